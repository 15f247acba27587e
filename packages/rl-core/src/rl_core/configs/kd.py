"""Offline knowledge distillation in ``rl sft`` (``--teacher_pretrain``): present on
:class:`~rl_core.trainers.configs.SFTConfig` as ``kd`` when a teacher is given. Each step a frozen teacher (any causal
LM with the student's tokenizer) scores the same batch (no gradient, in the trainer's precision) and the loss becomes
``(1 - coef) x NLL + coef x D``, D the token mean over the response tokens (SFT's loss mask) of a divergence between
the teacher's and the student's next-token distributions over the whole vocabulary: ``forward_kl``
``KL(teacher || student)`` (classic KD, Hinton et al., arXiv:1503.02531; OpenRLHF's ``train_kd``), ``reverse_kl``
``KL(student || teacher)`` or ``jsd``, GKD's generalised Jensen-Shannon divergence with ``jsd_beta`` (arXiv:2306.13649).
The step is :mod:`rl_core.trainers.sft_kd`; the math :mod:`rl_algos.distill`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from rl_rollout.config_fields import meta

DIVERGENCES = ("forward_kl", "reverse_kl", "jsd")


@dataclass(frozen=True)
class KDConfig:
    """The teacher of ``rl sft`` and how much of the loss it sets."""

    teacher_pretrain: str = field(
        default="",
        metadata=meta(
            "knowledge distillation: a teacher HF folder (any causal LM with the student's tokenizer) whose next-token "
            "distributions on each batch the student is trained towards (see --kd_coef, --kd_divergence)",
            flags=("teacher_pretrain",),
            openrlhf=("teacher_model",),
        ),
    )
    coef: float = field(
        default=0.4,
        metadata=meta(
            "the loss is (1 - kd_coef) x NLL + kd_coef x the divergence to the teacher, in [0, 1] (0.4 as OpenRLHF's "
            "train_kd)",
            flags=("kd_coef",),
        ),
    )
    divergence: str = field(
        default="forward_kl",
        metadata=meta(
            "forward_kl: KL(teacher || student), classic KD; reverse_kl: KL(student || teacher); jsd: the "
            "generalised Jensen-Shannon divergence of GKD (--kd_jsd_beta)",
            flags=("kd_divergence",),
        ),
    )
    jsd_beta: float | None = field(
        default=None,
        metadata=meta(
            "with --kd_divergence jsd: the mixture weight beta in (0, 1), m = beta x teacher + (1 - beta) x student "
            "(default 0.5)",
            flags=("kd_jsd_beta",),
        ),
    )
    teacher_offload: bool = field(
        default=False,
        metadata=meta(
            "the teacher's parameters on the CPU, gathered layer by layer for each forward (DeepSpeed ZeRO-3 "
            "offload_param; needs --zero_stage 3)",
            flags=("teacher_offload",),
        ),
    )

    def __post_init__(self) -> None:
        if not self.teacher_pretrain:
            raise ValueError(
                "--kd_coef, --kd_divergence, --kd_jsd_beta and --teacher_offload set knowledge distillation: add "
                "--teacher_pretrain FOLDER (the teacher), or drop them"
            )
        if not (math.isfinite(self.coef) and 0.0 <= self.coef <= 1.0):
            raise ValueError(
                f"--kd_coef must be in [0, 1] (the loss is (1 - kd_coef) x NLL + kd_coef x KD), got {self.coef}"
            )
        if self.divergence not in DIVERGENCES:
            raise ValueError(f"--kd_divergence {self.divergence!r}: pick one of {', '.join(DIVERGENCES)}")
        if self.jsd_beta is not None:
            if self.divergence != "jsd":
                raise ValueError(
                    f"--kd_jsd_beta {self.jsd_beta} is the mixture weight of --kd_divergence jsd; with "
                    f"--kd_divergence {self.divergence} drop it"
                )
            if not (math.isfinite(self.jsd_beta) and 0.0 < self.jsd_beta < 1.0):
                raise ValueError(
                    f"--kd_jsd_beta must be in (0, 1) (its limits are --kd_divergence forward_kl at 0 and reverse_kl "
                    f"at 1), got {self.jsd_beta}"
                )

    @property
    def beta(self) -> float:
        """The JSD's mixture weight (0.5 unless given)."""
        return 0.5 if self.jsd_beta is None else self.jsd_beta
