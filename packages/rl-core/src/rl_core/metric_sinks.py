"""Where a run's scalars go besides ``metrics.jsonl`` and ``curves.png``: the sink interface, and MLflow.

:class:`MetricSink` is what :class:`~rl_core.metrics.MetricsLogger` calls on rank 0 for every logged step
(``log``), when a resumed run forgets the steps after its checkpoint (``rewind``) and at the end (``close``).
TensorBoard and wandb are written by the logger itself; any other tracker is one class with these three methods,
passed as ``MetricsLogger(..., sinks=[MySink()])``. :class:`MLflowSink` is the one shipped: ``--use_mlflow``
(rl-core[mlflow]), a local SQLite store in the run folder by default, no server.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from rl_core.configs.mlflow import MLflowConfig

__all__ = ["MLflowSink", "MetricSink", "import_mlflow"]


@runtime_checkable
class MetricSink(Protocol):
    """A destination for a run's scalars. ``metrics`` holds finite and non-finite floats alike."""

    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def rewind(self, step: int) -> None:
        """A resumed run logs the steps after ``step`` again; a sink that cannot forget may keep both."""
        ...

    def close(self) -> None: ...


def import_mlflow() -> Any:
    try:
        import mlflow
    except ImportError:
        raise RuntimeError(
            "--use_mlflow needs MLflow, which is not installed: pip install 'rl-core[mlflow]' (mlflow-skinny with "
            "SQLAlchemy and Alembic for the local SQLite store)"
        ) from None
    return mlflow


class MLflowSink:
    """Logs every step's scalars to one MLflow run (``cfg.experiment``, ``cfg.run_name``) with the run's config as
    its parameters. The default store is ``sqlite:///RUN_DIR/mlflow.db``; a run with no run folder needs
    ``--mlflow_tracking_uri``. MLflow cannot unlog: after a resume, steps logged twice keep both values."""

    def __init__(self, cfg: MLflowConfig, run_dir: str | Path | None, params: dict | None = None):
        mlflow = import_mlflow()
        uri = cfg.tracking_uri
        if uri is None:
            if run_dir is None:
                raise ValueError(
                    "--use_mlflow without --run_dir needs --mlflow_tracking_uri (e.g. sqlite:///mlflow.db)"
                )
            Path(run_dir).mkdir(parents=True, exist_ok=True)
            uri = f"sqlite:///{Path(run_dir).resolve() / 'mlflow.db'}"
        self.tracking_uri = uri
        self._client = mlflow.MlflowClient(tracking_uri=uri)
        experiment = self._client.get_experiment_by_name(cfg.experiment)
        experiment_id = (
            experiment.experiment_id if experiment is not None else self._client.create_experiment(cfg.experiment)
        )
        self.run_id: str = self._client.create_run(experiment_id, run_name=cfg.run_name).info.run_id
        for key, value in _flat_params(params or {}).items():
            self._client.log_param(self.run_id, key, value)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric  # lazy: optional extra (rl-core[mlflow]), imported by __init__ already

        now = _now_ms()
        batch = [Metric(key=_key(k), value=v, timestamp=now, step=step) for k, v in metrics.items()]
        self._client.log_batch(self.run_id, metrics=batch)

    def rewind(self, step: int) -> None:
        pass  # MLflow keeps every logged value; the repeated steps show as a second value at the same step

    def close(self) -> None:
        if self.run_id:
            self._client.set_terminated(self.run_id)
            self.run_id = ""


def _now_ms() -> int:
    return int(time.time() * 1000)


def _key(name: str) -> str:
    """MLflow keys allow letters, digits, ``_ - . / space``; anything else becomes ``_``."""
    return "".join(c if c.isalnum() or c in "_-./ " else "_" for c in name)


def _flat_params(params: dict, prefix: str = "") -> dict[str, str]:
    """Nested config dicts as ``a.b.c`` parameters, each value as text cut to MLflow's 6,000 characters."""
    out: dict[str, str] = {}
    for k, v in params.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flat_params(v, f"{name}."))
        else:
            out[_key(name)] = str(v)[:6000]
    return out
