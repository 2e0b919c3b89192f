"""async_training.* and the rollout pool: bad input fails before Ray starts, naming the key (#25)."""

from __future__ import annotations

import pytest

from hybridflow.config.load import load_config

pytestmark = pytest.mark.bad_input
SPLIT = ("trainer.resource_pools.actor=[2]", "trainer.resource_pools.rollout=[2]",
         "trainer.role_pools.actor_rollout=actor", "trainer.role_pools.ref=actor", "trainer.role_pools.critic=actor",
         "trainer.role_pools.rollout=rollout")
ONE_STEP = "async_training.mode=one_step_off_policy"
FULLY = ("async_training.mode=fully_async", "actor_rollout_ref.rollout.mode=async")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from hybridflow.data.synthetic import make_reverse_rows, write_parquet
    from hybridflow.models.tiny import save_tiny_model

    root = tmp_path_factory.mktemp("async_checks")
    write_parquet(make_reverse_rows(8, seed=0), root / "train.parquet")
    return {"model": save_tiny_model(root / "policy"), "data": root / "train.parquet"}


def _validate(files, *overrides):
    from hybridflow.trainer.main import validate

    cfg = load_config(None, [f"actor_rollout_ref.model.path={files['model']}", f"data.train_files=[{files['data']}]",
                             "trainer.total_training_steps=4", *overrides])
    validate(cfg)
    return cfg


def test_one_step_on_a_rollout_pool_passes(files):
    assert _validate(files, *SPLIT, ONE_STEP).async_training.mode == "one_step_off_policy"


def test_fully_async_with_staleness_and_partial_rollouts_on_a_rollout_pool_passes(files):
    cfg = _validate(files, *SPLIT, *FULLY, "async_training.staleness_threshold=2",
                    "async_training.partial_rollout=true")
    assert (cfg.async_training.mode, cfg.async_training.staleness_threshold) == ("fully_async", 2.0)


@pytest.mark.parametrize("overrides, match", [
    ((ONE_STEP,), r"async_training.mode=one_step_off_policy needs the rollout on a pool of its own"),
    ((SPLIT[0], *SPLIT[2:5], "trainer.role_pools.rollout=actor", ONE_STEP),
     r"trainer.role_pools.rollout='actor' is the actor's pool"),
    ((*SPLIT, "async_training.staleness_threshold=-1"), r"async_training.staleness_threshold=-1.0 must be >= 0"),
    ((*SPLIT, "async_training.partial_rollout=true"),
     r"async_training.partial_rollout=true .* needs async_training.mode=fully_async"),
    ((*SPLIT, ONE_STEP, "async_training.trigger_parameter_sync_step=3"),
     r"trigger_parameter_sync_step=3 does not divide trainer.total_training_steps=4"),
    ((SPLIT[0], "trainer.resource_pools.rollout=[1]", *SPLIT[2:],
      "actor_rollout_ref.rollout.tensor_model_parallel_size=2"),
     r"tensor_model_parallel_size=2 does not divide the rollout pool's 1 processes"),
    ((*SPLIT, "async_training.mode=fully_async"),
     r"async_training.mode=fully_async produces request by request .* set actor_rollout_ref.rollout.mode=async"),
    ((*FULLY,), r"async_training.mode=fully_async needs the rollout on a pool of its own"),
    ((*SPLIT, *FULLY, "async_training.staleness_threshold=-0.5"), r"staleness_threshold=-0.5 must be >= 0"),
    ((*SPLIT, ONE_STEP, "async_training.staleness_threshold=1"),
     r"staleness_threshold=1.0: a staleness bound belongs to async_training.mode=fully_async"),
    ((*SPLIT, ONE_STEP, "actor_rollout_ref.rollout.mode=async"),
     r"one_step_off_policy generates whole batches .* async_training.mode=fully_async with "
     r"async_training.staleness_threshold=1"),
    ((*SPLIT, "async_training.mode=one_step"), r"unknown async_training.mode='one_step'"),
])
def test_bad_async_keys_are_named(files, overrides, match):
    with pytest.raises(ValueError, match=match):
        _validate(files, *overrides)
