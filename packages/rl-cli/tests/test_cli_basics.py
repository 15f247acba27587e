"""`rl --version` and `rl doctor` through the installed console script."""

import shutil
import subprocess
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[3]


def rl(*args):
    exe = shutil.which("rl")
    cmd = [exe, *args] if exe else [sys.executable, "-m", "rl_cli.main", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def test_version_lists_every_package_with_its_pyproject_version():
    out = rl("--version")
    assert out.returncode == 0, out.stderr
    for pkg in ("rl-algos", "rl-rollout", "rl-placement", "rl-core", "rl-cli"):
        v = tomllib.loads((ROOT / "packages" / pkg / "pyproject.toml").read_text())["project"]["version"]
        assert f"{pkg} {v}" in out.stdout.splitlines()


def test_doctor_reports_components():
    out = rl("doctor")
    assert out.returncode == 0, out.stderr
    lines = {line.split()[0]: line for line in out.stdout.splitlines() if line.strip()}
    assert {"torch", "transformers", "deepspeed", "ray", "vllm"} <= set(lines)
    assert "cpu only" in lines["torch"] or "cuda" in lines["torch"]


def test_unknown_command_fails():
    out = rl("ppo-ray-nope")
    assert out.returncode != 0
    assert "invalid choice" in out.stderr
