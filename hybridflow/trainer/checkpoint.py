"""Atomic, keep-last-k checkpoint directories and resume discovery.

Layout: <root>/global_step_<N>/{actor,critic,trainer_state.json,COMPLETE}.
A checkpoint is written under a temp name, gets its COMPLETE marker last, and
is then renamed into place, so a run killed mid-write never leaves a directory
that `latest()` would pick. A crash at any point of a save leaves the previous
checkpoint as it was: nothing complete is removed before its successor is in place
(tests/test_fault.py kills the saver at each `fault_point` below).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

from hybridflow.controller.fault_inject import maybe_kill as fault_point

MARKER = "COMPLETE"
_STEP = re.compile(r"^global_step_(\d+)$")


class CheckpointManager:
    def __init__(self, root: str | Path, keep: int | None = 2):
        self.root = Path(root)
        self.keep = keep

    def staging_dir(self, step: int) -> Path:
        """Where workers write step `step` (shared filesystem on a real cluster)."""
        if self.root.is_dir():  # partial saves of a crashed run (never resumable) go first
            for old in self.root.glob(".tmp_*"):
                shutil.rmtree(old, ignore_errors=True)
        d = self.root / f".tmp_global_step_{step}"
        d.mkdir(parents=True)
        return d

    def commit(self, step: int, staging: Path, trainer_state: dict) -> Path:
        fault_point("ckpt_before_state", step)
        _write_synced(staging / "trainer_state.json", json.dumps(trainer_state, indent=1))
        fault_point("ckpt_before_marker", step)
        _write_synced(staging / MARKER, str(step))
        fault_point("ckpt_before_rename", step)
        final = self.root / f"global_step_{step}"
        if final.exists():  # the same step saved again (a fresh run in an old directory): swap, then delete
            trash = self.root / f".tmp_replaced_global_step_{step}"
            final.rename(trash)
            staging.rename(final)
            shutil.rmtree(trash)
        else:
            staging.rename(final)
        fault_point("ckpt_before_prune", step)
        (self.root / "latest_checkpointed_iteration.txt").write_text(str(step))
        self._prune()
        return final

    def complete(self) -> list[tuple[int, Path]]:
        if not self.root.is_dir():
            return []
        out = []
        for d in self.root.iterdir():
            m = _STEP.match(d.name)
            if m and (d / MARKER).is_file():
                out.append((int(m.group(1)), d))
        return sorted(out)

    def latest(self) -> tuple[int, Path] | None:
        done = self.complete()
        return done[-1] if done else None

    def _prune(self) -> None:
        if not self.keep or self.keep < 1:
            return
        for _, d in self.complete()[: -self.keep]:
            shutil.rmtree(d, ignore_errors=True)

    @staticmethod
    def trainer_state(path: Path) -> dict:
        return json.loads((path / "trainer_state.json").read_text())


def _write_synced(path: Path, text: str) -> None:
    """Write and fsync: the marker must not reach the disk before the state it vouches for."""
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def check_resume_path(path: str | Path, roles: tuple[str, ...] = ("actor",), key: str = "trainer.resume_mode") -> None:
    """Refuse, before any worker starts, a resume path that is not one complete checkpoint directory (what
    RayPPOTrainer.maybe_resume loads): missing, a checkpoint root, incomplete (no COMPLETE marker), or lacking
    trainer_state.json or a role's directory. Errors name `key` and the path."""
    path = Path(path)
    where = f"{key}={str(path)!r}"
    if not path.is_dir():
        raise FileNotFoundError(f"{where}: not 'auto', 'disable' or an existing checkpoint directory")
    if not (path / MARKER).is_file():
        done = CheckpointManager(path).complete()
        if done:
            raise ValueError(f"{where} is a checkpoint root, not a checkpoint: pass {done[-1][1]} (its newest "
                             f"complete one), or trainer.resume_mode=auto with trainer.default_local_dir={path}")
        raise ValueError(f"{where} has no {MARKER} marker: not a checkpoint, or one whose save did not finish")
    try:
        state = CheckpointManager.trainer_state(path)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{where}: trainer_state.json is missing or unreadable ({e})") from None
    missing = [k for k in ("global_step", "sampler") if not isinstance(state, dict) or k not in state]
    if missing:
        raise ValueError(f"{where}: trainer_state.json lacks {missing}")
    absent = [role for role in roles if not (path / role).is_dir()]
    if absent:
        raise ValueError(f"{where}: no {', '.join(absent)} directory in the checkpoint (a run without a critic "
                         "cannot seed one that has a critic)")
