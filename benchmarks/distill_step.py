"""Seconds per iteration of on-policy distillation (``--teacher_pretrain``) against the GRPO iteration at the same
shape, both measured in this run (rl-core's PPOTrainer built by ``build_run`` as ``rl ppo`` builds it).

    uv run python benchmarks/distill_step.py --small                 # CPU, tiny student and teacher, a minute
    python benchmarks/distill_step.py --device cuda                   # GPU: Qwen2.5-0.5B / -1.5B shapes

The same prompts, seed and settings twice: GRPO (group_norm, no reference), then GRPO with a teacher
(``--distill_mode advantage``: the teacher's forward joins the experience phase, and the student's log-probs are
computed there too, since the teacher gap is the advantage). Models are random Llamas of the named shapes with one
tokenizer (the numbers are about time, not learning). Prints each phase's mean over the iterations after the first
and the ratio distillation / GRPO; ``--out`` writes them as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

SHAPES = {
    "tiny": dict(hidden_size=128, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=256),
    "tiny2": dict(hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=512),
    "0.5b": dict(hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, intermediate_size=4864),
    "1.5b": dict(hidden_size=1536, num_layers=28, num_heads=12, num_kv_heads=2, intermediate_size=8960),
    # the real shapes with Qwen2.5's vocabulary (151,936; the character tokenizer padded to it, as
    # benchmarks/grpo_vs_trl.py builds them): the GPU default, where the LM head is a large part of each forward
    "qwen2.5-0.5b": dict(hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, intermediate_size=4864,
                         vocab_size=151_936),
    "qwen2.5-1.5b": dict(hidden_size=1536, num_layers=28, num_heads=12, num_kv_heads=2, intermediate_size=8960,
                         vocab_size=151_936),
}
PHASES = ["generate_s", "reward_s", "experience_s", "policy_train_s", "sync_s", "iteration_s"]


def one(args, model, teacher, dev):
    from transformers import AutoTokenizer

    from rl_core.data import DataConfig, PromptDataset
    from rl_core.rl.build import LocalFactory, RLModelConfig, RunConfig, build_run
    from rl_core.strategy import StrategyConfig
    from rl_core.trainers.ppo import PPOConfig
    from rl_rollout import EngineConfig

    tok = AutoTokenizer.from_pretrained(model)
    rows = [{"prompt": f"Question {i}: repeat the letter {c} as often as you can. Answer: ", "label": c}
            for i, c in enumerate("abcdefghijklmnopqrstuvwxyz" * 2)]
    prompts = PromptDataset(rows, tok, DataConfig(input_key="prompt", label_key="label", max_len=256))
    n, P = args.n_samples_per_prompt, args.rollout_batch_size
    flat = dict(advantage_estimator="group_norm", n_samples_per_prompt=n, rollout_batch_size=P,
                generate_max_len=args.generate_max_len, max_iterations=args.iterations, init_kl_coef=0)
    cfg = PPOConfig.from_flat(**flat, **({} if teacher is None else {"teacher_pretrain": str(teacher)}))
    s = StrategyConfig(zero_stage=0, bf16=dev.type == "cuda", micro_train_batch_size=args.micro_train_batch_size,
                       train_batch_size=P * n, learning_rate=1e-6, lr_warmup_ratio=0.0, lr_scheduler="constant")

    def reward(prompt, response, label):
        return response.count(label) / max(len(response), 1)

    run = build_run(RunConfig(RLModelConfig(pretrain=str(model)), s, cfg, EngineConfig(kind="hf", max_batch_sequences=P * n)),
                    LocalFactory(), prompts=prompts, tokenizer=tok, reward_fn=reward)
    t0 = time.perf_counter()
    try:
        hist = run.trainer.fit()
    finally:
        run.close()
    later = hist[1:] or hist
    return {k: statistics.mean(m[k] for m in later) for k in PHASES}, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="tiny student and a twice-as-wide teacher, for a CPU run")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--student", default=None, choices=tuple(SHAPES), help="default: tiny with --small, else qwen2.5-0.5b")
    ap.add_argument("--teacher", default=None, choices=tuple(SHAPES), help="default: tiny2 with --small, else qwen2.5-1.5b")
    ap.add_argument("--iterations", type=int, default=4)
    ap.add_argument("--rollout_batch_size", type=int, default=8)
    ap.add_argument("--n_samples_per_prompt", type=int, default=4)
    ap.add_argument("--generate_max_len", type=int, default=128)
    ap.add_argument("--micro_train_batch_size", type=int, default=8)
    ap.add_argument("--out", default=None, help="write the numbers as JSON here")
    args = ap.parse_args()
    dev = torch.device(args.device)
    student_shape = args.student or ("tiny" if args.small else "qwen2.5-0.5b")
    teacher_shape = args.teacher or ("tiny2" if args.small else "qwen2.5-1.5b")
    if args.small:
        args.generate_max_len = min(args.generate_max_len, 32)

    from rl_rollout.testing import make_tiny_model

    work = Path(tempfile.mkdtemp(prefix="rl-distill-"))
    student = make_tiny_model(work / "student", **SHAPES[student_shape], max_position_embeddings=2048)
    teacher = make_tiny_model(work / "teacher", **SHAPES[teacher_shape], max_position_embeddings=2048, seed=1)
    print(f"distill_step: student {student_shape}, teacher {teacher_shape}, {args.device}, "
          f"{args.rollout_batch_size} prompts x {args.n_samples_per_prompt} samples, {args.generate_max_len} new "
          f"tokens, {args.iterations} iterations each (means over all but the first)", flush=True)
    grpo, t_grpo = one(args, student, None, dev)
    dist, t_dist = one(args, student, teacher, dev)
    print(f"{'phase':<16}{'GRPO s':>10}{'distill s':>12}{'ratio':>8}")
    for k in PHASES:
        ratio = dist[k] / grpo[k] if grpo[k] > 0 else float("nan")
        print(f"{k[:-2]:<16}{grpo[k]:>10.3f}{dist[k]:>12.3f}{ratio:>8.2f}")
    print(f"whole runs: GRPO {t_grpo:.1f} s, distillation {t_dist:.1f} s")
    if args.out:
        Path(args.out).write_text(json.dumps({"grpo": grpo, "distill": dist, "args": vars(args)}, indent=1))


if __name__ == "__main__":
    main()
