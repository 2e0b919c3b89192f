"""The driver side of `launch.torchrun_ray`: place one agent per node, start torchrun everywhere, stream the
output, stop every node as soon as one fails (or on --timeout / Ctrl-C), and print a per-rank table."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import uuid
from pathlib import Path

from hybridflow.ports import connect_within

from .agent import NodeAgent
from .plan import (
    LaunchInputError,
    LaunchSpec,
    absolute_pythonpath,
    loopback_host,
    node_env,
    rank_table,
    resolve_entry,
)
from .report import NodeOutcome, failed_ranks, format_table, rank_rows

REPO = Path(__file__).resolve().parents[2]  # holds launch/: the agents import it from there on every node
AGENT_CPUS = 0.01  # a placement group bundle may not be empty; torchrun's ranks get the node's CPUs
CALL_TIMEOUT_S = 30.0  # any single call to an agent (a poll returns at once; stop takes its grace period)
STOP_GRACE_S = 10.0
POLL_INTERVAL_S = 0.2
EXIT_TIMEOUT, EXIT_INTERRUPTED = 124, 130


class LaunchError(RuntimeError):
    """The job could not start: placement, connection or agent start-up failed (message says which)."""


def say(msg: str, out=None) -> None:
    print(f"[launcher] {msg}", file=out or sys.stdout, flush=True)


def check_reachable(address: str, timeout_s: float, refused_s: float = 2.0) -> None:
    """Fail in seconds (not after Ray's minute of reconnect attempts) when nothing answers at host:port.
    A refused connection is retried only for refused_s (a head restarting); silence up to timeout_s."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise LaunchInputError(f"--address {address!r} is not host:port")
    t0 = time.monotonic()
    last = connect_within(host, int(port), timeout_s, refused_s=refused_s)
    if last is not None:
        raise LaunchError(f"Ray cluster at --address {address} is unreachable "
                          f"({time.monotonic() - t0:.0f} s of tries): {last}")


def describe_cluster(nodes: list[dict]) -> str:
    """'2 alive nodes: 127.0.0.2 (ab12cd34) CPU 2 GPU 0; ...' from ray.nodes()."""
    alive = [n for n in nodes if n.get("Alive")]
    parts = [f"{n.get('NodeManagerAddress', '?')} ({str(n.get('NodeID', '?'))[:8]}) "
             f"CPU {n.get('Resources', {}).get('CPU', 0):g} GPU {n.get('Resources', {}).get('GPU', 0):g}"
             for n in alive]
    return f"{len(alive)} alive node(s): " + ("; ".join(parts) if parts else "none")


def capacity_problem(spec: LaunchSpec, nodes: list[dict]) -> str:
    """Why no placement can work on these nodes right now ('' if one can): fewer fitting nodes than --nnodes."""
    fit = [n for n in nodes if n.get("Alive") and n.get("Resources", {}).get("CPU", 0) >= AGENT_CPUS
           and n.get("Resources", {}).get("GPU", 0) >= spec.gpus_per_node]
    if len(fit) >= spec.nnodes:
        return ""
    need = f" with {spec.gpus_per_node:g} GPU(s)" if spec.gpus_per_node else ""
    return (f"--nnodes {spec.nnodes} needs {spec.nnodes} distinct nodes{need}, only {len(fit)} fit; "
            f"the cluster has {describe_cluster(nodes)}")


class Job:
    """One launch: the placement group, the agents, and their output cursors."""

    def __init__(self, spec: LaunchSpec, entry: list[str], cwd: str, env: dict[str, str], out=None):
        self.spec, self.entry, self.cwd, self.env = spec, entry, cwd, env
        self.out = out or sys.stdout
        self.t0 = time.monotonic()
        self.deadline = self.t0 + spec.timeout_s if spec.timeout_s else None
        self.tag = uuid.uuid4().hex[:12]
        self.pg = None
        self.agents: list = []
        self.where: list[dict] = []
        self.started: set[int] = set()

    def _left(self, cap: float) -> float:
        left = cap if self.deadline is None else min(cap, self.deadline - time.monotonic())
        if left <= 0:
            raise TimeoutError(f"--timeout {self.spec.timeout_s:g} s reached")
        return left

    def place(self) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        spec = self.spec
        short = capacity_problem(spec, ray.nodes())
        if short:  # nodes may still join (or an autoscaler add them): wait, but say so now
            say(f"waiting up to {self._left(spec.start_timeout_s):.0f} s for nodes: {short}", self.out)
        bundle = {"CPU": AGENT_CPUS, **({"GPU": spec.gpus_per_node} if spec.gpus_per_node else {})}
        self.pg = placement_group([bundle] * spec.nnodes, strategy="STRICT_SPREAD")
        wait = self._left(spec.start_timeout_s)
        ready, _ = ray.wait([self.pg.ready()], timeout=wait)
        if not ready:
            nodes = ray.nodes()
            raise LaunchError(f"placement of {spec.nnodes} nodes (STRICT_SPREAD, {bundle} each) not ready within "
                              f"{wait:.0f} s: {capacity_problem(spec, nodes) or describe_cluster(nodes)}")
        remote = ray.remote(NodeAgent)
        self.agents = [remote.options(num_cpus=AGENT_CPUS, num_gpus=spec.gpus_per_node, max_restarts=0,
                                      scheduling_strategy=PlacementGroupSchedulingStrategy(
                                          self.pg, placement_group_bundle_index=i)).remote(i)
                       for i in range(spec.nnodes)]
        wait = self._left(spec.start_timeout_s)
        try:
            self.where = ray.get([a.where.remote() for a in self.agents], timeout=wait)
        except ray.exceptions.GetTimeoutError as e:
            raise LaunchError(f"node agents did not start within {wait:.0f} s") from e
        except ray.exceptions.RayError as e:
            raise LaunchError(f"a node agent failed to start: {type(e).__name__}: {e}") from e
        say(f"placed {spec.nnodes} nodes in {time.monotonic() - self.t0:.1f} s: "
            + ", ".join(f"node {i}={w['ip']} ({w['node_id'][:8]})" for i, w in enumerate(self.where)), self.out)

    def start(self) -> None:
        import ray

        master_addr = self.where[0]["ip"]
        master_port = self.spec.master_port or self.where[0]["port"]
        say(f"torchrun: {self.spec.nnodes} node(s) x {self.spec.nproc_per_node} process(es), master "
            f"{master_addr}:{master_port}, entry {' '.join(self.entry)}", self.out)
        refs = [a.start.remote(self.spec, self.entry, master_addr, master_port, self.env, self.cwd, self.tag)
                for a in self.agents]
        for i, ref in enumerate(refs):
            try:
                info = ray.get(ref, timeout=self._left(CALL_TIMEOUT_S))
            except Exception as e:
                raise LaunchError(f"node {i} ({self.where[i]['ip']}): could not start torchrun: {e}") from e
            self.started.add(i)
            say(f"node {i}: torchrun pid {info['pid']}, per-rank logs in {info['log_dir']}", self.out)
        say(f"torchrun started on every node {time.monotonic() - self.t0:.1f} s after launch", self.out)

    def stream(self) -> tuple[str, int | None]:
        """Print every node's new lines until all exit 0 or one fails. Returns why it stopped early ('' when
        every node exited 0) and the node that failed first (None if none did)."""
        import ray

        cursors = [0] * len(self.agents)
        codes: dict[int, int] = {}
        while True:
            if self.deadline is not None and time.monotonic() > self.deadline:
                return f"--timeout {self.spec.timeout_s:g} s reached", None
            busy = False
            for i, agent in enumerate(self.agents):
                if i in codes:
                    continue
                try:
                    lines, cursors[i], code = ray.get(agent.poll.remote(cursors[i]), timeout=CALL_TIMEOUT_S)
                except Exception as e:  # the actor died or its node went away
                    return f"node {i} ({self.where[i]['ip']}) lost: {type(e).__name__}: {e}", i
                busy |= bool(lines)
                for line in lines:
                    print(f"[node {i}] {line}", file=self.out, flush=True)
                if code is not None:
                    codes[i] = code
                    if code != 0:
                        return f"node {i} torchrun exited with {code}", i
            if len(codes) == len(self.agents):
                return "", None
            if not busy:
                time.sleep(POLL_INTERVAL_S)

    def stop_and_report(self, reason: str, first_node: int | None = None) -> list:
        """Stop every started node, print what is left of their output, and the per-rank table."""
        import ray

        if reason:
            say(f"stopping all nodes: {reason}", self.out)
        stops = {i: self.agents[i].stop.remote(STOP_GRACE_S) for i in sorted(self.started)}
        outcomes: dict[int, NodeOutcome] = {}
        for i, ref in stops.items():
            host = self.where[i]["ip"]
            try:
                ray.get(ref, timeout=STOP_GRACE_S * 2 + CALL_TIMEOUT_S)
                lines, _, _ = ray.get(self.agents[i].poll.remote(0, 10**9), timeout=CALL_TIMEOUT_S)
                outcomes[i] = ray.get(self.agents[i].outcome.remote(host), timeout=CALL_TIMEOUT_S)
            except Exception as e:
                outcomes[i] = NodeOutcome(node=i, host=host, exit_code=None, problem=f"{type(e).__name__}: {e}")
                continue
            if reason:  # the tail of stopped nodes (already-printed lines were dropped by their polls)
                for line in lines:
                    print(f"[node {i}] {line}", file=self.out, flush=True)
        rows = rank_rows(rank_table(self.spec.nnodes, self.spec.nproc_per_node), outcomes, first_node)
        say(f"job ended {time.monotonic() - self.t0:.1f} s after launch; per-rank status:", self.out)
        print(format_table(rows), file=self.out, flush=True)
        return rows

    def shutdown(self) -> None:
        """Best effort, bounded: agents clean their temp logs, then they and the placement group go."""
        import ray

        for a in self.agents:
            try:
                ray.get(a.cleanup.remote(), timeout=10)
            except Exception:
                pass
            ray.kill(a)
        if self.pg is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.pg)


