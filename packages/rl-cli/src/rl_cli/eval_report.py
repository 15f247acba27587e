"""``rl eval``'s outputs besides the samples: the table printed (a row per dataset and metric, a column per model),
``summary.json`` and the pass@k bar chart ``pass_at_k.png`` (a panel per dataset, a bar per model and k;
matplotlib is optional: without it the chart is skipped and the reason printed)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

SHOWN = ("pass@", "maj@", "reward_mean", "correct", "response_length", "truncated", "prompts")  # the table's rows


def _shown(name: str) -> bool:
    return any(name == s or (s.endswith("@") and name.startswith(s)) for s in SHOWN)


def table(metrics: dict[str, dict[str, dict[str, float]]]) -> str:
    """``metrics[model][dataset][name]`` as text: ``dataset  metric  model_a  model_b ...``."""
    models = list(metrics)
    datasets = list(next(iter(metrics.values())))
    rows = [["dataset", "metric", *models]]
    for ds in datasets:
        names = [k for k in metrics[models[0]][ds] if _shown(k)]
        for name in names:
            cells = []
            for m in models:
                v = metrics[m].get(ds, {}).get(name)
                cells.append(
                    "-" if v is None else f"{v:.0f}" if name == "prompts" else f"{v:.4f}" if v < 100 else f"{v:.1f}"
                )
            rows.append([ds, name, *cells])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
        for r in rows
    )


def write_summary(path: Path, summary: dict) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(summary, indent=2, sort_keys=False) + "\n")
    tmp.replace(path)


def bar_chart(metrics: dict[str, dict[str, dict[str, float]]], ks: tuple[int, ...], path: Path) -> str | None:
    """Write the pass@k chart to ``path``; None when written, else why not (matplotlib missing)."""
    if importlib.util.find_spec("matplotlib") is None:
        return "matplotlib is not installed (pip install matplotlib), so no pass_at_k.png"
    # lazy: matplotlib is optional and slow to import; only the chart needs it
    import matplotlib

    matplotlib.use("Agg")
    # lazy: the pyplot half of the optional matplotlib import above
    import matplotlib.pyplot as plt

    models = list(metrics)
    datasets = list(next(iter(metrics.values())))
    fig, axes = plt.subplots(1, len(datasets), figsize=(3 + 2.5 * len(datasets), 3.5), squeeze=False)
    width = 0.8 / len(models)
    for ax, ds in zip(axes[0], datasets, strict=True):
        for j, m in enumerate(models):
            values = [metrics[m][ds].get(f"pass@{k}", 0.0) for k in ks]
            ax.bar([i + j * width for i in range(len(ks))], values, width, label=m)
        ax.set_xticks([i + width * (len(models) - 1) / 2 for i in range(len(ks))], [f"pass@{k}" for k in ks])
        ax.set_ylim(0, 1)
        ax.set_title(ds)
    axes[0][0].set_ylabel("pass@k (Chen et al. 2021)")
    axes[0][-1].legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return None
