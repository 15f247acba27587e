"""``rl ppo-ray`` on real GPUs: a few GRPO iterations of one placement, seconds per phase, and the
weight-sync rate against a device copy of the same bytes measured in the same run.

    python benchmarks/rl_ray_gpus.py --mode hybrid                  # 1 GPU: actor + HF engine share it, CUDA IPC
    python benchmarks/rl_ray_gpus.py --mode hybrid --actor_gpus 2   # 2 GPUs: ZeRO-3 actor, an engine on each, IPC
    python benchmarks/rl_ray_gpus.py --mode split --actor_gpus 2    # 3 GPUs: ZeRO-3 actor on 2, engine on a 3rd, NCCL
    python benchmarks/rl_ray_gpus.py --mode split --tp 2 --rollout_engine vllm   # 3 GPUs: vLLM tensor parallel 2
    python benchmarks/rl_ray_gpus.py --rollout_engine vllm --generate_max_len 1024 --compare_async 1   # sync vs async

``--compare_async N`` runs the same placement twice in one call, synchronous and then ``--async_train
--max_staleness N`` (the hybrid placement then keeps the engine awake beside the policy: an engine cannot sleep
while it generates the next batch), and prints the async / sync ratio of the steady-state iteration time. The
random model's next token is near uniform over its small vocabulary, so each response ends with probability about
1/vocabulary per token: lengths are geometric with a long tail up to ``--generate_max_len`` (the spread where a
synchronous batch waits for its longest sample).

It makes a random Llama of the chosen shape (``--shape 0.5b``: Qwen2.5-0.5B's layer sizes; ``1.5b`` and
``3b`` Qwen2.5-1.5B's and -3B's, to see how the sync's fixed cost and its copy scale; ``qwen2.5-0.5b`` the 0.5B
layers with Qwen2.5's real vocabulary, every response then full length; ``tiny`` for a smoke run) with a character tokenizer, a "repeat the letter" prompt set and
its reward file, runs ``python -m rl_cli.train_ppo_ray`` with OpenRLHF's flags (printed, so
the run can be repeated by hand), and reads the run's ``metrics.jsonl``. Phase means are over
the iterations after the first (the first pays for CUDA warm-up and the IPC handles).

Baselines measured in this run on the GPU the actor's rank 0 uses: a device-to-device copy
of the model's bytes (``torch`` copy_, best of 5) and, in ``split`` mode, a copy from GPU 0
to the engine's GPU. A sync at the device-copy rate would be ratio 1.0; the sync also
gathers (ZeRO-3), packs and, for NCCL, goes through the collective.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

SHAPES = {"tiny": dict(hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=512),
          "0.5b": dict(hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, intermediate_size=4864),
          "1.5b": dict(hidden_size=1536, num_layers=28, num_heads=12, num_kv_heads=2, intermediate_size=8960),
          "3b": dict(hidden_size=2048, num_layers=36, num_heads=16, num_kv_heads=2, intermediate_size=11008),
          # Qwen2.5-0.5B's real shape: its vocabulary (151,936, tied embeddings); the random model's end token then
          # comes about once in 151,936 draws, so every response runs to --generate_max_len (no length spread)
          "qwen2.5-0.5b": dict(hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, intermediate_size=4864,
                               vocab_size=151_936)}
PHASES = ["generate_s", "reward_s", "experience_s", "critic_train_s", "policy_train_s", "sync_s", "iteration_s"]
REWARD = "def letter(prompt, response, label, **info):\n    return response.count(label) / max(len(response), 1)\n"


def copy_gb_per_s(nbytes: int, src: int, dst: int) -> float:
    """Best of 5 copies of ``nbytes`` from cuda:src to cuda:dst (GB/s)."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{src}")
    b = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{dst}")
    best = float("inf")
    for _ in range(5):
        torch.cuda.synchronize(src), torch.cuda.synchronize(dst)
        t0 = time.perf_counter()
        b.copy_(a)
        torch.cuda.synchronize(src), torch.cuda.synchronize(dst)
        best = min(best, time.perf_counter() - t0)
    del a, b
    torch.cuda.empty_cache()
    return nbytes / best / 1e9


