"""DeepSpeedStrategy: distributed setup, ZeRO configs, optimizer, schedule, reductions, weight gathering.

Its settings (:class:`StrategyConfig`, the ``auto`` ZeRO stage, the LR schedule, :class:`BatchPlan`) are in
:mod:`rl_core.strategy_config` and the DeepSpeed internals it reaches into in :mod:`rl_core.ds_internals`; both
are importable from here as before.

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

from rl_core.activation_checkpointing import select_checkpointed_layers
from rl_core.ds_config import deepspeed_config, muon_section, trainable_param_groups
from rl_core.ds_internals import _coalescible, _full_numel, _gather_bucket, _OneRankCoalescing, _skip_deepspeed_shm_comm
from rl_core.strategy_config import (  # re-exported: the settings live beside, the engine here
    GRAD_ACCUM_DTYPES,
    MUON_DEFAULTS,
    OPTIMIZERS,
    SCHEDULES,
    BatchPlan,
    StrategyConfig,
    auto_zero_stage,
    check_optimizer,
    lr_lambda,
)

__all__ = [
    "GRAD_ACCUM_DTYPES",
    "MUON_DEFAULTS",
    "OPTIMIZERS",
    "SCHEDULES",
    "BatchPlan",
    "DeepSpeedStrategy",
    "StrategyConfig",
    "auto_zero_stage",
    "check_optimizer",
    "lr_lambda",
    "seed_everything",
]

logger = logging.getLogger(__name__)
Tensor = torch.Tensor


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
            # lazy: import cycle (rl_core -> rl_core.rl.build -> rl_core.strategy -> rl_core)
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
                f"or a micro batch that divides it"
            )
        total = None
        if dataset_size is not None:
            total = max(1, dataset_size // c.train_batch_size) * epochs
        return BatchPlan(
            self.world_size, dp, c.micro_train_batch_size, c.train_batch_size // per_step, c.train_batch_size, total
        )

    # ----- DeepSpeed engine -------------------------------------------------------------

    def ds_config(self, *, train: bool = True, offload: bool = False) -> dict:
        """DeepSpeed's config: the training one, or with ``train=False`` a frozen model's, whose parameters
        ``offload`` keeps on the CPU (:func:`rl_core.ds_config.deepspeed_config`)."""
        return deepspeed_config(self.cfg, self.batch_plan, train=train, offload=offload)

    def param_groups(self, model: nn.Module) -> list[dict]:
        """The trainable parameters in two groups: decayed by --l2, and norms and biases, not decayed."""
        return trainable_param_groups(model, self.cfg.weight_decay)

    def muon_config(self) -> dict:
        """DeepSpeed's ``optimizer`` section for ``optim="muon"`` (:func:`rl_core.ds_config.muon_section`)."""
        return muon_section(self.cfg)

    def make_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        c = self.cfg
        groups = self.param_groups(model)
        if c.adam_offload:
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            return DeepSpeedCPUAdam(groups, lr=c.learning_rate, betas=c.adam_betas, eps=c.adam_eps)
        # fused on CUDA: one kernel over the fp32 weights and moments instead of foreach's dozen passes (estimated
        # 10 ms of a 0.5B SFT step on an H200); it checks the parameters' device at the first step, after DeepSpeed
        # moved them
        return torch.optim.AdamW(
            groups, lr=c.learning_rate, betas=c.adam_betas, eps=c.adam_eps, fused=self.device.type == "cuda"
        )

    def prepare(self, model: nn.Module, *, total_steps: int | None = None, train: bool = True, offload: bool = False):
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
                logger.warning(
                    "optim muon with max_norm %g: DeepSpeed clips after Newton-Schulz, so the norm is the "
                    "orthogonalised update's (about sqrt(sum of min(rows, cols))), as in OpenRLHF; "
                    "--max_norm 0 leaves Muon's step unclipped",
                    self.cfg.max_norm,
                )
            engine, *_ = deepspeed.initialize(
                model=model, model_parameters=self.param_groups(model), lr_scheduler=schedule, config=self.ds_config()
            )
        else:
            optim = self.make_optimizer(model)
            engine, *_ = deepspeed.initialize(
                model=model, optimizer=optim, lr_scheduler=schedule(optim), config=self.ds_config()
            )
        if self.cfg.zero_stage == 0 and self.world_size == 1:
            # one rank: DeepSpeed's all-reduce at each step's last backward would flatten every gradient into
            # buckets, reduce over nobody and copy it back (as it does when it runs without torch.distributed)
            engine.enable_backward_allreduce = False
        if _coalescible(self.cfg, self.world_size, engine):
            engine._rl_coalesce = _OneRankCoalescing(engine)
            logger.info(
                "ZeRO-2 on one rank: gradients reduced once per optimizer step, not per micro-batch "
                "(DeepSpeed's coalesce_grad_reduction)"
            )
        if self.cfg.gradient_checkpointing:
            inner = getattr(engine.module, "model", None) or getattr(engine.module, "body", None)
            if inner is not None and hasattr(inner, "gradient_checkpointing_enable"):
                # lazy: import cycle (rl_core -> rl_core.rl.build -> rl_core.strategy -> rl_core)
                from rl_core import ring_attention

                # a layer's recompute reads its checkpoint function at call time, so the per-layer choice below
                # holds for either mode (tests/test_core_activation_checkpointing.py, reentrant case)
                inner.gradient_checkpointing_enable(
                    gradient_checkpointing_kwargs=ring_attention.checkpoint_kwargs(
                        self.cfg.gradient_checkpointing_use_reentrant
                    )
                )

            what = select_checkpointed_layers(
                engine.module, self.cfg.gradient_checkpointing_layers, device=self.device, optimizer=engine.optimizer
            )
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

    def named_parameter_buckets(
        self, module: nn.Module, bucket_bytes: int = 256 << 20, dtype: torch.dtype | None = None
    ) -> Iterator[list[tuple[str, Tensor]]]:
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
