"""The generation modes as types (hybridflow/trainer/generation/): which one a config picks, and what each does
around a step, on plain stand-ins for the worker groups (no Ray). The whole runs of every mode are the e2e tests
(test_e2e_trainer.py, test_e2e_server_mode.py, test_e2e_async.py); these pin the order of the calls, the weight
versions and the sampler state a checkpoint keeps, against values worked out here by hand."""

from __future__ import annotations

import pytest
import torch

from hybridflow.config.load import load_config
from hybridflow.data.sampler import ResumableSampler
from hybridflow.protocol import DataProto
from hybridflow.trainer.generation import make_generation
from hybridflow.trainer.generation.fully_async import FullyAsync
from hybridflow.trainer.generation.one_step import OneStepPrefetch
from hybridflow.trainer.generation.synchronous import Colocated, SplitSync
from hybridflow.trainer.generation.weights import PoolWeights


class Handle:
    def __init__(self, value):
        self.value = value

    def get(self):
        return self.value


class Method:
    """A worker-group method: called directly (blocking) or through `.remote` (a handle to .get())."""

    def __init__(self, name: str, calls: list, fn):
        self.name, self.calls, self.fn = name, calls, fn

    def __call__(self, *args):
        self.calls.append((self.name, *args))
        return self.fn(*args)

    def remote(self, *args):
        self.calls.append((self.name + ".remote", *args))
        return Handle(self.fn(*args))


def rollout_of(prompts: DataProto) -> DataProto:
    """A rollout batch that names the step it was generated for, and reports a metric."""
    out = DataProto.from_dict({"responses": prompts.batch["input_ids"] + 100}, dict(prompts.non_tensor_batch),
                              dict(prompts.meta_info))
    out.meta_info["metrics"] = [{"timing_s/reshard": 0.5}, {"timing_s/reshard": 1.5}]
    return out


class FakeGroup:
    def __init__(self, calls: list, world_size: int = 2):
        self.world_size = world_size
        self.generate_sequences = Method("generate_sequences", calls, rollout_of)
        self.send_weights = Method("send_weights", calls, lambda: [{"weight_sync/send_s": 0.1}])
        self.receive_weights = Method("receive_weights", calls, lambda v: [
            {"weight_sync/recv_s": 0.2, "weight_sync/bytes_recv_per_rank": 8.0,
             "weight_sync/expected_bytes_per_rank": 8.0, "rollout/weight_version": float(v)}])


def drawing(sampler: ResumableSampler, calls: list):
    def draw(step: int) -> DataProto:
        idx = sampler.next_batch()
        calls.append(("draw", step))
        return DataProto.from_dict({"input_ids": torch.tensor([[i] for i in idx])}, meta_info={"global_step": step})
    return draw


def _cfg(*overrides: str):
    return load_config(None, ["data.train_batch_size=2", *overrides])


SPLIT = ["trainer.role_pools.rollout=rollout_pool", "trainer.resource_pools.rollout_pool=[2]"]


@pytest.mark.parametrize("overrides, split, kind", [
    ([], False, Colocated),
    (["actor_rollout_ref.rollout.mode=async"], False, Colocated),
    (["async_training.mode=sync"], True, SplitSync),
    (["async_training.mode=one_step_off_policy"], True, OneStepPrefetch),
    (["async_training.mode=fully_async", "actor_rollout_ref.rollout.mode=async"], True, FullyAsync),
])
def test_the_config_picks_one_source_per_mode(overrides, split, kind):
    calls: list = []
    actor, rollout = FakeGroup(calls), FakeGroup(calls) if split else None
    cfg = _cfg(*overrides, *(SPLIT if split else []))
    sampler = ResumableSampler(8, 2, seed=0, shuffle=False)
    source = make_generation(cfg, actor, rollout, None, sampler, drawing(sampler, calls), last_step=4)
    assert type(source) is kind
    assert source.group is (rollout if split else actor)  # where generate_sequences (and ReMax's greedy call) go
    server_mode = "actor_rollout_ref.rollout.mode=async" in overrides
    assert type(source.how).__name__ == ("AgentGeneration" if server_mode else "BatchGeneration")
    assert calls == []  # building a source calls no worker


