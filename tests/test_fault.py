"""Fault injection on the real job (Ray driver, Megatron TP=2 actor+ref and critic on 2 processes, HF rollout).

One uninterrupted reference run (module fixture, 3 steps, a checkpoint every step, run beside the killed one) is
the yardstick for one killed run (module fixture, shared by four tests), launched with trainer.max_restarts=2:
- a worker SIGKILLed in update_actor on rank 1 at step 2 (inside gloo collectives with its peer): restart 1;
- the critic's rank 0 SIGKILLed inside its checkpoint save at step 3: restart 2;
- the driver SIGKILLed inside its own step-3 save (after the workers wrote, before the COMPLETE marker);
then relaunched as is. The other stages (gen, old_log_prob, ref, values, update_critic) fail through the same
path: a worker method whose actor died (hybridflow/controller/worker_group.py `_wait`). The run must end
with the reference's metrics (timings aside), data positions, and bit-identical weights and Adam state. It
carries fake credentials in its environment, and every file it wrote is grepped for them.
Kills come from hybridflow/controller/fault_inject.py (HYBRIDFLOW_FAULT): the process SIGKILLs itself.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_e2e_trainer import _cmd, _kill_tree, _rows

REPO = Path(__file__).resolve().parents[1]
STEPS = 3
SECRETS = {"HF_TOKEN": "hf_FAKEtoken1234567890abcdef", "WANDB_API_KEY": "fakewandbkey0123456789abcdef0123456789ab",
           "HUGGING_FACE_HUB_TOKEN": "hf_FAKEhubtoken0987654321", "AWS_SECRET_ACCESS_KEY": "FAKEawsSECRETkey/abc+123"}
NOT_COMPARED = ("timing_s/", "timing_per_token_ms/", "perf/", "reward/time_s", "rollout/gen_s_per_replica")


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from hybridflow.trainer.warmstart import prepare

    return prepare(tmp_path_factory.mktemp("assets"), sft_steps=2, train_size=256, test_size=16)


def _overrides(assets) -> list[str]:
    return [f"actor_rollout_ref.model.path={assets['model']}", f"data.train_files=[{assets['train']}]",
            "trainer.save_freq=1", "trainer.max_ckpt_to_keep=2", "data.train_batch_size=8",
            "actor_rollout_ref.actor.ppo_mini_batch_size=8", "critic.ppo_mini_batch_size=8",
            f"trainer.total_training_steps={STEPS}", "actor_rollout_ref.rollout.name=hf"]


def _launch(run: Path, log: Path, extra_env: dict, *overrides: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYBRIDFLOW_FAULT")}
    env.update(extra_env)
    with open(log, "w") as f:
        return subprocess.Popen(_cmd("ppo_tiny_cpu.yaml", run, *overrides), stdout=f, stderr=subprocess.STDOUT,
                                cwd=REPO, env=env, start_new_session=True)


def _finish(proc: subprocess.Popen, run: Path, log: Path, timeout: float = 600) -> int:
    try:
        return proc.wait(timeout=timeout)
    finally:
        _kill_tree(proc, str(run))  # whatever is left (Ray daemons of a killed driver) goes


@pytest.fixture(scope="module")
def reference_launch(assets, tmp_path_factory):
    """The reference run, started in the background: the killed run asks for it first, so it runs beside that
    run's deaths, detections and restarts (mostly waiting: ~25 s of the serial phase saved). Nothing of the
    killed run is timed tightly (detection within 60 s, measured 0.04 s); its own Ray and run dir are separate.
    Whatever of it is left at module end (a run nobody waited for, or its Ray daemons) is killed."""
    run = tmp_path_factory.mktemp("fault_ref") / "run"
    log = run.parent / "ref.log"
    proc = _launch(run, log, {}, *_overrides(assets))
    yield run, log, proc, time.perf_counter()
    _kill_tree(proc, str(run))  # as _finish does; harmless when the run has ended


@pytest.fixture(scope="module")
def reference(reference_launch):
    run, log, proc, t = reference_launch
    rc = _finish(proc, run, log)
    assert rc == 0, log.read_text()[-4000:]
    print(f"\nreference run ({STEPS} steps): {time.perf_counter() - t:.1f} s since its start")
    return run


def _final_state(run: Path) -> dict:
    """The last checkpoint's actor tensors (weights and Adam moments), read straight from dist_checkpointing's
    files by torch's own converter: an independent reader, loaded weights-only."""
    import megatron.core  # noqa: F401 - registers megatron's safe globals for the weights-only load
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = run.parent / f"{run.name}_final.pt"
    dcp_to_torch_save(str(run / "checkpoints" / f"global_step_{STEPS}" / "actor"), str(out))
    return {k: v for k, v in torch.load(out, weights_only=True).items() if isinstance(v, torch.Tensor)}


