"""Draw a timeline file (trainer.timeline_dir/step_<N>.json) as a Gantt PNG: one row per lane (the driver, then
each worker group's ranks), one bar per span, coloured by its name.

    python -m launch.plot_timeline runs/demo/timeline/step_2.json -o timeline.png

Perfetto (ui.perfetto.dev) shows the same file interactively; this is for a README or a report.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

# What a row shows: the driver's stages, and on workers the spans that say where a stage's time goes
# (megatron's nested forward_backward and the single gloo collectives would only cover them).
DEFAULT_SPANS = ("gen", "rm", "reward", "old_log_prob", "ref", "values", "adv", "update_critic", "update_actor",
                 "testing", "reshard", "generate", "forward", "backward", "grad_sync", "optimizer")


def lanes_of(trace: dict, names=DEFAULT_SPANS) -> list[tuple[str, list[tuple[str, float, float]]]]:
    """[(lane name, [(span name, start s, duration s)])] in the file's lane order."""
    label = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"]
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    rows: dict[int, list] = {pid: [] for pid in sorted(label)}
    for e in trace["traceEvents"]:
        if e.get("ph") == "X" and e["name"] in names and e["pid"] in rows:
            rows[e["pid"]].append((e["name"], e["ts"] / 1e6, e["dur"] / 1e6))
    return [(label[pid], spans) for pid, spans in rows.items()]


def plot_timeline(trace: dict | str | Path, out: str | Path, title: str | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not isinstance(trace, dict):
        trace = json.loads(Path(trace).read_text())
    lanes = lanes_of(trace)
    used = [n for n in DEFAULT_SPANS if any(n == s for _, spans in lanes for s, _, _ in spans)]
    cmap = plt.get_cmap("tab20")
    colour = {n: cmap(i % 20) for i, n in enumerate(used)}
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(lanes) + 1.4), dpi=90)
    labelled: set[str] = set()
    for row, (_, spans) in enumerate(lanes):
        for name in used:  # one call per name and row; the legend names each colour once
            bars = [(t, max(d, 1e-4)) for n, t, d in spans if n == name]
            if bars:
                ax.broken_barh(bars, (row - 0.38, 0.76), color=colour[name],
                               label=None if name in labelled else name)
                labelled.add(name)
    ax.set_yticks(range(len(lanes)), [name for name, _ in lanes])
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the step began")
    step = trace.get("otherData", {}).get("step")
    ax.set_title(title or (f"step {step}" if step is not None else "timeline"))
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", help="a step_<N>.json from trainer.timeline_dir")
    ap.add_argument("-o", "--out", default=None, help="PNG path (default: next to the trace)")
    ap.add_argument("--title", default=None)
    args = ap.parse_args(argv)
    out = args.out or str(Path(args.trace).with_suffix(".png"))
    print(plot_timeline(args.trace, out, args.title))


if __name__ == "__main__":
    main()
