"""The tests' process-group launcher (tests/rank_launch.py): forked ranks behave as torchrun's fresh ones do.

Each check runs a small script through the launcher and compares what the ranks saw with what `python script.py`
under torchrun gives them: their argv, sys.path[0], __name__, torchrun's variables, a real gloo all-reduce, their
own stdout/stderr and exit codes; a failing rank stops the group, a hung one is killed at the timeout.
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
import time

import pytest
import rank_launch
from rank_launch import Proc, run_group, torchrun

RANK_SCRIPT = textwrap.dedent("""
    import json, os, random, sys
    import numpy
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    print(json.dumps({"rank": dist.get_rank(), "world": dist.get_world_size(), "sum": t.item(), "argv": sys.argv,
                      "path0": sys.path[0], "name": __name__, "local_world": os.environ["LOCAL_WORLD_SIZE"],
                      "omp": os.environ["OMP_NUM_THREADS"], "marker": os.environ.get("MARKER"),
                      "preloaded": "megatron.core" in sys.modules, "cwd": os.getcwd(),
                      "draws": [random.getrandbits(30), int(numpy.random.randint(1 << 30))]}))
    print(f"rank {dist.get_rank()} says hello on stderr", file=sys.stderr)
    dist.destroy_process_group()
""")


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "rank_script.py"
    path.write_text(RANK_SCRIPT)
    return path


def _rows(stdout: str) -> list[dict]:
    return sorted((json.loads(x) for x in stdout.splitlines() if x.startswith("{")), key=lambda r: r["rank"])


def test_forked_ranks_see_what_torchrun_gives_them(script, tmp_path):
    env = dict(os.environ, MARKER="m1")
    env.pop("OMP_NUM_THREADS", None)
    r = torchrun(script, 3, ["a", "b"], env=env, cwd=tmp_path, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = _rows(r.stdout)
    assert [x["rank"] for x in rows] == [0, 1, 2]
    for x in rows:
        assert x["world"] == 3 and x["sum"] == 6.0 and x["local_world"] == "3" and x["omp"] == "1"
        assert x["argv"] == [str(script), "a", "b"] and x["path0"] == str(tmp_path) and x["name"] == "__main__"
        assert x["marker"] == "m1" and x["cwd"] == str(tmp_path)
        # the point of the launcher: the ranks start with megatron already imported (the yardstick below does not)
        assert x["preloaded"] is True
    assert all(f"rank {i} says hello on stderr" in r.stderr for i in range(3))
    # each rank's random and numpy streams are its own, as in fresh interpreters (not the server's, copied)
    draws = [x["draws"][k] for k in (0, 1) for x in rows]
    assert len(set(draws)) == len(draws), draws


@pytest.mark.slow
def test_the_real_torchrun_gives_the_same(script, tmp_path, monkeypatch):
    """HYBRIDFLOW_TEST_LAUNCHER=subprocess: torch.distributed.run with fresh interpreters, the same answers."""
    monkeypatch.setenv("HYBRIDFLOW_TEST_LAUNCHER", "subprocess")
    env = dict(os.environ, MARKER="m1")
    env.pop("OMP_NUM_THREADS", None)
    r = torchrun(script, 2, ["a", "b"], env=env, cwd=tmp_path, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = _rows(r.stdout)
    assert [x["sum"] for x in rows] == [3.0, 3.0] and [x["preloaded"] for x in rows] == [False, False]
    assert all(x["argv"] == [str(script), "a", "b"] and x["path0"] == str(tmp_path) and x["omp"] == "1"
               and x["name"] == "__main__" and x["marker"] == "m1" for x in rows)


def test_a_failing_process_stops_its_peers_after_the_grace(tmp_path):
    """One process exits 3 at once; its peer, which would sleep for 10 minutes, is killed `grace` s later."""
    fail, hang = tmp_path / "fail.py", tmp_path / "hang.py"
    fail.write_text("import sys\nprint('failing now', file=sys.stderr)\nsys.exit(3)\n")
    hang.write_text("import time\nprint('waiting', flush=True)\ntime.sleep(600)\n")
    start = time.monotonic()
    results = run_group([Proc([str(fail)]), Proc([str(hang)])], cwd=tmp_path, timeout=120, grace=1)
    assert time.monotonic() - start < 30
    assert [r.returncode for r in results] == [3, -9]
    assert "failing now" in results[0].stderr and results[1].stdout == "waiting\n"


def test_an_uncaught_exception_is_exit_code_1_with_its_traceback(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    raise ValueError('the bad input')\nf()\n")
    (result,) = run_group([Proc([str(bad)])], cwd=tmp_path, timeout=60)
    assert result.returncode == 1 and "ValueError: the bad input" in result.stderr and "Traceback" in result.stderr
    # failing before the script starts is exit code 1 with the reason too, and the server serves on
    (result,) = run_group([Proc([str(bad)])], cwd=tmp_path / "missing", timeout=60)
    assert result.returncode == 1 and "FileNotFoundError" in result.stderr and "missing" in result.stderr
    (result,) = run_group([Proc([str(bad)])], cwd=tmp_path, timeout=60)
    assert result.returncode == 1 and "ValueError: the bad input" in result.stderr


def test_a_hung_group_is_killed_at_the_timeout_and_the_server_goes_on(tmp_path):
    hang = tmp_path / "hang.py"
    hang.write_text("import os, time\nprint(os.getpid(), flush=True)\ntime.sleep(600)\n")
    start = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired) as info:
        run_group([Proc([str(hang)]), Proc([str(hang)])], cwd=tmp_path, timeout=3)
    assert time.monotonic() - start < 30
    pids = [int(x) for x in info.value.output.split()]
    assert len(pids) == 2
    for pid in pids:  # gone (reaped by the server), not left sleeping
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    ok = tmp_path / "ok.py"
    ok.write_text("print('still serving')\n")
    assert run_group([Proc([str(ok)])], cwd=tmp_path, timeout=60)[0].stdout == "still serving\n"
    assert rank_launch._servers["all"].alive()


def test_python_dash_m_runs_a_module(tmp_path):
    (tmp_path / "pkg_for_launch").mkdir()
    (tmp_path / "pkg_for_launch" / "__init__.py").write_text("")
    (tmp_path / "pkg_for_launch" / "tool.py").write_text(
        "import sys\nif __name__ == '__main__':\n    print('tool', sys.argv[1:])\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    (result,) = run_group([Proc(["-m", "pkg_for_launch.tool", "x"], env)], cwd=tmp_path, timeout=60)
    assert result.returncode == 0 and result.stdout == "tool ['x']\n", result.stderr[-2000:]


def test_a_group_across_two_preload_profiles_fails_as_one(tmp_path):
    """A process forked from the torch-only server fails; its peer on the full server is killed after the grace,
    and each saw only its own server's preloads."""
    fail, hang = tmp_path / "fail.py", tmp_path / "hang.py"
    fail.write_text("import sys\nprint('vllm' in sys.modules, flush=True)\nsys.exit(4)\n")
    hang.write_text("import sys, time\nprint('vllm' in sys.modules, flush=True)\ntime.sleep(600)\n")
    start = time.monotonic()
    results = run_group([Proc([str(fail)], preload="torch"), Proc([str(hang)], preload="all")], cwd=tmp_path,
                        timeout=120, grace=1)
    assert time.monotonic() - start < 60
    assert [r.returncode for r in results] == [4, -9]
    assert [r.stdout for r in results] == ["False\n", "True\n"]
    with pytest.raises(ValueError, match="preload profile 'nope'"):
        run_group([Proc([str(fail)], preload="nope")], cwd=tmp_path)
