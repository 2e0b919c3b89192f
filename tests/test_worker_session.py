"""Trainers over worker groups built for another config (hybridflow.trainer.main.worker_session): a variant may change
only what the driver reads per step, and the check names what else differs."""

from __future__ import annotations

import pytest

from hybridflow.config.load import load_config
from hybridflow.trainer.main import check_driver_side_variant


def _cfg(*overrides: str, critic: bool):
    cfg = load_config(None, list(overrides))
    cfg.critic.enable = critic  # as preflight resolves it from the estimator
    return cfg


def test_a_variant_may_change_the_algorithm_the_loss_agg_mode_and_the_run():
    built = _cfg("algorithm.adv_estimator=gae", critic=True)
    check_driver_side_variant(built, _cfg("algorithm.adv_estimator=grpo", "actor_rollout_ref.actor.loss_agg_mode="
                                          "seq-mean-token-sum", "trainer.default_local_dir=elsewhere",
                                          "trainer.total_training_steps=2", "critic.optim.lr=0.5", critic=False))


@pytest.mark.parametrize("overrides, message", [
    (("actor_rollout_ref.actor.optim.lr=0.5",), r"actor_rollout_ref.actor.optim.lr"),
    (("actor_rollout_ref.rollout.n=7",), r"actor_rollout_ref.rollout.n"),
    (("trainer.n_gpus_per_node=4",), r"trainer.n_gpus_per_node"),
    (("critic.loss_agg_mode=token-sum",), r"critic.loss_agg_mode"),  # gae uses the critic: its config is the workers'
])
def test_a_variant_that_changes_what_the_workers_hold_is_refused_naming_the_key(overrides, message):
    built = _cfg("algorithm.adv_estimator=gae", critic=True)
    with pytest.raises(ValueError, match=message):
        check_driver_side_variant(built, _cfg("algorithm.adv_estimator=gae", *overrides, critic=True))


def test_a_variant_that_needs_a_critic_the_groups_lack_is_refused():
    with pytest.raises(ValueError, match=r"adv_estimator=gae needs a critic; the worker groups were built without"):
        check_driver_side_variant(_cfg(critic=False), _cfg("algorithm.adv_estimator=gae", critic=True))
