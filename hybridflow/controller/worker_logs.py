"""A worker process's output goes to its own log file; the console gets only what matters.

Without this, every rank's library chatter (megatron-core's UserWarnings about Transformer Engine
and Apex, vLLM's start-up INFO lines, kineto's profiler lines) reaches the driver through Ray's
log_to_driver and interleaves with the progress bar. `redirect_worker_output` (WorkerHost, at actor
start, before any role imports megatron or vLLM) points file descriptors 1 and 2 at
`<log_dir>/<role>_rank<r>.log`, so C-level prints and vLLM's own stdout handler land there too,
and keeps a handle on the original stderr (which Ray forwards) for:

- every log record at ERROR or above, from any logger;
- WARNING records of our own code (hybridflow.*, megatron_workers.*), each distinct message once per
  process: config warnings are worth seeing, not once per step.

Failures of worker methods travel to the driver as tracebacks anyway (WorkerHost.call).
"""

from __future__ import annotations

import logging
import os
import sys

OUR_LOGGERS = ("hybridflow", "megatron_workers")
LOG_DIR_ENV = "HYBRIDFLOW_WORKER_LOG_DIR"


def log_file_name(role: str, rank: int) -> str:
    return f"{role.replace('+', '_')}_rank{rank}.log"


class ConsoleWorthy(logging.Filter):
    """Errors always; our own warnings once per distinct message; nothing else."""

    def __init__(self):
        super().__init__()
        self.seen: set[tuple[str, str]] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR:
            return True
        if record.levelno < logging.WARNING or not record.name.startswith(OUR_LOGGERS):
            return False
        key = (record.name, record.getMessage())
        if key in self.seen:
            return False
        self.seen.add(key)
        return True


def redirect_worker_output(log_dir: str, role: str, rank: int) -> str:
    """Point this process's stdout/stderr at its log file; returns the file's path. Idempotent per process."""
    os.makedirs(log_dir, exist_ok=True)
    path = os.path.join(log_dir, log_file_name(role, rank))
    root = logging.getLogger()
    if any(getattr(h, "_hybridflow_console", False) for h in root.handlers):
        return path
    sys.stdout.flush()
    sys.stderr.flush()
    console = os.fdopen(os.dup(2), "w", buffering=1)  # what Ray forwards to the driver
    log_fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    fmt = logging.Formatter(f"%(asctime)s %(levelname)s [{role} rank {rank}] %(name)s: %(message)s")
    to_console = logging.StreamHandler(console)
    to_console.setFormatter(fmt)
    to_console.addFilter(ConsoleWorthy())
    to_console._hybridflow_console = True
    to_file = logging.StreamHandler(sys.stderr)  # fd 2, now the log file: every record, ours and libraries'
    to_file.setFormatter(fmt)
    root.addHandler(to_console)
    root.addHandler(to_file)
    if root.level > logging.INFO or root.level == logging.NOTSET:
        root.setLevel(logging.INFO)
    print(f"worker log of {role} rank {rank} (pid {os.getpid()})", flush=True)
    return path
