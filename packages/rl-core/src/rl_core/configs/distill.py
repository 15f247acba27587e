"""On-policy distillation (``--teacher_pretrain``): present on :class:`~rl_core.trainers.ppo_config.PPOConfig` as
``distill`` when a teacher is given. The student (the policy) samples, the teacher scores every sampled token
(a frozen role like the reference: :mod:`rl_core.rl.teacher`), and the student lowers its reverse KL to the
teacher: as each token's own advantage (``teacher_lp - student_lp``, the one-sample reverse KL of that token,
negated, with no discount as in Tinker's on-policy distillation; whitened over the batch's response tokens, a
baseline that keeps the gradient unbiased, and added to the task's advantage) or as a loss term beside the policy loss (a KL estimator of the sampled tokens, as the
KL-to-reference loss). With ``--distill_mode loss`` the term may instead compare whole next-token distributions
(``divergence``: ``forward_kl`` ``KL(teacher || student)`` or ``jsd``, GKD's generalised JSD with ``jsd_beta``, the
names of ``rl sft``'s ``--kd_divergence``): the teacher sends its top ``topk`` tokens' log-probs per response token
(:mod:`rl_core.rl.distill_topk`), renormalised over them, and the student's full log-softmax is compared with them;
``topk`` at or above the vocabulary's size is the full distribution, exact (a real vocabulary of 32k-150k tokens
is refused above :data:`MAX_TOPK`: ``K`` ids and log-probs per response token travel with the experience). Both sides at the sampling
temperature (``--temperature``), as every log-prob of the loop: no separate distillation temperature. ``only``: the task's reward (if any) is measured and logged but not trained on (pure
distillation; no reward source is needed). Math: :mod:`rl_algos.distill`; papers: GKD (arXiv:2306.13649),
MiniLLM (arXiv:2306.08543)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from rl_rollout.config_fields import meta

MODES = ("advantage", "loss")
ESTIMATORS = ("k1", "k2", "k3")
DIVERGENCES = ("reverse_kl", "forward_kl", "jsd")
DEFAULT_TOPK = 64
#: the most teacher tokens per response token: 8 bytes each (an int32 id, a float32 log-prob), so 8 MiB for a
#: 1024-token response at K = 1024
MAX_TOPK = 1024


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
    divergence: str = field(
        default="reverse_kl",
        metadata=meta(
            "what the student lowers: reverse_kl, KL(policy || teacher) on the sampled tokens (--distill_mode "
            "advantage or loss); with --distill_mode loss also forward_kl, KL(teacher || policy), or jsd, GKD's "
            "generalised JSD (--distill_jsd_beta), on the teacher's top --distill_topk tokens per response token",
            flags=("distill_divergence",),
        ),
    )
    topk: int | None = field(
        default=None,
        metadata=meta(
            f"with --distill_divergence forward_kl or jsd: the teacher's top K tokens per response token (default "
            f"{DEFAULT_TOPK}; at or above the vocabulary's size: the full distributions, exact; at most {MAX_TOPK})",
            flags=("distill_topk",),
        ),
    )
    jsd_beta: float | None = field(
        default=None,
        metadata=meta(
            "with --distill_divergence jsd: the mixture weight beta in (0, 1), m = beta x teacher + (1 - beta) x "
            "policy (default 0.5)",
            flags=("distill_jsd_beta",),
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
                "--distill_mode, --distill_coef, --distill_kl_estimator, --distill_divergence, --distill_topk, "
                "--distill_jsd_beta, --distill_only and --teacher_offload set on-policy distillation: add --teacher_pretrain FOLDER (the teacher), or drop them"
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
        self._check_divergence()

    def _check_divergence(self) -> None:
        d = self.divergence
        if d not in DIVERGENCES:
            raise ValueError(f"--distill_divergence {d!r}: pick one of {', '.join(DIVERGENCES)}")
        if d != "reverse_kl":
            if self.mode != "loss":
                raise ValueError(
                    f"--distill_divergence {d} compares the policy's whole next-token distribution with the "
                    f"teacher's, a loss term beside the policy loss: add --distill_mode loss (--distill_mode "
                    f"{self.mode} trains on the sampled tokens' reverse KL only)"
                )
            if self.kl_estimator is not None:
                raise ValueError(
                    f"--distill_kl_estimator {self.kl_estimator} estimates the reverse KL from the sampled tokens; "
                    f"--distill_divergence {d} is computed from the distributions: drop it"
                )
        elif self.topk is not None:
            raise ValueError(
                f"--distill_topk {self.topk} sets how many of the teacher's tokens --distill_divergence forward_kl "
                "or jsd compares; the reverse KL reads the sampled tokens only: add --distill_divergence forward_kl "
                "(or jsd) and --distill_mode loss, or drop it"
            )
        if self.topk is not None and not 1 <= self.topk <= MAX_TOPK:
            raise ValueError(
                f"--distill_topk must be in 1..{MAX_TOPK}, got {self.topk}: the teacher sends K ids and log-probs "
                f"per response token with the experience, so a full real vocabulary (32k-150k tokens) is not "
                f"shipped; a K at or above a small vocabulary's size compares the full distributions"
            )
        if self.jsd_beta is not None:
            if d != "jsd":
                raise ValueError(
                    f"--distill_jsd_beta {self.jsd_beta} is the mixture weight of --distill_divergence jsd; with "
                    f"--distill_divergence {d} drop it"
                )
            if not (math.isfinite(self.jsd_beta) and 0.0 < self.jsd_beta < 1.0):
                raise ValueError(
                    f"--distill_jsd_beta must be in (0, 1) (its limit at 0 is --distill_divergence forward_kl; at 1, "
                    f"the reverse KL, a top-k teacher's divergence is infinite), got {self.jsd_beta}"
                )

    @property
    def loss_estimator(self) -> str | None:
        """The sampled-token loss term's estimator (None: the signal is the advantage, or a divergence of the
        distributions)."""
        return (self.kl_estimator or "k3") if self.mode == "loss" and self.divergence == "reverse_kl" else None

    @property
    def teacher_topk(self) -> int | None:
        """How many of its top tokens the teacher sends per response token (None: only the sampled token's
        log-prob)."""
        if self.divergence == "reverse_kl":
            return None
        return DEFAULT_TOPK if self.topk is None else self.topk

    @property
    def beta(self) -> float:
        """The JSD's mixture weight (0.5 unless given)."""
        return 0.5 if self.jsd_beta is None else self.jsd_beta
