"""Start, inspect and stop a multi-node Ray cluster, on this host or over ssh (`python -m launch.cluster <command>`).

The argparse layer over node, status and ssh.

Errors that are the user's to fix (bad address, port in use, unreachable head, failing host) print one
clear line and exit 1 instead of a traceback.
"""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import sys
import time

from launch.cluster import auth, net, node, ssh, status


def _node_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--node-ip-address", default=None,
                   help="address (or host name) this node advertises; default: this host's address toward the "
                        "head (workers) or its primary address (head); never 0.0.0.0")
    p.add_argument("--num-cpus", type=int, default=None)
    p.add_argument("--num-gpus", type=int, default=None)
    p.add_argument("--temp-dir", default=None, help="Ray's temp dir for this node (default /tmp/hfray-<uid>-<node>)")
    p.add_argument("--ray-args", default="",
                   help="more `ray start` arguments as one shell-quoted string, written --ray-args=\"...\" "
                        "(its value starts with --), e.g. --ray-args=\"--object-store-memory=1000000000\"")
    p.add_argument("--timeout", type=float, default=180, help="seconds to wait for the node to start")
    p.add_argument("--block", action="store_true",
                   help="stay in the foreground until SIGTERM/SIGINT, then stop the node (for srun steps)")
    p.add_argument("--auth-token-stdin", action="store_true",
                   help="read Ray's auth token from stdin and install it at the token path (used by `up`)")


def _state_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--state-dir", default=None,
                   help="where pid files and logs go (default $HYBRIDFLOW_CLUSTER_STATE_DIR or "
                        f"{node.DEFAULT_STATE_DIR}), one subdir per host name")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m launch.cluster", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("head", help="start the head node on this host")
    _node_args(p)
    _state_arg(p)
    p.add_argument("--port", type=int, default=6379, help="the GCS port workers and drivers connect to")
    p.add_argument("--dashboard-host", default=None, help="dashboard bind address (default: the node's address)")
    p.add_argument("--dashboard-port", type=int, default=8265)
    p.add_argument("--no-dashboard", action="store_true", help="no dashboard (no `ray job submit` either)")

    p = sub.add_parser("worker", help="start a worker node on this host and join a head")
    _node_args(p)
    _state_arg(p)
    p.add_argument("--address", required=True, help="the head's HOST:PORT")
    p.add_argument("--connect-timeout", type=float, default=15, help="seconds to wait for the head to answer")

    p = sub.add_parser("stop", help="stop the nodes this tool started on this host")
    _state_arg(p)
    p.add_argument("--node-ip-address", default=None, help="only the node(s) with this address")
    p.add_argument("--grace", type=float, default=10.0, help="most seconds between SIGTERM and SIGKILL")

    for name, what in (("status", "list the cluster's nodes"), ("wait", "wait until --nodes nodes are alive")):
        p = sub.add_parser(name, help=what)
        _state_arg(p)
        p.add_argument("--address", default=None, help="the head's HOST:PORT (default: from this host's pid files)")
        p.add_argument("--node-ip-address", default=None, help="this host's node address, for the driver")
        p.add_argument("--timeout", type=float, default=60 if name == "status" else 300)
        p.add_argument("--json", action="store_true")
        if name == "wait":
            p.add_argument("--nodes", type=int, required=True)

    p = sub.add_parser("up", help="start a cluster over ssh: the head on the first host, workers on the rest")
    p.add_argument("--hosts", required=True, help="comma-separated host names or addresses; the first is the head")
    p.add_argument("--ssh-user", default=None)
    p.add_argument("--ssh-option", action="append", default=[], help="extra ssh argument (repeatable)")
    p.add_argument("--port", type=int, default=6379)
    p.add_argument("--timeout", type=float, default=300, help="seconds for every node to join")
    p.add_argument("--remote-python", default=sys.executable, help="python on the hosts (default: this one)")
    p.add_argument("--remote-workdir", default=ssh._REPO, help="repository root on the hosts (default: this one)")
    p.add_argument("--state-dir", default=None, help="the hosts' state dir (passed to every remote command)")
    p.add_argument("--num-cpus", type=int, default=None)
    p.add_argument("--num-gpus", type=int, default=None)
    p.add_argument("--no-dashboard", action="store_true")
    p.add_argument("--dashboard-port", type=int, default=8265)
    p.add_argument("--ray-args", default="", help="more `ray start` arguments for every node")

    p = sub.add_parser("down", help="stop the cluster `up` started (ssh to each host, `stop` there)")
    p.add_argument("--hosts", required=True)
    p.add_argument("--ssh-user", default=None)
    p.add_argument("--ssh-option", action="append", default=[])
    p.add_argument("--remote-python", default=sys.executable)
    p.add_argument("--remote-workdir", default=ssh._REPO)
    p.add_argument("--state-dir", default=None)
    return ap


def _node_ip(name: str | None, toward: str | None) -> str:
    """--node-ip-address as given (a literal, or a host name resolved here); a host *name* that resolves to
    loopback (Debian's 127.0.1.1 for its own hostname) is useless to other nodes: take the routed address."""
    if not name:
        return net.default_node_ip(toward)
    ip = net.resolve_ipv4(name)
    if ip.startswith("127.") and ip != name:
        routed = net.default_node_ip(toward)
        _log(f"note: {name} resolves to {ip} (loopback) here; using {routed} instead")
        return routed
    return ip


