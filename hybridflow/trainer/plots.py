"""End-of-run curves: reward and throughput per step, one PNG. Validation scores, when the run has them,
are drawn on the reward panel next to the training reward."""

from __future__ import annotations

import re
from pathlib import Path

REWARD_KEY = "critic/score/mean"
# The headline validation metric of each data source (hybridflow.trainer.validation).
VAL_MEAN = re.compile(r"^val-core/(?P<source>.+)/reward/mean@(?P<n>\d+)$")


def val_series(rows: list[dict]) -> dict[str, tuple[list, list]]:
    """{label: (steps, values)} of each val-core .../reward/mean@n key in the rows, in row order.

    The label is "val" when the run validates one data source, "val <source>" for several.
    """
    series: dict[str, tuple[list, list]] = {}
    for r in rows:
        for key, value in r.items():
            m = VAL_MEAN.match(key)
            if m:
                xs, ys = series.setdefault(m["source"], ([], []))
                xs.append(r["step"])
                ys.append(value)
    if len(series) == 1:
        return {"val": next(iter(series.values()))}
    return {f"val {source}": xy for source, xy in series.items()}


def plot_curves(rows: list[dict], out_png: str | Path, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    val = val_series(rows)
    panels = [
        (REWARD_KEY, "mean reward"),
        ("perf/throughput", "tokens/s per device"),
        ("response_length/mean", "response length"),
        ("actor/entropy", "entropy"),
    ]
    panels = [(k, label) for k, label in panels if any(k in r for r in rows) or (k == REWARD_KEY and val)]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4), squeeze=False)
    for ax, (key, label) in zip(axes[0], panels, strict=True):
        xs = [s for s, r in zip(steps, rows, strict=True) if key in r]
        ys = [r[key] for r in rows if key in r]
        ax.plot(xs, ys, marker="o", ms=3, label="train" if key == REWARD_KEY else None)
        if key == REWARD_KEY and val:
            for name, (vx, vy) in val.items():
                ax.plot(vx, vy, marker="s", ms=5, ls="--", label=name)
            ax.legend(fontsize=8)
        ax.set_xlabel("step")
        ax.set_title(label)
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out_png = Path(out_png)
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return out_png
