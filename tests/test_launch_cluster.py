"""launch.cluster on a real 2-node Ray cluster on loopback: head/worker/status/stop, `up`/`down` through a fake
`ssh`, and the SLURM batch script through fake `scontrol`/`srun`. The fakes run the command on this machine
and record their arguments; node 0 binds 127.0.0.2 and node 1 127.0.0.3 (Ray accepts a second loopback
address as a second node). Token auth stays on, with a token file per test (RAY_AUTH_TOKEN_PATH under tmp).
Every test checks by pid that nothing it started is left running.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from hybridflow.controller.worker import free_port
from launch.cluster import node

REPO = Path(__file__).resolve().parents[1]
DRIVER = REPO / "tests" / "launch_cluster_driver.py"
HEAD_IP, WORKER_IP = "127.0.0.2", "127.0.0.3"



def _env(tmp: Path) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(REPO), RAY_AUTH_TOKEN_PATH=str(tmp / "auth_token"),
               HYBRIDFLOW_CLUSTER_STATE_DIR=str(tmp / "state"), RAY_USAGE_STATS_ENABLED="0")
    for k in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"):
        env.pop(k, None)
    return env


def _ray_args() -> str:
    # Ports Ray would otherwise take by default (10001, 52365) are shared by every cluster on this machine.
    return (f"--object-store-memory=200000000 --ray-client-server-port={free_port()} "
            f"--dashboard-agent-listen-port={free_port()}")


def _cli(env, *args, timeout=240, stdin=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launch.cluster", *args], env=env, capture_output=True, text=True,
                          timeout=timeout, input=stdin, cwd=REPO)


def _ok(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, (f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\n"
                                  f"stderr:\n{proc.stderr[-3000:]}")
    return proc.stdout


def _node_pids(state: Path) -> set[tuple[int, float]]:
    """(pid, create time) of every process of every node the tool recorded in this state dir."""
    return {(p.pid, p.create_time()) for rec in node.read_records(node.state_dir(state))
            for p in node.node_processes(rec)}


def _alive(pids) -> list[int]:
    out = []
    for pid, created in pids:
        try:
            p = psutil.Process(pid)
            if abs(p.create_time() - created) < 1.0 and p.status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def _naming(temp_dirs) -> list[int]:
    out = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if p.status() != psutil.STATUS_ZOMBIE and any(t + "/" in a or a.endswith(t) for a in p.info["cmdline"] or []
                                                          for t in temp_dirs):
                out.append(p.pid)
        except psutil.NoSuchProcess:
            pass
    return out


def _naming_address(address: str) -> list[int]:
    """Processes (not zombies) with the cluster's address on their command line: workers, waits, drivers."""
    out = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if p.status() != psutil.STATUS_ZOMBIE and any(address in a for a in p.info["cmdline"] or []):
                out.append(p.pid)
        except psutil.NoSuchProcess:
            pass
    return out


def _temp_dirs(port: int) -> list[str]:
    return [node.NodeSpec("head", HEAD_IP, port=port).resolved_temp_dir(),
            node.NodeSpec("worker", WORKER_IP, head_address=f"{HEAD_IP}:{port}").resolved_temp_dir()]


