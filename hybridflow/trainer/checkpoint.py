"""Atomic, keep-last-k checkpoint directories and resume discovery.

Layout: <root>/global_step_<N>/{actor,critic,trainer_state.json,COMPLETE}.
A checkpoint is written under a temp name, gets its COMPLETE marker last, and
is then renamed into place, so a run killed mid-write never leaves a directory
that `latest()` would pick.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

MARKER = "COMPLETE"
_STEP = re.compile(r"^global_step_(\d+)$")


class CheckpointManager:
    def __init__(self, root: str | Path, keep: int | None = 2):
        self.root = Path(root)
        self.keep = keep

    def staging_dir(self, step: int) -> Path:
        """Where workers write step `step` (shared filesystem on a real cluster)."""
        d = self.root / f".tmp_global_step_{step}"
        if d.exists():
            shutil.rmtree(d)
        d.mkdir(parents=True)
        return d

    def commit(self, step: int, staging: Path, trainer_state: dict) -> Path:
        (staging / "trainer_state.json").write_text(json.dumps(trainer_state, indent=1))
        (staging / MARKER).write_text(str(step))
        final = self.root / f"global_step_{step}"
        if final.exists():
            shutil.rmtree(final)
        staging.rename(final)
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
