"""Start and stop one Ray node, and remember what was started in a pid file.

A node is a `ray start --block` in its own session (its pid is also its process group), logging to the
state dir. The pid file records that pid, the node's temp dir and address, so `stop` can end exactly
those processes: the group, and whatever else names the temp dir on its command line (some Ray daemons
re-parent or start their own sessions, and gcs_server/raylet have ignored SIGTERM for 5 s). Never
`ray stop`, which ends every Ray instance on the machine.

State files live in <state dir>/<hostname>/ so a state dir on a shared home serves several hosts.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from launch.cluster import auth, net

READY_LINE = "Ray runtime started."  # what `ray start` prints once the node has registered with the GCS
DEFAULT_STATE_DIR = "~/.hybridflow/cluster"


def state_dir(path: str | os.PathLike | None = None) -> Path:
    """<state dir>/<this hostname>: --state-dir, else $HYBRIDFLOW_CLUSTER_STATE_DIR, else ~/.hybridflow/cluster."""
    root = path or os.environ.get("HYBRIDFLOW_CLUSTER_STATE_DIR") or DEFAULT_STATE_DIR
    return Path(root).expanduser().resolve() / socket.gethostname()


@dataclass
class NodeSpec:
    role: str  # "head" or "worker"
    node_ip: str
    port: int = 6379  # the head's GCS port
    head_address: str | None = None  # workers: HOST:PORT of the head
    temp_dir: str | None = None
    num_cpus: int | None = None
    num_gpus: int | None = None
    dashboard: bool = True
    dashboard_host: str | None = None  # default: the node's own address, not 0.0.0.0
    dashboard_port: int = 8265
    ray_args: list[str] = field(default_factory=list)  # passed through to `ray start` as they are

    @property
    def name(self) -> str:
        # Short: the default temp dir is named after it. A worker is named by its address and the head's port.
        if self.role == "head":
            return f"head-{self.node_ip}-{self.port}"
        return f"worker-{self.node_ip}-{self.head_address.rpartition(':')[2]}"

    @property
    def address(self) -> str:
        return f"{self.node_ip}:{self.port}" if self.role == "head" else self.head_address

    def resolved_temp_dir(self) -> str:
        """Unique per node, because `stop` kills whatever names it; short, because Ray's socket paths under it
        must fit AF_UNIX's 107 bytes (ray_temp_dir falls back to a short /tmp name)."""
        from hybridflow.controller.ray_env import ray_temp_dir

        default = f"/tmp/hfray-{os.getuid()}-{self.name}"
        return str(ray_temp_dir(".", override=self.temp_dir or default))


def ray_start_args(spec: NodeSpec, temp_dir: str) -> list[str]:
    """The `ray start` arguments for a node (pure)."""
    args = ["--block", "--node-ip-address", spec.node_ip, f"--temp-dir={temp_dir}", "--disable-usage-stats"]
    if spec.role == "head":
        args += ["--head", f"--port={spec.port}"]
        if spec.dashboard:
            args += ["--include-dashboard=true", f"--dashboard-host={spec.dashboard_host or spec.node_ip}",
                     f"--dashboard-port={spec.dashboard_port}"]
        else:
            args += ["--include-dashboard=false"]
    else:
        args += [f"--address={spec.head_address}"]
    if spec.num_cpus is not None:
        args.append(f"--num-cpus={spec.num_cpus}")
    if spec.num_gpus is not None:
        args.append(f"--num-gpus={spec.num_gpus}")
    return args + list(spec.ray_args)


def ray_env(base=None) -> dict[str, str]:
    """The environment of `ray start`: usage stats off, token auth explicit, this venv's bin first on PATH
    (a job's bare `python` is whatever `ray start` had on its PATH)."""
    env = dict(base if base is not None else os.environ)
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    env.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)  # init_ray sets it for local clusters; it forbids nodes
    if auth.auth_enabled(env):
        env["RAY_AUTH_MODE"] = "token"
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


def _ray_exe() -> str:
    return str(Path(sys.executable).with_name("ray"))


# ---- pid files ---------------------------------------------------------------------------------------------


def _record_path(sdir: Path, name: str) -> Path:
    return sdir / f"{name}.json"


