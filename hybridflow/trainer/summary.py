"""The end-of-run table: first vs last steps of the metrics a reader checks first."""

from __future__ import annotations

KEYS = ["critic/score/mean", "response_length/mean", "actor/pg_loss", "actor/entropy", "actor/ppo_kl",
        "critic/vf_loss", "perf/throughput", "perf/aggregate_throughput", "perf/time_per_step",
        "perf/transition_s", "rollout/logprob_diff_mean"]


def _mean(rows: list[dict], key: str) -> float | None:
    vals = [r[key] for r in rows if key in r]
    return sum(vals) / len(vals) if vals else None


def print_summary(rows: list[dict], window: int = 3) -> str:
    head, tail = rows[:window], rows[-window:]
    lines = [f"{'metric':32s} {'first ' + str(len(head)) + ' steps':>16s} {'last ' + str(len(tail)) + ' steps':>16s}"]
    for k in KEYS:
        a, b = _mean(head, k), _mean(tail, k)
        if a is None and b is None:
            continue
        fmt = lambda v: f"{v:16.4g}" if v is not None else f"{'-':>16s}"
        lines.append(f"{k:32s} {fmt(a)} {fmt(b)}")
    text = "\n".join(lines)
    print(f"\nRun summary ({len(rows)} steps)\n{text}\n", flush=True)
    return text
