"""What vLLM's sleep mode buys the trainer: a micro-batch that fits only while the engine sleeps (issue 16 item 2).

    python3 benchmarks/sleep_headroom.py            # GPU (CUDA, vLLM, DeepSpeed), about 3-4 minutes on an H200

Three runs of ``benchmarks/rl_phases.py`` (the real ``rl ppo`` loop: PPO with a critic and a reference,
ZeRO-2, bf16, vLLM in the trainer's process), each in its own process, the engine holding
``--gpu_memory_utilization`` of the GPU:

1. engine awake, ``--small_micro`` rows per training micro-batch (fits beside the engine);
2. engine awake, ``--big_micro`` rows (expected: out of device memory);
3. engine asleep while the models train (``--vllm_enable_sleep``, level ``--sleep_level``), ``--big_micro`` rows.

Prints, per run: finished or out of memory, peak device memory over the loop, the policy and critic
train seconds per iteration, the policy's response tokens/s, and for run 3 what one sleep returned.
The same prompts, seeds and settings in all three; response lengths come from sampling (up to
``--generate_max_len``), so compare the per-token rates.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpu_memory_utilization", type=float, default=0.8)
    ap.add_argument("--small_micro", type=int, default=8)
    ap.add_argument("--big_micro", type=int, default=64)
    ap.add_argument("--rollout_batch_size", type=int, default=16)
    ap.add_argument("--n_samples_per_prompt", type=int, default=8)
    ap.add_argument("--generate_max_len", type=int, default=1024)
    ap.add_argument("--iterations", type=int, default=2)
    ap.add_argument("--sleep_level", type=int, default=2, choices=(1, 2))
    ap.add_argument("--out", help="write the three results as JSON here")
    args = ap.parse_args()
    common = ["--rollout_engine", "vllm", "--zero_stage", "2", "--no_baselines",
              "--gpu_memory_utilization", str(args.gpu_memory_utilization),
              "--rollout_batch_size", str(args.rollout_batch_size),
              "--n_samples_per_prompt", str(args.n_samples_per_prompt),
              "--generate_max_len", str(args.generate_max_len), "--iterations", str(args.iterations)]
    runs = [("awake", args.small_micro, []), ("awake", args.big_micro, []),
            ("asleep", args.big_micro, ["--enable_sleep", "--sleep_level", str(args.sleep_level)])]
    results = []
    work = Path(tempfile.mkdtemp(prefix="sleep-headroom-"))
    for k, (engine, micro, extra) in enumerate(runs):
        out = work / f"run{k}.json"
        cmd = [sys.executable, str(HERE / "rl_phases.py"), *common, "--micro_train_batch_size", str(micro),
               "--out", str(out), *extra]
        print(f"--- run {k + 1}: engine {engine}, micro-batch {micro}: {' '.join(cmd[1:])}", flush=True)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        tail = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith(("rl_phases", "device memory"))]
        print("\n".join(tail[-4:]), flush=True)
        if not out.exists():
            print((proc.stdout + proc.stderr)[-3000:])
            raise SystemExit(f"run {k + 1} failed (exit {proc.returncode}) without a result")
        r = json.loads(out.read_text())
        r.update(engine=engine, micro=micro, returncode=proc.returncode)
        results.append(r)
    print(f"\nsleep_headroom: engine share {args.gpu_memory_utilization}; {args.rollout_batch_size} x "
          f"{args.n_samples_per_prompt} x {args.generate_max_len} tokens; sleep level {args.sleep_level} in run 3")
    print(f"{'engine':<8}{'micro':>6}  {'result':<14}{'peak GiB':>9}{'policy s':>10}{'policy tok/s':>14}"
          f"{'critic s':>10}{'freed GiB':>10}")
    for r in results:
        if r["oom"]:
            print(f"{r['engine']:<8}{r['micro']:>6}  {'out of memory':<14}{r['peak_device_gib'] or 0:>9.1f}")
            continue
        ph = r["phases"]
        print(f"{r['engine']:<8}{r['micro']:>6}  {'finished':<14}{r['peak_device_gib'] or 0:>9.1f}"
              f"{ph['policy_train_s']:>10.3f}{r['tokens'] / ph['policy_train_s']:>14.0f}{ph['critic_train_s']:>10.3f}"
              f"{r.get('freed_gib') or 0:>10.1f}")
    if not results[0]["oom"] and not results[2]["oom"]:
        a, b = results[0]["phases"], results[2]["phases"]
        ra, rb = results[0]["tokens"] / (a["policy_train_s"] + a["critic_train_s"]), \
            results[2]["tokens"] / (b["policy_train_s"] + b["critic_train_s"])
        print(f"train phases (policy + critic), response tokens/s: asleep at micro {args.big_micro} {rb:.0f}, "
              f"awake at micro {args.small_micro} {ra:.0f} -> {rb / ra:.3f}x")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "runs": results}, indent=1))


if __name__ == "__main__":
    main()
