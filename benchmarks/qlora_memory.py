"""QLoRA's memory and time against LoRA on the same model, one process per row (rl_core.qlora, ``--load_in_4bit``).

Each row loads the policy as ``rl sft`` / ``rl ppo`` do (``rl_core.models.Actor.from_pretrained``: bf16, gradient
checkpointing, LoRA on every linear layer), trains the adapter a few steps with AdamW on random tokens (the
HF causal-LM loss over the real vocabulary), and reads the full merged weights once as the weight sync does
(``rl_core.ds_internals._gather_bucket`` + ``merge_lora_stream``: dequantized under QLoRA). Printed per row: the
weights' memory after loading, the peak during the steps, seconds per step, seconds per weight readout; then
QLoRA / LoRA ratios measured in this run.

    python benchmarks/qlora_memory.py --shape qwen2.5-1.5b --device cuda      # real shapes (random weights)
    python benchmarks/qlora_memory.py --shape tiny --device cpu --steps 2     # a smoke run anywhere
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHAPES = {  # Qwen2.5's real configs (tied embeddings at 0.5B and 1.5B); tiny: a smoke shape
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1024, tie_word_embeddings=True),
}


def make_model(shape: str, root: Path) -> Path:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    path = root / shape
    if not (path / "config.json").is_file():
        torch.manual_seed(0)
        cfg = Qwen2Config(**SHAPES[shape], max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=1e6)
        with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
            model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
        model.save_pretrained(path)
        del model
    return path


def row(args) -> dict:
    """One configuration in this process (called through --row)."""
    import torch

    from rl_core.ds_internals import _gather_bucket
    from rl_core.hf_export import merge_lora_stream
    from rl_core.models import Actor, LoraSpec
    from rl_core.qlora import Load4bitConfig

    cuda = args.device == "cuda"
    dev = torch.device(args.device)
    quant = Load4bitConfig(args.row.split("-", 1)[1]) if args.row.startswith("qlora") else None
    t0 = time.perf_counter()
    actor = Actor.from_pretrained(args.model, dtype="bf16", gradient_checkpointing=True, load_in_4bit=quant,
                                  lora=LoraSpec.of(args.rank, 2 * args.rank, 0.0, "all-linear"))
    actor.to(dev)
    load_s = time.perf_counter() - t0
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    weights = torch.cuda.memory_allocated() if cuda else sum(p.numel() * p.element_size() for p in actor.parameters())
    trainable = [p for p in actor.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-4)
    g = torch.Generator().manual_seed(0)
    vocab = actor.model.config.vocab_size
    times = []
    actor.train()
    for step in range(args.steps + 1):  # the first step warms up
        ids = torch.randint(0, vocab, (args.rows, args.seq_len), generator=g).to(dev)
        t = time.perf_counter()
        loss = actor.model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        if step:
            times.append(time.perf_counter() - t)
    peak = torch.cuda.max_memory_allocated() if cuda else 0
    t = time.perf_counter()
    n = 0
    for _, tensor in merge_lora_stream(_gather_bucket(list(actor.model.named_parameters()), None),
                                       actor.model.peft_config):
        n += tensor.numel()
    if cuda:
        torch.cuda.synchronize()
    readout_s = time.perf_counter() - t
    return {"row": args.row, "load_s": round(load_s, 2), "weights_gb": weights / 1e9, "peak_gb": peak / 1e9,
            "step_s": sum(times) / len(times), "readout_s": readout_s, "merged_numel": n,
            "trainable": sum(p.numel() for p in trainable), "loss": float(loss)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-1.5b")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--rank", type=int, default=16, help="LoRA rank (alpha = 2 x rank), every linear layer")
    ap.add_argument("--rows", type=int, default=4, help="sequences per step")
    ap.add_argument("--seq_len", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=5, help="timed steps after one warm-up")
    ap.add_argument("--configs", default="lora,qlora-nf4,qlora-fp4", help="rows: lora, qlora-nf4, qlora-fp4")
    ap.add_argument("--root", default=None, help="where the random model folders are written (default: a temp dir)")
    ap.add_argument("--row", default=None, help=argparse.SUPPRESS)  # one row, in a child process
    ap.add_argument("--model", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.row:
        print("ROW " + json.dumps(row(args)), flush=True)
        return 0
    root = Path(args.root or tempfile.mkdtemp(prefix="qlora-bench-"))
    model = make_model(args.shape, root)
    print(f"shape {args.shape} ({SHAPES[args.shape]}), {args.device}, LoRA rank {args.rank} on every linear layer, "
          f"{args.rows} x {args.seq_len} tokens a step, bf16, gradient checkpointing, AdamW on the adapter")
    results = {}
    for cfg in args.configs.split(","):
        cmd = [sys.executable, __file__, "--row", cfg, "--model", str(model), "--device", args.device,
               "--rank", str(args.rank), "--rows", str(args.rows), "--seq_len", str(args.seq_len),
               "--steps", str(args.steps)]
        out = subprocess.run(cmd, capture_output=True, text=True)
        line = next((x for x in out.stdout.splitlines() if x.startswith("ROW ")), None)
        if out.returncode or line is None:
            tail = (out.stderr or out.stdout).strip().splitlines()[-3:]
            print(f"{cfg:10s} FAILED (exit {out.returncode}): {' | '.join(tail)}")
            continue
        r = results[cfg] = json.loads(line[4:])
        print(f"{cfg:10s} weights {r['weights_gb']:.3f} GB  peak {r['peak_gb']:.3f} GB  step {r['step_s']:.3f} s  "
              f"weight readout {r['readout_s']:.3f} s  load {r['load_s']:.1f} s  trainable {r['trainable']:,}  "
              f"loss {r['loss']:.3f}")
    base = results.get("lora")
    for cfg, r in results.items():
        if base is not None and cfg != "lora":
            peak = f"{r['peak_gb'] / base['peak_gb']:.2f}x" if base["peak_gb"] else "n/a on cpu"
            print(f"{cfg} / lora: weights {r['weights_gb'] / base['weights_gb']:.2f}x, peak {peak}, step "
                  f"{r['step_s'] / base['step_s']:.2f}x, weight readout {r['readout_s'] / base['readout_s']:.2f}x")
    return 0 if results else 1


if __name__ == "__main__":
    sys.exit(main())
