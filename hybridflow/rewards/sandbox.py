"""A user reward function run in a child process, with a wall-time and a memory limit per batch.

custom_reward_function.sandbox=true: each batch is scored by a fresh `python -m hybridflow.rewards.sandbox`
child. The child caps its own address space (RLIMIT_AS = memory_mb) before it imports the user's file, then
scores every sample and prints JSON. The parent never unpickles what the child sends (the child runs
untrusted code): it reads a list of numbers. A batch whose child runs past sandbox_timeout_s (killed), dies,
or runs out of memory scores 0 for every sample and is counted (reward/sandbox_failures); one sample that
raises (MemoryError included) scores 0 alone (reward/num_errors). The run goes on either way.

The child imports only the standard library and the user's file, so one costs ~0.05 s plus the user's imports.
"""

from __future__ import annotations

import json
import logging
import math
import os
import pickle
import subprocess
import sys
import time

log = logging.getLogger(__name__)
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # hybridflow's parent


class SandboxedReward:
    def __init__(self, path: str, name: str = "compute_score", timeout_s: float = 60.0, memory_mb: int = 1024):
        if timeout_s <= 0 or memory_mb < 64:
            raise ValueError(f"custom_reward_function: sandbox_timeout_s={timeout_s} must be > 0 and "
                             f"memory_mb={memory_mb} >= 64")
        self.path, self.name, self.timeout_s, self.memory_mb = path, name, timeout_s, memory_mb
        ok, detail = self._run([])  # the file imports and defines `name`, checked before any worker starts
        if not ok:
            raise ImportError(f"custom_reward_function.path={path!r} (sandboxed): {detail}")

    def _run(self, samples: list) -> tuple[bool, object]:
        payload = pickle.dumps({"path": self.path, "name": self.name, "memory_mb": self.memory_mb,
                                "samples": samples})
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([_ROOT, os.environ.get("PYTHONPATH", "")])}
        try:
            proc = subprocess.run([sys.executable, "-m", "hybridflow.rewards.sandbox"], input=payload,
                                  capture_output=True, timeout=self.timeout_s, env=env)
        except subprocess.TimeoutExpired:
            return False, f"timeout: the batch ran past {self.timeout_s:.0f} s (killed)"
        if proc.returncode != 0:
            tail = proc.stderr.decode(errors="replace").strip().splitlines()[-1:] or [""]
            return False, f"the sandbox exited with {proc.returncode}: {tail[0][:300]}"
        try:
            return True, json.loads(proc.stdout.decode().strip().splitlines()[-1])
        except (ValueError, IndexError):
            return False, "the sandbox printed no result"

    def score(self, data_sources, responses, ground_truths, extra_infos) -> tuple[list[float], list[str], dict]:
        """(scores, statuses 'ok'/'error'/'failed', metrics) for one batch."""
        n = len(responses)
        start = time.perf_counter()
        ok, out = self._run(list(zip(data_sources, responses, ground_truths, extra_infos, strict=True)))
        metrics = {"reward/sandbox_failures": 0.0, "reward/sandbox_s": 0.0}
        if not ok:
            log.warning("sandboxed reward batch of %d scored 0: %s", n, out)
            metrics.update({"reward/sandbox_failures": 1.0, "reward/sandbox_s": time.perf_counter() - start})
            return [0.0] * n, ["failed"] * n, metrics
        scores, statuses = [], []
        for value in out["scores"]:
            good = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            scores.append(float(value) if good else 0.0)
            statuses.append("ok" if good else "error")
        for err in out["errors"][:3]:
            log.warning("sandboxed reward sample failed, scored 0: %s", err)
        metrics["reward/sandbox_s"] = time.perf_counter() - start
        return scores, statuses, metrics


def _child() -> None:
    import resource

    job = pickle.loads(sys.stdin.buffer.read())  # from our own parent: trusted
    limit = job["memory_mb"] * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    from hybridflow.rewards.user_fn import load_reward_fn

    try:
        fn = load_reward_fn(job["path"], job["name"])
    except Exception as e:  # noqa: BLE001 - reported to the parent as text
        print(f"{type(e).__name__}: {e}", file=sys.stderr)
        sys.exit(3)
    scores, errors = [], []
    for source, response, truth, extra in job["samples"]:
        try:
            value = fn(source, response, truth, extra)
            value = value["score"] if isinstance(value, dict) else value
            scores.append(float(value))
        except BaseException as e:  # noqa: BLE001 - MemoryError and friends score this sample 0
            scores.append(None)
            errors.append(f"{type(e).__name__}: {str(e)[:200]}")
    print(json.dumps({"scores": [s if s is None or math.isfinite(s) else None for s in scores], "errors": errors}))


def _parse_args(argv: list[str]) -> None:
    """No options: the job comes on stdin. Only --help, so the child says what it is (~1 ms of argparse)."""
    import argparse

    argparse.ArgumentParser(
        prog="python -m hybridflow.rewards.sandbox",
        description="Score one batch with a user reward function in this (memory-capped) process; the parent "
                    "SandboxedReward starts it.",
        epilog="Reads a pickled job from stdin, prints {\"scores\": [...], \"errors\": [...]} as JSON. "
               "Not meant to be run by hand: custom_reward_function.sandbox=true starts one per batch.",
    ).parse_args(argv)


if __name__ == "__main__":
    _parse_args(sys.argv[1:])
    _child()
