"""``torch_varlen``: a transformers attention implementation that runs torch's own varlen kernel.

A packed row (several sequences in one row, ``position_ids`` restarting at 0, no attention mask)
runs through :func:`torch.nn.attention.varlen.varlen_attn` with ``cu_seqlens`` read from the position
ids, so each sequence attends only to itself at a cost linear in the number of sequences, not the
square of the row (transformers' sdpa path builds a dense block-diagonal mask for the same row).
Rows that need a real mask (padding, a KV cache during generation) defer to transformers' sdpa.

torch's varlen kernel is flash-attention inside torch (CUDA, bf16/fp16 only; no CPU kernel), so
:func:`register` is called by :func:`rl_core.attention.attention_implementation` only where it can run.
The function adapts to the ``varlen_attn`` signature of the installed torch (causal through
``window_size`` or ``is_causal``; GQA through ``enable_gqa`` or repeated KV heads; the softmax scale
through ``scale`` or a pre-scaled query).
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
from typing import Any

import torch

NAME = "torch_varlen"
logger = logging.getLogger(__name__)


def varlen_available() -> str | None:
    """None when torch's varlen kernel can run here, else why not (for the error message)."""
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen (added in torch 2.10)"
    if not torch.cuda.is_available():
        return "torch's varlen kernel is flash-attention (CUDA only) and no CUDA device is visible"
    return None


def cu_seqlens(position_ids: torch.Tensor, batch: int) -> tuple[torch.Tensor, int]:
    """``(cu_seqlens int32 [N+1], longest)`` of the rows of ``position_ids`` flattened into one.

    A sequence starts where a position is not the previous one plus 1 (transformers' own rule for
    packed rows, ``find_packed_sequence_indices``) and at the start of every row.
    """
    pos = position_ids.expand(batch, -1).reshape(-1)
    width = position_ids.shape[-1]
    start = torch.ones_like(pos, dtype=torch.bool)
    start[1:] = pos[1:] != pos[:-1] + 1
    start[::width] = True
    edges = torch.cat([start.nonzero().flatten(), pos.new_tensor([pos.numel()])]).to(torch.int32)
    return edges, int((edges[1:] - edges[:-1]).max())


_last: list = [None, None]  # (position_ids, its cu_seqlens): every layer of one forward reads the same tensor


def _cached_cu_seqlens(position_ids: torch.Tensor, batch: int) -> tuple[torch.Tensor, int]:
    key = (position_ids, position_ids._version, batch)
    held = _last[0]
    if held is None or held[0] is not position_ids or held[1:] != key[1:]:
        _last[0], _last[1] = key, cu_seqlens(position_ids, batch)  # the strong reference keeps id() unique
    return _last[1]


@functools.cache
def _params() -> frozenset[str]:
    from torch.nn.attention.varlen import varlen_attn

    params = frozenset(inspect.signature(varlen_attn).parameters)
    logger.info(
        "torch_varlen: packed rows run torch %s's varlen_attn (causal via %s, GQA %s, scale %s)",
        torch.__version__,
        "window_size" if "window_size" in params else "is_causal",
        "in the kernel" if "enable_gqa" in params else "by repeated KV heads",
        "in the kernel" if "scale" in params else "folded into the query",
    )
    return params


def _varlen(q, k, v, cu, longest: int, scaling: float | None):
    """q (T, H, D), k/v (T, Hkv, D) -> (T, H, D), causal within each sequence."""
    from torch.nn.attention.varlen import varlen_attn

    params = _params()
    kw: dict[str, Any] = {}
    kw.update(window_size=(-1, 0)) if "window_size" in params else kw.update(is_causal=True)
    if scaling is not None:
        if "scale" in params:
            kw["scale"] = scaling
        else:
            q = q * (scaling * math.sqrt(q.shape[-1]))
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in params:
            kw["enable_gqa"] = True
        else:
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return varlen_attn(q, k, v, cu, cu, longest, longest, **kw)


def torch_varlen_attention_forward(
    module,
    query,
    key,
    value,
    attention_mask,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    is_causal: bool | None = None,
    **kwargs,
):
    """transformers' attention-function contract: q/k/v (B, H, S, D) -> ((B, S, H, D), None)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    position_ids = kwargs.get("position_ids")
    B, H, S, D = query.shape
    if attention_mask is not None or position_ids is None or key.shape[2] != S:
        # padding or a KV cache: the mask function below built sdpa's mask (or None for plain causal decode)
        return sdpa_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            sliding_window=sliding_window,
            is_causal=is_causal,
            **kwargs,
        )
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if not causal or sliding_window is not None or (dropout > 0 and module.training):
        raise ValueError(
            f"attention implementation {NAME} runs causal full attention without dropout; this layer asks for "
            f"causal={causal}, sliding_window={sliding_window}, dropout={dropout}: use --attn_implementation sdpa"
        )
    if query.dtype not in (torch.bfloat16, torch.float16) or not query.is_cuda:
        raise ValueError(
            f"attention implementation {NAME} runs torch's flash-attention varlen kernel (CUDA, bf16/fp16); got "
            f"{query.dtype} on {query.device}: train in bf16 on a GPU or use --attn_implementation sdpa"
        )
    cu, longest = _cached_cu_seqlens(position_ids.to(query.device), B)
    out = _varlen(
        query.transpose(1, 2).reshape(B * S, H, D),
        key.transpose(1, 2).reshape(B * S, key.shape[1], D),
        value.transpose(1, 2).reshape(B * S, value.shape[1], D),
        cu,
        longest,
        scaling,
    )
    return out.view(B, S, H, D), None


def varlen_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset=0, attention_mask=None, **kwargs):
    """No mask where the position ids say it all (no padding, no cache); sdpa's mask otherwise."""
    from transformers.masking_utils import sdpa_mask

    plain = isinstance(q_offset, int) and isinstance(kv_offset, int) and q_offset == kv_offset == 0
    if plain and q_length == kv_length and (attention_mask is None or bool(attention_mask.all())):
        return None
    return sdpa_mask(
        batch_size=batch_size,
        q_length=q_length,
        kv_length=kv_length,
        q_offset=q_offset,
        kv_offset=kv_offset,
        attention_mask=attention_mask,
        **kwargs,
    )


@functools.cache
def register() -> str:
    """Register :data:`NAME` with transformers (attention function and mask); returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, torch_varlen_attention_forward)
    AttentionMaskInterface.register(NAME, varlen_mask)
    return NAME