def _assert_same_run(run: Path, reference: Path) -> None:
    import torch

    got, want = _rows(run), _rows(reference)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1)), [r["step"] for r in got]  # no duplicated rows
    for a, b in zip(got, want, strict=True):
        diff = {k: (a.get(k), v) for k, v in b.items()
                if not k.startswith(NOT_COMPARED) and "/perf/" not in k and a.get(k) != v}  # <role>/perf/: timings
        assert not diff, f"step {b['step']}: {diff}"
    assert (run / "data_trace.jsonl").read_text() == (reference / "data_trace.jsonl").read_text()
    a, b = _final_state(run), _final_state(reference)
    assert sorted(a) == sorted(b) and any(k.startswith("optimizer.") for k in a)
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"final weights/optimizer state differ from the uninterrupted run: {different[:5]}"


def _fired(state: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(state.glob("fired_*"))]


FAULTS = ("stage=update_actor,rank=1,step=2;stage=save_checkpoint,role=critic,rank=0,step=3;"
          "stage=ckpt_before_marker,step=3")


@pytest.fixture(scope="module")
def killed_run(assets, reference_launch, tmp_path_factory):
    """Run 1 (max_restarts=2, fake credentials in its environment) loses a worker twice, then its driver kills
    itself inside the step-3 save; run 2 is the plain relaunch. What run 1 left is recorded before run 2."""
    from hybridflow.trainer.checkpoint import CheckpointManager

    root = tmp_path_factory.mktemp("fault_killed")
    run, state = root / "run", root / "faults"
    out = {"run": run, "logs": [root / "first.log", root / "second.log"]}
    t = time.perf_counter()
    proc = _launch(run, out["logs"][0], {"HYBRIDFLOW_FAULT": FAULTS, "HYBRIDFLOW_FAULT_STATE": str(state), **SECRETS},
                   *_overrides(assets), "trainer.max_restarts=2", "trainer.fault.detect_timeout_s=60")
    out["first_rc"], out["first_s"] = _finish(proc, run, out["logs"][0]), time.perf_counter() - t
    out["fired"] = _fired(state)
    partial = run / "checkpoints" / ".tmp_global_step_3"
    out["partial"] = {"actor": (partial / "actor").is_dir(), "critic": (partial / "critic").is_dir(),
                      "state": (partial / "trainer_state.json").is_file(), "marker": (partial / "COMPLETE").exists()}
    found = CheckpointManager(run / "checkpoints").latest()
    out["latest_before_relaunch"] = found[0] if found else None
    relaunch = time.time()
    t = time.perf_counter()
    out["second_rc"] = _finish(_launch(run, out["logs"][1], SECRETS, *_overrides(assets)), run, out["logs"][1])
    out["second_s"], out["relaunch"], out["partial_after"] = time.perf_counter() - t, relaunch, partial.exists()
    print(f"\nkilled run: first launch {out['first_s']:.1f} s (2 worker deaths, then the driver's), relaunch "
          f"{out['second_s']:.1f} s")
    return out


@pytest.mark.fault
@pytest.mark.slow
def test_worker_deaths_are_detected_named_and_restarted(killed_run):
    run, log = killed_run["run"], killed_run["logs"][0]
    text = log.read_text()
    restarts = [json.loads(x) for x in (run / "restarts.jsonl").read_text().splitlines()]
    fired = killed_run["fired"]
    assert len(fired) == 3 and len(restarts) == 2, (fired, restarts, text[-3000:])
    expect = [("actor_rollout_ref", 1, "update_actor", 2, 1), ("critic", 0, "save_checkpoint", 3, 2)]
    for rec, kill, (role, rank, stage, failed, resumed) in zip(restarts, fired[:2], expect, strict=True):
        c = rec["cause"]
        assert (c["role"], c["rank"], c["stage"], rec["failed_step"], rec["resumed_from_step"]) == \
            (role, rank, stage, failed, resumed), rec
        detect = rec["detected_at"] - kill["time"]
        print(f"\n  {role} rank {rank} killed in {stage} at step {failed}: detected in {detect:.2f} s, every group "
              f"rebuilt and resumed from step {resumed} in {rec['recovery_s']:.1f} s")
        assert 0 <= detect <= 60, detect
    assert "restart 1: worker 'actor_rollout_ref' rank 1 died in stage update_actor at step 2" in text
    assert "restart 2: resumed from step 2" in text


