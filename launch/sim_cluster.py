"""A multi-node Ray cluster simulated on loopback: each "node" is a `ray start` with its own custom resource.

    python -m launch.sim_cluster start --nodes 2 --port 6390   # prints the address; Ctrl-C stops it
    python -m launch.sim_cluster start --dashboard-port 8270   # also a dashboard: ray job submit --address http://127.0.0.2:8270

Every node binds 127.0.0.2 and advertises the custom resource node<i>, so a
ResourcePool(node_resources=["node0", "node1"]) pins one bundle set per node.
The same commands (without --node-ip-address tricks) start a real cluster.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from hybridflow.controller.ray_env import processes_naming
from hybridflow.controller.worker import free_port

IP = "127.0.0.2"


def _ray() -> str:
    return str(Path(sys.executable).with_name("ray"))


def _wait_port(port: int, timeout_s: float, proc: subprocess.Popen, log: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"ray head exited with {proc.returncode}; see {log}:\n{Path(log).read_text()[-2000:]}")
        with socket.socket() as s:
            if s.connect_ex((IP, port)) == 0:
                return
        time.sleep(0.5)
    raise TimeoutError(f"Ray head on {IP}:{port} did not open its port within {timeout_s:.0f} s")


class SimCluster:
    """Each node is a `ray start --block` in its own process group, so stopping it kills only this cluster
    (`ray stop` would kill every Ray instance on the machine, other test clusters included)."""

    def __init__(self, nodes: int, port: int, cpus_per_node: int = 4, object_store_bytes: int = 512 * 1024**2,
                 temp_dir: str | None = None, include_dashboard: bool = False, dashboard_port: int | None = None):
        self.nodes, self.port, self.cpus, self.store = nodes, port, cpus_per_node, object_store_bytes
        # The dashboard (about 1 GB more) is what `ray job submit` talks to; off unless asked.
        self.include_dashboard = include_dashboard or dashboard_port is not None
        self.dashboard_port = dashboard_port
        # Ray's unix socket paths must stay under ~107 bytes: keep the temp dir short. One made here goes at stop().
        self.temp_dir = temp_dir or f"/tmp/hf_sim_{port}"
        self._own_temp_dir = temp_dir is None
        os.makedirs(self.temp_dir, exist_ok=True)
        self.procs: list[subprocess.Popen] = []
        # Ray's token auth (on by default) shares ~/.ray/auth_token between every cluster on the machine, and
        # concurrent clusters race on it. This cluster listens on loopback only, so it runs without auth;
        # drivers must use `self.env` too. A real multi-node cluster keeps token auth (see launch/README.md).
        self.env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="disabled")
        self.env.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)  # set by init_ray for local clusters: forbids nodes

    @property
    def address(self) -> str:
        return f"{IP}:{self.port}"

    @property
    def dashboard_url(self) -> str:
        """http://127.0.0.2:<port>: the address for `ray job submit` / JobSubmissionClient."""
        if not self.include_dashboard:
            raise RuntimeError("this SimCluster runs without a dashboard (include_dashboard=False)")
        return f"http://{IP}:{self.dashboard_port}"

    def _node_ports(self) -> list[str]:
        # Every node here shares one IP (and the machine may run other clusters): the dashboard agent's
        # fixed default HTTP port (52365) would collide, and the head's agent is the one that runs submitted jobs.
        if not self.include_dashboard:
            return []
        return [f"--dashboard-agent-listen-port={free_port()}"]

    def _spawn(self, args: list[str]) -> None:
        log = open(f"{self.temp_dir}/node{len(self.procs)}.log", "w")  # noqa: SIM115 - lives as long as the node
        self.procs.append(subprocess.Popen([_ray(), "start", "--block", *args], env=self.env, start_new_session=True,
                                           stdout=log, stderr=subprocess.STDOUT))

    def start(self, timeout_s: float = 180) -> str:
        common = ["--node-ip-address", IP, f"--num-cpus={self.cpus}", f"--object-store-memory={self.store}",
                  "--disable-usage-stats"]
        if self.include_dashboard:
            self.dashboard_port = self.dashboard_port or free_port()
            dashboard = ["--include-dashboard=true", f"--dashboard-host={IP}",
                         f"--dashboard-port={self.dashboard_port}"]
        else:
            dashboard = ["--include-dashboard=false"]
        self._spawn(["--head", f"--port={self.port}", *dashboard, f"--temp-dir={self.temp_dir}",
                     f"--resources={json.dumps({'node0': 1})}", *self._node_ports(), *common])
        _wait_port(self.port, timeout_s, self.procs[0], f"{self.temp_dir}/node0.log")
        self._wait_healthy(timeout_s)
        for i in range(1, self.nodes):
            # Each node its own temp dir, as on real machines: nodes sharing one would unpack a job's working
            # dir into the same runtime_resources folder, and one node's unpacking hid files from the other's
            # driver mid-import (measured: an ImportError from a half-extracted package).
            self._spawn([f"--address={self.address}", f"--resources={json.dumps({f'node{i}': 1})}",
                         f"--temp-dir={self.temp_dir}/n{i}", *self._node_ports(), *common])
        if self.include_dashboard:
            _wait_port(self.dashboard_port, timeout_s, self.procs[0], f"{self.temp_dir}/node0.log")
        return self.address

    def _wait_healthy(self, timeout_s: float) -> None:
        # The GCS port opens before the head can take drivers; `ray health-check` says when it can.
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            ok = subprocess.run([_ray(), "health-check", f"--address={self.address}"], capture_output=True,
                                env=self.env, timeout=timeout_s).returncode == 0
            if ok:
                return
            time.sleep(1)
        raise TimeoutError(f"Ray head {self.address} not healthy within {timeout_s:.0f} s")

    def stop(self, timeout_s: float = 5) -> None:
        """SIGTERM every node, then SIGKILL what is left after timeout_s in all (one deadline, not one per node:
        `ray start --block`, the gcs and the raylet sat out SIGTERM for 10 s and more here, and the cluster is
        thrown away anyway)."""
        for p in self.procs:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            try:  # raylet/gcs may outlive `ray start --block`: take the whole process group down
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.procs.clear()
        # Some Ray daemons start their own sessions; whatever still names this cluster's temp dir goes too, and
        # so do the processes that run inside it (a submitted job's driver runs in its unpacked working dir).
        import psutil

        killed = []
        for proc in processes_naming(self.temp_dir, cwd_inside=True):
            try:
                proc.kill()
                killed.append(proc)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
        psutil.wait_procs(killed, timeout=timeout_s)
        if self._own_temp_dir:  # its sessions and node logs: each test run left one in /tmp
            import shutil

            shutil.rmtree(self.temp_dir, ignore_errors=True)

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.stop()


