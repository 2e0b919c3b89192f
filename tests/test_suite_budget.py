"""The suite's time guard: end-to-end tests are counted, must carry the `slow` mark, and stay within a budget.

An end-to-end test is one that uses a whole trainer run or the simulated multi-node cluster through the shared
fixtures, or lives in a test_e2e_* module; each costs 10-130 s on 2 cores, where a unit test costs well under one.
A new one must be marked `slow` (so `-m "not slow"` gives a fast loop) and fit in E2E_BUDGET; raising the budget is
a deliberate edit here, with the suite's measured time in the commit (docs/index.md, "The tests").
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

# Fixtures behind a whole trainer run or a simulated multi-node cluster (tests/conftest.py, the cluster tests).
# The shared ray_cluster alone is not one: it starts once a session, and its users take seconds.
E2E_FIXTURES = {"observed_run", "plain_run", "server_run", "warm_assets", "cluster"}
E2E_BUDGET = 34  # 23 on 2026-12-04; 29 after server mode and agent loops (one run for two tests each) and split
# pools (two runs): test_e2e_{server_mode,agent,async}; plus room for 3; 34 with test_e2e_estimators (one driver run
# for its two tests, every estimator and loss_agg_mode: ~35 s of the pairs phase). Raise it deliberately


def is_end_to_end(item) -> bool:
    return bool(E2E_FIXTURES & set(getattr(item, "fixturenames", ()))) or item.module.__name__.startswith("test_e2e_")


def audit(items) -> dict:
    """What the guard checks, over the collected items (tests/conftest.py calls it once per session)."""
    e2e = [i for i in items if isinstance(i, pytest.Function) and is_end_to_end(i)]
    return {"collected": len(items), "e2e": [i.nodeid for i in e2e],
            "unmarked": [i.nodeid for i in e2e if i.get_closest_marker("slow") is None
                         and i.get_closest_marker("cluster") is None]}


def test_end_to_end_tests_are_marked_slow_and_within_budget(request):
    """Over everything collected in this session (the whole suite under `make test`)."""
    seen = request.config.stash[AUDIT]
    print(f"{len(seen['e2e'])} end-to-end tests of {seen['collected']} collected (budget {E2E_BUDGET})")
    assert not seen["unmarked"], f"end-to-end tests without the slow (or cluster) mark: {seen['unmarked']}"
    assert len(seen["e2e"]) <= E2E_BUDGET, (
        f"{len(seen['e2e'])} end-to-end tests, over the budget of {E2E_BUDGET}: share a run (tests/conftest.py's "
        "observed_run / plain_run) or raise the budget on purpose")


def test_the_guard_sees_a_fixture_run_and_an_e2e_module():
    """is_end_to_end on stand-in items: by fixture, by module name, and not for a plain unit test."""
    def Item(module, fixtures):  # noqa: N802  (a stand-in for a collected pytest item)
        return SimpleNamespace(module=SimpleNamespace(__name__=module), fixturenames=fixtures)

    assert is_end_to_end(Item("test_protocol", ["tmp_path", "plain_run"]))
    assert not is_end_to_end(Item("test_controller_ray", ["ray_cluster"]))  # the shared cluster alone is cheap
    assert is_end_to_end(Item("test_e2e_trainer", ["tmp_path"]))
    assert not is_end_to_end(Item("test_protocol", ["tmp_path"]))


AUDIT = pytest.StashKey[dict]()


def test_the_phase_rule_on_stand_in_items():
    """tests/conftest.py's phase_of, which `make test` splits the suite by: the observed run, the cluster / fault /
    serial marks and the launcher modules make a test serial (and win); a Ray of its own (the e2e modules, the
    shared runs, ray_cluster, the own_ray mark) runs in pairs; a unit or torchrun test in the parallel phase."""
    from conftest import phase_of

    def Item(module, fixtures=(), marks=()):  # noqa: N802  (a stand-in for a collected pytest item)
        return SimpleNamespace(module=SimpleNamespace(__name__=module), fixturenames=list(fixtures),
                               get_closest_marker=lambda name: name if name in marks else None)

    assert phase_of(Item("test_controller_ray", ["tmp_path", "ray_cluster"])) == ("pairs", "fixture ray_cluster")
    # a kill on the shared cluster (test_fault_collective) stays alone
    assert phase_of(Item("test_fault_collective", ["ray_cluster"], marks=["fault"])) == ("serial", "mark fault")
    assert phase_of(Item("test_timeline", ["run", "observed_run"])) == ("serial", "fixture observed_run")
    assert phase_of(Item("test_multinode", marks=["slow", "cluster"])) == ("serial", "mark cluster")
    assert phase_of(Item("test_security", marks=["fault"])) == ("serial", "mark fault")
    assert phase_of(Item("test_rewards", marks=["serial"])) == ("serial", "mark serial")
    assert phase_of(Item("test_launch_cluster", ["tmp_path"])) == ("serial", "module test_launch_cluster")
    # a fault test in an e2e module (a kill) and the observed run in test_e2e_trainer stay alone
    assert phase_of(Item("test_e2e_async", ["warm_assets"], marks=["slow", "fault"])) == ("serial", "mark fault")
    assert phase_of(Item("test_e2e_trainer", ["observed_run"])) == ("serial", "fixture observed_run")
    assert phase_of(Item("test_e2e_trainer", ["tmp_path"])) == ("pairs", "module test_e2e_trainer")
    assert phase_of(Item("test_e2e_async", ["plain_run", "warm_assets"])) == ("pairs", "fixture plain_run")
    assert phase_of(Item("test_convert", ["trained_run"], marks=["own_ray"])) == ("pairs", "mark own_ray")
    assert phase_of(Item("test_mcore_parity", ["tmp_path"], marks=["slow"])) == ("parallel", None)
    assert phase_of(Item("test_protocol", ["tmp_path"])) == ("parallel", None)
