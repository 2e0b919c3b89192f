"""Are two runs the same run? Their metrics.jsonl compared step by step, every metric but the clocks.

    python -m launch.benchmark.same_metrics runs/before runs/after [--markdown]

Prints JSON (or a markdown table for docs): the steps of both, the metrics compared, how many were bit-equal, the
largest difference and where, and which keys one run has and the other lacks. Left out are what a clock or the
machine's load decides: `timing_s/*`, `timing_per_token_ms/*`, anything under a `perf` segment (`perf/throughput`,
MFU, memory, `actor/perf/peak_rss_gb`), and wall times by name (a last segment ending in `_s` or holding `_s_per_`:
weight_sync/recv_s, reward/time_s, rollout/gen_s_per_replica). Exit status 1 when a compared metric differs, 2 on
bad input. docs/architecture.md's before/after table of a refactor is made by it.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

CLOCK_ROOTS = ("timing_s", "timing_per_token_ms")
WALL_TIME = re.compile(r"_s($|_per_)")


def is_clock(key: str) -> bool:
    parts = key.split("/")
    return parts[0] in CLOCK_ROOTS or "perf" in parts or bool(WALL_TIME.search(parts[-1]))


def read_rows(run: Path) -> dict[int, dict]:
    """metrics.jsonl of a run directory (or the file itself), by step; a step logged twice keeps its last row."""
    path = run / "metrics.jsonl" if run.is_dir() else run
    if not path.is_file():
        raise FileNotFoundError(f"{run}: no metrics.jsonl")
    rows: dict[int, dict] = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not JSON ({e})") from None
        if "step" not in row:
            raise ValueError(f"{path}:{n}: a row without 'step'")
        rows[int(row["step"])] = row
    return rows


def compare(before: dict[int, dict], after: dict[int, dict]) -> dict:
    """The comparison of two runs' rows (read_rows): pure."""
    steps = sorted(before.keys() & after.keys())
    compared = equal = 0
    worst = {"abs_diff": 0.0, "step": None, "key": None}
    differing: list[dict] = []
    only_before: set[str] = set()
    only_after: set[str] = set()
    for step in steps:
        a, b = before[step], after[step]
        keys = {k for k in a.keys() | b.keys() if k != "step" and not is_clock(k)}
        only_before |= {k for k in keys if k not in b}
        only_after |= {k for k in keys if k not in a}
        for key in sorted(k for k in keys if k in a and k in b):
            x, y = a[key], b[key]
            compared += 1
            if x == y or (isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y)):
                equal += 1
                continue
            diff = abs(x - y) if isinstance(x, int | float) and isinstance(y, int | float) else math.inf
            differing.append({"step": step, "key": key, "before": x, "after": y})
            if diff > worst["abs_diff"]:
                worst = {"abs_diff": diff, "step": step, "key": key}
    return {"steps": len(steps), "steps_before": len(before), "steps_after": len(after), "compared": compared,
            "equal": equal, "max_abs_diff": worst, "first_differences": differing[:10],
            "only_before": sorted(only_before), "only_after": sorted(only_after),
            "same": compared > 0 and equal == compared and not only_before and not only_after
            and len(before) == len(after) == len(steps)}


def markdown(result: dict, before: str, after: str) -> str:
    keys = result["compared"] // max(result["steps"], 1)
    return "\n".join([
        "| | before | after |", "|---|---|---|",
        f"| run | `{before}` | `{after}` |",
        f"| steps | {result['steps_before']} | {result['steps_after']} |",
        f"| metrics compared (non-clock, both runs) | {result['compared']} ({keys} a step on average) | |",
        f"| bit-equal | {result['equal']} of {result['compared']} | |",
        f"| largest difference | {result['max_abs_diff']['abs_diff']:.3g} | |",
        f"| keys in one run only | {len(result['only_before'])} | {len(result['only_after'])} |"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("before", type=Path, help="a run directory (its metrics.jsonl) or a metrics.jsonl")
    ap.add_argument("after", type=Path)
    ap.add_argument("--markdown", action="store_true", help="a table for docs instead of JSON")
    args = ap.parse_args(argv)
    try:
        result = compare(read_rows(args.before), read_rows(args.after))
    except (FileNotFoundError, ValueError) as e:
        print(f"same_metrics: {e}", file=sys.stderr)
        return 2
    print(markdown(result, str(args.before), str(args.after)) if args.markdown else json.dumps(result, indent=1))
    return 0 if result["same"] else 1


if __name__ == "__main__":
    sys.exit(main())
