"""The CUDA half of ``logprobs_from_logits.py`` (run that with ``--device cuda``): token
log-probs from bf16 logits on one GPU, every method in one process on the same data.

Methods:
- ``naive``: ``log_softmax(logits.float(), -1).gather(...)``.
- ``rowwise_bf16``: OpenRLHF's path for bf16 logits (``openrlhf/models/utils.py``,
  ``log_probs_from_logits``): a loop over batch rows, ``log_softmax`` in bf16, gather, stack.
  It is the baseline the ratios are taken against.
- ``torch_chunked``: rl_algos' chunked float32 torch path (``RL_LOGPROBS_KERNEL=torch``).
- ``triton``: rl_algos' Triton kernel (``RL_LOGPROBS_KERNEL=triton``).
- ``triton+entropy``: the same kernel computing the entropy too, in the same pass
  (``logprobs_and_entropy_from_logits``; its error column is the worse of the two outputs).

Per method: forward time and forward+backward time (median of ``--repeats`` after two
warm-ups, CUDA events; the backward is of ``sum(w * logprobs)``), the allocator's peak
above what was allocated before the call (forward; forward+backward counts the logits'
gradient, which every method must write), and the max abs error against float64.
``read_once`` is ``logits.amax(-1)``: the time to read the logits once, the floor.
"""

from __future__ import annotations

import json
import os
import statistics

import torch

from rl_algos.losses import logits as L

METHODS = ("naive", "rowwise_bf16", "torch_chunked", "triton", "triton+entropy")
MiB = 2**20


def run(name: str, logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(logprobs, entropy or None)``."""
    if name == "naive":
        return torch.log_softmax(logits.float(), -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1), None
    if name == "rowwise_bf16":
        rows = [torch.log_softmax(r, -1).gather(-1, y.unsqueeze(-1)).squeeze(-1) for r, y in zip(logits, labels)]
        return torch.stack(rows), None
    os.environ[L.KERNEL_ENV] = "torch" if name == "torch_chunked" else "triton"
    if name == "triton+entropy":
        return tuple(L.logprobs_and_entropy_from_logits(logits, labels))
    return L.logprobs_from_logits(logits, labels), None


def reference(logits: torch.Tensor, labels: torch.Tensor, rows: int = 256):
    """float64 log-probs and entropies, ``rows`` positions at a time."""
    x_NV, y_N = logits.detach().reshape(-1, logits.shape[-1]), labels.reshape(-1)
    lp, ent = torch.empty(y_N.shape, dtype=torch.float64, device=x_NV.device), torch.empty_like(y_N, dtype=torch.float64)
    for s in range(0, x_NV.shape[0], rows):
        l = torch.log_softmax(x_NV[s : s + rows].double(), -1)
        lp[s : s + rows] = l.gather(-1, y_N[s : s + rows, None]).squeeze(-1)
        ent[s : s + rows] = -(l.exp() * l).sum(-1)
    return lp.view(labels.shape), ent.view(labels.shape)


def timed(fn, repeats: int) -> float:
    """Median milliseconds of ``fn()`` over ``repeats`` runs, after two warm-ups."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def peak_extra(fn) -> int:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def measure(name: str, logits: torch.Tensor, labels: torch.Tensor, w: torch.Tensor, ref, repeats: int) -> dict:
    def fwd():
        with torch.no_grad():
            run(name, logits, labels)

    def fwd_bwd():
        x = logits.detach().requires_grad_(True)
        lp, ent = run(name, x, labels)
        loss = (lp * w).sum() + (ent.sum() if ent is not None else 0)
        loss.backward()

    lp, ent = run(name, logits, labels)
    err = (lp.double() - ref[0]).abs().max().item()
    if ent is not None:
        err = max(err, (ent.double() - ref[1]).abs().max().item())
    del lp, ent
    return {"method": name, "fwd_ms": timed(fwd, repeats), "fwd_bwd_ms": timed(fwd_bwd, repeats),
            "fwd_peak_extra_bytes": peak_extra(fwd), "fwd_bwd_peak_extra_bytes": peak_extra(fwd_bwd),
            "max_abs_err": err}


def main_cuda(args) -> None:
    dev = torch.device("cuda")
    B, T, V = args.batch, args.seq, args.vocab
    g = torch.Generator(device=dev).manual_seed(0)
    logits = (torch.randn(B, T, V, generator=g, device=dev, dtype=torch.bfloat16) * 3)
    labels = torch.randint(0, V, (B, T), generator=g, device=dev)
    w = torch.randn(B, T, generator=g, device=dev)
    ref = reference(logits, labels)
    gib = logits.numel() * logits.element_size() / 2**30
    print(f"logprobs_from_logits on {torch.cuda.get_device_name()}: B={B} T={T} V={V} bf16 logits ({gib:.2f} GiB), "
          f"torch {torch.__version__}, repeats {args.repeats}")
    read_ms = timed(lambda: logits.amax(-1), args.repeats)
    print(f"read_once (logits.amax(-1)): {read_ms:.3f} ms = {gib * 2**30 / read_ms / 1e6:.0f} GB/s")
    res = {m: measure(m, logits, labels, w, ref, args.repeats) for m in METHODS}
    row = res["rowwise_bf16"]
    print(f"{'method':<16}{'fwd ms':>9}{'fwd+bwd ms':>12}{'fwd x':>8}{'f+b x':>8}{'fwd MiB':>10}"
          f"{'f+b MiB':>10}{'max abs err':>13}")
    for m, r in res.items():
        print(f"{m:<16}{r['fwd_ms']:>9.3f}{r['fwd_bwd_ms']:>12.3f}{r['fwd_ms'] / row['fwd_ms']:>8.2f}"
              f"{r['fwd_bwd_ms'] / row['fwd_bwd_ms']:>8.2f}{r['fwd_peak_extra_bytes'] / MiB:>10.0f}"
              f"{r['fwd_bwd_peak_extra_bytes'] / MiB:>10.0f}{r['max_abs_err']:>13.2e}")
    print(f"(x: time / rowwise_bf16's in this run; f+b MiB includes the {gib * 1024:.0f} MiB logits gradient)")
    ours, naive = res["triton"], res["naive"]
    checks = {
        "error <= 1e-5": ours["max_abs_err"] <= 1e-5,
        "fwd memory <= naive/20": ours["fwd_peak_extra_bytes"] <= naive["fwd_peak_extra_bytes"] / 20,
        "fwd time <= rowwise_bf16": ours["fwd_ms"] <= row["fwd_ms"],
        "fwd+bwd time <= rowwise_bf16": ours["fwd_bwd_ms"] <= row["fwd_bwd_ms"],
    }
    print("targets (triton): " + ", ".join(f"{k}: {'yes' if v else 'NO'}" for k, v in checks.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": [B, T, V], "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "read_once_ms": read_ms, "results": res, "targets": checks}, f, indent=1)
