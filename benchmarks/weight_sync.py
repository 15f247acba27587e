"""Benchmark: the gloo weight broadcast (rl_rollout.transport) against a plain torch copy, same run, same bytes.

    uv run python benchmarks/weight_sync.py              # 256 MiB of float32 tensors, 64 MiB buckets
    uv run python benchmarks/weight_sync.py --mib 32     # a quick size
    python benchmarks/weight_sync.py --backend nccl --mib 2048   # 2 GPUs: cuda:0 -> cuda:1

Methods:
- ``copy``: ``dst.copy_(src)`` tensor by tensor in one process (the memory-bandwidth ceiling,
  which no transport between two processes reaches).
- ``raw``: the same tensors moved by the bare collective, one ``broadcast`` per tensor straight
  into the receiver's preallocated weights, no metadata, no checks (the plain copy of the same
  bytes over the same link; what the transport adds to it is the wrapper's cost).
- ``gloo``: ``CollectiveSender.send`` in this process (rank 0) to a ``CollectiveReceiver`` in a
  second process (rank 1) that copies every received tensor into its own preallocated weights,
  as an engine does; with the sha256 check (``verify``) and without (``no-verify``); ``in place``
  receives straight into the receiver's weights (``targets``, what HFEngine does) without the check.
  Time is the sender's wall time of a whole sync: packing, hashing, broadcast, the receiver's
  load and check, and the final all-reduce.

With ``--backend nccl`` the sender's tensors sit on ``cuda:0`` and the receiver's on
``cuda:1``, and ``copy`` is a ``cuda:0 -> cuda:1`` ``copy_`` of the same tensors (the
peer-to-peer ceiling). Prints the best of ``--repeats`` for each, in GB/s (1e9 bytes), and the ratios to raw and to copy.
The sender overlaps packing (and hashing) bucket k+1 with the broadcast of bucket k.
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
MODES = ("verify", "no-verify", "in place")


def make_weights(mib: int, seed: int = 0, device: str = "cpu") -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    n = TENSOR_MIB * 2**20 // 4
    return [(f"layer.{i}.weight", torch.randn(n, generator=g).to(device)) for i in range(mib // TENSOR_MIB)]


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def receiver(args) -> None:
    """Rank 1: takes ``2 * repeats`` syncs into preallocated tensors; prints its stats as JSON lines."""
    from rl_rollout.transport import CollectiveReceiver

    dev = "cpu" if args.backend == "gloo" else "cuda:1"
    dst = {name: torch.empty_like(t) for name, t in make_weights(args.mib, seed=1, device=dev)}

    def load(named):
        for name, t in named:
            dst[name].copy_(t)
        sync(dev)

    rx = CollectiveReceiver("127.0.0.1", args.port, 1, 2, backend=args.backend, device=dev, timeout_s=300)
    for i in range(3 * args.repeats):
        mode = MODES[i // args.repeats]
        stats = rx.receive(load, verify=mode == "verify", targets=dst if mode == "in place" else None)
        print(json.dumps(stats.as_dict()), flush=True)
    for _ in range(args.repeats + 1):  # raw: every tensor broadcast straight into its destination
        for t in dst.values():
            rx.group.broadcast_(t)
        rx.group.count_failures(False)
    rx.close()


def bench_copy(weights, repeats: int, dst_device: str = "cpu") -> float:
    dst = [torch.empty_like(t, device=dst_device) for _, t in weights]
    best = float("inf")
    for _ in range(repeats + 1):  # the first pass faults the destination pages in
        sync(dst_device)
        t0 = time.perf_counter()
        for d, (_, s) in zip(dst, weights, strict=True):
            d.copy_(s)
        sync(dst_device)
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=256, help="total MiB of tensors (multiple of 4)")
    ap.add_argument("--bucket-mib", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    ap.add_argument("--receiver", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.receiver:
        return receiver(args)

    from rl_rollout.transport import CollectiveSender

    if args.backend == "nccl" and torch.cuda.device_count() < 2:
        raise SystemExit(f"--backend nccl needs 2 GPUs (sender cuda:0, receiver cuda:1); "
                         f"this machine has {torch.cuda.device_count()}")
    dev = "cpu" if args.backend == "gloo" else "cuda:0"
    weights = make_weights(args.mib, device=dev)
    nbytes = sum(t.numel() * t.element_size() for _, t in weights)
    print(f"weight_sync: {len(weights)} float32 tensors, {nbytes / 2**20:.0f} MiB, buckets of {args.bucket_mib} MiB, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    copy_s = bench_copy(weights, args.repeats, "cpu" if args.backend == "gloo" else "cuda:1")

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    child = subprocess.Popen(
        [sys.executable, __file__, "--receiver", "--port", str(port), "--mib", str(args.mib), "--repeats", str(args.repeats),
         "--backend", args.backend],
        stdout=subprocess.PIPE, text=True,
    )
    sender = CollectiveSender("127.0.0.1", port, 2, backend=args.backend, device=dev, timeout_s=300)
    b = args.backend
    times = {f"{b} {m}": [] for m in MODES}
    for i in range(3 * args.repeats):
        key = f"{b} {MODES[i // args.repeats]}"
        stats = sender.send(weights, version=i, bucket_bytes=args.bucket_mib * 2**20, checksum=key == f"{b} verify")
        assert stats.bytes == nbytes
        times[key].append(stats.seconds)
    raw = []
    for _ in range(args.repeats + 1):  # the first pass faults the receiver's pages in
        sync(dev)
        t0 = time.perf_counter()
        for _, t in weights:
            sender.group.broadcast_(t)
        sender.group.count_failures(False)
        raw.append(time.perf_counter() - t0)
    raw_s = min(raw[1:])
    received = [json.loads(line) for line in child.communicate(timeout=300)[0].splitlines()]
    sender.close()
    assert child.returncode == 0 and all(r["bytes"] == nbytes for r in received), (child.returncode, received)

    print(f"{'method':<16}{'time s':>9}{'GB/s':>9}{'vs copy':>10}{'vs raw':>9}")
    rows = [("copy", copy_s), (f"{b} raw", raw_s)] + [(k, min(ts)) for k, ts in times.items()]
    for key, best in rows:
        print(f"{key:<16}{best:>9.3f}{nbytes / best / 1e9:>9.2f}{copy_s / best:>10.3f}{raw_s / best:>9.3f}")
    for key in (f"{b} in place", f"{b} no-verify", f"{b} verify"):
        best = min(times[key])
        print(f"ratio: {key} runs at {raw_s / best:.3f}x the GB/s of the raw {b} broadcast of the same tensors "
              f"(target >= 0.8: {'met' if raw_s / best >= 0.8 else 'NOT met'}) and {copy_s / best:.3f}x an "
              f"in-process copy")


if __name__ == "__main__":
    main()
