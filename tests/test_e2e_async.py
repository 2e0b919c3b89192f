"""The rollout on a pool of its own (asynchronous RL, #25) end to end: real Ray, a Megatron TP=2 actor on one pool,
two vLLM processes on another, the weights sent shard to shard over the cross-pool sync group, fp32.

- split sync (async_training.mode=sync, trainer.role_pools.rollout): the same processes layout for the rollout as
  the colocated run (two single-rank engines), the same weights after every sync, the same seeds, so the same
  samples and metrics as conftest's colocated PLAIN_JOB run (the yardstick), step for step; and every rollout
  rank received exactly its planned shard bytes;
- one_step_off_policy: the batch of step k is generated while step k-1 trains, by the weights of step k-1
  (step 1's by the initial weights): weight versions 1, 1, 2; the prompts are the plain run's, step for step;
- fully_async at staleness 0 (server mode, the producer thread): exactly the synchronous server-mode run on the same
  split pools (conftest's server_run), step for step: same prompts, same samples, same metrics;
- fully_async at staleness 1 with partial rollouts, a rollout worker SIGKILLed in the middle of a tick, under
  trainer.max_restarts=1: every step logged exactly once, every batch within one version of its step, the batches
  generated ahead regenerated after the restart (the data trace has each step once, in the sampler's order).
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from conftest import SERVER_JOB, SPLIT_POOLS
from test_e2e_trainer import REPO, _cmd, _rows, _run
from test_e2e_validation import COMPARED, TRAIN_ABS, TRAIN_REL

SPLIT = SPLIT_POOLS


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


def _timing_free(row: dict) -> dict:
    """A row without what depends on the clock, the process or the mode's own bookkeeping."""
    skip = ("timing_s/", "timing_per_token_ms/", "perf/", "rollout/server_", "weight_sync/", "rollout/gen_s",
            "actor/perf/", "critic/perf/",
            "reward/time_s", "rollout/engine_busy_frac", "rollout/aborted_requests", "rollout/weight_version",
            "rollout/interrupted", "rollout/staleness")
    return {k: v for k, v in row.items() if not k.startswith(skip)}


@pytest.mark.slow
def test_fully_async_at_staleness_0_is_the_synchronous_run_step_for_step(warm_assets, server_run, tmp_path):
    run = tmp_path / "run"
    _run(_cmd("ppo_tiny_cpu.yaml", run, f"actor_rollout_ref.model.path={warm_assets['model']}",
              f"data.train_files=[{warm_assets['train']}]", *SERVER_JOB, "async_training.mode=fully_async",
              f"data.val_files=[{warm_assets['test']}]", "trainer.val_before_train=true"), tmp_path / "log")
    sync = _rows(server_run / "run")
    rows = _rows(run)
    assert (run / "data_trace.jsonl").read_text() == (server_run / "run" / "data_trace.jsonl").read_text()
    assert [r["step"] for r in rows] == [r["step"] for r in sync] == [0, 1, 2]
    for a, b in zip(sync, rows, strict=True):
        a, b = _timing_free(a), _timing_free(b)
        assert set(a) == set(b), sorted(set(a) ^ set(b))
        assert b == a, {k: (a[k], b[k]) for k in a if a[k] != b[k]}  # exactly: same samples, same arithmetic
    for r in rows[1:]:  # and it says what it is: every token by the weights of its own step, nothing interrupted
        assert r["rollout/weight_version_min"] == r["rollout/weight_version_max"] == r["step"]
        assert r["rollout/staleness_max"] == 0 and r["rollout/interrupted_dropped"] == 0


@pytest.mark.slow
@pytest.mark.fault
def test_fully_async_survives_a_rollout_worker_killed_mid_tick_with_every_step_logged_once(warm_assets, tmp_path):
    run, steps = tmp_path / "run", 4
    cmd = _cmd("ppo_tiny_cpu.yaml", run, f"actor_rollout_ref.model.path={warm_assets['model']}",
               f"data.train_files=[{warm_assets['train']}]", *SERVER_JOB, "async_training.mode=fully_async",
               "async_training.staleness_threshold=1", "async_training.partial_rollout=true",
               f"trainer.total_training_steps={steps}", "trainer.save_freq=1", "trainer.max_restarts=1")
    # rank 0 of the rollout pool dies inside the first tick served by the weights of step 3
    env = {**os.environ, "HYBRIDFLOW_FAULT": "stage=serve_tick,role=rollout,rank=0,step=3",
           "HYBRIDFLOW_FAULT_STATE": str(tmp_path / "fault_state")}
    with open(tmp_path / "log", "w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=900, cwd=REPO, env=env)
    assert proc.returncode == 0, (tmp_path / "log").read_text()[-4000:]
    restarts = [json.loads(x) for x in (run / "restarts.jsonl").read_text().splitlines()]
    assert len(restarts) == 1 and restarts[0]["cause"]["error"] == "WorkerDiedError", restarts
    assert restarts[0]["cause"]["role"] == "rollout" and restarts[0]["resumed_from_step"] == 2
    rows = _rows(run)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))  # each step once: none lost, none twice
    for r in rows:  # within the bound: no token more than one version behind its step
        assert r["step"] - 1 <= r["rollout/weight_version_min"] <= r["rollout/weight_version_max"] <= r["step"]
        assert r["rollout/staleness_max"] <= 1
    trace = [json.loads(x) for x in (run / "data_trace.jsonl").read_text().splitlines()]
    assert [t["step"] for t in trace] == list(range(1, steps + 1))
    assert len({tuple(t["indices"]) for t in trace}) == steps  # batches 3 and 4 regenerated, not retrained
