"""Seconds per RL iteration, ``--async_train`` against the synchronous loop, same run otherwise.

    uv run python benchmarks/async_rl.py                       # CPU, HF engine, tiny model
    uv run python benchmarks/async_rl.py --iterations 12 --max_new_tokens 96

The run is ``rl ppo``'s (``rl_core.rl.build.build_run`` with ``LocalFactory``): GRPO on the demo
task (``Repeat the letter X:``), a random model from ``rl_rollout.testing.make_tiny_model`` (hidden
``--hidden``), fp32, ZeRO-0, the HF engine in this process receiving the weights in memory after every
iteration. Sync: generate, then train. Async (``max_staleness`` 1): the next batch is generated on a
producer thread while this one trains. Reported: the median ``iteration_s`` after the first two
iterations, the mean ``generate_s`` and ``policy_train_s`` and the async / sync ratio (below 1: async
is faster); sync and async runs alternate ``--repeats`` times and the medians are reported. On a CPU the two threads share the cores, so the gain is bounded by how much of each
phase is not compute-bound; on a GPU (engine and trainer sharing it) the same script with
``--device cuda`` measures the colocated case. Not here: generation lengths that vary widely (a
random model rarely stops early; every response runs to ``--max_new_tokens``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path


def letter_reward(prompt, response, label, **info):
    return min(response.count(label), 8) / 8


def run(args, work: Path, async_train: bool) -> dict:
    from transformers import AutoTokenizer

    from rl_core.data import DataConfig, PromptDataset, load_rows
    from rl_core.rl.build import LocalFactory, RLModelConfig, RunConfig, build_run
    from rl_core.strategy import StrategyConfig
    from rl_core.trainers.ppo import PPOConfig
    from rl_rollout import EngineConfig, RewardRunner

    model = work / "model"
    tok = AutoTokenizer.from_pretrained(model)
    prompts = PromptDataset(load_rows(str(work / "prompts.jsonl")), tok, DataConfig(input_key="p", label_key="y"))
    G = args.prompts * args.n
    cfg = PPOConfig(advantage_estimator="group_norm", n_samples_per_prompt=args.n, rollout_batch_size=args.prompts,
                    generate_max_len=args.max_new_tokens, max_iterations=args.iterations, init_kl_coef=0.0,
                    async_train=async_train, run_dir=str(work / ("async" if async_train else "sync")))
    s = StrategyConfig(zero_stage=0, bf16=False, micro_train_batch_size=G // 2, train_batch_size=G,
                       learning_rate=1e-4, lr_warmup_ratio=0.0, lr_scheduler="constant", seed=0)
    r = build_run(RunConfig(RLModelConfig(pretrain=str(model)), s, cfg, EngineConfig(kind="hf")),
                  LocalFactory(), prompts=prompts, tokenizer=tok, reward_fn=RewardRunner(letter_reward, workers=0))
    try:
        h = r.trainer.fit()
    finally:
        r.close()
    tail = h[2:] or h
    return {"iteration_s": statistics.median(m["iteration_s"] for m in tail),
            "generate_s": statistics.mean(m["generate_s"] for m in tail),
            "policy_train_s": statistics.mean(m["policy_train_s"] for m in tail),
            "staleness_max": max(m.get("staleness_max", 0.0) for m in h)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iterations", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max_new_tokens", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=2, help="sync and async runs alternate this many times (a "
                    "shared machine's load then hits both alike); the medians are reported")
    args = ap.parse_args()

    from rl_rollout.testing import make_tiny_model

    with tempfile.TemporaryDirectory() as d:
        work = Path(d)
        make_tiny_model(work / "model", hidden_size=args.hidden)
        (work / "prompts.jsonl").write_text(
            "".join(json.dumps({"p": f"Repeat the letter {c}: ", "y": c}) + "\n" for c in "abcdefgh"))
        runs = {"sync": [], "async": []}
        for _ in range(args.repeats):
            runs["sync"].append(run(args, work, async_train=False))
            runs["async"].append(run(args, work, async_train=True))
    med = {k: {m: statistics.median(r[m] for r in v) for m in v[0]} for k, v in runs.items()}
    print(json.dumps({**med, "ratio_async_over_sync": med["async"]["iteration_s"] / med["sync"]["iteration_s"],
                      "each_iteration_s": {k: [r["iteration_s"] for r in v] for k, v in runs.items()},
                      "args": vars(args)}, indent=1))


if __name__ == "__main__":
    main()
