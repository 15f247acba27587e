"""Benchmark: rl_algos.logprobs_from_logits against two baselines, same run, same data.

    uv run python benchmarks/logprobs_from_logits.py              # B=4, T=1024, V=151,936, bf16
    uv run python benchmarks/logprobs_from_logits.py --small      # a quick shape
    python3 benchmarks/logprobs_from_logits.py --device cuda      # GPU: see logprobs_cuda.py

Needs only torch and the repo's rl_algos (``PYTHONPATH=packages/rl-algos/src`` without uv).

Methods (CPU):
- ``naive``: ``log_softmax(logits.float(), -1).gather(...)`` (a float32 copy + its log-softmax).
- ``rowwise_bf16``: a loop over batch rows, ``log_softmax`` in the input dtype (bf16), as
  frameworks do to save memory (OpenRLHF's ``log_probs_from_logits`` for bf16 logits).
- ``rl_algos``: chunked float32 log-sum-exp (``rl_algos.losses.logits``).

On CUDA (``--device cuda``, ``logprobs_cuda.py``) the Triton kernel is added, forward and
forward+backward are timed with CUDA events, and memory is the allocator's peak.

For each on CPU: wall time (best of ``--repeats``), peak extra resident memory (``ru_maxrss``
growth in a fresh process, so one method's peak cannot hide another's), and the max abs
error against a float64 reference computed chunk by chunk. Prints ratios against the
baselines and whether the targets hold (error <= 1e-5, memory <= naive / 20, time <=
rowwise_bf16).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

import torch

METHODS = ("naive", "rowwise_bf16", "rl_algos")


def make_inputs(B: int, T: int, V: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.empty(B, T, V, dtype=torch.bfloat16)
    for b in range(B):  # filled 16 positions at a time: no large float32 temporary
        for t in range(0, T, 16):
            logits[b, t : t + 16] = (torch.randn(min(16, T - t), V, generator=g) * 3).bfloat16()
    labels = torch.randint(0, V, (B, T), generator=g)
    return logits, labels


def run_method(name: str, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    if name == "naive":
        return torch.log_softmax(logits.float(), -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    if name == "rowwise_bf16":
        rows = [torch.log_softmax(row, -1).gather(-1, lab.unsqueeze(-1)).squeeze(-1) for row, lab in zip(logits, labels)]
        return torch.stack(rows)
    from rl_algos.losses import logprobs_from_logits

    return logprobs_from_logits(logits, labels)


def reference(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    out = torch.empty(labels.shape, dtype=torch.float64)
    for b in range(logits.shape[0]):
        for s in range(0, logits.shape[1], 16):
            x = logits[b, s : s + 16].double()
            out[b, s : s + 16] = torch.log_softmax(x, -1).gather(-1, labels[b, s : s + 16].unsqueeze(-1)).squeeze(-1)
    return out


def child(args) -> None:
    """One method in a fresh process: prints a JSON line with time, peak extra memory, error."""
    logits, labels = make_inputs(args.batch, args.seq, args.vocab)
    run_method(args.child, logits[:, :8], labels[:, :8])  # warm-up: kernels, allocator
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    out = run_method(args.child, logits, labels)
    first = time.perf_counter() - t0
    peak = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) * 1024
    err = (out.double() - reference(logits, labels)).abs().max().item()  # after the peak was read
    times = [first]
    for _ in range(args.repeats - 1):
        t0 = time.perf_counter()
        run_method(args.child, logits, labels)
        times.append(time.perf_counter() - t0)
    print(json.dumps({"method": args.child, "time_s": min(times), "peak_extra_bytes": peak, "max_abs_err": err}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--repeats", type=int, default=None, help="default: 3 on CPU, 20 on CUDA")
    ap.add_argument("--small", action="store_true", help="B=2, T=256, V=32,000")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                    help="auto: cuda when torch sees a GPU")
    ap.add_argument("--json", help="also write the results to this file (CUDA only)")
    ap.add_argument("--child", choices=METHODS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.small:
        args.batch, args.seq, args.vocab = 2, 256, 32_000
    if args.child:
        return child(args)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.repeats is None:
        args.repeats = 20 if args.device == "cuda" else 3
    if args.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.device == "cuda":
        if not torch.cuda.is_available():
            ap.error("--device cuda, but torch sees no CUDA device; use --device cpu")
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from logprobs_cuda import main_cuda

        return main_cuda(args)
    if args.json:
        ap.error("--json is written by the CUDA benchmark only; drop it or add --device cuda")

    print(f"logprobs_from_logits: B={args.batch} T={args.seq} V={args.vocab} bf16 logits "
          f"({args.batch * args.seq * args.vocab * 2 / 2**30:.2f} GiB), torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    res = {}
    for m in METHODS:
        cmd = [sys.executable, __file__, "--child", m, "--batch", str(args.batch), "--seq", str(args.seq),
               "--vocab", str(args.vocab), "--repeats", str(args.repeats)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        res[m] = json.loads(out.strip().splitlines()[-1])
    print(f"{'method':<14}{'time s':>9}{'peak extra GiB':>16}{'max abs err':>14}")
    for m, r in res.items():
        print(f"{m:<14}{r['time_s']:>9.3f}{r['peak_extra_bytes'] / 2**30:>16.3f}{r['max_abs_err']:>14.2e}")
    ours, naive, row = res["rl_algos"], res["naive"], res["rowwise_bf16"]
    mem_ratio = ours["peak_extra_bytes"] / max(naive["peak_extra_bytes"], 1)
    print(f"ratios: time vs naive {ours['time_s'] / naive['time_s']:.2f}x, vs rowwise_bf16 "
          f"{ours['time_s'] / row['time_s']:.2f}x; memory vs naive {mem_ratio:.3f}x; "
          f"error vs rowwise_bf16 {ours['max_abs_err'] / row['max_abs_err']:.1e}x")
    checks = {
        "error <= 1e-5": ours["max_abs_err"] <= 1e-5,
        "memory <= naive/20": mem_ratio <= 1 / 20,
        "time <= rowwise_bf16": ours["time_s"] <= row["time_s"],
    }
    print("targets: " + ", ".join(f"{k}: {'yes' if v else 'NO'}" for k, v in checks.items()))


if __name__ == "__main__":
    main()
