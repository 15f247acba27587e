"""How a model's per-token outputs line up with ``input_ids`` (:mod:`rl_core.models` states the convention):
positions from an attention mask, the one-step shift right, and ring attention's packing of padded rows
(:mod:`rl_core.ring_attention`)."""

from __future__ import annotations

import contextlib

import torch

Tensor = torch.Tensor


def _ring_slice(input_ids: Tensor, attention_mask: Tensor | None, position_ids: Tensor | None):
    """:func:`rl_core.ring_attention.sharded` for a packed row (padded rows are packed first: :func:`_ring_padded`)."""
    # lazy: import cycle (rl_core -> rl_core.models -> rl_core.model_rows -> rl_core)
    from rl_core import ring_attention

    if ring_attention.current() is not None and (
        attention_mask is not None or position_ids is None or input_ids.shape[0] != 1
    ):
        raise ValueError(
            f"ring attention splits one packed row per forward; got {input_ids.shape[0]} padded "
            f"rows (position_ids given: {position_ids is not None}, attention_mask given: "
            f"{attention_mask is not None})"
        )
    return ring_attention.sharded(position_ids) if position_ids is not None else contextlib.nullcontext()


def _ring_padded(attention_mask: Tensor | None) -> bool:
    """Padded rows under ring attention: the forward packs their real tokens into one row, as OpenRLHF's
    ``unpad_and_slice_tensor`` does, and puts the per-token outputs back (:func:`_unpad`, :func:`_repad`)."""
    # lazy: import cycle (rl_core -> rl_core.models -> rl_core.model_rows -> rl_core)
    from rl_core import ring_attention

    return attention_mask is not None and ring_attention.current() is not None


def _unpad(input_ids: Tensor, attention_mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Padded rows ``[B, T]`` -> ``(ids [1, N], position ids [1, N], index [N])``: the real tokens in row order, each
    row's positions from 0, and where each came from in the flattened ``[B * T]``."""
    idx = attention_mask.reshape(-1).nonzero().squeeze(1)
    return input_ids.reshape(-1)[idx][None], _positions(attention_mask).reshape(-1)[idx][None], idx


def _repad(x_1N: Tensor, idx: Tensor, shape) -> Tensor:
    """A packed row's per-token output back in the padded ``[B, T]`` layout, 0 at the padding (differentiable)."""
    return x_1N.new_zeros(shape[0] * shape[1]).index_put((idx,), x_1N[0]).view(shape)


def _positions(attention_mask: Tensor) -> Tensor:
    """Position ids that count real tokens only (left padding), as the engine saw them."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def _shift_right(x_BT: Tensor, position_ids: Tensor | None) -> Tensor:
    """Move per-position outputs one step right (position t-1 -> t), 0 at sequence starts."""
    out = torch.zeros_like(x_BT)
    out[:, 1:] = x_BT[:, :-1]
    if position_ids is not None:
        out = out.masked_fill(position_ids == 0, 0)
    return out


def align_to_tokens(x_BT: Tensor, inputs: dict) -> Tensor:
    """A per-position value of the raw logits (``x_BT[:, t]`` about the distribution of ``x_{t+1}``) moved onto
    the token it predicts, as :class:`rl_core.models.Actor` places its log-probs: 0 at each sequence's first token.
    ``inputs``: the forward's keyword arguments (``position_ids`` of a packed row mark where sequences start)."""
    return _shift_right(x_BT, inputs.get("position_ids"))
