"""Pure parts of `launch.torchrun_ray`: the command line, each node's torchrun command, ranks and env.

Nothing here touches Ray or starts a process, so all of it is tested without a cluster.
"""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import dataclass, field
from importlib.machinery import PathFinder
from pathlib import Path

# torchrun prefixes each worker line with this (TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE, torch >= 2.2); the
# default prefix names the local rank only, which repeats on every node.
RANK_PREFIX_TEMPLATE = "[rank${rank}]:"
RANK_PREFIX_RE = re.compile(r"^\[rank(\d+)\]:")

# Launcher env passed through to torchrun on every node (besides PYTHONPATH, handled apart): the knobs
# users set for SPMD jobs. CUDA_VISIBLE_DEVICES is left out on purpose: it names the launcher's devices,
# not the node's; with --gpus-per-node Ray sets it on each node from the reservation.
PASS_ENV_PREFIXES = ("NCCL_", "GLOO_", "TORCH_", "TORCHELASTIC_", "HF_", "TRANSFORMERS_", "HYBRIDFLOW_",
                     "MEGATRON_", "OMP_", "MKL_", "TOKENIZERS_", "WANDB_")
PASS_ENV_NAMES = ("PYTHONHASHSEED", "PYTHONUNBUFFERED")


class LaunchInputError(ValueError):
    """Bad command line, found before anything starts."""


@dataclass(frozen=True)
class LaunchSpec:
    nnodes: int
    nproc_per_node: int
    entry: list[str]  # ["script.py", args...] or ["-m", "module", args...]
    address: str = "auto"
    timeout_s: float | None = None
    start_timeout_s: float = 180.0
    master_port: int | None = None
    gpus_per_node: float = 0.0
    node_ip_address: str | None = None
    log_dir: str | None = None
    extra_env: dict[str, str] = field(default_factory=dict)
    torchrun_args: list[str] = field(default_factory=list)

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    @property
    def is_module(self) -> bool:
        return self.entry[0] == "-m"

    @property
    def target(self) -> str:
        """The script path or module name, for messages and process matching."""
        return self.entry[1] if self.is_module else self.entry[0]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m launch.torchrun_ray",
        usage="%(prog)s --nnodes N --nproc-per-node P [options] -- (script.py | -m module) [args ...]",
        description="Run an SPMD script with torchrun on N nodes of a Ray cluster, one torchrun per node.",
        epilog="Everything after `--` is the script and its arguments, or `-m module args...`.")
    ap.add_argument("--nnodes", type=int, required=True)
    ap.add_argument("--nproc-per-node", type=int, required=True)
    ap.add_argument("--address", default="auto", help="Ray cluster address host:port (default: auto, as ray.init)")
    ap.add_argument("--timeout", type=float, default=None, help="bound on the whole job in seconds")
    ap.add_argument("--start-timeout", type=float, default=180.0,
                    help="bound on placing the nodes and starting torchrun on each (seconds)")
    ap.add_argument("--master-port", type=int, default=None, help="default: a free port picked on node 0")
    ap.add_argument("--gpus-per-node", type=float, default=0.0,
                    help="GPUs to reserve on each node (Ray then sets CUDA_VISIBLE_DEVICES there)")
    ap.add_argument("--node-ip-address", default=None,
                    help="this machine's Ray node IP (default: the address's host when it is loopback)")
    ap.add_argument("--log-dir", default=None,
                    help="keep torchrun's per-rank logs under <dir>/node<i> on each node (default: a temp dir)")
    ap.add_argument("--env", action="append", default=[], metavar="KEY[=VALUE]",
                    help="extra env for the ranks; KEY alone passes the launcher's value")
    ap.add_argument("--torchrun-arg", action="append", default=[], metavar="ARG",
                    help="extra torchrun argument, e.g. --torchrun-arg=--max-restarts=0")
    return ap


