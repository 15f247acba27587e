"""The offline trainers' settings: the loop's (:class:`TrainerConfig`, :class:`LMTrainerConfig`) and each
trainer's (:class:`SFTConfig`, :class:`RMConfig`, :class:`DPOConfig`, :class:`KTOConfig`), apart from the trainers
(which import torch and re-export them) so that ``rl sft --help`` and the others build their flags without torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rl_core.configs import CheckpointConfig, KDConfig, from_flat
from rl_rollout.config_fields import check_numbers, meta


@dataclass(frozen=True)
class TrainerConfig:
    """Loop settings shared by the offline trainers (OpenRLHF flag names in comments); checkpoints are the
    :class:`~rl_core.configs.CheckpointConfig` node every trainer shares (``ckpt``)."""

    max_epochs: int = field(default=1, metadata=meta("passes over the dataset"))
    ckpt: CheckpointConfig = field(
        default_factory=CheckpointConfig,
        metadata=meta("checkpoints (every --save_steps optimizer steps), resume and the final export"),
    )
    logging_steps: int = field(default=1, metadata=meta("log metrics every N optimizer steps"))
    run_dir: str | None = field(default=None, metadata=meta("metrics.jsonl, tensorboard/, curves.png"))
    max_steps: int | None = field(
        default=None, metadata=meta("stop after this many optimizer steps (e.g. to test resume)")
    )
    eval_steps: int = field(
        default=-1, metadata=meta("evaluate on the eval set every N optimizer steps (-1: only after the last)")
    )

    def __post_init__(self) -> None:
        check_numbers(self)  # every float finite (beta, loss weights ...)
        if self.max_epochs < 1:
            raise ValueError(f"max_epochs must be >= 1, got {self.max_epochs}")
        if self.logging_steps < 1:
            raise ValueError(f"logging_steps must be >= 1, got {self.logging_steps}")
        if self.ckpt.save_hf_ckpt and self.ckpt.save_steps <= 0:  # the RL loop only notes it (as OpenRLHF)
            raise ValueError(
                "save_hf_ckpt (--save_hf_ckpt) writes an HF export at every --save_steps; add "
                "--save_steps N (and --ckpt_path DIR), or drop it: the final model goes to --save_path"
            )
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"max_steps must be >= 1 or unset, got {self.max_steps}")
        if self.eval_steps == 0 or self.eval_steps < -1:
            raise ValueError(
                f"eval_steps (--eval_steps) must be >= 1, or -1 to evaluate only after the last step, "
                f"got {self.eval_steps}"
            )

    @classmethod
    def from_flat(cls, **flat):
        """The tree from flat names (``save_steps=5, ckpt_path="ck"`` land in ``ckpt``): rl-core 0.15's keywords."""
        return from_flat(cls, **flat)


@dataclass(frozen=True)
class LMTrainerConfig(TrainerConfig):
    """The loop's settings plus what a trainer of a causal LM (SFT, DPO, KTO) adds."""

    aux_loss_coef: float = field(
        default=0.0,
        metadata=meta(
            "mixture-of-experts models: + coef x the router's load-balancing loss (0: off); a model without experts "
            "is refused",
            openrlhf=("model.aux_loss_coef",),
        ),
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        check_numbers(self, non_negative=("aux_loss_coef",))


@dataclass(frozen=True)
class SFTConfig(LMTrainerConfig):
    """SFT's settings beyond the loop's and the MoE coefficient (the loss is the token-mean NLL): which tokens it is
    over (``pretrain_mode``: every token of the text, :class:`rl_core.data.PretrainDataset`, as OpenRLHF's) and the
    optional teacher (``kd``: :class:`~rl_core.configs.KDConfig`, knowledge distillation)."""

    pretrain_mode: bool = field(
        default=False,
        metadata=meta(
            "continued pretraining: the loss covers every token of the --input_key text (tokenized as is: no template, "
            "no special tokens, cut at --max_len), as OpenRLHF's --pretrain_mode; --output_key is not read",
            openrlhf=("model.pretrain_mode_enable",),
        ),
    )
    kd: KDConfig | None = field(
        default=None,
        metadata=meta(
            "knowledge distillation from a frozen teacher (on with --teacher_pretrain; rl_core.trainers.sft_kd)"
        ),
    )


@dataclass(frozen=True)
class RMConfig(TrainerConfig):
    loss: str = field(default="sigmoid", metadata=meta("sigmoid | logexp"))
    margin_loss: bool = field(default=False, metadata=meta("use the dataset's margin column (--margin_key)"))
    normalize_reward: bool = field(default=True, metadata=meta("store the training-set reward mean/std"))

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.loss not in ("sigmoid", "logexp"):
            raise ValueError(f"loss (--loss) must be sigmoid or logexp, got {self.loss!r}")


@dataclass(frozen=True)
class DPOConfig(LMTrainerConfig):
    beta: float = field(default=0.1, metadata=meta("DPO temperature on the log-ratio margin"))
    label_smoothing: float = field(default=0.0, metadata=meta("cDPO"))
    ipo: bool = field(default=False, metadata=meta("IPO loss (squared margin) instead of DPO's log-sigmoid"))
    nll_loss_coef: float = field(default=0.0, metadata=meta("+ coef x token-mean NLL of the chosen responses"))
    precompute_ref: bool = field(
        default=False, metadata=meta("compute reference logprobs once, then release the reference model")
    )
    ref_offload: bool = field(
        default=False,
        metadata=meta(
            "the reference's parameters on the CPU, gathered layer by layer for each forward (DeepSpeed ZeRO-3 "
            "offload_param; needs --zero_stage 3)",
            openrlhf=("ref.offload",),
        ),
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.beta <= 0:
            raise ValueError(f"beta (--beta) must be > 0, got {self.beta}")
        check_numbers(self, non_negative=("nll_loss_coef",))
        if not 0 <= self.label_smoothing < 0.5:
            raise ValueError(f"label_smoothing (--label_smoothing) must be in [0, 0.5), got {self.label_smoothing}")
        if self.ipo and self.label_smoothing:
            raise ValueError("--ipo and --label_smoothing (cDPO) are alternatives; set one of them")


@dataclass(frozen=True)
class KTOConfig(LMTrainerConfig):
    beta: float = field(default=0.1, metadata=meta("KTO temperature on the implied reward"))
    desirable_loss_weight: float = field(default=1.0, metadata=meta("weight of the desirable samples' loss"))
    undesirable_loss_weight: float = field(default=1.0, metadata=meta("weight of the undesirable samples' loss"))
    ref_offload: bool = field(
        default=False,
        metadata=meta(
            "the reference's parameters on the CPU, gathered layer by layer for each forward (DeepSpeed ZeRO-3 "
            "offload_param; needs --zero_stage 3)",
            openrlhf=("ref.offload",),
        ),
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.beta <= 0:
            raise ValueError(f"beta (--beta) must be > 0, got {self.beta}")
        if self.desirable_loss_weight < 0 or self.undesirable_loss_weight < 0:
            raise ValueError(
                "desirable/undesirable loss weights must be >= 0, got "
                f"{self.desirable_loss_weight}, {self.undesirable_loss_weight}"
            )
