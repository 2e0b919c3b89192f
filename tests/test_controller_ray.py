"""The single controller on a real local Ray cluster: groups, every dispatch mode, fused roles, failures."""

from __future__ import annotations

import time

import pytest
import torch
from ray_workers import EchoWorker, RefLikeWorker

from hybridflow.controller import (
    RayWorkerGroup,
    ResourcePool,
    WorkerDiedError,
    WorkerError,
    WorkerTimeoutError,
)
from hybridflow.protocol import DataProto


@pytest.fixture(scope="module")
def echo4(ray_cluster):
    pool = ResourcePool("echo", [4], cpus_per_proc=0.25)
    group = RayWorkerGroup(pool, EchoWorker, kwargs={"tp": 2}, role="echo", timeout_s=120)
    group.init_dist()
    yield group
    group.kill()
    pool.remove()


def test_env_and_one_to_all(echo4):
    info = echo4.whoami("hi")
    assert [i["rank"] for i in info] == [0, 1, 2, 3]
    assert {i["world"] for i in info} == {4} and {i["tag"] for i in info} == {"hi"}
    assert len({i["pid"] for i in info}) == 4  # one process per rank
    assert {i["master"] for i in info} == {(echo4.master_addr, echo4.master_port)}


def test_gloo_all_reduce_across_four_workers(echo4):
    # rank r contributes 1.5 * (r + 1): the sum over 4 ranks is 1.5 * 10
    assert echo4.all_reduce(1.5) == [15.0] * 4


def test_all_to_all_and_rank_zero(echo4):
    assert echo4.times_rank([1, 10, 100, 1000]) == [1, 20, 300, 4000]
    assert echo4.only_zero() == 0


def test_dp_dispatch_round_trip_with_tp_replicas(echo4):
    x = torch.arange(16, dtype=torch.float32).view(8, 2)
    out = echo4.double(DataProto.from_dict({"x": x}))
    # collected only from the tp=0 rank of each dp replica (ranks 0 and 2), in dp order
    assert torch.equal(out.batch["y"], x * 2)
    assert list(out.non_tensor_batch["seen_by"]) == ["r0"] * 4 + ["r2"] * 4


def test_dp_dispatch_without_mesh_splits_over_all_ranks(echo4):
    data = DataProto.from_dict({"x": torch.arange(8)}, {"s": [str(i) for i in range(8)]}, {"m": 1})
    out = echo4.identity(data)
    assert torch.equal(out.batch["x"], data.batch["x"]) and list(out.non_tensor_batch["s"]) == list("01234567")


def test_future_passes_between_groups_without_driver(echo4, ray_cluster):
    pool = ResourcePool("ref2", [2], cpus_per_proc=0.25)
    other = RayWorkerGroup(pool, RefLikeWorker, role="ref", timeout_s=120)
    try:
        x = torch.arange(8, dtype=torch.float32).view(8, 1)
        fut = echo4.double.remote(DataProto.from_dict({"x": x}))  # 2 dp shards -> 2 ranks of `other`
        out = other.add_one(fut)
        assert torch.equal(out.batch["z"], x * 2 + 1)
        fut4 = echo4.identity.remote(DataProto.from_dict({"y": x}))  # 4 shards re-split into 2
        assert torch.equal(other.add_one(fut4).batch["z"], x + 1)
    finally:
        other.kill()
        pool.remove()


def test_worker_exception_names_role_rank_and_traceback(echo4):
    with pytest.raises(WorkerError) as e:
        echo4.fail_on(2)
    assert e.value.role == "echo" and e.value.rank == 2 and e.value.method == "echo.fail_on"
    assert "boom from rank 2" in str(e.value) and "Traceback" in str(e.value)
    assert echo4.only_zero() == 0  # the group stays usable


def test_blocking_wait_times_out_naming_pending_ranks(echo4):
    fut = echo4.sleep.remote(3.0)
    with pytest.raises(WorkerTimeoutError, match=r"ranks still pending: \[0, 1, 2, 3\]"):
        fut.get(timeout_s=0.5)
    assert fut.get() == [3.0] * 4


def test_fused_roles_share_one_process_and_group(ray_cluster):
    pool = ResourcePool("fused", [2], cpus_per_proc=0.25)
    group = RayWorkerGroup(pool, roles={"echo": (EchoWorker, (), {}), "ref": (RefLikeWorker, (), {})},
                           timeout_s=120)
    try:
        group.echo.init_dist()
        pids_echo = [i["pid"] for i in group.echo.whoami("x")]
        pid_group = group.ref.pid_and_group()
        assert [p for p, _ in pid_group] == pids_echo  # same processes
        assert [w for _, w in pid_group] == [2, 2]  # the ref role sees the group the echo role created
        y = group.ref.add_one(DataProto.from_dict({"y": torch.zeros(4)}))
        assert y.batch["z"].tolist() == [1.0] * 4
    finally:
        group.kill()
        pool.remove()


def test_killed_worker_gives_clear_error(ray_cluster):
    import ray

    pool = ResourcePool("victim", [2], cpus_per_proc=0.25)
    group = RayWorkerGroup(pool, EchoWorker, role="victim", timeout_s=60)
    try:
        ray.kill(group.host(1), no_restart=True)
        # ray.kill is asynchronous: wait until the actor is really gone, or a call could still reach it.
        with pytest.raises(ray.exceptions.RayActorError):
            for _ in range(120):
                ray.get(group.host(1).ping.remote(), timeout=30)
                time.sleep(0.5)
        with pytest.raises(WorkerDiedError, match="worker 'victim' rank 1 died"):
            group.whoami("x")
    finally:
        group.kill()
        pool.remove()


def test_unsatisfiable_pool_times_out_with_resources(ray_cluster):
    pool = ResourcePool("huge", [1], cpus_per_proc=1000, max_colocate=1, timeout_s=2)
    with pytest.raises(TimeoutError, match="pool 'huge'"):
        pool.slots()
    pool.remove()


def test_a_driver_joins_a_loopback_cluster_without_the_loopback_setting(ray_cluster):
    """A job joining our local (loopback-only) cluster from a process that lacks RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0:
    Ray rewrites 127.0.0.1 to the first interface's address and used to wait there for minutes (init_ray now keeps
    the address on loopback for that init)."""
    import os
    import subprocess
    import sys

    from conftest import REPO, local_ray

    env = {k: v for k, v in os.environ.items() if k != "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"}
    code = ("import ray\nfrom hybridflow.controller import init_ray\n"
            f"init_ray(address={local_ray()!r})\nprint('answer', ray.get(ray.remote(lambda: 42).remote(), timeout=60))")
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "answer 42" in proc.stdout, proc.stderr[-3000:]
    assert time.monotonic() - t0 < 60
