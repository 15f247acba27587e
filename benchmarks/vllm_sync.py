"""Seconds of one weight sync into an in-process vLLM engine, by load mode, against a device copy.

    python benchmarks/vllm_sync.py                  # GPU: a Qwen2.5-0.5B-shaped random Llama, bf16
    python benchmarks/vllm_sync.py --small          # the vLLM CPU build (layerwise mode only: see below)

One vLLM engine in this process (``in_process=True``, what ``rl ppo`` builds) and a transformers copy
of the same model as the "trainer" on the same device. Each mode runs ``--syncs`` syncs of every
trainer parameter (``engine.update_weights``: begin, load, finish, prefix-cache reset), the first left
out of the mean (it records the copy plan), then checks the engine holds the last weights sent
(``verify_weights``) and that greedy generation equals the trainer's own greedy tokens:

- ``layerwise``: vLLM's layerwise reload session (the default);
- ``direct``: ``RL_VLLM_DIRECT_LOAD=1 RL_VLLM_COPY_PLAN=0``, ``model.load_weights`` into the live parameters;
- ``plan``: ``RL_VLLM_DIRECT_LOAD=1``, the recorded copy plan replayed as one ``torch._foreach_copy_``;
- ``live``: as ``plan``, with ``update_weights(..., live=True)`` (what ``rl ppo`` sends under ZeRO-0/1/2: the
  trainer's own parameters, one group, the plan's source views kept between syncs).

Then, apart: the fixed cost of an update session that loads nothing (begin + finish), the worker's own host
time per load call (its copy plan's ``load_s``), one prefix-cache reset after a generation (vLLM walks every KV block; the engine skips it
when nothing was generated since the last), and with ``--profile`` a cProfile of one steady ``live`` sync
(``--torch_profile``: torch.profiler's host ops and device kernels of one).

Baseline in the same run: ``torch._foreach_copy_`` of the same tensors into same-shaped buffers (the
fastest a sync of these bytes can be on this device). Prints seconds, GB/s and the ratio of each mode's
rate to the copy's (1.0 = device speed). Direct modes need CUDA (on CPU vLLM repacks linear weights after
loading, so the worker ignores them and the CPU run shows the layerwise mode only).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

MODES = {"layerwise": {"RL_VLLM_DIRECT_LOAD": "0"},
         "direct": {"RL_VLLM_DIRECT_LOAD": "1", "RL_VLLM_COPY_PLAN": "0"},
         "plan": {"RL_VLLM_DIRECT_LOAD": "1", "RL_VLLM_COPY_PLAN": "1"},
         "live": {"RL_VLLM_DIRECT_LOAD": "1", "RL_VLLM_COPY_PLAN": "1"}}


def sync_device():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="tiny model (the vLLM CPU build)")
    ap.add_argument("--syncs", type=int, default=6, help="syncs per mode (the first is left out of the mean)")
    ap.add_argument("--modes", default=None, help="comma-separated subset of layerwise,direct,plan,live")
    ap.add_argument("--gpu_memory_utilization", type=float, default=0.3,
                    help="the engine's share of the GPU (its KV blocks: what a prefix-cache reset walks)")
    ap.add_argument("--profile", action="store_true", help="cProfile one steady live sync (top 25 by cumulative time, 15 by own time)")
    ap.add_argument("--torch_profile", action="store_true",
                    help="torch.profiler of one steady live sync: ops by self CPU time and by device time")
    ap.add_argument("--out", default=None, help="write the numbers as JSON here")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    modes = (args.modes or ("layerwise,direct,plan,live" if cuda else "layerwise")).split(",")

    from transformers import AutoModelForCausalLM

    from rl_rollout import EngineConfig, RolloutRequest, SamplingParams, weight_stats
    from rl_rollout.testing import make_tiny_model

    shape = (dict(hidden_size=128, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=256) if args.small
             else dict(hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, intermediate_size=4864))
    dtype = torch.bfloat16 if cuda else torch.float32
    path = make_tiny_model(Path(tempfile.mkdtemp(prefix="vllm-sync-")) / "model", **shape, peaked=True)
    trainer = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(dev).eval()
    params = [(n, p.detach()) for n, p in trainer.named_parameters()]
    nbytes = sum(t.numel() * t.element_size() for _, t in params)

    dst = [torch.empty_like(t) for _, t in params]
    copy_s = []
    for _ in range(10):
        sync_device()
        t0 = time.perf_counter()
        torch._foreach_copy_(dst, [t for _, t in params])
        sync_device()
        copy_s.append(time.perf_counter() - t0)
    del dst
    copy = min(copy_s)

    engine = EngineConfig(kind="vllm", enforce_eager=True, gpu_memory_utilization=args.gpu_memory_utilization).make(
        str(path), dtype="bf16" if cuda else "fp32", seed=0, device=str(dev), in_process=True,
        extra={"max_model_len": 512, **({} if cuda else {"engine_kwargs": {"kv_cache_memory_bytes": 1 << 30}})})
    prompt = RolloutRequest([5, 60, 70, 80], SamplingParams(temperature=0.0, n=1, max_new_tokens=12))
    results, version = {}, 0
    try:
        for mode in modes:
            os.environ.update(MODES[mode])
            times, reports = [], []
            for k in range(args.syncs):
                with torch.no_grad():  # new values every sync, as after an optimizer step
                    for _, t in params:
                        t.mul_(1.0 + 1e-3 * (k + 1))
                version += 1
                sync_device()
                t0 = time.perf_counter()
                engine.update_weights(params, version, **({"live": True} if mode == "live" else {}))
                sync_device()
                times.append(time.perf_counter() - t0)
                reports.append(getattr(engine, "last_sync_reports", [{}])[0].get("copy_plan"))
            engine.verify_weights(weight_stats(params))  # raises when the engine holds other values
            got = engine.generate([prompt])[0][0].response_ids
            with torch.no_grad():
                ids = torch.tensor([prompt.prompt_token_ids], device=dev)
                want = trainer.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1]:].tolist()
            later = times[1:] or times
            mean = statistics.mean(later)
            loads = [r["load_s"] for r in reports[1:] if r and "load_s" in r]
            results[mode] = {"first_s": times[0], "mean_s": mean, "min_s": min(later), "gb_per_s": nbytes / mean / 1e9,
                             "ratio_to_device_copy": copy / mean, "greedy_equal": got == want[:len(got)],
                             "copy_plan": reports[-1],
                             "worker_load_s": statistics.mean(loads) if loads else None}
        # a session with nothing in it: in the direct modes only (a layerwise one warns for every layer left out)
        session_s = None
        if {"plan", "live"} & set(modes):
            session_s, version = time_empty_session(engine, version)
        reset_s = time_prefix_reset(engine, prompt)
        if args.profile:
            profile_sync(engine, params, version + 1)
            version += 2
        if args.torch_profile:
            torch_profile_sync(engine, params, version + 1)
    finally:
        engine.shutdown()

    name = torch.cuda.get_device_name() if cuda else "cpu"
    print(f"vllm_sync: {name}; model {shape}; {len(params)} tensors, {nbytes / 1e9:.3f} GB "
          f"{'bf16' if cuda else 'fp32'}; means over syncs 2..{args.syncs}")
    print(f"device copy (torch._foreach_copy_): {copy * 1e3:.2f} ms = {nbytes / copy / 1e9:.0f} GB/s")
    print(f"{'mode':<11}{'first s':>9}{'mean s':>9}{'GB/s':>9}{'x copy':>8}  greedy==trainer  copy plan")
    for mode, r in results.items():
        print(f"{mode:<11}{r['first_s']:>9.4f}{r['mean_s']:>9.4f}{r['gb_per_s']:>9.1f}{r['ratio_to_device_copy']:>8.3f}"
              f"  {str(r['greedy_equal']):<15}  {r['copy_plan']}")
    if session_s is not None:
        print(f"an update session with no tensors (begin + finish, the engine's lock, two worker calls): "
              f"{session_s * 1e3:.3f} ms (median of 20)")
    for mode, r in results.items():
        if r["worker_load_s"] is not None:
            print(f"{mode}: the worker's load call, host time until the copies are queued: "
                  f"{r['worker_load_s'] * 1e3:.3f} ms (mean of syncs 2..{args.syncs}); the rest of "
                  f"{r['mean_s'] * 1e3:.3f} ms is the session, the engine's side and the device's copy")
    print(f"prefix-cache reset after a generation ({reset_s['blocks']} KV blocks): {reset_s['seconds'] * 1e3:.2f} ms "
          "(skipped by the engine when nothing was generated since the last reset)")
    if args.out:
        Path(args.out).write_text(json.dumps({"device": name, "shape": shape, "bytes": nbytes, "device_copy_s": copy,
                                              "modes": results, "prefix_reset": reset_s,
                                              "empty_session_s": session_s}, indent=1))


def time_empty_session(engine, version: int, n: int = 20) -> tuple[float, int]:
    """Median seconds of an update session that loads nothing (the fixed cost every sync pays around its copies),
    and the engine's version after the ``n`` sessions (each one after ``version``)."""
    times = []
    for _ in range(n):
        version += 1
        sync_device()
        t0 = time.perf_counter()
        engine.begin_weight_update()
        engine.finish_weight_update(version)
        sync_device()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), version