def _assert_all_gone(pids, temp_dirs, state: Path, timeout_s=20) -> None:
    deadline = time.monotonic() + timeout_s
    while (_alive(pids) or _naming(temp_dirs)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _alive(pids), f"left running: {_alive(pids)}"
    assert not _naming(temp_dirs), f"processes still name {temp_dirs}: {_naming(temp_dirs)}"
    assert not node.read_records(node.state_dir(state)), "pid files left behind"
    for t in temp_dirs:  # Ray's session logs: kept for users, removed in tests so that /tmp does not fill up
        shutil.rmtree(t, ignore_errors=True)


def _emergency_stop(env) -> None:
    subprocess.run([sys.executable, "-m", "launch.cluster", "stop"], env=env, capture_output=True, timeout=120)


def _result(stdout: str) -> dict:
    lines = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, f"driver printed no RESULT:\n{stdout[-3000:]}"
    return json.loads(lines[-1][len("RESULT "):])


def _check_two_nodes(res: dict) -> None:
    """One task pinned to each node: each ran where it was sent, on two different nodes with our two addresses."""
    ids = [t[0] for t in res["tasks"]]
    assert ids == res["targets"] and len(set(ids)) == 2
    assert sorted(t[1] for t in res["tasks"]) == [HEAD_IP, WORKER_IP]


# ---- pure parts ---------------------------------------------------------------------------------------------


def test_ray_start_args_bind_the_given_address():
    head = node.NodeSpec("head", "10.0.0.1", port=6380, ray_args=["--resources={\"a\": 1}"])
    args = node.ray_start_args(head, "/tmp/t")
    assert args[:3] == ["--block", "--node-ip-address", "10.0.0.1"] and "--head" in args and "--port=6380" in args
    assert "--dashboard-host=10.0.0.1" in args and "--dashboard-port=8265" in args  # the node's address by default
    assert not any("0.0.0.0" in a for a in args) and args[-1] == "--resources={\"a\": 1}"
    assert "--include-dashboard=false" in node.ray_start_args(node.NodeSpec("head", "10.0.0.1", dashboard=False), "/t")
    worker = node.ray_start_args(node.NodeSpec("worker", "10.0.0.2", head_address="10.0.0.1:6380", num_gpus=8), "/t")
    assert "--address=10.0.0.1:6380" in worker and "--head" not in worker and "--num-gpus=8" in worker
    assert not any(a.startswith("--dashboard") for a in worker)


def test_ssh_command_line_and_temp_dir_matching():
    from launch.cluster import ssh

    cfg = ssh.SshConfig(user="bob", python="/opt/my env/python", workdir="/srv/hf repo", options=["-p", "2222"],
                        state_dir="/s")
    argv = ssh.ssh_argv(cfg, "n1", ["stop", "--node-ip-address", "n1"])
    assert argv[:5] == ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=15"] and argv[5:8] == ["-p", "2222",
                                                                                                   "bob@n1"]
    assert argv[8] == ("cd '/srv/hf repo' && PYTHONPATH='/srv/hf repo'${PYTHONPATH:+:$PYTHONPATH} exec "
                       "'/opt/my env/python' -m launch.cluster stop --state-dir /s --node-ip-address n1")
    # stop matches its own temp dir, not one that merely starts with the same characters
    assert node._names_dir(["raylet", "--temp-dir=/tmp/hfray-0-head-1.2.3.4-6379"], "/tmp/hfray-0-head-1.2.3.4-6379")
    assert node._names_dir(["x", "/tmp/hfray-0-head-1.2.3.4-6379/session_1/logs"], "/tmp/hfray-0-head-1.2.3.4-6379")
    assert not node._names_dir(["--temp-dir=/tmp/hfray-0-head-1.2.3.4-63790"], "/tmp/hfray-0-head-1.2.3.4-6379")


@pytest.mark.bad_input
def test_token_install_never_overwrites(tmp_path):
    from launch.cluster import auth

    env = {"RAY_AUTH_TOKEN_PATH": str(tmp_path / "ray" / "token")}
    auth.install_token("abc\n", env)
    assert (tmp_path / "ray" / "token").read_text() == "abc"
    assert stat.S_IMODE((tmp_path / "ray" / "token").stat().st_mode) == 0o600
    auth.install_token("abc", env)  # the same token again: fine
    with pytest.raises(RuntimeError, match=f"different Ray token already exists at {tmp_path}/ray/token"):
        auth.install_token("xyz", env)
    assert auth.ensure_token(env) == "abc"


# ---- head + worker + status + stop, directly ---------------------------------------------------------------


def test_worker_timeout_reports_the_local_heads_gcs(tmp_path):
    # A head this tool started here whose `ray start` has gone: a worker that cannot register says so, with the
    # tail of the head's gcs_server log (once seen in CI: a worker waited 180 s on a GCS that no longer answered).
    logs = tmp_path / "head_tmp" / "session_latest" / "logs"
    logs.mkdir(parents=True)
    (logs / "gcs_server.err").write_text("line\n" * 20 + "F gcs_server.cc: check failed: something\n")
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    rec = dict(role="head", name="head-x", pid=gone.pid, pgid=gone.pid, create_time=0.0, node_ip=HEAD_IP,
               address=f"{HEAD_IP}:1234", temp_dir=str(tmp_path / "head_tmp"))
    sdir = node.state_dir(tmp_path / "state")
    sdir.mkdir(parents=True)
    (sdir / "head-x.json").write_text(json.dumps(rec))
    text = node._local_head_report(sdir, f"{HEAD_IP}:1234")
    assert f"the head at {HEAD_IP}:1234 was started here (pid {gone.pid}): its `ray start` is not running" in text
    assert text.rstrip().endswith("F gcs_server.cc: check failed: something") and "gcs_server.err (tail)" in text
    assert node._local_head_report(sdir, f"{HEAD_IP}:9999") == ""  # someone else's head: nothing to add


