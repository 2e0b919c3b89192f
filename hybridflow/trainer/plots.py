"""End-of-run curves: reward and throughput per step, one PNG."""

from __future__ import annotations

from pathlib import Path


def plot_curves(rows: list[dict], out_png: str | Path, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    panels = [
        ("critic/score/mean", "mean reward"),
        ("perf/throughput", "tokens/s per device"),
        ("response_length/mean", "response length"),
        ("actor/entropy", "entropy"),
    ]
    panels = [(k, label) for k, label in panels if any(k in r for r in rows)]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4), squeeze=False)
    for ax, (key, label) in zip(axes[0], panels, strict=True):
        xs = [s for s, r in zip(steps, rows, strict=True) if key in r]
        ys = [r[key] for r in rows if key in r]
        ax.plot(xs, ys, marker="o", ms=3)
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