def read_records(sdir: Path) -> list[dict]:
    out = []
    for p in sorted(sdir.glob("*.json")):
        try:
            rec = json.loads(p.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        rec["_file"] = str(p)
        out.append(rec)
    return out


def _leader_alive(rec: dict) -> bool:
    import psutil

    try:
        p = psutil.Process(rec["pid"])
        return abs(p.create_time() - rec["create_time"]) < 1.0 and p.status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def _names_dir(cmdline: list[str], temp_dir: str) -> bool:
    # The dir itself or a path below it; a bare prefix match would take /tmp/x-63790 for /tmp/x-6379.
    return any(arg.endswith(temp_dir) or temp_dir + "/" in arg for arg in cmdline)


def node_processes(rec: dict) -> list:
    """This user's processes that belong to the node: its process group (started after it) and every process
    naming its temp dir."""
    import psutil

    me, out = os.getuid(), []
    for p in psutil.process_iter(["pid", "uids", "cmdline", "create_time", "status"]):
        try:
            if (p.info["uids"] is None or p.info["uids"].real != me or p.pid == os.getpid()
                    or p.info["status"] == psutil.STATUS_ZOMBIE):
                continue
            in_group = os.getpgid(p.pid) == rec["pgid"] and p.info["create_time"] >= rec["create_time"] - 1.0
            if in_group or _names_dir(p.info["cmdline"] or [], rec["temp_dir"]):
                out.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, ProcessLookupError):
            continue
    return out


# ---- start -------------------------------------------------------------------------------------------------


def _check_before_start(spec: NodeSpec, sdir: Path, connect_timeout_s: float) -> None:
    net.check_node_ip(spec.node_ip)
    rec_file = _record_path(sdir, spec.name)
    if rec_file.exists():
        rec = json.loads(rec_file.read_text())
        if _leader_alive(rec):
            raise RuntimeError(f"a {spec.role} node {spec.name} started by this tool is already running "
                               f"(pid {rec['pid']}); `python -m launch.cluster stop` first")
        rec["_file"] = str(rec_file)
        stop_records([rec], grace_s=0)  # a node that died: take down whatever of it is left, and its pid file
    if spec.role == "head":
        if net.port_in_use(spec.node_ip, spec.port):
            raise RuntimeError(f"port {spec.port} on {spec.node_ip} is already in use (another Ray head? check "
                               f"`python -m launch.cluster status --address {spec.node_ip}:{spec.port}`); "
                               "choose another --port")
        if spec.dashboard and net.port_in_use(spec.dashboard_host or spec.node_ip, spec.dashboard_port):
            raise RuntimeError(f"dashboard port {spec.dashboard_port} on {spec.dashboard_host or spec.node_ip} is "
                               "already in use: choose another --dashboard-port or pass --no-dashboard")
        if auth.auth_enabled():
            auth.ensure_token()
    else:
        net.split_address(spec.head_address)
        if auth.auth_enabled():
            auth.require_token()
        net.wait_reachable(spec.head_address, connect_timeout_s)


def start_node(spec: NodeSpec, state: str | os.PathLike | None = None, timeout_s: float = 180,
               connect_timeout_s: float = 20) -> dict:
    """Start a node and wait until it has joined; returns its pid-file record. On any failure, whatever was
    started is stopped again before the error propagates."""
    sdir = state_dir(state)
    sdir.mkdir(parents=True, exist_ok=True)
    _check_before_start(spec, sdir, connect_timeout_s)
    temp_dir = spec.resolved_temp_dir()
    os.makedirs(temp_dir, exist_ok=True)
    log_path = sdir / f"{spec.name}.log"
    cmd = [_ray_exe(), "start", *ray_start_args(spec, temp_dir)]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=ray_env(), start_new_session=True, stdin=subprocess.DEVNULL,
                                stdout=log, stderr=subprocess.STDOUT)
    import psutil

    rec = dict(role=spec.role, name=spec.name, pid=proc.pid, pgid=proc.pid,
               create_time=psutil.Process(proc.pid).create_time(), node_ip=spec.node_ip, address=spec.address,
               temp_dir=temp_dir, log=str(log_path), spec=asdict(spec), cmd=cmd)
    # Written before the wait, so that an interrupted start can still be stopped.
    _record_path(sdir, spec.name).write_text(json.dumps(rec, indent=1))
    rec["_file"] = str(_record_path(sdir, spec.name))
    try:
        _wait_ready(proc, log_path, spec, timeout_s)
    except BaseException as e:
        stop_record(rec)
        if isinstance(e, TimeoutError) and spec.role == "worker":  # and what became of the head, if started here
            raise TimeoutError(f"{e}{_local_head_report(sdir, spec.head_address)}") from None
        raise
    rec["_proc"] = proc
    return rec


