"""tests/conftest.py's built_once, which lets the pairs phase's two xdist workers share one trainer run: two callers
(threads here, each with its own open lock file, as two worker processes have) get one build and the same value;
a failed build is reported to the waiter instead of being rebuilt or waited on forever."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
from conftest import built_once


def _factory(common):
    # tmp_path_factory as a worker sees it: its own basetemp, under the run's common dir
    return SimpleNamespace(getbasetemp=lambda: common / "popen-gw0", mktemp=None)


def _both(factory, build):
    out, threads = {}, []

    def call(i):
        try:
            out[i] = built_once(factory, "shared", build)
        except Exception as e:  # kept, to compare the two outcomes
            out[i] = e

    for i in range(2):
        threads.append(threading.Thread(target=call, args=(i,)))
        threads[-1].start()
    for t in threads:
        t.join(timeout=30)
    return out


def test_two_workers_get_one_build_and_the_same_value(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    calls = []

    def build(root):
        calls.append(root)
        time.sleep(0.3)  # long enough for the other caller to find the lock taken
        return {"model": str(root / "model")}

    out = _both(_factory(tmp_path), build)
    assert len(calls) == 1 and calls[0] == tmp_path / "shared"
    assert out[0] == out[1] == {"model": str(tmp_path / "shared" / "model")}


def test_a_failed_build_is_reported_to_the_waiter_not_rebuilt(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    calls = []

    def build(root):
        calls.append(root)
        time.sleep(0.3)
        raise AssertionError("trainer exited 1")

    out = _both(_factory(tmp_path), build)
    assert len(calls) == 1
    errors = sorted((type(e).__name__, str(e)) for e in out.values())
    assert errors[0] == ("AssertionError", "trainer exited 1")
    assert errors[1][0] == "RuntimeError" and "failed to build shared" in errors[1][1]
    assert "trainer exited 1" in errors[1][1]


def test_without_xdist_each_session_builds_its_own(tmp_path, monkeypatch):
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    made = []
    factory = SimpleNamespace(mktemp=lambda name: made.append(name) or tmp_path / name)
    assert built_once(factory, "warm", lambda root: str(root)) == str(tmp_path / "warm") and made == ["warm"]


def test_the_waiter_gives_up_after_its_limit(tmp_path, monkeypatch):
    import conftest

    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    monkeypatch.setattr(conftest, "SHARED_WAIT_S", 0.5)
    release = threading.Event()
    holder = threading.Thread(target=lambda: built_once(_factory(tmp_path), "slow", lambda r: release.wait(10) and 1))
    holder.start()
    time.sleep(0.2)
    with pytest.raises(TimeoutError, match="waited 0.5 s for the other worker to build slow"):
        built_once(_factory(tmp_path), "slow", lambda r: 2)
    release.set()
    holder.join(timeout=10)
