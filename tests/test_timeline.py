"""trainer.timeline_dir and the quiet console, on one real tiny PPO run (Ray, Megatron TP=2 actor and critic,
vLLM rollout), run as the user runs it: `python -m hybridflow.trainer.main` in a subprocess whose console
(stdout + stderr) the tests read. The run is shared with test_prometheus.py (tests/observed_run.py).

- The timeline of step 2 is trace-event JSON with a span for every stage the driver timed and
  forward/backward/optimizer on every actor and critic rank, reshard on every actor rank, each inside
  the driver's stage that called it.
- The console has no megatron-core/vLLM library lines; the per-worker log files have them; a worker's
  warning of ours (an injected non-finite critic update at step 1) still reaches the console, once per rank
  and distinct message.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from hybridflow.trainer.timeline import merge_traces

REPO = Path(__file__).resolve().parents[1]
# Library lines that used to reach the console from every rank.
LIBRARY_LINE = re.compile(r"UserWarning|Transformer Engine|Apex are not installed|Megatron-FSDP|\bvllm\b|"
                          r"\[vllm|INFO \d\d-\d\d|profiler_start|USDT", re.IGNORECASE)
# which group's ranks run which stage's worker ranges
STAGE_OF = {"reshard": "gen", "generate": "gen"}


@pytest.fixture(scope="module")
def run(observed_run):
    """The shared tiny run (tests/observed_run.py): timeline of step 2, a NaN critic update at step 1."""
    return observed_run["run_dir"], observed_run["console"]


def _spans(trace: dict) -> dict[str, list[dict]]:
    lanes = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"]
             if e["ph"] == "M" and e["name"] == "process_name"}
    out: dict[str, list[dict]] = {name: [] for name in lanes.values()}
    for e in trace["traceEvents"]:
        if e["ph"] == "X":
            out[lanes[e["pid"]]].append(e)
    return out


@pytest.mark.slow
def test_timeline_has_every_stage_and_rank(run):
    run_dir, _ = run
    files = sorted(p.name for p in (run_dir / "timeline").iterdir())
    assert files == ["step_2.json"], files  # only the chosen step, and step 1 paid nothing
    trace = json.loads((run_dir / "timeline" / "step_2.json").read_text())
    for e in trace["traceEvents"]:
        assert {"ph", "ts", "pid", "name"} <= set(e), e
        if e["ph"] == "X":
            assert e["dur"] >= 0 and e["ts"] >= 0, e
    spans = _spans(trace)
    row = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    stages = {k.split("/", 1)[1] for k in row if k.startswith("timing_s/")} - {"reshard", "testing"}
    driver = {e["name"]: e for e in spans["driver"]}
    assert stages <= set(driver), (stages, sorted(driver))
    for name in stages:  # the span's length is the stage's timer (same interval, two clocks)
        assert abs(driver[name]["dur"] / 1e6 - row[f"timing_s/{name}"]) < 0.05 + 0.1 * row[f"timing_s/{name}"]
    expected = {f"actor_rollout_ref rank {r}": {"forward", "backward", "optimizer", "reshard"} for r in (0, 1)}
    expected.update({f"critic rank {r}": {"forward", "backward", "optimizer"} for r in (0, 1)})
    assert set(spans) == {"driver", *expected}, sorted(spans)
    slack = 20_000  # µs: Ray's call latency and the two processes' clocks
    for lane, names in expected.items():
        got = {e["name"] for e in spans[lane]}
        assert names <= got, (lane, names - got)
        update = driver["update_actor" if lane.startswith("actor") else "update_critic"]
        for e in spans[lane]:
            outer = driver[STAGE_OF.get(e["name"], "")] if e["name"] in STAGE_OF else None
            if e["name"] in ("backward", "optimizer"):
                outer = update
            if outer is not None:
                assert outer["ts"] - slack <= e["ts"] and e["ts"] + e["dur"] <= outer["ts"] + outer["dur"] + slack, \
                    (lane, e, outer)


@pytest.mark.slow
def test_console_is_quiet_and_nothing_is_lost(run):
    run_dir, console = run
    lines = console.splitlines()
    assert "logs: " + str(run_dir / "logs") in lines[0], lines[0]
    noisy = [x for x in lines if LIBRARY_LINE.search(x)]
    assert not noisy, noisy[:10]
    logs = {p.name: p.read_text() for p in (run_dir / "logs").glob("*_rank*.log")}
    assert sorted(logs) == [f"{g}_rank{r}.log" for g in ("actor_rollout_ref", "critic") for r in (0, 1)]
    for name, text in logs.items():  # what left the console is in the files
        assert "Transformer Engine and Apex are not installed" in text, name
    assert any("vllm" in text.lower() for name, text in logs.items() if name.startswith("actor"))
    # the injected NaN at step 1: each critic rank's warning on the console, once per distinct message (not per step)
    # (two mini-batch updates at step 1, both NaN: a rank whose two messages differ, e.g. in the NaN count, may show
    # both; identical ones show once)
    skipped = [x for x in lines if "skipped a non-finite update" in x]
    ranks = [re.search(r"\[critic rank (\d)\]", x).group(1) for x in skipped]
    assert set(ranks) == {"0", "1"} and all(ranks.count(r) <= 2 for r in ranks), skipped


def test_merge_numbers_lanes_and_shifts_time():
    driver = [{"ph": "X", "name": "gen", "ts": 1000.0, "dur": 50.0, "pid": 77, "tid": 77}]
    w0 = [{"ph": "X", "name": "reshard", "ts": 1010.0, "dur": 5.0, "pid": 5, "tid": 5},
          {"ph": "X", "name": "generate", "ts": 1016.0, "dur": -1.0, "pid": 5, "tid": 9}]
    trace = merge_traces(driver, [("actor", [w0, []])], step=4)
    assert trace["otherData"] == {"step": 4, "start_epoch_us": 1000.0,
                                  "lanes": ["driver", "actor rank 0", "actor rank 1"]}
    x = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert [(e["name"], e["pid"], e["tid"], e["ts"], e["dur"]) for e in x] == [
        ("gen", 0, 0, 0.0, 50.0), ("reshard", 1, 0, 10.0, 5.0), ("generate", 1, 1, 16.0, 0.0)]
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert names == {0: "driver", 1: "actor rank 0", 2: "actor rank 1"}


def test_plot_draws_every_lane(tmp_path):
    from launch.plot_timeline import lanes_of, plot_timeline

    driver = [{"ph": "X", "name": "gen", "ts": 0.0, "dur": 2e5, "pid": 1, "tid": 1},
              {"ph": "X", "name": "not-a-stage", "ts": 0.0, "dur": 1.0, "pid": 1, "tid": 1}]
    w = [{"ph": "X", "name": "reshard", "ts": 1e4, "dur": 3e4, "pid": 2, "tid": 2}]
    trace = merge_traces(driver, [("actor", [w])], step=2)
    assert lanes_of(trace) == [("driver", [("gen", 0.0, 0.2)]), ("actor rank 0", [("reshard", 0.01, 0.03)])]
    png = plot_timeline(trace, tmp_path / "t.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


@pytest.mark.bad_input
@pytest.mark.parametrize("steps", [[0], [2, -1], ["2"], [True], 3])
def test_bad_timeline_steps_are_refused_naming_the_key(steps):
    from hybridflow.config.schema import TrainerConfig
    from hybridflow.trainer.timeline import check_timeline_keys

    with pytest.raises(ValueError, match=r"trainer\.timeline_steps"):
        check_timeline_keys(TrainerConfig(timeline_steps=steps, timeline_dir="t"))
    check_timeline_keys(TrainerConfig(timeline_steps=[1, 5], timeline_dir="t"))  # good ones pass