def parse_args(argv: list[str], environ: dict[str, str] | None = None) -> LaunchSpec:
    environ = os.environ if environ is None else environ
    if "--" not in argv:
        if "-h" in argv or "--help" in argv:  # usage, exit 0: help needs no script
            build_parser().parse_args(["--help"])
        raise LaunchInputError("no script: put it after `--`, e.g. `-- train.py --lr 1e-4` or `-- -m pkg.mod`")
    cut = argv.index("--")
    a = build_parser().parse_args(argv[:cut])
    entry = list(argv[cut + 1:])
    if not entry or (entry[0] == "-m" and len(entry) < 2):
        raise LaunchInputError("no script after `--` (give `script.py args` or `-m module args`)")
    if a.nnodes < 1 or a.nproc_per_node < 1:
        raise LaunchInputError(f"--nnodes ({a.nnodes}) and --nproc-per-node ({a.nproc_per_node}) must be >= 1")
    for name, val in (("--timeout", a.timeout), ("--start-timeout", a.start_timeout)):
        if val is not None and val <= 0:
            raise LaunchInputError(f"{name} must be > 0, got {val}")
    if a.master_port is not None and not 0 < a.master_port < 65536:
        raise LaunchInputError(f"--master-port {a.master_port} is not a TCP port")
    extra = {}
    for item in a.env:
        key, sep, val = item.partition("=")
        if not sep:
            if key not in environ:
                raise LaunchInputError(f"--env {key}: not set in the launcher's environment")
            val = environ[key]
        extra[key] = val
    return LaunchSpec(nnodes=a.nnodes, nproc_per_node=a.nproc_per_node, entry=entry, address=a.address,
                      timeout_s=a.timeout, start_timeout_s=a.start_timeout, master_port=a.master_port,
                      gpus_per_node=a.gpus_per_node, node_ip_address=a.node_ip_address, log_dir=a.log_dir,
                      extra_env=extra, torchrun_args=list(a.torchrun_arg))


def find_module_file(name: str, sys_path: list[str]) -> str | None:
    """Locate a module's file the way `python -m` would, without importing it or its parent packages
    (a package __init__ may pull in torch or megatron: seconds of work for a yes/no)."""
    search = list(sys_path)
    spec = None
    for part in name.split("."):
        spec = PathFinder.find_spec(part, search)
        if spec is None:
            return None
        search = list(spec.submodule_search_locations or [])
    if spec.submodule_search_locations:  # a package runs as its __main__
        main = PathFinder.find_spec("__main__", list(spec.submodule_search_locations))
        return main.origin if main else None
    return spec.origin


def resolve_entry(spec: LaunchSpec, cwd: str, pythonpath: list[str]) -> list[str]:
    """The entry with an absolute script path; raises LaunchInputError if the script or module is missing.
    Nodes run in the launcher's working directory, so a module is looked up from there and PYTHONPATH."""
    if spec.is_module:
        if find_module_file(spec.entry[1], [cwd, *pythonpath]) is None:
            raise LaunchInputError(f"module {spec.entry[1]!r} not found from {cwd} or PYTHONPATH {pythonpath}")
        return list(spec.entry)
    script = Path(cwd, spec.entry[0])
    if not script.is_file():
        raise LaunchInputError(f"script {spec.entry[0]!r} not found ({script} is not a file)")
    return [str(script.resolve()), *spec.entry[1:]]


def absolute_pythonpath(value: str, cwd: str) -> list[str]:
    """PYTHONPATH entries made absolute against the launcher's cwd (an empty entry means the cwd)."""
    return [str(Path(cwd, p or ".").resolve()) for p in value.split(os.pathsep)] if value else []


def node_env(launcher_env: dict[str, str], pythonpath: list[str], extra: dict[str, str]) -> dict[str, str]:
    """Env for torchrun on each node: the pass-through knobs, PYTHONPATH, --env, and the rank prefix."""
    env = {k: v for k, v in launcher_env.items() if k.startswith(PASS_ENV_PREFIXES) or k in PASS_ENV_NAMES}
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(pythonpath)
    env.update(extra)
    env["TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"] = RANK_PREFIX_TEMPLATE
    return env


def torchrun_command(python: str, spec: LaunchSpec, entry: list[str], node_rank: int, master_addr: str,
                     master_port: int, log_dir: str) -> list[str]:
    """One node's torchrun: static rendezvous on node 0's address, every rank's output teed to the console
    (prefixed with its global rank) and to per-rank files under log_dir, which the summary reads."""
    cmd = [python, "-m", "torch.distributed.run",
           f"--nnodes={spec.nnodes}", f"--nproc-per-node={spec.nproc_per_node}", f"--node-rank={node_rank}",
           f"--master-addr={master_addr}", f"--master-port={master_port}",
           "--max-restarts=0", "--tee=3", f"--log-dir={log_dir}", *spec.torchrun_args]
    return [*cmd, *entry]


@dataclass(frozen=True)
class RankSlot:
    rank: int
    node: int
    local_rank: int


def rank_table(nnodes: int, nproc_per_node: int) -> list[RankSlot]:
    """Global rank of each (node, local rank): with static rendezvous torchrun's group rank is --node-rank,
    and global ranks are node_rank * nproc + local_rank."""
    return [RankSlot(n * nproc_per_node + lr, n, lr) for n in range(nnodes) for lr in range(nproc_per_node)]


def loopback_host(address: str) -> str | None:
    """The host of host:port when it is a 127.x address, else None. A driver that reaches Ray over
    loopback is on a node bound to that address and must say so to ray.init (FACTS: simulated clusters)."""
    host = address.rsplit(":", 1)[0]
    return host if host.startswith("127.") else None
