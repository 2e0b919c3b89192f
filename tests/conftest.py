"""Shared fixtures: one local Ray cluster for the whole session, tiny models created once."""

from __future__ import annotations

import atexit
import fcntl
import json
import os
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# The longest a pairs-phase worker waits for the other to build a shared run (the trainer's own limit is 600 s).
SHARED_WAIT_S = 1200


def built_once(tmp_path_factory, name: str, build):
    """A session fixture's value, built once per pytest run even when two xdist workers both want it (the pairs
    phase): the first builds it under a lock in the run's common temp dir and leaves it as JSON; the other waits on
    the lock (up to SHARED_WAIT_S) and reads it, or re-raises the builder's error. Without xdist: just build.

    Why not once per worker: the waiting worker gives the builder both cores, so a shared run costs what it costs in
    one process; and e2e comparisons at 1e-6 need every run made from the same warm-start files."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return build(tmp_path_factory.mktemp(name))
    common = tmp_path_factory.getbasetemp().parent  # pytest-N/, the parent of each worker's popen-gwN/
    done, failed = common / f"{name}.json", common / f"{name}.failed"
    with open(common / f"{name}.lock", "w") as lock:
        deadline = time.monotonic() + SHARED_WAIT_S
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"waited {SHARED_WAIT_S} s for the other worker to build {name}") from None
                time.sleep(0.5)
        try:
            if failed.is_file():
                raise RuntimeError(f"the other worker failed to build {name}:\n{failed.read_text()}")
            if done.is_file():
                return json.loads(done.read_text())
            try:
                value = build(common / name)
            except BaseException as e:
                failed.write_text(f"{type(e).__name__}: {e}"[-4000:])
                raise
            done.write_text(json.dumps(value))
            return value
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def local_ray() -> str:
    """The address of this pytest process's local Ray cluster, started on first use (7-16 s).

    Its users: the tests on `ray_cluster`, and every trainer run started through test_e2e_trainer._run, which joins
    it (trainer.ray.address) instead of starting a cluster of its own. Only pairs-phase tests do either, so at most
    two clusters run at a time, one per xdist worker, as before. A joined run is the same job: the driver a fresh
    process, the placement groups its own, torn down when it ends. What joining leaves out (a run's own cluster
    start, its ray temp dir, the local-only settings) the runs that keep their own cluster test: test_fault.py's
    killed and restarted runs, the observed run, the sweep.

    It first starts the Ray worker zygote (tests/ray_zygote.py): the workers of this process's jobs and of the runs
    that join are forks of one process that imported torch, megatron and vLLM once."""
    import tempfile

    import ray

    from hybridflow.controller import init_ray
    from hybridflow.controller.ray_env import shutdown_and_remove

    if not ray.is_initialized():
        # Ray workers import test helper modules (tests/ray_workers.py) by name.
        pythonpath = os.pathsep.join([str(TESTS), str(REPO), os.environ.get("PYTHONPATH", "")])
        os.environ["PYTHONPATH"] = pythonpath
        if str(TESTS) not in sys.path:
            sys.path.insert(0, str(TESTS))
        # Ray workers fork from one preloaded process (tests/ray_zygote.py): from here on this process's environment
        # carries the hook that ray.init applies, this process's own (the `ray_cluster` tests' actors) and that of
        # every trainer run started from here.
        import ray_zygote

        ray_zygote.start()
        run_dir = tempfile.mkdtemp(prefix="hf_test_ray_")
        atexit.register(shutdown_and_remove, run_dir)  # the session's Ray, then its temp dir
        init_ray(num_cpus=16, object_store_memory=1024**3, run_dir=run_dir, env_vars={"PYTHONPATH": pythonpath})
    return ray.get_runtime_context().gcs_address


@pytest.fixture(scope="session")
def ray_cluster():
    """A real local Ray cluster shared by every test of this pytest process that needs one (local_ray); in the
    pairs phase each xdist worker has its own."""
    import ray

    local_ray()
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session", autouse=True)
def _serial_ray_jobs_fork_their_workers(request):
    """In the serial phase every Ray job a test starts (a run's own cluster, a launcher's, a simulated multi-node
    one) forks its workers from the zygote, as the pairs phase's runs do through local_ray."""
    if request.config.getoption("phase") == "serial":
        if str(TESTS) not in sys.path:
            sys.path.insert(0, str(TESTS))
        import ray_zygote

        ray_zygote.start()


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

    return built_once(tmp_path_factory, "warm_assets",
                      lambda out: prepare(out, sft_steps=80, train_size=256, test_size=16))


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

    def build(root: Path) -> str:
        root.mkdir(parents=True, exist_ok=True)
        _run(_cmd("ppo_tiny_cpu.yaml", root / "run", f"actor_rollout_ref.model.path={warm_assets['model']}",
                  f"data.train_files=[{warm_assets['train']}]", *PLAIN_JOB), root / "log")
        return str(root)

    root = Path(built_once(tmp_path_factory, "plain", build))
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

    def build(root: Path) -> str:
        root.mkdir(parents=True, exist_ok=True)
        _run(_cmd("ppo_tiny_cpu.yaml", root / "run", f"actor_rollout_ref.model.path={warm_assets['model']}",
                  f"data.train_files=[{warm_assets['train']}]", *SERVER_JOB,
                  f"data.val_files=[{warm_assets['test']}]", "trainer.val_before_train=true",
                  f"trainer.validation_data_dir={root / 'val_dump'}", f"trainer.rollout_data_dir={root / 'samples'}"),
             root / "log")
        return str(root)

    return Path(built_once(tmp_path_factory, "server_mode", build))


