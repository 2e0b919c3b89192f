"""A rank SIGKILLed while its peer waits in a gloo all-reduce: the driver names the dead rank at once (not
the survivor's broken collective), does not wait for the process-group timeout, and the teardown kills the
survivor. The kill is the fault hook's (HYBRIDFLOW_FAULT read by the worker process)."""

from __future__ import annotations

import time

import psutil
import pytest
from ray_workers import EchoWorker

from hybridflow.controller import RayWorkerGroup, ResourcePool, WorkerDiedError


@pytest.mark.fault
def test_rank_killed_in_a_collective_is_named_and_the_survivor_torn_down(ray_cluster, tmp_path):
    pool = ResourcePool("collective", [2], cpus_per_proc=0.25)
    env = {"HYBRIDFLOW_FAULT": "stage=all_reduce,rank=1", "HYBRIDFLOW_FAULT_STATE": str(tmp_path)}
    group = RayWorkerGroup(pool, EchoWorker, role="collective", env=env, timeout_s=120, detect_timeout_s=20)
    try:
        group.init_dist(timeout_s=90.0)  # a survivor would wait up to 90 s in the collective
        pids = [info["pid"] for info in group.whoami("pids")]
        t = time.perf_counter()
        with pytest.raises(WorkerDiedError, match="worker 'collective' rank 1 died during collective.all_reduce"):
            group.all_reduce(1.0)
        detected = time.perf_counter() - t
        print(f"\nrank 1 killed while rank 0 waits in all_reduce: named after {detected:.2f} s")
        assert detected < 20
        # The GCS view the wait also polls (every detect_timeout_s / 2) agrees: rank 1 dead, rank 0 alive.
        assert group._dead_ranks([0, 1]) == [1]
    finally:
        group.kill()
        pool.remove()
    deadline = time.monotonic() + 30
    while psutil.pid_exists(pids[0]) and psutil.Process(pids[0]).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the surviving rank outlived the teardown"
        time.sleep(0.2)
    assert not psutil.pid_exists(pids[1]) or psutil.Process(pids[1]).status() == psutil.STATUS_ZOMBIE
