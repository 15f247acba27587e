"""What each trained role's ranks train against, resolved once from the run's config and handed to the workers
instead of the whole config: :class:`PolicyObjective` (the policy's loss and the terms added to it) and
:class:`CriticObjective` (the value loss and the critic's own optimizer settings).

``build_run`` makes them (``PolicyObjective.of(ppo_config)``); a worker over Ray receives a few numbers and the
policy-loss node (names, not classes, so an extension's variant is built in the worker after its module
loads), builds the variant once in its constructor and reads nothing else of the run.
"""

from __future__ import annotations

from dataclasses import dataclass

from rl_algos import KLEstimator, PolicyLossConfig
from rl_core.configs import CriticOptimizerConfig
from rl_core.rl.distill_topk import LogitDivergence


@dataclass(frozen=True)
class PolicyObjective:
    """The policy's loss: the variant (``loss``, with ``correction`` in force when the node sets none), the
    KL loss term (``kl_loss``: its estimator, None when KL is a reward penalty or off), PPO-ptx's coefficient
    (None: no pretraining term), the EMA's beta (None: no EMA), the sampling temperature the log-probs use,
    the passes over each iteration's samples, Dr. GRPO's constant normaliser (``norm_len``), and the distillation
    loss term (``distill_loss``: its KL(policy || teacher) estimator of the sampled tokens, None unless
    ``--distill_mode loss``; or ``distill_logits``, a divergence of the distributions on the teacher's top-k tokens,
    ``--distill_divergence forward_kl | jsd``; their weight ``distill_coef``)."""

    loss: PolicyLossConfig = PolicyLossConfig()
    correction: str | None = None
    temperature: float = 1.0
    epochs: int = 1
    norm_len: float = 64.0
    kl_loss: KLEstimator | None = None
    ptx_coef: float | None = None
    ema_beta: float | None = None
    distill_loss: KLEstimator | None = None
    distill_logits: LogitDivergence | None = None
    distill_coef: float = 0.0

    def __post_init__(self) -> None:
        if self.epochs < 1:
            raise ValueError(f"epochs (--max_epochs) must be >= 1, got {self.epochs}")
        if self.temperature <= 0:
            raise ValueError(f"temperature (--temperature) must be > 0, got {self.temperature}")

    @classmethod
    def of(cls, ppo) -> PolicyObjective:
        """From a :class:`~rl_core.trainers.ppo_config.PPOConfig`: the parts of it the policy's ranks read."""
        kl = ppo.kl
        return cls(
            loss=ppo.policy_loss,
            correction=ppo.is_correction_type,
            temperature=ppo.sampling.temperature,
            epochs=ppo.max_epochs,
            norm_len=ppo.loss_norm_len,
            kl_loss=kl.estimator if kl.use_loss and kl.enabled else None,
            ptx_coef=ppo.ptx.coef if ppo.ptx is not None else None,
            ema_beta=ppo.ema.beta if ppo.ema is not None else None,
            distill_loss=KLEstimator(d.loss_estimator) if (d := ppo.distill) and d.loss_estimator else None,
            distill_logits=LogitDivergence.of(ppo.distill),
            distill_coef=ppo.distill.coef if ppo.distill is not None else 0.0,
        )

    def variant(self):
        """The policy-loss variant (rl-algos), built: a worker asks once, in its constructor."""
        return self.loss.variant(self.correction)


@dataclass(frozen=True)
class CriticObjective:
    """The critic's loss and optimizer: the value clip (None: plain squared error), the passes over each
    iteration's samples, and its own optimizer settings (unset ones: the policy's)."""

    value_clip: float | None = 0.5
    epochs: int = 1
    optimizer: CriticOptimizerConfig = CriticOptimizerConfig()

    def __post_init__(self) -> None:
        if self.epochs < 1:
            raise ValueError(f"epochs (--max_epochs) must be >= 1, got {self.epochs}")
        if self.value_clip is not None and self.value_clip < 0:
            raise ValueError(f"value_clip (--value_clip) must be >= 0, got {self.value_clip}")

    @classmethod
    def of(cls, ppo) -> CriticObjective:
        """From a :class:`~rl_core.trainers.ppo_config.PPOConfig`: the parts of it the critic's ranks read."""
        return cls(value_clip=ppo.value_clip, epochs=ppo.max_epochs, optimizer=ppo.critic_optimizer)
