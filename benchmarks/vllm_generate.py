"""Where the RL loop's generation time goes: ``VLLMEngine.generate`` against ``vllm.LLM.generate``.

    python3 benchmarks/vllm_generate.py                           # GPU: 0.5B-shaped random Llama, bf16
    .venv-vllm/bin/python benchmarks/vllm_generate.py --small     # vLLM's CPU build, tiny model, fp32
    python3 benchmarks/vllm_generate.py --profile                 # and cProfile of one engine call

One vLLM engine in this process (``in_process=True``, what ``rl ppo`` builds, CUDA graphs on unless
``--small``), the batch of the GPU GRPO comparison (benchmarks/grpo_vs_trl.py): ``--prompts`` 16
prompts x ``--samples`` 8 samples x ``--new_tokens`` 128 tokens, temperature 1, every response forced
to full length (``ignore_eos``), the sampled token's log-prob returned. The methods run on the same
``LLM`` instance, taking turns within each round (median of ``--repeats`` after one warm-up each):

- ``vllm_raw``: ``LLM.generate`` with ``n`` samples per prompt, no per-request seed (vLLM's engine-wide
  random stream), token prompts, ``detokenize=False``, final outputs only: the floor for this batch;
- ``vllm_raw_seeded``: the same with one seed per request, as ``VLLMEngine`` sends them (vLLM then draws
  each sequence's noise with its own ``torch.Generator``: one kernel per row per decode step, which vLLM's
  sampler marks as possibly slow);
- ``VLLMEngine``: ``engine.generate`` on requests built as rl-core's PPO rollout builds them.

Prints seconds, generated tokens/s and each method's time over ``vllm_raw``'s (1.00 = vLLM's own speed).
Measured on one H100 (docs/performance.md): the three within 8% of each other (seeded 0.93x unseeded, noise
of that size between rounds): neither the wrapper nor the per-request seeds cost the loop's generation time.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import tempfile
import time
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="tiny model, fp32, eager (the vLLM CPU build)")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--samples", type=int, default=8, help="samples per prompt (vLLM's n)")
    ap.add_argument("--new_tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--gpu_memory_utilization", type=float, default=0.3)
    ap.add_argument("--profile", action="store_true", help="cProfile of one VLLMEngine call (top 25, cumulative)")
    ap.add_argument("--out", default=None, help="write the numbers as JSON here")
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.small

    from vllm import SamplingParams as VSamplingParams
    from vllm.sampling_params import RequestOutputKind

    from rl_rollout import EngineConfig, RolloutRequest, SamplingParams
    from rl_rollout.testing import make_tiny_model

    shape = (dict(hidden_size=128, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=256) if args.small
             else dict(hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, intermediate_size=4864))
    path = make_tiny_model(Path(tempfile.mkdtemp(prefix="vllm-generate-")) / "model", **shape,
                           max_position_embeddings=1024)
    t0 = time.perf_counter()
    engine = EngineConfig(kind="vllm", enforce_eager=not cuda, gpu_memory_utilization=args.gpu_memory_utilization).make(
        str(path), dtype="bf16" if cuda else "fp32", seed=0, device="cuda" if cuda else "cpu", in_process=True,
        extra={"max_model_len": 512, **({} if cuda else {"engine_kwargs": {"kv_cache_memory_bytes": 1 << 30}})})
    print(f"engine start {time.perf_counter() - t0:.1f} s")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(6, 101, (24 + i % 16,), generator=g).tolist() for i in range(args.prompts)]
    n_tokens = args.prompts * args.samples * args.new_tokens
    llm = engine._llm

    def raw(seeded: bool):
        params = [VSamplingParams(n=args.samples, temperature=1.0, max_tokens=args.new_tokens, ignore_eos=True,
                                  logprobs=0, detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY,
                                  seed=1000 + i if seeded else None) for i in range(len(prompts))]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return sum(len(c.token_ids) for o in outs for c in o.outputs)

    def ours():
        params = SamplingParams(temperature=1.0, n=args.samples, max_new_tokens=args.new_tokens, ignore_eos=True,
                                seed=1000)
        groups = engine.generate([RolloutRequest(p, params) for p in prompts])
        return sum(len(s.response_ids) for grp in groups for s in grp)

    methods = {"vllm_raw": lambda: raw(False), "vllm_raw_seeded": lambda: raw(True), "VLLMEngine": ours}
    times: dict[str, list[float]] = {m: [] for m in methods}
    for m, fn in methods.items():
        assert fn() == n_tokens, f"{m}: not every response ran to {args.new_tokens} tokens"
    for _ in range(args.repeats):
        for m, fn in methods.items():
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            times[m].append(time.perf_counter() - t0)
    med = {m: statistics.median(t) for m, t in times.items()}
    print(f"{args.prompts} prompts x {args.samples} samples x {args.new_tokens} tokens = {n_tokens} tokens, "
          f"{'cuda bf16, CUDA graphs' if cuda else 'cpu fp32, eager'}, median of {args.repeats}")
    print(f"{'method':<18}{'seconds':>9}{'tokens/s':>11}{'x vllm_raw':>12}")
    for m, t in med.items():
        print(f"{m:<18}{t:>9.3f}{n_tokens / t:>11.0f}{t / med['vllm_raw']:>12.3f}")
    if args.profile:
        prof = cProfile.Profile()
        prof.runcall(ours)
        pstats.Stats(prof).sort_stats("cumulative").print_stats(25)
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "tokens": n_tokens, "median_s": med,
                                              "times_s": times}, indent=1))
    engine.shutdown()


if __name__ == "__main__":
    main()
