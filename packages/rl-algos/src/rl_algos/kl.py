"""KL estimators between the policy and a reference, and KL-coefficient controllers.

Per-token estimators of KL(pi || pi_ref) from samples of pi (Schulman, "Approximating
KL Divergence", 2020, http://joschu.net/blog/kl-approx.html), with
d = logprobs - ref_logprobs:

    k1 = d
    k2 = d^2 / 2
    k3 = exp(-d) - 1 + d          (unbiased, always >= 0)

Each estimate is clamped to [-10, 10], as OpenRLHF's ``compute_approx_kl`` does,
so one wild token cannot dominate a batch.

Controllers follow Ziegler et al., "Fine-Tuning Language Models from Human
Preferences" (2019), section 2.2 (the adaptive controller of OpenAI's lm-human-preferences).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from rl_algos._masked import check_same_shape

Tensor = torch.Tensor

KL_CLAMP = 10.0


class KLEstimator(str, enum.Enum):
    K1 = "k1"
    K2 = "k2"
    K3 = "k3"


def _parse_estimator(estimator: str) -> KLEstimator:
    try:
        return KLEstimator(estimator)
    except ValueError:
        valid = ", ".join(e.value for e in KLEstimator)
        raise ValueError(f"unknown KL estimator {estimator!r}; valid: {valid}") from None


def approx_kl(
    logprobs: Tensor,
    ref_logprobs: Tensor,
    estimator: str = "k1",
    mask: Tensor | None = None,
) -> Tensor:
    """Per-token KL estimate, clamped to +-10.

    Shape: ``logprobs``, ``ref_logprobs``, ``mask``: ``[B, T]`` -> ``[B, T]`` float32
    (float64 if an input is float64). Masked-out tokens are 0 when ``mask`` is given.
    """
    kind = _parse_estimator(estimator)
    check_same_shape(logprobs=logprobs, ref_logprobs=ref_logprobs, mask=mask)
    dt = torch.float64 if torch.float64 in (logprobs.dtype, ref_logprobs.dtype) else torch.float32
    d = logprobs.to(dt) - ref_logprobs.to(dt)
    if kind is KLEstimator.K1:
        kl = d
    elif kind is KLEstimator.K2:
        kl = d.square() / 2
    else:
        kl = torch.expm1(-d) + d
    kl = kl.clamp(min=-KL_CLAMP, max=KL_CLAMP)
    if mask is not None:
        kl = kl * mask.to(dt)
    return kl


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
