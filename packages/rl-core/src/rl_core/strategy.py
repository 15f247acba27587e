"""DeepSpeedStrategy: distributed setup, ZeRO configs, optimizer, schedule, reductions, weight gathering.

One object owns how a model trains across processes: it initialises
torch.distributed (NCCL on GPU, gloo on CPU; a single process needs no
launcher), derives the batch arithmetic (global batch = micro batch x
accumulation x data-parallel size) and fails on numbers that do not divide,
builds the DeepSpeed config (ZeRO 0-3, optimizer offload, bf16/fp32, clipping, and
the keys OpenRLHF passes through: overlap_comm, ZeRO++ hpZ, the gradient accumulation
dtype), seeds each process (optionally in transformers' full determinism mode),
wraps model + optimizer (AdamW, or DeepSpeed's Muon for the weight matrices) + LR
schedule into a DeepSpeed engine, and yields full named parameters in size-bounded
buckets even under ZeRO-3 (what HF export and weight sync to rollout engines
consume). Works the same in one process and under ``deepspeed`` / ``torchrun`` with
several.

Gradient accumulation is managed by DeepSpeed (``gradient_accumulation_steps``);
losses are normalised by the caller with a global count (rl_algos.aggregate_loss),
so :meth:`backward` passes ``scale_wrt_gas=False``: the sum over micro-batches
and the mean over ranks then give exactly the full-batch loss. A caller whose micro-batch
count varies (the RL workers' token budgets) marks each step's last one with
:meth:`accumulation_boundary`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import random
import socket
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from rl_rollout.config import check_numbers, meta

logger = logging.getLogger(__name__)
Tensor = torch.Tensor


OPTIMIZERS = ("adam", "muon")
MUON_DEFAULTS = {"muon_lr": 0.02, "muon_momentum": 0.95}  # OpenRLHF's --muon.lr, --muon.momentum


def check_optimizer(optim: str, muon_lr: float, muon_momentum: float, prefix: str = "") -> None:
    """The one-line refusals of the optimizer settings; ``prefix`` names another model's flags (``critic_``)."""
    if optim not in OPTIMIZERS:
        raise ValueError(f"unknown {prefix}optim {optim!r} (--{prefix}optim); valid: {', '.join(OPTIMIZERS)}")
    if not muon_lr >= 0:
        raise ValueError(f"{prefix}muon_lr (--{prefix}muon_lr) must be >= 0, got {muon_lr}")
    if not 0 <= muon_momentum < 1:
        raise ValueError(f"{prefix}muon_momentum (--{prefix}muon_momentum) must be in [0, 1), got {muon_momentum}")
    if optim != "muon":
        for name, value in (("muon_lr", muon_lr), ("muon_momentum", muon_momentum)):
            if value != MUON_DEFAULTS[name]:
                raise ValueError(f"{prefix}{name}={value} (--{prefix}{name}) is a setting of the Muon optimizer, not "
                                 f"of --{prefix}optim {optim}; add --{prefix}optim muon or drop --{prefix}{name}")


