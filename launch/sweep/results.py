"""The sweep's results table and best trial, from what each trial reported: pure functions over plain rows.

A trial record: {"trial": id, "overrides": {key: value}, "history": [each reported step's metrics],
"error": the error's first line or None}. Its table row adds the best value of the metric over its steps
(max or min, --mode), the step of that value, how many steps it ran, and its status: DONE (every step), STOPPED
(fewer: the scheduler stopped it early, or the sweep was interrupted; --resume goes on) or ERROR.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

ERROR_WIDTH = 160  # the printed table's cut of an error line (the CSV and JSON keep it whole)


def first_line(error) -> str | None:
    """`Type: first line` of a trial's exception (the trainer's own one where Ray wrapped it)."""
    if error is None:
        return None
    cause = getattr(error, "cause", None) or error  # RayTaskError(cause) -> the trainer's exception
    lines = [line.strip() for line in str(cause).splitlines() if line.strip()]
    return f"{type(cause).__name__}: {lines[0] if lines else ''}".rstrip(": ")


def best_of(history: list[dict], metric: str, mode: str) -> tuple[float | None, int | None]:
    """(best value, its step) of `metric` over the trial's rows; (None, None) if it never reported it."""
    best, at = None, None
    for i, row in enumerate(history):
        v = row.get(metric)
        if v is None or not math.isfinite(float(v)):
            continue
        if best is None or (v > best if mode == "max" else v < best):
            best, at = float(v), int(row.get("training/global_step", i + 1))
    return best, at


def table_rows(trials: list[dict], metric: str, mode: str, total_steps: int) -> list[dict]:
    rows = []
    for t in trials:
        best, at = best_of(t["history"], metric, mode)
        steps = max((int(r.get("training/global_step", 0)) for r in t["history"]), default=0)
        status = "ERROR" if t.get("error") else "DONE" if steps >= total_steps else "STOPPED"
        rows.append({"trial": t["trial"], "overrides": dict(t["overrides"]), "best": best, "best_step": at,
                     "steps": steps, "status": status, "error": t.get("error")})
    return rows


def best_row(rows: list[dict], mode: str) -> dict | None:
    """The row with the best value (the first of equals); None when no trial reported the metric."""
    scored = [r for r in rows if r["best"] is not None]
    if not scored:
        return None
    pick = max if mode == "max" else min
    return pick(scored, key=lambda r: r["best"])


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)


def overrides_text(overrides: dict) -> str:
    return ", ".join(f"{k}={_fmt(v)}" for k, v in overrides.items())


def render_markdown(rows: list[dict], metric: str, mode: str) -> str:
    best = best_row(rows, mode)
    head = ["trial", "overrides", f"best {metric} ({mode})", "at step", "steps", "status"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        mark = " **best**" if best is not None and r is best else ""
        error = r["error"] if not r["error"] or len(r["error"]) <= ERROR_WIDTH else r["error"][:ERROR_WIDTH] + "..."
        status = r["status"] + (f": {error}" if error else "")
        cells = [r["trial"] + mark, overrides_text(r["overrides"]), _fmt(r["best"]), _fmt(r["best_step"]),
                 str(r["steps"]), status.replace("|", "\\|")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_tables(rows: list[dict], out_dir: str | Path, metric: str, mode: str) -> dict[str, Path]:
    """results.csv (one column per swept key), results.json and results.md in `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    keys = list(dict.fromkeys(k for r in rows for k in r["overrides"]))
    paths = {"csv": out / "results.csv", "json": out / "results.json", "md": out / "results.md"}
    with open(paths["csv"], "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["trial", *keys, "best", "best_step", "steps", "status", "error"])
        for r in rows:
            w.writerow([r["trial"], *(r["overrides"].get(k, "") for k in keys), "" if r["best"] is None else r["best"],
                        "" if r["best_step"] is None else r["best_step"], r["steps"], r["status"], r["error"] or ""])
    best = best_row(rows, mode)
    paths["json"].write_text(json.dumps({"metric": metric, "mode": mode, "best": best and best["trial"],
                                         "trials": rows}, indent=1) + "\n")
    paths["md"].write_text(render_markdown(rows, metric, mode) + "\n")
    return paths
