"""The vLLM log filter drops exactly the routine per-step reload lines, nothing else."""

from __future__ import annotations

import logging

import pytest

from hybridflow.rollout.vllm_logs import ROUTINE_PER_STEP, _DropPrefix, quiet_routine_reload_logs


class _Collect(logging.Handler):
    def __init__(self):
        super().__init__(level=logging.DEBUG)
        self.texts: list[str] = []

    def emit(self, record):
        self.texts.append(record.getMessage())


@pytest.fixture
def collected(monkeypatch):
    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    handler = _Collect()
    loggers = [logging.getLogger(name) for name, _ in ROUTINE_PER_STEP]
    saved = [(log.level, list(log.filters)) for log in loggers]
    for log in loggers:  # start from no filter of ours, even if an in-process vLLM test installed them
        log.filters[:] = [f for f in log.filters if not isinstance(f, _DropPrefix)]
        log.addHandler(handler)
        log.setLevel(logging.DEBUG)
    yield loggers, handler
    for log, (level, filters) in zip(loggers, saved, strict=True):
        log.removeHandler(handler)
        log.setLevel(level)
        log.filters[:] = filters


def _emit_all(loggers):
    inplace, block_pool, layerwise = loggers
    inplace.info("Reloading and processing weights took %.2f seconds", 0.03)
    block_pool.info("Successfully reset prefix cache")
    layerwise.warning("%s: Failed to load weights", "RotaryEmbedding")
    # look-alikes that must still show
    layerwise.warning("%s: Failed to load weights", "QKVParallelLinear")
    inplace.warning("Reloading failed: shape mismatch for %s", "lm_head")
    block_pool.info("Failed to reset prefix cache because some blocks are not freed yet")


def test_routine_lines_dropped_others_kept(collected):
    loggers, handler = collected
    assert quiet_routine_reload_logs() == 3
    assert quiet_routine_reload_logs() == 0  # idempotent: no second copy of a filter
    _emit_all(loggers)
    assert handler.texts == [
        "QKVParallelLinear: Failed to load weights",
        "Reloading failed: shape mismatch for lm_head",
        "Failed to reset prefix cache because some blocks are not freed yet",
    ]


def test_debug_level_keeps_everything(collected, monkeypatch):
    loggers, handler = collected
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "debug")
    assert quiet_routine_reload_logs() == 0
    _emit_all(loggers)
    assert len(handler.texts) == 6