def flags(args, model: Path, work: Path, staleness: int = 0) -> list[str]:
    f = ["--pretrain", str(model), "--prompt_data", str(work / "prompts.jsonl"), "--input_key", "prompt",
         "--label_key", "label", "--reward_fn", f"{work / 'reward.py'}:letter",
         "--advantage_estimator", "group_norm", "--init_kl_coef", "0", "--n_samples_per_prompt", str(args.n),
         "--rollout_batch_size", str(args.prompts), "--train_batch_size", str(args.n * args.prompts),
         "--micro_train_batch_size", str(args.micro), "--generate_max_len", str(args.generate_max_len),
         "--max_iterations", str(args.iterations), "--learning_rate", "1e-6", "--zero_stage", str(args.zero_stage),
         "--bf16", "true", "--rollout_engine", args.rollout_engine, "--verify_weights", str(args.verify).lower(),
         "--actor_num_gpus_per_node", str(args.actor_gpus), "--vllm_tensor_parallel_size", str(args.tp),
         "--max_batch_sequences", str(args.n * args.prompts), "--run_dir", str(work / f"run-s{staleness}"), "--seed", "1"]
    if args.mode == "hybrid":
        f += ["--colocate_all_models", "--vllm_num_engines", str(args.actor_gpus // args.tp)]
        # an engine generating ahead cannot sleep; with --compare_async the sync run stays awake too (same memory)
        f += [] if staleness or args.compare_async else ["--vllm_enable_sleep"]
    else:
        f += ["--vllm_num_engines", str(args.engines)]
    if staleness:
        f += ["--async_train", "--max_staleness", str(staleness)]
    return f + args.extra


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=["hybrid", "split"], default="hybrid")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="0.5b")
    ap.add_argument("--actor_gpus", type=int, default=1)
    ap.add_argument("--engines", type=int, default=1, help="split mode: engines on GPUs of their own")
    ap.add_argument("--tp", type=int, default=1, help="vLLM tensor parallel size")
    ap.add_argument("--rollout_engine", default="hf", choices=["hf", "vllm", "auto"])
    ap.add_argument("--zero_stage", type=int, default=3)
    ap.add_argument("--iterations", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=8, help="samples per prompt")
    ap.add_argument("--micro", type=int, default=16)
    ap.add_argument("--generate_max_len", type=int, default=128)
    ap.add_argument("--verify", action="store_true", help="checksum every synced bucket (slower)")
    ap.add_argument("--compare_async", type=int, default=0, metavar="N",
                    help="run twice: synchronous, then --async_train --max_staleness N; print the async / sync ratio")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--out", default=None, help="write the numbers as JSON here")
    ap.add_argument("extra", nargs="*", help="more rl ppo-ray flags, after --")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("rl_ray_gpus needs CUDA GPUs; on CPU see `rl ppo-ray --num_gpus N` in docs/performance.md")
    gpus = torch.cuda.device_count()
    need = args.actor_gpus if args.mode == "hybrid" else args.actor_gpus + args.engines * args.tp
    if need > gpus:
        raise SystemExit(f"--mode {args.mode} with {args.actor_gpus} actor GPU(s), {args.engines} engine(s) x TP "
                         f"{args.tp} needs {need} GPUs; this machine has {gpus}")

    from rl_rollout.testing import make_tiny_model

    work = Path(args.workdir or tempfile.mkdtemp(prefix="rl-ray-gpus-"))
    work.mkdir(parents=True, exist_ok=True)
    model = make_tiny_model(work / "model", **SHAPES[args.shape], max_position_embeddings=2048)
    (work / "prompts.jsonl").write_text("".join(
        json.dumps({"prompt": f"Question {i}: repeat the letter {c} as often as you can. Answer: ", "label": c}) + "\n"
        for i, c in enumerate("abcdefghijklmnopqrstuvwxyz" * 4)))
    (work / "reward.py").write_text(REWARD)
    nbytes = sum(p.stat().st_size for p in Path(model).glob("*.safetensors")) // 2  # float32 on disk -> bf16
    same = copy_gb_per_s(nbytes, 0, 0)
    peer = copy_gb_per_s(nbytes, 0, args.actor_gpus) if args.mode == "split" else None

    runs = [run_once(args, model, work, s, nbytes, same, peer, gpus)
            for s in ([0, args.compare_async] if args.compare_async else [0])]
    if args.compare_async:
        sync, asyn = runs
        print(f"\nasync (max staleness {args.compare_async}) / sync, steady-state iteration: "
              f"{asyn['steady_iteration_s']:.3f} / {sync['steady_iteration_s']:.3f} s = "
              f"{asyn['steady_iteration_s'] / sync['steady_iteration_s']:.3f}; generate {asyn['phases']['generate_s']:.3f}"
              f" / {sync['phases']['generate_s']:.3f} s, policy train {asyn['phases']['policy_train_s']:.3f} / "
              f"{sync['phases']['policy_train_s']:.3f} s (in async the two overlap)")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "gpus": gpus, "bytes": nbytes,
                                              "device_copy_gb_per_s": same, "peer_copy_gb_per_s": peer,
                                              "runs": runs}, indent=1))


