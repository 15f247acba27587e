"""Batching dataset items: right-padded batches, preference batches, packed sequences.

Label convention (shared with :mod:`rl_core.data.datasets`): ``loss_mask`` is aligned
with ``input_ids``, and ``loss_mask[b, t] == 1`` means token ``t`` is a target. A
causal LM's logprob of token ``t`` comes from the logits at position ``t - 1``, so
a trainer computes ``logprobs_from_logits(logits[:, :-1], input_ids[:, 1:])`` and
weighs it with ``loss_mask[:, 1:]``. Token 0 of every sequence is never a target.

Packing: :func:`pack_collate` concatenates sequences into one row whose
``position_ids`` restart at 0 for each sequence. It returns no attention mask: with
flash-attention 2, transformers reads the sequence boundaries from ``position_ids``
(varlen kernels); any other attention implementation must build a block-diagonal mask
from ``seq_lens``, or it would attend across sequences. The first token of each packed
sequence gets loss mask 0, since the logits before it belong to the previous sequence.
:func:`pack_greedy` chooses which items share a row.

Leaves out: samplers, distributed sharding and the choice of micro-batch size.
"""

from __future__ import annotations

import torch


def _pad(seqs: list[torch.Tensor], value: int) -> torch.Tensor:
    out = torch.full((len(seqs), max(len(s) for s in seqs)), value, dtype=torch.long)
    for b, s in enumerate(seqs):
        out[b, : len(s)] = s
    return out


def _padded_batch(ids: list[torch.Tensor], masks: list[torch.Tensor], pad_id: int) -> dict[str, torch.Tensor]:
    for b, (i, m) in enumerate(zip(ids, masks, strict=True)):
        if i.shape != m.shape or i.ndim != 1 or len(i) == 0:
            raise ValueError(
                f"item {b}: ids {tuple(i.shape)} and loss mask {tuple(m.shape)} must be equal non-empty 1-D"
            )
    input_ids = _pad(ids, pad_id)
    attention_mask = _pad([torch.ones_like(i) for i in ids], 0)
    loss_mask = _pad(masks, 0)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask}


def pad_collate(items: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """SFT or KTO items -> ``input_ids`` / ``attention_mask`` / ``loss_mask``, each ``[B, T]``
    (long, right-padded; T = longest item), plus ``desirable [B]`` (bool) for KTO items."""
    if not items:
        raise ValueError("pad_collate got an empty list of items")
    batch = _padded_batch([it["input_ids"] for it in items], [it["loss_mask"] for it in items], pad_id)
    if "desirable" in items[0]:
        batch["desirable"] = torch.tensor([bool(it["desirable"]) for it in items], dtype=torch.bool)
    return batch


def preference_collate(items: list[dict], pad_id: int, *, packing: bool = False) -> dict:
    """Preference items -> one batch of ``2B`` sequences: ``0..B-1`` chosen, ``B..2B-1`` the matching
    rejected, and ``margin [B]`` (float32). One forward pass scores both sides.

    Padded (default): ``input_ids``, ``attention_mask``, ``loss_mask`` each ``[2B, T]``. With ``packing``:
    the :func:`pack_collate` row of the ``2B`` sequences in that order (``position_ids``, ``seq_lens``)."""
    if not items:
        raise ValueError("preference_collate got an empty list of items")
    seqs = [
        {"input_ids": it[f"{side}_ids"], "loss_mask": it[f"{side}_mask"]}
        for side in ("chosen", "rejected")
        for it in items
    ]
    batch = pack_collate(seqs) if packing else pad_collate(seqs, pad_id)
    batch["margin"] = torch.tensor([float(it["margin"]) for it in items], dtype=torch.float32)
    return batch


def sequence_sums(x: torch.Tensor, batch: dict) -> torch.Tensor:
    """Per-sequence sum of a per-token ``x`` under the batch's ``loss_mask``: ``[R]`` float64.

    ``x`` has the shape of ``batch["input_ids"]``: ``[R, T]`` padded rows, or ``[1, S]`` for a
    :func:`pack_collate` row, summed per sequence of ``seq_lens``. Differentiable in ``x``. float64: a
    float32 sum of a long response's log-probs (-2000) is off by ~1e-4 depending on summation order, the
    size of the DPO / KTO log-ratios it enters; padded and packed rows sum in different orders."""
    w = x.double() * batch["loss_mask"].to(x.device)
    if "seq_lens" not in batch:
        return w.sum(1)
    lens = torch.tensor(batch["seq_lens"], device=x.device)
    seq = torch.repeat_interleave(torch.arange(len(lens), device=x.device), lens)
    return w.new_zeros(len(lens)).index_add(0, seq, w[0])


def model_inputs(batch: dict) -> dict[str, torch.Tensor]:
    """The model's keyword arguments for a batch: ``position_ids`` for a packed row (no mask: the sequences are
    told apart by positions restarting at 0), ``attention_mask`` for padded rows, plus a vision-language
    batch's ``image_inputs`` (``pixel_values`` ...: :func:`rl_core.data.images.with_images`)."""
    pixels = batch.get("image_inputs") or {}
    if "position_ids" in batch:
        return {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"], **pixels}
    return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"], **pixels}


def pack_collate(items: list[dict]) -> dict:
    """SFT or KTO items (or any ``input_ids`` / ``loss_mask`` pairs) -> one packed row: ``input_ids``, ``position_ids``, ``loss_mask``
    each ``[1, sum T]`` (long), ``seq_lens`` (list[int], in item order), and
    ``desirable [N]`` (bool) for KTO items."""
    if not items:
        raise ValueError("pack_collate got an empty list of items")
    ids = [it["input_ids"] for it in items]
    masks = []
    for b, it in enumerate(items):
        m = it["loss_mask"].clone()
        if m.shape != ids[b].shape or m.ndim != 1 or len(m) == 0:
            raise ValueError(
                f"item {b}: ids {tuple(ids[b].shape)} and loss mask {tuple(m.shape)} must be equal non-empty 1-D"
            )
        m[0] = 0
        masks.append(m)
    seq_lens = [len(i) for i in ids]
    batch = {
        "input_ids": torch.cat(ids).unsqueeze(0),
        "position_ids": torch.cat([torch.arange(n, dtype=torch.long) for n in seq_lens]).unsqueeze(0),
        "loss_mask": torch.cat(masks).unsqueeze(0),
        "seq_lens": seq_lens,
    }
    if "desirable" in items[0]:
        batch["desirable"] = torch.tensor([bool(it["desirable"]) for it in items], dtype=torch.bool)
    return batch


def pack_greedy(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Group item indices into bins of at most ``max_tokens`` tokens (first-fit decreasing).

    Longest items are placed first, each into the first bin with room; ties keep index
    order and each bin lists its indices ascending, so the result is deterministic.
    Raises if a single item is longer than ``max_tokens``.
    """
    if max_tokens <= 0:
        raise ValueError(f"max_tokens must be positive, got {max_tokens}")
    for i, n in enumerate(lengths):
        if n < 0:
            raise ValueError(f"item {i} has negative length {n}")
        if n > max_tokens:
            raise ValueError(
                f"item {i} has {n} tokens, more than max_tokens={max_tokens} on its own; "
                "raise the packing budget or lower --max_len"
            )
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(max_tokens - lengths[i])
    return [sorted(b) for b in bins]