def _start_direct(env) -> tuple[int, str]:
    port = free_port()
    head = _ok(_cli(env, "head", "--node-ip-address", HEAD_IP, "--port", str(port), "--no-dashboard",
                    "--num-cpus", "1", f"--ray-args={_ray_args()}"))
    _ok(_cli(env, "worker", "--address", f"{HEAD_IP}:{port}", "--node-ip-address", WORKER_IP, "--num-cpus", "2",
             f"--ray-args={_ray_args()}"))
    return port, head


@pytest.fixture(scope="module")
def direct(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("direct")
    env = _env(tmp)
    t0 = time.monotonic()
    try:
        try:
            port, head = _start_direct(env)
        except AssertionError as first:
            # Once in a full CI suite the worker could not reach a head that had just started (its GCS stopped
            # answering); the worker's error now says what became of that GCS. Print it and start afresh once:
            # a second failure fails every test of this fixture.
            print(f"direct: first start failed, retrying on a new port:\n{first}")
            _emergency_stop(env)
            port, head = _start_direct(env)
        print(f"direct: head and worker up in {time.monotonic() - t0:.1f} s")
        yield dict(env=env, port=port, tmp=tmp, head_stdout=head, pids=_node_pids(tmp / "state"))
    finally:
        _emergency_stop(env)


@pytest.mark.cluster
def test_head_worker_status(direct):
    assert f"RAY_ADDRESS={HEAD_IP}:{direct['port']}" in direct["head_stdout"]
    token = Path(direct["env"]["RAY_AUTH_TOKEN_PATH"])
    assert len(token.read_text()) == 64 and stat.S_IMODE(token.stat().st_mode) == 0o600  # the head made it
    nodes = json.loads(_ok(_cli(direct["env"], "status", "--json", "--timeout", "60")))
    by_ip = {n["ip"]: n for n in nodes}
    assert sorted(by_ip) == [HEAD_IP, WORKER_IP] and all(n["alive"] for n in nodes)
    assert (by_ip[HEAD_IP]["cpus"], by_ip[WORKER_IP]["cpus"]) == (1, 2)  # what each node was started with
    assert by_ip[HEAD_IP]["head"] and not by_ip[WORKER_IP]["head"]
    # Token auth is really on: a driver with another token is refused.
    wrong = tmp_token(direct["tmp"], "0" * 64)
    proc = _cli(dict(direct["env"], RAY_AUTH_TOKEN_PATH=str(wrong)), "status", "--address",
                f"{HEAD_IP}:{direct['port']}", "--timeout", "20")
    assert proc.returncode == 1 and f"{HEAD_IP}:{direct['port']} refused this host's token ({wrong}" in proc.stderr


def tmp_token(tmp: Path, token: str) -> Path:
    path = tmp / f"token_{token[:4]}"
    path.write_text(token)
    return path


@pytest.mark.cluster
@pytest.mark.bad_input
def test_second_head_on_used_port_fails_and_leaves_first(direct):
    args = ["head", "--node-ip-address", HEAD_IP, "--port", str(direct["port"]), "--no-dashboard"]
    proc = _cli(direct["env"], *args, timeout=60)  # the same state dir: this tool's own head
    assert proc.returncode == 1 and "is already running" in proc.stderr and "launch.cluster stop" in proc.stderr
    t0 = time.monotonic()
    other = dict(direct["env"], HYBRIDFLOW_CLUSTER_STATE_DIR=str(direct["tmp"] / "other_state"))  # someone else's
    proc = _cli(other, *args, timeout=60)
    assert proc.returncode == 1 and time.monotonic() - t0 < 20
    assert f"port {direct['port']} on {HEAD_IP} is already in use" in proc.stderr
    assert sorted(_alive(direct["pids"])) == sorted(p for p, _ in direct["pids"])  # the first cluster is intact
    assert len(node.read_records(node.state_dir(direct["tmp"] / "state"))) == 2


@pytest.mark.cluster
def test_stop_ends_every_process(direct):
    state = direct["tmp"] / "state"
    assert len(direct["pids"]) >= 6  # gcs, raylets, monitors, agents...
    t0 = time.monotonic()
    out = _ok(_cli(direct["env"], "stop", timeout=120))
    print(f"stop (2 nodes): {time.monotonic() - t0:.1f} s")
    assert "stopped worker-" in out and "stopped head-" in out
    _assert_all_gone(direct["pids"], _temp_dirs(direct["port"]), state)


# ---- bad input without a cluster ---------------------------------------------------------------------------


@pytest.mark.bad_input
def test_worker_with_unreachable_head_or_no_token(tmp_path):
    env = _env(tmp_path)
    dead = f"{HEAD_IP}:{free_port()}"  # nothing listens there
    proc = _cli(env, "worker", "--address", dead, "--node-ip-address", WORKER_IP, timeout=60)
    assert proc.returncode == 1 and str(env["RAY_AUTH_TOKEN_PATH"]) in proc.stderr  # no token: said first
    tmp_token(tmp_path, "ab" * 32).rename(env["RAY_AUTH_TOKEN_PATH"])
    from launch.cluster.cli import build_parser

    default = build_parser().parse_args(["worker", "--address", dead]).connect_timeout
    assert default <= 25  # what a user gets: the error comes within 30 s
    t0 = time.monotonic()
    proc = _cli(env, "worker", "--address", dead, "--node-ip-address", WORKER_IP, "--connect-timeout", "5", timeout=60)
    assert proc.returncode == 1 and time.monotonic() - t0 <= 15
    assert f"cannot reach the Ray head at {dead}" in proc.stderr
    # The head never advertises the wildcard; through the shell wrapper, run from elsewhere (it finds the repo).
    proc = subprocess.run([str(REPO / "launch/scripts/ray_head.sh"), "--node-ip-address", "0.0.0.0"],
                          env=dict(env, PYTHON=sys.executable), capture_output=True, text=True, timeout=60,
                          cwd=tmp_path)
    assert proc.returncode == 1 and "--node-ip-address 0.0.0.0 is not an address" in proc.stderr
    assert not node.read_records(node.state_dir(tmp_path / "state"))


@pytest.mark.bad_input
def test_up_and_status_reject_bad_input_before_any_ssh(tmp_path):
    env = _fake_bin(tmp_path, _env(tmp_path), ssh=FAKE_SSH)
    proc = _cli(env, "up", "--hosts", f"{HEAD_IP},{HEAD_IP}", timeout=60)
    assert proc.returncode == 1 and "lists a host twice" in proc.stderr
    proc = _cli(env, "up", "--hosts", ",", timeout=60)
    assert proc.returncode == 1 and "--hosts is empty" in proc.stderr
    assert not (tmp_path / "fake.log").exists()  # nothing was started anywhere
    proc = _cli(env, "status", timeout=60)
    assert proc.returncode == 1 and "no --address given" in proc.stderr
    proc = _cli(env, "status", "--address", "127.0.0.2", timeout=60)
    assert proc.returncode == 1 and "'127.0.0.2' must be HOST:PORT" in proc.stderr


# ---- up / down over a fake ssh -----------------------------------------------------------------------------

FAKE_SSH = """\
#!/bin/bash
# fake ssh: records its arguments, then runs the remote command on this machine (as sshd's shell would)
printf '%s\\n' "$*" >> "$FAKE_LOG"
while [ $# -gt 0 ]; do case "$1" in -o|-p|-i|-l|-F) shift 2;; -*) shift;; *) break;; esac; done
host=${1#*@}; shift
case ",${FAKE_SSH_FAIL:-}," in *",$host,"*)
  echo "ssh: connect to host $host port 22: Connection refused" >&2; exit 255;; esac
exec bash -c "$*"
"""

FAKE_SRUN = """\
#!/bin/bash
# fake srun: records its arguments, drops the srun options and runs the step's command on this machine
printf '%s\\n' "$*" >> "$FAKE_LOG"
while [ $# -gt 0 ]; do case "$1" in -w) host=$2; shift 2;; -N|-n|-c) shift 2;; -*) shift;; *) break;; esac; done
case ",${FAKE_SRUN_FAIL:-}," in *",${host:-},"*)
  echo "srun: error: Unable to create step for job: node $host is down" >&2; exit 1;; esac
exec "$@"
"""

FAKE_SCONTROL = """\
#!/bin/bash
# fake scontrol: `scontrol show hostnames LIST` for a comma-separated LIST
[ "$1 $2" = "show hostnames" ] || { echo "fake scontrol: $*" >&2; exit 1; }
tr ',' '\\n' <<< "$3"
"""


def _fake_bin(tmp: Path, env: dict, **scripts: str) -> dict:
    bindir = tmp / "bin"
    bindir.mkdir(exist_ok=True)
    for name, text in scripts.items():
        (bindir / name).write_text(text)
        (bindir / name).chmod(0o755)
    return dict(env, PATH=f"{bindir}:{env['PATH']}", FAKE_LOG=str(tmp / "fake.log"))


@pytest.mark.cluster
def test_up_down_over_ssh(tmp_path):
    env = _fake_bin(tmp_path, _env(tmp_path), ssh=FAKE_SSH)
    port, state = free_port(), tmp_path / "state"
    hosts = f"{HEAD_IP},{WORKER_IP}"
    try:
        t0 = time.monotonic()
        out = _ok(_cli(env, "up", "--hosts", hosts, "--ssh-user", "alice", "--port", str(port), "--no-dashboard",
                       "--num-cpus", "1", f"--ray-args={_ray_args()}", "--timeout", "180", timeout=400))
        print(f"up (2 nodes): {time.monotonic() - t0:.1f} s")
        assert f"RAY_ADDRESS={HEAD_IP}:{port}" in out
        calls = (tmp_path / "fake.log").read_text().splitlines()
        assert [c.split()[4] for c in calls] == [f"alice@{HEAD_IP}", f"alice@{WORKER_IP}", f"alice@{HEAD_IP}"]
        assert [c.split("launch.cluster ")[1].split()[0] for c in calls] == ["head", "worker", "wait"]
        assert all(f"cd {REPO} && PYTHONPATH={REPO}" in c and sys.executable in c for c in calls)
        assert not any(Path(env["RAY_AUTH_TOKEN_PATH"]).read_text() in c for c in calls)  # token not on a cmdline
        pids = _node_pids(state)
        drv = subprocess.run([sys.executable, str(DRIVER)], env=dict(env, RAY_ADDRESS=f"{HEAD_IP}:{port}",
                             RAY_AUTH_MODE="token"), capture_output=True, text=True, timeout=240, cwd=REPO)
        _check_two_nodes(_result(_ok(drv)))
        t0 = time.monotonic()
        _ok(_cli(env, "down", "--hosts", hosts, "--ssh-user", "alice", timeout=240))
        print(f"down (2 nodes): {time.monotonic() - t0:.1f} s")
        assert [c.split("launch.cluster ")[1].split()[0] for c in (tmp_path / "fake.log").read_text().splitlines()[3:]
                ] == ["stop", "stop"]
        _assert_all_gone(pids, _temp_dirs(port), state)
    finally:
        _emergency_stop(env)


@pytest.mark.cluster
@pytest.mark.bad_input
def test_up_with_failing_host_names_it_and_cleans_up(tmp_path):
    env = dict(_fake_bin(tmp_path, _env(tmp_path), ssh=FAKE_SSH), FAKE_SSH_FAIL="127.0.0.4")
    port, state = free_port(), tmp_path / "state"
    try:
        proc = _cli(env, "up", "--hosts", f"{HEAD_IP},127.0.0.4", "--port", str(port), "--no-dashboard",
                    "--num-cpus", "1", f"--ray-args={_ray_args()}", timeout=400)
        assert proc.returncode == 1
        assert "host 127.0.0.4 failed" in proc.stderr and "Connection refused" in proc.stderr
        calls = (tmp_path / "fake.log").read_text()
        assert "launch.cluster head" in calls and f"{HEAD_IP} cd " in calls.replace("\n", " ")
        assert f"stop --node-ip-address {HEAD_IP}" in calls  # the head that did start was stopped again
        _assert_all_gone(set(), _temp_dirs(port)[:1], state)
    finally:
        _emergency_stop(env)


# ---- the SLURM batch script with fake scontrol/srun ---------------------------------------------------------


@pytest.mark.cluster
def test_sbatch_runs_driver_and_tears_down(tmp_path):
    env = _fake_bin(tmp_path, _env(tmp_path), srun=FAKE_SRUN, scontrol=FAKE_SCONTROL)
    port, state = free_port(), tmp_path / "state"
    env.update(SLURM_JOB_NODELIST=f"{HEAD_IP},{WORKER_IP}", SLURM_JOB_ID="4242", SLURM_SUBMIT_DIR=str(REPO),
               HF_PYTHON=sys.executable, HF_RAY_PORT=str(port), HF_WAIT_TIMEOUT="180",
               HF_CLUSTER_STATE_DIR=str(state),
               HF_HEAD_ARGS=f"--no-dashboard --num-cpus 1 --ray-args='{_ray_args()}'",
               HF_WORKER_ARGS=f"--num-cpus 1 --ray-args='{_ray_args()}'")
    t0 = time.monotonic()
    try:
        # The driver exits 3 after its tasks: the job must exit 3 too, with the cluster torn down.
        proc = subprocess.run(["bash", str(REPO / "launch/slurm/ray_cluster.sbatch"), sys.executable, str(DRIVER),
                               "--exit-code", "3"], env=env, capture_output=True, text=True, timeout=400, cwd=tmp_path)
        print(f"sbatch (2 nodes, start + driver + teardown): {time.monotonic() - t0:.1f} s")
        assert proc.returncode == 3, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-4000:]}"
        res = _result(proc.stdout)
        _check_two_nodes(res)
        srun = (tmp_path / "fake.log").read_text().splitlines()
        assert len(srun) == 1 and srun[0].startswith(f"--nodes=1 --ntasks=1 -w {WORKER_IP} ")
        assert f"worker --block --address {HEAD_IP}:{port}" in srun[0]
        assert len(res["pids"]) >= 6
        _assert_all_gone([tuple(p) for p in res["pids"]], _temp_dirs(port), state)
        assert not _naming_address(f"{HEAD_IP}:{port}")
    finally:
        _emergency_stop(dict(env, HYBRIDFLOW_CLUSTER_STATE_DIR=str(state)))