def _local_head_report(sdir: Path, head_address: str) -> str:
    """A worker that cannot register mostly means the head's GCS is gone or stuck: when this state dir holds
    that head, say whether its gcs_server still runs and show the tail of its log ('' for a remote head)."""
    heads = [r for r in read_records(sdir) if r.get("role") == "head" and r.get("address") == head_address]
    if not heads:
        return ""
    head = heads[0]
    names = []
    for p in node_processes(head) if _leader_alive(head) else []:
        try:
            names.append(p.name())
        except Exception:  # gone since listed
            continue
    state = ("its gcs_server is running" if any("gcs_server" in n for n in names) else
             "its gcs_server is NOT running" if names else "its `ray start` is not running")
    logs = sorted(Path(head["temp_dir"]).glob("session_latest/logs/gcs_server.*"))
    tail = "".join(f"\n--- {f} (tail) ---\n" + "\n".join(f.read_text(errors="replace").splitlines()[-15:])
                   for f in logs if f.stat().st_size)
    return f"\nthe head at {head_address} was started here (pid {head['pid']}): {state}{tail}"


def _wait_ready(proc: subprocess.Popen, log_path: Path, spec: NodeSpec, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        text = log_path.read_text(errors="replace")
        if READY_LINE in text:
            return
        if proc.poll() is not None:
            raise RuntimeError(f"`ray start` for the {spec.role} at {spec.address} exited with {proc.returncode}; "
                               f"log {log_path}:\n{text[-3000:]}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the Ray {spec.role} at {spec.address} did not start within {timeout_s:.0f} s; "
                               f"log {log_path}:\n{text[-3000:]}")
        time.sleep(0.3)


# ---- stop --------------------------------------------------------------------------------------------------


def stop_records(recs: list[dict], grace_s: float = 10.0, timeout_s: float = 30.0) -> dict[str, list[int]]:
    """End nodes: SIGTERM to each `ray start` (it shuts its daemons down), all at once, then after up to `grace_s`
    SIGKILL to whatever is left of each node. Returns {node name: pids that were alive}. Raises if any process
    survives `timeout_s`."""
    import psutil

    procs = {r["name"]: node_processes(r) for r in recs}
    pids = {r["name"]: {p.pid for p in procs[r["name"]]} for r in recs}
    leaders = []
    for r in recs:
        if _leader_alive(r):
            try:
                os.kill(r["pid"], signal.SIGTERM)
                leaders += [p for p in procs[r["name"]] if p.pid == r["pid"]]
            except ProcessLookupError:
                pass
    psutil.wait_procs(leaders, timeout=grace_s)
    deadline = time.monotonic() + timeout_s
    for r in recs:
        left = node_processes(r)
        while left:
            for p in left:
                try:
                    p.kill()
                except psutil.NoSuchProcess:
                    pass
            psutil.wait_procs(left, timeout=min(5.0, max(0.1, deadline - time.monotonic())))
            left = node_processes(r)  # a dying raylet may still have forked a worker
            pids[r["name"]] |= {p.pid for p in left}
            if left and time.monotonic() > deadline:
                raise RuntimeError(f"processes of node {r['name']} survived SIGKILL: {[p.pid for p in left]}")
        if r.get("_proc") is not None:
            r["_proc"].poll()  # reap our own child
        if r.get("_file"):
            Path(r["_file"]).unlink(missing_ok=True)
    return {name: sorted(v) for name, v in pids.items()}


def stop_record(rec: dict, grace_s: float = 10.0) -> list[int]:
    return stop_records([rec], grace_s=grace_s)[rec["name"]]


def stop_nodes(state: str | os.PathLike | None = None, node_ip: str | None = None, grace_s: float = 10.0) -> list:
    """Stop every node this tool started on this host (only those with `node_ip` if given). Returns
    [(name, pids)], workers first."""
    recs = [r for r in read_records(state_dir(state)) if node_ip is None or r["node_ip"] == node_ip]
    recs.sort(key=lambda r: r["role"] == "head")
    return list(stop_records(recs, grace_s=grace_s).items())


def block_until_signal(rec: dict) -> int:
    """Keep a node in the foreground (SLURM steps end when their command ends): SIGTERM/SIGINT/SIGHUP stop the
    node; if `ray start` dies by itself, clean up and return its exit code."""
    proc: subprocess.Popen = rec["_proc"]
    stopping = []

    def on_signal(signum, _frame):
        stopping.append(signum)

    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, on_signal)
    while not stopping and proc.poll() is None:
        time.sleep(0.5)
    stop_record(rec)
    return 0 if stopping else (proc.returncode or 1)
