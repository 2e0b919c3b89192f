"""launch.plan on the async layout (docs/async.md): the weight-sync bytes, the link between the pools, the step
time of sync and one_step_off_policy and the pools' idle fractions, each term by hand; then the whole plan of a
recipe on split pools."""

from pathlib import Path

import pytest

from launch.plan import Options, PlanInputError, make_plan
from launch.plan import async_step as A

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "configs/recipes/llama3_8b_grpo_2nodes.yaml"  # Llama-3-8B GRPO, TP2, rollout TP2, 2 x 8 H100
SPLIT = ["trainer.resource_pools.actor=[8]", "trainer.resource_pools.rollout=[8]",
         "trainer.role_pools.actor_rollout=actor", "trainer.role_pools.ref=actor",
         "trainer.role_pools.rollout=rollout"]
LLAMA3_8B_PARAMS = 8_030_261_248  # Meta-Llama-3-8B: 32 x 218.1M layer params + 2 x 525.3M embeddings + norm


# ---- the pure terms ------------------------------------------------------------------------------------------------
def test_rollout_rank_receives_its_shard():
    assert A.rollout_rank_recv_bytes(16e9, 1) == 16e9
    assert A.rollout_rank_recv_bytes(16e9, 2) == 8e9


def test_busiest_sender_serves_its_replicas():
    # 4 rollout replicas over 4 training data replicas: each training rank sends its M/(t*p) slice once
    assert A.busiest_sender_bytes(16e9, tp=2, pp=1, train_replicas=4, rollout_replicas=4) == 8e9
    # 8 replicas (t_g=1 on 8 GPUs) from a single TP8 replica: 8 x 2 GB
    assert A.busiest_sender_bytes(16e9, tp=8, pp=1, train_replicas=1, rollout_replicas=8) == 16e9
    # 3 replicas over 2 training replicas: replica 0 and 2 read from training replica 0 -> 2 x M/(2*2)
    assert A.busiest_sender_bytes(16e9, tp=2, pp=2, train_replicas=2, rollout_replicas=3) == 8e9


def test_pools_share_a_node_only_when_both_fit_in_one():
    assert A.pools_share_node([4], [4], 8)
    assert not A.pools_share_node([8], [8], 8)
    assert not A.pools_share_node([4], [2, 2], 8)
    assert not A.pools_share_node([8, 8], [8], 8)


def test_weight_sync_seconds_and_amortisation():
    assert A.weight_sync_s(8e9, 16e9, 25e9) == pytest.approx(0.64)  # the sender is the bound
    assert A.weight_sync_s(8e9, 2e9, 25e9) == pytest.approx(0.32)
    assert A.sync_per_step_s(0.64, 4) == pytest.approx(0.16)
    with pytest.raises(ValueError, match="trigger_parameter_sync_step"):
        A.sync_per_step_s(0.64, 0)


def test_step_time_sync_and_one_step():
    assert A.async_step_s(60, 100, 2, "sync") == 162
    assert A.async_step_s(60, 100, 2, "one_step_off_policy") == 102  # training-bound
    assert A.async_step_s(120, 100, 2, "one_step_off_policy") == 122  # generation-bound
    with pytest.raises(ValueError, match="async_training.mode"):
        A.async_step_s(1, 1, 0, "two_step")


def test_step_time_fully_async_by_staleness():
    # eta 0: the synchronous step; eta >= 1: one_step's; between: (1 - eta) of generation after the sync, by hand
    assert A.async_step_s(60, 100, 2, "fully_async", 0) == 162
    assert A.async_step_s(60, 100, 2, "fully_async", 1) == A.async_step_s(60, 100, 2, "fully_async", 2) == 102
    assert A.async_step_s(120, 100, 2, "fully_async", 1) == 122
    assert A.async_step_s(60, 100, 2, "fully_async", 0.5) == pytest.approx(2 + 30 + 100)
    assert A.async_step_s(300, 100, 2, "fully_async", 0.5) == pytest.approx(2 + 150 + 150)
    with pytest.raises(ValueError, match="staleness_threshold"):
        A.async_step_s(1, 1, 0, "fully_async", -1)
    rollout, train = A.idle_fractions(60, 100, 2, "fully_async", 0.5)
    assert rollout == pytest.approx(1 - 62 / 132) and train == pytest.approx(1 - 102 / 132)


def test_idle_fractions():
    rollout, train = A.idle_fractions(60, 100, 2, "sync")
    assert rollout == pytest.approx(100 / 162) and train == pytest.approx(60 / 162)
    rollout, train = A.idle_fractions(60, 100, 2, "one_step_off_policy")
    assert rollout == pytest.approx(40 / 102) and train == 0.0
    assert A.idle_fractions(0, 0, 0, "sync") == (0.0, 0.0)


