"""The training strategy's settings: ``StrategyConfig`` (ZeRO stage, precision, optimizer, schedule, batch
sizes, the DeepSpeed keys OpenRLHF passes through), their one-line checks, the ``auto`` ZeRO stage, the LR
schedule and the batch arithmetic every run prints (:class:`BatchPlan`). Plain data and arithmetic: no
torch.distributed or DeepSpeed here; :mod:`rl_core.strategy` builds the engine from them (and re-exports
these names)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from rl_rollout.config_fields import check_numbers, meta

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
                raise ValueError(
                    f"{prefix}{name}={value} (--{prefix}{name}) is a setting of the Muon optimizer, not "
                    f"of --{prefix}optim {optim}; add --{prefix}optim muon or drop --{prefix}{name}"
                )


@dataclass(frozen=True)
class StrategyConfig:
    """Training-system settings (OpenRLHF flag names in comments are accepted by the CLI)."""

    zero_stage: int | None = field(
        default=None,
        metadata=meta(
            "DeepSpeed ZeRO stage: 0, 1, 2 or 3; unset (auto): 0 on one GPU (ZeRO partitions nothing there), else 2 "
            "(auto_zero_stage says why; --print_config shows the choice)"
        ),
    )
    bf16: bool = field(default=True, metadata=meta("params and compute in bf16 (fp32 master weights in the optimizer)"))
    adam_offload: bool = field(default=False, metadata=meta("optimizer states on CPU (DeepSpeedCPUAdam)"))
    micro_train_batch_size: int = field(default=1, metadata=meta("sequences per rank per forward"))
    train_batch_size: int = field(default=8, metadata=meta("sequences per optimizer step, all ranks"))
    max_norm: float = field(default=1.0, metadata=meta("gradient clipping (0 disables)"))
    learning_rate: float = field(default=1e-5, metadata=meta("peak learning rate (AdamW)"))
    min_lr_ratio: float = field(default=0.1, metadata=meta("cosine decays to learning_rate x min_lr_ratio"))
    lr_warmup_ratio: float = field(default=0.03, metadata=meta("share of the steps spent warming the learning rate up"))
    lr_scheduler: str = field(
        default="cosine_with_min_lr", metadata=meta("cosine_with_min_lr | constant_with_warmup | constant")
    )
    weight_decay: float = field(default=0.0, metadata=meta("--l2"))
    adam_betas: tuple[float, float] = field(default=(0.9, 0.95), metadata=meta("AdamW betas B1 B2"))
    adam_eps: float = field(default=1e-8, metadata=meta("AdamW epsilon", openrlhf=("adam.eps", "actor.adam.eps")))
    optim: str = field(
        default="adam",
        metadata=meta(
            "adam: AdamW for every weight; muon: DeepSpeed's Muon (MuonWithAuxAdam, as OpenRLHF's --optim muon) for the "
            "2-D weight matrices whose names hold neither embed nor lm_head, AdamW (--learning_rate, --adam_betas, "
            "--adam_eps) for the rest; --l2 decays both, except norms and biases. Muon's update is clipped by "
            "--max_norm after orthogonalisation, as in OpenRLHF: use --max_norm 0. rl ppo / ppo-ray: the actor's "
            "(the critic's: --critic_optim)",
            openrlhf=("actor.optim",),
        ),
    )
    muon_lr: float = field(
        default=MUON_DEFAULTS["muon_lr"],
        metadata=meta(
            "with --optim muon: the Muon group's peak learning rate (the AdamW group's is --learning_rate; the "
            "schedule scales both)",
            openrlhf=("muon.lr", "actor.muon.lr"),
        ),
    )
    muon_momentum: float = field(
        default=MUON_DEFAULTS["muon_momentum"],
        metadata=meta(
            "with --optim muon: Muon's Nesterov momentum (5 Newton-Schulz steps, fixed in DeepSpeed)",
            openrlhf=("muon.momentum", "actor.muon.momentum"),
        ),
    )
    gradient_checkpointing: bool = field(
        default=False, metadata=meta("recompute activations in the backward pass (less memory)")
    )
    gradient_checkpointing_layers: str = field(
        default="all",
        metadata=meta(
            "with --gradient_checkpointing, which decoder layers recompute: all; N, the first N (0..layers); or auto, "
            "per training forward the fewest whose estimated activations fit the free device memory (CUDA; all on "
            "CPU). Formula: rl_core.activation_checkpointing"
        ),
    )
    gradient_checkpointing_use_reentrant: bool = field(
        default=False,
        metadata=meta(
            "with --gradient_checkpointing, torch's reentrant checkpoint (use_reentrant=True) instead of the "
            "non-reentrant one; either works with --gradient_checkpointing_layers",
            openrlhf=("model.gradient_checkpointing_reentrant", "actor.gradient_checkpointing_reentrant"),
        ),
    )
    seed: int = field(default=42, metadata=meta("seed of the model init, data order and sampling"))
    full_determinism: bool = field(
        default=False,
        metadata=meta(
            "OpenRLHF's full determinism: transformers.enable_full_determinism(seed) in every training process "
            "(torch deterministic algorithms, cuDNN deterministic, CUBLAS_WORKSPACE_CONFIG, deterministic flash "
            "attention); rl ppo-ray's vLLM engines keep their engine core in process. Slower",
            openrlhf=("train.full_determinism_enable",),
        ),
    )
    zero_bucket_bytes: int = field(default=500_000_000, metadata=meta("ZeRO reduce / prefetch bucket size"))
    # DeepSpeed passthroughs, set in the training config as OpenRLHF's get_train_ds_config sets them
    overlap_comm: bool = field(
        default=False,
        metadata=meta(
            "DeepSpeed zero_optimization.overlap_comm and contiguous_gradients: overlap the gradient reduce with the "
            "backward (more memory for the buckets)",
            openrlhf=("ds.overlap_comm",),
        ),
    )
    zpg: int = field(
        default=1,
        metadata=meta(
            "ZeRO++ hierarchical partitioning (zero_hpz_partition_size): ZeRO-3 keeps a secondary copy of the "
            "weights partitioned over groups of this many ranks (a node's GPUs), so the forward's all-gathers stay "
            "inside the group; 1: off",
            openrlhf=("ds.zpg",),
        ),
    )
    grad_accum_dtype: str | None = field(
        default=None,
        metadata=meta(
            "DeepSpeed data_types.grad_accum_dtype: fp32 | bf16; default: the params' dtype, or fp32 inside the "
            "ZeRO optimizers",
            openrlhf=("ds.grad_accum_dtype",),
        ),
    )
    local_rank: int = field(
        default=-1,
        metadata=meta(
            "this process's rank on its node, as the deepspeed launcher passes it (--local_rank=N); launchers also "
            "export LOCAL_RANK, which wins; -1: from the environment (torchrun, Ray) or 0 alone"
        ),
    )
    use_ds_universal_ckpt: bool = field(
        default=False,
        metadata=meta(
            "resume through DeepSpeed's universal checkpoint (load_universal): at --load_checkpoint each role's saved "
            "ZeRO state is converted once (deepspeed.checkpoint.ds_to_universal, into ds_universal/ beside it) and "
            "loaded from there, so a run resumes on another number of ranks (weights, optimizer moments and step, "
            "schedule); ZeRO-1/2/3, not with LoRA",
            openrlhf=("ds.use_universal_ckpt",),
        ),
    )
    ring_attn_size: int = field(
        default=1,
        metadata=meta(
            "ring attention (sequence parallelism; rl ppo-ray, sft, rm, dpo, kto): groups of this many consecutive "
            "ranks (of every role) hold the same micro-batches and compute each row in that many slices, gathering "
            "keys and values in attention (rl_core.ring_attention); padded rows are packed first; data parallel "
            "size = ranks / ring_attn_size",
            openrlhf=("ds.ring_attn_size",),
        ),
    )
    ring_head_stride: int = field(
        default=1,
        metadata=meta(
            "with --ring_attn_size > 1, how many key/value heads each attention layer gathers at a time (more: fewer "
            "collectives, more memory); must divide the model's key/value heads",
            openrlhf=("ds.ring_attn_head_stride",),
        ),
    )

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
        check_numbers(
            self, positive=("zero_bucket_bytes",), non_negative=("learning_rate", "max_norm", "weight_decay", "seed")
        )

        # lazy: it imports torch; rl ppo --help builds its flags from this class without it
        from rl_core.activation_checkpointing import parse_layers

        layers = parse_layers(self.gradient_checkpointing_layers)
        object.__setattr__(self, "gradient_checkpointing_layers", layers)  # canonical text: all, auto, "4"
        if layers != "all" and not self.gradient_checkpointing:
            raise ValueError(
                f"gradient_checkpointing_layers={layers} (--gradient_checkpointing_layers) picks which "
                f"layers recompute once --gradient_checkpointing is on; add --gradient_checkpointing"
            )
        self._check_deepspeed_passthroughs()
        check_optimizer(self.optim, self.muon_lr, self.muon_momentum)
        check_numbers(self, at_least_1=("ring_attn_size", "ring_head_stride"))
        if self.gradient_checkpointing_use_reentrant and not self.gradient_checkpointing:
            raise ValueError(
                "gradient_checkpointing_use_reentrant (--gradient_checkpointing_use_reentrant) picks the "
                "checkpoint mode once --gradient_checkpointing is on; add --gradient_checkpointing"
            )
        if self.gradient_checkpointing_use_reentrant and self.ring_attn_size > 1:
            raise ValueError(
                f"--gradient_checkpointing_use_reentrant with --ring_attn_size {self.ring_attn_size}: the reentrant "
                "recompute runs without the ring's shard of the row; drop --gradient_checkpointing_use_reentrant "
                "(the default, non-reentrant mode recomputes the same ring attention)"
            )
        if not all(0 <= b < 1 for b in self.adam_betas):
            raise ValueError(f"adam_betas (--adam_betas) must be two numbers in [0, 1), got {self.adam_betas}")

    def check_param_offload(self, flags: str) -> None:
        """A frozen model's parameters go to the CPU through ZeRO-3's ``offload_param`` only (OpenRLHF's
        get_eval_ds_config sets it at stage 0 too, where DeepSpeed ignores it): refuse the other stages."""
        if self.zero_stage != 3:
            raise ValueError(
                f"{flags}: a frozen model's parameters go to the CPU through DeepSpeed ZeRO-3 "
                f"(offload_param), not at --zero_stage {self.zero_stage}; add --zero_stage 3 or drop "
                f"the flag"
            )

    def _check_deepspeed_passthroughs(self) -> None:
        check_numbers(self, positive=("adam_eps",), at_least_1=("zpg",))
        if isinstance(self.zpg, bool) or not isinstance(self.zpg, int):
            raise ValueError(f"zpg (--zpg) must be a whole number of ranks, got {self.zpg!r}")
        if self.zpg > 1 and self.zero_stage != 3:
            raise ValueError(
                f"zpg={self.zpg} (--zpg): ZeRO++ hierarchical partitioning partitions ZeRO-3's weights "
                f"(DeepSpeed ignores it at stage {self.zero_stage}); add --zero_stage 3 or drop --zpg"
            )
        if self.grad_accum_dtype not in (None, *GRAD_ACCUM_DTYPES):
            raise ValueError(
                f"grad_accum_dtype={self.grad_accum_dtype!r} (--grad_accum_dtype): valid: "
                f"{', '.join(GRAD_ACCUM_DTYPES)} (fp16 training is not built), or leave it unset"
            )
        params = "bf16" if self.bf16 else "fp32"
        if self.use_ds_universal_ckpt and self.zero_stage == 0:
            raise ValueError(
                "use_ds_universal_ckpt (--use_ds_universal_ckpt): DeepSpeed's universal checkpoint is "
                "made of a ZeRO optimizer's partitions; use --zero_stage 1, 2 or 3, or drop the flag"
            )
        if self.zero_stage == 0 and self.grad_accum_dtype not in (None, params):
            raise ValueError(
                f"grad_accum_dtype={self.grad_accum_dtype} (--grad_accum_dtype) with {params} params needs "
                f"a ZeRO optimizer (DeepSpeed: 'unsupported mix' at stage 0); use --zero_stage 1, 2 or 3, "
                f"or --grad_accum_dtype {params}"
            )


GRAD_ACCUM_DTYPES = ("fp32", "bf16")


def auto_zero_stage(
    cfg: StrategyConfig, *, cuda: bool, world_size: int, needs_zero: str | None = None
) -> tuple[int, str]:
    """The stage an unset ``zero_stage`` (auto) resolves to, and why. ``needs_zero``: a flag of the caller's that
    needs a ZeRO optimizer (e.g. RL's --deepspeed_enable_sleep). Never 1 or 3: those trade speed for memory, a
    user's call. On one GPU stage 0 is as small as 2 (nothing to partition) and skips ZeRO's gradient buckets
    (benchmarks/grpo_vs_trl.py, docs/performance.md); on CPU runs keep stage 2, as before."""
    params = "bf16" if cfg.bf16 else "fp32"
    needs = needs_zero or (
        "--adam_offload"
        if cfg.adam_offload
        else "--use_ds_universal_ckpt"
        if cfg.use_ds_universal_ckpt
        else f"--grad_accum_dtype {cfg.grad_accum_dtype}"
        if cfg.grad_accum_dtype not in (None, params)
        else None
    )
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
        ring = (
            ""
            if self.world_size == self.dp_size
            else f" (ring attention: {self.world_size // self.dp_size} ranks per data-parallel slice)"
        )
        return (
            f"global batch {self.global_batch} = micro batch {self.micro_batch} x accumulation "
            f"{self.accumulation_steps} x data parallel {self.dp_size}{ring}{steps}"
        )
