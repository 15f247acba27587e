"""What the policy's EMA weights (``rl ppo --enable_ema``, rl_core.rl.ema) cost: memory and time per optimizer step.

    uv run python benchmarks/ema_memory.py --small              # CPU, tiny model: the shadow's bytes only
    python benchmarks/ema_memory.py --zero_stage 2              # GPU: a Qwen2.5-0.5B-shaped random Llama, bf16

Builds the policy's worker as ``rl ppo`` does (one rank), without and then with ``enable_ema``, and prints the
shadow's bytes (``EmaWeights.nbytes``: the trained parameters in their dtype, this rank's part under ZeRO-3), on
CUDA the allocated-memory difference between the two workers after construction, and the mean seconds of one
EMA update (run after each optimizer step) beside one policy train step of ``--items`` samples.
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from pathlib import Path

import torch


def build(model: str, args, ema: bool):
    from rl_core.rl import PolicyObjective, PolicyWorker
    from rl_core.strategy import StrategyConfig
    from rl_core.trainers.ppo_config import PPOConfig

    s = StrategyConfig(zero_stage=args.zero_stage, bf16=not args.small, micro_train_batch_size=args.items,
                       train_batch_size=args.items, learning_rate=1e-6, lr_warmup_ratio=0.0)
    objective = PolicyObjective.of(PPOConfig.from_flat(enable_ema=ema))
    return PolicyWorker(s, model, objective, 100, load_kw={"dtype": "fp32" if args.small else "bf16"})


def timed(fn, device, n: int) -> float:
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    fn()  # warm-up
    sync()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    sync()
    return (time.perf_counter() - t0) / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="tiny fp32 model for a CPU run")
    ap.add_argument("--zero_stage", type=int, default=2)
    ap.add_argument("--items", type=int, default=8, help="samples of the timed train step (one optimizer step)")
    ap.add_argument("--seq_len", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    from rl_core.rl import make_item
    from rl_rollout.testing import make_tiny_model

    shape = (dict(hidden_size=128, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=256) if args.small else
             dict(hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, intermediate_size=4864))
    work = Path(tempfile.mkdtemp(prefix="ema-bench-"))
    model = str(make_tiny_model(work / "model", **shape, max_position_embeddings=2048))
    out: dict = {"zero_stage": args.zero_stage}
    mem = {}
    for ema in (False, True):
        cuda = torch.cuda.is_available()
        w = build(model, args, ema)
        if cuda:
            torch.cuda.synchronize()
            mem[ema] = torch.cuda.memory_allocated()
        half = args.seq_len // 2
        items = [make_item(list(range(3, 3 + half)), list(range(3, 3 + half))) for _ in range(args.items)]
        for it in items:
            it.advantages_T = torch.tensor(it.loss_mask_T, dtype=torch.float32)
        out[f"train_step_s{'_ema' if ema else ''}"] = timed(lambda: w.train(items, on_policy=True), w.s.device,
                                                            args.repeats)
        if ema:
            out["ema_gb"] = w._ema.nbytes / 1e9
            out["ema_update_s"] = timed(w._ema.update, w.s.device, args.repeats)
        del w
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    if mem:
        out["ema_allocated_gb"] = (mem[True] - mem[False]) / 1e9
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
