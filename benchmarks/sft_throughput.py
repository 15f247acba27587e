"""Benchmark: SFT tokens/s of rl-core's DeepSpeed path against a plain PyTorch loop, same run.

    uv run python benchmarks/sft_throughput.py            # hidden 512, 4 layers, seq 256, 24 steps
    uv run python benchmarks/sft_throughput.py --small    # a quick shape

Both sides train the same freshly initialised Llama (``rl_rollout.testing.make_tiny_model``)
on the same synthetic token rows (every token a target), fp32, one process, micro batch
x accumulation = global batch:

- ``plain``: ``AutoModelForCausalLM`` + ``torch.optim.AdamW``, a hand-written loop
  (forward, token-mean NLL via ``log_softmax``/``gather``, backward, clip, step).
- ``rl_core zero-N``: :class:`rl_core.trainers.SFTTrainer` over
  :class:`rl_core.strategy.DeepSpeedStrategy` at ZeRO stage N (its whole step:
  collate, global token count, Actor logprobs through rl_algos, DeepSpeed backward/step,
  metrics), measured by the wall time of ``fit()`` minus nothing: setup is excluded by
  a warm-up run of the same trainer.

Runs are interleaved (plain, zero-0, zero-1, plain, ...). Prints tokens/s (median of ``--repeats``) and each rl-core path's overhead against
``plain`` (target: under 10% at ZeRO-0/1). On a 2-core CPU the numbers move by a few
percent between runs; read the ratio, not the absolute rate.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch


def rows(n: int, T: int, vocab: int, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, vocab, (n, T), generator=g)
    return [{"input_ids": ids[i], "loss_mask": torch.ones(T, dtype=torch.long)} for i in range(n)]


def plain_loop(path, data, micro: int, accum: int, steps: int, lr: float) -> float:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95))
    G = micro * accum
    start = time.perf_counter()
    for s in range(steps):
        batch = data[(s * G) % len(data):][:G]
        total = sum(int(r["loss_mask"][1:].sum()) for r in batch)
        for k in range(accum):
            ids = torch.stack([r["input_ids"] for r in batch[k * micro:(k + 1) * micro]])
            logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float()
            lp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
            loss = -lp.sum() / total
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def rl_core_loop(path, data, micro: int, accum: int, steps: int, lr: float, zero: int) -> float:
    from transformers import AutoTokenizer

    from rl_core.models import Actor
    from rl_core.strategy import DeepSpeedStrategy, StrategyConfig
    from rl_core.trainers import SFTConfig, SFTTrainer

    G = micro * accum
    strategy = DeepSpeedStrategy(StrategyConfig(zero_stage=zero, bf16=False, micro_train_batch_size=micro,
                                                train_batch_size=G, learning_rate=lr, lr_warmup_ratio=0.0))
    tok = AutoTokenizer.from_pretrained(path)
    torch.manual_seed(0)
    trainer = SFTTrainer(strategy, Actor.from_pretrained(path, dtype="fp32", attn_implementation="sdpa"), tok,
                         data[:G * steps], SFTConfig(max_epochs=1))
    start = time.perf_counter()
    trainer.fit()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="hidden 128, 2 layers, seq 128, 8 steps")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--zero", type=int, nargs="+", default=[0, 1])
    args = ap.parse_args()
    hidden, layers, T, steps = (128, 2, 128, 8) if args.small else (512, 4, 256, 24)
    micro, accum, lr = 4, 2, 1e-4
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    logging_quiet()
    from rl_rollout.testing import make_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_model(os.path.join(tmp, "m"), hidden_size=hidden, num_layers=layers, num_heads=8,
                               num_kv_heads=2, intermediate_size=hidden * 3, vocab_size=2048,
                               max_position_embeddings=T)
        data = rows(micro * accum * steps, T, 2048)
        tokens = steps * micro * accum * T
        print(f"model hidden {hidden} x {layers} layers, seq {T}, global batch {micro}x{accum}, {steps} steps, "
              f"{tokens} tokens per run, torch threads {torch.get_num_threads()}")
        runs = {"plain": lambda n: plain_loop(path, data, micro, accum, n, lr)}
        for z in args.zero:
            runs[f"rl_core zero-{z}"] = lambda n, z=z: rl_core_loop(path, data, micro, accum, n, lr, z)
        for run in runs.values():
            run(2)  # warm-up (DeepSpeed builds its engine and comm ops here too)
        times: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(args.repeats):  # interleaved, so a drifting machine hits every method alike
            for name, run in runs.items():
                times[name].append(run(steps))
    base = statistics.median(times["plain"])
    print(f"{'method':<16} {'tokens/s':>10} {'median s':>9} {'vs plain':>9}")
    for name, ts in times.items():
        t = statistics.median(ts)
        print(f"{name:<16} {tokens / t:>10.0f} {t:>9.3f} {t / base:>8.3f}x")
    worst = max(statistics.median(ts) / base for n, ts in times.items() if n != "plain")
    verdict = "met" if worst <= 1.10 else "NOT met"
    print(f"target (rl_core wall time <= 1.10 x plain at ZeRO-0/1): {verdict}, worst {worst:.3f}x")


def logging_quiet() -> None:
    import logging
    import warnings

    logging.disable(logging.WARNING)
    warnings.filterwarnings("ignore")
    os.environ.setdefault("TQDM_DISABLE", "1")


if __name__ == "__main__":
    sys.exit(main())