def connect(spec: LaunchSpec, pythonpath: list[str], timeout_s: float) -> None:
    import ray

    address = spec.address
    if address == "auto" and os.environ.get("RAY_ADDRESS"):
        address = os.environ["RAY_ADDRESS"]
    if address != "auto":
        check_reachable(address, timeout_s)
    node_ip = spec.node_ip_address or (loopback_host(address) if address != "auto" else None)
    # The agents import launch.torchrun_ray on every node: REPO first, then the launcher's PYTHONPATH.
    runtime_env = {"env_vars": {"PYTHONPATH": os.pathsep.join(dict.fromkeys([str(REPO), *pythonpath])),
                                "RAY_USAGE_STATS_ENABLED": "0"}}
    try:
        ray.init(address=address, _node_ip_address=node_ip, runtime_env=runtime_env, log_to_driver=False,
                 configure_logging=False)
    except ConnectionError as e:
        raise LaunchError(f"could not join the Ray cluster at --address {address}: {e}") from e


def run(spec: LaunchSpec, cwd: str | None = None, environ: dict[str, str] | None = None, out=None) -> int:
    """The whole launch; returns the process exit code (0 only if every rank exited 0)."""
    import ray

    out = out or sys.stdout
    cwd = cwd or os.getcwd()
    environ = dict(os.environ if environ is None else environ)
    pythonpath = absolute_pythonpath(environ.get("PYTHONPATH", ""), cwd)
    entry = resolve_entry(spec, cwd, pythonpath)  # a missing script fails before Ray is touched
    connect(spec, pythonpath, timeout_s=min(10.0, spec.start_timeout_s))
    # After ray.init, which installs its own SIGTERM handler (sys.exit): SIGTERM stops the nodes like Ctrl-C.
    # SIGINT explicitly too: a process started as a background job of a script inherits SIGINT *ignored*, and
    # Python then keeps it ignored, so Ctrl-C / `kill -INT` would leave the launcher and every node running (this
    # was the "flake" of test_sigint_stops_everything: the suite had been started in the background).
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _sigterm_as_interrupt)
        signal.signal(signal.SIGINT, signal.default_int_handler)
    job = Job(spec, entry, cwd, node_env(environ, pythonpath, spec.extra_env), out)
    reason, exit_code, first_node = "", 1, None
    try:
        try:
            job.place()
            job.start()
            reason, first_node = job.stream()
            exit_code = EXIT_TIMEOUT if reason.startswith("--timeout") else 1
        except TimeoutError as e:  # --timeout ran out while placing or starting
            reason, exit_code = str(e), EXIT_TIMEOUT
        except KeyboardInterrupt:
            reason, exit_code = "interrupted (SIGINT/SIGTERM)", EXIT_INTERRUPTED
        except LaunchError as e:  # some nodes may already run torchrun: stop them before saying why
            if job.started:
                job.stop_and_report(str(e))
            raise
        try:
            rows = job.stop_and_report(reason, first_node)
        except KeyboardInterrupt:  # a second Ctrl-C: the agents' own cleanup is all that is left
            rows = []
        failed = failed_ranks(rows)
        for r in failed:
            err = r.error[-1].strip() if r.error else "no stderr"
            say(f"{'FAILED first' if r.first else 'also failed'}: rank {r.rank} (node {r.node}, local rank "
                f"{r.local_rank}, exit {r.exit_code}): {err}", out)
        if not reason and rows and all(r.status == "ok" for r in rows):
            say(f"all {len(rows)} ranks exited 0", out)
            return 0
        return exit_code
    finally:
        job.shutdown()
        ray.shutdown()


def _sigterm_as_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    from .plan import parse_args

    argv = sys.argv[1:] if argv is None else argv
    try:
        return run(parse_args(argv))
    except (LaunchInputError, LaunchError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
