"""The tests' Ray worker zygote (tests/ray_zygote.py): a job whose driver applies the hook gets workers that are
forks of the preloaded server, and they behave as Ray's own fresh workers do: same argv, cwd, sys.path, job and
runtime_env, exit status; a killed worker is seen dead by Ray, and the process Ray started goes with it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
import ray_zygote
from conftest import local_ray

pytestmark = pytest.mark.own_ray  # a local Ray: the pairs phase
REPO = Path(__file__).resolve().parents[1]

DRIVER = textwrap.dedent('''
    import json, os, sys, time
    import ray
    ray.init(address=sys.argv[1], runtime_env={"env_vars": {"ZYGOTE_PROBE": "seen"}})

    @ray.remote(num_cpus=0)
    class Probe:
        def report(self):
            return {"pid": os.getpid(), "ppid": os.getppid(), "preloaded": "vllm" in sys.modules,
                    "probe": os.environ.get("ZYGOTE_PROBE"), "job": os.environ.get("RAY_JOB_ID"),
                    "argv0": os.path.basename(sys.argv[0]), "cwd": os.getcwd(), "path0": sys.path[0],
                    "client": os.environ.get("HYBRIDFLOW_TEST_RAY_ZYGOTE_CLIENT"), "pgid": os.getpgid(0)}

    probe = Probe.remote()
    out = ray.get(probe.report.remote(), timeout=120)
    out["driver_job"] = ray.get_runtime_context().get_job_id()
    print("REPORT " + json.dumps(out), flush=True)
    if sys.argv[2] == "kill-worker":
        os.kill(out["pid"], 9)
    elif sys.argv[2] == "kill-client":
        os.kill(int(out["client"]), 9)
    if sys.argv[2] != "report":
        deadline = time.monotonic() + 30  # the worker goes first (a killed client's worker notices within ms)
        while time.monotonic() < deadline:
            try:
                os.kill(out["pid"], 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        print("GONE", "yes" if time.monotonic() < deadline else "no", flush=True)
        try:
            ray.get(probe.report.remote(), timeout=60)
            print("DEAD no", flush=True)
        except ray.exceptions.RayActorError:
            print("DEAD yes", flush=True)
''')


def _drive(tmp_path: Path, mode: str, hook: bool) -> tuple[dict, str]:
    address = local_ray()  # first: it puts the hook (and the loopback setting a join needs) into os.environ
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    env = dict(os.environ)
    if not hook:
        env.pop("RAY_RUNTIME_ENV_HOOK", None)
    proc = subprocess.run([sys.executable, str(script), address, mode], capture_output=True, text=True,
                          timeout=240, cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = next(json.loads(x[len("REPORT "):]) for x in proc.stdout.splitlines() if x.startswith("REPORT "))
    return report, proc.stdout


def _server_pid() -> int:
    assert ray_zygote._server is not None, "local_ray() starts the zygote"
    return ray_zygote._server[0].pid


def _gone(pid: int, within_s: float = 30) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.2)
    return False


def test_a_hooked_job_s_workers_are_forks_that_see_what_fresh_workers_see(tmp_path):
    local_ray()
    forked, _ = _drive(tmp_path, "report", hook=True)
    fresh, _ = _drive(tmp_path, "report", hook=False)
    assert forked["ppid"] == _server_pid() and forked["preloaded"]  # a fork of the server, vLLM already there
    assert fresh["ppid"] != _server_pid() and not fresh["preloaded"]  # Ray's own fresh interpreter
    for report in (forked, fresh):
        assert report["probe"] == "seen"  # the job's runtime_env
        assert report["job"] == report["driver_job"]
    for key in ("argv0", "cwd", "path0"):
        assert forked[key] == fresh[key], key
    # A group of its own, as Ray gives its workers (the raylet cleans up after a worker by killing its group)
    assert forked["pgid"] == forked["pid"] and fresh["pgid"] == fresh["pid"]
    assert forked["argv0"] == "default_worker.py"
    assert fresh["client"] is None and int(forked["client"]) != forked["pid"]


def test_a_killed_worker_is_dead_to_ray_and_its_client_exits(tmp_path):
    report, out = _drive(tmp_path, "kill-worker", hook=True)
    assert report["ppid"] == _server_pid()
    assert "GONE yes" in out and "DEAD yes" in out
    assert _gone(int(report["client"])), "the client Ray started outlived its worker"


def test_a_killed_client_takes_its_worker_with_it(tmp_path):
    report, out = _drive(tmp_path, "kill-client", hook=True)
    assert report["ppid"] == _server_pid()
    assert "GONE yes" in out, "the forked worker outlived the client Ray started"
    assert "DEAD yes" in out


@pytest.mark.parametrize("script, code", [("import sys; sys.exit(3)", 3),
                                          ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", -9)])
def test_the_client_exits_as_its_forked_process_did(tmp_path, script, code):
    local_ray()
    path = tmp_path / "exit.py"
    path.write_text(script)
    proc = subprocess.run([sys.executable, ray_zygote.__file__, "--client", ray_zygote._server[1], str(path)],
                          timeout=60)
    assert proc.returncode == code


def test_without_a_server_the_client_runs_a_fresh_interpreter(tmp_path):
    path = tmp_path / "where.py"
    path.write_text("import os, sys; print('vllm' in sys.modules, os.getppid())")
    proc = subprocess.run([sys.executable, ray_zygote.__file__, "--client", str(tmp_path / "no.sock"), str(path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["False", str(os.getpid())]  # exec'd in place: this test is its parent


def test_a_signal_to_the_client_reaches_the_forked_process(tmp_path):
    """The fork's client-watching thread blocks every signal (its SigBlk in /proc), so the SIGTERM the client passes
    on reaches the main thread, asleep in time.sleep, at once; one taken by the watching thread woke nobody."""
    local_ray()
    path = tmp_path / "wait.py"
    path.write_text("import signal, sys, threading, time\n"
                    "signal.signal(signal.SIGTERM, lambda *_: sys.exit(7))\n"
                    "watch = next(t for t in threading.enumerate() if t.name == 'ray-zygote-client-watch')\n"
                    "status = open(f'/proc/self/task/{watch.native_id}/status').read()\n"
                    "print(next(x for x in status.splitlines() if x.startswith('SigBlk:')).split()[1], flush=True)\n"
                    "print('ready', flush=True)\n"
                    "time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, ray_zygote.__file__, "--client", ray_zygote._server[1], str(path)],
                            stdout=subprocess.PIPE, text=True)
    try:
        blocked = int(proc.stdout.readline().strip(), 16)
        assert blocked >> (signal.SIGTERM - 1) & 1, f"the watching thread takes SIGTERM (SigBlk {blocked:#x})"
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 7
    finally:
        proc.kill()


def test_a_module_driver_through_the_client_sees_what_a_fresh_one_sees(tmp_path):
    """test_e2e_trainer._run starts the trainer's driver (`python -m hybridflow.trainer.main ...`) through the client:
    as a fork it must get the `-m` run a fresh interpreter gives it (run name, argv, sys.path[0] = the working
    directory, its environment and exit status), with the imports already done."""
    local_ray()
    pkg = tmp_path / "probe_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "main.py").write_text(textwrap.dedent('''
        import json, os, sys
        print(json.dumps({"name": __name__, "argv": [os.path.basename(sys.argv[0]), *sys.argv[1:]],
                          "path0": sys.path[0], "cwd": os.getcwd(), "probe": os.environ.get("DRIVER_PROBE"),
                          "preloaded": "vllm" in sys.modules, "ppid": os.getppid()}), flush=True)
        sys.exit(5)
    '''))
    env = {**os.environ, "DRIVER_PROBE": "seen"}
    fresh = [sys.executable, "-m", "probe_pkg.main", "a", "b=c"]
    forked = [sys.executable, ray_zygote.__file__, "--client", ray_zygote._server[1], *fresh[1:]]
    out = {}
    for kind, cmd in (("fresh", fresh), ("forked", forked)):
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env)
        assert proc.returncode == 5, proc.stderr[-3000:]
        out[kind] = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["forked"].pop("preloaded") and not out["fresh"].pop("preloaded")
    assert out["fresh"].pop("ppid") == os.getpid() and out["forked"].pop("ppid") != os.getpid()
    assert out["forked"] == out["fresh"] == {"name": "__main__", "argv": ["main.py", "a", "b=c"],
                                             "path0": str(tmp_path), "cwd": str(tmp_path), "probe": "seen"}
