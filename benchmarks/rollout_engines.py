"""Benchmark: rollout engines against the raw libraries they wrap, same prompts, same model.

    uv run python benchmarks/rollout_engines.py                  # HFEngine vs transformers generate
    .venv-vllm/bin/python benchmarks/rollout_engines.py          # ... and VLLMEngine vs vllm.LLM.generate
    uv run python benchmarks/rollout_engines.py --prompts 8 --new-tokens 16   # a quick shape

Model: :func:`rl_rollout.testing.make_tiny_model` with a larger config than the tests'
(hidden 256, 4 layers, head_dim 64 as vLLM's CPU attention needs; peaked weights),
float32. Work: ``--prompts`` prompts of 8-23 tokens, ``--new-tokens`` tokens each,
greedy with ``ignore_eos`` so every method generates exactly the same number of tokens,
and every method returns the sampled token's logprob (the rollout engines always can).

Methods:
- ``hf_raw``: one left-padded ``model.generate(output_scores=True)`` call on the
  engine's own model, plus ``log_softmax``/``gather`` of the scores.
- ``HFEngine``: ``engine.generate(requests)``, same model object.
- ``vllm_raw``: ``LLM.generate`` with token prompts, ``logprobs=0``, ``detokenize=False``, final outputs only,
  on the ``LLM`` inside the ``VLLMEngine`` (same instance: only the wrapper differs).
- ``VLLMEngine``: ``engine.generate(requests)`` (sync mode, in-process, eager).

Each method is warmed up once, then timed ``--repeats`` times, raw and wrapper taking
turns (a shared machine's load then hits both alike); the median is reported.
Prints generated tokens/s, the wrapper overhead of each engine over its raw library
(target: VLLMEngine within 5% of raw vLLM) and VLLMEngine over HFEngine. vLLM rows
appear only where vLLM imports (the CPU build lives in .venv-vllm).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from rl_rollout import RolloutRequest, SamplingParams
from rl_rollout.hf_engine import HFEngine
from rl_rollout.testing import make_tiny_model

MODEL_CONFIG = dict(hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=768, peaked=True)


def make_prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    # ids 6..100 are printable characters of the tiny tokenizer (no special tokens)
    return [torch.randint(6, 101, (8 + i % 16,), generator=g).tolist() for i in range(n)]


def timed_pair(fns: dict, repeats: int) -> tuple[dict[str, float], dict[str, object]]:
    """Median wall time of each ``fns[name]()`` over ``repeats`` rounds, after one warm-up run each.

    The methods take turns within each round (raw, wrapper, raw, ...) so that load from
    other processes on a shared machine hits both alike. Returns medians and last results.
    """
    outs = {name: fn() for name, fn in fns.items()}
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            outs[name] = fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}, outs


def hf_raw(model, prompts: list[list[int]], new_tokens: int, pad_id: int) -> list[list[int]]:
    from transformers import GenerationConfig

    width = max(len(p) for p in prompts)
    ids_BT = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask_BT = torch.zeros_like(ids_BT)
    for b, p in enumerate(prompts):
        ids_BT[b, width - len(p) :] = torch.tensor(p)
        mask_BT[b, width - len(p) :] = 1
    cfg = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=0, do_sample=False, eos_token_id=None,
                           pad_token_id=pad_id, output_scores=True, return_dict_in_generate=True)
    with torch.no_grad():
        out = model.generate(input_ids=ids_BT, attention_mask=mask_BT, generation_config=cfg)
    gen_BL = out.sequences[:, width:]
    logprobs_BL = torch.log_softmax(torch.stack(out.scores, 1).float(), -1).gather(-1, gen_BL[..., None])[..., 0]
    assert logprobs_BL.shape == gen_BL.shape
    return gen_BL.tolist()


def vllm_raw(llm, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    from vllm import SamplingParams as VSamplingParams
    from vllm.sampling_params import RequestOutputKind

    # FINAL_ONLY as the engine asks: the default (cumulative) rebuilds every output at every step
    params = VSamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True, logprobs=0, detokenize=False,
                             output_kind=RequestOutputKind.FINAL_ONLY)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def engine_run(engine, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True, logprobs=True)
    groups = engine.generate([RolloutRequest(p, params) for p in prompts])
    return [g[0].response_ids for g in groups]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workdir", default=None, help="where the model is written (default: a temp folder)")
    ap.add_argument("--no-vllm", action="store_true", help="skip vLLM even where it imports")
    args = ap.parse_args()

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="rollout_bench_"))
    path = make_tiny_model(workdir / "bench_model", **MODEL_CONFIG)
    prompts = make_prompts(args.prompts)
    n_tokens = args.prompts * args.new_tokens
    print(f"rollout engines: {args.prompts} prompts x {args.new_tokens} new tokens (greedy, ignore_eos), model "
          f"{MODEL_CONFIG}, float32, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{os.cpu_count()} CPUs")

    times: dict[str, float] = {}
    outputs: dict[str, list[list[int]]] = {}
    hf = HFEngine(path, max_batch_sequences=args.prompts)  # one generate call, as hf_raw
    t, o = timed_pair({"hf_raw": lambda: hf_raw(hf.model, prompts, args.new_tokens, hf.pad_token_id),
                       "HFEngine": lambda: engine_run(hf, prompts, args.new_tokens)}, args.repeats)
    times.update(t)
    outputs.update(o)
    hf.shutdown()

    have_vllm = not args.no_vllm and importlib.util.find_spec("vllm") is not None
    if have_vllm:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vLLM on CPU otherwise wants most of RAM
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # its INFO lines would bury the table
        from rl_rollout.vllm_engine import VLLMEngine

        t0 = time.perf_counter()
        eng = VLLMEngine(path, dtype="float32", enforce_eager=True, in_process=True,
                         max_model_len=max(len(p) for p in prompts) + args.new_tokens + 32)
        print(f"VLLMEngine start: {time.perf_counter() - t0:.1f} s")
        t, o = timed_pair({"vllm_raw": lambda: vllm_raw(eng._llm, prompts, args.new_tokens),
                           "VLLMEngine": lambda: engine_run(eng, prompts, args.new_tokens)}, args.repeats)
        times.update(t)
        outputs.update(o)
        eng.shutdown()
    else:
        print("vLLM rows skipped: vllm does not import here (run with .venv-vllm/bin/python)")

    print(f"{'method':<12}{'median s':>10}{'tokens/s':>11}{'same tokens as hf_raw':>24}")
    for name, t in times.items():
        same = sum(a == b for a, b in zip(outputs[name], outputs["hf_raw"], strict=True))
        print(f"{name:<12}{t:>10.3f}{n_tokens / t:>11.0f}{f'{same}/{args.prompts}':>24}")
    overhead = {"HFEngine vs hf_raw": times["HFEngine"] / times["hf_raw"] - 1}
    if have_vllm:
        overhead["VLLMEngine vs vllm_raw"] = times["VLLMEngine"] / times["vllm_raw"] - 1
    print("wrapper overhead (time): " + ", ".join(f"{k} {v:+.1%}" for k, v in overhead.items()))
    if have_vllm:
        speedup = times["HFEngine"] / times["VLLMEngine"]
        print(f"VLLMEngine vs HFEngine: {speedup:.2f}x the tokens/s")
        ok = overhead["VLLMEngine vs vllm_raw"] <= 0.05
        print(f"target VLLMEngine overhead <= 5%: {'yes' if ok else 'NO'}")


if __name__ == "__main__":
    main()
