"""trainer.timeline_dir: one Chrome-trace JSON per chosen step, the driver's stages above every rank's ranges.

Every event is one torch.profiler wrote (hybridflow/controller/profile.py): on the driver the stage
timers of ppo_trainer.py are `record_function` ranges, on the workers megatron's forward/backward
(megatron_workers/profiling.py), the optimizer step and the reshard. Merging only re-numbers them:
pid 0 is the driver, then one pid per (worker group, rank), each named by a process_name metadata
event, timestamps shifted so the step starts at 0. The file opens in Perfetto (ui.perfetto.dev) and
chrome://tracing; launch/plot_timeline.py draws it as a PNG.
"""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path

log = logging.getLogger(__name__)


def check_timeline_keys(trainer_cfg) -> None:
    """trainer.timeline_steps: positive step numbers (steps count from 1); refused before Ray starts."""
    steps = trainer_cfg.timeline_steps
    if not isinstance(steps, (list, tuple)) or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 1
                                                       for s in steps):
        raise ValueError(f"trainer.timeline_steps={steps!r}: a list of step numbers >= 1 (steps count from 1)")
    total = trainer_cfg.total_training_steps
    if trainer_cfg.timeline_dir and total is not None and not any(s <= total for s in steps):
        log.warning("trainer.timeline_steps=%s: none is <= trainer.total_training_steps=%d, so trainer.timeline_dir "
                    "gets no file", list(steps), total)


def merge_traces(driver: list[dict], workers: list[tuple[str, list[list[dict]]]], step: int) -> dict:
    """driver: the driver's events; workers: [(group name, [events of rank 0, rank 1, ...])]. -> trace dict."""
    lanes = [("driver", driver)] + [(f"{name} rank {r}", ev) for name, per_rank in workers
                                     for r, ev in enumerate(per_rank)]
    t0 = min((e["ts"] for _, ev in lanes for e in ev), default=0.0)
    out: list[dict] = []
    for pid, (label, events) in enumerate(lanes):
        out.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "ts": 0, "args": {"name": label}})
        out.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "ts": 0,
                    "args": {"sort_index": pid}})
        tids: dict = {}
        for e in sorted(events, key=lambda e: e["ts"]):
            tid = tids.setdefault(e.get("tid"), len(tids))
            out.append({**e, "pid": pid, "tid": tid, "ts": e["ts"] - t0, "dur": max(0.0, float(e.get("dur", 0)))})
    return {"traceEvents": out, "displayTimeUnit": "ms",
            "otherData": {"step": step, "start_epoch_us": t0, "lanes": [label for label, _ in lanes]}}


class StepTimeline:
    """`record(step)` around a trainer step: profiles the driver and every group when the step is chosen."""

    def __init__(self, directory: str | None, steps, groups: list, quiet_to: str | None = None):
        self.directory = Path(directory) if directory else None
        self.steps = {int(s) for s in steps or ()}
        self.groups = [g for g in groups if g is not None]
        self.quiet_to = quiet_to  # where the driver's kineto start/stop lines go (the driver log), None: stderr

    def wants(self, step: int) -> bool:
        return self.directory is not None and step in self.steps

    @contextlib.contextmanager
    def record(self, step: int):
        if not self.wants(step):
            yield None
            return
        import torch

        from hybridflow.controller.profile import RangeProfiler

        prof = RangeProfiler()
        for g in self.groups:
            g.profile_start()
        prof.start(self.quiet_to)
        try:
            with torch.profiler.record_function("step"):
                yield self
        except BaseException:
            # The step failed (a dead worker, ...): no file, and no call into groups that are being torn down,
            # which would replace the step's error with its own. A restarted run's groups start unprofiled.
            prof.stop(self.quiet_to)
            raise
        driver = prof.stop(self.quiet_to)
        workers = [(g.role, g.profile_stop()) for g in self.groups]
        path = self.write(merge_traces(driver, workers, step), step)
        log.info("timeline of step %d: %s", step, path)

    def write(self, trace: dict, step: int) -> Path:
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / f"step_{step}.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(trace))
        tmp.replace(path)
        return path
