"""Token log-probs (and entropy) straight from hidden states and the LM head, chunk by chunk: the
``[tokens, V]`` logits are never held whole, in forward or backward.

A policy's log-probs usually come from ``logits = lm_head(hidden)`` (``[N, V]``, 4.6 GiB in bf16 for
16,384 tokens of a 151,936-word vocabulary), then a log-softmax kernel over them; autograd keeps the
logits for that kernel's backward and writes a gradient of the same size. Here ``N`` is cut into chunks of
``chunk_tokens`` rows: each chunk's logits are computed (``F.linear`` in the weight's dtype, as the model's
own head computes them), reduced to the label's log-prob (and the entropy) by
:func:`rl_algos.logprobs_and_entropy_from_logits` (the Triton kernel on CUDA), and freed. Backward
recomputes each chunk's logits (one more LM-head matmul per chunk: the price of the memory), takes the
kernel's gradient of that chunk and turns it into the hidden states' gradient (``d logits @ W``) and the
head's (``d logits^T @ hidden``, summed over chunks in float32, cast to the weight's dtype once).

Memory beyond the inputs: one chunk of logits and its gradient (``chunk_tokens x V``) and, in backward,
a float32 ``[V, H]`` accumulator for the head's gradient. The values are those of the unfused path to
rounding: the same matmul per row and the same kernel; chunking changes only the order of the head
gradient's sum (in float32 here, in the weight's dtype inside the unfused matmul).

:func:`weighted_logprob_sum_from_hidden` is the variant for a loss linear in the log-probs (SFT's NLL): the
upstream gradient of every log-prob is its weight, known in forward, so every gradient is computed there and
backward recomputes nothing (liger-kernel's fused linear cross-entropy does the same for a mean loss).

Benchmark: ``benchmarks/fused_lm_head.py``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rl_algos.losses.logits import (
    LogprobsEntropy,
    _check_temperature,
    logprobs_and_entropy_from_logits,
    logprobs_from_logits,
)

Tensor = torch.Tensor

# Logits per chunk (elements) by default. CPU: 64M, 256 MiB in float32 (441 tokens of a 151,936-word vocabulary;
# the CPU kernel re-chunks each one to what fits its cache). CUDA: 512M, 1 GiB in bf16 (3,533 tokens there): on one
# H200 (benchmarks/fused_lm_head.py, 16,384 tokens, bf16) the forward+backward took 3.12x the full logits' time at
# 441-token chunks, 1.81x at 2,048, 1.60x at 4,096, 1.46x at 8,192 (SFT's weighted sum: 2.65x, 1.42x, 1.24x, 1.13x)
# against a peak of 1.5, 1.9, 2.9, 5.3 GiB (full logits: 9.5 GiB): small chunks leave the GPU idle between matmuls.
CPU_CHUNK_ELEMENTS = 1 << 26
CUDA_CHUNK_ELEMENTS = 1 << 29


def _tokens_per_chunk(vocab: int, chunk_tokens: int | None, device: torch.device) -> int:
    if chunk_tokens is not None:
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        return chunk_tokens
    budget = CUDA_CHUNK_ELEMENTS if device.type == "cuda" else CPU_CHUNK_ELEMENTS
    return max(1, budget // max(vocab, 1))


def _float(t: Tensor) -> torch.dtype:
    """The float type results and sums are kept in: float64 for float64 inputs, else float32."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


class _HeadGrads:
    """The gradients of the hidden states, the head's weight and its bias, filled chunk by chunk from each chunk's
    ``d logits`` (the head's in a float32 sum, cast to its dtype once)."""

    def __init__(self, hidden_NH: Tensor, weight_VH: Tensor, bias_V: Tensor | None, need: tuple[bool, bool, bool]):
        self.weight = weight_VH
        acc = _float(weight_VH)
        self.h = torch.empty_like(hidden_NH) if need[0] else None
        self.w = torch.zeros(weight_VH.shape, dtype=acc, device=weight_VH.device) if need[1] else None
        self.b = torch.zeros(bias_V.shape, dtype=acc, device=bias_V.device) if need[2] and bias_V is not None else None
        self.bias_dtype = None if bias_V is None else bias_V.dtype

    @property
    def any(self) -> bool:
        return self.h is not None or self.w is not None or self.b is not None

    def add(self, s: int, h: Tensor, g_logits: Tensor) -> None:
        """Rows ``s : s + len(h)``: ``d hidden = d logits @ W``, ``d W += d logits^T @ hidden``, ``d b += sum``."""
        if self.h is not None:
            self.h[s : s + h.shape[0]] = g_logits @ self.weight
        if self.w is not None:  # in place where the dtypes agree (no [V, H] temporary per chunk)
            if g_logits.dtype == self.w.dtype:
                self.w.addmm_(g_logits.t(), h)
            else:
                self.w += (g_logits.t() @ h).to(self.w.dtype)
        if self.b is not None:
            self.b += g_logits.sum(0).to(self.b.dtype)

    def result(self) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        return (
            self.h,
            None if self.w is None else self.w.to(self.weight.dtype),
            None if self.b is None else self.b.to(self.bias_dtype),
        )


