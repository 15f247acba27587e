"""The run's KL settings (:class:`KLConfig`), the estimator names (:class:`KLEstimator`) and the coefficient
controllers (:class:`FixedKLController`, :class:`AdaptiveKLController`): plain Python, no torch, so a command's
flags are built without it. The estimators themselves are :mod:`rl_algos.kl`'s (which re-exports these names).

Controllers follow Ziegler et al., "Fine-Tuning Language Models from Human Preferences" (2019), section 2.2 (the
adaptive controller of OpenAI's lm-human-preferences).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from rl_algos._settings import field_meta as _meta


class KLEstimator(str, enum.Enum):
    K1 = "k1"
    K2 = "k2"
    K3 = "k3"


@dataclass
class FixedKLController:
    """A constant KL coefficient (``--init_kl_coef`` with no target)."""

    value: float

    def update(self, current_kl: float, n_steps: int) -> float:
        return self.value


@dataclass
class AdaptiveKLController:
    """Proportional controller that steers the measured KL towards ``target``.

    After each batch of ``n_steps`` samples with mean KL ``current_kl``::

        e = clip(current_kl / target - 1, -0.2, 0.2)
        value <- value * (1 + e * n_steps / horizon)

    (Ziegler et al. 2019, eq. 2; OpenRLHF ``AdaptiveKLController``.)
    """

    value: float
    target: float
    horizon: int

    def __post_init__(self) -> None:
        if self.target <= 0 or self.horizon <= 0:
            raise ValueError(
                f"AdaptiveKLController needs target > 0 and horizon > 0, got "
                f"target={self.target}, horizon={self.horizon}"
            )

    def update(self, current_kl: float, n_steps: int) -> float:
        proportional_error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon
        return self.value


@dataclass(frozen=True)
class KLConfig:
    """KL to the reference policy: as a per-token reward penalty (the default, coefficient fixed or steered to
    ``target`` by :class:`AdaptiveKLController`) or as a loss term beside the policy loss (``use_loss``, GRPO).
    ``init_coef`` 0 turns KL off (no reference model is needed)."""

    init_coef: float = field(
        default=0.01, metadata=_meta("KL to the reference (0: no reference model)", "init_kl_coef", "algo.kl.init_coef")
    )
    target: float | None = field(
        default=None, metadata=_meta("adaptive KL coefficient steering to this KL", "kl_target", "algo.kl.target")
    )
    horizon: int = field(default=10000, metadata=_meta("adaptive KL horizon", "kl_horizon", "algo.kl.horizon"))
    use_loss: bool = field(
        default=False,
        metadata=_meta("KL as a loss term (GRPO) instead of a reward penalty", "use_kl_loss", "algo.kl.use_loss"),
    )
    estimator: KLEstimator = field(
        default=KLEstimator.K1,
        metadata=_meta("k1 | k2 | k3 (Schulman's estimators)", "kl_estimator", "algo.kl.estimator"),
    )

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "estimator", KLEstimator(self.estimator))  # "k3" -> KLEstimator.K3
        except ValueError:
            *rest, last = [e.value for e in KLEstimator]
            raise ValueError(
                f"kl_estimator (--kl_estimator) must be {', '.join(rest)} or {last}, got {self.estimator!r}"
            ) from None
        if not (self.init_coef >= 0 and self.init_coef != float("inf")):
            raise ValueError(f"init_kl_coef (--init_kl_coef) must be a finite number >= 0, got {self.init_coef}")
        if self.target is not None and not 0 < self.target < float("inf"):
            raise ValueError(f"kl_target (--kl_target) must be a finite number > 0, got {self.target}")
        if self.horizon < 1:
            raise ValueError(f"kl_horizon (--kl_horizon) must be >= 1, got {self.horizon}")

    @property
    def enabled(self) -> bool:
        """A reference model is needed (the coefficient is above 0)."""
        return self.init_coef > 0

    @property
    def as_penalty(self) -> bool:
        """KL enters the rewards (per token), not the loss."""
        return self.enabled and not self.use_loss

    def controller(self) -> FixedKLController | AdaptiveKLController | None:
        """The coefficient controller of the reward penalty (None when KL is a loss, or off)."""
        if not self.as_penalty:
            return None
        if self.target:
            return AdaptiveKLController(self.init_coef, self.target, self.horizon)
        return FixedKLController(self.init_coef)
