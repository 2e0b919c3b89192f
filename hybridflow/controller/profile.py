"""Named time ranges of one process for a timeline step, recorded by torch.profiler.

Only the ranges code marks with `torch.profiler.record_function` are kept (category
`user_annotation` in torch's Chrome-trace export), not every aten op: the timeline shows
stages and forward/backward/optimizer/reshard, and stays small. Timestamps are made absolute
(epoch microseconds; torch writes them relative to `baseTimeNanoseconds`) so that the events
of the driver and of every worker process line up in one file (hybridflow/trainer/timeline.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile


class RangeProfiler:
    """start() ... stop() -> the trace events (torch.profiler's Chrome-trace dicts) of the marked ranges."""

    def __init__(self):
        self._prof = None

    def start(self, quiet_to: str | None = None) -> None:
        """quiet_to: a file for what kineto prints on stderr meanwhile ('profiler_start' lines); None: leave it."""
        from torch.profiler import ProfilerActivity, profile

        if self._prof is not None:
            raise RuntimeError("the profiler is already running (profile_start called twice)")
        self._prof = profile(activities=[ProfilerActivity.CPU])
        with _fd_to_file(2, quiet_to):
            self._prof.start()

    def stop(self, quiet_to: str | None = None) -> list[dict]:
        if self._prof is None:
            raise RuntimeError("profile_stop without profile_start")
        prof, self._prof = self._prof, None
        with _fd_to_file(2, quiet_to):
            prof.stop()
        with tempfile.TemporaryDirectory(prefix="hf_prof_") as tmp:
            path = os.path.join(tmp, "trace.json")
            prof.export_chrome_trace(path)
            with open(path) as f:
                trace = json.load(f)
        base_us = float(trace.get("baseTimeNanoseconds", 0)) / 1e3
        return [{**e, "ts": float(e["ts"]) + base_us, "args": {}} for e in trace.get("traceEvents", [])
                if e.get("cat") == "user_annotation" and e.get("ph") == "X"]


@contextlib.contextmanager
def _fd_to_file(fd: int, path: str | None):
    """Send `fd` to the file `path` meanwhile."""
    if path is None:
        yield
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    saved = os.dup(fd)
    try:
        with open(path, "a") as f:
            os.dup2(f.fileno(), fd)
        yield
    finally:
        os.dup2(saved, fd)
        os.close(saved)
