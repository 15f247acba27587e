"""Where the RL loop's generation time goes: ``VLLMEngine.generate`` against ``vllm.LLM.generate``.

    python3 benchmarks/vllm_generate.py                           # GPU: 0.5B-shaped random Llama, bf16
    .venv-vllm/bin/python benchmarks/vllm_generate.py --small     # vLLM's CPU build, tiny model, fp32
    python3 benchmarks/vllm_generate.py --profile                 # and cProfile of one engine call
    python3 benchmarks/vllm_generate.py --shape qwen2.5-0.5b --lengths varied --new_tokens 1024 \
        --gpu_memory_utilization 0.15 --variants default,no_async_scheduling   # the loop's batch, two engine builds
    python3 benchmarks/vllm_generate.py --shape qwen2.5-0.5b --lengths varied --new_tokens 1024 \
        --gpu_memory_utilization 0.15 --between none,sync,gpu_work,empty_cache,sync_gpu_work,neighbor

One vLLM engine in this process (``in_process=True``, what ``rl ppo`` builds, CUDA graphs on unless
``--small``), the batch of the GPU GRPO comparison (benchmarks/grpo_vs_trl.py): ``--prompts`` 16
prompts x ``--samples`` 8 samples x ``--new_tokens`` 128 tokens, temperature 1, every response forced
to full length (``ignore_eos``), the sampled token's log-prob returned; with ``--lengths varied`` each response
forced to the length grpo_vs_trl.py draws for it (long tail up to ``--new_tokens``), one request per sample as
its loop sends them, prompts of 33-192 tokens. The methods run on the same ``LLM`` instance, taking turns within
each round (median of ``--repeats`` after one warm-up each):

- ``vllm_raw``: ``LLM.generate`` with ``n`` samples per prompt, no per-request seed (vLLM's engine-wide
  random stream), token prompts, ``detokenize=False``, final outputs only: the floor for this batch;
- ``vllm_raw_seeded``: the same with one seed per request, as ``VLLMEngine`` sends them (vLLM then draws
  each sequence's noise with its own ``torch.Generator``: one kernel per row per decode step, which vLLM's
  sampler marks as possibly slow);
- ``VLLMEngine``: ``engine.generate`` on requests built as rl-core's PPO rollout builds them;
  ``VLLMEngine_unseeded`` the same without seeds;
- ``one_request``: one request of ``--new_tokens`` alone: the milliseconds of one decode step at batch 1, the
  floor of a batch's long tail.

``--variants`` builds the engine several ways, each in its own process (VARIANTS: vLLM's defaults, async
scheduling off or on, the engine core in a child process). ``--between`` also times ``VLLMEngine`` right after
each of what the RL loop does between two generate calls (BETWEEN: the in-process sync, a training phase's memory
and matmuls, ``empty_cache``, an idle engine in a second process), in turn.

Prints seconds, generated tokens/s and each method's time over ``vllm_raw``'s (1.00 = vLLM's own speed).
Measured (docs/performance.md, "The in-loop generate gap"): at Qwen2.5-0.5B's real shape and the loop's varied
lengths on one H100, VLLMEngine 2.81 s, raw vLLM 2.67 s, seeds costing nothing, one decode step 1.64 ms;
vLLM's async scheduling (on by default) is worth 1.41x; none of the ``--between`` steps moved the engine's time
beyond the spread of back-to-back calls.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from grpo_vs_trl import SHAPES, step_lengths  # noqa: E402  (the same shapes and length draws as the side by side)

# --variants: each an engine built its own way, in its own process (vLLM caches its environment per process)
VARIANTS = {
    "default": {},  # what rl ppo builds: in this process, vLLM's defaults (async scheduling where it supports it)
    "no_async_scheduling": {"engine_kwargs": {"async_scheduling": False}},
    "async_scheduling": {"engine_kwargs": {"async_scheduling": True}},
    # vLLM's engine core in a child process (the scheduler beside the loop); spawned: this process has CUDA up
    "multiprocess": {"in_process": False, "env": {"VLLM_WORKER_MULTIPROC_METHOD": "spawn"}},
}


# --between: what the RL loop (and benchmarks/grpo_vs_trl.py around it) does between two generate calls
BETWEEN = {
    "none": "nothing (back to back)",
    "sync": "the in-process weight sync of rl ppo (a bf16 model's live parameters, update_weights(live=True))",
    "gpu_work": "a training phase's footprint: 16 GiB allocated and kept in torch's cache, ~1 s of bf16 matmuls",
    "empty_cache": "torch.cuda.empty_cache() (grpo_vs_trl.py's hand-over between the sides)",
    "sync_gpu_work": "gpu_work, then the sync (the loop's order: train, then sync)",
    "neighbor": "nothing, with a second process holding an idle vLLM engine on the GPU (grpo_vs_trl.py's TRL side)",
}


def arg_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="tiny model, fp32, eager (the vLLM CPU build)")
    ap.add_argument("--shape", default="0.5b", choices=sorted(SHAPES),
                    help="model shape (benchmarks/grpo_vs_trl.py's; qwen2.5-0.5b: the real vocabulary, tied)")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--samples", type=int, default=8, help="samples per prompt (vLLM's n)")
    ap.add_argument("--new_tokens", type=int, default=128, help="full: every response's length; varied: the cap")
    ap.add_argument("--lengths", default="full", choices=("full", "varied"),
                    help="varied: each response's length drawn as benchmarks/grpo_vs_trl.py draws it (long tail)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--gpu_memory_utilization", type=float, default=0.3)
    ap.add_argument("--variants", default="default",
                    help=f"comma-separated engine builds, each in its own process: {', '.join(VARIANTS)}")
    ap.add_argument("--between", default="",
                    help="comma-separated: also time VLLMEngine right after what the RL loop does between two "
                         f"generate calls, each round in turn: {', '.join(BETWEEN)} (the in-loop generate gap)")
    ap.add_argument("--profile", action="store_true", help="cProfile of one VLLMEngine call (top 25, cumulative)")
    ap.add_argument("--out", default=None, help="write the numbers as JSON here")
    ap.add_argument("--_variant", default=None, help=argparse.SUPPRESS)  # child: run this one, print its JSON
    ap.add_argument("--_neighbor", action="store_true", help=argparse.SUPPRESS)  # child: an idle engine, until stdin ends
    return ap


def main() -> None:
    args = arg_parser().parse_args()
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; choose from {', '.join(VARIANTS)}")
    args.between = between = [b.strip() for b in args.between.split(",") if b.strip()]
    if sorted(set(between) - set(BETWEEN)):
        raise SystemExit(f"--between: unknown {sorted(set(between) - set(BETWEEN))}; choose from {', '.join(BETWEEN)}")
    if args._neighbor:
        run_neighbor(args)
        return
    if args._variant is not None:
        print("VARIANT_JSON " + json.dumps(run_variant(args, args._variant)), flush=True)
        return
    results = {}
    for name in names:
        argv = [sys.executable, __file__, *sys.argv[1:], "--_variant", name]
        print(f"== variant {name}: {VARIANTS[name] or 'our defaults'}", flush=True)
        proc = subprocess.run(argv, stdout=subprocess.PIPE, text=True, check=False)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("VARIANT_JSON ")]
        print("\n".join(ln for ln in proc.stdout.splitlines() if not ln.startswith("VARIANT_JSON ")))
        if proc.returncode or not lines:
            print(f"== variant {name} failed (exit {proc.returncode})")
            results[name] = {"error": f"exit {proc.returncode}"}
            continue
        results[name] = json.loads(lines[-1].removeprefix("VARIANT_JSON "))
    base = results.get(names[0], {}).get("median_s", {}).get("VLLMEngine")
    print(f"\n{'variant':<22}{'method':<22}{'seconds':>9}{'tokens/s':>11}{'x first VLLMEngine':>20}")
    for name, r in results.items():
        for m, t in r.get("median_s", {}).items():
            tokens = r["tokens"][m]
            ratio = f"{t / base:>20.3f}" if base and m == "VLLMEngine" else f"{'':>20}"
            print(f"{name:<22}{m:<22}{t:>9.3f}{tokens / t:>11.0f}{ratio}")
        if "ms_per_step_one_request" in r:
            print(f"{name:<22}one request alone: {r['ms_per_step_one_request']:.2f} ms a decode step "
                  f"(async scheduling {r['async_scheduling']})")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "variants": results}, indent=1))


def build_engine(args: argparse.Namespace, variant: dict):
    """``(engine, model folder)``: a random model of ``--shape`` (``--small``: a tiny one) and its VLLMEngine, built
    the ``variant``'s way (VARIANTS)."""
    from rl_rollout import EngineConfig
    from rl_rollout.testing import make_tiny_model

    cuda = torch.cuda.is_available() and not args.small
    os.environ.update(variant.get("env", {}))
    shape = (dict(hidden_size=128, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=256) if args.small
             else {k: v for k, v in SHAPES[args.shape].items() if k != "max_position_embeddings"})
    path = make_tiny_model(Path(tempfile.mkdtemp(prefix="vllm-generate-")) / "model", **shape,
                           max_position_embeddings=2048)
    kwargs = dict(variant.get("engine_kwargs", {}), **({} if cuda else {"kv_cache_memory_bytes": 1 << 30}))
    engine = EngineConfig(kind="vllm", enforce_eager=not cuda, gpu_memory_utilization=args.gpu_memory_utilization).make(
        str(path), dtype="bf16" if cuda else "fp32", seed=0, device="cuda" if cuda else "cpu",
        in_process=variant.get("in_process", True),
        extra={"max_model_len": 256 + args.new_tokens, "engine_kwargs": kwargs})
    return engine, path