# ---- the three phases -------------------------------------------------------------------------------------------
# `make test` runs the suite in three phases (docs/index.md, "The tests"), by what a test can share a 2-core machine
# with (phase_of):
#  - parallel (`-n 2 --phase parallel`): units, single-process model tests, torchrun/vLLM process groups, whose
#    rendezvous ports come from hybridflow/ports.py and whose vLLM shm segments are named per job;
#  - pairs (`-n 2 --phase pairs`): what runs on a local Ray: whole trainer runs, each in a subprocess (the
#    test_e2e_* modules, the shared warm_assets / plain_run / server_run, or marked `own_ray` by hand: a sweep, an
#    export of a trained run), and the users of `ray_cluster`. Each xdist worker has one local Ray (local_ray), which
#    its `ray_cluster` tests use and its trainer runs join; Ray 2.60 starts a local cluster on ports of its own
#    choosing under its own temp dir, so the two coexist; the shared runs are built once for both workers
#    (built_once);
#  - serial (`--phase serial`): one at a time, what a second test could break: the observed run (observed_run: Ray's
#    own Prometheus export), a simulated multi-node cluster (`cluster`), launchers (test_launch_*: signals,
#    `ray start`), fault injection (`fault`: kills, deadlines, detection times), and anything marked `serial` by hand
#    (a timing bound).
ALONE_FIXTURES = {"observed_run", "cluster"}
ALONE_MARKS = ("serial", "cluster", "fault")
ALONE_MODULES = ("test_launch_",)
RUN_FIXTURES = {"ray_cluster", "warm_assets", "plain_run", "server_run"}
RUN_MARKS = ("own_ray",)
RUN_MODULES = ("test_e2e_",)
PHASES = ("parallel", "pairs", "serial")
PHASE_MARK = {"pairs": "own_ray", "serial": "serial"}


def _reason(item, fixtures, marks, modules) -> str | None:
    found = sorted(fixtures & set(getattr(item, "fixturenames", ())))
    if found:
        return f"fixture {found[0]}"
    found = [m for m in marks if item.get_closest_marker(m) is not None]
    if found:
        return f"mark {found[0]}"
    module = getattr(getattr(item, "module", None), "__name__", "")
    return f"module {module}" if module.startswith(modules) else None


def phase_of(item) -> tuple[str, str | None]:
    """The phase this collected test runs in, and why (None for the parallel phase). Being alone wins."""
    reason = _reason(item, ALONE_FIXTURES, ALONE_MARKS, ALONE_MODULES)
    if reason:
        return "serial", reason
    reason = _reason(item, RUN_FIXTURES, RUN_MARKS, RUN_MODULES)
    return ("pairs", reason) if reason else ("parallel", None)


def pytest_addoption(parser):
    parser.addoption("--phase", choices=PHASES, default=None,
                     help="run only one phase: the tests that may share the machine (parallel) or a trainer run "
                          "(pairs), both for -n 2, or the serial group; all by default. See tests/conftest.py.")


def pytest_configure(config):
    # -n without --phase parallel/pairs would run serial tests beside others: refuse rather than flake.
    if getattr(config.option, "numprocesses", None) and config.getoption("phase") not in ("parallel", "pairs") \
            and not hasattr(config, "workerinput"):
        raise pytest.UsageError("pytest -n runs tests side by side; add --phase parallel (or pairs), and run the "
                                "serial group afterwards with --phase serial (what `make test` does)")


@pytest.hookimpl(tryfirst=True)  # before -k / -m deselect: the guard counts everything collected
def pytest_collection_modifyitems(session, config, items):
    """The suite-time guard's view of this session's tests (tests/test_suite_budget.py asserts on it), then each
    test's phase mark (so `-m own_ray` / `-m serial` select a phase too) and the --phase selection."""
    from test_suite_budget import AUDIT, audit

    config.stash[AUDIT] = audit(items)
    phases = {}
    for item in items:
        phase, _ = phase_of(item)
        phases[item.nodeid] = phase
        if phase in PHASE_MARK and item.get_closest_marker(PHASE_MARK[phase]) is None:
            item.add_marker(getattr(pytest.mark, PHASE_MARK[phase]))
    wanted = config.getoption("phase")
    if wanted:
        other = [i for i in items if phases[i.nodeid] != wanted]
        if other:
            config.hook.pytest_deselected(items=other)
            items[:] = [i for i in items if phases[i.nodeid] == wanted]



# ---- /dev/shm: the test that leaves vLLM's shared-memory segments behind fails (tests/shm_watch.py) ---------------
from shm_watch import _no_shm_segments_left, shm_before_session  # noqa: E402, F401