# ---- the planner on split pools -------------------------------------------------------------------------------------
def test_plan_on_split_pools():
    sync = make_plan(RECIPE, [*SPLIT, "async_training.mode=sync"], Options())
    one = make_plan(RECIPE, [*SPLIT, "async_training.mode=one_step_off_policy"], Options())
    j = one.job
    assert j.rollout_pool == "rollout" and j.world == 8 and j.rollout_world == 8 and j.total_gpus == 16
    assert j.roles["actor"].dims.dp == 4  # TP2 on the actor pool's 8 GPUs
    stages = {s.name: s.seconds for s in one.stages}
    assert "transition" not in stages and "4 replicas" in next(s.detail for s in one.stages if s.name == "generate")
    # M/t_g = 2 x 8.03e9 / 2 bytes per rollout GPU (the busiest sender sends as much: 4 replicas over dp 4), across
    # nodes: 50 GB/s NIC x 0.5 (EFFICIENCY internode_link)
    assert stages["weight_sync"] == pytest.approx(LLAMA3_8B_PARAMS * 2 / 2 / 25e9, rel=1e-9)
    gen, train, sync_s = one.async_parts
    assert gen == stages["generate"] and sync_s == stages["weight_sync"]
    assert train == pytest.approx(sum(stages.values()) - gen - sync_s)
    assert one.step_s == pytest.approx(max(gen, train) + sync_s)
    assert sync.step_s == pytest.approx(gen + train + sync_s) and one.step_s < sync.step_s
    assert one.idle_fractions == pytest.approx(A.idle_fractions(gen, train, sync_s, "one_step_off_policy"))
    for phase in one.memory.phases:  # vLLM only on the rollout pool, the training roles only on the actor's
        roles = {r for r, _, _ in phase.items}
        assert roles <= ({"gpu", "rollout"} if phase.pool == "rollout" else {"gpu", "actor", "ref"})
    assert {p.name for p in one.memory.phases if p.pool == "rollout"} == {"weight_sync", "generate"}


def test_sync_every_and_pools_on_one_node():
    every = make_plan(RECIPE, [*SPLIT, "async_training.trigger_parameter_sync_step=4",
                               "trainer.total_training_steps=8"], Options())
    sync = next(s for s in every.stages if s.name == "weight_sync")
    assert sync.seconds == pytest.approx(LLAMA3_8B_PARAMS / 25e9 / 4, rel=1e-9) and "every 4 steps" in sync.detail
    one_node = ["trainer.nnodes=1", "trainer.resource_pools.actor=[4]", "trainer.resource_pools.rollout=[4]",
                *SPLIT[2:], "data.train_batch_size=128"]
    plan = make_plan(RECIPE, one_node, Options())
    # NVLink 450 GB/s x 0.8 (EFFICIENCY link); rollout: 2 replicas of TP2; actor TP2 dp2 -> the sender serves one
    assert next(s.seconds for s in plan.stages if s.name == "weight_sync") == pytest.approx(
        LLAMA3_8B_PARAMS / 360e9, rel=1e-9)
    assert plan.job.total_gpus == 8


def test_plan_of_fully_async_follows_its_staleness():
    one = make_plan(RECIPE, [*SPLIT, "async_training.mode=one_step_off_policy"], Options())
    fa = {eta: make_plan(RECIPE, [*SPLIT, "async_training.mode=fully_async", "actor_rollout_ref.rollout.mode=async",
                                  f"async_training.staleness_threshold={eta}"], Options()) for eta in (0, 0.5, 2)}
    gen, train, sync = one.async_parts
    assert fa[2].step_s == pytest.approx(one.step_s)  # eta >= 1: one step's overlap
    assert fa[0].step_s == pytest.approx(gen + train + sync)  # eta 0: the synchronous step
    assert fa[0.5].step_s == pytest.approx(sync + 0.5 * gen + max(train, 0.5 * gen))


@pytest.mark.parametrize("overrides, match", [
    (["trainer.role_pools.ref=rollout"], "trainer.resource_pools: the planner models the presets"),
    (["async_training.mode=two_step"], "async_training.mode='two_step': the planner models"),
    (["actor_rollout_ref.rollout.tensor_model_parallel_size=4", "trainer.resource_pools.rollout=[6]"],
     "tensor_model_parallel_size=4 does not divide the rollout pool's 6 GPUs"),
])
def test_async_layout_refusals(overrides, match):
    with pytest.raises(PlanInputError, match=match):
        make_plan(RECIPE, [*SPLIT, *overrides], Options())


def test_rollout_pool_must_not_be_the_actors():
    with pytest.raises(PlanInputError, match="is the actor's pool: a rollout pool must be a pool of its own"):
        make_plan(RECIPE, ["trainer.resource_pools.actor=[8]", "trainer.role_pools.actor_rollout=actor",
                           "trainer.role_pools.ref=actor", "trainer.role_pools.rollout=actor"], Options())


def test_one_step_needs_a_rollout_pool():
    with pytest.raises(PlanInputError, match="needs the rollout on a pool of its own"):
        make_plan(RECIPE, ["async_training.mode=one_step_off_policy"], Options())
