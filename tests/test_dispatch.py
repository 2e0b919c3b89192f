"""Dispatch and collect are pure functions: checked here without Ray."""

from pathlib import Path

import pytest
import torch

from hybridflow.controller.dispatch import (
    DispatchContext,
    DispatchError,
    MeshCoords,
    get_mode,
    register_dispatch_mode,
)
from hybridflow.protocol import DataProto


def tp2_dp2_mesh():
    # ranks 0..3, tp fastest: (dp0,tp0) (dp0,tp1) (dp1,tp0) (dp1,tp1)
    return [MeshCoords(dp_rank=r // 2, dp_size=2, tp_rank=r % 2, is_collect=r % 2 == 0) for r in range(4)]


def test_one_to_all_and_all_to_all():
    ctx = DispatchContext(3)
    d, c = get_mode("one_to_all")
    calls = d(ctx, (7,), {"k": 1})
    assert calls == [((7,), {"k": 1})] * 3
    assert c(ctx, [1, 2, 3]) == [1, 2, 3]
    d, _ = get_mode("all_to_all")
    calls = d(ctx, ([1, 2, 3],), {"k": ["a", "b", "c"]})
    assert calls[2] == ((3,), {"k": "c"})
    with pytest.raises(DispatchError, match="list of 3"):
        d(ctx, ([1, 2],), {})


def test_rank_zero():
    ctx = DispatchContext(4)
    d, c = get_mode("rank_zero")
    assert d(ctx, (1,), {}) == [((1,), {}), None, None, None]
    assert c(ctx, ["r0", None, None, None]) == "r0"


def test_dp_proto_sends_each_shard_to_its_whole_replica_and_collects_from_owner():
    ctx = DispatchContext(4, tp2_dp2_mesh())
    data = DataProto.from_dict({"x": torch.arange(8).view(8, 1)})
    d, c = get_mode("dp_compute_proto")
    calls = d(ctx, (data,), {})
    got = [call[0][0].batch["x"].flatten().tolist() for call in calls]
    assert got == [[0, 1, 2, 3], [0, 1, 2, 3], [4, 5, 6, 7], [4, 5, 6, 7]]
    outs = [DataProto.from_dict({"y": torch.full((4, 1), v)}) for v in (10, -1, 20, -1)]
    merged = c(ctx, outs)
    assert merged.batch["y"].flatten().tolist() == [10] * 4 + [20] * 4


def test_dp_proto_errors_name_the_problem():
    d, _ = get_mode("dp_compute_proto")
    bad = [MeshCoords(dp_rank=0, dp_size=2, is_collect=True)] * 4
    with pytest.raises(DispatchError, match="collect ranks cover"):
        d(DispatchContext(4, bad), (DataProto.from_dict({"x": torch.zeros(4)}),), {})
    with pytest.raises(ValueError, match="3"):  # 3 rows over 2 dp ranks: chunk refuses, naming the sizes
        d(DispatchContext(4, tp2_dp2_mesh()), (DataProto.from_dict({"x": torch.zeros(3)}),), {})


def test_dp_per_replica_sends_each_replica_its_own_list_and_collects_one_output_per_replica():
    ctx = DispatchContext(4, tp2_dp2_mesh())
    d, c = get_mode("dp_per_replica")
    calls = d(ctx, ([["a", "b"], ["c"]],), {"max_steps": 4})
    # both tp ranks of replica 0 get replica 0's list; keyword arguments go to every rank unchanged
    assert calls == [((["a", "b"],), {"max_steps": 4}), ((["a", "b"],), {"max_steps": 4}),
                     ((["c"],), {"max_steps": 4}), ((["c"],), {"max_steps": 4})]
    assert c(ctx, ["out0", "tp1 copy", "out1", "tp1 copy"]) == ["out0", "out1"]
    with pytest.raises(DispatchError, match="list of 2"):
        d(ctx, ([["a"]],), {})


def test_user_mode_and_unknown_mode():
    register_dispatch_mode("test_reverse", lambda ctx, a, k: [(a, k)] * ctx.world_size,
                           lambda ctx, outs: list(reversed(outs)))
    d, c = get_mode("test_reverse")
    assert c(DispatchContext(2), [1, 2]) == [2, 1]
    with pytest.raises(DispatchError, match="already exists"):
        register_dispatch_mode("test_reverse", d, c)
    with pytest.raises(DispatchError, match="unknown dispatch mode 'nope'"):
        get_mode("nope")


def test_ray_temp_dir_keeps_socket_paths_within_af_unix_limit():
    from hybridflow.controller.ray_env import ray_temp_dir

    # what broke once pytest's counter reached 101: 46 characters + Ray's 62-character socket suffix
    longest = "/session_2026-12-02_18-35-20_571285_14334/sockets/plasma_store"
    for run_dir in ("/tmp/pytest-of-root/pytest-101/runs0/plain", "/r", "/tmp/" + "x" * 200):
        assert len(str(ray_temp_dir(run_dir)) + longest) <= 107, run_dir
    assert ray_temp_dir("/r") == Path("/r/ray")  # short enough: kept under the run dir
    a, b = ray_temp_dir("/tmp/" + "x" * 200), ray_temp_dir("/tmp/" + "y" * 200)
    assert a != b and a == ray_temp_dir("/tmp/" + "x" * 200)  # distinct runs, stable per run
