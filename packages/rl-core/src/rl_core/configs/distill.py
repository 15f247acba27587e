"""On-policy distillation (``--teacher_pretrain``): present on :class:`~rl_core.trainers.ppo_config.PPOConfig` as
``distill`` when a teacher is given. The student (the policy) samples, the teacher scores every sampled token
(a frozen role like the reference: :mod:`rl_core.rl.teacher`), and the student lowers its reverse KL to the
teacher: as each token's own advantage (``teacher_lp - student_lp``, the one-sample reverse KL of that token,
negated, with no discount as in Tinker's on-policy distillation; whitened over the batch's response tokens, a
baseline that keeps the gradient unbiased, and added to the task's advantage) or as a loss term beside the policy loss (a KL estimator of the sampled tokens, as the
KL-to-reference loss). ``only``: the task's reward (if any) is measured and logged but not trained on (pure
distillation; no reward source is needed). Math: :mod:`rl_algos.distill`; papers: GKD (arXiv:2306.13649),
MiniLLM (arXiv:2306.08543)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from rl_rollout.config_fields import meta

MODES = ("advantage", "loss")
ESTIMATORS = ("k1", "k2", "k3")


@dataclass(frozen=True)
class DistillConfig:
    """The teacher and how its per-token signal reaches the student."""

    teacher_pretrain: str = field(
        default="",
        metadata=meta(
            "on-policy distillation: a teacher HF folder (any causal LM with the policy's tokenizer) scoring every "
            "sampled token; the policy lowers its reverse KL to it (see --distill_mode)",
            flags=("teacher_pretrain",),
        ),
    )
    mode: str = field(
        default="advantage",
        metadata=meta(
            "advantage: each response token's advantage gains --distill_coef x its (teacher - policy log-prob), "
            "whitened over the batch's response tokens; loss: "
            "--distill_coef x the sampled-token KL estimate (--distill_kl_estimator) joins the policy loss",
            flags=("distill_mode",),
        ),
    )
    coef: float = field(default=1.0, metadata=meta("the weight of the distillation signal", flags=("distill_coef",)))
    kl_estimator: str | None = field(
        default=None,
        metadata=meta(
            "with --distill_mode loss: the KL(policy || teacher) estimator of the loss term, k1, k2 or k3 (default)",
            flags=("distill_kl_estimator",),
        ),
    )
    only: bool = field(
        default=False,
        metadata=meta(
            "pure distillation: the task's reward (if a reward source is given) is logged but not trained on; "
            "no reward source is needed",
            flags=("distill_only",),
        ),
    )
    offload: bool = field(
        default=False,
        metadata=meta(
            "the teacher's parameters on the CPU, gathered layer by layer for each forward, as --ref_offload does "
            "for the reference (DeepSpeed ZeRO-3 offload_param; needs --zero_stage 3)",
            flags=("teacher_offload",),
        ),
    )

    def __post_init__(self) -> None:
        if not self.teacher_pretrain:
            raise ValueError(
                "--distill_mode, --distill_coef, --distill_kl_estimator, --distill_only and --teacher_offload set on-policy "
                "distillation: add --teacher_pretrain FOLDER (the teacher), or drop them"
            )
        if self.mode not in MODES:
            raise ValueError(f"--distill_mode {self.mode!r}: pick one of {', '.join(MODES)}")
        if not (math.isfinite(self.coef) and self.coef > 0):
            raise ValueError(f"--distill_coef must be a finite number > 0, got {self.coef}")
        if self.kl_estimator is not None:
            if self.mode != "loss":
                raise ValueError(
                    f"--distill_kl_estimator {self.kl_estimator} sets the loss term of --distill_mode loss; "
                    f"with --distill_mode {self.mode} the signal is the sampled log-prob gap itself: drop it"
                )
            if self.kl_estimator not in ESTIMATORS:
                raise ValueError(f"--distill_kl_estimator {self.kl_estimator!r}: pick one of {', '.join(ESTIMATORS)}")

    @property
    def loss_estimator(self) -> str | None:
        """The loss term's estimator (None: the signal is the advantage)."""
        return (self.kl_estimator or "k3") if self.mode == "loss" else None
