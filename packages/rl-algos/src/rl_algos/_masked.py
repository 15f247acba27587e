"""Masked reductions shared by every rl_algos module.

Shape convention: ``x`` and ``mask`` are ``[B, T]`` (or broadcastable); ``mask``
is 0/1 (bool or float) with 1 on the tokens that count. Reductions compute in
float32 or wider, so bf16 inputs do not lose the sum.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor


def compute_dtype(*tensors: Tensor) -> torch.dtype:
    """float64 if any input is float64, else float32 (never a half type)."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of ``x * mask`` over ``dim`` (all elements when ``None``), in float32+."""
    dt = compute_dtype(x)
    prod = x.to(dt) * mask.to(dt)
    return prod.sum() if dim is None else prod.sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``x`` over the masked-in elements; 0 where nothing is masked in.

    ``dim=None`` averages over every masked-in element of the tensor.
    """
    num = masked_sum(x, mask, dim)
    den = mask.to(num.dtype).sum() if dim is None else mask.to(num.dtype).sum(dim)
    return num / den.clamp(min=1.0)


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = False) -> Tensor:
    """Variance of the masked-in elements of ``x`` (a scalar)."""
    mean = masked_mean(x, mask)
    centred_sq = (x.to(mean.dtype) - mean) ** 2
    var = masked_mean(centred_sq, mask)
    if unbiased:
        n = mask.to(mean.dtype).sum()
        if n < 2:
            raise ValueError(f"unbiased variance needs at least 2 masked-in elements, got {int(n)}")
        var = var * n / (n - 1)
    return var


def check_same_shape(**tensors: Tensor | None) -> None:
    """Raise a ValueError naming every argument when shapes disagree."""
    shapes = {name: tuple(t.shape) for name, t in tensors.items() if t is not None}
    if len(set(shapes.values())) > 1:
        listed = ", ".join(f"{k}={v}" for k, v in shapes.items())
        raise ValueError(f"shape mismatch: {listed}; all must be the same [batch, seq] shape")


def last_token_index(mask_BT: Tensor) -> tuple[Tensor, Tensor]:
    """Index of the last masked-in position of each row and whether the row has one.

    Returns ``(index_B, has_token_B)``; ``index_B`` is 0 for empty rows.
    """
    T = mask_BT.shape[-1]
    m = mask_BT.to(torch.bool)
    has = m.any(dim=-1)
    idx = T - 1 - torch.flip(m, dims=[-1]).to(torch.int8).argmax(dim=-1)
    return torch.where(has, idx, torch.zeros_like(idx)), has


def place_on_last_token(scores_B: Tensor, mask_BT: Tensor) -> Tensor:
    """``[B, T]`` tensor holding ``scores_B[b]`` on row b's last masked-in token, 0 elsewhere."""
    if scores_B.dim() != 1 or scores_B.shape[0] != mask_BT.shape[0]:
        raise ValueError(f"scores must be [batch]={mask_BT.shape[0]}, got shape {tuple(scores_B.shape)}")
    dt = compute_dtype(scores_B)
    out = torch.zeros(mask_BT.shape, dtype=dt, device=mask_BT.device)
    idx, has = last_token_index(mask_BT)
    out.scatter_(1, idx.unsqueeze(1), (scores_B.to(dt) * has.to(dt)).unsqueeze(1))
    return out
