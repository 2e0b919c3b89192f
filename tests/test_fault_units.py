"""Pure parts of the fault handling: the fault-hook spec, the restart loop's decisions, the non-finite check."""

from __future__ import annotations

import math

import pytest
import torch

from hybridflow.controller import fault_inject
from hybridflow.controller.errors import WorkerDiedError, WorkerError
from hybridflow.trainer.restart import resume_mode_for_restart, run_with_restarts


def test_fault_spec_parses_and_matches_exact_points():
    a, b = fault_inject.parse("stage=update_actor,rank=1,step=2; stage=ckpt_before_marker,step=3-4,kind=kill")
    assert a.matches("update_actor", 2, rank=1) and not a.matches("update_actor", 2, rank=0)
    assert not a.matches("update_actor", 3, rank=1) and not a.matches("update_critic", 2, rank=1)
    assert b.matches("ckpt_before_marker", 4) and not b.matches("ckpt_before_marker", 5)
    assert not b.matches("ckpt_before_marker", None)  # a step-bound fault never fires where no step is known
    for bad, where in (("rank=1", "needs stage="), ("stage=x,when=2", "unknown: \\['when'\\]"),
                       ("stage=x,kind=segv", "kind='segv'"), ("stage", "not key=value")):
        with pytest.raises(ValueError, match=where):
            fault_inject.parse(bad)


def test_kill_fault_fires_once_per_state_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(fault_inject.STATE_ENV, str(tmp_path))
    (fault,) = fault_inject.parse("stage=x")
    assert fault_inject._claim(fault) and not fault_inject._claim(fault)  # a redone step is not killed again


def test_step_of_reads_batches_and_checkpoint_extras():
    from hybridflow.protocol import DataProto

    assert fault_inject.step_of((DataProto(meta_info={"global_step": 7}),), {}) == 7
    assert fault_inject.step_of(("path",), {"extra": {"global_step": 3}}) == 3
    assert fault_inject.step_of((), {}) is None


def test_restart_loop_restarts_deaths_only_and_within_max_restarts(tmp_path):
    calls = []

    def dies_twice(n, log):
        calls.append(n)
        if n < 2:
            raise WorkerDiedError("actor", 1, "update_actor")
        log.resumed(5)
        return ["done"]

    assert run_with_restarts(2, dies_twice, tmp_path, lambda: 6) == ["done"] and calls == [0, 1, 2]
    with pytest.raises(WorkerDiedError):
        run_with_restarts(1, dies_twice, tmp_path, lambda: 6)  # the second death is one too many

    def raises(n, log):  # a worker that raised would raise again: no restart
        calls.append(("raised", n))
        raise WorkerError("actor", 0, "update_actor", "Traceback ...")

    with pytest.raises(WorkerError):
        run_with_restarts(5, raises, tmp_path, lambda: 1)
    assert calls[-1] == ("raised", 0)
    assert resume_mode_for_restart("disable", "/run/checkpoints/global_step_4") == "/run/checkpoints/global_step_4"
    assert resume_mode_for_restart("auto", None) == "auto"


def test_nonfinite_guard_names_the_tensor_and_counts_the_streak():
    from megatron_workers.nonfinite import NonFiniteGuard, NonFiniteUpdateError

    model = torch.nn.Linear(3, 2)
    model.weight.grad = torch.tensor([[1.0, float("nan"), 2.0], [float("inf"), -4.0, 0.5]])
    guard = NonFiniteGuard("update_actor", enabled=True, max_in_a_row=2)
    assert guard.check([model], 0.3) == ("update_actor rank 0: grad of weight shape (2, 3): 1 NaN, 1 inf, "
                                          "finite range [-4, 2]")
    model.weight.grad = torch.ones(2, 3)
    assert guard.check([model], 0.3) is None and guard.streak == 0  # a finite update resets the streak
    assert "loss = nan" in guard.check([model], math.nan)
    with pytest.raises(NonFiniteUpdateError, match="2 updates in a row.*max_nonfinite=2.*loss = inf"):
        guard.check([model], math.inf)
    assert NonFiniteGuard("x", enabled=False).check([model], math.nan) is None


@pytest.mark.bad_input
@pytest.mark.parametrize("key,value,error", [("max_restarts", -1, "trainer.max_restarts=-1 must be >= 0"),
                                             ("fault.pg_timeout_s", 0.0, "trainer.fault.pg_timeout_s=0.0 must be > 0"),
                                             ("fault.detect_timeout_s", math.nan, "detect_timeout_s=nan must be")])
def test_bad_fault_settings_name_the_key(key, value, error):
    from hybridflow.config.schema import HybridFlowConfig
    from hybridflow.trainer.preflight import _validate_fault

    cfg = HybridFlowConfig()
    target, _, leaf = f"trainer.{key}".rpartition(".")
    obj = cfg
    for part in target.split("."):
        obj = getattr(obj, part)
    setattr(obj, leaf, value)
    with pytest.raises(ValueError, match=error):
        _validate_fault(cfg)