def run_variant(args: argparse.Namespace, name: str) -> dict:
    cuda = torch.cuda.is_available() and not args.small

    from vllm import SamplingParams as VSamplingParams
    from vllm.sampling_params import RequestOutputKind

    from rl_rollout import RolloutRequest, SamplingParams

    t0 = time.perf_counter()
    engine, path = build_engine(args, VARIANTS[name])
    print(f"engine start {time.perf_counter() - t0:.1f} s")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(6, 101, (24 + i % 16,) if args.lengths == "full" else (33 + (i * 37) % 160,),
                             generator=g).tolist() for i in range(args.prompts)]
    if args.lengths == "varied":  # one request per sample, its own length: as grpo_vs_trl.py's loop sends them
        lengths = step_lengths(0, args.prompts, args.samples, 1, args.new_tokens)
    else:
        lengths = [args.new_tokens] * (args.prompts * args.samples)
    n_tokens = sum(lengths)
    llm = engine._llm

    def raw(seeded: bool):
        if args.lengths == "full":
            params = [VSamplingParams(n=args.samples, temperature=1.0, max_tokens=args.new_tokens, ignore_eos=True,
                                      logprobs=0, detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY,
                                      seed=1000 + i if seeded else None) for i in range(len(prompts))]
            inputs = [{"prompt_token_ids": p} for p in prompts]
        else:
            params = [VSamplingParams(n=1, temperature=1.0, max_tokens=n, ignore_eos=True, logprobs=0,
                                      detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY,
                                      seed=1000 + i if seeded else None) for i, n in enumerate(lengths)]
            inputs = [{"prompt_token_ids": prompts[i // args.samples]} for i in range(len(lengths))]
        outs = llm.generate(inputs, params, use_tqdm=False)
        return sum(len(c.token_ids) for o in outs for c in o.outputs)

    def ours(seeded: bool = True):
        if args.lengths == "full":
            params = SamplingParams(temperature=1.0, n=args.samples, max_new_tokens=args.new_tokens, ignore_eos=True,
                                    seed=1000 if seeded else None)
            requests = [RolloutRequest(p, params) for p in prompts]
        else:
            requests = [RolloutRequest(prompts[i // args.samples], SamplingParams(
                temperature=1.0, n=1, max_new_tokens=n, ignore_eos=True, seed=1000 + i if seeded else None))
                for i, n in enumerate(lengths)]
        groups = engine.generate(requests)
        return sum(len(s.response_ids) for grp in groups for s in grp)

    def one_request():
        params = SamplingParams(temperature=1.0, n=1, max_new_tokens=args.new_tokens, ignore_eos=True, seed=7)
        (group,) = engine.generate([RolloutRequest(prompts[0], params)])
        return len(group[0].response_ids)

    methods = {"vllm_raw": lambda: raw(False), "vllm_raw_seeded": lambda: raw(True), "VLLMEngine": ours,
               "VLLMEngine_unseeded": lambda: ours(False), "one_request": one_request}
    expected = {m: (args.new_tokens if m == "one_request" else n_tokens) for m in methods}
    times: dict[str, list[float]] = {m: [] for m in methods}
    for m, fn in methods.items():
        assert fn() == expected[m], f"{m}: the responses did not run to their lengths"
    for _ in range(args.repeats):
        for m, fn in methods.items():
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            times[m].append(time.perf_counter() - t0)
    med = {m: statistics.median(t) for m, t in times.items()}
    sched = llm.llm_engine.vllm_config.scheduler_config
    print(f"{name}: {len(lengths)} responses, {n_tokens} tokens ({args.lengths}; longest {max(lengths)}), "
          f"{'cuda bf16, CUDA graphs' if cuda else 'cpu fp32, eager'}, async scheduling {sched.async_scheduling}, "
          f"median of {args.repeats}")
    print(f"{'method':<22}{'seconds':>9}{'tokens/s':>11}{'x vllm_raw':>12}")
    for m, t in med.items():
        print(f"{m:<22}{t:>9.3f}{expected[m] / t:>11.0f}{t / med['vllm_raw']:>12.3f}")
    between_s = loop_rounds(args, engine, path, ours, args.between, cuda) if args.between else {}
    if args.profile:
        prof = cProfile.Profile()
        prof.runcall(ours)
        pstats.Stats(prof).sort_stats("cumulative").print_stats(25)
    engine.shutdown()
    return {"median_s": med, "times_s": times, "tokens": expected, "longest": max(lengths), "between_s": between_s,
            "async_scheduling": sched.async_scheduling,
            "ms_per_step_one_request": 1000 * med["one_request"] / args.new_tokens}


def loop_rounds(args, engine, path: Path, generate, between: list[str], cuda: bool) -> dict[str, list[float]]:
    """VLLMEngine's time on the same batch right after each of ``between`` (BETWEEN), in turn, ``--repeats``
    rounds; ``neighbor`` rounds run last, with a second process holding an idle engine."""
    from transformers import AutoModelForCausalLM

    model = None
    if any("sync" in b for b in between):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16 if cuda else torch.float32)
        model = model.to("cuda" if cuda else "cpu")
    kept: list[torch.Tensor] = []
    version = 0

    def do(kind: str) -> None:
        nonlocal version
        if kind in ("gpu_work", "sync_gpu_work") and cuda:
            kept.clear()
            kept.extend(torch.empty(1 << 30, dtype=torch.uint8, device="cuda") for _ in range(16))
            x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
            for _ in range(600):
                x = torch.tanh(x @ x)
            torch.cuda.synchronize()
            del x
            kept.clear()  # freed into torch's cache, not returned to the device (as a trainer's step leaves it)
        if kind == "empty_cache" and cuda:
            torch.cuda.empty_cache()
        if kind in ("sync", "sync_gpu_work"):
            version += 1
            engine.update_weights([(n, p.detach()) for n, p in model.named_parameters()], version=version, live=True)

    out: dict[str, list[float]] = {b: [] for b in between}
    plain = [b for b in between if b != "neighbor"]
    for _ in range(args.repeats):
        for kind in plain:
            do(kind)
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            generate()
            out[kind].append(time.perf_counter() - t0)
    if "neighbor" in between:
        neighbor = subprocess.Popen([sys.executable, __file__, *sys.argv[1:], "--_neighbor"], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, text=True)
        try:
            assert neighbor.stdout is not None
            for line in neighbor.stdout:  # its start-up done
                if line.startswith("NEIGHBOR_READY"):
                    break
            else:
                raise RuntimeError("the neighbor engine did not start")
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                generate()
                out["neighbor"].append(time.perf_counter() - t0)
        finally:
            assert neighbor.stdin is not None
            neighbor.stdin.close()
            neighbor.wait(120)
    print(f"{'VLLMEngine right after':<24}{'median s':>10}  rounds")
    for kind, ts in out.items():
        print(f"{kind:<24}{statistics.median(ts):>10.3f}  {' '.join(f'{t:.3f}' for t in ts)}  ({BETWEEN[kind]})")
    return out


def run_neighbor(args: argparse.Namespace) -> None:
    """A second process holding an idle engine of the same model on the GPU until its stdin ends."""
    engine, _ = build_engine(args, VARIANTS["default"])
    print("NEIGHBOR_READY", flush=True)
    sys.stdin.read()
    engine.shutdown()


if __name__ == "__main__":
    main()