def _chunk_grad(logits_fn, outs_and_grads) -> Tensor:
    """``d logits`` of one chunk: the kernel's own backward of ``outs_and_grads(logits)`` (pairs of an output
    and its upstream gradient) on a fresh leaf of the chunk's logits."""
    with torch.enable_grad():
        logits = logits_fn().detach().requires_grad_()
        pairs = outs_and_grads(logits)
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
    return logits.grad


class _FusedHeadFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        hidden_NH: Tensor,
        weight_VH: Tensor,
        bias_V: Tensor | None,
        labels_N: Tensor,
        temperature: float,
        chunk: int,
        with_entropy: bool,
    ):
        N = hidden_NH.shape[0]
        lp = torch.empty(N, dtype=_float(hidden_NH), device=hidden_NH.device)
        ent = torch.empty(N, dtype=_float(hidden_NH), device=hidden_NH.device) if with_entropy else None
        for s in range(0, N, chunk):
            logits, lab = F.linear(hidden_NH[s : s + chunk], weight_VH, bias_V), labels_N[s : s + chunk]
            if ent is not None:
                lp[s : s + chunk], ent[s : s + chunk] = logprobs_and_entropy_from_logits(logits, lab, temperature)
            else:
                lp[s : s + chunk] = logprobs_from_logits(logits, lab, temperature)
        ctx.save_for_backward(hidden_NH, weight_VH, bias_V, labels_N)
        ctx.temperature, ctx.chunk, ctx.with_entropy = temperature, chunk, with_entropy
        return (lp, ent) if with_entropy else lp

    @staticmethod
    def backward(ctx, grad_lp: Tensor | None, grad_ent: Tensor | None = None):
        hidden_NH, weight_VH, bias_V, labels_N = ctx.saved_tensors
        T, chunk = ctx.temperature, ctx.chunk
        grads = _HeadGrads(hidden_NH, weight_VH, bias_V, ctx.needs_input_grad[:3])
        for s in range(0, hidden_NH.shape[0], chunk):
            h, lab = hidden_NH[s : s + chunk], labels_N[s : s + chunk]

            def pairs(logits, s=s, lab=lab):
                if ctx.with_entropy:
                    outs = logprobs_and_entropy_from_logits(logits, lab, T)
                    return [
                        (o, g[s : s + chunk]) for o, g in zip(outs, (grad_lp, grad_ent), strict=True) if g is not None
                    ]
                return [(logprobs_from_logits(logits, lab, T), grad_lp[s : s + chunk])]

            grads.add(s, h, _chunk_grad(lambda h=h: F.linear(h, weight_VH, bias_V), pairs))
        return (*grads.result(), None, None, None, None)


def _check_inputs(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    bias: Tensor | None,
    temperature: float,
    token_weights: Tensor | None = None,
) -> None:
    _check_temperature(temperature)
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(
            f"labels shape {tuple(labels.shape)} must equal hidden's without the hidden axis {tuple(hidden.shape[:-1])}"
        )
    if token_weights is not None and token_weights.shape != labels.shape:
        raise ValueError(
            f"token_weights shape {tuple(token_weights.shape)} must equal the labels' {tuple(labels.shape)}"
        )
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"weight must be [vocabulary, hidden] with hidden {hidden.shape[-1]}, got {tuple(weight.shape)}"
        )
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias must be [{weight.shape[0]}], got {tuple(bias.shape)}")


