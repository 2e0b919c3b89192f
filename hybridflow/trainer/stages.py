"""The named stages of the driver's step (hybridflow/trainer/ppo_trainer.py): each is timed (`timing_s/<stage>`, a
span on timeline steps), and a worker failure inside one carries its name."""

from __future__ import annotations

import contextlib
import time

import torch

from hybridflow.controller.errors import WorkerDiedError, WorkerError, WorkerTimeoutError


@contextlib.contextmanager
def timer(name: str, timings: dict):
    t = time.perf_counter()
    with stage(name), torch.profiler.record_function(name):  # a driver span on timeline steps
        yield
    timings[name] = timings.get(name, 0.0) + time.perf_counter() - t


@contextlib.contextmanager
def stage(name: str):
    """A worker failure inside carries the stage it broke (`e.stage`), for the restart log and the error."""
    try:
        yield
    except (WorkerDiedError, WorkerTimeoutError, WorkerError) as e:
        if getattr(e, "stage", None) is None:
            e.stage = name
            e.add_note(f"(stage {name})")
        raise
