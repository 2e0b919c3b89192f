"""Writes launch/grafana/hybridflow.json, the Grafana dashboard of a run's step gauges.

The dashboard is data (JSON, imported into Grafana as is); this script is where its panels are listed, so a
panel is one line here and the JSON stays consistent (ids, grid positions, the variables every query uses).
Run it after changing PANELS: `python -m launch.grafana.make_dashboard`; tests/test_prometheus.py checks the
file is this script's output and that every metric it queries is one a tiny run exports.

Every query is `${prefix}<gauge>{experiment=~"$experiment"}`: `prefix` is empty for the trainer's own endpoint
(trainer.prometheus.mode=http) and `ray_` when the gauges come through Ray's metrics export (mode=ray).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from hybridflow.trainer.prometheus import sanitize_name

OUT = Path(__file__).resolve().parent / "hybridflow.json"

# (title, unit, [step metric keys]). Keys, not gauge names: the names come from the one sanitizer.
PANELS = [
    ("Reward", "none", ["critic/score/mean", "critic/rewards/mean"]),
    ("KL", "none", ["actor/ppo_kl", "actor/reward_kl_penalty", "actor/kl_loss", "actor/kl_coef"]),
    ("Stage time per step", "s", [f"timing_s/{s}" for s in ("gen", "reward", "old_log_prob", "ref", "values",
                                                             "adv", "update_critic", "update_actor")]),
    ("Throughput", "none", ["perf/throughput", "perf/aggregate_throughput"]),
    ("Step time", "s", ["perf/time_per_step"]),
    ("Transition (train -> generate reshard)", "s", ["perf/transition_s"]),
    ("Peak memory per role", "decgbytes", [f"{r}/perf/{m}" for r in ("actor", "critic")
                                           for m in ("peak_rss_gb", "max_memory_allocated_gb")]),
    ("Update seconds per micro-batch", "s", ["actor/perf/update_s_per_micro_batch",
                                             "critic/perf/update_s_per_micro_batch"]),
    ("Losses", "none", ["actor/pg_loss", "critic/vf_loss"]),
    ("Response length", "none", ["response_length/mean"]),
]
# Panel keys a run exports only in some set-ups: the test accepts them missing from a CPU PPO run, for this reason.
CONDITIONAL = {
    "actor/kl_loss": "only with actor_rollout_ref.actor.use_kl_loss (GRPO-style KL in the loss)",
    "actor/perf/max_memory_allocated_gb": "CUDA only",
    "critic/perf/max_memory_allocated_gb": "CUDA only",
}


def query(key: str) -> str:
    return '${prefix}' + sanitize_name(key) + '{experiment=~"$experiment"}'


def panel(i: int, title: str, unit: str, keys: list[str]) -> dict:
    return {
        "id": i + 1, "type": "timeseries", "title": title,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                    "tooltip": {"mode": "multi", "sort": "none"}},
        "targets": [{"refId": chr(ord("A") + j), "datasource": {"type": "prometheus", "uid": "${datasource}"},
                     "expr": query(k), "legendFormat": k + " {{experiment}}"} for j, k in enumerate(keys)],
    }


def dashboard() -> dict:
    step = sanitize_name("training/global_step")
    return {
        "title": "HybridFlow run", "uid": "hybridflow-run", "schemaVersion": 39, "version": 1,
        "editable": True, "tags": ["hybridflow", "rl"], "time": {"from": "now-1h", "to": "now"},
        "refresh": "10s", "timezone": "", "annotations": {"list": []},
        "templating": {"list": [
            {"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus",
             "current": {}, "hide": 0, "refresh": 1},
            {"name": "prefix", "label": "name prefix (ray_ via Ray's export)", "type": "textbox", "query": "",
             "current": {"text": "", "value": ""}, "hide": 0},
            {"name": "experiment", "label": "experiment", "type": "query",
             "datasource": {"type": "prometheus", "uid": "${datasource}"},
             "query": {"query": f"label_values(${{prefix}}{step}, experiment)", "refId": "experiments"},
             "definition": f"label_values(${{prefix}}{step}, experiment)",
             "includeAll": True, "multi": True, "allValue": ".*", "current": {}, "refresh": 2, "hide": 0},
        ]},
        "panels": [panel(i, *p) for i, p in enumerate(PANELS)],
    }


def render() -> str:
    return json.dumps(dashboard(), indent=1) + "\n"


def main(argv: list[str] | None = None) -> int:
    import argparse

    argparse.ArgumentParser(prog="python -m launch.grafana.make_dashboard",
                            description=f"Write {OUT.relative_to(OUT.parents[2])}, the Grafana dashboard of a run's "
                                        "step gauges, from PANELS.").parse_args(argv)
    OUT.write_text(render())
    print(OUT, file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
