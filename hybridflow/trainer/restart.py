"""Surviving a dead worker: tear every worker group down, rebuild on fresh processes, resume.

`run_with_restarts` runs one attempt (build the groups, fit, and always take every group and placement
group down: hybridflow.controller.teardown.Teardown) and, when a worker died or a wait timed out
(WorkerDiedError, WorkerTimeoutError) and trainer.max_restarts allows, runs the next attempt on fresh
processes, ports and process groups, which resumes from the newest complete checkpoint. A worker
that *raised* (WorkerError: a bug, bad data, NonFiniteUpdateError) is not restarted: it would raise again.

Each restart is logged and appended to <run_dir>/restarts.jsonl: the count, the cause (role, rank, stage),
the step resumed from, and the times of the death's detection and of the rebuilt groups being ready.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path

from hybridflow.controller.errors import WorkerDiedError, WorkerTimeoutError

log = logging.getLogger(__name__)
RESTARTABLE = (WorkerDiedError, WorkerTimeoutError)


def resume_mode_for_restart(original: str, saved_this_run: str | None) -> str:
    """A restart resumes from this run's newest checkpoint when it saved one, else as the run first started
    (auto: the directory's newest; a path: that one; disable: from scratch)."""
    return saved_this_run if saved_this_run else original


def cause(e: BaseException) -> dict:
    return {"error": type(e).__name__, "role": getattr(e, "role", None), "rank": getattr(e, "rank", None),
            "stage": getattr(e, "stage", None), "method": getattr(e, "method", None),
            "message": str(e).splitlines()[0][:300]}


class RestartLog:
    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / "restarts.jsonl"
        self.pending: dict | None = None

    def died(self, count: int, error: BaseException, at_step: int) -> None:
        self.pending = {"restart": count, "cause": cause(error), "failed_step": at_step, "detected_at": time.time()}
        c = self.pending["cause"]
        log.warning("restart %d: worker '%s' rank %s %s in stage %s at step %d; rebuilding every worker group",
                    count, c["role"], c["rank"], "died" if c["error"] == "WorkerDiedError" else "timed out",
                    c["stage"], at_step)

    def resumed(self, step: int) -> None:
        """Called by the trainer once the rebuilt groups have loaded the checkpoint (or started afresh)."""
        if self.pending is None:
            return
        rec = {**self.pending, "resumed_from_step": step, "ready_at": time.time()}
        rec["recovery_s"] = rec["ready_at"] - rec["detected_at"]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        log.warning("restart %d: resumed from step %d, %.1f s after the failure was detected", rec["restart"], step,
                    rec["recovery_s"])
        self.pending = None


def run_with_restarts(max_restarts: int, attempt: Callable[[int, RestartLog], list[dict]], run_dir,
                      current_step: Callable[[], int]) -> list[dict]:
    """attempt(n, restart_log) builds the groups, fits (calling restart_log.resumed after its resume) and
    tears its groups down whatever happens. current_step(): the step the failed attempt was on."""
    restart_log = RestartLog(run_dir)
    n = 0
    while True:
        try:
            return attempt(n, restart_log)
        except RESTARTABLE as e:
            if n >= max_restarts:
                if max_restarts:
                    log.error("trainer.max_restarts=%d used up; giving up: %s", max_restarts, cause(e))
                raise
            n += 1
            restart_log.died(n, e, current_step())
