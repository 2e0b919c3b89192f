"""Process groups for the tests, forked from one process that has already imported torch, megatron and vLLM.

Why: the multi-process tests (torchrun-style rank groups, the cross-pool pools) run a few seconds of work
per process, and each fresh interpreter first spends ~4-9 s of CPU importing torch, megatron.core, vLLM and
transformers (docs/index.md, "The tests"); torchrun's own launcher imports torch again. Here a long-lived server
per pytest process (a "zygote", as Android and multiprocessing's forkserver do it) pays those imports once; every
rank is a fork of it that then runs its script as `python script.py` would (sys.argv, sys.path[0], __main__,
its own environment, stdout and stderr), with torchrun's rank variables when asked for. The groups are as real as
before: separate processes, gloo over TCP, files on disk; only the launcher differs.

What a fork does not give, and so the real launcher stays in use where it matters: each rank has the server's
hash seed (torchrun's ranks each draw one; `random` and numpy are reseeded per rank), and torchrun itself is not
exercised (test_launch_torchrun_ray.py runs it, as the trainer does). HYBRIDFLOW_TEST_LAUNCHER=subprocess runs
every group as fresh interpreters instead (the old way: torch.distributed.run, or plain `python`), to tell a
launcher problem from a code problem.

Used as `run_group` / `torchrun` by the tests; run as `python rank_launch.py --serve` by run_group itself.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# What a group's processes import anyway, by profile (one server each, started when first asked for):
# megatron_workers first, so its lean import hook covers megatron.core. "megatron" and "vllm" are for processes
# that must not import the other (test_cross_pool_sync.py's two pools check exactly that).
PRELOADS = {
    "all": ("torch", "torch.distributed", "megatron_workers", "megatron.core", "megatron.core.parallel_state",
            "vllm", "transformers", "safetensors.torch"),
    "megatron": ("torch", "torch.distributed", "megatron_workers", "megatron.core", "megatron.core.parallel_state",
                 "transformers", "safetensors.torch"),
    "vllm": ("torch", "torch.distributed", "vllm", "transformers", "safetensors.torch"),
    "torch": ("torch", "torch.distributed"),
}
SERVER_START_TIMEOUT_S = 300  # the preload takes ~10 s of CPU on a loaded 2-core box; far more means it hung


@dataclass
class Proc:
    """One process of a group: `python argv[0] argv[1:]` with this environment, forked from the server that
    preloaded PRELOADS[preload]."""
    argv: list[str]
    env: dict[str, str] = field(default_factory=lambda: dict(os.environ))
    preload: str = "all"


@dataclass
class Result:
    returncode: int  # -9: killed (after a peer failed and the grace ran out, or at the timeout)
    stdout: str
    stderr: str


def _fresh_interpreters() -> bool:
    return os.environ.get("HYBRIDFLOW_TEST_LAUNCHER", "fork") == "subprocess"


# ---- the client (in the pytest process) ---------------------------------------------------------------------------

class _Server:
    """One launch server (a child of this process) and the bytes read from it past the last whole line."""

    def __init__(self, profile: str):
        self.profile, self.pending = profile, b""
        self.log = Path(tempfile.mkstemp(prefix=f"rank_launch_{profile}_", suffix=".log")[1])
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        with open(self.log, "w") as log:
            self.popen = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--serve", profile],
                                          cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                          stderr=log, text=True, bufsize=1)
        atexit.register(self.stop)
        ready = self.read_line(SERVER_START_TIMEOUT_S)
        if ready is None or json.loads(ready).get("ready") is not True:
            self.stop()
            raise RuntimeError(f"the rank-launch server ({profile}) did not start (rc={self.popen.poll()}):\n"
                               f"{self.tail()}")

    def alive(self) -> bool:
        return self.popen.poll() is None

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait()

    def send(self, request: dict) -> None:
        self.popen.stdin.write(json.dumps(request) + "\n")
        self.popen.stdin.flush()

    def read_line(self, timeout: float) -> str | None:
        """The next line, or None when `timeout` passes or the server dies first. Reads the pipe's fd itself: a
        buffered reader could hold the next line where select() cannot see it."""
        deadline = time.monotonic() + max(timeout, 0)
        fd = self.popen.stdout.fileno()
        while b"\n" not in self.pending:
            ready, _, _ = select.select([fd], [], [], max(deadline - time.monotonic(), 0))
            if not ready:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                return None
            self.pending += chunk
        line, _, self.pending = self.pending.partition(b"\n")
        return line.decode()


_servers: dict[str, _Server] = {}
_lock = threading.Lock()


def _server(profile: str) -> _Server:
    if profile not in PRELOADS:
        raise ValueError(f"preload profile {profile!r}: expected one of {sorted(PRELOADS)}")
    if profile not in _servers or not _servers[profile].alive():
        _servers[profile] = _Server(profile)
    return _servers[profile]


def run_group(procs: list[Proc], cwd: Path | str = REPO, timeout: float = 300, grace: float = 15) -> list[Result]:
    """Start every process at once; wait for all. When one fails, the others get `grace` seconds to finish or fail
    on their own (a peer's error usually says what it waited for), then are killed (returncode -9), as are all of
    them at `timeout`. Raises subprocess.TimeoutExpired at the timeout, with every process's output so far."""
    with tempfile.TemporaryDirectory(prefix="rank_launch_") as tmp:
        outs = [(Path(tmp) / f"{i}.out", Path(tmp) / f"{i}.err") for i in range(len(procs))]
        if _fresh_interpreters():
            rcs, timed_out = _run_fresh(procs, outs, cwd, timeout, grace)
        else:
            rcs, timed_out = _run_forked(procs, outs, cwd, timeout, grace)
        results = [Result(rc, _read(o), _read(e)) for rc, (o, e) in zip(rcs, outs)]
    if timed_out:
        raise subprocess.TimeoutExpired([p.argv for p in procs], timeout,
                                        output="\n".join(r.stdout for r in results),
                                        stderr="\n".join(r.stderr for r in results))
    return results


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.is_file() else ""


def _run_forked(procs, outs, cwd, timeout, grace) -> tuple[list[int], bool]:
    """One request per preload profile in the group, all started before any is waited for; the grace and the
    timeout then span the servers as they span one server's processes."""
    by_profile: dict[str, list[int]] = {}
    for i, p in enumerate(procs):
        by_profile.setdefault(p.preload, []).append(i)
    rcs: list[int | None] = [None] * len(procs)
    with _lock:
        running: dict[str, int] = {}  # profile -> its group's process group id
        for profile, idx in by_profile.items():
            server = _server(profile)
            server.send({"procs": [{"argv": [str(a) for a in procs[i].argv], "env": procs[i].env,
                                    "out": str(outs[i][0]), "err": str(outs[i][1])} for i in idx],
                         "cwd": str(cwd), "grace": grace})
            started = server.read_line(60)
            if started is None:
                raise RuntimeError(f"the rank-launch server ({profile}) died:\n{server.tail()}")
            running[profile] = json.loads(started)["pgid"]
        deadline, failed_at, killed_at, timed_out = time.monotonic() + timeout, None, None, False
        while running:
            for profile in list(running):
                server = _servers[profile]
                done = server.read_line(0.05 if len(running) > 1 else 0.5)
                if done is None and not server.alive():
                    raise RuntimeError(f"the rank-launch server ({profile}) died:\n{server.tail()}")
                if done is not None:
                    del running[profile]
                    for i, rc in zip(by_profile[profile], json.loads(done)["rcs"]):
                        rcs[i] = -9 if rc is None else rc
                    if failed_at is None and any(rcs[i] != 0 for i in by_profile[profile]):
                        failed_at = time.monotonic()
            now = time.monotonic()
            if not running:
                break
            if killed_at is None:
                timed_out = now > deadline
                if timed_out or (failed_at is not None and now - failed_at > grace):
                    for pgid in running.values():  # each whole group: leader, processes and theirs
                        with contextlib.suppress(ProcessLookupError):
                            os.killpg(pgid, signal.SIGKILL)
                    killed_at = now
            elif now - killed_at > 30:  # the servers reap and answer at once after a kill
                raise RuntimeError(f"the rank-launch servers {sorted(running)} did not answer after a kill")
    return [-9 if rc is None else rc for rc in rcs], timed_out


def _run_fresh(procs, outs, cwd, timeout, grace) -> tuple[list[int], bool]:
    files = [(open(o, "w"), open(e, "w")) for o, e in outs]
    try:
        running = [subprocess.Popen([sys.executable, *map(str, p.argv)], cwd=cwd, env=p.env, stdout=fo, stderr=fe,
                                    stdin=subprocess.DEVNULL) for p, (fo, fe) in zip(procs, files)]
        rcs = _wait_all([r.pid for r in running], timeout, grace)
    finally:
        for fo, fe in files:
            fo.close()
            fe.close()
    timed_out = rcs is None
    return [-9 if rc is None else rc for rc in (rcs or [None] * len(procs))], timed_out


def _wait_all(pids: list[int], timeout: float, grace: float) -> list[int | None] | None:
    """Reap `pids` (children of this process); kill the rest `grace` s after the first failure; None at timeout."""
    rcs: dict[int, int] = {}
    deadline, failed_at = time.monotonic() + timeout, None
    while len(rcs) < len(pids):
        for pid in pids:
            if pid not in rcs:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    rcs[pid] = os.waitstatus_to_exitcode(status)
                    if rcs[pid] != 0 and failed_at is None:
                        failed_at = time.monotonic()
        now = time.monotonic()
        if now > deadline or (failed_at is not None and now - failed_at > grace):
            for pid in pids:
                if pid not in rcs:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    rcs[pid] = -9
            if now > deadline:
                return None
        time.sleep(0.05)
    return [rcs[p] for p in pids]


def torchrun(script: Path | str, nproc: int, args: list[str], env: dict[str, str] | None = None,
             cwd: Path | str = REPO, timeout: float = 300, master_port: int | None = None) -> Result:
    """`python -m torch.distributed.run --nproc-per-node=N --master-addr=127.0.0.1 script args` on one node: each
    rank gets torchrun's variables (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT; OMP_NUM_THREADS
    1 unless set). One Result: the first failing rank's code (0 if none), every rank's stdout and stderr in rank
    order. When a rank fails, the others get 5 s, as torchrun stops a group that lost a member."""
    from hybridflow.ports import free_port

    base = dict(os.environ if env is None else env)
    base.setdefault("OMP_NUM_THREADS", "1")
    if _fresh_interpreters():  # the real launcher
        port = master_port or free_port()
        cmd = ["-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1",
               f"--master-port={port}", str(script), *map(str, args)]
        return run_group([Proc(cmd, base)], cwd, timeout)[0]
    port = str(master_port or free_port())
    procs = [Proc([str(script), *map(str, args)],
                  {**base, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(nproc), "GROUP_RANK": "0",
                   "LOCAL_WORLD_SIZE": str(nproc), "ROLE_RANK": str(r), "ROLE_WORLD_SIZE": str(nproc),
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}) for r in range(nproc)]
    results = run_group(procs, cwd, timeout, grace=5)
    failed = [r.returncode for r in results if r.returncode != 0]
    return Result(failed[0] if failed else 0, "".join(r.stdout for r in results),
                  "".join(r.stderr for r in results))


# ---- the server (a process of its own) ----------------------------------------------------------------------------

def _serve(profile: str) -> None:
    """Preload, say ready, then one group per request line: fork a leader (its own process group, so the client
    can kill the whole group at a timeout), which forks the processes and reports their codes."""
    import gc
    import importlib

    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # a stray print from an import must not corrupt the protocol
    for name in PRELOADS[profile]:
        importlib.import_module(name)
    gc.freeze()  # the preloaded objects never move to a collected generation, so forks keep sharing their pages
    _become_subreaper()
    proto.write(json.dumps({"ready": True, "preloaded": list(PRELOADS[profile])}) + "\n")
    for line in sys.stdin:
        request = json.loads(line)
        results = tempfile.mkstemp(prefix="rank_launch_rcs_")[1]
        sys.stdout.flush()
        sys.stderr.flush()
        leader = os.fork()
        if leader == 0:  # never returns to this loop: an error here must not leave a second server reading stdin
            try:
                proto.close()
                os.setpgid(0, 0)
                Path(results).write_text(json.dumps(_lead(request)))
            finally:
                os._exit(0)  # an empty results file reads as "every process killed"
        proto.write(json.dumps({"pgid": leader}) + "\n")
        _, status = os.waitpid(leader, 0)
        _reap_group(leader, killed=os.waitstatus_to_exitcode(status) < 0)
        text = Path(results).read_text()
        os.unlink(results)
        rcs = json.loads(text) if text else [None] * len(request["procs"])
        proto.write(json.dumps({"rcs": rcs}) + "\n")


def _become_subreaper() -> None:
    """Processes orphaned by a killed leader come to this server rather than to PID 1, which in a container may
    never reap them (they would stay as zombies)."""
    import ctypes

    PR_SET_CHILD_SUBREAPER = 36
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: orphans go to init as usual
        pass


def _reap_group(pgid: int, killed: bool) -> None:
    """Reap what is left (members reparent to this subreaper when their leader dies). After a kill every member of
    the group got SIGKILL with the leader: wait for each. Then take any other orphan already gone (no group runs
    now, so nothing else is a child of this server)."""
    for target, flags in ((-pgid, 0), (-1, os.WNOHANG)) if killed else ((-1, os.WNOHANG),):
        while True:
            try:
                pid, _ = os.waitpid(target, flags)
            except ChildProcessError:
                break
            if pid == 0:
                break


def _lead(request: dict) -> list[int | None]:
    pids = []
    for proc in request["procs"]:
        pid = os.fork()
        if pid == 0:
            try:
                _become(proc, request["cwd"])  # exits with the script's code
            except BaseException:  # before the script started (e.g. a cwd that does not exist): say why, exit 1
                import traceback

                traceback.print_exc()
            finally:
                os._exit(1)
        pids.append(pid)
    return _wait_all(pids, float("inf"), request["grace"])


def _become(proc: dict, cwd: str) -> None:
    """In a fresh fork: turn into `python argv...` with its own env and outputs, run it, exit with its code."""
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(os.open(proc["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), 1)
    os.dup2(os.open(proc["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), 2)
    os.chdir(cwd)
    run_as_main(proc["argv"], proc["env"])


def run_as_main(argv: list[str], env: dict[str, str]) -> None:
    """In a fresh fork, with its outputs and working directory in place: become `python argv...` with this
    environment, run it and exit with its code (tests/ray_zygote.py's Ray workers come through here too)."""
    import runpy

    os.environ.clear()
    os.environ.update(env)
    module = argv[1] if argv[0] == "-m" else None  # `python -m module args`: sys.path[0] is the cwd
    script = None if module else os.path.abspath(argv[0])
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    first = os.getcwd() if module else os.path.dirname(script)
    sys.path[:] = [first, *extra, *[p for p in sys.path[1:] if p not in extra]]
    sys.argv = [module or script, *argv[2 if module else 1:]]
    if "numpy" in sys.modules:  # as in a fresh interpreter, numpy's global stream is the process's own (random
        sys.modules["numpy"].random.seed()  # reseeds itself at fork; the hash seed cannot be redrawn)
    code = 0
    try:
        if module:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = e.code
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    # Exit as `python script.py` would, less the module teardown: join the non-daemon threads, run the atexit
    # handlers (logging, vLLM's and torch's cleanups), flush. Tearing down the preloaded modules would write to every
    # page this fork shares with the server (reference counts), ~2 s of copying for nothing.
    import threading

    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


if __name__ == "__main__" and sys.argv[1:2] == ["--serve"]:
    _serve(sys.argv[2])