def wait_for_nodes(n: int, timeout_s: float = 180) -> None:
    """From a connected driver: block until n nodes are alive (every wait has a timeout)."""
    import ray

    deadline = time.monotonic() + timeout_s
    while sum(1 for node in ray.nodes() if node["Alive"]) < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {sum(1 for x in ray.nodes() if x['Alive'])} of {n} Ray nodes joined")
        time.sleep(0.5)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("action", choices=["start"])
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--port", type=int, default=6390)
    ap.add_argument("--cpus-per-node", type=int, default=4)
    ap.add_argument("--object-store-bytes", type=int, default=512 * 1024**2)
    ap.add_argument("--temp-dir", default=None)
    ap.add_argument("--dashboard-port", type=int, default=None, help="start the dashboard on 127.0.0.2:PORT "
                    "(what `ray job submit` / launch.submit talk to)")
    a = ap.parse_args()
    cluster = SimCluster(a.nodes, a.port, a.cpus_per_node, a.object_store_bytes, a.temp_dir,
                         dashboard_port=a.dashboard_port)

    def _interrupt(signum, frame):  # `kill PID` takes the cluster down like Ctrl-C (background jobs ignore SIGINT)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _interrupt)
    print(cluster.start(), flush=True)
    if cluster.include_dashboard:
        print(cluster.dashboard_url, flush=True)
    try:  # runs until Ctrl-C, then takes the whole simulated cluster down
        while all(p.poll() is None for p in cluster.procs):
            time.sleep(1)
    except KeyboardInterrupt:
        pass
    finally:
        cluster.stop()


if __name__ == "__main__":
    main()
