"""`up` / `down` over SSH: the head on the first host, a worker on each of the others.

Each host runs `python -m launch.cluster head|worker|wait|stop ...` through `ssh [user@]host <command>`,
from a working dir and with a python that default to this machine's (the usual shared file system).
Ray's token goes to every host on ssh's stdin, never on a command line.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from launch.cluster import auth

_REPO = str(Path(__file__).resolve().parents[2])


@dataclass
class SshConfig:
    user: str | None = None
    python: str = sys.executable  # on the remote hosts
    workdir: str = _REPO  # on the remote hosts: the repository root
    options: list[str] = field(default_factory=list)  # extra `ssh` arguments, e.g. ["-p", "2222"]
    state_dir: str | None = None  # passed as --state-dir to every remote command
    timeout_s: float = 300  # per ssh command


def remote_command(cfg: SshConfig, args: list[str]) -> str:
    """The shell line the remote login shell runs (pure)."""
    wd = shlex.quote(cfg.workdir)
    state = ["--state-dir", cfg.state_dir] if cfg.state_dir else []
    tool = " ".join(shlex.quote(a) for a in [cfg.python, "-m", "launch.cluster", args[0], *state, *args[1:]])
    return f"cd {wd} && PYTHONPATH={wd}${{PYTHONPATH:+:$PYTHONPATH}} exec {tool}"


def ssh_argv(cfg: SshConfig, host: str, args: list[str]) -> list[str]:
    target = f"{cfg.user}@{host}" if cfg.user else host
    # BatchMode: fail instead of prompting for a password that nobody will type.
    return ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=15", *cfg.options, target,
            remote_command(cfg, args)]


class HostError(RuntimeError):
    def __init__(self, host: str, what: str, detail: str):
        super().__init__(f"{what} on host {host} failed: {detail}")
        self.host = host


def run_on(cfg: SshConfig, host: str, args: list[str], stdin: str | None = None,
           timeout_s: float | None = None) -> str:
    """Run one launch.cluster command on a host; its stdout, or HostError naming the host."""
    timeout_s = timeout_s or cfg.timeout_s
    try:
        proc = subprocess.run(ssh_argv(cfg, host, args), input=stdin or "", capture_output=True, text=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise HostError(host, f"`{args[0]}`", f"no answer within {timeout_s:.0f} s") from None
    except FileNotFoundError:
        raise HostError(host, f"`{args[0]}`", "no `ssh` on PATH") from None
    if proc.returncode != 0:
        why = "ssh could not connect" if proc.returncode == 255 else f"exit {proc.returncode}"
        raise HostError(host, f"`{args[0]}`", f"{why}:\n{(proc.stderr or proc.stdout)[-2000:]}")
    return proc.stdout


def _address_from(stdout: str, host: str) -> str:
    for line in stdout.splitlines():
        if line.startswith("RAY_ADDRESS="):
            return line.split("=", 1)[1].strip()
    raise HostError(host, "`head`", f"it printed no RAY_ADDRESS line:\n{stdout[-2000:]}")


def up(hosts: list[str], cfg: SshConfig, port: int = 6379, node_args: list[str] | None = None,
       head_args: list[str] | None = None, timeout_s: float = 300, log=print) -> str:
    """Start the cluster; returns the head's address. If any host fails, what was started is stopped again and
    the error names the host."""
    if not hosts:
        raise ValueError("--hosts is empty")
    if len(set(hosts)) != len(hosts):
        raise ValueError(f"--hosts lists a host twice: {hosts}")
    node_args = list(node_args or [])
    token = auth.ensure_token() if auth.auth_enabled() else None
    token_args, stdin = (["--auth-token-stdin"], token + "\n") if token else ([], None)
    head, workers = hosts[0], hosts[1:]
    started: list[str] = []
    try:
        started.append(head)
        out = run_on(cfg, head, ["head", "--node-ip-address", head, "--port", str(port), *token_args, *node_args,
                                 *(head_args or [])], stdin)
        address = _address_from(out, head)
        log(f"head {head}: {address}")

        def start_worker(host):
            run_on(cfg, host, ["worker", "--address", address, "--node-ip-address", host, *token_args, *node_args],
                   stdin)
            return host

        errors = []
        with ThreadPoolExecutor(max_workers=min(16, max(1, len(workers)))) as pool:
            futures = {pool.submit(start_worker, h): h for h in workers}
            for fut, host in futures.items():
                try:
                    fut.result()
                    started.append(host)
                    log(f"worker {host}: joined")
                except HostError as e:
                    errors.append(e)
        if errors:
            raise errors[0]
        run_on(cfg, head, ["wait", "--address", address, "--nodes", str(len(hosts)), "--timeout", str(timeout_s),
                           "--node-ip-address", head], timeout_s=max(cfg.timeout_s, timeout_s + 60))
        return address
    except BaseException:
        failed = down(started, cfg, log=log)
        if failed:
            log(f"cleanup failed on: {', '.join(failed)}")
        raise


def down(hosts: list[str], cfg: SshConfig, log=print) -> list[str]:
    """Stop this tool's nodes on every host: the workers (in parallel), then the head. Returns the hosts where
    that failed."""

    def stop(host):
        try:
            out = run_on(cfg, host, ["stop", "--node-ip-address", host])
            log(f"{host}: {out.strip() or 'nothing to stop'}")
            return None
        except HostError as e:
            log(str(e))
            return host

    with ThreadPoolExecutor(max_workers=min(16, max(1, len(hosts) - 1))) as pool:
        failed = [h for h in pool.map(stop, hosts[1:]) if h]
    return failed + [h for h in map(stop, hosts[:1]) if h]


def hosts_arg(text: str) -> list[str]:
    return [h.strip() for h in text.split(",") if h.strip()]

