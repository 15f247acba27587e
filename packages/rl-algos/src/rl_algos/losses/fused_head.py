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

# Logits per chunk (elements): 64M, 256 MiB in float32 (441 tokens of a 151,936-word vocabulary); the CPU
# path's kernel re-chunks each one to what fits its cache.
CHUNK_ELEMENTS = 1 << 26


def _tokens_per_chunk(vocab: int, chunk_tokens: int | None) -> int:
    if chunk_tokens is not None:
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        return chunk_tokens
    return max(1, CHUNK_ELEMENTS // max(vocab, 1))


class _FusedHeadFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_NH: Tensor, weight_VH: Tensor, bias_V: Tensor | None, labels_N: Tensor,
                temperature: float, chunk: int, with_entropy: bool):
        N = hidden_NH.shape[0]
        out_dtype = torch.float64 if hidden_NH.dtype == torch.float64 else torch.float32
        lp = torch.empty(N, dtype=out_dtype, device=hidden_NH.device)
        ent = torch.empty(N, dtype=out_dtype, device=hidden_NH.device) if with_entropy else None
        for s in range(0, N, chunk):
            logits, lab = F.linear(hidden_NH[s : s + chunk], weight_VH, bias_V), labels_N[s : s + chunk]
            if with_entropy:
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
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(hidden_NH) if need_h else None
        grad_w = torch.zeros(weight_VH.shape, dtype=torch.float32 if weight_VH.dtype != torch.float64
                             else torch.float64, device=weight_VH.device) if need_w else None
        grad_b = torch.zeros(bias_V.shape, dtype=grad_w.dtype if grad_w is not None else torch.float32,
                             device=bias_V.device) if need_b else None
        for s in range(0, hidden_NH.shape[0], chunk):
            h = hidden_NH[s : s + chunk]
            lab = labels_N[s : s + chunk]
            with torch.enable_grad():  # the kernel's own backward gives this chunk's d logits
                logits = F.linear(h, weight_VH, bias_V).detach().requires_grad_()
                if ctx.with_entropy:
                    outs = logprobs_and_entropy_from_logits(logits, lab, T)
                    pairs = [(o, g[s : s + chunk]) for o, g in zip(outs, (grad_lp, grad_ent)) if g is not None]
                else:
                    pairs = [(logprobs_from_logits(logits, lab, T), grad_lp[s : s + chunk])]
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
            g_logits = logits.grad
            if need_h:
                grad_h[s : s + chunk] = g_logits @ weight_VH
            if need_w:  # in place where the dtypes agree (no [V, H] temporary per chunk)
                if g_logits.dtype == grad_w.dtype:
                    grad_w.addmm_(g_logits.t(), h)
                else:
                    grad_w += (g_logits.t() @ h).to(grad_w.dtype)
            if need_b:
                grad_b += g_logits.sum(0).to(grad_b.dtype)
        return (grad_h, None if grad_w is None else grad_w.to(weight_VH.dtype),
                None if grad_b is None else grad_b.to(bias_V.dtype), None, None, None, None)


def logprobs_from_hidden(
    hidden: Tensor, weight: Tensor, labels: Tensor, *, bias: Tensor | None = None, temperature: float = 1.0,
    return_entropy: bool = False, chunk_tokens: int | None = None,
) -> Tensor | LogprobsEntropy:
    """``log softmax((hidden @ weight^T + bias) / temperature)[label]`` per position, without the logits.

    Shapes: ``hidden`` ``[..., H]``, ``weight`` ``[V, H]`` (an LM head's, tied or not), ``bias`` ``[V]`` or None,
    ``labels`` ``[...]`` int64 -> ``[...]`` float32 (float64 for float64 inputs). ``return_entropy``: a
    :class:`LogprobsEntropy` of both (the entropy of the same tempered distribution). Differentiable w.r.t.
    ``hidden``, ``weight`` and ``bias``. ``chunk_tokens`` positions at a time; the default keeps a chunk's logits
    near 64M elements.
    """
    _check_temperature(temperature)
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(f"labels shape {tuple(labels.shape)} must equal hidden's without the hidden axis "
                         f"{tuple(hidden.shape[:-1])}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight must be [vocabulary, hidden] with hidden {hidden.shape[-1]}, got "
                         f"{tuple(weight.shape)}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias must be [{weight.shape[0]}], got {tuple(bias.shape)}")
    flat = hidden.reshape(-1, hidden.shape[-1])
    chunk = _tokens_per_chunk(weight.shape[0], chunk_tokens)
    out = _FusedHeadFn.apply(flat, weight, bias, labels.reshape(-1).long(), float(temperature), chunk, return_entropy)
    if return_entropy:
        return LogprobsEntropy(out[0].view(labels.shape), out[1].view(labels.shape))
    return out.view(labels.shape)


