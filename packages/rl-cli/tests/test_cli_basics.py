"""`rl --version` and `rl doctor` through the installed console script."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[3]


def rl(*args):
    exe = shutil.which("rl")
    cmd = [exe, *args] if exe else [sys.executable, "-m", "rl_cli.main", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def test_version_lists_every_package_with_its_pyproject_version():
    out = rl("--version")
    assert out.returncode == 0, out.stderr
    for folder in ("rl-algos", "rl-rollout", "rl-placement", "rl-core", "rl-cli"):
        project = tomllib.loads((ROOT / "packages" / folder / "pyproject.toml").read_text())["project"]
        assert f"{project['name']} {project['version']}" in out.stdout.splitlines()


def test_doctor_reports_components_and_names_each_fix():
    out = rl("doctor")
    assert out.returncode == 0, out.stderr
    lines = {line.split()[0]: line for line in out.stdout.splitlines() if line.strip()}
    assert {"torch", "transformers", "deepspeed", "ray", "vllm", "liger_kernel"} <= set(lines)
    for line in out.stdout.splitlines():  # every part that cannot be used is followed by the command that fixes it
        if "<-" in line:
            following = out.stdout.split(line, 1)[1].lstrip("\n").splitlines()[0]
            assert following.strip().startswith("fix: "), (line, following)
    assert "Setting accelerator to CPU" not in out.stdout + out.stderr  # DeepSpeed's notice, dropped


def test_doctor_for_a_command_exits_1_naming_what_it_lacks():
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed in this venv: rl doctor ppo --rollout_engine vllm can run here")
    out = rl("doctor", "ppo", "--rollout_engine", "vllm")
    assert out.returncode == 1, out.stdout
    assert "rl ppo --rollout_engine vllm: cannot run here" in out.stdout
    assert "vllm (--rollout_engine vllm): not usable (ModuleNotFoundError" in out.stdout
    assert "fix: bash scripts/vllm-cpu-env.sh" in out.stdout or "fix: pip install 'rl-stack-cli[vllm]'" in out.stdout
    ok = rl("doctor", "sft", "--pretrain", "x")
    assert ok.returncode == 0 and "rl sft --pretrain x: every part it needs is here" in ok.stdout, ok.stdout


def test_doctor_checks_versions_against_what_our_packages_declare(monkeypatch):
    from rl_cli import doctor

    real = doctor.md.version
    monkeypatch.setattr(doctor.md, "version", lambda dist: "4.46.0" if dist == "transformers" else real(dist))
    (check,) = doctor.check_parts([doctor._BY_MODULE["transformers"]])
    assert check.version == "4.46.0" and check.problem is not None
    assert "needs transformers<6,>=5" in check.problem and check.fix == "pip install 'transformers<6,>=5'"
    assert [p.module for p in doctor.needs("ppo-ray", ["--rollout_engine=vllm", "--lora_rank", "8"])] == [
        "torch", "transformers", "deepspeed", "ray", "vllm", "peft"]


def test_unknown_command_fails():
    out = rl("ppo-ray-nope")
    assert out.returncode != 0
    assert "invalid choice" in out.stderr