def logprobs_from_hidden(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    *,
    bias: Tensor | None = None,
    temperature: float = 1.0,
    return_entropy: bool = False,
    chunk_tokens: int | None = None,
) -> Tensor | LogprobsEntropy:
    """``log softmax((hidden @ weight^T + bias) / temperature)[label]`` per position, without the logits.

    Shapes: ``hidden`` ``[..., H]``, ``weight`` ``[V, H]`` (an LM head's, tied or not), ``bias`` ``[V]`` or None,
    ``labels`` ``[...]`` int64 -> ``[...]`` float32 (float64 for float64 inputs). ``return_entropy``: a
    :class:`LogprobsEntropy` of both (the entropy of the same tempered distribution). Differentiable w.r.t.
    ``hidden``, ``weight`` and ``bias``. ``chunk_tokens`` positions at a time; the default keeps a chunk's logits
    near 64M elements on CPU, 512M on CUDA (where larger chunks keep the GPU busy: see the constants).
    """
    _check_inputs(hidden, weight, labels, bias, temperature)
    flat = hidden.reshape(-1, hidden.shape[-1])
    chunk = _tokens_per_chunk(weight.shape[0], chunk_tokens, hidden.device)
    out = _FusedHeadFn.apply(flat, weight, bias, labels.reshape(-1).long(), float(temperature), chunk, return_entropy)
    if return_entropy:
        return LogprobsEntropy(out[0].view(labels.shape), out[1].view(labels.shape))
    return out.view(labels.shape)


class _WeightedHeadFn(torch.autograd.Function):
    """``sum(w * logprob)`` with every gradient computed in forward (the upstream gradient of each log-prob is
    its weight, known before backward), so backward only scales them: no recompute, no logits kept."""

    @staticmethod
    def forward(
        ctx,
        hidden_NH: Tensor,
        weight_VH: Tensor,
        bias_V: Tensor | None,
        labels_N: Tensor,
        weights_N: Tensor,
        temperature: float,
        chunk: int,
    ):
        N = hidden_NH.shape[0]
        lp = torch.empty(N, dtype=_float(hidden_NH), device=hidden_NH.device)
        grads = _HeadGrads(
            hidden_NH,
            weight_VH,
            bias_V,
            (hidden_NH.requires_grad, weight_VH.requires_grad, bias_V is not None and bias_V.requires_grad),
        )
        for s in range(0, N, chunk):
            h, lab, w = hidden_NH[s : s + chunk], labels_N[s : s + chunk], weights_N[s : s + chunk]
            if not grads.any:  # nothing asks for a gradient (no_grad, frozen inputs): the values only
                lp[s : s + chunk] = logprobs_from_logits(F.linear(h, weight_VH, bias_V), lab, temperature)
                continue
            kept: list[Tensor] = []

            def pairs(logits, lab=lab, w=w, kept=kept):
                kept.append(logprobs_from_logits(logits, lab, temperature))
                return [(kept[0], w.to(kept[0].dtype))]

            grads.add(s, h, _chunk_grad(lambda h=h: F.linear(h, weight_VH, bias_V), pairs))
            lp[s : s + chunk] = kept[0].detach()
        total = (lp * weights_N.to(lp.dtype)).sum()
        ctx.save_for_backward(*grads.result())
        ctx.mark_non_differentiable(lp)
        return total, lp

    @staticmethod
    def backward(ctx, grad_total: Tensor, _grad_lp: Tensor | None):
        return (*(None if g is None else g * grad_total.to(g.dtype) for g in ctx.saved_tensors), None, None, None, None)


def weighted_logprob_sum_from_hidden(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    token_weights: Tensor,
    *,
    bias: Tensor | None = None,
    temperature: float = 1.0,
    chunk_tokens: int | None = None,
) -> tuple[Tensor, Tensor]:
    """``(sum(token_weights * logprob), logprob)`` for a loss linear in the log-probs (SFT's token-mean NLL:
    weights ``-mask / tokens``), the LM head fused as in :func:`logprobs_from_hidden` but with its gradients
    computed during forward: each chunk's logits are made, reduced and differentiated once, so backward
    recomputes nothing (the matmuls of the unfused path, none of its logits). Holds the hidden states'
    gradient and the head's (``[V, H]``) from forward to backward.

    Shapes as :func:`logprobs_from_hidden`, ``token_weights`` like ``labels`` (constants: no gradient flows to
    them). The returned log-probs are values only (no gradient); the sum carries the gradients of ``hidden``,
    ``weight`` and ``bias``.
    """
    _check_inputs(hidden, weight, labels, bias, temperature, token_weights)
    flat = hidden.reshape(-1, hidden.shape[-1])
    chunk = _tokens_per_chunk(weight.shape[0], chunk_tokens, hidden.device)
    total, lp = _WeightedHeadFn.apply(
        flat, weight, bias, labels.reshape(-1).long(), token_weights.detach().reshape(-1), float(temperature), chunk
    )
    return total, lp.view(labels.shape)
