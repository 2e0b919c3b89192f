"""Shared fixtures: one local Ray cluster for the whole session, tiny models created once."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory):
    """A real local Ray cluster shared by every test that needs one (starting one costs 7-16 s)."""
    import ray

    from hybridflow.controller import init_ray

    # Ray workers import test helper modules (tests/ray_workers.py) by name.
    pythonpath = os.pathsep.join([str(TESTS), str(REPO), os.environ.get("PYTHONPATH", "")])
    os.environ["PYTHONPATH"] = pythonpath
    if str(TESTS) not in sys.path:
        sys.path.insert(0, str(TESTS))
    init_ray(num_cpus=16, object_store_memory=1024**3, run_dir=tmp_path_factory.mktemp("ray_run"),
             env_vars={"PYTHONPATH": pythonpath})
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def observed_run(tmp_path_factory):
    """The one tiny PPO run with prometheus, timeline, an injected NaN and the quiet console (observed_run.py)."""
    if str(TESTS) not in sys.path:
        sys.path.insert(0, str(TESTS))
    from observed_run import run_observed

    return run_observed(tmp_path_factory.mktemp("observed"))


@pytest.fixture(scope="session")
def warm_assets(tmp_path_factory):
    """The tiny model after 80 warm-start steps (~8 s) and its reverse-task parquet files (256 train, 16 test):
    greedy answers are partly right (val mean ~0.49), so generations and scores vary."""
    from hybridflow.trainer.warmstart import prepare

    return prepare(tmp_path_factory.mktemp("warm_assets"), sft_steps=80, train_size=256, test_size=16)


# The plain 2-step colocated PPO job on warm_assets (8 prompts, one mini-batch, no validation, no saves). In fp32:
# its users compare it with HF generate token for token and with other layouts to 1e-6 (model.dtype=auto would be
# bf16 on a CPU with native bf16; the e2e runs that only check behaviour keep auto, so CI runs the bf16 path too).
PLAIN_JOB = ("data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
             "critic.ppo_mini_batch_size=8", "trainer.total_training_steps=2", "trainer.save_freq=-1",
             "actor_rollout_ref.model.dtype=float32", "critic.model.dtype=float32")


@pytest.fixture(scope="session")
def plain_run(warm_assets, tmp_path_factory):
    """PLAIN_JOB run once, the yardstick of test_e2e_validation.py (validating changes no training metric) and
    test_e2e_placement.py (other placements and pools give colocate's metrics): (run dir, console log)."""
    if str(TESTS) not in sys.path:
        sys.path.insert(0, str(TESTS))
    from test_e2e_trainer import _cmd, _run

    root = tmp_path_factory.mktemp("plain")
    _run(_cmd("ppo_tiny_cpu.yaml", root / "run", f"actor_rollout_ref.model.path={warm_assets['model']}",
              f"data.train_files=[{warm_assets['train']}]", *PLAIN_JOB), root / "log")
    return root / "run", root / "log"


# The rollout on a pool of its own (#25): actor, ref and critic on two processes, vLLM on two others.
SPLIT_POOLS = ("trainer.resource_pools.actor=[2]", "trainer.resource_pools.rollout=[2]",
               "trainer.role_pools.actor_rollout=actor", "trainer.role_pools.ref=actor",
               "trainer.role_pools.critic=actor", "trainer.role_pools.rollout=rollout")
# PLAIN_JOB in server mode on split pools, as test_e2e_server_mode.py checks it and test_e2e_async.py's fully_async
# runs repeat it: the old-log-prob pass on (its max diff to the rollout's), the rollout correction (token TIS, ~1
# on policy) on.
SERVER_JOB = (*PLAIN_JOB, *SPLIT_POOLS, "actor_rollout_ref.rollout.mode=async",
              "actor_rollout_ref.recompute_old_log_prob=true", "algorithm.rollout_correction.rollout_is=token")


@pytest.fixture(scope="session")
def server_run(warm_assets, tmp_path_factory):
    """SERVER_JOB (synchronous), validating before training: <root>/run, val_dump, samples."""
    if str(TESTS) not in sys.path:
        sys.path.insert(0, str(TESTS))
    from test_e2e_trainer import _cmd, _run

    root = tmp_path_factory.mktemp("server_mode")
    _run(_cmd("ppo_tiny_cpu.yaml", root / "run", f"actor_rollout_ref.model.path={warm_assets['model']}",
              f"data.train_files=[{warm_assets['train']}]", *SERVER_JOB,
              f"data.val_files=[{warm_assets['test']}]", "trainer.val_before_train=true",
              f"trainer.validation_data_dir={root / 'val_dump'}", f"trainer.rollout_data_dir={root / 'samples'}"),
         root / "log")
    return root


# ---- the serial group -------------------------------------------------------------------------------------------
# `make test` runs the suite in two phases (docs/index.md, "The tests"): the tests that can share the machine two at
# a time under pytest-xdist (`-n 2 --phase parallel`), then the serial group one at a time (`--phase serial`).
# A test is serial when it cannot share a 2-core machine with another test:
#  - Ray: it uses the run-wide Ray cluster or a whole trainer run (each starts its own local Ray), or a simulated
#    multi-node cluster (the fixtures below, the `cluster` mark, the test_e2e_* modules);
#  - timing and signals: launchers (test_launch_*), fault injection (`fault`: kills, deadlines, detection times);
#  - anything else marked `serial` by hand: a timing bound that a second test on the cores could break, or Ray
#    started outside these fixtures (a module fixture running the trainer, Ray Tune).
# Everything else runs in the parallel phase: units, single-process model tests, and torchrun/vLLM process groups,
# whose rendezvous ports are probed (tests/mcore_scripts/train_common.py retries a port taken in between) and whose
# vLLM shm segments are named per job (hybridflow/rollout/vllm_launch.py: cpu_shm_communicator).
SERIAL_FIXTURES = {"ray_cluster", "observed_run", "plain_run", "warm_assets", "cluster"}
SERIAL_MARKS = ("serial", "cluster", "fault")
SERIAL_MODULES = ("test_e2e_", "test_launch_")


def serial_reason(item) -> str | None:
    """Why this collected test belongs to the serial group, or None (it may run beside another test)."""
    fixtures = sorted(SERIAL_FIXTURES & set(getattr(item, "fixturenames", ())))
    if fixtures:
        return f"fixture {fixtures[0]}"
    marks = [m for m in SERIAL_MARKS if item.get_closest_marker(m) is not None]
    if marks:
        return f"mark {marks[0]}"
    module = getattr(getattr(item, "module", None), "__name__", "")
    return f"module {module}" if module.startswith(SERIAL_MODULES) else None


def pytest_addoption(parser):
    parser.addoption("--phase", choices=("parallel", "serial"), default=None,
                     help="run only the tests that may share the machine (parallel: for -n 2) or only the serial "
                          "group (serial); both by default. See tests/conftest.py, 'the serial group'.")


def pytest_configure(config):
    # -n without --phase parallel would run serial tests beside others: refuse rather than flake.
    if getattr(config.option, "numprocesses", None) and config.getoption("phase") != "parallel" \
            and not hasattr(config, "workerinput"):
        raise pytest.UsageError("pytest -n runs tests side by side; add --phase parallel, and run the serial group "
                                "afterwards with --phase serial (what `make test` does)")


@pytest.hookimpl(tryfirst=True)  # before -k / -m deselect: the guard counts everything collected
def pytest_collection_modifyitems(session, config, items):
    """The suite-time guard's view of this session's tests (tests/test_suite_budget.py asserts on it), then the
    serial mark on every serial test (so `-m serial` selects them too) and the --phase selection."""
    from test_suite_budget import AUDIT, audit

    config.stash[AUDIT] = audit(items)
    for item in items:
        if serial_reason(item) and item.get_closest_marker("serial") is None:
            item.add_marker(pytest.mark.serial)
    phase = config.getoption("phase")
    if phase:
        wanted = phase == "serial"
        other = [i for i in items if (i.get_closest_marker("serial") is not None) != wanted]
        if other:
            config.hook.pytest_deselected(items=other)
            items[:] = [i for i in items if (i.get_closest_marker("serial") is not None) == wanted]
