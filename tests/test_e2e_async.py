"""The rollout on a pool of its own (asynchronous RL, #25) end to end: real Ray, a Megatron TP=2 actor on one pool,
two vLLM processes on another, the weights sent shard to shard over the cross-pool sync group, fp32.

- split sync (async_training.mode=sync, trainer.role_pools.rollout): the same processes layout for the rollout as
  the colocated run (two single-rank engines), the same weights after every sync, the same seeds, so the same
  samples and metrics as conftest's colocated PLAIN_JOB run (the yardstick), step for step; and every rollout
  rank received exactly its planned shard bytes;
- one_step_off_policy: the batch of step k is generated while step k-1 trains, by the weights of step k-1
  (step 1's by the initial weights): weight versions 1, 1, 2; the prompts are the plain run's, step for step.
"""

from __future__ import annotations

import pytest
from test_e2e_trainer import _cmd, _rows, _run
from test_e2e_validation import COMPARED, TRAIN_ABS, TRAIN_REL

SPLIT = ("trainer.resource_pools.actor=[2]", "trainer.resource_pools.rollout=[2]",
         "trainer.role_pools.actor_rollout=actor", "trainer.role_pools.ref=actor", "trainer.role_pools.critic=actor",
         "trainer.role_pools.rollout=rollout")


def _split_run(warm_assets, root, *extra):
    from conftest import PLAIN_JOB

    _run(_cmd("ppo_tiny_cpu.yaml", root / "run", f"actor_rollout_ref.model.path={warm_assets['model']}",
              f"data.train_files=[{warm_assets['train']}]", *PLAIN_JOB, *SPLIT, *extra), root / "log")
    return root / "run"


@pytest.mark.slow
def test_split_sync_matches_the_colocated_run_step_for_step(warm_assets, plain_run, tmp_path):
    run = _split_run(warm_assets, tmp_path)
    assert (run / "data_trace.jsonl").read_text() == (plain_run[0] / "data_trace.jsonl").read_text()
    split, plain = _rows(run), _rows(plain_run[0])
    assert [r["step"] for r in split] == [r["step"] for r in plain] == [1, 2]
    for a, b in zip(plain, split, strict=True):
        for key in COMPARED:
            assert b[key] == pytest.approx(a[key], rel=TRAIN_REL, abs=TRAIN_ABS), (a["step"], key)
        # shard to shard: each rollout rank (t_g=1) received exactly the model, as planned
        assert b["weight_sync/bytes_recv_per_rank"] == b["weight_sync/expected_bytes_per_rank"] > 0
        assert b["rollout/weight_version"] == b["step"]  # synchronous: the weights of the step before


@pytest.mark.slow
def test_one_step_off_policy_generates_the_next_batch_with_the_weights_one_step_behind(warm_assets, plain_run,
                                                                                      tmp_path):
    run = _split_run(warm_assets, tmp_path, "async_training.mode=one_step_off_policy",
                     "trainer.total_training_steps=3")
    rows = _rows(run)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["rollout/weight_version"] for r in rows] == [1, 1, 2]
    plain_trace = (plain_run[0] / "data_trace.jsonl").read_text().splitlines()
    assert (run / "data_trace.jsonl").read_text().splitlines()[:2] == plain_trace  # same prompts per step
    for r in rows:
        assert r["weight_sync/bytes_recv_per_rank"] == r["weight_sync/expected_bytes_per_rank"] > 0
    # step 1's samples are the synchronous run's (same weights, same seeds); from step 2 they are one step stale
    for key in ("critic/score/mean", "response_length/mean"):
        assert rows[0][key] == pytest.approx(_rows(plain_run[0])[0][key], rel=TRAIN_REL, abs=TRAIN_ABS), key
