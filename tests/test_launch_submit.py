"""The trainer as a `ray job submit` job (launch.submit) on a simulated 2-node cluster with its dashboard.

One cluster for the module. A 2-step tiny PPO (HF rollout, Megatron TP=2 over one rank per node) succeeds with
its workers on both nodes, a second one stopped after its first step ends STOPPED with nothing left on the
cluster within 30 s, and bad input (an unreachable dashboard, a bad config key) fails fast and says why.
"""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_e2e_trainer import NO_DEMO_VALIDATION, _rows, assets  # noqa: F401 - assets is a fixture

from hybridflow.controller.worker import free_port
from hybridflow.trainer.tracking import StepLines
from launch import submit as S
from launch.sim_cluster import SimCluster

REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- pure parts (no cluster)
def test_entrypoint_joins_the_cluster_with_this_venv():
    ep = S.build_entrypoint(["--config", "c.yaml", "trainer.nnodes=2"], python=".venv/bin/python")
    # Absolute but not resolved: a venv's python is a symlink to the base interpreter, which would leave the venv.
    assert ep == (f"exec {os.path.abspath('.venv/bin/python')} -m hybridflow.trainer.main --config c.yaml "
                  "trainer.nnodes=2 trainer.ray.address=auto")
    assert "trainer.ray.address=auto" not in S.build_entrypoint(["trainer.ray.address=10.0.0.1:6379"])
    assert S.build_entrypoint(["data.train_files=[a b]"]).split(" -m ")[1] == \
        "hybridflow.trainer.main 'data.train_files=[a b]' trainer.ray.address=auto"  # quoted for the shell


def test_runtime_env_uploads_the_code_without_outputs_and_venv(tmp_path):
    renv = S.build_runtime_env(str(tmp_path), S.parse_env(["A=1", "RAY_USAGE_STATS_ENABLED=1", "B=x=y"]))
    assert renv["working_dir"] == str(tmp_path)
    assert {"runs/", ".venv/", ".git/", "__pycache__/"} <= set(renv["excludes"])
    assert renv["env_vars"] == {**S.BASE_ENV, "A": "1", "RAY_USAGE_STATS_ENABLED": "1", "B": "x=y"}
    assert "working_dir" not in S.build_runtime_env(None)


@pytest.mark.bad_input
def test_bad_helper_input_names_it(tmp_path):
    with pytest.raises(S.SubmitError, match="--env 'NOEQUALS'"):
        S.parse_env(["NOEQUALS"])
    with pytest.raises(S.SubmitError, match="--working-dir .*not a directory"):
        S.build_runtime_env(str(tmp_path / "missing"))
    with pytest.raises(S.SubmitError, match="expected http://HOST:PORT"):
        S.check_reachable("ftp://head:8265")


@pytest.mark.bad_input
def test_several_nodes_need_a_cluster_address():
    from hybridflow.config.load import load_config
    from hybridflow.trainer.main import validate_cluster

    with pytest.raises(ValueError, match=r"trainer.nnodes=2 needs a multi-node Ray cluster: set trainer.ray.address"):
        validate_cluster(load_config(None, ["trainer.nnodes=2"]))
    validate_cluster(load_config(None, ["trainer.nnodes=2", "trainer.ray.address=auto"]))  # joining: fine


@pytest.mark.bad_input
def test_a_cluster_address_where_nothing_answers_is_named_at_once():
    # ray.init would retry such an address for minutes; the check fails before anything starts.
    import socket
    import time

    from hybridflow.config.load import load_config
    from hybridflow.trainer.main import validate_cluster

    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        port = listening.getsockname()[1]
        validate_cluster(load_config(None, [f"trainer.ray.address=127.0.0.1:{port}"]))  # it answers: fine
    start = time.monotonic()
    address = f"127.0.0.1:{port}"
    with pytest.raises(ValueError, match=rf"trainer.ray.address='{address}': nothing answers at {address}"):
        validate_cluster(load_config(None, [f"trainer.ray.address={address}"]))
    assert time.monotonic() - start < 5
    with pytest.raises(ValueError, match=r"trainer.ray.address='headnode': expected auto or host:port"):
        validate_cluster(load_config(None, ["trainer.ray.address=headnode"]))