def time_prefix_reset(engine, prompt) -> dict:
    """Seconds of vLLM's own prefix-cache reset right after a generation, and the KV blocks it walks."""
    engine.generate([prompt])
    llm = engine._llm
    try:
        blocks = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool.num_gpu_blocks
    except AttributeError:  # another vLLM layout: the count is only informative
        blocks = None
    with engine._lock:
        t0 = time.perf_counter()
        llm.reset_prefix_cache()
        return {"seconds": time.perf_counter() - t0, "blocks": blocks}


def profile_sync(engine, params, version: int) -> None:
    import cProfile
    import pstats

    engine.update_weights(params, version, live=True)  # steady state first
    sync_device()
    prof = cProfile.Profile()
    prof.enable()
    engine.update_weights(params, version + 1, live=True)
    sync_device()
    prof.disable()
    pstats.Stats(prof).sort_stats("cumulative").print_stats(25)
    pstats.Stats(prof).sort_stats("tottime").print_stats(15)


def torch_profile_sync(engine, params, version: int) -> None:
    """Where a steady live sync's time goes: host-side ops (Python, launches) and device kernels."""
    from torch.profiler import ProfilerActivity, profile

    engine.update_weights(params, version, live=True)  # steady state first
    sync_device()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        engine.update_weights(params, version + 1, live=True)
        sync_device()
        wall = time.perf_counter() - t0
    print(f"torch.profiler, one steady live sync: {wall * 1e3:.2f} ms wall (profiler on)")
    avg = prof.key_averages()
    print(avg.table(sort_by="self_cpu_time_total", row_limit=15))
    if torch.cuda.is_available():
        print(avg.table(sort_by="self_device_time_total", row_limit=10))


if __name__ == "__main__":
    main()
