"""Turning a per-token loss ``[B, T]`` into the scalar to back-propagate.

Modes (names as in verl's ``agg_loss``; OpenRLHF's ``token_level_loss`` flag picks
the first two):

=========================  ==========================================================
``token-mean``             sum of masked token losses / number of tokens (DAPO)
``seq-mean-token-mean``    per-sequence token mean, averaged over sequences (GRPO paper)
``seq-mean-token-sum``     per-sequence token sum, averaged over sequences
``seq-mean-token-sum-norm`` per-sequence token sum / ``norm_len``, averaged over sequences;
                           ``norm_len`` is a constant such as the generation limit
                           (Dr. GRPO, Liu et al. 2025, arXiv:2503.20783); defaults to T
=========================  ==========================================================

Sharding invariance. With data parallelism and gradient accumulation the
normaliser must be global. Pass ``global_tokens`` (token-mean) or
``global_seqs`` (the seq-mean modes): the count over every micro-batch of every
data-parallel rank in the optimizer step, and ``dp_size``. The returned loss is
then ``local_sum * dp_size / global_count``, so that summing it over a rank's
micro-batches and averaging over ranks (what DDP / DeepSpeed all-reduce does)
gives exactly the full-batch loss. (OpenRLHF ``aggregate_loss``; its test
``test_loss_aggregation.py`` checks the same property.)
"""

from __future__ import annotations

import torch

from rl_algos._masked import check_same_shape, compute_dtype
from rl_algos.losses.kinds import LossAggregation, parse_aggregation  # noqa: F401 - re-exported: torch-free beside

Tensor = torch.Tensor


def aggregate_loss(
    loss_BT: Tensor,
    mask_BT: Tensor,
    mode: str = "token-mean",
    *,
    global_tokens: float | Tensor | None = None,
    global_seqs: float | Tensor | None = None,
    dp_size: int = 1,
    norm_len: float | None = None,
) -> Tensor:
    """Scalar loss from per-token losses (see module docstring for the modes).

    Shape: ``loss_BT``, ``mask_BT`` ``[B, T]`` -> scalar, float32+.
    ``dp_size > 1`` requires the matching global count, since a per-rank mean
    averaged across ranks is not the global mean.
    """
    agg = parse_aggregation(mode)
    check_same_shape(loss_BT=loss_BT, mask_BT=mask_BT)
    if dp_size < 1:
        raise ValueError(f"dp_size must be >= 1, got {dp_size}")
    dt = compute_dtype(loss_BT)
    m = mask_BT.to(dt)
    masked = loss_BT.to(dt) * m
    if agg is LossAggregation.TOKEN_MEAN:
        count = global_tokens
        if count is None:
            if dp_size != 1:
                raise ValueError("token-mean with dp_size > 1 needs global_tokens (tokens over all ranks)")
            count = m.sum()
        return masked.sum() * dp_size / torch.as_tensor(count, dtype=dt, device=masked.device).clamp(min=1)
    if agg is LossAggregation.SEQ_MEAN_TOKEN_MEAN:
        per_seq = masked.sum(-1) / m.sum(-1).clamp(min=1)
    elif agg is LossAggregation.SEQ_MEAN_TOKEN_SUM:
        per_seq = masked.sum(-1)
    else:
        L = loss_BT.shape[-1] if norm_len is None else norm_len
        if L <= 0:
            raise ValueError(f"norm_len must be > 0, got {L}")
        per_seq = masked.sum(-1) / L
    count = global_seqs
    if count is None:
        if dp_size != 1:
            raise ValueError(f"{agg.value} with dp_size > 1 needs global_seqs (sequences over all ranks)")
        count = loss_BT.shape[0]
    return per_seq.sum() * dp_size / torch.as_tensor(count, dtype=dt, device=masked.device).clamp(min=1)