def test_progress_without_a_terminal_is_one_line_per_step():
    out = io.StringIO()
    bar = StepLines("demo", total=3, initial=1, stream=out)
    bar.set_postfix({"reward": "0.5"})
    bar.update(1)
    bar.update(1)
    assert out.getvalue().splitlines() == ["demo step 2/3 reward=0.5", "demo step 3/3 reward=0.5"]


# ---------------------------------------------------------------- on the simulated cluster
@pytest.fixture(scope="module")
def cluster():
    from ray.util.state import list_nodes

    mp = pytest.MonkeyPatch()
    c = SimCluster(2, free_port(), cpus_per_node=4, object_store_bytes=256 * 1024**2, include_dashboard=True)
    for k in ("RAY_AUTH_MODE", "RAY_USAGE_STATS_ENABLED"):  # this process's client talks to it like its nodes
        mp.setenv(k, c.env[k])
    try:
        c.start()
        deadline = time.monotonic() + 180
        while len([n for n in list_nodes(address=c.dashboard_url) if n.state == "ALIVE"]) < 2:
            assert time.monotonic() < deadline, "the second node did not join within 180 s"
            time.sleep(1)
        yield c
    finally:
        c.stop()
        mp.undo()


def _trainer_args(run_dir: Path, made: dict, *extra: str) -> list[str]:
    # Every path absolute: the job runs in Ray's unpacked copy of the working dir.
    return ["--config", str(REPO / "configs" / "ppo_tiny_cpu.yaml"), f"trainer.default_local_dir={run_dir}",
            "trainer.logger=[console,jsonl]", "trainer.ray.timeout_s=300", *NO_DEMO_VALIDATION,
            f"actor_rollout_ref.model.path={made['model']}", f"data.train_files=[{made['train']}]",
            "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
            "critic.ppo_mini_batch_size=8", "actor_rollout_ref.rollout.name=hf", "trainer.save_freq=-1",
            # One rank per node: Megatron's TP=2 group and every worker group span both nodes.
            "trainer.nnodes=2", "trainer.n_gpus_per_node=1", *extra]


