"""Run metrics a person can look at: JSONL, TensorBoard, PNG curves, console lines.

Rank 0 writes; other ranks' loggers are silent. ``metrics.jsonl`` holds one JSON
object per logged step (``{"step": N, "name": value, ...}``), ``tensorboard/``
the same scalars (or the folder ``tensorboard=`` names), and :meth:`MetricsLogger.close`
draws ``curves.png`` (one panel per metric). With ``wandb={"project": ..., "name": ...,
"entity": ..., "group": ..., "config": ...}`` the same scalars go to wandb too
(``WANDB_MODE=offline`` works without an account); wandb is optional (``rl-core[wandb]``)
and a missing install fails at start-up, in one line, with the fix.

:class:`LoggerConfig` holds the settings every command shares (OpenRLHF's
``--use_wandb``, ``--wandb_project``, ``--wandb_run_name``, ``--wandb_org``,
``--wandb_group``, ``--use_tensorboard``); :meth:`MetricsLogger.from_config` builds
the logger from it. The wandb API key is never a config value: the CLI moves
OpenRLHF's ``--use_wandb KEY`` into ``WANDB_API_KEY``, where wandb reads it. ``--use_mlflow``
(:class:`~rl_core.configs.mlflow.MLflowConfig`) adds MLflow, and any other tracker is a
:class:`~rl_core.metric_sinks.MetricSink` passed as ``sinks=`` (log, rewind, close).
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from rl_core.configs.mlflow import MLflowConfig
from rl_core.metric_sinks import MetricSink, MLflowSink, import_mlflow
from rl_rollout.config_fields import meta

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoggerConfig:
    """Where a run's metrics go besides ``run_dir`` (metrics.jsonl, curves.png): wandb, TensorBoard, MLflow."""

    use_wandb: bool = field(
        default=False,
        metadata=meta(
            "also log to wandb (needs rl-core[wandb]); OpenRLHF's --use_wandb KEY works: the key goes to "
            "WANDB_API_KEY and is never printed; true uses WANDB_API_KEY or wandb login; WANDB_MODE=offline logs "
            "without an account",
            openrlhf=("logger.wandb.key",),
        ),
    )
    wandb_project: str = field(default="rl", metadata=meta("wandb project", openrlhf=("logger.wandb.project",)))
    wandb_run_name: str | None = field(
        default=None, metadata=meta("wandb run name (default: wandb's)", openrlhf=("logger.wandb.run_name",))
    )
    wandb_org: str | None = field(
        default=None, metadata=meta("wandb entity (team or user; default: the key's)", openrlhf=("logger.wandb.org",))
    )
    wandb_group: str | None = field(default=None, metadata=meta("wandb run group", openrlhf=("logger.wandb.group",)))
    use_tensorboard: str | None = field(
        default=None,
        metadata=meta(
            "TensorBoard event folder (default: RUN_DIR/tensorboard when --run_dir is set, else none)",
            openrlhf=("logger.tensorboard_dir",),
        ),
    )

    mlflow: MLflowConfig | None = field(
        default=None,
        metadata={
            **meta(
                "also log to MLflow (needs rl-core[mlflow]): a SQLite store in the run folder by default, no server "
                "(--mlflow_tracking_uri for another)",
                flags=("use_mlflow",),
            ),
            "switch": True,
        },
    )

    def check(self) -> None:
        """Fail now, in one line, when ``use_wandb`` / ``use_mlflow`` is set and its library cannot be imported."""
        if self.use_wandb:
            _import_wandb()
        if self.mlflow is not None:
            import_mlflow()

    def wandb_settings(self, config: dict | None = None) -> dict | None:
        if not self.use_wandb:
            return None
        return {
            "project": self.wandb_project,
            "name": self.wandb_run_name,
            "entity": self.wandb_org,
            "group": self.wandb_group,
            "config": config or {},
        }


