"""Seconds per RL iteration, ``--async_train`` against the synchronous loop, same run otherwise.

    uv run python benchmarks/async_rl.py                       # CPU, HF engine, tiny model
    uv run python benchmarks/async_rl.py --iterations 12 --max_new_tokens 96
    python3 benchmarks/async_rl.py --device cuda --rollout_engine vllm --shape 0.5b --max_new_tokens 1024

The run is ``rl ppo``'s (``rl_core.rl.build.build_run`` with ``LocalFactory``): GRPO on the demo
task (``Repeat the letter X:``), a random model from ``rl_rollout.testing.make_tiny_model`` (hidden
``--hidden``, or ``--shape 0.5b``: Qwen2.5-0.5B's layer sizes), fp32 on CPU and bf16 on CUDA, ZeRO-0, the
engine (``--rollout_engine hf|vllm``) in this process receiving the weights in memory after every iteration. Sync: generate, then train. Async (``max_staleness`` 1): the next batch is generated on a
producer thread while this one trains. Reported: the median ``iteration_s`` after the first two
iterations, the mean ``generate_s`` and ``policy_train_s`` and the async / sync ratio (below 1: async
is faster); sync and async runs alternate ``--repeats`` times and the medians are reported. On a CPU the two threads share the cores, so the gain is bounded by how much of each
phase is not compute-bound; on a GPU (engine and trainer sharing it) the same script with
``--device cuda`` measures the colocated case.

Lengths: the random model's next-token distribution is near uniform over its 128 tokens, so each
token ends the response with probability about 1/128: response lengths are geometric (mean about
128, standard deviation about the mean, a long tail), which with ``--max_new_tokens 1024`` is the
reasoning-like spread where a synchronous batch waits for its longest sample. The report gives the
mean and the largest length per iteration and the fraction cut at the limit.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
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
    cfg = PPOConfig.from_flat(advantage_estimator="group_norm", n_samples_per_prompt=args.n, rollout_batch_size=args.prompts,
                    generate_max_len=args.max_new_tokens, max_iterations=args.iterations, init_kl_coef=0.0,
                    async_train=async_train, run_dir=str(work / ("async" if async_train else "sync")))
    s = StrategyConfig(zero_stage=0, bf16=args.device == "cuda", micro_train_batch_size=args.micro or G // 2, train_batch_size=G,
                       learning_rate=1e-4, lr_warmup_ratio=0.0, lr_scheduler="constant", seed=0)
    r = build_run(RunConfig(RLModelConfig(pretrain=str(model)), s, cfg, EngineConfig(kind=args.rollout_engine, max_batch_sequences=G)),
                  LocalFactory(), prompts=prompts, tokenizer=tok, reward_fn=RewardRunner(letter_reward, workers=0))
    try:
        h = r.trainer.fit()
    finally:
        r.close()
    tail = h[2:] or h
    return {"iteration_s": statistics.median(m["iteration_s"] for m in tail),
            "generate_s": statistics.mean(m["generate_s"] for m in tail),
            "policy_train_s": statistics.mean(m["policy_train_s"] for m in tail),
            "staleness_max": max(m.get("staleness_max", 0.0) for m in h),
            "response_length_mean": statistics.mean(m["response_length"] for m in tail),
            "response_length_max": max(m.get("response_length_max", 0.0) for m in tail),
            "truncated": statistics.mean(m["truncated"] for m in tail)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iterations", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max_new_tokens", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--micro", type=int, default=0, help="training micro-batch (sequences); 0: half the batch")
    ap.add_argument("--shape", choices=("tiny", "0.5b"), default="tiny", help="0.5b: Qwen2.5-0.5B's layer sizes")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--rollout_engine", choices=("hf", "vllm"), default="hf")
    ap.add_argument("--repeats", type=int, default=2, help="sync and async runs alternate this many times (a "
                    "shared machine's load then hits both alike); the medians are reported")
    ap.add_argument("--one", choices=("sync", "async"), help=argparse.SUPPRESS)  # a child: one run, JSON out
    ap.add_argument("--work", help=argparse.SUPPRESS)
    args = ap.parse_args()
    import torch

    if (args.device == "cuda") != torch.cuda.is_available():
        ap.error(f"--device {args.device}, but torch.cuda.is_available() is {torch.cuda.is_available()}: the run "
                 "trains where DeepSpeed finds an accelerator; pass the device this machine has")

    if args.one:
        print(json.dumps(run(args, Path(args.work), async_train=args.one == "async")), flush=True)
        return

    from rl_rollout.testing import make_tiny_model

    with tempfile.TemporaryDirectory() as d:
        work = Path(d)
        shape = (dict(hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, intermediate_size=4864)
                 if args.shape == "0.5b" else dict(hidden_size=args.hidden))
        make_tiny_model(work / "model", **shape, max_position_embeddings=max(1024, 2 * args.max_new_tokens))
        (work / "prompts.jsonl").write_text(
            "".join(json.dumps({"p": f"Repeat the letter {c}: ", "y": c}) + "\n" for c in "abcdefgh"))
        runs = {"sync": [], "async": []}
        for _ in range(args.repeats):
            for mode in runs:  # each run in a process of its own: DeepSpeed keeps process groups per process
                out = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--one", mode, "--work", d],
                                     stdout=subprocess.PIPE, text=True)
                if out.returncode != 0:
                    raise SystemExit(f"the {mode} run exited {out.returncode} (its log is above)")
                runs[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
    med = {k: {m: statistics.median(r[m] for r in v) for m in v[0]} for k, v in runs.items()}
    print(json.dumps({**med, "ratio_async_over_sync": med["async"]["iteration_s"] / med["sync"]["iteration_s"],
                      "each_iteration_s": {k: [r["iteration_s"] for r in v] for k, v in runs.items()},
                      "args": vars(args)}, indent=1))


if __name__ == "__main__":
    main()
