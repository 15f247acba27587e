"""Supervised and preference losses: SFT, reward-model pairwise, DPO (cDPO, IPO), KTO.

All take per-sequence (or per-token, for SFT) log-probabilities that the caller
computed with :func:`rl_algos.losses.logits.logprobs_from_logits`; none touches a model.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rl_algos._masked import check_same_shape, compute_dtype
from rl_algos.losses.aggregate import aggregate_loss

Tensor = torch.Tensor


def sft_loss(
    logprobs_BT: Tensor,
    mask_BT: Tensor,
    *,
    aggregation: str = "token-mean",
    global_tokens: float | Tensor | None = None,
    global_seqs: float | Tensor | None = None,
    dp_size: int = 1,
) -> Tensor:
    """Negative log-likelihood of the target tokens: ``-agg(logprobs * mask)``.

    Shapes ``[B, T]`` -> scalar. With ``token-mean`` and ``global_tokens`` it is
    invariant to micro-batching and data parallelism (see ``aggregate_loss``).
    """
    return -aggregate_loss(
        logprobs_BT, mask_BT, aggregation, global_tokens=global_tokens, global_seqs=global_seqs, dp_size=dp_size
    )


class PairwiseKind(str, enum.Enum):
    SIGMOID = "sigmoid"  # -log sigmoid(c - r - m)   (Ouyang et al. 2022, InstructGPT)
    LOGEXP = "logexp"  # log(1 + exp(r - c + m))   (OpenRLHF LogExpLoss)


def pairwise_loss(
    chosen_B: Tensor, rejected_B: Tensor, margin_B: Tensor | None = None, kind: str = "sigmoid"
) -> Tensor:
    """Reward-model ranking loss, averaged over pairs.

    ``sigmoid``: ``-log sigmoid(c - r - margin)``; ``logexp``: ``log(1 + exp(r - c + margin))``
    (mathematically the same, kept as both names are flags users know). The margin
    (Llama 2, Touvron et al. 2023, eq. 2) demands a larger gap on clearer pairs.
    Shapes ``[B]`` -> scalar.
    """
    try:
        k = PairwiseKind(kind)
    except ValueError:
        raise ValueError(f"unknown pairwise loss {kind!r}; valid: sigmoid, logexp") from None
    check_same_shape(chosen_B=chosen_B, rejected_B=rejected_B, margin_B=margin_B)
    dt = compute_dtype(chosen_B, rejected_B)
    gap = chosen_B.to(dt) - rejected_B.to(dt)
    if margin_B is not None:
        gap = gap - margin_B.to(dt)
    if k is PairwiseKind.SIGMOID:
        return -F.logsigmoid(gap).mean()
    return F.softplus(-gap).mean()


@dataclass(frozen=True)
class DPOOutput:
    """``loss`` scalar, ``losses`` ``[B]``, implicit rewards ``beta * (logp - ref_logp)``
    of chosen and rejected ``[B]`` (detached)."""

    loss: Tensor
    losses: Tensor
    chosen_rewards: Tensor
    rejected_rewards: Tensor


def dpo_loss(
    policy_chosen_B: Tensor,
    policy_rejected_B: Tensor,
    ref_chosen_B: Tensor,
    ref_rejected_B: Tensor,
    *,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    ipo: bool = False,
    chosen_nll: Tensor | None = None,
    nll_coef: float = 0.0,
) -> DPOOutput:
    """Direct Preference Optimization on sequence log-probs.

    ``h = (pi_c - pi_r) - (ref_c - ref_r)``;

    - sigmoid (Rafailov et al. 2023, arXiv:2305.18290), with label smoothing eps
      (conservative DPO, Mitchell 2023):
      ``-(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)``;
    - IPO (Azar et al. 2023, arXiv:2310.12036): ``(h - 1 / (2 beta))^2``;
    - NLL term (RPO, Pang et al. 2024, arXiv:2404.19733): ``+ nll_coef * chosen_nll``,
      where ``chosen_nll`` is the caller's token-mean NLL of the chosen responses.

    Shapes ``[B]``; matches OpenRLHF ``DPOLoss``.
    """
    check_same_shape(
        policy_chosen_B=policy_chosen_B,
        policy_rejected_B=policy_rejected_B,
        ref_chosen_B=ref_chosen_B,
        ref_rejected_B=ref_rejected_B,
    )
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")
    if ipo and label_smoothing:
        raise ValueError("label_smoothing (cDPO) and ipo are alternatives; set one of them")
    if nll_coef and chosen_nll is None:
        raise ValueError(f"nll_coef={nll_coef} needs chosen_nll (token-mean NLL of the chosen responses)")
    dt = compute_dtype(policy_chosen_B)
    pc, pr = policy_chosen_B.to(dt), policy_rejected_B.to(dt)
    rc, rr = ref_chosen_B.to(dt).detach(), ref_rejected_B.to(dt).detach()
    h = (pc - pr) - (rc - rr)
    if ipo:
        losses = (h - 1.0 / (2.0 * beta)) ** 2
    else:
        losses = -F.logsigmoid(beta * h) * (1 - label_smoothing) - F.logsigmoid(-beta * h) * label_smoothing
    loss = losses.mean()
    if nll_coef:
        assert chosen_nll is not None  # checked above: nll_coef needs chosen_nll
        loss = loss + nll_coef * chosen_nll.to(dt)
    return DPOOutput(loss, losses, (beta * (pc - rc)).detach(), (beta * (pr - rr)).detach())


def kto_reference_kl(policy_kl_logps_B: Tensor, ref_kl_logps_B: Tensor) -> Tensor:
    """KTO's reference point: ``max(0, mean(pi(y'|x) - ref(y'|x)))`` over mismatched
    (x, y') pairs, detached. Under data parallelism average it across ranks first."""
    return (policy_kl_logps_B.float() - ref_kl_logps_B.float()).mean().clamp(min=0).detach()


@dataclass(frozen=True)
class KTOOutput:
    """``loss`` scalar, ``losses`` ``[B]`` (weighted), ``rewards`` ``[B]`` =
    ``beta * (logp - ref_logp)`` detached, and the ``kl`` reference point used."""

    loss: Tensor
    losses: Tensor
    rewards: Tensor
    kl: Tensor


def kto_loss(
    policy_logps_B: Tensor,
    ref_logps_B: Tensor,
    desirable_B: Tensor,
    kl: Tensor | float,
    *,
    beta: float = 0.1,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> KTOOutput:
    """Kahneman-Tversky Optimization (Ethayarajh et al. 2024, arXiv:2402.01306).

    With ``z = logp - ref_logp`` and reference point ``kl`` (:func:`kto_reference_kl`):

    - desirable:   ``w_d * (1 - sigmoid(beta (z - kl)))``
    - undesirable: ``w_u * (1 - sigmoid(beta (kl - z)))``

    averaged over the batch. Shapes ``[B]`` (``desirable_B`` bool) -> scalar.
    Matches OpenRLHF ``KTOLoss`` (which concatenates the two halves; here the rows
    stay in order).
    """
    check_same_shape(policy_logps_B=policy_logps_B, ref_logps_B=ref_logps_B, desirable_B=desirable_B)
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if desirable_weight < 0 or undesirable_weight < 0:
        raise ValueError(f"KTO weights must be >= 0, got {desirable_weight}, {undesirable_weight}")
    dt = compute_dtype(policy_logps_B)
    z = policy_logps_B.to(dt) - ref_logps_B.to(dt).detach()
    kl_t = torch.as_tensor(kl, dtype=dt, device=z.device).detach()
    good = desirable_B.to(torch.bool)
    losses = torch.where(
        good,
        desirable_weight * (1 - torch.sigmoid(beta * (z - kl_t))),
        undesirable_weight * (1 - torch.sigmoid(beta * (kl_t - z))),
    )
    return KTOOutput(losses.mean(), losses, (beta * z).detach(), kl_t)
