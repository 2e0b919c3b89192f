"""ActorRolloutRefWorker driven through the single controller on a real local Ray cluster.

Two ranks (TP1, DP2): the driver calls each method once; DP_COMPUTE_PROTO splits the batch over
the two replicas and concatenates what the collect ranks return. The results are checked against
plain HF transformers + torch AdamW on the whole batch (the same reference as the torchrun tests).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "mcore_scripts"))
from train_common import actor_config, hf_ppo_update, hf_state, make_rl_batch, ppo_inputs  # noqa: E402


@pytest.mark.slow
def test_actor_worker_group_log_probs_update_and_export(ray_cluster, tmp_path):
    from hybridflow.controller import RayWorkerGroup, ResourcePool
    from hybridflow.models.tiny import save_tiny_model
    from hybridflow.protocol import DataProto
    from megatron_workers.actor_rollout_ref import ActorRolloutRefWorker

    model = save_tiny_model(tmp_path / "llama", preset="tiny", arch="llama")
    pool = ResourcePool("actor_test", [2], cpus_per_proc=0.5)
    group = RayWorkerGroup(pool, ActorRolloutRefWorker, kwargs={"config": actor_config(model), "role": "actor_ref"},
                           role="actor", timeout_s=300)
    try:
        group.init_model()
        assert [c.dp_rank for c in group.mesh("actor", "actor")] == [0, 1]
        batch = make_rl_batch(103, seed=0)
        old = group.compute_log_prob(DataProto.from_dict(batch, meta_info={"temperature": 1.0}))
        ref = group.compute_ref_log_prob(DataProto.from_dict(batch))
        assert old.batch["old_log_probs"].shape == batch["responses"].shape
        assert torch.equal(old.batch["old_log_probs"], ref.batch["ref_log_prob"])

        train = ppo_inputs(batch, old.batch["old_log_probs"], ref.batch["ref_log_prob"])
        metrics = group.update_actor(DataProto.from_dict(train, meta_info={"temperature": 1.0})).meta_info["metrics"]
        group.export_hf(str(tmp_path / "after"))

        expected = hf_ppo_update(model, {"old_log_probs": old.batch["old_log_probs"],
                                         "ref_log_prob": ref.batch["ref_log_prob"]})
        mask = expected["mask"].bool()
        assert (old.batch["old_log_probs"] - expected["log_prob"])[mask].abs().max() < 1e-5
        assert metrics["actor/grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-5)
        assert metrics["actor/pg_loss"] == pytest.approx(expected["pg_loss"], rel=1e-5)
        for key in ("actor/pg_clipfrac", "actor/ppo_kl", "actor/entropy", "actor/kl_loss", "actor/lr"):
            assert key in metrics
        after = hf_state(tmp_path / "after")
        assert max((after[k] - expected["params"][k]).abs().max().item() for k in after) < 1e-5
    finally:
        group.kill()
        pool.remove()
