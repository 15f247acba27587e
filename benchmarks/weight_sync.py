"""Benchmark: the gloo weight broadcast (rl_rollout.transport) against a plain torch copy, same run, same bytes.

    uv run python benchmarks/weight_sync.py              # 256 MiB of float32 tensors, 64 MiB buckets
    uv run python benchmarks/weight_sync.py --mib 32     # a quick size

Methods:
- ``copy``: ``dst.copy_(src)`` tensor by tensor in one process (the memory-bandwidth ceiling).
- ``gloo``: ``CollectiveSender.send`` in this process (rank 0) to a ``CollectiveReceiver`` in a
  second process (rank 1) that copies every received tensor into its own preallocated weights,
  as an engine does; with the sha256 check (``verify``) and without (``no-verify``).
  Time is the sender's wall time of a whole sync: packing, hashing, broadcast, the receiver's
  load and check, and the final all-reduce.

Prints the best of ``--repeats`` for each, in GB/s (1e9 bytes), and the ratio gloo / copy.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time

import torch

TENSOR_MIB = 4


def make_weights(mib: int, seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    n = TENSOR_MIB * 2**20 // 4
    return [(f"layer.{i}.weight", torch.randn(n, generator=g)) for i in range(mib // TENSOR_MIB)]


def receiver(args) -> None:
    """Rank 1: takes ``2 * repeats`` syncs into preallocated tensors; prints its stats as JSON lines."""
    from rl_rollout.transport import CollectiveReceiver

    dst = {name: torch.empty_like(t) for name, t in make_weights(args.mib, seed=1)}

    def load(named):
        for name, t in named:
            dst[name].copy_(t)

    rx = CollectiveReceiver("127.0.0.1", args.port, 1, 2, timeout_s=300)
    for i in range(2 * args.repeats):
        stats = rx.receive(load, verify=i < args.repeats)
        print(json.dumps(stats.as_dict()), flush=True)
    rx.close()


def bench_copy(weights, repeats: int) -> float:
    dst = [torch.empty_like(t) for _, t in weights]
    best = float("inf")
    for _ in range(repeats + 1):  # the first pass faults the destination pages in
        t0 = time.perf_counter()
        for d, (_, s) in zip(dst, weights, strict=True):
            d.copy_(s)
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=256, help="total MiB of tensors (multiple of 4)")
    ap.add_argument("--bucket-mib", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--receiver", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.receiver:
        return receiver(args)

    from rl_rollout.transport import CollectiveSender

    weights = make_weights(args.mib)
    nbytes = sum(t.numel() * t.element_size() for _, t in weights)
    print(f"weight_sync: {len(weights)} float32 tensors, {nbytes / 2**20:.0f} MiB, buckets of {args.bucket_mib} MiB, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    copy_s = bench_copy(weights, args.repeats)

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    child = subprocess.Popen(
        [sys.executable, __file__, "--receiver", "--port", str(port), "--mib", str(args.mib), "--repeats", str(args.repeats)],
        stdout=subprocess.PIPE, text=True,
    )
    sender = CollectiveSender("127.0.0.1", port, 2, timeout_s=300)
    times = {"gloo verify": [], "gloo no-verify": []}
    for i in range(2 * args.repeats):
        key = "gloo verify" if i < args.repeats else "gloo no-verify"
        stats = sender.send(weights, version=i, bucket_bytes=args.bucket_mib * 2**20, checksum=key == "gloo verify")
        assert stats.bytes == nbytes
        times[key].append(stats.seconds)
    received = [json.loads(line) for line in child.communicate(timeout=300)[0].splitlines()]
    sender.close()
    assert child.returncode == 0 and all(r["bytes"] == nbytes for r in received), (child.returncode, received)

    print(f"{'method':<16}{'time s':>9}{'GB/s':>9}{'vs copy':>10}")
    print(f"{'copy':<16}{copy_s:>9.3f}{nbytes / copy_s / 1e9:>9.2f}{1.0:>10.3f}")
    for key, ts in times.items():
        best = min(ts)
        print(f"{key:<16}{best:>9.3f}{nbytes / best / 1e9:>9.2f}{copy_s / best:>10.3f}")
    best = min(times["gloo verify"])
    print(f"ratio: gloo (verified) runs at {copy_s / best:.3f}x the GB/s of a local torch copy "
          f"({nbytes / best / 1e9:.2f} vs {nbytes / copy_s / 1e9:.2f} GB/s)")


if __name__ == "__main__":
    main()
