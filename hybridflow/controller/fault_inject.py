"""Fault injection at exact points, for the fault-tolerance tests: a real kill, not a mock.

    HYBRIDFLOW_FAULT="stage=update_actor,rank=1,step=2;stage=ckpt_before_marker,step=3"
    HYBRIDFLOW_FAULT_STATE=<dir>   # where fired faults are recorded, so each fires once across restarts

A fault is `;`-separated `key=value` lists:
- stage: a worker method (generate_sequences, compute_log_prob, compute_ref_log_prob, compute_values,
  update_critic, update_actor, save_checkpoint, ...), checked by `WorkerHost.call` before the method
  runs; or a driver point inside a save (`ckpt_*`, see CheckpointManager.commit and RayPPOTrainer.save).
- rank: the worker's rank (workers only; absent: any rank). role: the worker group's role (optional).
- step: the global step the call belongs to (an int, `a-b`, or absent: any).
- kind: `kill` (default; SIGKILL of this process, once) or `nan` (the update's loss becomes NaN, at every
  match; hybridflow's engine reads it through `nan_requested`).

Unset variables cost one dict lookup per call. The parsing is pure and unit-tested.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from pathlib import Path

ENV = "HYBRIDFLOW_FAULT"
STATE_ENV = "HYBRIDFLOW_FAULT_STATE"
_NAN_ACTIVE = {"on": False}  # set by WorkerHost.call for the duration of a method a nan fault matches


@dataclass(frozen=True)
class Fault:
    index: int
    stage: str
    rank: int | None = None
    role: str | None = None
    steps: tuple[int, int] | None = None
    kind: str = "kill"

    def matches(self, stage: str, step: int | None, rank: int | None = None, role: str | None = None) -> bool:
        if stage != self.stage:
            return False
        if self.rank is not None and rank != self.rank:
            return False
        if self.role is not None and role != self.role:
            return False
        if self.steps is not None and (step is None or not self.steps[0] <= step <= self.steps[1]):
            return False
        return True


def parse(spec: str) -> list[Fault]:
    """`stage=...,rank=...,step=...;...` -> faults; an unknown key or kind fails naming it."""
    out = []
    for index, part in enumerate(p for p in spec.split(";") if p.strip()):
        fields = {}
        for item in part.split(","):
            key, sep, value = item.partition("=")
            if not sep:
                raise ValueError(f"{ENV}: {item!r} in {part!r} is not key=value")
            fields[key.strip()] = value.strip()
        unknown = set(fields) - {"stage", "rank", "role", "step", "kind"}
        if unknown or "stage" not in fields:
            raise ValueError(f"{ENV}: {part!r} needs stage= and knows stage, rank, role, step, kind "
                             f"(unknown: {sorted(unknown)})")
        steps = None
        if "step" in fields:
            lo, _, hi = fields["step"].partition("-")
            steps = (int(lo), int(hi or lo))
        kind = fields.get("kind", "kill")
        if kind not in ("kill", "nan"):
            raise ValueError(f"{ENV}: kind={kind!r} in {part!r}; choose kill or nan")
        out.append(Fault(index, fields["stage"], int(fields["rank"]) if "rank" in fields else None,
                         fields.get("role"), steps, kind))
    return out


def active() -> list[Fault]:
    spec = os.environ.get(ENV)
    return parse(spec) if spec else []


def _claim(fault: Fault) -> bool:
    """A kill fires once per run directory of faults: the first process to create its marker fires it."""
    state = os.environ.get(STATE_ENV)
    if not state:
        return True
    Path(state).mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(Path(state) / f"fired_{fault.index}", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    import json
    import time

    os.write(fd, json.dumps({"stage": fault.stage, "pid": os.getpid(), "time": time.time()}).encode())
    os.close(fd)
    return True


def maybe_kill(stage: str, step: int | None, rank: int | None = None, role: str | None = None) -> None:
    """SIGKILL this process if a kill fault matches (and has not fired yet)."""
    for fault in active():
        if fault.kind == "kill" and fault.matches(stage, step, rank, role) and _claim(fault):
            os.kill(os.getpid(), signal.SIGKILL)


def wants_nan(stage: str, step: int | None, rank: int | None = None, role: str | None = None) -> bool:
    return any(f.kind == "nan" and f.matches(stage, step, rank, role) for f in active())


def set_nan(on: bool) -> None:
    _NAN_ACTIVE["on"] = on


def nan_requested() -> bool:
    """Read by the training engine: make this update's loss NaN (a nan fault matched the running method)."""
    return _NAN_ACTIVE["on"]


def step_of(args: tuple, kwargs: dict) -> int | None:
    """The global step a worker call belongs to: a batch's meta_info, or a checkpoint's `extra` dict."""
    for v in (*args, *kwargs.values()):
        meta = getattr(v, "meta_info", None)
        if isinstance(meta, dict) and "global_step" in meta:
            return int(meta["global_step"])
        if isinstance(v, dict) and "global_step" in v:
            return int(v["global_step"])
    return None
