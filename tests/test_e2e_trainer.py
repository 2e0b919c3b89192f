"""End-to-end runs of the real job (Ray driver, Megatron TP=2 workers, vLLM rollout, critic) on the tiny model.

- PPO: the shared observed run's metrics file (tests/observed_run.py) has every metric verl users read, and
  its curves plot. Kills and resumes are tested in test_fault.py.
- GRPO (no critic) trains on a parquet file laid out exactly as verl's GSM8K preprocessing writes it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from conftest import local_ray
from test_data import write_verl_gsm8k

REPO = Path(__file__).resolve().parents[1]

REQUIRED = [
    "timing_s/gen", "timing_s/reward", "timing_s/ref", "timing_s/values", "timing_s/adv",
    "timing_s/update_critic", "timing_s/update_actor", "timing_s/reshard",
    "timing_per_token_ms/gen", "timing_per_token_ms/update_actor",
    "perf/throughput", "perf/total_num_tokens", "perf/time_per_step", "perf/mfu/actor",
    "perf/aggregate_throughput", "perf/transition_s",
    "critic/score/mean", "critic/advantages/mean", "critic/advantages/max", "critic/advantages/min",
    "critic/values/mean", "critic/vf_loss",
    "actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/entropy",
    "response_length/mean", "response_length/max", "response_length/clip_ratio",
    "rollout/logprob_diff_mean",
    *(f"perf/padding_fraction/{stage}" for stage in ("ref", "values", "update_critic", "update_actor")),
]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from hybridflow.trainer.warmstart import prepare

    return prepare(tmp_path_factory.mktemp("assets"), sft_steps=2, train_size=256, test_size=16)


# The demo configs validate on runs/demo_assets' held-out file; tests bring their own assets, so they start
# from the schema's validation defaults (none, greedy) and a test that validates says so itself.
NO_DEMO_VALIDATION = ("data.val_files=[]", "trainer.val_before_train=false", "trainer.test_freq=-1",
                      "actor_rollout_ref.rollout.val_kwargs.do_sample=false",
                      "actor_rollout_ref.rollout.val_kwargs.temperature=0.0",
                      "actor_rollout_ref.rollout.val_kwargs.n=1")


def _cmd(cfg: str, run_dir: Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "hybridflow.trainer.main", "--config", str(REPO / "configs" / cfg),
            f"trainer.default_local_dir={run_dir}", "trainer.logger=[console,jsonl]", "trainer.ray.timeout_s=300",
            "trainer.ray.object_store_memory=268435456", *NO_DEMO_VALIDATION, *overrides]


def _kill_tree(proc: subprocess.Popen, marker: str) -> None:
    # Every descendant, taken before the kill: a SIGKILLed worker's multiprocessing children (resource tracker,
    # spawn workers) carry neither the process group nor the marker, and would idle on, orphaned, otherwise.
    try:
        tree = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        tree = []
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=60)
    for p in [*tree, *psutil.process_iter(["cmdline"])]:  # + Ray daemons that left the process group
        try:
            if p in tree or any(marker in a for a in p.cmdline() or []):
                p.kill()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass


def _run(cmd: list[str], log: Path, timeout: float = 600) -> None:
    """Runs a trainer command (_cmd) on this pytest process's local Ray (conftest.local_ray), asserting it passed.
    The driver, like the run's Ray workers, is a fork of the zygote that local_ray started (tests/ray_zygote.py),
    which skips its interpreter start-up and ~5 s of imports (torch, transformers); it imports ray itself."""
    cmd = [*cmd, f"trainer.ray.address={local_ray()}"]
    sock = os.environ.get("HYBRIDFLOW_TEST_RAY_ZYGOTE")  # ray_zygote.SOCKET_ENV, set by local_ray's start()
    if sock and cmd[0] == sys.executable:
        cmd = [sys.executable, str(REPO / "tests" / "ray_zygote.py"), "--client", sock, *cmd[1:]]
    with open(log, "w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout, cwd=REPO)
    assert proc.returncode == 0, log.read_text()[-4000:]


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_a_run_reports_every_metric_verl_users_read_and_plots_its_curves(observed_run):
    # Resuming after a kill is tested in test_fault.py (worker, critic-save and driver kills, then a relaunch,
    # against an uninterrupted run and an independent sampler); this is the shared tiny run's last row.
    rows = observed_run["rows"]
    missing = [k for k in REQUIRED if k not in rows[-1]]
    assert not missing, f"metrics.jsonl lacks {missing}"
    assert (observed_run["run_dir"] / "curves.png").stat().st_size > 5000
    # Its run dir is too deep for Ray's socket paths, so its local Ray ran under a short /tmp stand-in, which the
    # driver removes once the cluster is down (hybridflow/controller/ray_env.py)
    from hybridflow.controller.ray_env import ray_temp_dir

    stand_in = ray_temp_dir(observed_run["run_dir"])
    assert stand_in.parent == Path("/tmp") and not stand_in.exists(), stand_in


@pytest.mark.slow
def test_grpo_trains_on_a_verl_layout_gsm8k_parquet(assets, tmp_path):
    data = tmp_path / "gsm8k_train.parquet"
    write_verl_gsm8k(data)
    run = tmp_path / "grpo"
    _run(_cmd("grpo_tiny_cpu.yaml", run, f"actor_rollout_ref.model.path={assets['model']}",
              f"data.train_files=[{data}]", "data.max_prompt_length=320", "data.train_batch_size=2",
              "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.rollout.n=2",
              "trainer.total_training_steps=2", "trainer.save_freq=-1"), tmp_path / "grpo.log")
    rows = _rows(run)
    assert [r["step"] for r in rows] == [1, 2]
    for k in ("critic/score/mean", "actor/pg_loss", "actor/kl_loss", "perf/throughput", "timing_s/gen"):
        assert k in rows[-1], k
    assert "critic/values/mean" not in rows[-1]  # GRPO runs without a critic
    assert rows[-1]["prompt_length/mean"] > 150  # the real GSM8K prompts went through the chat template