def test_colocated_draws_now_and_sends_no_weights():
    calls: list = []
    sampler = ResumableSampler(8, 2, seed=0, shuffle=False)
    source = make_generation(_cfg(), FakeGroup(calls), None, None, sampler, drawing(sampler, calls), last_step=4)
    source.prepare(0)
    gen = source.next(1)
    assert calls[0] == ("draw", 1) and calls[1][0] == "generate_sequences" and len(calls) == 2
    assert gen.prompts is not None and gen.batch.batch["responses"].tolist() == [[100], [101]]
    assert gen.metrics["timing_s/reshard"] == pytest.approx(1.0)  # the ranks' mean
    timings: dict = {}
    assert source.after_update(1, timings) == {} and timings == {}
    assert source.state(1) == {"sampler": sampler.state_dict()}


def test_split_sync_sends_the_weights_on_the_steps_the_period_names():
    calls: list = []
    actor, rollout = FakeGroup(calls), FakeGroup(calls)
    sampler = ResumableSampler(8, 2, seed=0, shuffle=False)
    cfg = _cfg("async_training.mode=sync", "async_training.trigger_parameter_sync_step=2", *SPLIT)
    source = make_generation(cfg, actor, rollout, None, sampler, drawing(sampler, calls), last_step=4)
    source.prepare(2)  # a resumed run at step 2: the rollout pool serves step 3 with the actor's weights
    assert calls == [("send_weights.remote",), ("receive_weights.remote", 3)] and source.weights.version == 3
    calls.clear()
    for step, due in ((3, False), (4, True)):
        source.next(step)
        timings: dict = {}
        metrics = source.after_update(step, timings)
        assert ("weight_sync" in timings) is due
        assert bool(metrics) is due
    assert calls[-2:] == [("send_weights.remote",), ("receive_weights.remote", 5)]
    assert source.weights.version == 5 and metrics["rollout/weight_version"] == 5.0


def test_one_step_prefetch_launches_the_next_batch_and_checkpoints_the_sampler_before_it():
    calls: list = []
    actor, rollout = FakeGroup(calls), FakeGroup(calls)
    sampler = ResumableSampler(8, 2, seed=0, shuffle=False)
    cfg = _cfg("async_training.mode=one_step_off_policy", *SPLIT)
    source = make_generation(cfg, actor, rollout, None, sampler, drawing(sampler, calls), last_step=2)
    reference = ResumableSampler(8, 2, seed=0, shuffle=False)  # the sampler of a run that drew steps 1..k only

    gen = source.next(1)  # nothing in flight: launches step 1, waits for it, launches step 2
    assert [c[:2] if c[0] == "draw" else c[0] for c in calls] == [
        ("draw", 1), "generate_sequences.remote", ("draw", 2), "generate_sequences.remote"]
    assert gen.prompts is None and gen.batch.meta_info["global_step"] == 1
    assert gen.batch.batch["responses"].tolist() == [[100], [101]]
    reference.next_batch()
    assert source.state(1) == {"sampler": reference.state_dict()}  # before step 2's draw, not after it

    calls.clear()
    gen = source.next(2)  # the last step: takes what step 1 launched, launches nothing
    assert calls == [] and gen.batch.meta_info["global_step"] == 2
    assert gen.batch.batch["responses"].tolist() == [[102], [103]]
    reference.next_batch()
    assert source.state(2) == {"sampler": reference.state_dict()} == {"sampler": sampler.state_dict()}


def test_pool_weights_first_transfer_logs_and_sets_the_version():
    calls: list = []
    weights = PoolWeights(FakeGroup(calls), FakeGroup(calls), every=1)
    weights.first_transfer(1)
    assert weights.version == 1 and weights.due(7)
    assert calls == [("send_weights.remote",), ("receive_weights.remote", 1)]
