"""Benchmark: one training forward+backward of a Qwen2.5-0.5B-shaped model (random weights,
bf16, sdpa) with and without liger-kernel's fused RMSNorm / SwiGLU / RoPE
(``rl_core.liger``, ``--use_liger_kernel``), same run, each mode in a fresh process
(liger's RoPE patch is process-wide).

    PYTHONPATH=packages/rl-algos/src:packages/rl-core/src:packages/rl-rollout/src \\
        python3 benchmarks/liger_model.py [--batch 8 --seq 2048 --repeats 10]

The loss is ``-logprobs_from_logits(logits[:, :-1], ids[:, 1:]).mean()`` (rl_algos' Triton
kernel on CUDA), as in SFT. Prints the median step time, tokens/s, the peak memory and the
max difference of the log-probs between the two modes (same weights, same data).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import torch


def child(args) -> None:
    from transformers import AutoModelForCausalLM, Qwen2Config

    from rl_algos import logprobs_from_logits

    cfg = Qwen2Config(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                      num_key_value_heads=2, vocab_size=151_936, max_position_embeddings=32768, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa").cuda()
    if args.child == "liger":
        from rl_core.liger import apply_liger_kernel

        apply_liger_kernel(model)
    g = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), device="cuda", generator=g)

    def step():
        logits = model(input_ids=ids, use_cache=False).logits
        lp = logprobs_from_logits(logits[:, :-1], ids[:, 1:])
        (-lp.mean()).backward()
        return lp.detach()

    from logprobs_cuda import timed  # this script's folder is on sys.path

    lp = step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step_ms = timed(step, args.repeats)
    torch.save(lp.float().cpu(), args.out)
    print(json.dumps({"mode": args.child, "step_ms": step_ms,
                      "peak_gib": torch.cuda.max_memory_allocated() / 2**30}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--child", choices=("plain", "liger"), help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    if not torch.cuda.is_available():
        sys.exit("liger_model.py needs a CUDA device (liger-kernel's kernels are Triton); torch sees none")
    res, lps = {}, {}
    for mode in ("plain", "liger"):
        out = f"/tmp/liger_model_{mode}.pt"
        cmd = [sys.executable, __file__, "--child", mode, "--out", out, "--batch", str(args.batch),
               "--seq", str(args.seq), "--repeats", str(args.repeats)]
        res[mode] = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
        lps[mode] = torch.load(out)
    tokens = args.batch * args.seq
    print(f"Qwen2.5-0.5B shape, bf16, sdpa, {args.batch} x {args.seq} tokens, fwd+bwd, on {torch.cuda.get_device_name()}")
    for mode, r in res.items():
        print(f"{mode:<6} {r['step_ms']:8.1f} ms  {tokens / r['step_ms'] * 1e3:9.0f} tokens/s  peak {r['peak_gib']:.1f} GiB")
    print(f"liger / plain time: {res['liger']['step_ms'] / res['plain']['step_ms']:.3f}; "
          f"max |logprob difference| {(lps['liger'] - lps['plain']).abs().max().item():.3e}")


if __name__ == "__main__":
    main()
