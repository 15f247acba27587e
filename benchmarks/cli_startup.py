"""How long the ``rl`` command takes to answer ``--help``, against an empty interpreter, in one run.

    uv run python benchmarks/cli_startup.py [--repeats 5]

Times (median of ``--repeats`` runs after one warm-up that writes the bytecode, as an installed package has it):
``python -c pass``, ``rl --help`` and the ``--help`` of ``rl ppo``, ``rl ppo-ray``, ``rl sft``, ``rl dpo`` and
``rl demo``; prints each and its ratio to ``python -c pass``, and which heavy libraries each imports (``-X
importtime``). Targets (issue 39 item 3, on a 2-core machine): ``rl --help`` under 1 s, ``rl ppo --help`` under 3 s.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

HEAVY = ("torch", "transformers", "deepspeed", "ray", "vllm", "datasets", "peft", "sympy")
CASES = {
    "python -c pass": [sys.executable, "-c", "pass"],
    "rl --help": [sys.executable, "-m", "rl_cli.main", "--help"],
    "rl ppo --help": [sys.executable, "-m", "rl_cli.main", "ppo", "--help"],
    **{f"rl {c} --help": [sys.executable, "-m", "rl_cli.main", c, "--help"] for c in ("ppo-ray", "sft", "dpo", "demo")},
}
TARGETS = {"rl --help": 1.0, "rl ppo --help": 3.0}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env.setdefault("PYTHONPYCACHEPREFIX", tempfile.mkdtemp(prefix="rl-cli-startup-pyc."))
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs, median of {args.repeats} after a warm-up")
    base = None
    failed = False
    for name, cmd in CASES.items():
        subprocess.run(cmd, env=env, capture_output=True, check=True)  # warm-up: bytecode written
        times = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            subprocess.run(cmd, env=env, capture_output=True, check=True)
            times.append(time.perf_counter() - t)
        med = statistics.median(times)
        base = base or med
        trace = subprocess.run([cmd[0], "-X", "importtime", *cmd[1:]], env=env, capture_output=True, text=True)
        mods = {line.rsplit("|", 1)[-1].strip() for line in trace.stderr.splitlines() if line.startswith("import time")}
        heavy = sorted(h for h in HEAVY if h in mods)
        target = TARGETS.get(name)
        verdict = "" if target is None else (f"  target < {target:g} s: " + ("met" if med < target else "MISSED"))
        failed |= target is not None and med >= target
        print(
            f"{name:<20} {med:6.3f} s  {med / base:6.1f}x python -c pass  imports: {', '.join(heavy) or 'none'}"
            f"{verdict}"
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
