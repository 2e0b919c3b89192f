"""The end-of-run table: first vs last steps of the metrics a reader checks first, then the first and last
validation of each val-core metric."""

from __future__ import annotations

KEYS = ["critic/score/mean", "response_length/mean", "actor/pg_loss", "actor/entropy", "actor/ppo_kl",
        "critic/vf_loss", "perf/throughput", "perf/aggregate_throughput", "perf/time_per_step",
        "perf/transition_s", "rollout/logprob_diff_mean"]


def _mean(rows: list[dict], key: str) -> float | None:
    vals = [r[key] for r in rows if key in r]
    return sum(vals) / len(vals) if vals else None


def _is_training_row(row: dict) -> bool:
    # A validation before training is a row of its own (val metrics and timing only).
    return "training/global_step" in row or "critic/score/mean" in row


def print_summary(rows: list[dict], window: int = 3) -> str:
    train = [r for r in rows if _is_training_row(r)]
    head, tail = train[:window], train[-window:]
    lines = [f"{'metric':32s} {'first ' + str(len(head)) + ' steps':>16s} {'last ' + str(len(tail)) + ' steps':>16s}"]
    fmt = lambda v: f"{v:16.4g}" if v is not None else f"{'-':>16s}"
    for k in KEYS:
        a, b = _mean(head, k), _mean(tail, k)
        if a is None and b is None:
            continue
        lines.append(f"{k:32s} {fmt(a)} {fmt(b)}")
    val_keys = sorted({k for r in rows for k in r if k.startswith("val-core/")})
    for k in val_keys:
        points = [(r["step"], r[k]) for r in rows if k in r]
        (s0, v0), (s1, v1) = points[0], points[-1]
        lines.append(f"{k} (step {s0} -> {s1})")
        lines.append(f"{'':32s} {fmt(v0)} {fmt(v1)}")
    text = "\n".join(lines)
    print(f"\nRun summary ({len(train)} steps)\n{text}\n", flush=True)
    return text