def _spec(a, role: str) -> node.NodeSpec:
    if role == "head":
        ip = _node_ip(a.node_ip_address, toward=None)
        return node.NodeSpec("head", ip, port=a.port, temp_dir=a.temp_dir, num_cpus=a.num_cpus,
                             num_gpus=a.num_gpus, dashboard=not a.no_dashboard, dashboard_host=a.dashboard_host,
                             dashboard_port=a.dashboard_port, ray_args=shlex.split(a.ray_args))
    head_host, _port = net.split_address(a.address)
    ip = _node_ip(a.node_ip_address, toward=net.resolve_ipv4(head_host))
    return node.NodeSpec("worker", ip, head_address=a.address, temp_dir=a.temp_dir, num_cpus=a.num_cpus,
                         num_gpus=a.num_gpus, ray_args=shlex.split(a.ray_args))


def _start(a, role: str) -> int:
    if a.auth_token_stdin:
        auth.install_token(sys.stdin.readline())
    spec = _spec(a, role)
    t0 = time.monotonic()
    rec = node.start_node(spec, a.state_dir, timeout_s=a.timeout,
                          **({"connect_timeout_s": a.connect_timeout} if role == "worker" else {}))
    print(f"started Ray {role} {spec.node_ip} (pid {rec['pid']}, temp dir {rec['temp_dir']}, log {rec['log']}) "
          f"in {time.monotonic() - t0:.1f} s", file=sys.stderr)
    if not auth.auth_enabled():
        print("warning: RAY_AUTH_MODE=disabled: anyone who reaches this node's ports can run code on it",
              file=sys.stderr)
    if role == "head":  # stdout: one line a script can parse (`up` and the sbatch script do)
        print(f"RAY_ADDRESS={spec.address}", flush=True)
        dash = f"http://{spec.dashboard_host or spec.node_ip}:{spec.dashboard_port}" if spec.dashboard else "off"
        print(f"dashboard: {dash}; drivers: export RAY_ADDRESS={spec.address}"
              + (" RAY_AUTH_MODE=token" if auth.auth_enabled() else ""), file=sys.stderr)
    return node.block_until_signal(rec) if a.block else 0


def _address(a) -> str:
    if a.address:
        return a.address
    recs = node.read_records(node.state_dir(a.state_dir))
    if not recs:
        raise ValueError("no --address given and no node started by this tool on this host "
                         f"(state dir {node.state_dir(a.state_dir)})")
    addresses = sorted({r["address"] for r in recs})
    if len(addresses) > 1:
        raise ValueError(f"this host has nodes of several clusters ({', '.join(addresses)}): pass --address")
    return addresses[0]


def _driver_ip(a, address: str) -> str | None:
    if a.node_ip_address:
        return net.resolve_ipv4(a.node_ip_address)
    recs = [r for r in node.read_records(node.state_dir(a.state_dir)) if r["address"] == address]
    return recs[0]["node_ip"] if recs else None


def _status(a, want: int | None) -> int:
    address = _address(a)
    nodes = status.cluster_nodes(address, want_nodes=want, timeout_s=a.timeout, node_ip=_driver_ip(a, address))
    print(json.dumps(nodes, indent=1) if a.json else f"Ray cluster {address}\n{status.format_table(nodes)}")
    return 0


def _ssh_cfg(a) -> ssh.SshConfig:
    return ssh.SshConfig(user=a.ssh_user, python=a.remote_python, workdir=a.remote_workdir, options=a.ssh_option,
                         state_dir=a.state_dir)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run(a) -> int:
    if a.command in ("head", "worker"):
        return _start(a, a.command)
    if a.command == "stop":
        ip = net.resolve_ipv4(a.node_ip_address) if a.node_ip_address else None
        stopped = node.stop_nodes(a.state_dir, node_ip=ip, grace_s=a.grace)
        for name, pids in stopped:
            print(f"stopped {name}: {len(pids)} processes")
        return 0
    if a.command == "status":
        return _status(a, None)
    if a.command == "wait":
        return _status(a, a.nodes)
    if a.command == "up":
        node_args = [f"--ray-args={a.ray_args}"] if a.ray_args else []  # "=": the value starts with --
        for flag, val in (("--num-cpus", a.num_cpus), ("--num-gpus", a.num_gpus)):
            if val is not None:
                node_args += [flag, str(val)]
        head_args = ["--no-dashboard"] if a.no_dashboard else ["--dashboard-port", str(a.dashboard_port)]
        t0 = time.monotonic()
        address = ssh.up(ssh.hosts_arg(a.hosts), _ssh_cfg(a), port=a.port, node_args=node_args,
                         head_args=head_args, timeout_s=a.timeout, log=_log)
        _log(f"all {len(ssh.hosts_arg(a.hosts))} nodes joined in {time.monotonic() - t0:.1f} s")
        print(f"RAY_ADDRESS={address}", flush=True)
        return 0
    if a.command == "down":
        failed = ssh.down(ssh.hosts_arg(a.hosts), _ssh_cfg(a), log=_log)
        return 1 if failed else 0
    raise AssertionError(a.command)


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    # SIGTERM as an exception: a node being started is stopped again (start_node cleans up on any exception) and
    # the driver child of `status`/`wait` is killed by subprocess.run on the way out, instead of being orphaned.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        return run(a)
    except (ValueError, RuntimeError, ConnectionError, TimeoutError) as e:
        print(f"launch.cluster {a.command}: error: {e}", file=sys.stderr)
        return 1
