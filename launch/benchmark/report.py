"""Text tables for one benchmark result and for several side by side (pure: result dicts in, strings out)."""

from __future__ import annotations

import json
from pathlib import Path

from launch.benchmark.stages import STAGES
from launch.plan.report import table


def _f(x, fmt: str = ".3f") -> str:
    return "-" if x is None else format(x, fmt)


def _gib(b) -> str:
    return "-" if b is None else f"{b / 2**30:.2f} GiB"


def render(result: dict) -> str:
    t, peak = result["totals"], result["peak_flops"]
    rows = [[s, _f(e["mean_s"]), _f(e["min_s"]), f"{100 * e['share']:.1f}%", str(e["devices"]),
             _f(e["tokens_per_s_per_device"], ",.0f"), "-" if e["mfu"] is None else f"{100 * e['mfu']:.2f}%"]
            for s, e in result["stages"].items()]
    rows.append(["untimed", _f(t["untimed_s"]), "", f"{100 * t['untimed_s'] / t['step_mean_s']:.1f}%", "", "", ""])
    rows.append(["step", _f(t["step_mean_s"]), _f(t["step_min_s"]), "100%", str(t["n_devices"]), "", ""])
    lay = result["layout"]
    out = [f"launch.benchmark: {result['config']} {' '.join(result['overrides'])}".rstrip(),
           f"{result['warmup']} warm-up + {result['steps']} timed steps; {lay['source']}: "
           + ", ".join(f"{r} pool '{v['pool']}' tp{v['tp']} pp{v['pp']} dp{v['dp']}" for r, v in lay["roles"].items())
           + f", rollout t_g={lay['rollout_tp']}; {result['device']}",
           f"MFU against {peak['per_device']:.3g} FLOP/s per device ({peak['source']})", "",
           table(["stage", "mean s", "min s", "share", "devices", "tokens/s/device", "MFU"], rows), "",
           f"tokens/s per device (verl perf/throughput): {t['throughput_per_device']:,.1f}",
           f"aggregate tokens/s (HybridFlow paper, all devices): {t['aggregate_throughput']:,.1f}",
           f"tokens per step: {t['tokens_per_step']:,.0f}"
           + (f"; actor MFU over the step (perf/mfu/actor): {100 * t['mfu_actor']:.2f}%" if "mfu_actor" in t else "")]
    if result.get("published"):
        p = result["published"]
        out.append(f"published: {p['throughput_per_device']:,.0f} tokens/s per device ({p['source']})")
    for group, mem in result["peak_memory"].items():
        out.append(f"peak memory {group}: RSS {_gib(mem.get('rss_peak_bytes'))}"
                   + (f", device {_gib(mem['device_peak_bytes'])}" if "device_peak_bytes" in mem else ""))
    return "\n".join(out)


def load_result(path: str | Path) -> dict:
    """A result JSON file, or a benchmark's captured output (its last line that parses as the result)."""
    text = Path(path).read_text()
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                continue
            if obj.get("benchmark") == "launch.benchmark":
                return obj
    raise ValueError(f"{path}: no launch.benchmark result line (a JSON object with \"benchmark\") found")


def compare(results: dict[str, dict]) -> str:
    """Runs side by side ({label: result}); a published figure of a run's recipe gets its own column."""
    labels = list(results)
    cols = []
    for label in labels:
        cols.append((label, results[label]))
        if results[label].get("published"):
            cols.append((f"{label} published", None))

    def line(name: str, get, published=None) -> list[str]:
        cells = []
        for label, r in cols:
            if r is None:
                p = results[label.removesuffix(" published")]["published"]
                cells.append(published(p) if published else "")
            else:
                cells.append(get(r))
        return [name, *cells]

    def stage(s):
        return lambda r: _f(r["stages"][s]["mean_s"]) if s in r["stages"] else "-"

    rows = [line("layout", lambda r: r["layout"]["source"].removeprefix("trainer.")),
            line("devices", lambda r: str(r["totals"]["n_devices"])),
            line("pools", lambda r: " ".join(f"{k}={v}" for k, v in r["layout"]["pools"].items())),
            line("actor tp/pp/dp", lambda r: "{tp}/{pp}/{dp}".format(**r["layout"]["roles"]["actor_rollout"])),
            line("rollout t_g", lambda r: str(r["layout"]["rollout_tp"])),
            line("timed steps", lambda r: f"{r['warmup']}+{r['steps']}"),
            line("step s (mean)", lambda r: _f(r["totals"]["step_mean_s"]))]
    rows += [line(f"  {s} s", stage(s)) for s in STAGES if any(s in r["stages"] for r in results.values())]
    rows += [line("tokens/s/device", lambda r: _f(r["totals"]["throughput_per_device"], ",.1f"),
                  lambda p: f"{p['throughput_per_device']:,.0f}"),
             line("aggregate tokens/s", lambda r: _f(r["totals"]["aggregate_throughput"], ",.1f")),
             line("actor MFU", lambda r: "-" if "mfu_actor" not in r["totals"]
                  else f"{100 * r['totals']['mfu_actor']:.2f}%"),
             line("MFU peak", lambda r: f"{r['peak_flops']['per_device']:.3g} ({r['peak_flops']['source']})")]
    groups = sorted({g for r in results.values() for g in r["peak_memory"]})
    rows += [line(f"peak RSS {g}", lambda r, g=g: _gib(r["peak_memory"].get(g, {}).get("rss_peak_bytes")))
             for g in groups]
    rows += [line("device", lambda r: r["device"]),
             line("commit", lambda r: (r["git"]["commit"] or "?")[:10] + ("+dirty" if r["git"]["dirty"] else ""))]
    notes = [f"{label}: {results[label.removesuffix(' published')]['published']['source']}"
             for label, r in cols if r is None]
    return "\n".join([table(["", *[label for label, _ in cols]], rows), *notes])
