"""Benchmark: packed rows + token-budget micro-batches against padded micro-batches in the RL policy worker.

    uv run python benchmarks/rl_packing.py                                  # CPU, tiny Llama, fp32
    python benchmarks/rl_packing.py --device cuda --preset 0.5b --max_len 2048 --samples 128 --micro 8
    python benchmarks/rl_packing.py --device cuda --preset 0.5b --max_len 2048 --samples 128 --micro 8 \
        --attn_implementation sdpa torch_varlen flex_attention     # packed sides per attention kernel

One batch of experience items with a skewed length distribution (most responses short, a few at
``--max_len``: see :func:`response_lengths`), the same items for both sides, timed in the same run
with the sides alternating (``--repeats`` rounds, median):

- ``padded``: rl-core's :class:`~rl_core.rl.PolicyWorker` as before this feature: right-padded rows,
  ``--micro`` sequences per forward (the training micro-batch and the no-grad one);
- ``packed@B``: the same worker with ``packing=True`` and ``max_tokens_per_gpu`` = B, one side per
  ``--budget`` value (default: ``--micro`` x the longest item, the padded side's worst-case micro-batch
  and so the same peak memory, and the longest item alone). Without flash-attn a packed row runs sdpa with a block-diagonal mask whose
  cost grows with the row's length squared, so smaller budgets can be faster: pass several to see.
  ``--attn_implementation`` picks the packed sides' attention (one side per value and budget, named
  ``packed@B:impl``): ``torch_varlen`` (torch's flash varlen kernel, rl_core.varlen_attention) and
  ``flex_attention`` run each packed sequence on its own, without the dense mask (CUDA only). The padded
  side always runs rl-core's default (flash_attention_2 if importable, else sdpa); without the flag the packed
  sides run rl-core's default for packed rows (torch_varlen on CUDA in bf16, else sdpa), as ``rl ppo`` does.

Two phases each: the no-grad log-prob pass (``PolicyWorker.logprobs``, the experience phase's forward)
and one policy train step (``PolicyWorker.train``: forward, clipped PPO loss, backward, AdamW step,
one optimizer step over the batch). Tokens/s count the real tokens (prompt + response) of the batch,
the same on both sides, so the ratio is the speed-up. Also printed: the largest difference between the two
sides' log-probs (rounding: ~1e-6 in fp32, larger in bf16), the tokens each side computes
(padding included) and the attention kernel transformers ran (packing without flash-attn runs sdpa with
a block-diagonal mask built from the position ids). CUDA runs in bf16 and synchronises before each clock
read; CPU runs in fp32. ``--out FILE`` writes the numbers as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

PRESETS = {
    "tiny": dict(hidden_size=128, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=256),
    "small": dict(hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=768),
    "0.5b": dict(hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, intermediate_size=4864),  # Qwen2.5
}


def response_lengths(n: int, max_len: int, seed: int = 0, full: bool = False) -> list[int]:
    """Skewed: 80% short (1/32 .. 1/8 of the limit), 15% medium (1/8 .. 1/2), 5% at the limit (at least one).
    ``full``: every response at the limit (the SFT-like shape of issue 18 item 4)."""
    if full:
        return [max_len] * n
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        u = torch.rand((), generator=g).item()
        lo, hi = (max_len // 32, max_len // 8) if u < 0.8 else (max_len // 8, max_len // 2) if u < 0.95 else \
            (max_len, max_len)
        out.append(int(torch.randint(max(lo, 1), max(hi, 1) + 1, (), generator=g)))
    out[n // 2] = max_len
    return out


def make_items(n: int, prompt_len: int, max_len: int, vocab: int, seed: int = 0, full: bool = False) -> list:
    from rl_core.rl import make_item

    g = torch.Generator().manual_seed(seed)
    items = []
    for r in response_lengths(n, max_len, seed, full):
        ids = torch.randint(5, vocab, (prompt_len + r,), generator=g).tolist()
        it = make_item(ids[:prompt_len], ids[prompt_len:])
        it.advantages_T = torch.tensor(it.loss_mask_T, dtype=torch.float32) * torch.randn(len(ids), generator=g)
        items.append(it)
    return items


def computed_tokens(worker, items, train: bool) -> int:
    """Tokens the forwards process, padding included."""
    total = 0
    for idx in worker._micro_batches(items, train=train):
        lengths = [items[i].T for i in idx]
        total += sum(lengths) if worker.packing else len(lengths) * max(lengths)
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--preset", default="tiny", choices=tuple(PRESETS), help="model shape (random weights)")
    ap.add_argument("--samples", type=int, default=32, help="items in the batch (one optimizer step)")
    ap.add_argument("--prompt_len", type=int, default=32)
    ap.add_argument("--max_len", type=int, default=256, help="the response length limit (a few items reach it)")
    ap.add_argument("--micro", type=int, default=4, help="padded side: sequences per micro-batch")
    ap.add_argument("--budget", type=int, nargs="*", default=None,
                    help="packed sides: tokens per micro-batch, one side per value (default: --micro x the longest "
                         "item, and the longest item)")
    ap.add_argument("--attn_implementation", nargs="*", default=None,
                    help="packed sides: attention implementation(s), one side per value and budget (default: "
                         "rl-core's, flash_attention_2 if importable else sdpa; torch_varlen and flex_attention "
                         "need CUDA)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--lengths", default="skewed", choices=("skewed", "full"),
                    help="response lengths: skewed (default) or every one at --max_len (rows of prompt_len + max_len "
                         "tokens: the SFT benchmark's shape, to compare the policy's train step with "
                         "sft_throughput.py's tokens/s)")
    ap.add_argument("--use_liger_kernel", action="store_true",
                    help="every side with liger-kernel's RMSNorm / SwiGLU / RoPE (rl ppo's --use_liger_kernel; CUDA)")
    ap.add_argument("--fused_lm_head", action="store_true",
                    help="every side with rl ppo's --fused_lm_head (log-probs without the [tokens, vocabulary] logits)")
    ap.add_argument("--out", default=None, help="write the numbers as JSON here")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here; run on the GPU machine or drop the flag")
    dev = torch.device(args.device)
    bf16 = dev.type == "cuda"

    def clock() -> float:
        if dev.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    from rl_core.attention import attention_implementation
    from rl_core.rl import MicroBatchConfig, PolicyObjective, PolicyWorker
    from rl_core.strategy import StrategyConfig
    from rl_core.trainers.ppo import PPOConfig
    from rl_rollout.testing import make_tiny_model

    work = Path(tempfile.mkdtemp(prefix="rl-packing-"))
    vocab = 151_936 if args.preset == "0.5b" else 128  # Qwen2.5's vocabulary: the log-prob pass reads its logits
    model = make_tiny_model(work / "model", **PRESETS[args.preset], vocab_size=vocab,
                            max_position_embeddings=max(2048, 2 * (args.prompt_len + args.max_len)))
    items = make_items(args.samples, args.prompt_len, args.max_len, vocab, full=args.lengths == "full")
    longest = max(it.T for it in items)
    budgets = args.budget or [args.micro * longest, longest]
    default_attn = attention_implementation()
    # packed sides default to what rl ppo --packing_samples runs (torch_varlen on CUDA in bf16, else sdpa)
    attns = args.attn_implementation or [attention_implementation(packed=True, dtype="bf16" if bf16 else "fp32")]
    for a in attns:
        try:
            attention_implementation(a)
        except ValueError as e:
            raise SystemExit(f"--attn_implementation: {e}") from None
    real = sum(it.T for it in items)
    s = StrategyConfig(zero_stage=0, bf16=bf16, micro_train_batch_size=args.micro, train_batch_size=args.samples,
                       learning_rate=1e-7, lr_warmup_ratio=0.0, lr_scheduler="constant")
    c = PPOConfig(max_epochs=1)
    dtype = "bf16" if bf16 else "fp32"
    steps = 10 * args.repeats + 10
    liger = {"use_liger_kernel": True} if args.use_liger_kernel else {}
    if args.fused_lm_head:
        liger["fused_lm_head"] = True
    workers = {"padded": PolicyWorker(s, str(model), PolicyObjective.of(c), steps, load_kw={"dtype": dtype, **liger})}
    for a in attns:
        for b in budgets:
            workers[f"packed@{b}:{a}"] = PolicyWorker(s, str(model), PolicyObjective.of(c), steps, packing=True,
                                                      batching=MicroBatchConfig(max_tokens_per_gpu=b),
                                                      load_kw={"dtype": dtype, "attn_implementation": a, **liger})
    logprobs = {side: w.logprobs(items) for side, w in workers.items()}  # also the warm-up
    gap = max((a - b).abs().max().item() for side in workers if side != "padded"
              for a, b in zip(logprobs["padded"], logprobs[side], strict=True))
    for it, lp in zip(items, logprobs["padded"], strict=True):
        it.old_logprobs_T = lp
    for w in workers.values():  # the first step allocates the optimizer state and the autograd kernels
        w.train(items)
    times: dict[str, list[float]] = {f"{side}/{phase}": [] for side in workers for phase in ("logprobs", "train")}
    for _ in range(args.repeats):  # the sides alternate within each phase, so a shared machine's load hits both
        for phase in ("logprobs", "train"):
            for side, w in workers.items():
                t0 = clock()
                w.logprobs(items) if phase == "logprobs" else w.train(items)
                times[f"{side}/{phase}"].append(clock() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    resp = [it.T - args.prompt_len for it in items]
    result = {
        "device": str(dev), "dtype": "bf16" if bf16 else "fp32", "preset": args.preset,
        "attention": {"padded": default_attn, "packed": attns}, "samples": args.samples, "prompt_len": args.prompt_len,
        "response_len": {"min": min(resp), "median": int(statistics.median(resp)), "max": max(resp)},
        "lengths": args.lengths, "use_liger_kernel": args.use_liger_kernel, "fused_lm_head": args.fused_lm_head,
        "real_tokens": real, "micro": args.micro, "budgets": budgets,
        "micro_batches": {side: len(w._micro_batches(items, train=True)) for side, w in workers.items()},
        "computed_tokens": {side: computed_tokens(w, items, True) for side, w in workers.items()},
        "max_logprob_gap": gap,
        "tokens_per_s": {k: real / v for k, v in med.items()},
        "speedup": {side: {p: med[f"padded/{p}"] / med[f"{side}/{p}"] for p in ("logprobs", "train")}
                    for side in workers if side != "padded"},
    }
    kernels = ", liger" * args.use_liger_kernel + ", fused LM head" * args.fused_lm_head
    print(f"{args.preset} on {dev} ({result['dtype']}{kernels}, attention: padded {default_attn}, packed "
          f"{', '.join(attns)}): {args.samples} items, "
          f"response lengths {result['response_len']}, {real} real tokens; packed vs padded log-probs: max gap "
          f"{gap:.2e}")
    for side in workers:
        up = result["speedup"].get(side)
        vs = f" | vs padded: log-probs {up['logprobs']:.2f}x, train {up['train']:.2f}x" if up else ""
        print(f"  {side:26s} {result['micro_batches'][side]:3d} micro-batches, {result['computed_tokens'][side]:7d} "
              f"tokens computed | log-probs {result['tokens_per_s'][side + '/logprobs']:9.0f} tok/s | "
              f"train step {result['tokens_per_s'][side + '/train']:9.0f} tok/s{vs}")
    print(f"  (median of {args.repeats}, sides alternating, same run)")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
