"""MetricsLogger: metrics.jsonl, TensorBoard, curves.png, and wandb in offline mode (or the install hint)."""

from __future__ import annotations

import importlib.util
import json

import pytest

from rl_core.metrics import MetricsLogger


def test_files_a_person_can_look_at(tmp_path):
    m = MetricsLogger(tmp_path)
    for step in range(1, 4):
        m.log(step, {"train/loss": 1.0 / step, "train/acc": step / 3})
    png = m.close()
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[2]["train/loss"] == pytest.approx(1 / 3)
    assert png.stat().st_size > 1000 and list((tmp_path / "tensorboard").iterdir())


def test_silent_on_other_ranks(tmp_path):
    m = MetricsLogger(tmp_path / "r1", enabled=False)
    m.log(1, {"x": 1.0})
    assert m.close() is None and not (tmp_path / "r1").exists()


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed: the offline test runs")
def test_wandb_missing_says_how_to_install(tmp_path):
    with pytest.raises(RuntimeError, match=r"pip install 'rl-core\[wandb\]' \(or pip install wandb\).*WANDB_MODE=offline"):
        MetricsLogger(tmp_path, wandb={"project": "t"})


@pytest.mark.skipif(importlib.util.find_spec("wandb") is None,
                    reason="wandb is not installed in this environment (the workspace dev group has it)")
def test_wandb_offline_run_is_written(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    m = MetricsLogger(tmp_path, wandb={"project": "rl-test", "name": "t", "config": {"lr": 1e-3}})
    m.log(1, {"train/loss": 2.0})
    m.log(2, {"train/loss": 1.0})
    m.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, list((tmp_path / "wandb").iterdir())
    assert list(runs[0].glob("*.wandb")), "the offline run holds its event file"


def test_a_tensorboard_folder_of_its_own_works_without_a_run_dir(tmp_path):
    from rl_core.metrics import LoggerConfig

    m = MetricsLogger.from_config(None, LoggerConfig(use_tensorboard=str(tmp_path / "tb")))
    m.log(1, {"train/loss": 1.0})
    assert m.close() is None  # no run_dir: no metrics.jsonl, no curves
    assert [p.name.startswith("events.out.tfevents") for p in (tmp_path / "tb").iterdir()] == [True]


def test_wandb_not_importable_fails_in_one_line_naming_the_extra(monkeypatch):
    from rl_core.metrics import LoggerConfig

    monkeypatch.setitem(__import__("sys").modules, "wandb", None)  # import wandb -> ImportError
    LoggerConfig().check()  # not asked for: nothing to check
    with pytest.raises(RuntimeError) as e:
        LoggerConfig(use_wandb=True).check()
    assert "\n" not in str(e.value) and "pip install 'rl-core[wandb]'" in str(e.value)


def test_rewind_keeps_one_row_per_step_across_a_resume(tmp_path):
    """A run that logged steps 1-5, stopped, and resumes from the checkpoint of step 3 logs 4 and 5 again:
    after rewind(3) the file holds each step once, the resumed values last, and the curves agree."""
    m = MetricsLogger(tmp_path)
    for s in range(1, 6):
        m.log(s, {"loss": float(s)})
    m.close()
    m = MetricsLogger(tmp_path)  # the resumed process
    assert m.rewind(3) == 2
    for s in (4, 5):
        m.log(s, {"loss": 10.0 * s})
    m.close()
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert [r["loss"] for r in rows] == [1.0, 2.0, 3.0, 40.0, 50.0]
    assert not (tmp_path / "metrics.jsonl.tmp").exists()
