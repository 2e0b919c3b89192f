"""An MoE actor end to end (#26): real Ray, a tiny Qwen3-MoE (8 experts, top-2) at expert parallel 2 on two
processes, GRPO with the HF rollout recording each token's experts and the actor replaying them (R3), fp32.

In fp32 the rollout and training compute the same log-probs (rollout/logprob_diff_max, the sampler's log-prob of
each token against the actor's old-log-prob pass); the routers' load is reported per update.
"""

from __future__ import annotations

import pytest
from test_e2e_trainer import _cmd, _rows, _run

pytestmark = pytest.mark.moe


@pytest.mark.slow
def test_an_ep2_moe_actor_trains_with_routing_replay(warm_assets, tmp_path):
    from hybridflow.models.tiny import save_tiny_model

    model = save_tiny_model(tmp_path / "moe", arch="qwen3_moe", seed=2)
    run = tmp_path / "run"
    _run(_cmd("grpo_moe_tiny_cpu.yaml", run, f"actor_rollout_ref.model.path={model}",
              f"data.train_files=[{warm_assets['train']}]", f"data.val_files=[{warm_assets['test']}]",
              "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=4",  # old log-probs pass
              "trainer.total_training_steps=2", "trainer.save_freq=-1", "actor_rollout_ref.model.dtype=float32",
              "actor_rollout_ref.rollout.name=hf", "actor_rollout_ref.actor.router_replay.mode=R3",
              "actor_rollout_ref.rollout.enable_rollout_routing_replay=true"), tmp_path / "log")
    rows = _rows(run)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["rollout/logprob_diff_max"] < 1e-4, r["rollout/logprob_diff_max"]
        assert 1.0 <= r["actor/moe_load_imbalance"] <= 8 / 2  # even .. every token on the same 2 of 8 experts
        assert r["actor/grad_norm"] > 0
