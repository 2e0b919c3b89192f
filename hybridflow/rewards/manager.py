"""Score a batch of responses with rule rewards, one failure or hang never taking down the run.

Each sample is scored on its own thread with its own timeout. A scorer that raises
or overruns scores 0 for that sample and is counted (reward/num_errors,
reward/num_timeouts). An overrunning thread cannot be killed in Python, so it is
abandoned as a daemon thread and a fresh thread takes its slot. Worst case, when
every sample hangs, a batch takes ceil(n / num_workers) * timeout_s. A scorer
stuck inside C code that holds the GIL (a catastrophic `re` backtrack) cannot be
interrupted by threads at all; that would need processes.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from hybridflow.rewards import gsm8k, gsm8k_lenient, lookup, math_answer, synthetic

logger = logging.getLogger(__name__)

# data_source -> fn(solution_str, ground_truth) -> float. "openai/gsm8k" scores as verl does (strict,
# format_score 0), so a GSM8K figure means the same in both; "gsm8k_lenient" compares numbers instead.
BUILTIN_SCORERS: dict[str, Callable[[str, Any], float]] = {
    gsm8k.DATA_SOURCE: gsm8k.compute_score,
    gsm8k_lenient.DATA_SOURCE: gsm8k_lenient.compute_score,
    **{source: math_answer.compute_score for source in math_answer.DATA_SOURCES},
    synthetic.DATA_SOURCE: synthetic.compute_score,
    lookup.DATA_SOURCE: lookup.compute_score,
}


def _as_score(result: Any) -> float:
    """A scorer may return a number, a bool, or a dict with 'score' (as verl's custom functions may)."""
    if isinstance(result, dict):
        if "score" not in result:
            raise TypeError(f"reward dict has no 'score' key (keys: {sorted(result)})")
        result = result["score"]
    if not isinstance(result, (int, float, bool, np.number)):
        raise TypeError(f"reward must be a number, got {type(result).__name__}: {result!r}")
    value = float(result)
    if not math.isfinite(value):
        raise ValueError(f"reward is not finite: {value}")
    return value


def _run_with_timeouts(jobs: list[Callable[[], Any]], timeout_s: float, num_workers: int):
    """Run the jobs, at most num_workers at a time, each within timeout_s of its own start.

    Returns (results, statuses): statuses[i] is "ok", "error" or "timeout"; results[i] is the
    return value or the exception.
    """
    n = len(jobs)
    results: list[Any] = [None] * n
    statuses = ["pending"] * n
    finished: queue.Queue = queue.Queue()
    waiting = deque(range(n))
    running: dict[int, float] = {}  # index -> monotonic start time

    def call(i: int) -> None:
        try:
            finished.put((i, "ok", jobs[i]()))
        except BaseException as e:  # any failure is this sample's, not the batch's
            finished.put((i, "error", e))

    while waiting or running:
        while waiting and len(running) < num_workers:
            i = waiting.popleft()
            running[i] = time.monotonic()
            threading.Thread(target=call, args=(i,), daemon=True, name=f"reward-{i}").start()
        next_deadline = min(running.values()) + timeout_s
        try:
            i, status, value = finished.get(timeout=max(0.0, next_deadline - time.monotonic()))
            if i in running:  # a late answer from an abandoned sample is ignored
                del running[i]
                results[i], statuses[i] = value, status
        except queue.Empty:
            pass
        now = time.monotonic()
        for i in [i for i, start in running.items() if now - start >= timeout_s]:
            del running[i]
            statuses[i] = "timeout"
    return results, statuses


class RewardManager:
    """Dispatches each sample on its data_source to a rule scorer, or to one user function for all."""

    def __init__(
        self,
        compute_score: Callable[[str, str, Any, Any], Any] | None = None,
        timeout_s: float = 5.0,
        num_workers: int = 4,
        sandbox=None,
    ):
        """sandbox: a hybridflow.rewards.sandbox.SandboxedReward that scores whole batches in a child process
        (custom_reward_function.sandbox=true) instead of compute_score on threads."""
        if timeout_s <= 0 or num_workers < 1:
            raise ValueError(f"need timeout_s > 0 and num_workers >= 1, got {timeout_s} and {num_workers}")
        self.compute_score = compute_score
        self.timeout_s = timeout_s
        self.num_workers = num_workers
        self.sandbox = sandbox

    @classmethod
    def from_config(cls, cfg, num_workers: int = 4) -> RewardManager:
        """From a CustomRewardConfig (path, name, timeout_s); no path means the built-in scorers."""
        fn = None
        if cfg.path and getattr(cfg, "sandbox", False):  # the user's code is never imported in the driver
            from hybridflow.rewards.sandbox import SandboxedReward

            box = SandboxedReward(cfg.path, cfg.name, cfg.sandbox_timeout_s, cfg.memory_mb)
            return cls(timeout_s=cfg.timeout_s, num_workers=num_workers, sandbox=box)
        if cfg.path:
            from hybridflow.rewards.user_fn import load_reward_fn

            fn = load_reward_fn(cfg.path, cfg.name)
        return cls(compute_score=fn, timeout_s=cfg.timeout_s, num_workers=num_workers)

    def _job(self, source: str, response: str, truth: Any, extra: Any) -> Callable[[], float]:
        if self.compute_score is not None:
            return lambda: _as_score(self.compute_score(source, response, truth, extra))
        scorer = BUILTIN_SCORERS[source]
        return lambda: _as_score(scorer(response, truth))

    def score(
        self,
        responses: Sequence[str],
        ground_truths: Sequence[Any],
        data_sources: Sequence[str],
        extra_infos: Sequence[Any] | None = None,
    ) -> tuple[np.ndarray, dict[str, float]]:
        """Scores (float32, one per response) and metrics; failed or timed-out samples score 0."""
        n = len(responses)
        if extra_infos is None:
            extra_infos = [None] * n
        lengths = {"responses": n, "ground_truths": len(ground_truths), "data_sources": len(data_sources),
                   "extra_infos": len(extra_infos)}
        if len(set(lengths.values())) != 1:
            raise ValueError(f"reward inputs differ in length: {lengths}")
        if self.sandbox is not None:
            values, statuses, extra = self.sandbox.score(list(data_sources), list(responses), list(ground_truths),
                                                         list(extra_infos))
            scores = np.asarray(values, dtype=np.float32)
            return scores, {"reward/mean": float(scores.mean()) if n else 0.0,
                            "reward/num_errors": float(statuses.count("error")),
                            "reward/num_timeouts": float(statuses.count("failed")), **extra}
        if self.compute_score is None:
            unknown = sorted(set(data_sources) - set(BUILTIN_SCORERS))
            if unknown:
                raise ValueError(
                    f"no reward function for data_source {unknown}; known: {sorted(BUILTIN_SCORERS)} "
                    "(or set custom_reward_function.path)"
                )

        start = time.perf_counter()
        jobs = [self._job(*args) for args in zip(data_sources, responses, ground_truths, extra_infos)]
        results, statuses = _run_with_timeouts(jobs, self.timeout_s, self.num_workers)
        scores = np.zeros(n, dtype=np.float32)
        for i, (status, value) in enumerate(zip(statuses, results)):
            if status == "ok":
                scores[i] = value
        errors = [i for i, s in enumerate(statuses) if s == "error"]
        timeouts = [i for i, s in enumerate(statuses) if s == "timeout"]
        for i in errors[:3]:
            logger.warning("reward for sample %d (%s) failed, scored 0: %s: %s", i, data_sources[i],
                           type(results[i]).__name__, results[i])
        if timeouts:
            logger.warning("%d reward(s) exceeded %.1fs and scored 0 (first: sample %d, %s)", len(timeouts),
                           self.timeout_s, timeouts[0], data_sources[timeouts[0]])
        metrics = {
            "reward/mean": float(scores.mean()) if n else 0.0,
            "reward/num_errors": float(len(errors)),
            "reward/num_timeouts": float(len(timeouts)),
            "reward/time_s": time.perf_counter() - start,
        }
        return scores, metrics


def scores_to_token_level(scores, response_mask: torch.Tensor) -> torch.Tensor:
    """(B, T) float32 rewards: each sample's score at its last valid response token, zeros elsewhere."""
    if response_mask.dim() != 2:
        raise ValueError(f"response_mask must be (batch, response_len), got shape {tuple(response_mask.shape)}")
    scores = torch.as_tensor(np.asarray(scores, dtype=np.float32), device=response_mask.device)
    batch, length = response_mask.shape
    if scores.shape != (batch,):
        raise ValueError(f"{tuple(scores.shape)} scores for a response_mask of {batch} rows")
    mask = response_mask.bool()
    empty = (~mask.any(dim=1)).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"rows {empty[:8]} have no valid response token to put their reward on")
    last = length - 1 - mask.flip(dims=[1]).int().argmax(dim=1)
    out = torch.zeros(batch, length, dtype=torch.float32, device=response_mask.device)
    out[torch.arange(batch, device=response_mask.device), last] = scores
    return out


# How a reward model's token-level scores combine with the rule/user scores (reward_model.reward_mode).
REWARD_MODES = ("replace", "add")


def combine_with_rm(rule_scores: torch.Tensor | None, rm_scores: torch.Tensor, mode: str) -> torch.Tensor:
    """token_level_scores from the reward model's (B, R) scores and, for `add`, the rule scores.

    replace: the model's scores alone (rule_scores is not needed; verl's behaviour with a reward model).
    add:     rule + model; both sit on the last valid response token, so the sum does too.
    """
    if mode == "replace":
        return rm_scores.float().clone()
    if mode == "add":
        if rule_scores is None:
            raise ValueError("reward_model.reward_mode=add needs the rule scores")
        if rule_scores.shape != rm_scores.shape:
            raise ValueError(f"rule scores {tuple(rule_scores.shape)} and rm_scores {tuple(rm_scores.shape)} differ")
        return rule_scores.float() + rm_scores.float()
    raise ValueError(f"reward_model.reward_mode={mode!r}; choose one of {', '.join(REWARD_MODES)}")
