"""Starting or joining Ray with defaults that suit one machine and do not surprise a cluster.

Single machine: bind to loopback, no dashboard unless asked (then on
127.0.0.1), temp dir under the run directory, usage stats off.

Joining a cluster (address "auto" or host:port, e.g. as a `ray job submit` job): nothing local applies.
The cluster's own CPUs, object store, dashboard, node address and temp dir are used, and the driver
leaves alone the env vars the job's runtime_env already sets (Ray refuses to merge two values of one key).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path

from hybridflow.ports import is_loopback_address

log = logging.getLogger(__name__)


# The longest socket path Ray creates under its temp dir (a 7-digit pid, the most Linux hands out); with the
# temp dir it must fit AF_UNIX's 107 bytes. A fixed length guess (60) failed once pytest's counter hit 101.
_LONGEST_SOCKET_SUFFIX = "/session_2026-12-02_18-35-20_571285_1234567/sockets/plasma_store"
_UNIX_SOCKET_PATH_MAX = 107


def ray_temp_dir(run_dir, override: str | None = None) -> Path:
    """<run_dir>/ray (or `override`), absolute; a short /tmp name derived from it when Ray's socket paths
    under it would not fit in AF_UNIX's 107 bytes (is_stand_in tells which)."""
    tmp = Path(override or Path(run_dir).resolve() / "ray")
    if len(str(tmp)) + len(_LONGEST_SOCKET_SUFFIX) > _UNIX_SOCKET_PATH_MAX:
        import hashlib

        tmp = Path("/tmp") / f"{_STAND_IN_PREFIX}{hashlib.sha1(str(tmp).encode()).hexdigest()[:10]}"
    return tmp


_STAND_IN_PREFIX = "hf_ray_"


def is_stand_in(temp_dir: Path) -> bool:
    """Whether ray_temp_dir gave the short /tmp stand-in rather than the run dir's own ray/."""
    return temp_dir.parent == Path("/tmp") and temp_dir.name.startswith(_STAND_IN_PREFIX)


def processes_naming(path, cwd_inside: bool = False) -> list:
    """The live processes with `path` in their command line (or, with cwd_inside, running in a directory under
    it): a Ray cluster's daemons name their temp dir there."""
    import psutil

    path = str(path)
    found = []
    for proc in psutil.process_iter(["cmdline", "cwd"]):
        try:
            if (any(path in arg for arg in proc.info["cmdline"] or [])
                    or (cwd_inside and (proc.info["cwd"] or "").startswith(path + "/"))):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def _job_env_vars() -> dict | None:
    """The env vars of the runtime_env this driver was submitted with (`ray job submit`), None outside a job.

    The job manager hands the job's config to its entrypoint in this variable (ray/_private/worker.py reads it).
    """
    import json

    raw = os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR")
    if raw is None:
        return None
    return dict((json.loads(raw).get("runtime_env") or {}).get("env_vars") or {})


@contextlib.contextmanager
def _cluster_mode(on: bool):
    """Ray's cluster mode (ray_constants.ENABLE_RAY_CLUSTER, read from RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER when ray
    is imported) for one init: off, a node's address is loopback and loopback addresses are left as they are."""
    from ray._private import ray_constants

    saved, ray_constants.ENABLE_RAY_CLUSTER = ray_constants.ENABLE_RAY_CLUSTER, ray_constants.ENABLE_RAY_CLUSTER and on
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved


def init_ray(address: str | None = None, num_cpus: int | None = None, include_dashboard: bool = False,
             object_store_memory: int | None = 2 * 1024**3, run_dir: str | os.PathLike = "runs",
             env_vars: dict | None = None):
    """Start a local cluster (address=None) or join one ("auto" or host:port; num_cpus, include_dashboard,
    object_store_memory and run_dir are then the cluster's business and ignored)."""
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if ray.is_initialized():
        return ray.get_runtime_context()
    runtime_env = {"env_vars": {"RAY_USAGE_STATS_ENABLED": "0", **(env_vars or {})}}
    if address:
        job_env = _job_env_vars()
        extra = {k: v for k, v in runtime_env["env_vars"].items() if k not in (job_env or {})}
        log.info("joining Ray cluster at %s%s", address, " (inside a Ray job)" if job_env is not None else "")
        # A cluster on loopback (our local clusters are: below) registered its node as 127.0.0.1. Ray rewrites a
        # loopback address to the first interface's (resolve_ip_for_localhost) unless its cluster mode is off, and
        # then waits for minutes on a raylet that is not there; with it off for this init, the driver joins at once.
        with _cluster_mode(not is_loopback_address(address)):
            return ray.init(address=address, runtime_env={"env_vars": extra} if extra else None, log_to_driver=True)
    tmp = ray_temp_dir(run_dir, os.environ.get("RAY_TMPDIR"))
    tmp.mkdir(parents=True, exist_ok=True)
    # A stale "current cluster" marker makes the next init try to join a dead cluster.
    stale = tmp / "ray_current_cluster"
    if stale.exists():
        stale.unlink()
    # Loopback only: Ray otherwise binds the first interface's address (and its gRPC servers '::'). This switch
    # (Ray's own name for it) keeps a local cluster on 127.0.0.1 and refuses other nodes, which is what a local
    # cluster is. Ray reads it into a module constant when ray is imported, which has happened by now, so the
    # constant is set too (for this init only: a later join from this process must see the real address);
    # the env var reaches the GCS, raylet, agents and workers that this init spawns.
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    kwargs = dict(
        num_cpus=num_cpus,
        include_dashboard=include_dashboard,
        _temp_dir=str(tmp),
        runtime_env=runtime_env,
        object_store_memory=object_store_memory,
        log_to_driver=True,
    )
    if include_dashboard:
        kwargs["dashboard_host"] = "127.0.0.1"
    log.info("starting local Ray (num_cpus=%s, temp dir %s)", num_cpus, tmp)
    with _cluster_mode(False):
        context = ray.init(**kwargs)
    if is_stand_in(tmp):
        # The short /tmp stand-in for a run dir whose socket paths would be too long: nobody would look for its
        # logs there, and every such run left one behind. The run dir's own ray/ stays, logs and all.
        import atexit

        atexit.register(shutdown_and_remove, tmp)
    return context


def shutdown_and_remove(temp_dir, timeout_s: float = 15) -> None:
    """Shut this process's Ray down, then remove `temp_dir` once no process names it any more. ray.shutdown()
    returns before the local cluster's daemons have exited, and a daemon still shutting down made its session dir
    again after an immediate rmtree. Ray's own atexit shutdown is registered when ray is imported, so an atexit
    handler registered later runs before it: hence the shutdown here."""
    import shutil

    import ray

    ray.shutdown()
    deadline = time.monotonic() + timeout_s
    while processes_naming(temp_dir) and time.monotonic() < deadline:
        time.sleep(0.2)
    shutil.rmtree(temp_dir, ignore_errors=True)