def _helper(cluster: SimCluster, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = dict(cluster.env, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "launch.submit", *args], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


def _job_of(stdout: str) -> str:
    m = re.search(r"submitted job (\S+)", stdout)
    assert m, stdout[-3000:]
    return m.group(1)


def _left_on_cluster(url: str, ray_job_id: str) -> tuple[list, list]:
    from ray.util.state import list_actors, list_placement_groups

    actors = [a for a in list_actors(address=url, filters=[("job_id", "=", ray_job_id)], detail=True, limit=1000)
              if a.state != "DEAD"]
    pgs = [p for p in list_placement_groups(address=url, detail=True, limit=1000)
           if p.creator_job_id == ray_job_id and p.state != "REMOVED"]
    return actors, pgs


@pytest.mark.cluster
@pytest.mark.slow
def test_submitted_job_trains_on_both_nodes(cluster, assets, tmp_path):  # noqa: F811 - assets is the fixture
    from ray.job_submission import JobSubmissionClient
    from ray.util.state import list_actors, list_nodes

    run = tmp_path / "ppo"
    t0 = time.monotonic()
    proc = _helper(cluster, "--address", cluster.dashboard_url, "--working-dir", str(REPO), "--",
                   *_trainer_args(run, assets, "trainer.total_training_steps=2"))
    wall = time.monotonic() - t0
    out = proc.stdout
    assert proc.returncode == 0, f"{out[-5000:]}\n{proc.stderr[-2000:]}"
    job = _job_of(out)
    print(f"submit -> SUCCEEDED: {wall:.1f} s")
    assert f"job {job} SUCCEEDED" in out
    # The job's own logs (through the dashboard, as `ray job logs` shows them) carry progress and summary.
    logs = JobSubmissionClient(cluster.dashboard_url).get_job_logs(job)
    for text in (out, logs):
        assert "Run summary (2 steps)" in text and "critic/score/mean" in text
        # One plain line per step, not a carriage-return bar (str.splitlines would split at \r too).
        steps = [line for line in text.split("\n") if "demo step" in line]
        assert [line.split(" reward=")[0] for line in steps] == ["demo step 1/2", "demo step 2/2"], steps
    assert [r["step"] for r in _rows(run)] == [1, 2]

    # Where the workers ran, from Ray's own records of the job's (now dead) actors.
    ray_job = JobSubmissionClient(cluster.dashboard_url).get_job_info(job).job_id
    hosts = [a for a in list_actors(address=cluster.dashboard_url, filters=[("job_id", "=", ray_job)], detail=True)
             if a.class_name == "WorkerHost"]
    nodes = sorted(n.node_id for n in list_nodes(address=cluster.dashboard_url))
    per_node = {n: sum(1 for a in hosts if a.node_id == n) for n in nodes}
    # Two groups (actor+rollout+ref, critic) of one rank per node: two worker processes on each node.
    assert per_node == {n: 2 for n in nodes}, per_node
    assert _left_on_cluster(cluster.dashboard_url, ray_job) == ([], [])


@pytest.mark.cluster
@pytest.mark.slow
def test_stopped_job_leaves_nothing_behind(cluster, assets, tmp_path):  # noqa: F811
    from ray.job_submission import JobStatus

    run = tmp_path / "ppo_stop"
    client = S.connect(cluster.dashboard_url)
    job = S.submit(client, S.build_entrypoint(_trainer_args(run, assets, "trainer.total_training_steps=50")),
                   S.build_runtime_env(str(REPO)))
    metrics = run / "metrics.jsonl"
    deadline = time.monotonic() + 480
    while not (metrics.is_file() and metrics.read_text().strip()):
        status = client.get_job_status(job)
        assert not status.is_terminal(), f"job ended {status} before its first step:\n{client.get_job_logs(job)}"
        assert time.monotonic() < deadline, "no step row within 480 s"
        time.sleep(0.5)
    ray_job = client.get_job_info(job).job_id
    actors, pgs = _left_on_cluster(cluster.dashboard_url, ray_job)
    assert actors and pgs  # the run was live when stopped

    t0 = time.monotonic()
    client.stop_job(job)
    assert S.wait_done(client, job, 30) == JobStatus.STOPPED
    t_status = time.monotonic() - t0
    while any(_left_on_cluster(cluster.dashboard_url, ray_job)):
        assert time.monotonic() - t0 < 30, f"left on the cluster 30 s after the stop: " \
                                           f"{_left_on_cluster(cluster.dashboard_url, ray_job)}"
        time.sleep(0.5)
    t_clean = time.monotonic() - t0
    print(f"stop -> STOPPED: {t_status:.1f} s; no actor or placement group left: {t_clean:.1f} s")
    assert len(_rows(run)) < 50
    # The driver's SIGTERM handler ran to its end (after a SIGKILL, Ray's cleanup alone would have done it).
    logs = client.get_job_logs(job)
    assert "received SIGTERM" in logs and "exiting with 143" in logs, logs[-3000:]


@pytest.mark.bad_input
@pytest.mark.parametrize("address", ["closed_port", "http://192.0.2.1:8265"])  # RFC 5737: never routed
def test_unreachable_dashboard_fails_fast_naming_it(address):
    if address == "closed_port":
        address = f"http://127.0.0.2:{free_port()}"
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "launch.submit", "--address", address, "--", "trainer.nnodes=1"],
                          cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True, text=True,
                          timeout=60)
    took = time.monotonic() - t0
    assert proc.returncode != 0
    assert f"cannot reach the Ray dashboard at {address}" in proc.stderr, proc.stderr[-2000:]
    assert took <= 30, f"{took:.1f} s"


@pytest.mark.cluster
@pytest.mark.bad_input
def test_config_error_fails_the_job_and_the_helper_says_why(cluster, tmp_path):
    proc = _helper(cluster, "--address", cluster.dashboard_url, "--working-dir", str(REPO), "--",
                   "--config", str(REPO / "configs" / "ppo_tiny_cpu.yaml"), "trainer.no_such_key=1", timeout=300)
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert "config error" in proc.stdout and "no_such_key" in proc.stdout, proc.stdout[-3000:]
    assert f"job {_job_of(proc.stdout)} FAILED" in proc.stdout
