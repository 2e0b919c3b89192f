"""The per-node side of `launch.torchrun_ray`: a Ray actor that runs one torchrun and reports on it.

The launcher creates one `NodeAgent` per node (STRICT_SPREAD placement group), asks node 0 for its IP and a
free port, starts torchrun on every node, then polls each agent for new output lines until all exit or one
fails, and stops the rest. The actor reserves almost no CPU (0.01): torchrun's ranks need the node's cores.
"""

from __future__ import annotations

import collections
import glob
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from hybridflow.controller.worker import free_port

from .plan import LaunchSpec, torchrun_command
from .report import NodeOutcome, parse_failures

JOB_TAG_ENV = "HF_TORCHRUN_RAY_TAG"  # marks every process of one node's torchrun tree


class NodeAgent:
    TORCHRUN_TAIL = 400  # torchrun's own (unprefixed) lines kept for its failure report

    def __init__(self, node: int):
        self.node = node
        self.proc: subprocess.Popen | None = None
        self.lines: list[str] = []
        self.acked = 0  # absolute index of self.lines[0]
        self.lock = threading.Lock()
        self.torchrun_tail: collections.deque[str] = collections.deque(maxlen=self.TORCHRUN_TAIL)
        self.log_dir = ""
        self.own_log_dir = False
        self.stopped = False
        self.tag = ""
        self.reader: threading.Thread | None = None

    def where(self) -> dict:
        import ray

        return {"ip": ray.util.get_node_ip_address(), "hostname": socket.gethostname(), "port": free_port(),
                "node_id": ray.get_runtime_context().get_node_id()}

    def start(self, spec: LaunchSpec, entry: list[str], master_addr: str, master_port: int, env: dict[str, str],
              cwd: str, job_tag: str) -> dict:
        """Start this node's torchrun with this node's interpreter (the actor's sys.executable: the node's venv,
        not a path from the launcher's machine). Every process of the tree carries JOB_TAG_ENV=job_tag, so
        stop() finds workers torchrun started in their own sessions even if torchrun is gone."""
        if not os.path.isdir(cwd):
            raise FileNotFoundError(f"node {self.node}: working directory {cwd} does not exist here "
                                    "(nodes run in the launcher's directory: use a shared filesystem or image)")
        if spec.log_dir:
            self.log_dir = os.path.join(spec.log_dir, f"node{self.node}")
            os.makedirs(self.log_dir, exist_ok=True)
        else:
            self.log_dir, self.own_log_dir = tempfile.mkdtemp(prefix=f"hf_trr{self.node}_"), True
        self.tag = f"{job_tag}:{self.node}"
        self._start_watchdog()
        cmd = torchrun_command(sys.executable, spec, entry, self.node, master_addr, master_port, self.log_dir)
        full_env = {**os.environ, **env, JOB_TAG_ENV: self.tag}
        self.proc = subprocess.Popen(cmd, env=full_env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True,
                                     text=True, errors="replace", bufsize=1)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        return {"pid": self.proc.pid, "cmd": cmd, "log_dir": self.log_dir}

    def _start_watchdog(self) -> None:
        """A detached process that kills this node's tagged tree (and removes the temp logs) once this actor
        process is gone (see watchdog.py: Ray SIGKILLs torchrun with the actor, which would orphan the ranks)."""
        import psutil

        me = psutil.Process(os.getpid())
        env = {k: v for k, v in os.environ.items() if k != JOB_TAG_ENV}
        temp = [self.log_dir] if self.own_log_dir else []
        subprocess.run([sys.executable, "-m", "launch.torchrun_ray.watchdog", str(me.pid), repr(me.create_time()),
                        self.tag, *temp], env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, check=True, timeout=60)

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            line = line.rstrip("\n")
            with self.lock:
                self.lines.append(line)
                if not line.startswith("[rank"):
                    self.torchrun_tail.append(line)
        self.proc.stdout.close()

    def poll(self, ack: int, max_lines: int = 2000) -> tuple[list[str], int, int | None]:
        """Lines from absolute index `ack` on (those before are dropped: the launcher has printed them),
        the index after the last line returned, and torchrun's exit code (None while it runs or while its
        output is still being read)."""
        with self.lock:
            drop = max(0, min(ack - self.acked, len(self.lines)))
            del self.lines[:drop]
            self.acked += drop
            out = self.lines[:max_lines]
        code = self.proc.poll() if self.proc else None
        if code is not None and self.reader is not None and self.reader.is_alive():
            code = None  # exited, but its last lines are not read yet
        return out, self.acked + len(out), code

    def stop(self, grace_s: float = 10.0) -> int | None:
        """SIGTERM torchrun (it stops its workers), SIGKILL it after grace_s, then SIGKILL any process still
        carrying this node's job tag (workers live in their own sessions, so no process group covers them).
        Returns torchrun's exit code."""
        code = None
        if self.proc is not None:
            if self.proc.poll() is None:
                self.stopped = True
                self.proc.send_signal(signal.SIGTERM)
            try:
                code = self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                code = self.proc.wait(timeout=10)
        if self.tag:
            kill_tagged(self.tag, timeout_s=grace_s)
        return code

    def outcome(self, host: str, tail_lines: int = 20) -> NodeOutcome:
        """Exit status, torchrun's failure report and each local rank's stderr tail and error file."""
        if self.reader is not None:
            self.reader.join(timeout=5)
        code = self.proc.poll() if self.proc else None
        tails: dict[int, list[str]] = {}
        messages: dict[int, str] = {}
        attempts = sorted(glob.glob(os.path.join(self.log_dir, "*", "attempt_*")), key=os.path.getmtime)
        if attempts:
            for rank_dir in Path(attempts[-1]).iterdir():
                if not rank_dir.name.isdigit():
                    continue
                local = int(rank_dir.name)
                err = rank_dir / "stderr.log"
                if err.is_file():
                    tails[local] = [ln for ln in err.read_text(errors="replace").splitlines() if ln.strip()][
                        -tail_lines:]
                msg = _error_file_message(rank_dir / "error.json")
                if msg:
                    messages[local] = msg
        with self.lock:
            report = "\n".join(self.torchrun_tail)
        failures, root = parse_failures(report)
        return NodeOutcome(node=self.node, host=host, exit_code=code, stopped=self.stopped, failures=failures,
                           root_cause=root, stderr_tails=tails, error_messages=messages)

    def cleanup(self) -> None:
        if self.own_log_dir and self.log_dir:
            shutil.rmtree(self.log_dir, ignore_errors=True)


def _error_file_message(path: Path) -> str | None:
    """The message a rank wrote through torch's @record (TORCHELASTIC_ERROR_FILE), if any."""
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        msg = data.get("message", {})
        return (msg.get("message") if isinstance(msg, dict) else str(msg)) or None
    except (OSError, ValueError, AttributeError):
        return None


def tagged_processes(tag: str) -> list:
    """Processes of this user whose environment has JOB_TAG_ENV=tag."""
    import psutil

    found = []
    for p in psutil.process_iter():
        try:
            if p.environ().get(JOB_TAG_ENV) == tag:
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, OSError):
            pass
    return found


def kill_tagged(tag: str, timeout_s: float, term_first: bool = False) -> int:
    """Give tagged processes timeout_s to exit (on torchrun's SIGTERM, or on ours with term_first), then
    SIGKILL them. Returns how many had to be killed."""
    import psutil

    procs = tagged_processes(tag)
    if term_first:
        for p in procs:
            try:
                p.terminate()
            except psutil.NoSuchProcess:
                pass
    _, alive = psutil.wait_procs(procs, timeout=timeout_s)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=5)
    return len(alive)
