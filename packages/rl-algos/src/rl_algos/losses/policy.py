"""PPO-family policy loss and the clipped value loss.

Notation (per token t of sequence i): ``r = exp(logp - old_logp)``, ``A`` the advantage.

PPO clip with clip-higher (Schulman et al. 2017, arXiv:1707.06347; DAPO, Yu et al.
2025, arXiv:2503.14476)::

    L = -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)

Dual clip (Ye et al. 2020, arXiv:1912.09729), for A < 0 only, with c > 1::

    L = -max(min(r A, clip(r) A), c A)

GSPO (Zheng et al. 2025, arXiv:2507.18071): the ratio is the sequence's geometric
mean ``r_i = exp(mean_t (logp - old_logp))``, shared by its tokens.

Rollout-vs-trainer importance correction, for samples drawn by an inference engine
whose log-probs ``rollout_logp`` differ from the trainer's ``old_logp``
(Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL
training"; OpenRLHF ``--algo.advantage.is_correction_type``), with ``w = exp(old_logp - rollout_logp)``
and thresholds ``[low, high]``:

- ``tis``: token weight ``clamp(w, low, high)``;
- ``icepop``: token weight ``w`` where ``low <= w <= high``, else 0;
- ``seq-mask-tis``: token weight ``w``, zeroed for whole sequences whose geometric-mean
  weight ``exp(mean_t log w)`` lies outside ``[low, high]``.

The weights are constants (no gradient). The per-token loss is aggregated by
:func:`rl_algos.losses.aggregate.aggregate_loss`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from rl_algos._masked import check_same_shape, compute_dtype, masked_mean
from rl_algos.losses.aggregate import aggregate_loss, parse_aggregation
from rl_algos.losses.kinds import ISCorrection  # re-exported: torch-free beside

Tensor = torch.Tensor


class RatioType(str, enum.Enum):
    TOKEN = "token"  # PPO
    SEQUENCE = "sequence"  # GSPO


def _enum(cls: type[enum.Enum], value: str, what: str):
    try:
        return cls(value)
    except ValueError:
        raise ValueError(f"unknown {what} {value!r}; valid: {', '.join(e.value for e in cls)}") from None


@dataclass(frozen=True)
class PolicyLossOutput:
    """``loss``: scalar to back-propagate. Metrics are masked means over this batch,
    detached: ``clip_fraction`` (tokens whose clipped term was the active one),
    ``approx_kl`` (k1 of old vs current, ``mean(old_logp - logp)``), ``rollout_kl``
    (``mean(rollout_logp - old_logp)``, None without rollout log-probs),
    ``is_weight_mean`` (mean correction weight, None without correction)."""

    loss: Tensor
    clip_fraction: Tensor
    approx_kl: Tensor
    rollout_kl: Tensor | None = None
    is_weight_mean: Tensor | None = None


def _is_weights(
    old_BT: Tensor, rollout_BT: Tensor, mask_BT: Tensor, kind: ISCorrection, low: float, high: float
) -> Tensor:
    log_w = old_BT - rollout_BT
    w = log_w.exp()
    if kind is ISCorrection.TIS:
        return w.clamp(min=low, max=high)
    if kind is ISCorrection.ICEPOP:
        return w * ((w >= low) & (w <= high)).to(w.dtype)
    seq_w = masked_mean(log_w, mask_BT, dim=-1).exp()
    keep = ((seq_w >= low) & (seq_w <= high)).to(w.dtype)
    return w * keep.unsqueeze(-1)


def policy_loss(
    logprobs_BT: Tensor,
    old_logprobs_BT: Tensor,
    advantages_BT: Tensor,
    mask_BT: Tensor,
    *,
    clip_eps_low: float = 0.2,
    clip_eps_high: float | None = None,
    dual_clip: float | None = None,
    ratio_type: str = "token",
    rollout_logprobs_BT: Tensor | None = None,
    correction: str | None = None,
    correction_low: float = 0.5,
    correction_high: float = 5.0,
    aggregation: str = "token-mean",
    global_tokens: float | Tensor | None = None,
    global_seqs: float | Tensor | None = None,
    dp_size: int = 1,
    norm_len: float | None = None,
) -> PolicyLossOutput:
    """Clipped policy-gradient loss (see module docstring).

    Shapes: every ``*_BT`` is ``[B, T]``; returns scalars. ``clip_eps_high`` defaults
    to ``clip_eps_low``; ``dual_clip`` must be > 1; ``correction`` needs
    ``rollout_logprobs_BT``.
    """
    check_same_shape(
        logprobs_BT=logprobs_BT,
        old_logprobs_BT=old_logprobs_BT,
        advantages_BT=advantages_BT,
        mask_BT=mask_BT,
        rollout_logprobs_BT=rollout_logprobs_BT,
    )
    rtype = _enum(RatioType, ratio_type, "ratio_type")
    parse_aggregation(aggregation)
    eps_high = clip_eps_low if clip_eps_high is None else clip_eps_high
    if clip_eps_low < 0 or eps_high < 0:
        raise ValueError(f"clip eps must be >= 0, got low={clip_eps_low}, high={eps_high}")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (e.g. 3.0), got {dual_clip}")
    corr = None if correction is None else _enum(ISCorrection, correction, "importance correction")
    if corr is not None and rollout_logprobs_BT is None:
        raise ValueError(f"correction={correction!r} needs rollout_logprobs_BT (the engine's log-probs)")
    if corr is not None and not 0 <= correction_low <= correction_high:
        raise ValueError(
            f"correction thresholds need 0 <= low <= high, got low={correction_low}, high={correction_high}"
        )

    dt = compute_dtype(logprobs_BT, old_logprobs_BT)
    logp, old = logprobs_BT.to(dt), old_logprobs_BT.to(dt).detach()
    adv = advantages_BT.to(dt).detach()
    log_ratio = logp - old
    if rtype is RatioType.SEQUENCE:
        ratio = masked_mean(log_ratio, mask_BT, dim=-1).exp().unsqueeze(-1).expand_as(log_ratio)
    else:
        ratio = log_ratio.exp()
    surr1 = ratio * adv
    surr2 = ratio.clamp(1.0 - clip_eps_low, 1.0 + eps_high) * adv
    clipped = torch.min(surr1, surr2)
    if dual_clip is not None:
        clipped = torch.where(adv < 0, torch.max(clipped, dual_clip * adv), clipped)
    loss_BT = -clipped

    rollout_kl = is_mean = None
    if rollout_logprobs_BT is not None:
        rollout = rollout_logprobs_BT.to(dt).detach()
        rollout_kl = masked_mean(rollout - old, mask_BT).detach()
        if corr is not None:
            w = _is_weights(old, rollout, mask_BT, corr, correction_low, correction_high)
            loss_BT = loss_BT * w
            is_mean = masked_mean(w, mask_BT).detach()

    loss = aggregate_loss(
        loss_BT,
        mask_BT,
        aggregation,
        global_tokens=global_tokens,
        global_seqs=global_seqs,
        dp_size=dp_size,
        norm_len=norm_len,
    )
    with torch.no_grad():
        clip_fraction = masked_mean((surr2 < surr1).to(dt), mask_BT)
        approx_kl = masked_mean(-log_ratio, mask_BT)
    return PolicyLossOutput(loss, clip_fraction, approx_kl, rollout_kl, is_mean)


@dataclass(frozen=True)
class ValueLossOutput:
    """``loss``: scalar (0.5 * aggregated squared error); ``clip_fraction``: share of tokens
    where the clipped error was the larger one (0 without clipping)."""

    loss: Tensor
    clip_fraction: Tensor


def value_loss(
    values_BT: Tensor,
    old_values_BT: Tensor,
    returns_BT: Tensor,
    mask_BT: Tensor,
    *,
    clip_eps: float | None = None,
    aggregation: str = "token-mean",
    global_tokens: float | Tensor | None = None,
    global_seqs: float | Tensor | None = None,
    dp_size: int = 1,
) -> ValueLossOutput:
    """Critic loss ``0.5 * max((V - R)^2, (V_old + clip(V - V_old, -eps, eps) - R)^2)``
    (PPO2 value clipping, as OpenRLHF ``ValueLoss``; plain squared error without ``clip_eps``).

    Shapes ``[B, T]`` -> scalars.
    """
    check_same_shape(values_BT=values_BT, old_values_BT=old_values_BT, returns_BT=returns_BT, mask_BT=mask_BT)
    dt = compute_dtype(values_BT)
    v, ret = values_BT.to(dt), returns_BT.to(dt).detach()
    err = (v - ret) ** 2
    if clip_eps is not None:
        if clip_eps <= 0:
            raise ValueError(f"value clip_eps must be > 0 or None, got {clip_eps}")
        old = old_values_BT.to(dt).detach()
        v_clipped = old + (v - old).clamp(-clip_eps, clip_eps)
        err_clipped = (v_clipped - ret) ** 2
        with torch.no_grad():
            frac = masked_mean((err_clipped > err).to(dt), mask_BT)
        err = torch.max(err, err_clipped)
    else:
        frac = torch.zeros((), dtype=dt, device=v.device)
    loss = 0.5 * aggregate_loss(
        err, mask_BT, aggregation, global_tokens=global_tokens, global_seqs=global_seqs, dp_size=dp_size
    )
    return ValueLossOutput(loss, frac)
