"""Benchmark: the CUDA IPC weight transport (rl_rollout.ipc) against a plain GPU copy, same run, same bytes.

    python benchmarks/weight_sync_ipc.py              # 16 GiB of float32 tensors (a 8B model in bf16), 256 MiB buckets
    python benchmarks/weight_sync_ipc.py --mib 2048   # a quicker size (needs a GPU either way)

Methods:
- ``copy``: ``dst.copy_(src)`` tensor by tensor on one GPU in one process (the device-memory ceiling
  for moving the same bytes once).
- ``ipc``: a trainer process packs its tensors into CUDA buckets and shares their handles
  (``share_buckets``); this process (the engine) opens each handle and copies the tensors into its
  own preallocated weights (``open_bucket``), then acknowledges. Time is the trainer's wall time of
  the whole sync (pack + share + the engine's open, copy and synchronise). ``ipc+sha256`` (``--sha256``) adds the
  sender's checksum and the engine's check (both through host memory). ``ipc in place``
  (``pack=False``) shares each tensor's own memory: no packing copy.
- ``sender`` / ``sender in place``: the same through a persistent ``IpcSender`` and the engine's
  ``IpcReceiver`` (what an RL loop does every step): handles are shared and opened once (a warm-up
  sync, not timed), later syncs refill the same buckets (packed) or nothing (in place) and send keys.

Prints the best of ``--repeats`` in GB/s (1e9 bytes), the ratio ipc / copy, and ``engine s``: the
engine's own part of a sync (open or look up, copy, synchronise), without the trainer's side and
the two pipe messages (``multiprocessing.Pipe``) that carry the sync and the acknowledgement.
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


def recv(conn, timeout_s: float = 600):
    if not conn.poll(timeout_s):
        raise TimeoutError(f"nothing from the other process in {timeout_s} s")
    return conn.recv()


def trainer(mib: int, bucket_mib: int, plan: list[str], conn) -> None:
    from rl_rollout.ipc import IpcSender, share_buckets

    weights = make_weights(mib)
    senders = {"sender": IpcSender(bucket_bytes=bucket_mib * 2**20),
               "sender in place": IpcSender(bucket_bytes=bucket_mib * 2**20, pack=False)}
    for mode in plan:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if mode in senders:
            buckets = senders[mode].share(weights)
        else:
            buckets = list(share_buckets(weights, bucket_bytes=bucket_mib * 2**20, checksum=mode == "ipc+sha256",
                                         pack=mode != "ipc in place"))
        conn.send(buckets)
        recv(conn)  # the engine loaded everything
        conn.send(time.perf_counter() - t0)
        del buckets
    conn.send(None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=16384, help=f"total MiB (multiple of {TENSOR_MIB})")
    ap.add_argument("--bucket-mib", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--sha256", action="store_true", help="also time ipc+sha256 (host hashing, ~0.2 GB/s: slow)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("CUDA IPC needs a GPU; this machine has none")
    import torch.multiprocessing as mp

    from rl_rollout.ipc import IpcReceiver, open_bucket

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

    def digest(t):  # exact: the bits summed as integers
        return t.view(torch.int32).to(torch.int64).sum().item()

    expected = {name: digest(t) for name, t in src}  # for the final check, without keeping src
    del src
    torch.cuda.empty_cache()

    modes = ("sender", "sender in place", "ipc", "ipc in place") + (("ipc+sha256",) if args.sha256 else ())
    warm = ["ipc", "sender", "sender in place"]  # the first one-shot run warms up; senders share their handles
    plan = warm + [m for _ in range(args.repeats) for m in modes]  # then interleaved
    receivers = {"sender": IpcReceiver(), "sender in place": IpcReceiver()}
    ctx = mp.get_context("spawn")
    conn, trainer_conn = ctx.Pipe()
    proc = ctx.Process(target=trainer, args=(args.mib, args.bucket_mib, plan, trainer_conn))
    proc.start()
    times: dict[str, list[float]] = {m: [] for m in modes}
    engine_times: dict[str, list[float]] = {m: [] for m in modes}
    for i, mode in enumerate(plan):
        buckets = recv(conn)
        t_engine = time.perf_counter()
        groups = (receivers[mode].load(buckets) if mode in receivers
                  else (open_bucket(b, verify=mode == "ipc+sha256") for b in buckets))
        for named in groups:
            for name, t in named:
                dst[name].copy_(t)
        torch.cuda.synchronize()
        t_engine = time.perf_counter() - t_engine
        del buckets
        conn.send(True)
        seconds = recv(conn)
        if i >= len(warm):
            times[mode].append(seconds)
            engine_times[mode].append(t_engine)
    assert recv(conn, 60) is None
    proc.join(60)
    for receiver in receivers.values():
        receiver.close()
    for name, total in expected.items():  # the engine holds the trainer's weights (same seed)
        assert digest(dst[name]) == total, name

    print(f"{'method':<17}{'time s':>9}{'GB/s':>9}{'vs copy':>10}{'engine s':>10}")
    print(f"{'copy':<17}{copy_s:>9.4f}{nbytes / copy_s / 1e9:>9.1f}{1.0:>10.3f}{copy_s:>10.4f}")
    for key, ts in times.items():
        best = min(ts)
        print(f"{key:<17}{best:>9.4f}{nbytes / best / 1e9:>9.1f}{copy_s / best:>10.3f}{min(engine_times[key]):>10.4f}")
    for key in ("sender", "sender in place", "ipc", "ipc in place"):
        r = copy_s / min(times[key])
        print(f"ratio: {key} runs at {r:.3f}x the GB/s of a plain GPU copy (target >= 0.8: "
              f"{'met' if r >= 0.8 else 'NOT met'})")
    print("(packed ipc copies each byte twice: into the bucket, then into the engine's weights)")


if __name__ == "__main__":
    main()
