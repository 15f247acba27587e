"""OpenRLHF's logging flags on every command: ``--use_wandb KEY`` (the key never printed, never in the config),
``--wandb_project``, ``--wandb_run_name``, ``--use_tensorboard DIR``, with ``WANDB_MODE=offline`` writing a real
wandb run that holds the metrics; without wandb installed, ``--use_wandb`` fails in one line naming the extra."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from rl_cli.ppo import _groups as ppo_groups
from rl_cli.train import COMMANDS, _groups, _wandb_key

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]
KEY = "k3y-0f-a-test-that-must-never-show-0123456789"
needs_wandb = pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="wandb is not installed here")


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    from rl_rollout.testing import make_tiny_model

    root = tmp_path_factory.mktemp("logging")
    make_tiny_model(root / "tiny")
    (root / "sft.jsonl").write_text("".join(json.dumps({"q": f"say {w}", "a": w}) + "\n" for w in "abcd"))
    (root / "prompts.jsonl").write_text(
        "".join(json.dumps({"prompt": f"Repeat the letter {c}: ", "label": c}) + "\n" for c in "ab"))
    (root / "reward.py").write_text("def letter(prompt, response, label, **info):\n"
                                    "    return float(label in response)\n")
    return root


def env(**extra):
    out = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "OMP_NUM_THREADS": "1", **extra}
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "WANDB_API_KEY"):
        out.pop(var, None)
    return out


def sft_argv(root, run):
    return ["--pretrain", str(root / "tiny"), "--dataset", str(root / "sft.jsonl"), "--input_key", "q", "--output_key",
            "a", "--train_batch_size", "4", "--micro_train_batch_size", "4", "--bf16", "false", "--max_epochs", "2",
            "--run_dir", str(root / run)]


def ppo_argv(root, run):
    return ["--pretrain", str(root / "tiny"), "--prompt_data", str(root / "prompts.jsonl"), "--input_key", "prompt",
            "--label_key", "label", "--reward_fn", f"{root / 'reward.py'}:letter", "--advantage_estimator",
            "group_norm", "--n_samples_per_prompt", "2", "--rollout_batch_size", "2", "--train_batch_size", "4",
            "--generate_max_len", "4", "--max_iterations", "2", "--init_kl_coef", "0", "--bf16", "false",
            "--run_dir", str(root / run)]


def wandb_run(run_dir):
    runs = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, list((run_dir / "wandb").iterdir()) if (run_dir / "wandb").exists() else run_dir
    (events,) = runs[0].glob("run-*.wandb")
    return events.read_bytes()


@pytest.mark.parametrize("name", [*COMMANDS, "ppo", "ppo-ray"])
def test_every_command_takes_the_logging_flags_in_both_dialects(name, monkeypatch):
    from rl_cli.config import build_parser
    from rl_cli.loading import resolve

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    groups = _groups(COMMANDS[name]) if name in COMMANDS else ppo_groups(name == "ppo-ray")
    parser, flags = build_parser(f"rl {name}", "", groups)
    for argv in (["--use_wandb", KEY, "--wandb_project", "p", "--wandb_run_name", "r", "--wandb_org", "o",
                  "--wandb_group", "g", "--use_tensorboard", "tb"],
                 [f"--logger.wandb.key={KEY}", "--logger.wandb.project", "p", "--logger.wandb.run_name", "r",
                  "--logger.wandb.org", "o", "--logger.wandb.group", "g", "--logger.tensorboard_dir", "tb"]):
        monkeypatch.delenv("WANDB_API_KEY", raising=False)
        log = resolve(groups, parser.parse_args(_wandb_key(argv, parser)), flags)["logger"]
        assert (log.use_wandb, log.wandb_project, log.wandb_run_name, log.wandb_org, log.wandb_group,
                log.use_tensorboard) == (True, "p", "r", "o", "g", "tb")
        assert os.environ["WANDB_API_KEY"] == KEY and KEY not in repr(log)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    log = resolve(groups, parser.parse_args(_wandb_key(["--use_wandb", "True"], parser)), flags)["logger"]
    assert log.use_wandb is True and "WANDB_API_KEY" not in os.environ  # True: wandb's own login or env


@needs_wandb
@pytest.mark.parametrize("module,argv", [("rl_cli.train_sft", sft_argv), ("rl_cli.train_ppo", ppo_argv)])
def test_wandb_offline_run_and_tensorboard_dir_hold_the_metrics_and_the_key_is_never_printed(task, module, argv):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = f"run-{module.rsplit('_', 1)[1]}"
    tb = task / f"{run}-tb"
    cmd = [sys.executable, "-m", module, *argv(task, run), "--use_wandb", KEY, "--wandb_project", "rl-test",
           "--wandb_run_name", f"{run}-name", "--use_tensorboard", str(tb)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env())
    assert out.returncode == 0, out.stderr[-3000:]
    assert KEY not in out.stdout + out.stderr
    first = json.loads((task / run / "metrics.jsonl").read_text().splitlines()[0])
    name = "train/loss" if "sft" in module else "rl/reward_mean"
    assert name in first
    events = wandb_run(task / run)
    assert name.encode() in events and b"rl-test" in events and f"{run}-name".encode() in events
    assert KEY.encode() not in events  # the key is not logged as config either
    acc = EventAccumulator(str(tb))
    acc.Reload()
    assert name in acc.Tags()["scalars"] and len(acc.Scalars(name)) == 2
    assert not (task / run / "tensorboard").exists()  # --use_tensorboard DIR replaces RUN_DIR/tensorboard


def test_use_wandb_without_wandb_installed_fails_in_one_line_naming_the_extra(task, tmp_path):
    shadow = tmp_path / "shadow" / "wandb"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('No module named wandb')\n")
    e = env(PYTHONPATH=os.pathsep.join([str(tmp_path / "shadow"), os.environ.get("PYTHONPATH", "")]))
    for module, argv in (("rl_cli.train_sft", sft_argv), ("rl_cli.train_ppo", ppo_argv)):
        out = subprocess.run([sys.executable, "-m", module, *argv(task, "none"), "--use_wandb", KEY],
                             capture_output=True, text=True, timeout=300, env=e)
        assert out.returncode != 0
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and "rl-core[wandb]" in lines[0] and "--use_wandb" in lines[0], out.stderr[-2000:]
        assert KEY not in out.stdout + out.stderr
        assert not (task / "none").exists()  # stopped before anything ran


needs_mlflow = pytest.mark.skipif(importlib.util.find_spec("mlflow") is None,
                                  reason="mlflow is not installed here (rl-core[mlflow])")


@needs_mlflow
@pytest.mark.parametrize(("module", "argv"), [("rl_cli.train_sft", sft_argv), ("rl_cli.train_ppo", ppo_argv)])
def test_use_mlflow_writes_every_step_to_a_local_store_in_the_run_folder(task, module, argv):
    """``--use_mlflow`` with no server: a SQLite store in the run folder holds the same steps as metrics.jsonl,
    the run's config as parameters; read back with MLflow's own client."""
    from mlflow import MlflowClient

    run = f"mlflow-{module.rsplit('_', 1)[1]}"
    out = subprocess.run([sys.executable, "-m", module, *argv(task, run), "--use_mlflow", "--mlflow_experiment",
                          "exp", "--mlflow_run_name", "r1"], env=env(), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(x) for x in (task / run / "metrics.jsonl").read_text().splitlines()]
    client = MlflowClient(tracking_uri=f"sqlite:///{task / run / 'mlflow.db'}")
    (found,) = client.search_runs([client.get_experiment_by_name("exp").experiment_id])
    assert found.info.run_name == "r1" and found.info.status == "FINISHED"
    name = next(k for k in rows[-1] if k != "step")  # one of the run's scalars
    history = client.get_metric_history(found.info.run_id, name)
    assert [(m.step, m.value) for m in history] == [(r["step"], pytest.approx(r[name])) for r in rows if name in r]
    assert found.data.params, "the run's config was not logged as parameters"
