"""Per-token log-probabilities and entropy from logits, chunked so that no second
full ``[B, T, V]`` tensor is ever held.

The naive ``log_softmax(logits.float(), -1).gather(...)`` materialises an fp32
copy of the logits (and its log-softmax, so two ``[B, T, V]`` fp32 tensors; 4.6 GiB
at B=4, T=1024, V=151,936) to keep a ``[B, T]`` result. Some frameworks loop over
rows in the input dtype instead, which saves memory but loses precision in bf16
(errors around 6e-2 in log-prob units, enough to distort PPO ratios).

Here the rows are processed in chunks of ``chunk_rows``: each chunk is upcast to
float32 (float64 stays float64), its log-sum-exp and the label's logit are kept,
and the chunk is freed. Backward recomputes the softmax chunk by chunk and writes
``d logits`` straight into the gradient buffer (which autograd needs anyway), so
training memory is also one chunk plus the gradient. Temperature is applied
inside the chunk (``logits / T``) instead of on a full copy.

On CUDA the public functions run a Triton kernel instead (``logits_triton``: one pass
over the vocabulary per row, online float32 log-sum-exp, no chunk copies) when triton
imports and the logits are bf16, fp16 or fp32. ``RL_LOGPROBS_KERNEL=torch|triton`` forces
a path (``auto``, the default, picks as above); asking for triton where it cannot run is
an error. An explicit ``chunk_rows`` is a knob of the torch path and selects it.

Benchmark: ``benchmarks/logprobs_from_logits.py``.
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch

Tensor = torch.Tensor

# Logits per chunk. On CPU a chunk that stays in cache (2 MiB of float32) is fastest:
# measured on a 2-core AVX-512 machine, V=151,936: 0.62 s for 4096 rows at 3-4 rows
# a chunk, 1.1 s at 16, 2.8 s at 64. On GPU bigger chunks amortise kernel launches.
CPU_CHUNK_ELEMENTS = 1 << 19
GPU_CHUNK_ELEMENTS = 1 << 24


def _rows_per_chunk(vocab: int, chunk_rows: int | None, device: torch.device) -> int:
    if chunk_rows is not None:
        if chunk_rows < 1:
            raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
        return chunk_rows
    budget = CPU_CHUNK_ELEMENTS if device.type == "cpu" else GPU_CHUNK_ELEMENTS
    return max(1, budget // max(vocab, 1))


def _upcast(x: Tensor) -> Tensor:
    """A fresh float32 (float64 for float64) copy: callers modify it in place."""
    return x.to(torch.float64 if x.dtype == torch.float64 else torch.float32, copy=True)


def _check_temperature(temperature: float) -> None:
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")


KERNEL_ENV = "RL_LOGPROBS_KERNEL"
KERNEL_CHOICES = ("auto", "torch", "triton")
KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@functools.cache
def _triton_import_error() -> str | None:
    try:
        import triton  # noqa: F401
    except ImportError as e:
        return f"triton does not import ({e})"
    return None


def _triton_unavailable(logits: Tensor) -> str | None:
    """Why the Triton kernel cannot take these logits, or None if it can."""
    if logits.dtype not in KERNEL_DTYPES:
        return f"logits dtype {logits.dtype} has no triton kernel (bfloat16, float16, float32 do)"
    if logits.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return f"logits are on {logits.device} (the kernel needs CUDA, or TRITON_INTERPRET=1 to interpret it on CPU)"
    return _triton_import_error()


def _use_triton(logits: Tensor, chunk_rows: int | None) -> bool:
    choice = os.environ.get(KERNEL_ENV, "auto")
    if choice not in KERNEL_CHOICES:
        raise ValueError(f"{KERNEL_ENV}={choice!r} is not one of {', '.join(KERNEL_CHOICES)}")
    if choice == "torch":
        return False
    reason = _triton_unavailable(logits)
    if choice == "auto":  # the interpreter on CPU is for tests: only when forced
        return reason is None and logits.device.type == "cuda" and chunk_rows is None
    if reason is not None:
        raise RuntimeError(f"{KERNEL_ENV}=triton but {reason}; unset {KERNEL_ENV} or set it to torch")
    if chunk_rows is not None:
        raise ValueError(
            f"chunk_rows={chunk_rows} applies to the chunked torch path only; drop it or set {KERNEL_ENV}=torch"
        )
    return True


class _LogprobsFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_NV: Tensor, labels_N: Tensor, temperature: float, rows: int) -> Tensor:
        N = logits_NV.shape[0]
        out_dtype = torch.float64 if logits_NV.dtype == torch.float64 else torch.float32
        out = torch.empty(N, dtype=out_dtype, device=logits_NV.device)
        lse = torch.empty(N, dtype=out_dtype, device=logits_NV.device)
        for s in range(0, N, rows):
            x = _upcast(logits_NV[s : s + rows])
            if temperature != 1.0:
                x = x.div_(temperature)
            lse[s : s + rows] = torch.logsumexp(x, dim=-1)
            out[s : s + rows] = x.gather(-1, labels_N[s : s + rows].unsqueeze(-1)).squeeze(-1) - lse[s : s + rows]
        ctx.save_for_backward(logits_NV, labels_N, lse)
        ctx.temperature, ctx.rows = temperature, rows
        return out

    @staticmethod
    def backward(ctx, grad_N: Tensor):
        logits_NV, labels_N, lse = ctx.saved_tensors
        T, rows = ctx.temperature, ctx.rows
        grad_logits = torch.empty_like(logits_NV)
        for s in range(0, logits_NV.shape[0], rows):
            x = _upcast(logits_NV[s : s + rows])
            if T != 1.0:
                x = x.div_(T)
            # d logp(y) / d x_j = 1[j = y] - softmax(x)_j, times 1/T for the temperature
            p = x.sub_(lse[s : s + rows].unsqueeze(-1)).exp_()
            g = grad_N[s : s + rows].to(p.dtype).unsqueeze(-1)
            p.mul_(-g)
            p.scatter_add_(-1, labels_N[s : s + rows].unsqueeze(-1), g)
            if T != 1.0:
                p.div_(T)
            grad_logits[s : s + rows] = p
        return grad_logits, None, None, None


class _EntropyFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_NV: Tensor, temperature: float, rows: int) -> Tensor:
        N = logits_NV.shape[0]
        out_dtype = torch.float64 if logits_NV.dtype == torch.float64 else torch.float32
        out = torch.empty(N, dtype=out_dtype, device=logits_NV.device)
        for s in range(0, N, rows):
            x = _upcast(logits_NV[s : s + rows])
            if temperature != 1.0:
                x = x.div_(temperature)
            # H = -sum p log p, not lse - sum p x: no cancellation between two large terms
            logp = x.sub_(torch.logsumexp(x, dim=-1, keepdim=True))
            out[s : s + rows] = -(logp.exp() * logp).sum(-1)
        ctx.save_for_backward(logits_NV)
        ctx.temperature, ctx.rows = temperature, rows
        return out

    @staticmethod
    def backward(ctx, grad_N: Tensor):
        (logits_NV,) = ctx.saved_tensors
        T, rows = ctx.temperature, ctx.rows
        grad_logits = torch.empty_like(logits_NV)
        for s in range(0, logits_NV.shape[0], rows):
            x = _upcast(logits_NV[s : s + rows])
            if T != 1.0:
                x = x.div_(T)
            p = torch.softmax(x, dim=-1)
            mean_x = (p * x).sum(-1, keepdim=True)
            # dH/dx_j = p_j (E_p[x] - x_j)
            g = p.mul_(mean_x - x).mul_(grad_N[s : s + rows].to(p.dtype).unsqueeze(-1))
            if T != 1.0:
                g.div_(T)
            grad_logits[s : s + rows] = g
        return grad_logits, None, None


class LogprobsEntropy(NamedTuple):
    logprobs: Tensor
    entropy: Tensor


def _check_labels(logits: Tensor, labels: Tensor) -> None:
    if logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"labels shape {tuple(labels.shape)} must equal logits shape without the vocab axis "
            f"{tuple(logits.shape[:-1])}"
        )


def _triton(logits: Tensor, labels: Tensor | None, temperature: float, with_entropy: bool) -> LogprobsEntropy:
    # lazy: the Triton kernel (CUDA only) pulls triton
    from rl_algos.losses.logits_triton import TritonLogprobsEntropyFn

    lab = None if labels is None else labels.reshape(-1).long().contiguous()
    lp, ent = TritonLogprobsEntropyFn.apply(logits, lab, float(temperature), with_entropy)
    lead = logits.shape[:-1]
    return LogprobsEntropy(lp.view(lead) if labels is not None else lp, ent.view(lead) if with_entropy else ent)


def logprobs_from_logits(
    logits: Tensor, labels: Tensor, temperature: float = 1.0, chunk_rows: int | None = None
) -> Tensor:
    """log softmax(logits / temperature)[label] per position, in float32 (float64 for float64 logits).

    Shape: ``logits`` ``[..., V]`` (e.g. ``[B, T, V]``), ``labels`` ``[...]`` int64 ->
    ``[...]``. Differentiable w.r.t. ``logits``. ``chunk_rows`` rows (positions) are
    processed at a time; the default keeps a chunk near 512K elements on CPU, 16M on GPU.
    Accuracy: float32 log-sum-exp (max abs error vs float64 ~1e-6 on bf16 logits).
    On CUDA (see the module docstring) the Triton kernel runs instead; there a label
    outside ``[0, V)`` gives NaN rather than an error.
    """
    _check_temperature(temperature)
    _check_labels(logits, labels)
    if _use_triton(logits, chunk_rows):
        return _triton(logits, labels, temperature, with_entropy=False).logprobs
    V = logits.shape[-1]
    flat = logits.reshape(-1, V)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    out = _LogprobsFn.apply(
        flat, labels.reshape(-1).long(), float(temperature), _rows_per_chunk(V, chunk_rows, logits.device)
    )
    return out.view(labels.shape)


def entropy_from_logits(logits: Tensor, temperature: float = 1.0, chunk_rows: int | None = None) -> Tensor:
    """Entropy ``H = -sum_j p_j log p_j``, ``p = softmax(logits / temperature)``.

    Shape ``[..., V]`` -> ``[...]`` float32 (float64 for float64). Differentiable, chunked
    like :func:`logprobs_from_logits`.
    """
    _check_temperature(temperature)
    if _use_triton(logits, chunk_rows):
        return _triton(logits, None, temperature, with_entropy=True).entropy
    V = logits.shape[-1]
    flat = logits.reshape(-1, V)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    out = _EntropyFn.apply(flat, float(temperature), _rows_per_chunk(V, chunk_rows, logits.device))
    return out.view(logits.shape[:-1])


def logprobs_and_entropy_from_logits(
    logits: Tensor, labels: Tensor, temperature: float = 1.0, chunk_rows: int | None = None
) -> LogprobsEntropy:
    """Both :func:`logprobs_from_logits` and :func:`entropy_from_logits`, shapes ``[...]``.

    The Triton kernel computes both in one pass over the logits (and one backward pass for
    both gradients); the torch path runs the two chunked functions.
    """
    _check_temperature(temperature)
    _check_labels(logits, labels)
    if _use_triton(logits, chunk_rows):
        return _triton(logits, labels, temperature, with_entropy=True)
    return LogprobsEntropy(
        logprobs_from_logits(logits, labels, temperature, chunk_rows),
        entropy_from_logits(logits, temperature, chunk_rows),
    )
