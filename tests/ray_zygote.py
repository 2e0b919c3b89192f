"""Ray workers for the tests, forked from one process that has already imported torch, megatron and vLLM.

Why: a 2-step tiny PPO run joined to a local Ray took ~32 s and 53 CPU-s on the slower 2-core box, of which the two
steps are ~4 s; most of the rest was its worker processes each importing torch, megatron.core and vLLM afresh.
Forked: ~20 s and 29 CPU-s, the metrics bit-identical (docs/index.md, "The tests"). tests/rank_launch.py does this
for torchrun-style rank groups; this does it for Ray's workers.

How: Ray starts a worker of a job whose runtime_env names a `py_executable` as `<py_executable> default_worker.py
<args>`. The hook (RAY_RUNTIME_ENV_HOOK, set by `start`) names this file's client. The client sends its argv,
environment, working directory and its stdin/stdout/stderr (the worker's log files) to the server over a Unix
socket; the server forks a child that becomes `python default_worker.py <args>` with all of them, and tells the
client its pid and, later, its exit code, which the client exits with. The worker is as real as before: Ray's own
default_worker.py, registering with the raylet by its startup token and running the job's actors; only the
interpreter start-up is skipped. The raylet signals the pid the worker registers with (the child) and kills its
process group; a signal to the client is passed on; a client that dies (SIGKILL) takes its child with it, which
watches the client's connection.

Who: conftest.local_ray (the pairs phase: the ray_cluster tests' actors, the trainer runs that join) and, in the serial
phase, every Ray job a test starts (conftest's session fixture). A driver whose environment lacks the hook (the
observed run drops it) gets fresh interpreters; HYBRIDFLOW_TEST_LAUNCHER=subprocess turns it off everywhere, as it
does rank_launch's forks.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import sys

SOCKET_ENV = "HYBRIDFLOW_TEST_RAY_ZYGOTE"  # the server's socket path, for the hook
# By its package path from the repository root: the tests' drivers run with PYTHONPATH=<repo> (or from it), not
# always with tests/ on the path.
HOOK = "tests.ray_zygote.runtime_env_hook"
CLIENT_PID_ENV = "HYBRIDFLOW_TEST_RAY_ZYGOTE_CLIENT"  # in a forked worker: the pid of the client Ray started
# What the trainer's Ray workers import, on top of rank_launch's "all" profile. Never `ray` itself: importing it
# builds Ray's C++ RayConfig from the environment of the moment (RAY_JOB_ID and the rest), and a fork would keep the
# server's (the worker then aborts: "Check failed: !job_id_env.empty()"). Each worker imports ray on its own (~1 s).
RAY_PRELOADS = ("hybridflow.controller", "megatron_workers.actor_rollout_ref", "megatron_workers.critic",
                "megatron_workers.reward_model", "megatron_workers.rollout_worker", "hybridflow.rollout.vllm_rollout")
HEADER = struct.Struct("!I")
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


def runtime_env_hook(runtime_env: dict | None) -> dict | None:
    """RAY_RUNTIME_ENV_HOOK: the job's workers start through this file's client (when a server is up)."""
    path = os.environ.get(SOCKET_ENV)
    if not path or os.environ.get("HYBRIDFLOW_TEST_LAUNCHER") == "subprocess":
        return runtime_env
    return {**(runtime_env or {}), "py_executable": f"{sys.executable} {os.path.abspath(__file__)} --client {path}"}


# ---- the client: Ray's py_executable ------------------------------------------------------------------------------

def _client(path: str, argv: list[str]) -> None:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
    except OSError:  # no server (it ended with its pytest process): a fresh interpreter, as without the hook
        os.execv(sys.executable, [sys.executable, *argv])
    child: list[int] = []  # the forked pid, once the server has said it
    pending: list[int] = []  # signals that came before it

    def forward(signum, _frame):
        if not child:
            pending.append(signum)
            return
        try:
            os.kill(child[0], signum)
        except ProcessLookupError:
            pass

    for sig in FORWARDED:
        signal.signal(sig, forward)
    body = json.dumps({"argv": argv, "env": {**os.environ, CLIENT_PID_ENV: str(os.getpid())},
                       "cwd": os.getcwd()}).encode()
    socket.send_fds(conn, [HEADER.pack(len(body)) + body], [0, 1, 2])
    reader = conn.makefile("r")
    started = reader.readline()
    if not started:
        sys.exit("ray_zygote: the server closed the connection before forking")
    child.append(json.loads(started)["pid"])
    for sig in pending:
        forward(sig, None)
    done = reader.readline()
    rc = json.loads(done)["rc"] if done else 1
    if rc < 0:  # died of a signal: so does the client, so that whoever waits on it sees the same status
        if -rc != signal.SIGKILL:
            signal.signal(-rc, signal.SIG_DFL)
        os.kill(os.getpid(), -rc)
    sys.exit(rc)


# ---- the server ---------------------------------------------------------------------------------------------------

def _serve(path: str) -> None:
    import gc
    import importlib
    import select

    from rank_launch import PRELOADS, _become_subreaper

    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # a stray print from an import must not corrupt the protocol
    for name in (*PRELOADS["all"], *RAY_PRELOADS):
        importlib.import_module(name)
    if "ray._raylet" in sys.modules:
        raise RuntimeError("a preload imported ray: its RayConfig would carry this server's environment into every "
                           "worker (see RAY_PRELOADS)")
    gc.freeze()  # the preloaded objects stay out of the collector, so the forks keep sharing their pages
    _become_subreaper()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    proto.write(json.dumps({"ready": True}) + "\n")
    clients: dict[int, socket.socket] = {}  # child pid -> its client's connection
    while True:
        ready, _, _ = select.select([listener], [], [], 0.2)
        if ready:
            conn, _ = listener.accept()
            try:
                pid = _fork_worker(conn, listener, clients)
            except (OSError, ValueError, KeyError) as e:  # a client that died mid-request: nothing to start
                print(f"ray_zygote: bad request: {e!r}", file=sys.stderr, flush=True)
                conn.close()
            else:
                clients[pid] = conn
        while True:  # reap: children, and the orphans this subreaper inherits
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = clients.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall((json.dumps({"rc": os.waitstatus_to_exitcode(status)}) + "\n").encode())
                except OSError:
                    pass
                conn.close()


def _recv_request(conn: socket.socket) -> tuple[dict, list[int]]:
    conn.settimeout(30)
    data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
    if len(data) < HEADER.size or len(fds) != 3:
        raise ValueError(f"short request ({len(data)} bytes, {len(fds)} fds)")
    (size,) = HEADER.unpack_from(data)
    body = data[HEADER.size:]
    while len(body) < size:
        chunk = conn.recv(size - len(body))
        if not chunk:
            raise ValueError("the client closed mid-request")
        body += chunk
    conn.settimeout(None)
    return json.loads(body), fds


def _fork_worker(conn, listener, clients) -> int:
    request, fds = _recv_request(conn)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        try:
            # A process group of its own, as Ray gives each worker it starts: the raylet cleans up after a worker by
            # killing the worker's group, which would otherwise be the server's (and, without the server's own
            # session, the pytest process's: a killed worker once took the whole serial phase with it).
            os.setsid()
            listener.close()
            for other in clients.values():
                other.close()
            for target, fd in enumerate(fds):
                os.dup2(fd, target)
                os.close(fd)
            _watch_client(conn)
            from rank_launch import run_as_main

            os.chdir(request["cwd"])
            run_as_main(request["argv"], request["env"])  # never returns
        except BaseException:
            import traceback

            traceback.print_exc()
        finally:
            os._exit(1)
    for fd in fds:
        os.close(fd)
    conn.sendall((json.dumps({"pid": pid}) + "\n").encode())
    return pid


def _watch_client(conn: socket.socket) -> None:
    """The worker dies with its client: Ray's raylet may SIGKILL the process it started (the client), and a worker
    left behind would hold its actors' resources. The client never writes after its request, so any return of
    recv (EOF) means it is gone.

    The watching thread blocks every signal: the kernel hands a process-directed signal (the SIGTERM the client
    passes on) to any thread that does not block it, and one taken by this thread, asleep in recv, only sets
    Python's flag, which the main thread reads when it next wakes up: a worker asleep in time.sleep(60) then exited
    60 s late (seen once as a test timing out at 30 s). The thread inherits the mask set around its start."""
    import threading

    def watch():
        try:
            conn.recv(1)
        except OSError:
            pass
        os.kill(os.getpid(), signal.SIGKILL)

    every = signal.valid_signals()
    before = signal.pthread_sigmask(signal.SIG_BLOCK, every)
    try:
        threading.Thread(target=watch, name="ray-zygote-client-watch", daemon=True).start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


# ---- starting it, from a pytest process ---------------------------------------------------------------------------

_server = None


def start(timeout_s: float = 300) -> str | None:
    """Start this process's server (once) and put the hook into os.environ, so that the trainer runs this process
    starts (and their Ray jobs) fork their workers from it. Returns the socket path (None: fresh interpreters asked
    for with HYBRIDFLOW_TEST_LAUNCHER=subprocess)."""
    global _server
    import atexit
    import shutil
    import subprocess
    import tempfile
    import time

    if os.environ.get("HYBRIDFLOW_TEST_LAUNCHER") == "subprocess":  # fresh interpreters, as rank_launch then runs
        return None
    if _server is not None and _server[0].poll() is None:
        return _server[1]
    tmp = tempfile.mkdtemp(prefix="ray_zygote_")
    path, log = os.path.join(tmp, "sock"), open(os.path.join(tmp, "server.log"), "w")
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
               PYTHONPATH=os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve", path], env=env,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log, text=True,
                            start_new_session=True)

    def stop():
        proc.kill()
        proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)

    atexit.register(stop)
    deadline = time.monotonic() + timeout_s
    import select

    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 1.0)
        if ready:
            line = proc.stdout.readline()
            if line and json.loads(line).get("ready"):
                break
            raise RuntimeError(f"the Ray worker zygote did not start:\n{open(log.name).read()[-4000:]}")
        if proc.poll() is not None:
            raise RuntimeError(f"the Ray worker zygote died:\n{open(log.name).read()[-4000:]}")
    else:
        stop()
        raise RuntimeError(f"the Ray worker zygote did not start in {timeout_s} s")
    _server = (proc, path)
    os.environ[SOCKET_ENV] = path
    os.environ["RAY_RUNTIME_ENV_HOOK"] = HOOK
    repo, paths = os.path.dirname(here), os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if repo not in paths:  # the drivers import the hook (HOOK)
        os.environ["PYTHONPATH"] = os.pathsep.join([repo, *filter(None, paths)])
    return path


if __name__ == "__main__":
    if sys.argv[1:2] == ["--client"]:
        _client(sys.argv[2], sys.argv[3:])
    elif sys.argv[1:2] == ["--serve"]:
        _serve(sys.argv[2])
