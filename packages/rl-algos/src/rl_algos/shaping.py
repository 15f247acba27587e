"""Reward shaping before advantages: clipping, length penalties, KL-penalised token rewards.

- :func:`clip_rewards`: clamp scalar scores to ``[-clip, clip]`` (OpenRLHF ``reward_clip_range``).
- :func:`overlong_penalty`: DAPO's soft overlong punishment (Yu et al. 2025,
  arXiv:2503.14476, eq. 13).
- :func:`stop_properly_penalty`: ProRL's penalty on truncated samples (Liu et al. 2025,
  arXiv:2505.24864; OpenRLHF ``stop_properly_penalty_coef``).
- :func:`kl_penalized_rewards`: token rewards ``-beta * kl_t`` plus the scalar score on the
  last response token (Ziegler et al. 2019; Ouyang et al. 2022; OpenRLHF ``compute_reward``).

:class:`ShapingConfig` holds a run's shaping settings (which of the first three apply, with what numbers); it is
defined in :mod:`rl_algos.shaping_config` (no torch: ``rl ppo --help`` reads it).
"""

from __future__ import annotations

import torch

from rl_algos._masked import check_same_shape, compute_dtype, place_on_last_token
from rl_algos.shaping_config import ShapingConfig  # noqa: F401 - re-exported: the settings live beside, torch-free

Tensor = torch.Tensor


def clip_rewards(scores_B: Tensor, low: float, high: float) -> Tensor:
    """``clamp(scores, low, high)``; ``low <= high`` required."""
    if low > high:
        raise ValueError(f"reward clip range needs low <= high, got [{low}, {high}]")
    return scores_B.clamp(min=low, max=high)


def overlong_penalty(response_lengths_B: Tensor, max_len: int, buffer_len: int, penalty_factor: float = 1.0) -> Tensor:
    """DAPO soft overlong penalty, added to the scores.

    With ``L = response length``, ``E = max_len - buffer_len``::

        penalty = 0                                      if L <= E
                = -min(L - E, buffer_len) / buffer_len * penalty_factor   otherwise

    Shape ``[B]`` (lengths) -> ``[B]`` float32.
    """
    if buffer_len <= 0 or buffer_len > max_len:
        raise ValueError(
            f"overlong buffer_len must be in (0, max_len={max_len}], got {buffer_len}; "
            f"it is the stretch before max_len where the penalty ramps up"
        )
    exceed = (response_lengths_B.to(torch.float32) - (max_len - buffer_len)).clamp(min=0, max=buffer_len)
    return -exceed / buffer_len * penalty_factor


def stop_properly_penalty(scores_B: Tensor, truncated_B: Tensor, coef: float) -> Tensor:
    """Scores of truncated samples (finish reason ``length``) scaled by ``coef`` in [0, 1],
    or, for ``coef < 0``, replaced by ``coef`` itself (a fixed negative reward), as OpenRLHF."""
    check_same_shape(scores_B=scores_B, truncated_B=truncated_B)
    if coef > 1:
        raise ValueError(f"stop_properly_penalty coef must be <= 1 (scale in [0, 1] or a fixed reward < 0), got {coef}")
    t = truncated_B.to(torch.bool)
    penalised = scores_B * coef if coef >= 0 else torch.full_like(scores_B, coef)
    return torch.where(t, penalised, scores_B)


def kl_penalized_rewards(
    scores_B: Tensor,
    kl_BT: Tensor | None,
    mask_BT: Tensor,
    kl_coef: float,
) -> Tensor:
    """Per-token rewards ``r_t = -kl_coef * kl_t * mask_t``, plus ``scores_B`` on the last
    masked-in token of each row.

    Shapes: ``scores_B`` ``[B]``, ``kl_BT``/``mask_BT`` ``[B, T]`` -> ``[B, T]`` float32+.
    ``kl_BT=None`` (or ``kl_coef=0``) gives the score alone.
    """
    out = place_on_last_token(scores_B, mask_BT)
    if kl_BT is not None and kl_coef != 0.0:
        check_same_shape(kl_BT=kl_BT, mask_BT=mask_BT)
        dt = compute_dtype(out, kl_BT)
        out = out.to(dt) - kl_coef * kl_BT.to(dt) * mask_BT.to(dt)
    return out
