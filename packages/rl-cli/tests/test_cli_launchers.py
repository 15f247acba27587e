"""The launchers OpenRLHF users run, on CPU: ``deepspeed --module rl_cli.train_sft`` (which adds
``--local_rank=N``), and ``ray start --head`` followed by ``python -m rl_cli.train_ppo_ray`` with no
address, with ``RAY_ADDRESS``, and over a second node (a second ``ray start --address`` raylet on this
machine stands in for it). Ray's token authentication is on, as ``ray start --head`` turns it on when a
token exists: the driver joins without being told, and a driver without the token stops in one line
naming ``RAY_AUTH_MODE=token``. ``ray job submit`` needs Ray's dashboard (``ray[default]``): run when it
is installed. torchrun: ``test_cli_train.py::test_two_ranks_under_torchrun_match_one_process``.

Each cluster here gets its own ``RAY_TMPDIR``, ``HOME`` (so its own ``~/.ray/auth_token``) and ports,
and is stopped by killing the processes that carry that ``RAY_TMPDIR``: never ``ray stop``, which
would stop every Ray on the machine."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from rl_cli.ppo import _groups as ppo_groups
from rl_cli.train import COMMANDS, _groups
from rl_rollout.testing import kill_started_with

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]
BIN = Path(sys.executable).parent
REAL_HOME = Path.home()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    from rl_rollout.testing import make_tiny_model

    root = tmp_path_factory.mktemp("launch")
    make_tiny_model(root / "tiny")
    (root / "sft.jsonl").write_text("".join(json.dumps({"q": f"say {w}", "a": w}) + "\n" for w in "abcdefgh"))
    (root / "prompts.jsonl").write_text(
        "".join(json.dumps({"prompt": f"Repeat the letter {c}: ", "label": c}) + "\n" for c in "ab"))
    (root / "reward.py").write_text("def letter(prompt, response, label, **info):\n"
                                    "    return float(label in response)\n")
    return root


def clean_env(**extra) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", **extra}
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "RAY_ADDRESS", "RAY_AUTH_MODE",
                "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        if var not in extra:
            env.pop(var, None)
    return env


# ----- deepspeed --module ---------------------------------------------------------------------


@pytest.mark.parametrize("name", [*COMMANDS, "ppo", "ppo-ray"])
def test_every_command_accepts_the_local_rank_the_deepspeed_launcher_adds(name):
    from rl_cli.config import build_parser
    from rl_cli.loading import resolve

    groups = _groups(COMMANDS[name]) if name in COMMANDS else ppo_groups(name == "ppo-ray")
    parser, flags = build_parser(f"rl {name}", "", groups)
    for argv in (["--local_rank=3"], ["--local_rank", "3"]):
        assert resolve(groups, parser.parse_args(argv), flags)["strategy"].local_rank == 3


@pytest.mark.multiprocess
@pytest.mark.skipif(shutil.which("deepspeed", path=str(BIN)) is None, reason="the deepspeed launcher is not installed")
def test_deepspeed_launcher_runs_the_sft_module_on_two_cpu_ranks(task, tmp_path):
    out = subprocess.run(
        [str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()), "--module", "rl_cli.train_sft",
         "--pretrain", str(task / "tiny"), "--dataset", str(task / "sft.jsonl"), "--input_key", "q", "--output_key",
         "a", "--train_batch_size", "4", "--micro_train_batch_size", "2", "--bf16", "false", "--max_steps", "1",
         "--zero_stage", "2", "--run_dir", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=800, env=clean_env(), cwd=tmp_path)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    assert "'--local_rank=1'" in text  # the launcher's own flag reached our parser
    assert "accumulation 1 x data parallel 2" in out.stdout and "[rl sft] done: 1 steps" in out.stdout


# ----- Ray: ray start --head, then the module --------------------------------------------------


class Cluster:
    """``ray start --head`` (and ``ray start --address`` workers) under a private RAY_TMPDIR and HOME."""

    def __init__(self, gpus: int, dashboard_port: int | None = None):
        self.tmp = Path(tempfile.mkdtemp(prefix="rlray", dir="/tmp"))  # short: Ray's unix sockets live here
        self.home = self.tmp / "home"
        self.home.mkdir()
        self.port = free_port()
        # HOME holds this cluster's token; the caches the workers need stay where they are
        self.env = clean_env(HOME=str(self.home), RAY_TMPDIR=str(self.tmp),
                             TORCH_EXTENSIONS_DIR=str(REAL_HOME / ".cache" / "torch_extensions"),
                             HF_HOME=os.environ.get("HF_HOME", str(REAL_HOME / ".cache" / "huggingface")),
                             RAY_ENABLE_UV_RUN_RUNTIME_ENV="0")
        self.ray(["get-auth-token", "--generate"])
        assert (self.home / ".ray" / "auth_token").is_file()
        self.dashboard_port = dashboard_port
        dash = (["--include-dashboard", "true", "--dashboard-port", str(dashboard_port)] if dashboard_port
                else ["--include-dashboard", "false"])
        out = self.ray(["start", "--head", "--port", str(self.port), "--num-cpus", "2", "--num-gpus", str(gpus),
                        *dash, "--disable-usage-stats"])
        assert "Token authentication is enabled" in out, out[-2000:]  # what a user meets, Ray 2.52+
        self.address = (self.tmp / "ray" / "ray_current_cluster").read_text().strip()

    def ray(self, args: list[str], **env) -> str:
        out = subprocess.run([str(BIN / "ray"), *args], capture_output=True, text=True, timeout=180,
                             env={**self.env, **env})
        assert out.returncode == 0, (args, out.stdout[-2000:], out.stderr[-3000:])
        return out.stdout + out.stderr

    def add_node(self, gpus: int) -> None:
        """A second raylet joining the head: what `ray start --address` on a second machine does (token mode on)."""
        self.ray(["start", "--address", self.address, "--num-cpus", "1", "--num-gpus", str(gpus),
                  "--disable-usage-stats"], RAY_AUTH_MODE="token")

    def stop(self) -> None:
        kill_started_with("RAY_TMPDIR", str(self.tmp))  # this cluster's processes alone, not a user's cluster
        time.sleep(0.5)
        shutil.rmtree(self.tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(gpus=2)
    try:
        yield c
    finally:
        c.stop()


def ppo_ray(task, run, *extra) -> list[str]:
    return [sys.executable, "-m", "rl_cli.train_ppo_ray", "--pretrain", str(task / "tiny"), "--prompt_data",
            str(task / "prompts.jsonl"), "--input_key", "prompt", "--label_key", "label", "--reward_fn",
            f"{task / 'reward.py'}:letter", "--advantage_estimator", "group_norm", "--n_samples_per_prompt", "2",
            "--rollout_batch_size", "2", "--train_batch_size", "4", "--generate_max_len", "4", "--max_iterations",
            "1", "--init_kl_coef", "0", "--bf16", "false", "--rollout_engine", "hf", "--run_dir", str(task / run),
            *extra]


@pytest.mark.multiprocess
def test_ray_start_head_then_the_module_joins_it_with_token_auth(task, cluster):
    """No address, as in OpenRLHF's README: the module finds the `ray start` cluster of this machine."""
    out = subprocess.run(ppo_ray(task, "joined"), capture_output=True, text=True, timeout=800, env=cluster.env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    assert f"Connecting to existing Ray cluster at address: {cluster.address}" in out.stderr, out.stderr[-3000:]
    assert "[rl ppo-ray] done: 1 iterations" in out.stdout


def test_a_driver_without_the_token_stops_in_one_line_naming_ray_auth_mode(task, cluster, tmp_path):
    env = {**cluster.env, "HOME": str(tmp_path), "RAY_ADDRESS": cluster.address}  # the token was not copied here
    out = subprocess.run(ppo_ray(task, "refused"), capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("rl ppo-ray: cannot join the Ray cluster at") and "RAY_AUTH_MODE=token" in last, \
        out.stderr[-3000:]
    assert "~/.ray/auth_token" in last and "Traceback" not in out.stderr


@pytest.mark.multiprocess
def test_ray_address_and_a_second_node_run_a_placement_that_needs_both(task, cluster):
    """Head 2 GPUs + a second node with 2: the actor's 2 ranks and the engine's GPU do not fit on one node."""
    cluster.add_node(gpus=2)
    env = {**cluster.env, "RAY_ADDRESS": cluster.address}  # explicit: Ray alone would not turn token mode on
    out = subprocess.run(ppo_ray(task, "two-nodes", "--actor_num_gpus_per_node", "2", "--vllm_num_engines", "1",
                                 "--placement_strategy", "SPREAD"),
                         capture_output=True, text=True, timeout=800, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    assert "policy on cpu x 2" in out.stdout and "[rl ppo-ray] done: 1 iterations" in out.stdout, out.stdout[-3000:]


def wait_for_http(url: str, timeout_s: float = 120.0) -> None:
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            urllib.request.urlopen(url, timeout=5).close()
            return
        except urllib.error.HTTPError:  # it answered (401 without the token): up
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1)


@pytest.mark.multiprocess
@pytest.mark.skipif(importlib.util.find_spec("aiohttp") is None,
                    reason="ray job submit needs Ray's dashboard: pip install 'rl-stack-cli[ray-jobs]' (ray[default])")
def test_ray_job_submit_runs_the_module_as_the_jobs_driver(task):
    """Ray's own `ray job submit` needs RAY_AUTH_MODE=token on a token cluster (nothing of ours runs before it
    connects); the job's driver, our module, then joins with the token the cluster's processes carry."""
    c = Cluster(gpus=2, dashboard_port=free_port())
    try:
        wait_for_http(f"http://127.0.0.1:{c.dashboard_port}/api/version")  # the dashboard starts after `ray start`
        submit = [str(BIN / "ray"), "job", "submit", "--address", f"http://127.0.0.1:{c.dashboard_port}", "--",
                  *ppo_ray(task, "job")]
        refused = subprocess.run(submit, capture_output=True, text=True, timeout=300, env=c.env)
        assert refused.returncode != 0 and "token" in refused.stderr.lower(), refused.stderr[-2000:]
        out = subprocess.run(submit, capture_output=True, text=True, timeout=800,
                             env={**c.env, "RAY_AUTH_MODE": "token"})
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        assert "[rl ppo-ray] done: 1 iterations" in out.stdout and "succeeded" in out.stdout, out.stdout[-3000:]
    finally:
        c.stop()
