"""The LR schedule against hand-computed numbers, and how the scheduler writes into parameter groups."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from hybridflow.config.schema import OptimConfig
from megatron_workers.optimizer import LRSchedule, LRScheduler


def lrs(schedule: LRSchedule, n: int) -> list[float]:
    return [schedule.lr_at(k) for k in range(n)]


def test_constant_with_and_without_warmup():
    assert lrs(LRSchedule(1e-3), 3) == [1e-3, 1e-3, 1e-3]
    # warmup 4: the first update already uses 1/4 of the lr (not 0)
    assert lrs(LRSchedule(1e-3, warmup_steps=4), 6) == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3])


def test_linear_decay_to_min_ratio():
    s = LRSchedule(1.0, "linear", warmup_steps=2, total_steps=10, min_lr_ratio=0.1)
    # warmup 0.5, 1.0; then from 1.0 at step 2 down to 0.1 at step 10, flat after
    expected = {0: 0.5, 1: 1.0, 2: 1.0, 4: 0.1 + 0.9 * (1 - 2 / 8), 6: 0.55, 10: 0.1, 12: 0.1}
    for step, lr in expected.items():
        assert s.lr_at(step) == pytest.approx(lr), step


def test_cosine_decay():
    s = LRSchedule(2.0, "cosine", total_steps=4)
    assert lrs(s, 6) == pytest.approx([2.0, 1.0 + math.sqrt(0.5), 1.0, 1.0 - math.sqrt(0.5), 0.0, 0.0])
    with_floor = LRSchedule(1.0, "cosine", warmup_steps=1, total_steps=5, min_lr_ratio=0.2)
    # step 0 is warmup (1/1), step 3 is half way through the 4 decay steps
    assert with_floor.lr_at(0) == 1.0 and with_floor.lr_at(3) == pytest.approx(0.6)
    assert with_floor.lr_at(5) == pytest.approx(0.2)


def test_bad_schedules_name_the_key():
    with pytest.raises(ValueError, match="total_training_steps=-1"):
        LRSchedule(1.0, "cosine")  # the trainer has not filled in the total
    with pytest.raises(ValueError, match="lr_scheduler='step'"):
        LRSchedule(1.0, "step")
    with pytest.raises(ValueError, match="min_lr_ratio=1.5"):
        LRSchedule(1.0, "linear", total_steps=3, min_lr_ratio=1.5)


def test_scheduler_writes_groups_and_round_trips():
    groups = [{"lr_mult": 1.0, "wd_mult": 1.0}, {"lr_mult": 0.5, "wd_mult": 0.0}, {}]
    optim = OptimConfig(lr=1.0, weight_decay=0.1, lr_scheduler="linear", lr_warmup_steps=0,
                        total_training_steps=4, min_lr_ratio=0.0)
    sched = LRScheduler(SimpleNamespace(param_groups=groups), LRSchedule.from_optim_config(optim), 0.1)
    assert [g["lr"] for g in groups] == [1.0, 0.5, 1.0]
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0, 0.1]  # no decay where megatron says wd_mult=0
    sched.step()
    assert sched.current_lr() == pytest.approx(0.75) and groups[1]["lr"] == pytest.approx(0.375)
    state = sched.state_dict()
    other_groups = [{}, {}, {}]
    resumed = LRScheduler(SimpleNamespace(param_groups=other_groups), sched.schedule, 0.1)
    resumed.load_state_dict(state)
    assert resumed.num_steps == 1 and other_groups[0]["lr"] == pytest.approx(0.75)
