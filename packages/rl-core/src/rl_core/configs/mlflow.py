"""MLflow tracking (``--use_mlflow``): present on :class:`~rl_core.metrics.LoggerConfig` as ``mlflow`` when on;
:class:`~rl_core.metric_sinks.MLflowSink` logs the run's scalars there."""

from __future__ import annotations

from dataclasses import dataclass, field

from rl_rollout.config_fields import meta


@dataclass(frozen=True)
class MLflowConfig:
    """Where the run's metrics go in MLflow. No server needed: by default a SQLite store in the run folder
    (``RUN_DIR/mlflow.db``; browse it with ``mlflow ui --backend-store-uri sqlite:///RUN_DIR/mlflow.db``)."""

    tracking_uri: str | None = field(
        default=None,
        metadata=meta(
            "MLflow tracking URI: sqlite:///PATH, an http(s) server, databricks (default: sqlite:///RUN_DIR/mlflow.db)",
            flags=("mlflow_tracking_uri",),
        ),
    )
    experiment: str = field(default="rl", metadata=meta("MLflow experiment name", flags=("mlflow_experiment",)))
    run_name: str | None = field(
        default=None, metadata=meta("MLflow run name (default: MLflow's)", flags=("mlflow_run_name",))
    )

    def __post_init__(self) -> None:
        if not self.experiment:
            raise ValueError("mlflow_experiment (--mlflow_experiment) must be a non-empty name")