class _WeightedHeadFn(torch.autograd.Function):
    """``sum(w * logprob)`` with every gradient computed in forward (the upstream gradient of each log-prob is
    its weight, known before backward), so backward only scales them: no recompute, no logits kept."""

    @staticmethod
    def forward(ctx, hidden_NH: Tensor, weight_VH: Tensor, bias_V: Tensor | None, labels_N: Tensor,
                weights_N: Tensor, temperature: float, chunk: int):
        N = hidden_NH.shape[0]
        out_dtype = torch.float64 if hidden_NH.dtype == torch.float64 else torch.float32
        lp = torch.empty(N, dtype=out_dtype, device=hidden_NH.device)
        acc = torch.float64 if weight_VH.dtype == torch.float64 else torch.float32
        grad_h = torch.empty_like(hidden_NH) if hidden_NH.requires_grad else None
        grad_w = torch.zeros(weight_VH.shape, dtype=acc, device=weight_VH.device) if weight_VH.requires_grad else None
        grad_b = torch.zeros(bias_V.shape, dtype=acc, device=bias_V.device) \
            if bias_V is not None and bias_V.requires_grad else None
        grads = grad_h is not None or grad_w is not None or grad_b is not None
        for s in range(0, N, chunk):
            h, lab, w = hidden_NH[s : s + chunk], labels_N[s : s + chunk], weights_N[s : s + chunk]
            if not grads:  # nothing asks for a gradient (no_grad, frozen inputs): the values only
                lp[s : s + chunk] = logprobs_from_logits(F.linear(h, weight_VH, bias_V), lab, temperature)
                continue
            with torch.enable_grad():
                logits = F.linear(h, weight_VH, bias_V).detach().requires_grad_()
                lp_c = logprobs_from_logits(logits, lab, temperature)
                torch.autograd.backward(lp_c, w.to(lp_c.dtype))
            lp[s : s + chunk] = lp_c.detach()
            g_logits = logits.grad
            if grad_h is not None:
                grad_h[s : s + chunk] = g_logits @ weight_VH
            if grad_w is not None:
                if g_logits.dtype == grad_w.dtype:
                    grad_w.addmm_(g_logits.t(), h)
                else:
                    grad_w += (g_logits.t() @ h).to(grad_w.dtype)
            if grad_b is not None:
                grad_b += g_logits.sum(0).to(grad_b.dtype)
        total = (lp * weights_N.to(lp.dtype)).sum()
        ctx.save_for_backward(grad_h, None if grad_w is None else grad_w.to(weight_VH.dtype),
                              None if grad_b is None else grad_b.to(bias_V.dtype))
        ctx.mark_non_differentiable(lp)
        return total, lp

    @staticmethod
    def backward(ctx, grad_total: Tensor, _grad_lp: Tensor | None):
        grad_h, grad_w, grad_b = ctx.saved_tensors
        scale = (lambda g: None if g is None else g * grad_total.to(g.dtype))  # noqa: E731
        return scale(grad_h), scale(grad_w), scale(grad_b), None, None, None, None


def weighted_logprob_sum_from_hidden(
    hidden: Tensor, weight: Tensor, labels: Tensor, token_weights: Tensor, *, bias: Tensor | None = None,
    temperature: float = 1.0, chunk_tokens: int | None = None,
) -> tuple[Tensor, Tensor]:
    """``(sum(token_weights * logprob), logprob)`` for a loss linear in the log-probs (SFT's token-mean NLL:
    weights ``-mask / tokens``), the LM head fused as in :func:`logprobs_from_hidden` but with its gradients
    computed during forward: each chunk's logits are made, reduced and differentiated once, so backward
    recomputes nothing (the matmuls of the unfused path, none of its logits). Holds the hidden states'
    gradient and a float32 ``[V, H]`` head gradient from forward to backward.

    Shapes as :func:`logprobs_from_hidden`, ``token_weights`` like ``labels`` (constants: no gradient flows to
    them). The returned log-probs are values only (no gradient); the sum carries the gradients of ``hidden``,
    ``weight`` and ``bias``.
    """
    _check_temperature(temperature)
    if hidden.shape[:-1] != labels.shape or token_weights.shape != labels.shape:
        raise ValueError(f"labels {tuple(labels.shape)} and token_weights {tuple(token_weights.shape)} must both "
                         f"equal hidden's shape without the hidden axis {tuple(hidden.shape[:-1])}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight must be [vocabulary, hidden] with hidden {hidden.shape[-1]}, got "
                         f"{tuple(weight.shape)}")
    flat = hidden.reshape(-1, hidden.shape[-1])
    chunk = _tokens_per_chunk(weight.shape[0], chunk_tokens)
    total, lp = _WeightedHeadFn.apply(flat, weight, bias, labels.reshape(-1).long(),
                                      token_weights.detach().reshape(-1), float(temperature), chunk)
    return total, lp.view(labels.shape)
