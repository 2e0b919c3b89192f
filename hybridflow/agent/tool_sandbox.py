"""Runs one tool call in a fresh, memory-capped, network-less child process; async, so calls overlap.

Tools are untrusted code. As the sandboxed reward (hybridflow/rewards/sandbox.py) does for a batch, every
call starts a fresh `python -I -S hybridflow/agent/tool_child.py` child, which caps its own address space
(RLIMIT_AS) and cuts itself off the network before it imports the user's file (what exactly is and is not
blocked: tool_child's docstring). The parent sends the call as JSON on stdin and reads one JSON line back;
it never unpickles anything from the child. A call past `timeout_s` is killed with its whole process group
(SIGKILL). Whatever goes wrong (the tool raises, hangs, returns a non-string, runs out of memory, the child
dies) becomes an error observation `error: <Kind>: <detail>` for the model, never an exception in the loop.

Measured (2-core x86 box, Python 3.11; tests/test_agent_sandbox.py::test_overhead prints it): a call of a
tool that returns at once takes ~25-35 ms of wall time and ~19 ms of CPU (16 ms without the network
namespace), nearly all of it the interpreter's start (`python -I -S`: 10 ms of CPU for `pass`); the user
file's own imports come on top, every call. 64 trajectories each calling a 50 ms tool finish in ~0.8-1.3 s,
x6 faster than one after another on an idle box, x4 at load 1
(tests/test_agent_loop.py::test_many_trajectories_overlap_tool_calls): the concurrent run is bound by the
CPU of starting 64 interpreters. A fork server (one clean process forking a child per call) would cut that.
"""

from __future__ import annotations

import asyncio
import json
import marshal
import math
import os
import signal
import sys
import time
from dataclasses import dataclass

_CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tool_child.py")


@dataclass
class ToolResult:
    """One call's outcome. `text` is what the model reads: the tool's string, or `error: ...`."""

    text: str
    status: str  # "ok" | "error" | "timeout"
    latency_s: float

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def error_text(kind: str, detail: str) -> str:
    return f"error: {kind}: {detail}"


class ToolSandbox:
    """Runs tool functions in child processes: at most `max_concurrency` children at once.

    netns=False skips the network namespace (the socket block stays), for kernels that are slow to make one.
    """

    def __init__(self, timeout_s: float = 10.0, memory_mb: int = 512, max_concurrency: int = 64,
                 netns: bool = True):
        if not timeout_s > 0:
            raise ValueError(f"tool sandbox: timeout_s={timeout_s} must be > 0 (multi_turn.tool_timeout_s)")
        if memory_mb < 64:
            raise ValueError(f"tool sandbox: memory_mb={memory_mb} must be >= 64 (multi_turn.tool_memory_mb)")
        if max_concurrency < 1:
            raise ValueError(f"tool sandbox: max_concurrency={max_concurrency} must be >= 1")
        self.timeout_s, self.memory_mb, self.max_concurrency, self.netns = timeout_s, memory_mb, max_concurrency, netns
        self._slots: asyncio.Semaphore | None = None
        self._slots_loop = None

    def _job(self, mode: str, path: str, function: str = "", arguments: dict | None = None) -> bytes:
        return marshal.dumps({"mode": mode, "path": path, "function": function, "arguments": arguments or {},
                           "memory_mb": self.memory_mb, "cpu_s": max(1, math.ceil(self.timeout_s)) + 1,
                           "netns": self.netns, "sys_path": [p for p in sys.path if p]})

    def _semaphore(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        if self._slots is None or self._slots_loop is not loop:  # one per event loop (asyncio.run per step)
            self._slots, self._slots_loop = asyncio.Semaphore(self.max_concurrency), loop
        return self._slots

    async def call(self, path: str, function: str, arguments: dict) -> ToolResult:
        """Runs `function(**arguments)` from the file at `path`; never raises for the tool's faults."""
        async with self._semaphore():
            start = time.perf_counter()
            status, text = await self._call(self._job("call", path, function, arguments))
            return ToolResult(text=text, status=status, latency_s=time.perf_counter() - start)

    async def _call(self, job: bytes) -> tuple[str, str]:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-I", "-S", _CHILD, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, start_new_session=True)  # its own group: a kill takes its children
        try:
            stdout, stderr = await asyncio.wait_for(proc.communicate(job), timeout=self.timeout_s)
        except TimeoutError:
            _kill_group(proc.pid)
            await _reap(proc)
            return "timeout", error_text("TimeoutError", f"the tool ran past {self.timeout_s:g} s and was killed")
        except BaseException:  # cancelled (the trajectory's own timeout): no orphan child
            _kill_group(proc.pid)
            await _reap(proc)
            raise
        _kill_group(proc.pid)  # anything the tool started and left running
        return _reply(proc.returncode, stdout, stderr)

    def describe(self, path: str, timeout_s: float = 60.0) -> dict:
        """Imports the file in a sandboxed child (blocking, at load time) and lists its tools as JSON."""
        import subprocess

        try:
            proc = subprocess.run([sys.executable, "-I", "-S", _CHILD], input=self._job("describe", path),
                                  capture_output=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return {"ok": False, "error": f"TimeoutError: importing it took over {timeout_s:g} s"}
        status, text = _reply(proc.returncode, proc.stdout, proc.stderr)
        if status != "ok":
            return {"ok": False, "error": text.removeprefix("error: ")}
        return json.loads(text)


def _reply(returncode: int | None, stdout: bytes, stderr: bytes) -> tuple[str, str]:
    """(status, text) from what the child wrote: its JSON line, or what is known of its death."""
    lines = stdout.decode(errors="replace").strip().splitlines()
    try:
        reply = json.loads(lines[-1])
    except (IndexError, ValueError):
        tail = (stderr.decode(errors="replace").strip().splitlines() or [""])[-1][:300]
        if returncode is not None and returncode < 0:
            detail = f"the tool process died of signal {signal.Signals(-returncode).name}"
        else:
            detail = f"the tool process exited with {returncode} and no result"
        return "error", error_text("ChildProcessError", detail + (f" ({tail})" if tail else ""))
    if "tools" in reply:  # describe mode: the caller reads the JSON
        return "ok", json.dumps(reply)
    if reply.get("ok"):
        return "ok", str(reply["result"])
    kind, _, detail = str(reply.get("error", "unknown")).partition(": ")
    return "error", error_text(kind, detail)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


async def _reap(proc: asyncio.subprocess.Process) -> None:
    try:
        await asyncio.wait_for(proc.wait(), timeout=5.0)
    except TimeoutError:  # a zombie we cannot reap: leave it to the event loop's child watcher
        pass
