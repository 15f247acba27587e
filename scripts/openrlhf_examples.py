"""Run each of OpenRLHF's example scripts to the end on this CPU machine, scaled down; record the outcome.

Each script's own flags (rl_cli.openrlhf_examples.SCRIPTS) plus its printed overrides (OVERRIDES: sizes
scaled down, Ray's logical GPUs, each changed feature with its reason) run one at a time as
``python -m rl_cli.main COMMAND ...`` on tiny fixtures in a temp dir. ``rl serve-rm`` runs to the end when it
answers one /get_reward request and stops on SIGTERM. Per script the record holds: ran to the end, exit
code, seconds, the flags and overrides (with placeholders, so the test can tell a stale record), the
interpreter, and the last line of metrics.jsonl or the error's last lines. Results go to
docs/openrlhf-examples.json with the date and commit; scripts not run this time keep their old record.

    OMP_NUM_THREADS=1 python scripts/openrlhf_examples.py [SCRIPT ...] [--vllm_python PATH] [--timeout S]

Scripts that start vLLM engines (--vllm.num_engines) run under --vllm_python (vLLM's CPU build, default
.venv-vllm/bin/python at the repository root), the others under this interpreter.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from rl_cli.openrlhf_examples import OVERRIDES, SCRIPTS, record, run_argv, write_fixtures

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "openrlhf-examples.json"
ENV = {
    "OMP_NUM_THREADS": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "RAY_DEDUP_LOGS": "0",
    "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
    "WANDB_MODE": "offline",
    "TOKENIZERS_PARALLELISM": "false",
}


def uses_vllm(name: str) -> bool:
    return "--vllm.num_engines" in SCRIPTS[name].argv


def _wandb_shim(python: str, tmp: Path) -> tuple[str, str] | None:
    """Where ``python`` (vLLM's CPU venv) lacks wandb, a folder linking this interpreter's wandb (and platformdirs,
    the one module it needs beyond vLLM's) for its PYTHONPATH: the scripts with --logger.wandb.key log offline
    (WANDB_MODE=offline) instead of stopping at the missing package. (folder, note) or None."""
    if subprocess.run([python, "-c", "import wandb"], capture_output=True).returncode == 0:
        return None
    import platformdirs
    import wandb

    shim = tmp / "wandb-shim"
    shim.mkdir(exist_ok=True)
    for mod in (wandb, platformdirs):
        (shim / mod.__name__).symlink_to(Path(mod.__file__).parent)
    return str(shim), f"wandb {wandb.__version__} linked from {sys.executable}'s venv (not in the vLLM venv)"


def _tail(text: str, n: int = 12) -> list[str]:
    lines = [x for x in text.splitlines() if x.strip()]
    return lines[-n:]


def _serve(cmd: list[str], env: dict, timeout: float) -> tuple[int, str, str]:
    """Start the server, score one query at /get_reward, stop it with SIGTERM; (exit code, the reply, output)."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    out, reply, t0 = [], "", time.time()
    assert p.stdout is not None
    for line in p.stdout:
        out.append(line)
        if m := re.search(r"serving .* at (\S+) ", line):
            req = urllib.request.Request(
                m.group(1).rstrip("/") + "/get_reward",
                method="POST",
                data=json.dumps({"query": ["Repeat the letter a: aaaa"]}).encode(),
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(req, timeout=timeout) as r:
                reply = r.read().decode()
            p.send_signal(signal.SIGTERM)
        if time.time() - t0 > timeout:
            p.kill()
    code = p.wait()
    return code, reply, "".join(out)


def run_one(
    name: str, fx: dict[str, str], python: str, timeout: float, logs: Path | None, shim: tuple[str, str] | None
) -> dict:
    argv = run_argv(name, fx)
    cmd = [python, "-m", "rl_cli.main", *argv]
    print(f"=== {name}: rl {' '.join(argv[:1])} with the script's flags and these overrides:", flush=True)
    for o in OVERRIDES[name]:
        print(f"    {o.flags.format(**fx)}    # {o.why}", flush=True)
    env = {**os.environ, **ENV}
    note = ""
    if shim and "wandb" in SCRIPTS[name].argv and uses_vllm(name):
        env["PYTHONPATH"] = os.pathsep.join(x for x in (env.get("PYTHONPATH"), shim[0]) if x)
        note = shim[1]
        print(f"    ({note})", flush=True)
    t0 = time.time()
    if SCRIPTS[name].command == "serve-rm":
        code, reply, out = _serve(cmd, env, timeout)
        ok = code == 0 and '"rewards"' in reply
        last = [reply.strip()] if ok else _tail(out)
    else:
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
            code, out = p.returncode, p.stdout + p.stderr
        except subprocess.TimeoutExpired as e:
            text = [x.decode(errors="replace") if isinstance(x, bytes) else x or "" for x in (e.stdout, e.stderr)]
            code, out = 124, f"{text[0]}{text[1]}\ntimed out after {timeout:.0f} s"
        metrics = Path(fx["out"]) / "run" / "metrics.jsonl"
        rows = metrics.read_text().splitlines() if metrics.is_file() else []
        ok = code == 0 and bool(rows)
        last = [rows[-1]] if ok else _tail(out)
    seconds = round(time.time() - t0, 1)
    if logs is not None:
        logs.mkdir(parents=True, exist_ok=True)
        (logs / f"{name}.log").write_text(out)
    print(f"--- {name}: {'ran to the end' if ok else 'FAILED'}, exit {code}, {seconds} s", flush=True)
    for line in last:
        print("    " + line, flush=True)
    return {
        **record(name),
        "ran_to_end": ok,
        "exit_code": code,
        "seconds": seconds,
        "python": "vllm" if uses_vllm(name) else "workspace",
        "note": note,
        "last": last,
    }


def _commit() -> str:
    """HEAD, with "+uncommitted" when a tracked file other than the record and the README's table differs."""
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout
    ours = ("docs/openrlhf-examples.json", "packages/rl-cli/README.md")
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no", "--", ".", *(f":!{p}" for p in ours)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    ).stdout
    return sha.strip() + ("+uncommitted" if dirty.strip() else "")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("scripts", nargs="*", help=f"default: all of {', '.join(SCRIPTS)}")
    ap.add_argument("--vllm_python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per script")
    ap.add_argument("--results", type=Path, default=RESULTS)
    ap.add_argument("--logs", type=Path, help="write each script's whole output to LOGS/SCRIPT.log")
    args = ap.parse_args()
    unknown = [s for s in args.scripts if s not in SCRIPTS]
    if unknown:
        ap.error(f"unknown scripts {unknown}; choose from {list(SCRIPTS)}")
    if not Path(args.vllm_python).is_file():
        ap.error(f"--vllm_python {args.vllm_python}: no such interpreter (build it: scripts/vllm-cpu-env.sh)")
    old = json.loads(args.results.read_text()) if args.results.is_file() else {"scripts": {}}
    results = old["scripts"]
    with tempfile.TemporaryDirectory(prefix="openrlhf-examples-") as tmp:
        shared = write_fixtures(Path(tmp) / "fixtures")
        shim = _wandb_shim(args.vllm_python, Path(tmp))
        for name in args.scripts or SCRIPTS:
            fx = {**shared, "out": str(Path(tmp) / name.removesuffix(".sh"))}
            python = args.vllm_python if uses_vllm(name) else sys.executable
            results[name] = {
                **run_one(name, fx, python, args.timeout, args.logs, shim),
                "date": str(datetime.date.today()),
                "commit": _commit(),
            }
            args.results.write_text(
                json.dumps(
                    {"about": __doc__.splitlines()[0], "env": ENV, "scripts": dict(sorted(results.items()))}, indent=1
                )
                + "\n"
            )
            print(f"wrote {args.results}", flush=True)
    return 0 if all(r["ran_to_end"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
