"""Placements against colocate, end to end (real Ray, Megatron, vLLM, the tiny PPO job, same seed, 2 steps).

- trainer.placement=standalone (a pool per role, each of 2 processes, every role TP=2): bit-identical metrics.
- trainer.resource_pools of other sizes (actor TP2 on a 2-process pool, critic TP1 and ref TP1 on a 1-process
  pool each), run through `python -m launch.benchmark --warmup 1 --steps 1`: the same metrics within float
  tolerance, and the benchmark's own result checked against the run's metrics.jsonl (one run serves both).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import PLAIN_JOB, local_ray
from test_e2e_trainer import REPO, _cmd, _rows, _run

# conftest's plain job (8 prompts, one mini-batch, no saves) without its step count: launch.benchmark sets its own
SMALL_BATCH = tuple(x for x in PLAIN_JOB if not x.startswith("trainer.total_training_steps="))
COMPARED = ("critic/score/mean", "critic/values/mean", "critic/rewards/mean", "actor/reward_kl_penalty",
            "critic/advantages/mean", "critic/vf_loss", "actor/pg_loss")


@pytest.fixture(scope="module")
def assets(warm_assets):
    return warm_assets


def _job(assets) -> list[str]:
    return [f"actor_rollout_ref.model.path={assets['model']}", f"data.train_files=[{assets['train']}]", *SMALL_BATCH]


@pytest.fixture(scope="module")
def colocate(plain_run):
    """conftest's plain colocated run of PLAIN_JOB (the same job as _job's): (rows, console log)."""
    run, log = plain_run
    return _rows(run), log.read_text()


# Measured on this CPU: colocate and standalone give bit-identical metrics at both steps. Every role runs the
# same TP=2 layout in both placements, each rank with one OMP thread, and the rollout is seeded by
# (seed, call, replica), so the same floating-point operations run in the same order, only in other
# processes. The tolerance is therefore not a statistical allowance; it only absorbs last-bit
# reduction-order noise. Step 2 holds only because step 1 is exact: a last-bit change in step 1's
# advantages could flip one sampled token in step 2 and move its score by a whole character's reward.
# (GPU kernels are not bitwise deterministic in general; there, compare step 1 only.)
PLACEMENT_REL, PLACEMENT_ABS = 1e-6, 1e-9
# Pools of other sizes change the critic's and the ref's layout (TP1 instead of TP2): Megatron TP1 vs TP2 agree to
# ~5e-7 on losses (FACTS.md). Measured: scores, rewards and vf_loss equal, values within 6e-8, the KL, advantage and
# pg-loss means (~1e-8 at step 1, so only an absolute bound means anything there) within 1e-7.
POOLS_REL, POOLS_ABS = 1e-4, 1e-6


@pytest.mark.slow
def test_ppo_standalone_placement_matches_colocate(assets, colocate, tmp_path):
    run, log = tmp_path / "standalone", tmp_path / "standalone.log"
    _run(_cmd("ppo_tiny_cpu.yaml", run, *_job(assets), "trainer.total_training_steps=2",
              "trainer.placement=standalone"), log)
    assert "ref in pool 'ref' [2], critic in pool 'critic' [2]" in log.read_text()
    rows, (colo, colo_log) = _rows(run), colocate
    assert "ref in pool" not in colo_log and "(the ref in the actor's processes)" in colo_log
    assert [r["step"] for r in rows] == [1, 2]
    for a, b in zip(colo, rows, strict=True):
        for key in COMPARED:
            assert b[key] == pytest.approx(a[key], rel=PLACEMENT_REL, abs=PLACEMENT_ABS), (a["step"], key)
    # the KL is a real signal at step 2 (the actor moved, the ref in its own pool did not)
    assert rows[1]["actor/reward_kl_penalty"] > 1e-4


POOLS = ("trainer.resource_pools.train=[2]", "trainer.resource_pools.small=[1]", "trainer.resource_pools.refpool=[1]",
         "trainer.role_pools.actor_rollout=train", "trainer.role_pools.critic=small",
         "trainer.role_pools.ref=refpool", "critic.megatron.tensor_model_parallel_size=1",
         "actor_rollout_ref.ref.megatron.tensor_model_parallel_size=1")


@pytest.fixture(scope="module")
def pools_bench(assets, tmp_path_factory):
    """The pools job, 1 warm-up + 1 timed step, through the benchmark CLI: (result, stdout, metrics rows)."""
    out = tmp_path_factory.mktemp("pools")
    cmd = [sys.executable, "-m", "launch.benchmark", str(REPO / "configs" / "ppo_tiny_cpu.yaml"), *_job(assets),
           *POOLS, f"trainer.default_local_dir={out / 'run'}", "trainer.logger=[console,jsonl]",
           "trainer.ray.timeout_s=300", "trainer.ray.object_store_memory=268435456",
           f"trainer.ray.address={local_ray()}", "--warmup", "1", "--steps", "1", "--out", str(out / "result.json")]
    with open(out / "log", "w") as log, open(out / "stderr", "w") as err:
        proc = subprocess.run(cmd, stdout=log, stderr=err, timeout=600, cwd=REPO)
    assert proc.returncode == 0, (out / "stderr").read_text()[-4000:]
    stdout = (out / "log").read_text()  # the table, then the result as the last line
    return json.loads(stdout.strip().splitlines()[-1]), out, _rows(out / "run")


@pytest.mark.slow
def test_pools_of_other_sizes_match_colocate(pools_bench, colocate):
    result, out, rows = pools_bench
    log = (out / "stderr").read_text()
    assert ("actor_rollout in pool 'train' [2], ref in pool 'refpool' [1], critic in pool 'small' [1]" in log)
    assert [r["step"] for r in rows] == [1, 2]
    for a, b in zip(colocate[0], rows, strict=True):
        for key in COMPARED:
            assert b[key] == pytest.approx(a[key], rel=POOLS_REL, abs=POOLS_ABS), (a["step"], key)
    assert rows[1]["actor/reward_kl_penalty"] > 1e-4
    # verl's perf/throughput divides by every pool's processes: 2 + 1 + 1
    assert rows[1]["perf/throughput"] == pytest.approx(
        rows[1]["perf/total_num_tokens"] / (rows[1]["perf/time_per_step"] * 4))
    assert result["layout"]["roles"]["critic"] == {"pool": "small", "tp": 1, "pp": 1, "cp": 1, "dp": 1}


@pytest.mark.slow
def test_benchmark_result_is_the_runs_timed_step(pools_bench):
    result, out, rows = pools_bench
    timed = rows[1]  # --warmup 1: step 2 is the timed one
    stages, totals = result["stages"], result["totals"]
    # the trainer's own timers (independent of the benchmark's arithmetic) cover the step to within 5%
    raw = sum(v for k, v in timed.items() if k.startswith("timing_s/") and k != "timing_s/reshard")
    assert raw == pytest.approx(timed["perf/time_per_step"], rel=0.05)
    assert sum(e["mean_s"] for e in stages.values()) == pytest.approx(totals["step_mean_s"], rel=0.05)
    assert stages["transition"]["mean_s"] == timed["timing_s/reshard"]
    assert stages["gen"]["mean_s"] + stages["transition"]["mean_s"] == pytest.approx(timed["timing_s/gen"])
    assert {"gen", "transition", "reward", "ref", "values", "adv", "update_critic", "update_actor"} <= set(stages)
    assert "old_log_prob" not in stages  # one epoch over one mini-batch: the update's own forward is on-policy
    assert (stages["update_actor"]["devices"], stages["values"]["devices"], stages["ref"]["devices"]) == (2, 1, 1)
    assert stages["values"]["tokens_per_s_per_device"] == pytest.approx(
        timed["perf/total_num_tokens"] / timed["timing_s/values"])
    assert totals["throughput_per_device"] == timed["perf/throughput"]
    assert totals["aggregate_throughput"] == timed["perf/aggregate_throughput"]
    # the peak is this CPU's own matmul, measured in the run at the actor's GEMM shape and dtype
    source = result["peak_flops"]["source"]
    assert 0 < stages["update_actor"]["mfu"] < 1 and source.startswith("measured ") and "matmul [" in source, source
    assert set(result["peak_memory"]) == {"actor_rollout", "ref", "critic"}
    assert all(m["rss_peak_bytes"] > 100e6 for m in result["peak_memory"].values())
    assert result["versions"]["torch"] and result["git"]["commit"] and result["device"].startswith("CPU")
    assert json.loads((out / "result.json").read_text()) == result
    # --compare: the --out file beside the captured output of the same run
    proc = subprocess.run([sys.executable, "-m", "launch.benchmark", "--compare", str(out / "result.json"),
                           str(out / "log")], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].split() == ["result", "log"]
    step_row = next(x for x in lines if x.startswith("step s (mean)")).split()
    assert step_row[-2] == step_row[-1] == f"{totals['step_mean_s']:.3f}"
    assert any(x.startswith("  update_critic s") for x in lines)