class MetricsLogger:
    def __init__(
        self,
        run_dir: str | Path | None,
        *,
        enabled: bool = True,
        tensorboard: bool | str | Path = True,
        wandb: dict | None = None,
        sinks: list[MetricSink] | tuple[MetricSink, ...] = (),
    ):
        """``tensorboard``: True writes events to ``run_dir/tensorboard``, a path to that folder, False nowhere.
        ``sinks``: more destinations (:class:`~rl_core.metric_sinks.MetricSink`), called on the enabled rank."""
        self.sinks = list(sinks) if enabled else []
        self.enabled = enabled and run_dir is not None
        self._wandb = _start_wandb(wandb, run_dir) if enabled and wandb is not None else None
        self.history: dict[str, list[tuple[int, float]]] = {}
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self._jsonl = self._tb = None
        if self.enabled and self.run_dir is not None:  # (enabled: run_dir is set)
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self._jsonl = (self.run_dir / "metrics.jsonl").open("a")
        tb_dir = (
            Path(tensorboard)
            if isinstance(tensorboard, (str, Path))
            else (self.run_dir / "tensorboard" if tensorboard and self.run_dir is not None else None)
        )
        self._tb_dir = tb_dir if enabled else None
        if self._tb_dir is not None:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(tb_dir))

    def rewind(self, step: int) -> int:
        """Forget every row after ``step``: a run resumed from the checkpoint of iteration ``step`` logs the
        iterations after it again, and each step must keep one row (metrics.jsonl is rewritten without the later
        rows, TensorBoard purges its events after ``step``; wandb cannot unlog: its rows repeat). Returns the
        number of metrics.jsonl rows dropped."""
        for k in list(self.history):
            points = [(s, v) for s, v in self.history[k] if s <= step]
            if points:
                self.history[k] = points
            else:  # a metric first logged after ``step``: no panel (an empty one failed to draw in close())
                del self.history[k]
        for sink in self.sinks:
            sink.rewind(step)
        if self._tb is not None:
            from torch.utils.tensorboard import SummaryWriter

            self._tb.close()
            self._tb = SummaryWriter(str(self._tb_dir), purge_step=step + 1)
        if not self.enabled:
            return 0
        if self.run_dir is None or self._jsonl is None:  # not reached: an enabled logger has both
            raise RuntimeError("MetricsLogger: enabled without a run_dir and its metrics.jsonl")
        self._jsonl.close()
        path = self.run_dir / "metrics.jsonl"
        lines = path.read_text().splitlines(keepends=True)
        kept = [x for x in lines if x.strip() and json.loads(x).get("step", 0) <= step]
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(kept))
        os.replace(tmp, path)  # atomic: a crash here leaves the old file or the new one, never half of one
        self._jsonl = path.open("a")
        return len([x for x in lines if x.strip()]) - len(kept)

    @classmethod
    def from_config(
        cls, run_dir: str | Path | None, cfg: LoggerConfig, *, enabled: bool = True, run_config: dict | None = None
    ) -> MetricsLogger:
        """The logger a run's settings ask for; ``run_config`` is what wandb and MLflow record as the run's config."""
        sinks: list[MetricSink] = [MLflowSink(cfg.mlflow, run_dir, run_config)] if cfg.mlflow and enabled else []
        return cls(
            run_dir,
            enabled=enabled,
            tensorboard=cfg.use_tensorboard or True,
            wandb=cfg.wandb_settings(run_config),
            sinks=sinks,
        )

    def log(self, step: int, metrics: dict[str, float]) -> None:
        clean = {k: float(v) for k, v in metrics.items()}
        bad = [k for k, v in clean.items() if not math.isfinite(v)]
        if bad:
            logger.warning("step %d: non-finite metrics %s", step, {k: clean[k] for k in bad})
        for k, v in clean.items():
            self.history.setdefault(k, []).append((step, v))
        if self._wandb is not None:
            self._wandb.log(clean, step=step)
        if self._tb is not None:
            for k, v in clean.items():
                self._tb.add_scalar(k, v, step)
        for sink in self.sinks:
            sink.log(step, clean)
        if not self.enabled:
            return
        if self._jsonl is None:  # not reached: an enabled logger opened it
            raise RuntimeError("MetricsLogger: enabled without its metrics.jsonl")
        self._jsonl.write(json.dumps({"step": step, **clean}) + "\n")
        self._jsonl.flush()

    def close(self) -> Path | None:
        """Flush files and draw ``curves.png``; returns its path (None when disabled or empty)."""
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        for sink in self.sinks:
            sink.close()
        self.sinks = []
        if not self.enabled:
            return None
        if self.run_dir is None or self._jsonl is None:  # not reached: an enabled logger has both
            raise RuntimeError("MetricsLogger: enabled without a run_dir and its metrics.jsonl")
        self._jsonl.close()
        if not self.history:
            return None
        # Figure + the Agg canvas, not pyplot (no global state, no backend switch), and fixed margins instead of
        # tight_layout: a run's ~35 curves drew in 2.4-3.5 s that way on 2 cores, 1.5 s this way
        # lazy: matplotlib only when curves.png is drawn
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        names = sorted(self.history)
        cols = min(3, len(names))
        rows = math.ceil(len(names) / cols)
        fig = Figure(figsize=(4 * cols, 2.6 * rows))
        FigureCanvasAgg(fig)
        fig.subplots_adjust(left=0.06, right=0.98, top=1 - 0.35 / rows, bottom=0.3 / rows, hspace=0.55, wspace=0.25)
        axes = fig.subplots(rows, cols, squeeze=False)
        for ax, name in zip(axes.flat, names, strict=False):  # the grid may have spare cells
            steps, values = zip(*self.history[name], strict=True)
            ax.plot(steps, values)
            ax.set_title(name, fontsize=9)
            ax.tick_params(labelsize=7)
            ax.locator_params(nbins=5)
        for ax in list(axes.flat)[len(names) :]:
            ax.axis("off")
        fig.supxlabel("step", fontsize=9, y=0.05 / rows)
        out = self.run_dir / "curves.png"
        fig.savefig(out, dpi=80)
        return out


def _import_wandb():
    try:
        import wandb
    except ImportError:
        raise RuntimeError(
            "--use_wandb needs the wandb package, which is not installed: pip install "
            "'rl-core[wandb]' (or pip install wandb); set WANDB_MODE=offline to log without an "
            "account"
        ) from None
    return wandb


def _start_wandb(settings: dict, run_dir: str | Path | None):
    wandb = _import_wandb()
    kw = {
        "project": settings.get("project", "rl"),
        "name": settings.get("name"),
        "entity": settings.get("entity"),
        "group": settings.get("group"),
        "config": settings.get("config") or {},
    }
    if run_dir is not None:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        kw["dir"] = str(run_dir)
    return wandb.init(**kw)
