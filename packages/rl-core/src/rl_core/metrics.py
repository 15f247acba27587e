"""Run metrics a person can look at: JSONL, TensorBoard, PNG curves, console lines.

Rank 0 writes; other ranks' loggers are silent. ``metrics.jsonl`` holds one JSON
object per logged step (``{"step": N, "name": value, ...}``), ``tensorboard/``
the same scalars, and :meth:`MetricsLogger.close` draws ``curves.png`` (one
panel per metric). With ``wandb={"project": ..., "name": ..., "config": ...}`` the
same scalars go to wandb too (``WANDB_MODE=offline`` works without an account);
wandb is optional and a missing install fails at start-up with the fix.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

logger = logging.getLogger(__name__)


class MetricsLogger:
    def __init__(self, run_dir: str | Path | None, *, enabled: bool = True, tensorboard: bool = True,
                 wandb: dict | None = None):
        self.enabled = enabled and run_dir is not None
        self._wandb = _start_wandb(wandb, run_dir) if enabled and wandb is not None else None
        self.history: dict[str, list[tuple[int, float]]] = {}
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self._jsonl = self._tb = None
        if self.enabled:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self._jsonl = (self.run_dir / "metrics.jsonl").open("a")
            if tensorboard:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(self.run_dir / "tensorboard"))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        clean = {k: float(v) for k, v in metrics.items()}
        bad = [k for k, v in clean.items() if not math.isfinite(v)]
        if bad:
            logger.warning("step %d: non-finite metrics %s", step, {k: clean[k] for k in bad})
        for k, v in clean.items():
            self.history.setdefault(k, []).append((step, v))
        if self._wandb is not None:
            self._wandb.log(clean, step=step)
        if not self.enabled:
            return
        self._jsonl.write(json.dumps({"step": step, **clean}) + "\n")
        self._jsonl.flush()
        if self._tb is not None:
            for k, v in clean.items():
                self._tb.add_scalar(k, v, step)

    def close(self) -> Path | None:
        """Flush files and draw ``curves.png``; returns its path (None when disabled or empty)."""
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
        if not self.enabled:
            return None
        self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if not self.history:
            return None
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        names = sorted(self.history)
        cols = min(3, len(names))
        rows = math.ceil(len(names) / cols)
        fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3 * rows), squeeze=False)
        for ax, name in zip(axes.flat, names):
            steps, values = zip(*self.history[name], strict=True)
            ax.plot(steps, values)
            ax.set_title(name)
            ax.set_xlabel("step")
        for ax in list(axes.flat)[len(names):]:
            ax.axis("off")
        fig.tight_layout()
        out = self.run_dir / "curves.png"
        fig.savefig(out, dpi=80)
        plt.close(fig)
        return out


def _start_wandb(settings: dict, run_dir: str | Path | None):
    try:
        import wandb
    except ImportError:
        raise RuntimeError("--use_wandb needs the wandb package: pip install wandb (or rl-core[wandb]); "
                           "set WANDB_MODE=offline to log without an account") from None
    kw = {"project": settings.get("project", "rl"), "name": settings.get("name"),
          "config": settings.get("config") or {}}
    if run_dir is not None:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        kw["dir"] = str(run_dir)
    return wandb.init(**kw)
