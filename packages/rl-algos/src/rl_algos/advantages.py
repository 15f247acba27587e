"""Advantage estimators: GAE, REINFORCE(++), REINFORCE with baseline, RLOO, GRPO, Dr.GRPO.

One signature family. Every estimator is called as::

    out = estimator(scores_B, mask_BT, n_samples=n, token_rewards_BT=None,
                    values_BT=None, gamma=1.0, lambd=1.0)

- ``scores_B``: one scalar reward per sample, the ``n`` samples of a prompt contiguous
  (``B = num_prompts * n``).
- ``mask_BT``: 1 on the response tokens that count.
- ``token_rewards_BT``: optional per-token rewards added before discounting
  (typically ``-kl_coef * kl`` from :func:`rl_algos.shaping.kl_penalized_rewards`).
- ``values_BT``: critic values, only for ``gae``.

Returns :class:`Advantages` (``advantages_BT``, ``returns_BT``, the group-shaped
``scores_B``). The semantics match OpenRLHF's experience maker:

=====================  ================================================================
``gae``                delta_t = r_t + gamma V_{t+1} - V_t; A_t = delta_t + gamma lambda A_{t+1};
                       returns = A + V (Schulman et al. 2016, arXiv:1506.02438)
``reinforce``          A_t = discounted return of token rewards (REINFORCE++,
                       Hu 2025, arXiv:2501.03262; Williams 1992)
``reinforce_baseline`` score - group mean, then discounted return (REINFORCE++-baseline)
``rloo``               score - (group sum - score) / (n - 1), then discounted return
                       (Ahmadian et al. 2024, arXiv:2402.14740)
``group_norm``         (score - group mean) / (group std + 1e-9), unbiased std, then
                       discounted return (GRPO, Shao et al. 2024, arXiv:2402.03300)
``dr_grpo``            score - group mean (no std), then discounted return
                       (Dr. GRPO, Liu et al. 2025, arXiv:2503.20783)
=====================  ================================================================

Token rewards are the shaped score on the last response token plus
``token_rewards_BT``. Batch whitening (OpenRLHF applies it to ``gae``,
``reinforce`` and ``reinforce_baseline``: their entries' ``whiten_by_default``) is
:func:`masked_whiten`, left to the caller so it can use global statistics.

The registry (:data:`ESTIMATORS`, :class:`EstimatorSpec`, :func:`get_estimator`, :func:`estimator_names`) is
:mod:`rl_algos.estimators`'s, re-exported here: it names these estimators without importing torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from rl_algos._masked import check_same_shape, compute_dtype, masked_mean, masked_var, place_on_last_token
from rl_algos.estimators import (  # noqa: F401 - re-exported: the registry lives beside, torch-free
    ESTIMATORS,
    EstimatorSpec,
    estimator_names,
    get_estimator,
)

Tensor = torch.Tensor

GROUP_STD_EPS = 1e-9
_BLOCK = 128  # block length of the blocked reverse scan (memory ~ B * T * _BLOCK / T)


@dataclass(frozen=True)
class Advantages:
    """Output of every estimator. Shapes: ``advantages``/``returns`` ``[B, T]``, ``scores`` ``[B]``."""

    advantages: Tensor
    returns: Tensor
    scores: Tensor


class EstimatorFn(Protocol):
    def __call__(
        self,
        scores_B: Tensor,
        mask_BT: Tensor,
        *,
        n_samples: int = 1,
        token_rewards_BT: Tensor | None = None,
        values_BT: Tensor | None = None,
        gamma: float = 1.0,
        lambd: float = 1.0,
    ) -> Advantages: ...


# ---------------------------------------------------------------------------- scans


def discounted_cumsum(x_BT: Tensor, factor: float) -> Tensor:
    """``y_t = x_t + factor * y_{t+1}`` along the last axis (reverse discounted sum).

    factor == 1 is an exact reverse cumsum; otherwise a blocked scan: inside each
    block of ``_BLOCK`` steps a triangular matmul with powers of ``factor``, across
    blocks a carry, so memory stays O(B * T) and the Python loop is T / _BLOCK long.
    """
    dt = compute_dtype(x_BT)
    x = x_BT.to(dt)
    if factor == 1.0:
        return torch.flip(torch.cumsum(torch.flip(x, [-1]), -1), [-1])
    B, T = x.shape
    L = min(_BLOCK, T)
    k = torch.arange(L, device=x.device, dtype=dt)
    # W[s, t] = factor^(s - t) for s >= t, else 0: y_t = sum_s x_s W[s, t]
    expo = k.view(-1, 1) - k.view(1, -1)
    W = torch.where(expo >= 0, torch.tensor(factor, dtype=dt, device=x.device) ** expo.clamp(min=0), 0.0)
    decay = torch.tensor(factor, dtype=dt, device=x.device) ** (L - k)  # factor^(L - t) for the carry
    out = torch.empty_like(x)
    carry = torch.zeros(B, dtype=dt, device=x.device)  # y at the first step of the next block
    for end in range(T, 0, -L):
        start = max(0, end - L)
        n = end - start
        blk = x[:, start:end]
        y = blk @ W[:n, :n] + carry.unsqueeze(1) * decay[L - n :].unsqueeze(0)
        out[:, start:end] = y
        carry = y[:, 0]
    return out


def discounted_returns(rewards_BT: Tensor, mask_BT: Tensor, gamma: float = 1.0) -> Tensor:
    """Return-to-go of masked token rewards: ``G_t = r_t + gamma G_{t+1}`` (OpenRLHF
    ``get_cumulative_returns``). Shape ``[B, T]`` -> ``[B, T]`` float32+."""
    check_same_shape(rewards_BT=rewards_BT, mask_BT=mask_BT)
    r = rewards_BT.to(compute_dtype(rewards_BT)) * mask_BT.to(compute_dtype(rewards_BT))
    return discounted_cumsum(r, gamma)


def gae_advantages(
    rewards_BT: Tensor, values_BT: Tensor, mask_BT: Tensor, gamma: float = 1.0, lambd: float = 0.95
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016, arXiv:1506.02438).

    ``delta_t = r_t + gamma V_{t+1} - V_t``, ``A_t = delta_t + gamma lambda A_{t+1}``,
    ``returns = A + V``; rewards and values are masked first, as in OpenRLHF
    ``get_advantages_and_returns``. Returns ``(advantages_BT, returns_BT)``.
    """
    check_same_shape(rewards_BT=rewards_BT, values_BT=values_BT, mask_BT=mask_BT)
    dt = compute_dtype(rewards_BT, values_BT)
    m = mask_BT.to(dt)
    r = rewards_BT.to(dt) * m
    v = values_BT.to(dt) * m
    v_next = torch.cat([v[:, 1:], torch.zeros_like(v[:, :1])], dim=1)
    delta = r + gamma * v_next - v
    adv = discounted_cumsum(delta, gamma * lambd)
    return adv, adv + v


