"""Where one call's GPU time goes: torch.profiler over the call, summarised for a person deciding what to fix.

    out, text = profile_cuda(fn, *args, regions={"forward": (obj, "method"), ...}, **kwargs)

The report says: the call's wall seconds (to a device sync, profiler overhead included), the GPU's busy
seconds (the union of its kernels and copies), the idle share, the busy time by kind of kernel (GEMM,
attention, optimizer, copies, the rest), the host's waits on the device (stream/device synchronizations,
``.item()`` reads, blocking copies: count and seconds), the named regions' wall seconds (each ``(object,
method)`` given in ``regions`` wrapped in ``record_function`` for the call), the ten longest idle gaps, and the
top kernels. Used by benchmarks/grpo_vs_trl.py --ours_profile_train.
"""

from __future__ import annotations

import re
import time
from collections import defaultdict
from contextlib import ExitStack, contextmanager
from typing import Any

KINDS = (  # first match wins
    ("optimizer", re.compile(r"multi_tensor|adam|Adam|l2norm|LpNorm|norm_kernel", re.I)),
    ("attention", re.compile(r"flash|fmha|attention|sdpa", re.I)),
    ("gemm", re.compile(r"gemm|sm90_|sm80_|cutlass|nvjet|cublas|matmul|xmma", re.I)),
    ("copy", re.compile(r"^Memcpy|^Memset|copy_kernel|CatArrayBatched", re.I)),
    ("triton", re.compile(r"^triton_|_kernel$|liger", re.I)),
)
WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "aten::_local_scalar_dense",
         "cudaMemcpy", "aten::nonzero")


def _kind(name: str) -> str:
    return next((kind for kind, pattern in KINDS if pattern.search(name)), "other")


@contextmanager
def _regions(regions: dict[str, tuple[Any, str]]):
    """Each ``(obj, method)`` wrapped in ``torch.profiler.record_function(name)`` for the block."""
    import torch

    with ExitStack() as stack:
        for name, (obj, attr) in regions.items():
            inner = getattr(obj, attr)

            def wrapped(*a, _inner=inner, _name=name, **kw):
                with torch.profiler.record_function(f"region: {_name}"):
                    return _inner(*a, **kw)

            setattr(obj, attr, wrapped)
            stack.callback(setattr, obj, attr, inner)
        yield


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(s, e) for s, e in out]


def _caller(event, depth: int = 4) -> str:
    """The innermost ``depth`` Python frames above an event outside torch and this file (with_stack: the
    profiler records Python calls as the event's ancestors, ``file.py(line): function``; older torch put them
    in ``event.stack``)."""
    frames, up = list(event.stack or []), event.cpu_parent
    while up is not None:
        frames.append(up.name)
        up = up.cpu_parent
    keep = [f for f in frames if ".py(" in f and "torch/" not in f and "cuda_profile.py" not in f]
    return " <- ".join(f.split("/")[-1] for f in keep[:depth]) or "(no Python frame)"


def profile_cuda(fn, *args, regions: dict[str, tuple[Any, str]] | None = None, label: str = "call",
                 top: int = 25, **kwargs) -> tuple[Any, str]:
    """``fn(*args, **kwargs)`` under torch.profiler (CPU and CUDA); its result and the report (text)."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()  # without it (a smoke test on CPU) the GPU lines read zero
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with _regions(regions or {}), profile(activities=activities, with_stack=True) as prof:
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        sync()
        wall = time.perf_counter() - t0
    events = prof.events()
    # the regions' own spans on the GPU timeline (record_function) are annotations, not work
    device = [e for e in events if e.device_type == DeviceType.CUDA and not e.name.startswith(("region: ", "Optimizer."))]
    spans = [(e.time_range.start, e.time_range.end) for e in device]
    busy = _union(spans)
    busy_s = sum(e - s for s, e in busy) / 1e6
    by_kind: dict[str, float] = defaultdict(float)
    by_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in device:
        took = (e.time_range.end - e.time_range.start) / 1e6
        by_kind[_kind(e.name)] += took
        by_name[e.name][0] += 1
        by_name[e.name][1] += took
    gaps = sorted(((b[0] - a[1]) / 1e6 for a, b in zip(busy, busy[1:], strict=False)), reverse=True)
    host = [e for e in events if e.device_type == DeviceType.CPU]
    waits: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    callers: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0.0])
    named: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in host:
        if any(e.name.startswith(w) for w in WAITS):
            waits[e.name][0] += 1
            waits[e.name][1] += (e.time_range.end - e.time_range.start) / 1e6
            where = _caller(e)
            callers[e.name, where][0] += 1
            callers[e.name, where][1] += (e.time_range.end - e.time_range.start) / 1e6
        if e.name.startswith("region: "):
            named[e.name[8:]][0] += 1
            named[e.name[8:]][1] += (e.time_range.end - e.time_range.start) / 1e6
    own: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])  # host ops by self time (Python frames left out)
    for e in host:
        if ".py(" not in e.name and not e.name.startswith(("<", "region: ")):
            own[e.name][0] += 1
            own[e.name][1] += e.self_cpu_time_total / 1e6
    lines = [f"[profile] {label}: {wall:.3f} s wall (to a device sync, profiler on), GPU busy {busy_s:.3f} s "
             f"({busy_s / wall:.0%}), idle {wall - busy_s:.3f} s; {len(device)} kernels and copies",
             "[profile] GPU time by kind: " + ", ".join(f"{k} {v:.3f} s" for k, v in
                                                        sorted(by_kind.items(), key=lambda kv: -kv[1])),
             "[profile] host waits on the device: " + (", ".join(
                 f"{k} x{n} {s:.3f} s" for k, (n, s) in sorted(waits.items(), key=lambda kv: -kv[1][1])) or "none"),
             "[profile] regions (host wall, calls): " + (", ".join(
                 f"{k} {s:.3f} s x{n}" for k, (n, s) in sorted(named.items(), key=lambda kv: -kv[1][1])) or "none"),
             f"[profile] longest GPU idle gaps (ms): {', '.join(f'{g * 1e3:.2f}' for g in gaps[:10])}; "
             f"{sum(g for g in gaps if g > 1e-4):.3f} s in {sum(g > 1e-4 for g in gaps)} gaps over 0.1 ms",
             "[profile] who waits (calls, host seconds, innermost frames outside torch):",
             *(f"  x{int(n):<5d} {t:.4f} s  {name}: {where[:160]}" for (name, where), (n, t) in
               sorted(callers.items(), key=lambda kv: -kv[1][0])[:15]),
             "[profile] host ops by self time (calls, seconds): " + ", ".join(
                 f"{k} x{int(n)} {t:.3f}" for k, (n, t) in sorted(own.items(), key=lambda kv: -kv[1][1])[:12]),
             f"[profile] top {top} kernels by GPU time (calls, seconds, kind):"]
    for name, (n, s) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]:
        lines.append(f"  {s:8.4f} s  x{int(n):<6d} {_kind(name):<9} {name[:110]}")
    return out, "\n".join(lines)