@dataclass(frozen=True)
class StrategyConfig:
    """Training-system settings (OpenRLHF flag names in comments are accepted by the CLI)."""

    zero_stage: int | None = field(default=None, metadata=meta(
        "DeepSpeed ZeRO stage: 0, 1, 2 or 3; unset (auto): 0 on one GPU (ZeRO partitions nothing there), else 2 "
        "(auto_zero_stage says why; --print_config shows the choice)"))
    bf16: bool = field(default=True, metadata=meta("params and compute in bf16 (fp32 master weights in the optimizer)"))
    adam_offload: bool = field(default=False, metadata=meta("optimizer states on CPU (DeepSpeedCPUAdam)"))
    micro_train_batch_size: int = field(default=1, metadata=meta("sequences per rank per forward"))
    train_batch_size: int = field(default=8, metadata=meta("sequences per optimizer step, all ranks"))
    max_norm: float = field(default=1.0, metadata=meta("gradient clipping (0 disables)"))
    learning_rate: float = field(default=1e-5, metadata=meta("peak learning rate (AdamW)"))
    min_lr_ratio: float = field(default=0.1, metadata=meta("cosine decays to learning_rate x min_lr_ratio"))
    lr_warmup_ratio: float = field(default=0.03, metadata=meta("share of the steps spent warming the learning rate up"))
    lr_scheduler: str = field(default="cosine_with_min_lr", metadata=meta(
        "cosine_with_min_lr | constant_with_warmup | constant"))
    weight_decay: float = field(default=0.0, metadata=meta("--l2"))
    adam_betas: tuple[float, float] = field(default=(0.9, 0.95), metadata=meta("AdamW betas B1 B2"))
    adam_eps: float = field(default=1e-8, metadata=meta("AdamW epsilon", openrlhf=("adam.eps", "actor.adam.eps")))
    optim: str = field(default="adam", metadata=meta(
        "adam: AdamW for every weight; muon: DeepSpeed's Muon (MuonWithAuxAdam, as OpenRLHF's --optim muon) for the "
        "2-D weight matrices whose names hold neither embed nor lm_head, AdamW (--learning_rate, --adam_betas, "
        "--adam_eps) for the rest; --l2 decays both, except norms and biases. Muon's update is clipped by "
        "--max_norm after orthogonalisation, as in OpenRLHF: use --max_norm 0. rl ppo / ppo-ray: the actor's "
        "(the critic's: --critic_optim)", openrlhf=("actor.optim",)))
    muon_lr: float = field(default=MUON_DEFAULTS["muon_lr"], metadata=meta(
        "with --optim muon: the Muon group's peak learning rate (the AdamW group's is --learning_rate; the "
        "schedule scales both)", openrlhf=("muon.lr", "actor.muon.lr")))
    muon_momentum: float = field(default=MUON_DEFAULTS["muon_momentum"], metadata=meta(
        "with --optim muon: Muon's Nesterov momentum (5 Newton-Schulz steps, fixed in DeepSpeed)",
        openrlhf=("muon.momentum", "actor.muon.momentum")))
    gradient_checkpointing: bool = field(default=False, metadata=meta("recompute activations in the backward pass (less memory)"))
    gradient_checkpointing_layers: str = field(default="all", metadata=meta(
        "with --gradient_checkpointing, which decoder layers recompute: all; N, the first N (0..layers); or auto, "
        "per training forward the fewest whose estimated activations fit the free device memory (CUDA; all on "
        "CPU). Formula: rl_core.activation_checkpointing"))
    gradient_checkpointing_use_reentrant: bool = field(default=False, metadata=meta(
        "with --gradient_checkpointing, torch's reentrant checkpoint (use_reentrant=True) instead of the "
        "non-reentrant one; either works with --gradient_checkpointing_layers",
        openrlhf=("model.gradient_checkpointing_reentrant", "actor.gradient_checkpointing_reentrant")))
    seed: int = field(default=42, metadata=meta("seed of the model init, data order and sampling"))
    full_determinism: bool = field(default=False, metadata=meta(
        "OpenRLHF's full determinism: transformers.enable_full_determinism(seed) in every training process "
        "(torch deterministic algorithms, cuDNN deterministic, CUBLAS_WORKSPACE_CONFIG, deterministic flash "
        "attention); rl ppo-ray's vLLM engines keep their engine core in process. Slower",
        openrlhf=("train.full_determinism_enable",)))
    zero_bucket_bytes: int = field(default=500_000_000, metadata=meta("ZeRO reduce / prefetch bucket size"))
    # DeepSpeed passthroughs, set in the training config as OpenRLHF's get_train_ds_config sets them
    overlap_comm: bool = field(default=False, metadata=meta(
        "DeepSpeed zero_optimization.overlap_comm and contiguous_gradients: overlap the gradient reduce with the "
        "backward (more memory for the buckets)", openrlhf=("ds.overlap_comm",)))
    zpg: int = field(default=1, metadata=meta(
        "ZeRO++ hierarchical partitioning (zero_hpz_partition_size): ZeRO-3 keeps a secondary copy of the "
        "weights partitioned over groups of this many ranks (a node's GPUs), so the forward's all-gathers stay "
        "inside the group; 1: off", openrlhf=("ds.zpg",)))
    grad_accum_dtype: str | None = field(default=None, metadata=meta(
        "DeepSpeed data_types.grad_accum_dtype: fp32 | bf16; default: the params' dtype, or fp32 inside the "
        "ZeRO optimizers", openrlhf=("ds.grad_accum_dtype",)))
    local_rank: int = field(default=-1, metadata=meta(
        "this process's rank on its node, as the deepspeed launcher passes it (--local_rank=N); launchers also "
        "export LOCAL_RANK, which wins; -1: from the environment (torchrun, Ray) or 0 alone"))
    use_ds_universal_ckpt: bool = field(default=False, metadata=meta(
        "resume through DeepSpeed's universal checkpoint (load_universal): at --load_checkpoint each role's saved "
        "ZeRO state is converted once (deepspeed.checkpoint.ds_to_universal, into ds_universal/ beside it) and "
        "loaded from there, so a run resumes on another number of ranks (weights, optimizer moments and step, "
        "schedule); ZeRO-1/2/3, not with LoRA", openrlhf=("ds.use_universal_ckpt",)))
    ring_attn_size: int = field(default=1, metadata=meta(
        "ring attention (sequence parallelism; rl ppo-ray, sft, rm, dpo, kto): groups of this many consecutive "
        "ranks (of every role) hold the same micro-batches and compute each row in that many slices, gathering "
        "keys and values in attention (rl_core.ring_attention); padded rows are packed first; data parallel "
        "size = ranks / ring_attn_size",
        openrlhf=("ds.ring_attn_size",)))
    ring_head_stride: int = field(default=1, metadata=meta(
        "with --ring_attn_size > 1, how many key/value heads each attention layer gathers at a time (more: fewer "
        "collectives, more memory); must divide the model's key/value heads", openrlhf=("ds.ring_attn_head_stride",)))

    def __post_init__(self) -> None:
        if self.zero_stage not in (None, 0, 1, 2, 3):
            raise ValueError(f"zero_stage must be 0, 1, 2 or 3 (or unset: auto), got {self.zero_stage!r}")
        for name in ("micro_train_batch_size", "train_batch_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.lr_scheduler not in SCHEDULES:
            raise ValueError(f"unknown lr_scheduler {self.lr_scheduler!r}; valid: {', '.join(SCHEDULES)}")
        if not 0 <= self.lr_warmup_ratio < 1:
            raise ValueError(f"lr_warmup_ratio must be in [0, 1), got {self.lr_warmup_ratio}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        # a learning rate of 0 is legitimate (a run that must not move the weights: evaluation, loss checks)
        check_numbers(self, positive=("zero_bucket_bytes",),
                      non_negative=("learning_rate", "max_norm", "weight_decay", "seed"))
        from rl_core.activation_checkpointing import parse_layers

        layers = parse_layers(self.gradient_checkpointing_layers)
        object.__setattr__(self, "gradient_checkpointing_layers", layers)  # canonical text: all, auto, "4"
        if layers != "all" and not self.gradient_checkpointing:
            raise ValueError(f"gradient_checkpointing_layers={layers} (--gradient_checkpointing_layers) picks which "
                             f"layers recompute once --gradient_checkpointing is on; add --gradient_checkpointing")
        self._check_deepspeed_passthroughs()
        check_optimizer(self.optim, self.muon_lr, self.muon_momentum)
        check_numbers(self, at_least_1=("ring_attn_size", "ring_head_stride"))
        if self.gradient_checkpointing_use_reentrant and not self.gradient_checkpointing:
            raise ValueError("gradient_checkpointing_use_reentrant (--gradient_checkpointing_use_reentrant) picks the "
                             "checkpoint mode once --gradient_checkpointing is on; add --gradient_checkpointing")
        if not all(0 <= b < 1 for b in self.adam_betas):
            raise ValueError(f"adam_betas (--adam_betas) must be two numbers in [0, 1), got {self.adam_betas}")


    def check_param_offload(self, flags: str) -> None:
        """A frozen model's parameters go to the CPU through ZeRO-3's ``offload_param`` only (OpenRLHF's
        get_eval_ds_config sets it at stage 0 too, where DeepSpeed ignores it): refuse the other stages."""
        if self.zero_stage != 3:
            raise ValueError(f"{flags}: a frozen model's parameters go to the CPU through DeepSpeed ZeRO-3 "
                             f"(offload_param), not at --zero_stage {self.zero_stage}; add --zero_stage 3 or drop "
                             f"the flag")

    def _check_deepspeed_passthroughs(self) -> None:
        check_numbers(self, positive=("adam_eps",), at_least_1=("zpg",))
        if isinstance(self.zpg, bool) or not isinstance(self.zpg, int):
            raise ValueError(f"zpg (--zpg) must be a whole number of ranks, got {self.zpg!r}")
        if self.zpg > 1 and self.zero_stage != 3:
            raise ValueError(f"zpg={self.zpg} (--zpg): ZeRO++ hierarchical partitioning partitions ZeRO-3's weights "
                             f"(DeepSpeed ignores it at stage {self.zero_stage}); add --zero_stage 3 or drop --zpg")
        if self.grad_accum_dtype not in (None, *GRAD_ACCUM_DTYPES):
            raise ValueError(f"grad_accum_dtype={self.grad_accum_dtype!r} (--grad_accum_dtype): valid: "
                             f"{', '.join(GRAD_ACCUM_DTYPES)} (fp16 training is not built), or leave it unset")
        params = "bf16" if self.bf16 else "fp32"
        if self.use_ds_universal_ckpt and self.zero_stage == 0:
            raise ValueError("use_ds_universal_ckpt (--use_ds_universal_ckpt): DeepSpeed's universal checkpoint is "
                             "made of a ZeRO optimizer's partitions; use --zero_stage 1, 2 or 3, or drop the flag")
        if self.zero_stage == 0 and self.grad_accum_dtype not in (None, params):
            raise ValueError(f"grad_accum_dtype={self.grad_accum_dtype} (--grad_accum_dtype) with {params} params needs "
                             f"a ZeRO optimizer (DeepSpeed: 'unsupported mix' at stage 0); use --zero_stage 1, 2 or 3, "
                             f"or --grad_accum_dtype {params}")


GRAD_ACCUM_DTYPES = ("fp32", "bf16")


def auto_zero_stage(cfg: StrategyConfig, *, cuda: bool, world_size: int, needs_zero: str | None = None
                    ) -> tuple[int, str]:
    """The stage an unset ``zero_stage`` (auto) resolves to, and why. ``needs_zero``: a flag of the caller's that
    needs a ZeRO optimizer (e.g. RL's --deepspeed_enable_sleep). Never 1 or 3: those trade speed for memory, a
    user's call. On one GPU stage 0 is as small as 2 (nothing to partition) and skips ZeRO's gradient buckets
    (benchmarks/grpo_vs_trl.py, docs/performance.md); on CPU runs keep stage 2, as before."""
    params = "bf16" if cfg.bf16 else "fp32"
    needs = needs_zero or ("--adam_offload" if cfg.adam_offload else "--use_ds_universal_ckpt"
                           if cfg.use_ds_universal_ckpt else f"--grad_accum_dtype {cfg.grad_accum_dtype}"
                           if cfg.grad_accum_dtype not in (None, params) else None)
    if needs:
        return 2, f"{needs} needs a ZeRO optimizer"
    if not cuda:
        return 2, "no CUDA device: stage 2 as before on CPU, where its one-rank path reduces once per step"
    if world_size > 1:
        return 2, f"{world_size} data-parallel ranks: optimizer states and gradients partitioned over them"
    return 0, "one GPU: ZeRO partitions nothing there, and stage 0 skips its gradient buckets"
SCHEDULES = ("cosine_with_min_lr", "constant_with_warmup", "constant")


def lr_lambda(schedule: str, total_steps: int, warmup_steps: int, min_lr_ratio: float):
    """Multiplier of the base LR at optimizer step ``s`` (linear warmup, then the schedule)."""

    def f(s: int) -> float:
        if s < warmup_steps:
            return (s + 1) / (warmup_steps + 1)
        if schedule == "constant" or schedule == "constant_with_warmup":
            return 1.0
        progress = min(1.0, (s - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


def seed_everything(seed: int, *, full_determinism: bool = False) -> None:
    """Seed python, numpy and torch; with ``full_determinism`` as OpenRLHF's ``--full_determinism`` does
    (``DeepspeedStrategy.setup_distributed``): ``transformers.enable_full_determinism(seed)``, which also turns on
    torch's deterministic algorithms (an op without one raises), cuDNN's deterministic mode and the environment
    that cuBLAS and flash attention read."""
    if full_determinism:
        import transformers

        transformers.enable_full_determinism(seed)
    DeepSpeedStrategy.set_seed(seed)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class BatchPlan:
    """The batch arithmetic every run prints before it starts."""

    world_size: int
    dp_size: int
    micro_batch: int
    accumulation_steps: int
    global_batch: int
    total_steps: int | None = None

    def describe(self) -> str:
        steps = "" if self.total_steps is None else f", total optimizer steps {self.total_steps}"
        ring = "" if self.world_size == self.dp_size else \
            f" (ring attention: {self.world_size // self.dp_size} ranks per data-parallel slice)"
        return (f"global batch {self.global_batch} = micro batch {self.micro_batch} x accumulation "
                f"{self.accumulation_steps} x data parallel {self.dp_size}{ring}{steps}")


@dataclass
class DeepSpeedStrategy:
    cfg: StrategyConfig = field(default_factory=StrategyConfig)

    def __post_init__(self) -> None:
        self._initialized = False
        if self.cfg.zero_stage is None:  # auto, where no builder resolved it (rl sft / rm / dpo / kto)
            world = int(os.environ.get("WORLD_SIZE", "1"))  # the launcher's (deepspeed, torchrun, Ray groups)
            stage, why = auto_zero_stage(self.cfg, cuda=torch.cuda.is_available(), world_size=world)
            self.cfg = dataclasses.replace(self.cfg, zero_stage=stage)
            if int(os.environ.get("RANK", "0")) == 0:
                logger.info("zero_stage auto: %d (%s)", stage, why)

    # ----- processes --------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        if torch.cuda.is_available():
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        return torch.device("cpu")

    def setup_distributed(self) -> None:
        """Join (or create) the default process group; a lone process makes a world of 1."""
        if self._initialized:
            return
        import deepspeed

        if self.cfg.local_rank >= 0:  # deepspeed --module passes --local_rank=N (and exports LOCAL_RANK)
            os.environ.setdefault("LOCAL_RANK", str(self.cfg.local_rank))
        if "RANK" not in os.environ:  # no launcher: a world of one
            os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(_free_port()))
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        seed_everything(self.cfg.seed, full_determinism=self.cfg.full_determinism)  # before CUDA starts (cuBLAS env)
        if torch.cuda.is_available():
            torch.cuda.set_device(self.device)
        if not dist.is_initialized():
            # A world that an earlier run in this process destroyed (vLLM's in-process engine tears down the default
            # group at close) leaves DeepSpeed's clone of it cached; the next prepare() would fail with "Group ... is
            # not registered". The clone belongs to the world, so a new world starts without it.
            from deepspeed.utils import groups as ds_groups

            if getattr(ds_groups, "_WORLD_GROUP", None) is not None:
                ds_groups._WORLD_GROUP = None
            if backend == "gloo" and os.environ.get("RL_DS_SHM_COMM") != "1":
                _skip_deepspeed_shm_comm()
            deepspeed.init_distributed(dist_backend=backend)
        if self.cfg.ring_attn_size > 1:
            from rl_core import ring_attention

            ring_attention.setup(self.cfg.ring_attn_size, self.cfg.ring_head_stride)
        self._initialized = True
        logger.info("distributed: backend %s, rank %d of %d", backend, self.rank, self.world_size)

    @property
    def rank(self) -> int:
        return dist.get_rank() if dist.is_initialized() else 0

    @property
    def world_size(self) -> int:
        return dist.get_world_size() if dist.is_initialized() else 1

    def is_rank_0(self) -> bool:
        return self.rank == 0

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks: the world over the ring attention groups (each group holds the same data)."""
        return self.world_size // self.cfg.ring_attn_size

    @property
    def ring_rank(self) -> int:
        """This rank's place in its ring attention group (0 without ring attention)."""
        return self.rank % self.cfg.ring_attn_size

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel slice: its ring attention group's index (the rank without ring attention)."""
        return self.rank // self.cfg.ring_attn_size

    def dp_sum(self, value):
        """The sum over data-parallel slices of a value every rank of a ring attention group holds alike (counts,
        per-row results): the sum over all ranks counts each slice ``ring_attn_size`` times."""
        out = self.all_reduce(value, "sum")
        return out if self.cfg.ring_attn_size == 1 else out / self.cfg.ring_attn_size

    def barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier()

    @staticmethod
    def set_seed(seed: int) -> None:
        random.seed(seed)
        torch.manual_seed(seed)
        try:
            import numpy as np

            np.random.seed(seed)
        except ImportError:
            pass

    def batch_plan(self, dataset_size: int | None = None, epochs: int = 1) -> BatchPlan:
        c, dp = self.cfg, self.dp_size
        per_step = c.micro_train_batch_size * dp
        if c.train_batch_size % per_step:
            fit = max(per_step, round(c.train_batch_size / per_step) * per_step)
            raise ValueError(
                f"train_batch_size {c.train_batch_size} is not divisible by micro_train_batch_size "
                f"{c.micro_train_batch_size} x data-parallel size {dp} = {per_step}; use train_batch_size {fit} "
                f"or a micro batch that divides it")
        total = None
        if dataset_size is not None:
            total = max(1, dataset_size // c.train_batch_size) * epochs
        return BatchPlan(self.world_size, dp, c.micro_train_batch_size, c.train_batch_size // per_step,
                         c.train_batch_size, total)

    # ----- DeepSpeed engine -------------------------------------------------------------

    def ds_config(self, *, train: bool = True, offload: bool = False) -> dict:
        """DeepSpeed's config: the training one, or with ``train=False`` a frozen model's (OpenRLHF's
        get_eval_ds_config: ZeRO-3 when training runs it, else stage 0), whose parameters ``offload`` keeps on
        the CPU (ZeRO-3's offload_param, as OpenRLHF's --ref.offload / --reward.offload)."""
        c = self.cfg
        if offload and train:
            raise ValueError("offload=True is for frozen models (train=False); trained ones offload their "
                             "optimizer states: --adam_offload")
        if offload:
            c.check_param_offload("--ref_offload / --reward_offload")
        plan = self.batch_plan()
        zero: dict = {"stage": c.zero_stage if train else (3 if c.zero_stage == 3 else 0),
                      "reduce_bucket_size": c.zero_bucket_bytes, "allgather_bucket_size": c.zero_bucket_bytes}
        if zero["stage"] in (1, 2):
            # the contiguous gradient buffer serves the reduce over ranks; alone, it is one more copy of
            # every gradient per step (SFT benchmark, one process: ZeRO-1 1.19x -> 1.05x a plain loop)
            zero["contiguous_gradients"] = plan.dp_size > 1
        if c.zero_stage == 3:
            zero.update(stage3_prefetch_bucket_size=c.zero_bucket_bytes, stage3_param_persistence_threshold=10_000,
                        stage3_gather_16bit_weights_on_model_save=True)
        if offload:
            zero["offload_param"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
        if train and c.adam_offload:
            zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
        extra = {}
        if train:  # OpenRLHF's get_train_ds_config (its eval config has none of these)
            if c.overlap_comm:
                zero.update(overlap_comm=True, contiguous_gradients=True)
            if c.zpg > 1:
                zero["zero_hpz_partition_size"] = c.zpg
            if c.grad_accum_dtype is not None:
                extra["data_types"] = {"grad_accum_dtype": c.grad_accum_dtype}
            if c.use_ds_universal_ckpt:  # as OpenRLHF's get_train_ds_config; rl_core.checkpoint converts at load
                extra["checkpoint"] = {"load_universal": True}
            if c.optim == "muon":
                extra["optimizer"] = self.muon_config()
                if c.zero_stage == 3:  # DeepSpeed: "Muon and reduce scatter cannot be used together"
                    zero["reduce_scatter"] = False
        return {**extra,
            "train_micro_batch_size_per_gpu": plan.micro_batch,
            "gradient_accumulation_steps": plan.accumulation_steps,
            # DeepSpeed counts every rank as data parallel: a ring group's ranks are replicas of one slice
            "train_batch_size": plan.global_batch * c.ring_attn_size,
            "gradient_clipping": c.max_norm if c.max_norm > 0 else 0.0,
            "zero_optimization": zero,
            "bf16": {"enabled": c.bf16},
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 10**9,
            "wall_clock_breakdown": False,
            # DeepSpeed's throughput timer (on by default) synchronises the whole device at every forward and every
            # step() to time a samples/s figure nobody prints here: the host then waits for the GPU twice per
            # micro-batch and the GPU idles while the next one is launched (a third of the policy's training call
            # at the 0.5B shape on an H100, docs/performance.md)
            "timers": {"throughput": {"enabled": False, "synchronized": False}},
        }

    def param_groups(self, model: nn.Module) -> list[dict]:
        """The trainable parameters in two groups: decayed by --l2, and norms and biases, not decayed."""
        decay, no_decay = [], []
        for name, p in model.named_parameters():
            if p.requires_grad:
                (no_decay if p.ndim < 2 or "norm" in name.lower() or name.endswith(".bias") else decay).append(p)
        groups = [{"params": decay, "weight_decay": self.cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        groups = [g for g in groups if g["params"]]
        if not groups:
            raise ValueError("the model has no trainable parameters (all requires_grad=False): nothing to train")
        return groups

    def muon_config(self) -> dict:
        """DeepSpeed's ``optimizer`` section for ``optim="muon"``, as OpenRLHF's ``_ds_init_train_model`` writes it
        (Muon: Jordan et al. 2024, kellerjordan.github.io/posts/muon; at LLM scale: Liu et al. 2025,
        arXiv:2502.16982).

        ``deepspeed.initialize`` then tags each parameter (``use_muon``: 2-D, name without ``embed`` /
        ``lm_head``) and builds ``MuonWithAuxAdam``, splitting each of :meth:`param_groups` into a Muon half
        (``muon_lr``, ``momentum``) and an AdamW half (``adam_lr``, ``betas``, ``eps``); a group's own
        ``weight_decay`` applies to both halves. DeepSpeed runs Newton-Schulz with 5 steps and Nesterov
        momentum (neither is configurable there). The AdamW half is torch's AdamW, as our ``adam`` path's, or
        DeepSpeedCPUAdam with ``adam_offload``."""
        c = self.cfg
        params = {"lr": c.muon_lr, "muon_lr": c.muon_lr, "adam_lr": c.learning_rate, "momentum": c.muon_momentum,
                  "betas": list(c.adam_betas), "eps": c.adam_eps, "weight_decay": c.weight_decay}
        if not c.adam_offload:
            params["torch_adam"] = True  # instead of DeepSpeed's FusedAdam, a CUDA op built at first use
        return {"type": "Muon", "params": params}

    def make_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        c = self.cfg
        groups = self.param_groups(model)
        if c.adam_offload:
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            return DeepSpeedCPUAdam(groups, lr=c.learning_rate, betas=c.adam_betas, eps=c.adam_eps)
        # fused on CUDA: one kernel over the fp32 weights and moments instead of foreach's dozen passes (estimated
        # 10 ms of a 0.5B SFT step on an H200); it checks the parameters' device at the first step, after DeepSpeed
        # moved them
        return torch.optim.AdamW(groups, lr=c.learning_rate, betas=c.adam_betas, eps=c.adam_eps,
                                 fused=self.device.type == "cuda")

    def prepare(self, model: nn.Module, *, total_steps: int | None = None, train: bool = True,
                offload: bool = False):
        """Wrap ``model`` in a DeepSpeed engine; with ``train`` also the optimizer (AdamW or Muon) and LR schedule.

        ``total_steps`` (optimizer steps) sizes the warmup and cosine schedule.
        Frozen models (reference, reward) use ``train=False``: ZeRO-3 still
        partitions them (``offload``: on the CPU, gathered layer by layer for each
        forward); other stages keep a plain copy on the device.
        """
        import deepspeed

        self.setup_distributed()
        model = model.to(torch.bfloat16 if self.cfg.bf16 else torch.float32)
        if not train:
            engine, *_ = deepspeed.initialize(model=model, config=self.ds_config(train=False, offload=offload))
            engine.eval()
            return engine
        if total_steps is None or total_steps < 1:
            raise ValueError(f"prepare(train=True) needs total_steps >= 1 for the LR schedule, got {total_steps!r}")
        warmup = math.ceil(self.cfg.lr_warmup_ratio * total_steps)
        factor = lr_lambda(self.cfg.lr_scheduler, total_steps, warmup, self.cfg.min_lr_ratio)

        def schedule(optim):  # each group's own peak learning rate times the factor (Muon's and AdamW's)
            return torch.optim.lr_scheduler.LambdaLR(optim, factor)

        if self.cfg.optim == "muon":  # DeepSpeed builds it from the config's optimizer section (muon_config)
            if self.cfg.max_norm > 0 and self.is_rank_0():
                logger.warning("optim muon with max_norm %g: DeepSpeed clips after Newton-Schulz, so the norm is the "
                               "orthogonalised update's (about sqrt(sum of min(rows, cols))), as in OpenRLHF; "
                               "--max_norm 0 leaves Muon's step unclipped", self.cfg.max_norm)
            engine, *_ = deepspeed.initialize(model=model, model_parameters=self.param_groups(model),
                                              lr_scheduler=schedule, config=self.ds_config())
        else:
            optim = self.make_optimizer(model)
            engine, *_ = deepspeed.initialize(model=model, optimizer=optim, lr_scheduler=schedule(optim),
                                              config=self.ds_config())
        if self.cfg.zero_stage == 0 and self.world_size == 1:
            # one rank: DeepSpeed's all-reduce at each step's last backward would flatten every gradient into
            # buckets, reduce over nobody and copy it back (as it does when it runs without torch.distributed)
            engine.enable_backward_allreduce = False
        if _coalescible(self.cfg, self.world_size, engine):
            engine._rl_coalesce = _OneRankCoalescing(engine)
            logger.info("ZeRO-2 on one rank: gradients reduced once per optimizer step, not per micro-batch "
                        "(DeepSpeed's coalesce_grad_reduction)")
        if self.cfg.gradient_checkpointing:
            inner = getattr(engine.module, "model", None) or getattr(engine.module, "body", None)
            if inner is not None and hasattr(inner, "gradient_checkpointing_enable"):
                # a layer's recompute reads its checkpoint function at call time, so the per-layer choice below
                # holds for either mode (tests/test_core_activation_checkpointing.py, reentrant case)
                inner.gradient_checkpointing_enable(gradient_checkpointing_kwargs={
                    "use_reentrant": self.cfg.gradient_checkpointing_use_reentrant})
            from rl_core.activation_checkpointing import select_checkpointed_layers

            what = select_checkpointed_layers(engine.module, self.cfg.gradient_checkpointing_layers,
                                              device=self.device, optimizer=engine.optimizer)
            if self.is_rank_0():
                logger.info("gradient checkpointing: %s", what)
        return engine

    @staticmethod
    def backward(loss: Tensor, engine) -> None:
        """Backward of an already globally normalised loss (no extra 1/accumulation)."""
        coalesce = getattr(engine, "_rl_coalesce", None)
        if coalesce is not None:
            coalesce.open()
        engine.backward(loss, scale_wrt_gas=False)

    @staticmethod
    def accumulation_boundary(engine, last: bool) -> None:
        """Say, before a micro-batch's forward, whether it is the last of its optimizer step. Callers whose
        micro-batch count varies per step (token budgets) set it by hand instead of DeepSpeed counting
        ``gradient_accumulation_steps``; every data-parallel rank must run as many micro-batches."""
        engine.set_gradient_accumulation_boundary(last)

    @staticmethod
    def optimizer_step(engine) -> bool:
        """DeepSpeed steps the optimizer and schedule only at accumulation boundaries; says if it did."""
        coalesce = getattr(engine, "_rl_coalesce", None)
        if coalesce is not None:
            return coalesce.step()
        boundary = engine.is_gradient_accumulation_boundary()
        engine.step()
        return boundary

    # ----- reductions ---------------------------------------------------------------------

    def all_reduce(self, value, op: str = "mean"):
        """Reduce a tensor, a float or a dict of them over ranks (``mean``, ``sum``, ``max``)."""
        if isinstance(value, dict):
            keys = sorted(value)
            flat = self.all_reduce(torch.tensor([float(value[k]) for k in keys], dtype=torch.float64), op)
            return {k: flat[i].item() for i, k in enumerate(keys)}
        is_tensor = isinstance(value, torch.Tensor)
        t = value.detach().clone() if is_tensor else torch.tensor(float(value), dtype=torch.float64)
        if dist.is_initialized() and self.world_size > 1:
            dev = t.device
            t = t.to(self.device)
            if op not in ("mean", "sum", "max"):
                raise ValueError(f"unknown reduce op {op!r}; valid: mean, sum, max")
            dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
            if op == "mean":
                t = t / self.world_size
            t = t.to(dev)
        return t if is_tensor else t.item()

    # ----- full weights ---------------------------------------------------------------------

    def named_parameter_buckets(self, module: nn.Module, bucket_bytes: int = 256 << 20,
                                dtype: torch.dtype | None = None) -> Iterator[list[tuple[str, Tensor]]]:
        """Yield ``[(name, full tensor), ...]`` lists of at most ``bucket_bytes`` (one tensor may exceed it).

        Under ZeRO-3 each bucket's partitioned parameters are gathered together
        (every rank must iterate: the gather is a collective) and copied out, so
        peak extra memory is one bucket. Tensors are detached copies on the
        parameter's device, cast to ``dtype`` when given. Buffers are not included.
        """
        params = list(module.named_parameters())
        bucket: list[tuple[str, nn.Parameter]] = []
        size = 0
        for name, p in params:
            nbytes = _full_numel(p) * p.element_size()
            if bucket and size + nbytes > bucket_bytes:
                yield _gather_bucket(bucket, dtype)
                bucket, size = [], 0
            bucket.append((name, p))
            size += nbytes
        if bucket:
            yield _gather_bucket(bucket, dtype)

    def full_state_dict(self, module: nn.Module, dtype: torch.dtype | None = None) -> dict[str, Tensor]:
        """Every parameter (gathered under ZeRO-3) and buffer, on CPU. Collective: call on every rank."""
        state = {}
        for bucket in self.named_parameter_buckets(module, dtype=dtype):
            state.update({n: t.cpu() for n, t in bucket})
        persistent = set(module.state_dict())  # non-persistent buffers (rotary inv_freq) are not weights
        for n, b in module.named_buffers():
            if n in persistent:
                state[n] = b.detach().cpu()
        return state


def _gather_bucket(bucket: list[tuple[str, nn.Parameter]], dtype: torch.dtype | None) -> list[tuple[str, Tensor]]:
    zero3 = [p for _, p in bucket if hasattr(p, "ds_id")]
    gathered = contextlib.nullcontext()
    if zero3:
        import deepspeed

        gathered = deepspeed.zero.GatheredParameters(zero3, modifier_rank=None)
    with gathered:
        return [(n, p.detach().clone().to(dtype or p.dtype)) for n, p in bucket]


def _coalescible(cfg: StrategyConfig, world_size: int, engine) -> bool:
    """ZeRO-2 alone (one rank, no ring group): reduce each step's gradients once instead of per micro-batch."""
    params_dtype = "bf16" if cfg.bf16 else "fp32"
    return (world_size == 1 and cfg.zero_stage == 2 and not cfg.adam_offload and not cfg.overlap_comm
            and cfg.grad_accum_dtype in (None, params_dtype) and hasattr(engine, "coalesce_grad_reduction")
            and hasattr(engine.optimizer, "_coalesce_grad_reduction"))


class _OneRankCoalescing:
    """ZeRO-2 on one rank partitions nothing, yet DeepSpeed reduces every micro-batch's gradients into its
    partition buffer (flatten, reduce over nobody, copy back: one pass over every gradient per micro-batch,
    7% of the policy's train step on CPU against stage 0). DeepSpeed's own ``coalesce_grad_reduction`` holds
    the gradients on the parameters across a step's micro-batches (autograd accumulates them, in the
    parameters' dtype as ZeRO-2's buffer does) and reduces once at the boundary: the same sums, one pass.

    The block spans a step's backwards: opened by the first, closed (the one reduction) just before the
    boundary's ``engine.step()``, which may not run inside it; off the boundary the micro-step DeepSpeed's
    ``step()`` would count is counted here, and a boundary the caller set by hand
    (:meth:`DeepSpeedStrategy.accumulation_boundary`) survives the block's exit."""

    def __init__(self, engine):
        self.engine = engine
        self.block = None

    def open(self) -> None:
        if self.block is None:
            self.block = self.engine.coalesce_grad_reduction()
            self.block.__enter__()

    def step(self) -> bool:
        e = self.engine
        if not e.is_gradient_accumulation_boundary():
            e.micro_steps += 1  # what engine.step() does off the boundary
            return False
        block, self.block = self.block, None
        if block is not None:
            manual = e._is_gradient_accumulation_boundary  # the exit restores the flag it saw on entry
            block.__exit__(None, None, None)
            e._is_gradient_accumulation_boundary = manual
        e.step()
        return True


def _skip_deepspeed_shm_comm() -> None:
    """On CPU DeepSpeed's comm backend JIT-builds a shared-memory all-reduce op (C++, torch's extension cache) in
    every new process and venv: tens of seconds the first time in each venv (a test run's subprocesses, Ray
    actors, ``rl demo`` on a fresh machine), and rebuilt whenever another venv built it last (the cache is keyed
    by Python and torch, not venv). gloo does the all-reduce without it; ``RL_DS_SHM_COMM=1`` keeps DeepSpeed's."""
    import importlib

    # (not `import deepspeed.comm.torch as m`: that reads the attribute `torch` of deepspeed.comm, the torch module)
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None


def _full_numel(p: nn.Parameter) -> int:
    return p.ds_numel if hasattr(p, "ds_numel") else p.numel()