@pytest.mark.cluster
@pytest.mark.fault
def test_sbatch_worker_step_fails_stops_head(tmp_path):
    env = _fake_bin(tmp_path, _env(tmp_path), srun=FAKE_SRUN, scontrol=FAKE_SCONTROL)
    port, state = free_port(), tmp_path / "state"
    env.update(SLURM_JOB_NODELIST=f"{HEAD_IP},{WORKER_IP}", SLURM_JOB_ID="4243", HF_WORKDIR=str(REPO),
               HF_PYTHON=sys.executable, HF_RAY_PORT=str(port), HF_WAIT_TIMEOUT="300", HF_CLUSTER_STATE_DIR=str(state),
               HF_HEAD_ARGS=f"--no-dashboard --num-cpus 1 --ray-args='{_ray_args()}'", FAKE_SRUN_FAIL=WORKER_IP)
    t0 = time.monotonic()
    try:
        proc = subprocess.run(["bash", str(REPO / "launch/slurm/ray_cluster.sbatch"), "touch", str(tmp_path / "ran")],
                              env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
        # It gives up as soon as the step ends, long before the 300 s wait, and never runs the driver.
        assert proc.returncode == 1 and time.monotonic() - t0 < 120, proc.stderr[-3000:]
        assert f"the worker step on {WORKER_IP} ended before the cluster was up" in proc.stderr
        assert not (tmp_path / "ran").exists()
        _assert_all_gone(set(), _temp_dirs(port)[:1], state)
        assert not _naming_address(f"{HEAD_IP}:{port}")  # the `wait` it gave up on is gone too, not orphaned
    finally:
        _emergency_stop(dict(env, HYBRIDFLOW_CLUSTER_STATE_DIR=str(state)))


@pytest.mark.bad_input
def test_sbatch_without_driver_or_nodelist_fails_fast(tmp_path):
    env = _fake_bin(tmp_path, _env(tmp_path), srun=FAKE_SRUN, scontrol=FAKE_SCONTROL)
    script = str(REPO / "launch/slurm/ray_cluster.sbatch")
    proc = subprocess.run(["bash", script], env=dict(env, SLURM_JOB_NODELIST="x"), capture_output=True, text=True,
                          timeout=30)
    assert proc.returncode == 2 and "driver command" in proc.stderr
    proc = subprocess.run(["bash", script, "true"], env=env, capture_output=True, text=True, timeout=30)
    assert proc.returncode != 0 and "SLURM_JOB_NODELIST" in proc.stderr
