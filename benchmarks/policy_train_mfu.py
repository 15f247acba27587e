"""The policy's training phase alone at a real model shape: seconds, tokens/s and MFU, per configuration.

    python3 benchmarks/policy_train_mfu.py --device cuda                      # Qwen2.5-0.5B's shape, 65,536 tokens
    python3 benchmarks/policy_train_mfu.py --device cuda --shape qwen2.5-1.5b
    uv run python benchmarks/policy_train_mfu.py --small                      # CPU: a tiny model, a check that it runs

What it times: rl-core's ``PolicyWorker.train`` (the call ``rl ppo``'s loop makes in its policy-train phase), GRPO
on-policy (one optimizer step per batch, old log-probs from the train forward, no KL term: ``rl ppo
--advantage_estimator group_norm``'s defaults), on items of varied lengths (prompts 32-192 tokens, responses drawn
from a log-normal long tail: median ``--response_median``, sigma 0.8, clipped to 64..``--max_response``) until the
step holds ``--tokens`` tokens. The worker is built from the same ``RunConfig`` ``rl ppo`` builds, with its ``auto``
settings resolved by :func:`rl_core.rl.auto.resolve` on this machine: the ``defaults`` row is what a user gets with
no tuning flags; the other rows set one thing by hand (``--rows`` picks them).

Each row runs in its own process (a fresh device). The memory a colocated engine would hold is set aside first:
``--engine_share`` of the device (vLLM's ``--vllm_gpu_memory_utilization``, allocated as one tensor), so the token
budget rl-core sizes from free memory sees what it would see beside vLLM; ``--memory_share`` caps the process as
benchmarks/grpo_vs_trl.py does (torch's per-process memory fraction; 1.0: the whole device).

MFU: 6 x N x tokens / seconds / ``--peak_tflops`` (989: H100/H200 SXM dense bf16), N the unique parameters with the
LM head (a tied embedding counted once); attention's FLOPs not counted. Seconds: ``--steps`` steps after
``--warmup``, each timed to a device synchronisation. A row that runs out of memory is reported as such.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHAPES = {  # the real models' layer sizes and vocabulary (random weights, tied embeddings as the real ones)
    "qwen2.5-0.5b": dict(hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, intermediate_size=4864,
                         vocab_size=151_936),
    "qwen2.5-1.5b": dict(hidden_size=1536, num_layers=28, num_heads=12, num_kv_heads=2, intermediate_size=8960,
                         vocab_size=151_936),
    "small": dict(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128, vocab_size=512),
}
# one setting changed from rl ppo's defaults per row (the names are the RunConfig's dotted settings)
ROWS = {
    "defaults": {},
    "no_fused_head": {"model.fused_lm_head": False},
    "fused_head": {"model.fused_lm_head": True},
    "no_liger": {"model.use_liger_kernel": False},
    "budget_16k": {"batching.max_tokens_per_gpu": 16_384},
    "budget_32k": {"batching.max_tokens_per_gpu": 32_768},
    "budget_65k": {"batching.max_tokens_per_gpu": 65_536},
    "ckpt_budget_65k": {"strategy.gradient_checkpointing": True, "batching.max_tokens_per_gpu": 65_536},
    "no_fused_16k": {"model.fused_lm_head": False, "batching.max_tokens_per_gpu": 16_384},
    "no_fused_32k": {"model.fused_lm_head": False, "batching.max_tokens_per_gpu": 32_768},
    "no_fused_65k": {"model.fused_lm_head": False, "batching.max_tokens_per_gpu": 65_536},
}


def items_for(tokens: int, vocab: int, median: int, max_response: int, seed: int):
    """Experience items of varied lengths until their tokens reach ``tokens``; advantages +-1 on the responses."""
    import random

    import torch

    from rl_core.rl import make_item

    rng, out, total = random.Random(seed), [], 0
    while total < tokens:
        p = rng.randint(32, 192)
        r = int(min(max(math.exp(math.log(median) + 0.8 * rng.gauss(0.0, 1.0)), 64), max_response))
        r = min(r, tokens - total - p) if tokens - total - p >= 16 else r
        it = make_item([rng.randrange(3, vocab) for _ in range(p)], [rng.randrange(3, vocab) for _ in range(r)])
        it.advantages_T = torch.tensor(it.loss_mask_T, dtype=torch.float32) * (1.0 if len(out) % 2 else -1.0)
        out.append(it)
        total += p + r
    return out


def run_row(args) -> dict:
    import dataclasses

    import torch

    from rl_core.rl import PolicyObjective, PolicyWorker
    from rl_core.rl.auto import Hardware, resolve
    from rl_core.rl.build import RLModelConfig, RunConfig
    from rl_core.strategy import StrategyConfig
    from rl_core.trainers.ppo import PPOConfig
    from rl_rollout import EngineConfig
    from rl_rollout.testing import make_tiny_model

    dev = torch.device(args.device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    reserve = None
    if dev.type == "cuda":
        torch.cuda.set_per_process_memory_fraction(args.memory_share, dev)
        total = torch.cuda.get_device_properties(dev).total_memory
        reserve = torch.empty(int(args.engine_share * total), dtype=torch.uint8, device=dev)
    shape = SHAPES[args.shape]
    model = make_tiny_model(Path(tempfile.mkdtemp(prefix="policy-mfu-")) / "m", max_position_embeddings=4096,
                            tie_word_embeddings=True, **shape)
    items = items_for(args.tokens, shape["vocab_size"], args.response_median, args.max_response, args.seed)
    ppo = PPOConfig.from_flat(advantage_estimator="group_norm", n_samples_per_prompt=8, rollout_batch_size=len(items),
                              init_kl_coef=0.0)
    strategy = StrategyConfig(bf16=dev.type == "cuda", train_batch_size=len(items), learning_rate=1e-6,
                              lr_warmup_ratio=0.0, lr_scheduler="constant")
    cfg = RunConfig(RLModelConfig(pretrain=str(model)), strategy, ppo, EngineConfig(kind="hf"))
    given = set()
    for name, value in ROWS[args.row].items():  # the row's one hand-set setting, as a flag would set it
        node, field = name.split(".")
        node_attr = {"model": "model", "strategy": "strategy", "batching": "batching"}[node]
        cfg = dataclasses.replace(cfg, **{node_attr: dataclasses.replace(getattr(cfg, node_attr), **{field: value})})
        given.add(name)
    cfg, choices = resolve(cfg, Hardware.here(), given=frozenset(given))
    objective = PolicyObjective.of(cfg.ppo)
    w = PolicyWorker(cfg.strategy, str(model), objective, args.warmup + args.steps,
                     load_kw={**cfg.load_kw(), "fused_lm_head": cfg.model.fused_lm_head}, pad_id=0,
                     batching=cfg.batching, packing=cfg.packing)
    n_params = sum(p.numel() for p in w.engine.module.parameters())
    times, metrics = [], {}
    try:
        for step in range(args.warmup + args.steps):
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            metrics = w.train(items, 0.0, True)[0]
            if dev.type == "cuda":
                torch.cuda.synchronize()
            if step >= args.warmup:
                times.append(time.perf_counter() - t0)
    except torch.OutOfMemoryError as e:
        return {"row": args.row, "oom": str(e)[:300], "choices": [str(c) for c in choices]}
    tokens = sum(len(it.input_ids_T) for it in items)
    sec = statistics.median(times)
    budget = metrics.get("max_tokens_per_gpu") or cfg.batching.max_tokens_per_gpu
    micro = len(w._micro_batches(items, train=True)) if hasattr(w, "_micro_batches") else None
    del reserve
    return {
        "row": args.row,
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "seconds": times,
        "median_s": sec,
        "tokens": tokens,
        "items": len(items),
        "tokens_per_s": tokens / sec,
        "params": n_params,
        "mfu": 6 * n_params * tokens / sec / (args.peak_tflops * 1e12) if dev.type == "cuda" else None,
        "budget": budget,
        "micro_batches": micro,
        "peak_gib": torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else None,
        "settings": {"zero_stage": cfg.strategy.zero_stage, "packing": cfg.packing,
                     "use_liger_kernel": cfg.model.use_liger_kernel, "fused_lm_head": cfg.model.fused_lm_head,
                     "gradient_checkpointing": cfg.strategy.gradient_checkpointing},
        "choices": [str(c) for c in choices],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="CPU, a tiny model and 2,048 tokens: checks that it runs")
    ap.add_argument("--shape", default="qwen2.5-0.5b", choices=sorted(SHAPES))
    ap.add_argument("--tokens", type=int, default=65_536, help="tokens per training step (prompts and responses)")
    ap.add_argument("--response_median", type=int, default=384)
    ap.add_argument("--max_response", type=int, default=2048)
    ap.add_argument("--rows", default="defaults,no_fused_head,budget_32k,no_liger",
                    help=f"comma-separated, of: {', '.join(ROWS)}")
    ap.add_argument("--engine_share", type=float, default=0.15, help="device memory held aside for an engine")
    ap.add_argument("--memory_share", type=float, default=1.0, help="torch's per-process memory fraction")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--peak_tflops", type=float, default=989.0)
    ap.add_argument("--row", default=None, help=argparse.SUPPRESS)  # the child's one row
    ap.add_argument("--out", default=None, help="write every row as JSON here")
    args = ap.parse_args()
    if args.small:
        args.device, args.shape, args.tokens, args.response_median, args.max_response = "cpu", "small", 2048, 96, 256
        args.engine_share, args.steps = 0.0, 1
    if args.row is not None:
        print("ROW " + json.dumps(run_row(args)), flush=True)
        return
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    bad = [r for r in rows if r not in ROWS]
    if bad:
        raise SystemExit(f"--rows: unknown {bad}; known: {', '.join(ROWS)}")
    results = []
    for row in rows:
        cmd = [sys.executable, __file__, "--row", row, *sys.argv[1:]]
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        found = [line[4:] for line in proc.stdout.splitlines() if line.startswith("ROW ")]
        if proc.returncode != 0 or not found:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
            results.append({"row": row, "failed": proc.returncode, "tail": tail})
            print(f"{row}: FAILED (exit {proc.returncode}): " + " | ".join(tail), flush=True)
            continue
        r = json.loads(found[-1])
        results.append(r)
        print(f"{row}: done in {time.perf_counter() - t0:.0f} s", flush=True)
    first = next((r for r in results if "median_s" in r), None)
    if first:
        print(f"\npolicy train phase: {first['device']}; shape {args.shape} ({first['params'] / 1e6:.0f}M params); "
              f"{first['tokens']} tokens in {first['items']} items per step; engine share {args.engine_share}, "
              f"memory share {args.memory_share}; median of {args.steps} steps after {args.warmup}")
        print("our defaults chose: " + "; ".join(first["choices"]) if first["row"] == "defaults" else "")
    base = next((r for r in results if r["row"] == "defaults" and "median_s" in r), None)
    print(f"{'row':<18}{'s/step':>8}{'tok/s':>9}{'MFU':>7}{'vs def':>8}{'budget':>8}{'mb':>4}{'peak GiB':>9}  settings")
    for r in results:
        if "median_s" not in r:
            print(f"{r['row']:<18} {'out of memory' if 'oom' in r else 'failed'}")
            continue
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "-"
        vs = f"{r['median_s'] / base['median_s']:.3f}" if base else "-"
        peak = f"{r['peak_gib']:.1f}" if r["peak_gib"] is not None else "-"
        print(f"{r['row']:<18}{r['median_s']:>8.3f}{r['tokens_per_s']:>9.0f}{mfu:>7}{vs:>8}{str(r['budget']):>8}"
              f"{str(r['micro_batches']):>4}{peak:>9}  {r['settings']}")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "rows": results}, indent=1))


if __name__ == "__main__":
    main()
