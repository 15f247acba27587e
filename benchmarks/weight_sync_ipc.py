"""Benchmark: the CUDA IPC weight transport (rl_rollout.ipc) against a plain GPU copy, same run, same bytes.

    python benchmarks/weight_sync_ipc.py              # 2 GiB of float32 tensors, 256 MiB buckets (needs a GPU)
    python benchmarks/weight_sync_ipc.py --mib 256    # a quick size

Methods:
- ``copy``: ``dst.copy_(src)`` tensor by tensor on one GPU in one process (the device-memory ceiling
  for moving the same bytes once).
- ``ipc``: a trainer process packs its tensors into CUDA buckets and shares their handles
  (``share_buckets``); this process (the engine) opens each handle and copies the tensors into its
  own preallocated weights (``open_bucket``), then acknowledges. Time is the trainer's wall time of
  the whole sync (pack + share + the engine's open, copy and synchronise). ``ipc+sha256`` adds the
  sender's checksum and the engine's check (both through host memory). ``ipc in place``
  (``pack=False``) shares each tensor's own memory: no packing copy.

Prints the best of ``--repeats`` in GB/s (1e9 bytes) and the ratio ipc / copy.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "packages", "rl-rollout", "src"))
TENSOR_MIB = 16


def make_weights(mib: int, seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    n = TENSOR_MIB * 2**20 // 4
    return [(f"layer.{i}.weight", torch.randn(n, generator=g, device="cuda")) for i in range(mib // TENSOR_MIB)]


def trainer(mib: int, bucket_mib: int, plan: list[bool], to_engine, from_engine) -> None:
    from rl_rollout.ipc import share_buckets

    weights = make_weights(mib)
    for mode in plan:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        buckets = list(share_buckets(weights, bucket_bytes=bucket_mib * 2**20, checksum=mode == "ipc+sha256",
                                     pack=mode != "ipc in place"))
        to_engine.put(buckets)
        from_engine.get()  # the engine loaded everything
        to_engine.put(time.perf_counter() - t0)
        del buckets
    to_engine.put(None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=2048, help=f"total MiB (multiple of {TENSOR_MIB})")
    ap.add_argument("--bucket-mib", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("CUDA IPC needs a GPU; this machine has none")
    import torch.multiprocessing as mp

    from rl_rollout.ipc import open_bucket

    src = make_weights(args.mib)
    dst = {name: torch.empty_like(t) for name, t in src}
    nbytes = sum(t.numel() * t.element_size() for _, t in src)
    print(f"weight_sync_ipc: {len(src)} float32 tensors, {nbytes / 2**20:.0f} MiB, buckets of {args.bucket_mib} MiB, "
          f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    copy_times = []
    for _ in range(args.repeats + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for name, t in src:
            dst[name].copy_(t)
        torch.cuda.synchronize()
        copy_times.append(time.perf_counter() - t0)
    copy_s = min(copy_times[1:])

    modes = ("ipc", "ipc in place", "ipc+sha256")
    plan = ["ipc"] + [m for _ in range(args.repeats) for m in modes]  # the first run warms up; then interleaved
    ctx = mp.get_context("spawn")
    to_engine, from_engine = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=trainer, args=(args.mib, args.bucket_mib, plan, to_engine, from_engine))
    proc.start()
    times: dict[str, list[float]] = {m: [] for m in modes}
    for i, mode in enumerate(plan):
        buckets = to_engine.get(timeout=600)
        for b in buckets:
            for name, t in open_bucket(b, verify=mode == "ipc+sha256"):
                dst[name].copy_(t)
        torch.cuda.synchronize()
        del buckets
        from_engine.put(True)
        seconds = to_engine.get(timeout=600)
        if i > 0:
            times[mode].append(seconds)
    assert to_engine.get(timeout=60) is None
    proc.join(60)
    for name, t in src:  # the engine holds exactly the trainer's weights
        assert torch.equal(dst[name], t), name

    print(f"{'method':<14}{'time s':>9}{'GB/s':>9}{'vs copy':>10}")
    print(f"{'copy':<14}{copy_s:>9.4f}{nbytes / copy_s / 1e9:>9.1f}{1.0:>10.3f}")
    for key, ts in times.items():
        best = min(ts)
        print(f"{key:<14}{best:>9.4f}{nbytes / best / 1e9:>9.1f}{copy_s / best:>10.3f}")
    for key in ("ipc", "ipc in place"):
        r = copy_s / min(times[key])
        print(f"ratio: {key} runs at {r:.3f}x the GB/s of a plain GPU copy (target >= 0.8: "
              f"{'met' if r >= 0.8 else 'NOT met'})")
    print("(packed ipc copies each byte twice: into the bucket, then into the engine's weights)")


if __name__ == "__main__":
    main()
