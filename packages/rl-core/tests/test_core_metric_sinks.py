"""MetricsLogger's sinks: a tracker is one class with log / rewind / close (rl_core.metric_sinks.MetricSink), and
MLflow is one (--use_mlflow): a local SQLite store in the run folder, read back with MLflow's own client."""

from __future__ import annotations

import importlib.util
import json

import pytest

from rl_core.configs import MLflowConfig
from rl_core.metric_sinks import MetricSink
from rl_core.metrics import LoggerConfig, MetricsLogger


class Recorder:
    def __init__(self):
        self.calls: list[tuple] = []

    def log(self, step, metrics):
        self.calls.append(("log", step, dict(metrics)))

    def rewind(self, step):
        self.calls.append(("rewind", step))

    def close(self):
        self.calls.append(("close",))


def test_a_user_sink_gets_every_step_the_rewind_and_the_close(tmp_path):
    sink = Recorder()
    assert isinstance(sink, MetricSink)
    log = MetricsLogger(tmp_path, sinks=[sink], tensorboard=False)
    log.log(1, {"loss": 1.0})
    log.log(2, {"loss": 0.5, "reward": 0.25})
    log.rewind(1)
    log.log(2, {"loss": 0.4})
    log.close()
    assert sink.calls == [("log", 1, {"loss": 1.0}), ("log", 2, {"loss": 0.5, "reward": 0.25}), ("rewind", 1),
                          ("log", 2, {"loss": 0.4}), ("close",)]
    silent = Recorder()
    MetricsLogger(tmp_path / "other", enabled=False, sinks=[silent]).log(1, {"x": 1.0})  # a rank that is not 0
    assert silent.calls == []


@pytest.mark.skipif(importlib.util.find_spec("mlflow") is None, reason="mlflow is not installed (rl-core[mlflow])")
def test_mlflow_sink_holds_the_steps_and_the_config(tmp_path):
    from mlflow import MlflowClient

    cfg = LoggerConfig(mlflow=MLflowConfig(experiment="e", run_name="r"))
    log = MetricsLogger.from_config(tmp_path, cfg, run_config={"lr": 1e-3, "kl": {"coef": 0.1}})
    sink = log.sinks[0]
    log.log(1, {"loss": 1.0, "rl/reward": 0.5})
    log.log(2, {"loss": 0.5, "rl/reward": 0.75})
    log.close()
    assert sink.tracking_uri == f"sqlite:///{tmp_path.resolve() / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=sink.tracking_uri)
    (run,) = client.search_runs([client.get_experiment_by_name("e").experiment_id])
    assert run.info.run_name == "r" and run.info.status == "FINISHED"
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "rl/reward")] == [(1, 0.5), (2, 0.75)]
    assert run.data.params == {"lr": "0.001", "kl.coef": "0.1"}
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]  # metrics.jsonl as before, beside the store


def test_use_mlflow_without_a_run_folder_names_the_flag(tmp_path):
    if importlib.util.find_spec("mlflow") is None:
        pytest.skip("mlflow is not installed (rl-core[mlflow]): the import error comes first")
    with pytest.raises(ValueError, match="--use_mlflow without --run_dir needs --mlflow_tracking_uri"):
        MetricsLogger.from_config(None, LoggerConfig(mlflow=MLflowConfig()))
