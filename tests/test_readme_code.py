"""The packages' README code runs.

Each package README's ```python blocks are one script, run in a fresh folder in a
subprocess (``__name__ == "__main__"``, as a user pasting them would). A block whose
first line is ``# sketch: WHY`` needs what a test machine lacks (a GPU, a second
process set up by hand); it must still compile and every module it imports must
exist, and the test names where it runs for real (WHY). The root README's commands
are tested elsewhere (``rl demo`` in rl-cli's tests, the test command by CI itself).
"""

from __future__ import annotations

import ast
import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ["rl-algos", "rl-rollout", "rl-placement", "rl-core"]
BLOCK = re.compile(r"```python\n(.*?)```", re.S)


def blocks(pkg: str) -> tuple[list[str], list[str]]:
    """(runnable blocks, sketch blocks) of a package README, in order."""
    run, sketch = [], []
    for code in BLOCK.findall((ROOT / "packages" / pkg / "README.md").read_text()):
        (sketch if code.lstrip().startswith("# sketch:") else run).append(code)
    return run, sketch


@pytest.mark.timeout(900)
@pytest.mark.parametrize("pkg", PACKAGES)
def test_readme_code_runs(pkg, tmp_path):
    run, _ = blocks(pkg)
    assert run, f"{pkg}/README.md has no runnable python block"
    script = tmp_path / "readme.py"
    script.write_text("\n\n".join(run))
    # a fresh process, as a user's: no torch.distributed settings left by this process's earlier tests
    # (their MASTER_PORT is still held by this process's store)
    dist = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}
    env = {k: v for k, v in os.environ.items() if k not in dist}
    env.update(PYTHONPATH=str(tmp_path), RAY_ENABLE_UV_RUN_RUNTIME_ENV="0")
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=850,
                         env=env)
    assert out.returncode == 0, f"{pkg}/README.md code failed:\n{out.stdout[-3000:]}\n{out.stderr[-5000:]}"


@pytest.mark.parametrize("pkg", PACKAGES)
def test_readme_sketches_compile_and_import_what_exists(pkg):
    _, sketches = blocks(pkg)
    for code in sketches:
        tree = ast.parse(code)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                mod = importlib.import_module(node.module)
                for alias in node.names:
                    assert hasattr(mod, alias.name), f"{pkg} README sketch: {node.module} has no {alias.name}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    importlib.import_module(alias.name)


def test_the_plain_torch_loop_example_runs(tmp_path):
    """The rl-rollout README's loop sketch is the heart of this example file, which runs here."""
    out = subprocess.run([sys.executable, str(ROOT / "packages/rl-rollout/examples/plain_torch_loop.py"), "--steps",
                          "2", "--workdir", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(900)
def test_the_placement_readme_runs_beside_a_cluster_the_user_started():
    """issue 40 finding 9: with a `ray start --head` cluster up on the machine, the README's bare
    `ray.init(num_cpus=..., num_gpus=...)` found that cluster's recorded address and refused the resources
    ("When connecting to an existing cluster ..."). The README starts a Ray of its own (address="local")."""
    import shutil
    import tempfile

    from rl_rollout.testing import kill_started_with

    ray_bin = Path(sys.executable).parent / "ray"
    if not ray_bin.exists():
        pytest.skip(f"no ray command beside {sys.executable} to start a user's cluster with")
    short = Path(tempfile.mkdtemp(prefix="rt", dir="/tmp"))  # Ray's socket paths must stay under 107 characters
    env = {k: v for k, v in os.environ.items() if k not in {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                                                            "MASTER_ADDR", "MASTER_PORT", "RAY_ADDRESS"}}
    env.update(RAY_TMPDIR=str(short), RAY_ENABLE_UV_RUN_RUNTIME_ENV="0", PYTHONPATH=str(short))
    # ports of its own: a cluster the user runs here holds Ray's defaults (GCS 6379, client server 10001), and a
    # second head on them joins that GCS ("Session name ... does not match persisted value")
    ports = ["--port", str(_free_port()), "--ray-client-server-port", str(_free_port())]
    started = subprocess.run([str(ray_bin), "start", "--head", *ports, "--num-cpus", "1", "--include-dashboard",
                              "false", "--disable-usage-stats"], capture_output=True, text=True, timeout=300, env=env)
    try:
        assert started.returncode == 0, started.stderr[-3000:]
        assert (short / "ray" / "ray_current_cluster").is_file()  # the address a bare ray.init() would find
        run, _ = blocks("rl-placement")
        script = short / "readme.py"
        script.write_text("\n\n".join(run))
        out = subprocess.run([sys.executable, str(script)], cwd=short, capture_output=True, text=True, timeout=850,
                             env=env)
        assert out.returncode == 0, f"{out.stdout[-3000:]}\n{out.stderr[-5000:]}"
    finally:  # its own cluster's processes alone: `ray stop` would also stop a cluster the user runs here
        kill_started_with("RAY_TMPDIR", str(short))
        shutil.rmtree(short, ignore_errors=True)