# ---------------------------------------------------------------------------- group baselines


def _grouped(scores_B: Tensor, n_samples: int, name: str, min_n: int) -> Tensor:
    if scores_B.dim() != 1:
        raise ValueError(f"{name}: scores must be 1-D [num_prompts * n], got shape {tuple(scores_B.shape)}")
    B = scores_B.shape[0]
    if n_samples < min_n:
        raise ValueError(f"{name} needs n_samples_per_prompt >= {min_n}, got {n_samples}")
    if B % n_samples != 0:
        raise ValueError(
            f"{name}: batch of {B} scores is not divisible by n_samples={n_samples} "
            f"({B} = {B // n_samples} * {n_samples} + {B % n_samples}); each prompt needs "
            f"exactly n contiguous samples"
        )
    return scores_B.to(compute_dtype(scores_B)).view(B // n_samples, n_samples)


def rloo_baseline(scores_B: Tensor, n_samples: int) -> Tensor:
    """``r_i - (sum_j r_j - r_i) / (n - 1)`` within each group of n (RLOO)."""
    r = _grouped(scores_B, n_samples, "rloo", 2)
    return (r - (r.sum(-1, keepdim=True) - r) / (n_samples - 1)).flatten()


def mean_baseline(scores_B: Tensor, n_samples: int) -> Tensor:
    """``r_i - mean_j r_j`` within each group (REINFORCE++-baseline, Dr. GRPO)."""
    r = _grouped(scores_B, n_samples, "mean baseline", 1)
    return (r - r.mean(-1, keepdim=True)).flatten()


def group_normalize(scores_B: Tensor, n_samples: int, eps: float = GROUP_STD_EPS) -> Tensor:
    """``(r_i - mean) / (std + eps)`` within each group, unbiased std (GRPO)."""
    r = _grouped(scores_B, n_samples, "group_norm", 2)
    return ((r - r.mean(-1, keepdim=True)) / (r.std(-1, keepdim=True) + eps)).flatten()


# ---------------------------------------------------------------------------- estimators


def _token_rewards(scores_B: Tensor, mask_BT: Tensor, token_rewards_BT: Tensor | None) -> Tensor:
    rewards = place_on_last_token(scores_B, mask_BT)
    if token_rewards_BT is not None:
        check_same_shape(mask_BT=mask_BT, token_rewards_BT=token_rewards_BT)
        rewards = rewards + token_rewards_BT.to(rewards.dtype)
    return rewards


def _check_scores(scores_B: Tensor, mask_BT: Tensor, name: str) -> None:
    if mask_BT.dim() != 2:
        raise ValueError(f"{name}: mask must be [batch, seq], got shape {tuple(mask_BT.shape)}")
    if scores_B.dim() != 1 or scores_B.shape[0] != mask_BT.shape[0]:
        raise ValueError(f"{name}: scores must be [batch]=[{mask_BT.shape[0]}], got shape {tuple(scores_B.shape)}")


def _returns_based(name: str, shape: Callable[[Tensor, int], Tensor] | None) -> EstimatorFn:
    def estimator(
        scores_B: Tensor,
        mask_BT: Tensor,
        *,
        n_samples: int = 1,
        token_rewards_BT: Tensor | None = None,
        values_BT: Tensor | None = None,
        gamma: float = 1.0,
        lambd: float = 1.0,
    ) -> Advantages:
        _check_scores(scores_B, mask_BT, name)
        shaped = scores_B.to(compute_dtype(scores_B)) if shape is None else shape(scores_B, n_samples)
        returns = discounted_returns(_token_rewards(shaped, mask_BT, token_rewards_BT), mask_BT, gamma)
        return Advantages(advantages=returns, returns=returns, scores=shaped)

    estimator.__name__ = name
    estimator.__qualname__ = name
    return estimator


def gae(
    scores_B: Tensor,
    mask_BT: Tensor,
    *,
    n_samples: int = 1,
    token_rewards_BT: Tensor | None = None,
    values_BT: Tensor | None = None,
    gamma: float = 1.0,
    lambd: float = 0.95,
) -> Advantages:
    """PPO's estimator: GAE over token rewards and critic values (see module docstring)."""
    _check_scores(scores_B, mask_BT, "gae")
    if values_BT is None:
        raise ValueError(
            "gae needs critic values (values_BT); use a critic or a critic-free estimator "
            f"({', '.join(estimator_names(critic_free=True))})"
        )
    shaped = scores_B.to(compute_dtype(scores_B))
    adv, ret = gae_advantages(_token_rewards(shaped, mask_BT, token_rewards_BT), values_BT, mask_BT, gamma, lambd)
    return Advantages(advantages=adv, returns=ret, scores=shaped)


reinforce = _returns_based("reinforce", None)
reinforce.__doc__ = "REINFORCE++: advantages = discounted return of the token rewards."
reinforce_baseline = _returns_based("reinforce_baseline", mean_baseline)
reinforce_baseline.__doc__ = "REINFORCE++-baseline: score minus group mean, then discounted return."
rloo = _returns_based("rloo", rloo_baseline)
rloo.__doc__ = "RLOO: leave-one-out group baseline, then discounted return."
group_norm = _returns_based("group_norm", group_normalize)
group_norm.__doc__ = "GRPO: group-normalised score, then discounted return."
dr_grpo = _returns_based("dr_grpo", mean_baseline)
dr_grpo.__doc__ = "Dr. GRPO: score minus group mean (no std division), then discounted return."


def compute_advantages(name: str, scores_B: Tensor, mask_BT: Tensor, **kwargs) -> Advantages:
    """``get_estimator(name)(scores_B, mask_BT, **kwargs)``."""
    return get_estimator(name)(scores_B, mask_BT, **kwargs)


def masked_whiten(
    x_BT: Tensor, mask_BT: Tensor, shift_mean: bool = True, eps: float = 1e-8, scale: bool = True
) -> Tensor:
    """Normalise the masked-in elements to zero mean and unit variance (biased variance,
    clamped at ``eps``), as OpenRLHF normalises advantages; masked-out elements become 0.
    With ``shift_mean=False`` the mean is added back (only the scale changes); with
    ``scale=False`` the std is not divided by (only the mean is subtracted: OpenRLHF's
    ``--no_advantage_std_norm``)."""
    check_same_shape(x_BT=x_BT, mask_BT=mask_BT)
    mean = masked_mean(x_BT, mask_BT)
    out = x_BT.to(mean.dtype) - mean
    if scale:
        out = out * masked_var(x_BT, mask_BT).clamp(min=eps).rsqrt()
    if not shift_mean:
        out = out + mean
    return out * mask_BT.to(out.dtype)
