"""KL estimators between the policy and a reference, and KL-coefficient controllers.

Per-token estimators of KL(pi || pi_ref) from samples of pi (Schulman, "Approximating
KL Divergence", 2020, http://joschu.net/blog/kl-approx.html), with
d = logprobs - ref_logprobs:

    k1 = d
    k2 = d^2 / 2
    k3 = exp(-d) - 1 + d          (unbiased, always >= 0)

Each estimate is clamped to [-10, 10], as OpenRLHF's ``compute_approx_kl`` does,
so one wild token cannot dominate a batch.

:class:`KLConfig` holds a run's KL settings (estimator, coefficient, target, horizon, loss or
penalty), validated when built; :meth:`KLConfig.controller` gives the controller of the penalty. Both, and the
estimator names, are defined in :mod:`rl_algos.kl_config` (no torch: ``rl ppo --help`` reads them).

Controllers follow Ziegler et al., "Fine-Tuning Language Models from Human
Preferences" (2019), section 2.2 (the adaptive controller of OpenAI's lm-human-preferences).
"""

from __future__ import annotations

import torch

from rl_algos._masked import check_same_shape
from rl_algos.kl_config import (  # noqa: F401 - re-exported: the settings and controllers live beside, torch-free
    AdaptiveKLController,
    FixedKLController,
    KLConfig,
    KLEstimator,
)

Tensor = torch.Tensor

KL_CLAMP = 10.0


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
