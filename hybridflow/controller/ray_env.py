"""Starting or joining Ray with defaults that suit one machine and do not surprise a cluster.

Single machine: bind to loopback, no dashboard unless asked (then on
127.0.0.1), temp dir under the run directory, usage stats off.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)


# The longest socket path Ray creates under its temp dir (a 7-digit pid, the most Linux hands out); with the
# temp dir it must fit AF_UNIX's 107 bytes. A fixed length guess (60) failed once pytest's counter hit 101.
_LONGEST_SOCKET_SUFFIX = "/session_2026-12-02_18-35-20_571285_1234567/sockets/plasma_store"
_UNIX_SOCKET_PATH_MAX = 107


def ray_temp_dir(run_dir, override: str | None = None) -> Path:
    """<run_dir>/ray (or `override`), absolute; a short /tmp name derived from it when Ray's socket paths
    under it would not fit in AF_UNIX's 107 bytes."""
    tmp = Path(override or Path(run_dir).resolve() / "ray")
    if len(str(tmp)) + len(_LONGEST_SOCKET_SUFFIX) > _UNIX_SOCKET_PATH_MAX:
        import hashlib

        tmp = Path("/tmp") / f"hf_ray_{hashlib.sha1(str(tmp).encode()).hexdigest()[:10]}"
    return tmp


def init_ray(address: str | None = None, num_cpus: int | None = None, include_dashboard: bool = False,
             object_store_memory: int | None = 2 * 1024**3, run_dir: str | os.PathLike = "runs",
             env_vars: dict | None = None):
    """Start a local cluster (address=None) or join one ("auto" or host:port)."""
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if ray.is_initialized():
        return ray.get_runtime_context()
    runtime_env = {"env_vars": {"RAY_USAGE_STATS_ENABLED": "0", **(env_vars or {})}}
    if address:
        log.info("joining Ray cluster at %s", address)
        return ray.init(address=address, runtime_env=runtime_env, log_to_driver=True)
    tmp = ray_temp_dir(run_dir, os.environ.get("RAY_TMPDIR"))
    tmp.mkdir(parents=True, exist_ok=True)
    # A stale "current cluster" marker makes the next init try to join a dead cluster.
    stale = tmp / "ray_current_cluster"
    if stale.exists():
        stale.unlink()
    # Loopback only: Ray otherwise binds the first interface's address. This switch (Ray's own name for it)
    # keeps a local cluster on 127.0.0.1 and refuses other nodes, which is what a local cluster is.
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
    return ray.init(**kwargs)
