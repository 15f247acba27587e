"""Benchmark: the RL policy's train step on one rank by ZeRO stage (what ``rl ppo``'s one process per role runs).

    uv run python benchmarks/zero_one_rank.py                  # CPU, the 11M Llama of grpo_vs_trl.py, fp32
    python benchmarks/zero_one_rank.py --device cuda --preset 0.5b

On one rank ZeRO-1 and ZeRO-2 partition nothing, so whatever they cost over stage 0 is overhead. Sides, built
once and timed alternating in one process (``--repeats`` rounds, median), each :class:`rl_core.rl.PolicyWorker`
running one ``train`` (forward, clipped PPO loss, backward, optimizer step) over the same batch:

- ``zero0``: DeepSpeed's stage 0 (the torch optimizer on the parameters themselves);
- ``zero1``: stage 1 (flat fp32 partitions; one reduction at the step's boundary);
- ``zero2``: stage 2 as rl-core runs it alone: DeepSpeed's ``coalesce_grad_reduction`` reduces once per step
  (rl_core.strategy's ``_OneRankCoalescing``);
- ``zero2-per-micro``: stage 2 as DeepSpeed runs it by default, a flatten-reduce-copy pass over every gradient
  after each micro-batch (rl-core's coalescing switched off for this side only).

Printed: seconds per step (median and min over the rounds: min is the steadier on a shared machine) and
each side's ratios to ``zero0``; the largest weight difference
from ``zero0`` after the rounds (all sides compute the same sums: fp32 rounding only).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from rl_packing import PRESETS, make_items  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--preset", default="11m", choices=("11m", *PRESETS),
                    help="11m: hidden 512, 4 layers, vocabulary 128 (grpo_vs_trl.py's CPU model); else rl_packing's")
    ap.add_argument("--samples", type=int, default=64, help="rows in the batch (one optimizer step)")
    ap.add_argument("--prompt_len", type=int, default=21)
    ap.add_argument("--response_len", type=int, default=64)
    ap.add_argument("--micro", type=int, default=16, help="rows per micro-batch")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2, help="torch threads on CPU")
    args = ap.parse_args()

    from rl_core import strategy as strategy_mod
    from rl_core.rl import PolicyObjective, PolicyWorker
    from rl_core.strategy import StrategyConfig
    from rl_core.trainers.ppo import PPOConfig
    from rl_rollout.testing import make_tiny_model

    torch.set_num_threads(args.threads)
    cuda = args.device == "cuda"
    shape = (dict(hidden_size=512, num_layers=4, num_heads=8, num_kv_heads=2, intermediate_size=1408)
             if args.preset == "11m" else dict(PRESETS[args.preset]))
    shape["vocab_size"] = 151_936 if args.preset == "0.5b" else 128  # as rl_packing.py
    model = make_tiny_model(Path(tempfile.mkdtemp()) / "m", **shape)
    items = make_items(args.samples, args.prompt_len, args.response_len, shape["vocab_size"], full=True)
    coalescible = strategy_mod._coalescible
    sides = {}
    for name, stage, coalesce in (("zero0", 0, True), ("zero1", 1, True), ("zero2", 2, True),
                                  ("zero2-per-micro", 2, False)):
        strategy_mod._coalescible = coalescible if coalesce else (lambda *a: False)
        cfg = StrategyConfig(zero_stage=stage, bf16=cuda, micro_train_batch_size=args.micro,
                             train_batch_size=args.samples, learning_rate=1e-6)
        sides[name] = PolicyWorker(cfg, str(model), PolicyObjective.of(PPOConfig(max_epochs=1)), 1000,
                                   load_kw={"dtype": "bf16" if cuda else "fp32"})
    strategy_mod._coalescible = coalescible
    for it, lp in zip(items, sides["zero0"].logprobs(items), strict=True):
        it.old_logprobs_T = lp
    for w in sides.values():  # warm-up
        w.train(items)
    times = {name: [] for name in sides}
    for _ in range(args.repeats):
        for name, w in sides.items():
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            w.train(items)
            if cuda:
                torch.cuda.synchronize()
            times[name].append(time.perf_counter() - t0)

    def flat(w):
        return torch.cat([p.detach().float().reshape(-1) for p in w.engine.module.parameters()])

    base, base_min = statistics.median(times["zero0"]), min(times["zero0"])
    ref = flat(sides["zero0"])
    tokens = sum(it.T for it in items)
    print(f"{args.device}, preset {args.preset}, {args.samples} rows x {args.prompt_len}+{args.response_len} tokens "
          f"({tokens} per step), micro-batch {args.micro}, {'bf16' if cuda else 'fp32'}, median of {args.repeats}")
    for name, t in times.items():
        med = statistics.median(t)
        print(f"{name:16s} median {med:6.3f} s x{med / base:6.3f}  min {min(t):6.3f} s x{min(t) / base_min:6.3f}  "
              f"max |w - zero0| {(flat(sides[name]) - ref).abs().max():.1e}"
              f"   [{' '.join(f'{x:.3f}' for x in t)}]")


if __name__ == "__main__":
    main()