@pytest.mark.fault
@pytest.mark.slow
def test_driver_killed_inside_a_save_resumes_on_relaunch(killed_run):
    assert killed_run["first_rc"] == -9, killed_run["logs"][0].read_text()[-3000:]  # the driver's SIGKILL
    # Both workers' shards of step 3 were written, the marker was not: the partial save is never picked.
    assert killed_run["partial"] == {"actor": True, "critic": True, "state": True, "marker": False}
    assert killed_run["latest_before_relaunch"] == 2
    assert killed_run["second_rc"] == 0, killed_run["logs"][1].read_text()[-4000:]
    text = killed_run["logs"][1].read_text()
    m = re.search(r"^(\S+ \S+) INFO hybridflow.trainer.ppo_trainer: resumed from \S+global_step_2 at step 2", text,
                  re.M)
    assert m, text[-3000:]
    from datetime import datetime

    resumed = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
    print(f"\ndriver killed in a save: the relaunch resumed from step 2 {resumed - killed_run['relaunch']:.1f} s "
          "after it started")
    assert not killed_run["partial_after"]  # the relaunch's first save cleared the partial one


@pytest.mark.fault
@pytest.mark.slow
def test_killed_run_ends_exactly_as_the_uninterrupted_one(killed_run, reference, assets):
    _assert_same_run(killed_run["run"], reference)
    # and the data positions are an uninterrupted sampler's (an independent reference, not another run)
    import pyarrow.parquet as pq

    from hybridflow.data.sampler import ResumableSampler

    sampler = ResumableSampler(pq.read_metadata(assets["train"]).num_rows, 8, seed=1, shuffle=True)
    expected = [sampler.next_batch() for _ in range(STEPS)]
    trace = [json.loads(x) for x in (killed_run["run"] / "data_trace.jsonl").read_text().splitlines()]
    assert [t["step"] for t in trace] == list(range(1, STEPS + 1))
    assert [t["indices"] for t in trace] == expected


@pytest.mark.fault
@pytest.mark.slow
def test_no_credential_reaches_any_file_of_the_run(killed_run):
    """Logs, metrics, the saved config, checkpoints, restarts.jsonl and Ray's session logs under the run."""
    leaks, files = [], 0
    for path in [*killed_run["logs"], *killed_run["run"].rglob("*")]:
        if path.is_file() and not path.is_symlink():
            files += 1
            data = path.read_bytes()
            leaks += [f"{path}: {k}" for k, v in SECRETS.items() if v.encode() in data]
    assert files > 20 and not leaks, leaks


@pytest.mark.fault
def test_a_save_killed_at_each_point_leaves_the_previous_checkpoint_loadable(tmp_path):
    """The trainer's commit protocol under a real kill (the saving process SIGKILLs itself) at each named
    point; what it commits is a real safetensors file, checked by loading it."""
    from safetensors.numpy import load_file

    from hybridflow.trainer.checkpoint import CheckpointManager

    child = (
        "import sys, numpy as np\n"
        "from safetensors.numpy import save_file\n"
        "from hybridflow.trainer.checkpoint import CheckpointManager\n"
        "m = CheckpointManager(sys.argv[1], keep=1)\n"
        "for step in (1, 2):\n"
        "    staging = m.staging_dir(step)\n"
        "    (staging / 'actor').mkdir()\n"
        "    save_file({'w': np.full((64, 64), step, np.float32)}, str(staging / 'actor' / 'model.safetensors'))\n"
        "    m.commit(step, staging, {'global_step': step})\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    for point, newest in (("ckpt_before_state", 1), ("ckpt_before_marker", 1), ("ckpt_before_rename", 1),
                          ("ckpt_before_prune", 2)):
        root = tmp_path / point
        proc = subprocess.run([sys.executable, "-c", child, str(root)], capture_output=True, text=True, timeout=120,
                              env={**env, "HYBRIDFLOW_FAULT": f"stage={point},step=2"})
        assert proc.returncode == -9, (point, proc.stderr[-2000:])
        step, path = CheckpointManager(root).latest()
        assert step == newest, point  # a partial save is never picked; a renamed one is complete
        assert CheckpointManager.trainer_state(path)["global_step"] == step
        assert (load_file(str(path / "actor" / "model.safetensors"))["w"] == step).all()
        if newest == 1:
            assert (root / ".tmp_global_step_2").is_dir()  # the partial one is still there, unpicked
            CheckpointManager(root).staging_dir(3)  # and the next save clears it
            assert not (root / ".tmp_global_step_2").exists()
