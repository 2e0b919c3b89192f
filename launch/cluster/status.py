"""Which nodes a cluster has, as a driver connected with ray.init(address=...) sees them.

The driver runs in a child process under a hard timeout: ray.init and ray.nodes() have none of their own
that covers every way a cluster can be unreachable. Ray only lets a driver join from a host that runs one of
the cluster's nodes, so run `status`/`wait` on a node (the head, usually).

    python -m launch.cluster.status HOST:PORT [--nodes N] [--timeout S] [--node-ip-address A]   (the probe)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from launch.cluster import auth, net

_REPO = str(Path(__file__).resolve().parents[2])
_RESULT = "NODES "


def summarize(node: dict) -> dict:
    """One ray.nodes() entry as the fields `status` prints (pure)."""
    res = node.get("Resources") or {}
    return {"node_id": node.get("NodeID"), "ip": node.get("NodeManagerAddress"),
            "hostname": node.get("NodeManagerHostname"), "alive": bool(node.get("Alive")),
            "cpus": res.get("CPU", 0), "gpus": res.get("GPU", 0),
            "head": "node:__internal_head__" in res or bool(node.get("IsHead"))}


def format_table(nodes: list[dict]) -> str:
    rows = [("NODE_ID", "IP", "ROLE", "ALIVE", "CPUS", "GPUS")]
    for n in sorted(nodes, key=lambda n: (not n["head"], not n["alive"], n["ip"] or "")):
        rows.append(((n["node_id"] or "?")[:12], n["ip"] or "?", "head" if n["head"] else "worker",
                     "yes" if n["alive"] else "NO", f"{n['cpus']:g}", f"{n['gpus']:g}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    alive = sum(n["alive"] for n in nodes)
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    return "\n".join(lines + [f"{alive} of {len(nodes)} nodes alive"])


def _driver_env() -> dict[str, str]:
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
    env.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)
    env.pop("RAY_ADDRESS", None)  # the address is passed explicitly
    if auth.auth_enabled(env):
        env["RAY_AUTH_MODE"] = "token"  # a driver does not turn token auth on by itself, even with a token at hand
    # ray.init retries its GCS connection once a second, 20 times, whatever the error (a refused token too);
    # the head's port has already answered, so a few tries are enough.
    env.setdefault("RAY_gcs_server_port_wait_time_s", "5")
    env["PYTHONPATH"] = os.pathsep.join(p for p in [_REPO, env.get("PYTHONPATH", "")] if p)
    return env


def cluster_nodes(address: str, want_nodes: int | None = None, timeout_s: float = 60,
                  node_ip: str | None = None) -> list[dict]:
    """The cluster's nodes; with want_nodes, wait (up to timeout_s) until that many are alive. Raises naming the
    address when the head does not answer, and TimeoutError (with the nodes seen) when too few joined."""
    net.wait_reachable(address, min(timeout_s, 20))
    cmd = [sys.executable, "-m", "launch.cluster.status", address, "--timeout", str(timeout_s)]
    if want_nodes:
        cmd += ["--nodes", str(want_nodes)]
    if node_ip:
        cmd += ["--node-ip-address", node_ip]
    try:
        proc = subprocess.run(cmd, env=_driver_env(), capture_output=True, text=True, timeout=timeout_s + 30)
    except subprocess.TimeoutExpired:
        raise TimeoutError(f"a driver could not connect to the Ray cluster at {address} within "
                           f"{timeout_s + 30:.0f} s") from None
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(_RESULT)]
    if proc.returncode != 0 and "InvalidAuthToken" in proc.stderr:
        raise RuntimeError(f"the Ray cluster at {address} refused this host's token ({auth.token_path()} or "
                           "RAY_AUTH_TOKEN): use the head's token")
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"could not list the nodes of the Ray cluster at {address} (driver exit "
                           f"{proc.returncode}):\n{proc.stderr[-2000:]}")
    nodes = json.loads(lines[-1][len(_RESULT):])
    alive = sum(n["alive"] for n in nodes)
    if want_nodes and alive < want_nodes:
        raise TimeoutError(f"only {alive} of {want_nodes} nodes joined the Ray cluster at {address} within "
                           f"{timeout_s:.0f} s:\n{format_table(nodes)}")
    return nodes


def _probe(address: str, want_nodes: int | None, timeout_s: float, node_ip: str | None) -> list[dict]:
    import ray

    kwargs = {"_node_ip_address": node_ip} if node_ip else {}
    ray.init(address=address, logging_level="ERROR", log_to_driver=False, configure_logging=False, **kwargs)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            nodes = [summarize(n) for n in ray.nodes()]
            if not want_nodes or sum(n["alive"] for n in nodes) >= want_nodes or time.monotonic() > deadline:
                return nodes
            time.sleep(1.0)
    finally:
        ray.shutdown()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="print the nodes of a Ray cluster as JSON (used by `status`)")
    ap.add_argument("address")
    ap.add_argument("--nodes", type=int, default=None)
    ap.add_argument("--timeout", type=float, default=60)
    ap.add_argument("--node-ip-address", default=None)
    a = ap.parse_args(argv)
    nodes = _probe(a.address, a.nodes, a.timeout, a.node_ip_address)
    print(_RESULT + json.dumps(nodes), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