def run_once(args, model, work: Path, staleness: int, nbytes: int, same: float, peer, gpus: int) -> dict:
    """One ``rl ppo-ray`` run (synchronous, or async with ``staleness``): prints its phases, returns them."""
    run_dir = work / f"run-s{staleness}"
    cmd = [sys.executable, "-m", "rl_cli.train_ppo_ray", *flags(args, Path(model), work, staleness)]
    print("+ " + shlex.join(cmd), flush=True)
    log = work / f"ppo_ray-s{staleness}.log"
    t0 = time.perf_counter()
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        for line in proc.stdout:
            fh.write(line)
            if line.startswith("[rl ppo-ray]") or "Error" in line or "error:" in line:
                print(line, end="", flush=True)
        rc = proc.wait()
    wall = time.perf_counter() - t0
    if rc != 0:
        print(log.read_text()[-6000:])
        raise SystemExit(f"rl ppo-ray exited {rc}; full log: {log}")
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    later = rows[1:] or rows
    mean = {k: statistics.mean(r.get("rl/" + k, 0.0) for r in later) for k in PHASES}
    sync_rate = statistics.mean(r["rl/sync_gb_per_s"] for r in later)
    # async rows after the first hold the stale batch's gap under rl/stale_logprob_gap
    gap = max(r.get("rl/rollout_logprob_gap", r.get("rl/stale_logprob_gap", 0.0)) for r in rows)
    tokens = statistics.mean(r["rl/response_length"] for r in later) * args.n * args.prompts

    print(f"\nrl_ray_gpus: {torch.cuda.get_device_name()} x {gpus}; --mode {args.mode}; shape {args.shape} "
          f"({nbytes / 2**30:.2f} GiB bf16); {args.prompts} prompts x {args.n} samples x <= {args.generate_max_len} "
          f"tokens; ZeRO-{args.zero_stage}; engine {args.rollout_engine} TP {args.tp}; "
          f"{f'async, max staleness {staleness}' if staleness else 'sync'}; {len(rows)} iterations, "
          f"wall {wall:.0f} s with start-up (means over iterations 2..)")
    outside = wall - sum(r["rl/iteration_s"] for r in rows)
    print(f"outside the iterations (start-up: Ray, the models, the engines; shutdown): {outside:.1f} s")
    print(f"{'phase':<16}{'seconds':>10}{'share':>8}")
    for k in PHASES:
        print(f"{k[:-2]:<16}{mean[k]:>10.3f}{mean[k] / mean['iteration_s']:>8.1%}")
    print(f"generate: {tokens / max(mean['generate_s'], 1e-9):.0f} tok/s")
    print(f"weight sync: {sync_rate:.1f} GB/s; device copy on one GPU {same:.1f} GB/s -> ratio {sync_rate / same:.3f}"
          + (f"; peer copy GPU 0 -> {args.actor_gpus} {peer:.1f} GB/s -> ratio {sync_rate / peer:.3f}" if peer else ""))
    per_it = ", ".join(f"{r.get('rl/sync_s', 0.0) * 1e3:.1f}" for r in rows)
    if "rl/sync_load_s" in rows[0]:
        per_it += " (the policy's call + the engine's: " + ", ".join(
            f"{r['rl/sync_share_s'] * 1e3:.1f} + {r['rl/sync_load_s'] * 1e3:.1f}" for r in rows) + ")"
    if "rl/sync_share_work_s" in rows[0] and "rl/sync_load_work_s" in rows[0]:
        per_it += ("; inside the policy's method + inside the engine actor's (the rest is Ray's calls): " + ", ".join(
            f"{r['rl/sync_share_work_s'] * 1e3:.1f} + {r['rl/sync_load_work_s'] * 1e3:.1f}" for r in rows))
    print(f"sync per iteration (ms, wake excluded): {per_it}; a device copy of the same bytes "
          f"{nbytes / same / 1e6:.2f} ms"
          + (f"; in place (the engines read the policy's own memory): "
             f"{[int(r['rl/sync_in_place']) for r in rows]}" if "rl/sync_in_place" in rows[0] else ""))
    print(f"engine vs policy logprobs: max gap {gap:.2e} (the engine samples from the synced weights)")
    steady = [r["rl/iteration_s"] for r in rows[2:]] or [r["rl/iteration_s"] for r in later]
    lengths = [r["rl/response_length"] for r in rows]
    print(f"steady-state iteration (median of iterations 3..): {statistics.median(steady):.3f} s; mean response "
          f"length per iteration {', '.join(f'{x:.0f}' for x in lengths)}")
    return {"staleness": staleness, "phases": mean, "steady_iteration_s": statistics.median(steady),
            "sync_gb_per_s": sync_rate, "max_logprob_gap": gap, "wall_s": wall, "outside_iterations_s": outside,
            "command": cmd, "rows": rows}


if __name__ == "__main__":
    main()
