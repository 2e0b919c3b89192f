"""DataProto: every operation against hand-built expected values, error messages, and transport.

Pure tests (no Ray) except the last one, which runs only with HYBRIDFLOW_RAY_TESTS=1.
"""

import os
import pickle
import tempfile
import time
import warnings

import numpy as np
import pytest
import torch

from hybridflow.protocol import DataProto, DataProtoItem


def make(n=4, meta=None):
    """Rows are recognisable: ids[i] == [10*i, 10*i+1], score[i] == i/2, uid[i] == f"u{i}"."""
    return DataProto.from_dict(
        tensors={"ids": torch.arange(n * 2).view(n, 2) + torch.arange(n).repeat_interleave(2).view(n, 2) * 8,
                 "score": torch.arange(n, dtype=torch.float32) / 2},
        non_tensors={"uid": [f"u{i}" for i in range(n)]},
        meta_info=meta or {"temperature": 1.0},
    )


def uids(dp):
    return list(dp.non_tensor_batch["uid"])


def rows(dp):
    return dp.batch["ids"][:, 0].tolist()


def test_make_rows_are_as_documented():
    dp = make(3)
    assert dp.batch["ids"].tolist() == [[0, 1], [10, 11], [20, 21]]
    assert dp.batch["score"].tolist() == [0.0, 0.5, 1.0]
    assert uids(dp) == ["u0", "u1", "u2"]


# ---- construction and consistency ---------------------------------------------------------------

def test_from_single_dict_routes_by_type():
    d = {"a": torch.zeros(2, 3), "texts": ["x", "y"], "lens": np.array([3, 4]), "pairs": [[1, 2], [3, 4]]}
    dp = DataProto.from_single_dict(d, meta_info={"k": 1})
    assert set(dp.batch) == {"a"}
    assert set(dp.non_tensor_batch) == {"texts", "lens", "pairs"}
    assert dp.non_tensor_batch["texts"].dtype == object
    # a list of equal-length lists stays one object per row, not a 2-D array
    assert dp.non_tensor_batch["pairs"].shape == (2,) and dp.non_tensor_batch["pairs"][1] == [3, 4]
    assert dp.non_tensor_batch["lens"].dtype == np.int64
    assert dp.meta_info == {"k": 1} and len(dp) == 2


def test_from_dict_type_errors_name_the_key():
    with pytest.raises(TypeError, match="tensors\\['x'\\] is list"):
        DataProto.from_dict(tensors={"x": [1, 2]})
    with pytest.raises(TypeError, match="non_tensors\\['y'\\] is int"):
        DataProto.from_dict(non_tensors={"y": 3})
    with pytest.raises(TypeError, match="'z' is float"):
        DataProto.from_single_dict({"z": 1.5})


def test_check_consistency_names_key_and_sizes():
    with pytest.raises(ValueError, match=r"batch\['b'\] has leading size 3, but 'a' has 2"):
        DataProto.from_dict(tensors={"a": torch.zeros(2), "b": torch.zeros(3)})
    with pytest.raises(ValueError, match=r"non_tensor_batch\['u'\] has leading size 5, but 'a' has 2"):
        DataProto.from_dict(tensors={"a": torch.zeros(2)}, non_tensors={"u": np.zeros(5)})
    with pytest.raises(ValueError, match=r"batch\['s'\] is 0-dimensional"):
        DataProto.from_dict(tensors={"s": torch.tensor(1.0)})
    with pytest.raises(ValueError, match=r"\['k'\] are in both"):
        DataProto.from_dict(tensors={"k": torch.zeros(2)}, non_tensors={"k": ["a", "b"]})
    # mutation after construction is caught by an explicit call
    dp = make(4)
    dp.batch["bad"] = torch.zeros(7)
    with pytest.raises(ValueError, match=r"batch\['bad'\] has leading size 7, but 'ids' has 4"):
        dp.check_consistency()


def test_len_repr_nbytes():
    dp = make(4)
    assert len(dp) == 4
    assert len(DataProto()) == 0
    assert len(DataProto.from_dict(non_tensors={"u": ["a", "b", "c"]})) == 3
    r = repr(dp)
    assert "len=4" in r and "ids: (4, 2) int64" in r and "score: (4,) float32" in r and "uid: (4,) object" in r
    assert "temperature" in r
    big = DataProto.from_dict(tensors={"x": torch.zeros(10_000, 100)})
    assert len(repr(big)) < 200  # no values printed
    assert dp.nbytes == 4 * 2 * 8 + 4 * 4 + 4 * np.dtype(object).itemsize
    assert DataProto.from_dict(tensors={"h": torch.zeros(3, 5, dtype=torch.bfloat16)}).nbytes == 30


# ---- indexing -----------------------------------------------------------------------------------

def test_int_index_gives_item():
    dp = make(4)
    item = dp[2]
    assert isinstance(item, DataProtoItem)
    assert item["ids"].tolist() == [20, 21] and item["uid"] == "u2" and item.meta_info["temperature"] == 1.0
    assert dp[-1]["uid"] == "u3"
    assert "ids" in item and item.keys() == ["ids", "score", "uid"]
    with pytest.raises(KeyError, match="'nope' not found"):
        item["nope"]
    with pytest.raises(IndexError, match="index 4 out of range for DataProto of len 4"):
        dp[4]
    with pytest.raises(IndexError, match="index -5 out of range"):
        dp[-5]
    assert [it["uid"] for it in dp] == ["u0", "u1", "u2", "u3"]


def test_slice_is_a_view_and_steps_work():
    dp = make(5)
    s = dp[1:3]
    assert rows(s) == [10, 20] and uids(s) == ["u1", "u2"]
    assert s.batch["ids"].data_ptr() == dp.batch["ids"][1].data_ptr()  # no copy
    s.meta_info["new"] = 1
    assert "new" not in dp.meta_info  # meta_info dict is not shared
    assert rows(dp[::2]) == [0, 20, 40] and uids(dp[::-2]) == ["u4", "u2", "u0"]
    assert len(dp[3:1]) == 0


@pytest.mark.parametrize("index", [
    [3, 0, -1], np.array([3, 0, 4]), torch.tensor([3, 0, 4]),
])
def test_array_index_gathers(index):
    dp = make(5)
    out = dp[index]
    assert rows(out) == [30, 0, 40] and uids(out) == ["u3", "u0", "u4"]


def test_bool_and_bad_indices():
    dp = make(4)
    assert uids(dp[torch.tensor([True, False, True, False])]) == ["u0", "u2"]
    assert uids(dp[np.array([False, False, False, True])]) == ["u3"]
    assert len(dp[[]]) == 0
    with pytest.raises(IndexError, match=r"boolean index has shape \(3,\), expected \(4,\)"):
        dp[torch.tensor([True, False, True])]
    with pytest.raises(IndexError, match="index 9 out of range for DataProto of len 4"):
        dp[[0, 9]]
    with pytest.raises(IndexError, match="1-D integer or boolean"):
        dp[np.array([0.5])]
    with pytest.raises(TypeError, match=r"dp.batch\['ids'\]"):
        dp["ids"]


# ---- key operations -----------------------------------------------------------------------------

def test_select_shares_memory_unless_deepcopy():
    dp = make(4, meta={"a": [1], "b": 2})
    s = dp.select(batch_keys=["ids"], non_tensor_batch_keys="uid", meta_info_keys=["a"])
    assert set(s.batch) == {"ids"} and set(s.non_tensor_batch) == {"uid"} and s.meta_info == {"a": [1]}
    assert s.batch["ids"].data_ptr() == dp.batch["ids"].data_ptr()
    everything = dp.select()
    assert set(everything.batch) == {"ids", "score"} and everything.meta_info == {"a": [1], "b": 2}
    deep = dp.select(deepcopy=True)
    deep.batch["ids"][0, 0] = 99
    deep.non_tensor_batch["uid"][0] = "changed"
    deep.meta_info["a"].append(5)
    assert dp.batch["ids"][0, 0] == 0 and dp.non_tensor_batch["uid"][0] == "u0" and dp.meta_info["a"] == [1]
    with pytest.raises(KeyError, match=r"batch key\(s\) \['nope'\] not found; available: \['ids', 'score'\]"):
        dp.select(batch_keys=["nope"])
    with pytest.raises(KeyError, match=r"meta_info key\(s\) \['zz'\]"):
        dp.select(meta_info_keys=["zz"])


def test_clone_owns_memory():
    dp = make(3)
    c = dp.clone()
    assert c.batch["ids"].data_ptr() != dp.batch["ids"].data_ptr()
    assert torch.equal(c.batch["ids"], dp.batch["ids"]) and uids(c) == uids(dp)


def test_pop_removes_and_returns():
    dp = make(4, meta={"a": 1, "b": 2})
    popped = dp.pop(batch_keys=["score"], non_tensor_batch_keys=["uid"], meta_info_keys=["a"])
    assert set(dp.batch) == {"ids"} and dp.non_tensor_batch == {} and dp.meta_info == {"b": 2}
    assert popped.batch["score"].tolist() == [0.0, 0.5, 1.0, 1.5] and uids(popped) == ["u0", "u1", "u2", "u3"]
    assert popped.meta_info == {"a": 1}
    with pytest.raises(KeyError, match=r"\['score'\] not found"):
        dp.pop(batch_keys=["score"])


def test_rename_in_place_including_swap():
    dp = make(3)
    out = dp.rename("ids", "input_ids")
    assert out is dp and set(dp.batch) == {"input_ids", "score"}
    dp.rename(["input_ids", "uid"], ["x", "prompt_uid"])
    assert set(dp.batch) == {"x", "score"} and set(dp.non_tensor_batch) == {"prompt_uid"}
    dp.rename(["x", "score"], ["score", "x"])  # swap
    assert dp.batch["x"].tolist() == [0.0, 0.5, 1.0]
    with pytest.raises(KeyError, match=r"\['missing'\] not found"):
        dp.rename("missing", "m2")
    with pytest.raises(KeyError, match=r"\['score'\] already exist"):
        dp.rename("x", "score")
    with pytest.raises(ValueError, match="1 old keys .* but 2 new keys"):
        dp.rename(["x"], ["a", "b"])


def test_union_merges_and_checks():
    a = make(3, meta={"step": 1})
    b = DataProto.from_dict(tensors={"logp": torch.tensor([-1.0, -2.0, -3.0]), "ids": a.batch["ids"].clone()},
                            non_tensors={"uid": ["u0", "u1", "u2"]}, meta_info={"step": 1, "lr": 0.1})
    out = a.union(b)
    assert out is a
    assert set(a.batch) == {"ids", "score", "logp"} and a.batch["logp"].tolist() == [-1.0, -2.0, -3.0]
    assert a.meta_info == {"step": 1, "lr": 0.1}
    bad = DataProto.from_dict(tensors={"score": torch.tensor([9.0, 0.5, 1.0])})
    with pytest.raises(ValueError, match="batch key 'score' exists in both with different values"):
        make(3).union(bad)
    with pytest.raises(ValueError, match="non_tensor_batch key 'uid'"):
        make(3).union(DataProto.from_dict(non_tensors={"uid": ["u0", "zz", "u2"]}))
    with pytest.raises(ValueError, match="meta_info key 'temperature'"):
        make(3).union(DataProto(meta_info={"temperature": 0.5}))
    with pytest.raises(ValueError, match="batch sizes differ: 3 vs 4"):
        make(3).union(DataProto.from_dict(tensors={"z": torch.zeros(4)}))
    # a batch with only meta_info merges into any size
    assert make(3).union(DataProto(meta_info={"m": 1})).meta_info["m"] == 1


# ---- row operations -----------------------------------------------------------------------------

def test_concat_values_meta_and_errors():
    a, b = make(2, meta={"from": "a"}), make(3, meta={"from": "b"})
    c = DataProto.concat([a, b])
    assert rows(c) == [0, 10, 0, 10, 20] and uids(c) == ["u0", "u1", "u0", "u1", "u2"]
    assert c.batch["score"].tolist() == [0.0, 0.5, 0.0, 0.5, 1.0]
    assert c.meta_info == {"from": "a"}
    b.pop(batch_keys=["score"])
    with pytest.raises(ValueError, match=r"part 1 \(len 3\) has keys batch=\['ids'\].*part 0 \(len 2\) has "
                                         r"batch=\['ids', 'score'\]"):
        DataProto.concat([a, b])
    with pytest.raises(ValueError, match="empty list"):
        DataProto.concat([])
    half = make(2)
    half.batch["score"] = half.batch["score"].half()
    with pytest.raises(ValueError, match=r"batch key 'score' is \(2,\) torch.float16 in part 1"):
        DataProto.concat([make(2), half])


def test_chunk_and_split():
    dp = make(6)
    parts = dp.chunk(3)
    assert [rows(p) for p in parts] == [[0, 10], [20, 30], [40, 50]]
    assert [uids(p) for p in parts] == [["u0", "u1"], ["u2", "u3"], ["u4", "u5"]]
    assert rows(DataProto.concat(parts)) == rows(dp)
    with pytest.raises(ValueError, match="len 6 is not divisible by chunks=4"):
        dp.chunk(4)
    with pytest.raises(ValueError, match="positive int"):
        dp.chunk(0)
    assert [uids(p) for p in dp.split(4)] == [["u0", "u1", "u2", "u3"], ["u4", "u5"]]
    # meta-only batches chunk into meta-only pieces
    assert [p.meta_info for p in DataProto(meta_info={"m": 1}).chunk(2)] == [{"m": 1}, {"m": 1}]


def test_repeat():
    dp = make(2)
    inter = dp.repeat(2, interleave=True)
    assert rows(inter) == [0, 0, 10, 10] and uids(inter) == ["u0", "u0", "u1", "u1"]
    tiled = dp.repeat(3, interleave=False)
    assert rows(tiled) == [0, 10, 0, 10, 0, 10] and uids(tiled) == ["u0", "u1"] * 3
    assert tiled.batch["ids"].shape == (6, 2)
    with pytest.raises(ValueError, match="repeat_times must be an int >= 1, got 0"):
        dp.repeat(0)


def test_row_ops_keep_dtype_and_autograd():
    h = torch.tensor([[1.5, -2.0], [3.0, 0.25]], dtype=torch.bfloat16)
    f8 = torch.tensor([0.5, 2.0]).to(torch.float8_e4m3fn)
    dp = DataProto.from_dict(tensors={"h": h, "f8": f8})
    cat = DataProto.concat([dp, dp[1:]])
    assert cat.batch["h"].dtype == torch.bfloat16 and cat.batch["h"].tolist() == [[1.5, -2.0], [3.0, 0.25], [3.0, 0.25]]
    assert cat.batch["f8"].dtype == torch.float8_e4m3fn and cat.batch["f8"].float().tolist() == [0.5, 2.0, 2.0]
    rep = dp.repeat(2)
    assert rep.batch["h"].dtype == torch.bfloat16 and rep.batch["h"][:, 0].tolist() == [1.5, 1.5, 3.0, 3.0]
    # tensors that require grad go through torch ops, so gradients still flow back
    w = torch.tensor([1.0, 2.0], requires_grad=True)
    g = DataProto.from_dict(tensors={"w": w})
    (DataProto.concat([g, g]).batch["w"].sum() + g.repeat(3).batch["w"].sum()).backward()
    assert w.grad.tolist() == [5.0, 5.0]


def test_reorder_in_place():
    dp = make(4)
    assert dp.reorder(torch.tensor([3, 1, 0, 2])) is None
    assert rows(dp) == [30, 10, 0, 20] and uids(dp) == ["u3", "u1", "u0", "u2"]
    with pytest.raises(IndexError, match="index 7 out of range"):
        dp.reorder([7, 0, 1, 2])


@pytest.mark.parametrize("n,divisor,expected_pad,expected_rows", [
    (5, 4, 3, [0, 1, 2, 3, 4, 0, 1, 2]),
    (2, 5, 3, [0, 1, 0, 1, 0]),  # more padding than rows: wraps around
    (4, 4, 0, [0, 1, 2, 3]),
    (3, 1, 0, [0, 1, 2]),
])
def test_pad_unpad_round_trip(n, divisor, expected_pad, expected_rows):
    dp = make(n)
    padded, pad = dp.pad_to_divisor(divisor)
    assert pad == expected_pad and len(padded) % divisor == 0
    assert uids(padded) == [f"u{i}" for i in expected_rows]
    assert rows(padded) == [10 * i for i in expected_rows]
    back = padded.unpad(pad)
    assert rows(back) == rows(dp) and uids(back) == uids(dp) and back.meta_info == dp.meta_info


def test_pad_unpad_errors():
    with pytest.raises(ValueError, match="divisor must be a positive int, got 0"):
        make(3).pad_to_divisor(0)
    with pytest.raises(ValueError, match=r"pad_size 5 is not in \[0, len=3\]"):
        make(3).unpad(5)


def test_make_iterator_plain_and_seeded():
    dp = make(6)
    plain = list(dp.make_iterator(2, epochs=2))
    assert [uids(b) for b in plain] == [["u0", "u1"], ["u2", "u3"], ["u4", "u5"]] * 2
    assert all(b.meta_info == {"temperature": 1.0} for b in plain)

    def order(seed):
        return [uids(b) for b in dp.make_iterator(3, epochs=3, shuffle=True, seed=seed)]

    first = order(7)
    assert first == order(7)  # deterministic for a seed
    assert first != order(8)
    # each epoch is a permutation of all rows, and the epochs are not all the same permutation
    epochs = [first[i] + first[i + 1] for i in range(0, 6, 2)]
    assert all(sorted(e) == [f"u{i}" for i in range(6)] for e in epochs)
    assert len({tuple(e) for e in epochs}) > 1
    # rows stay aligned across batch and non_tensor_batch after shuffling
    for b in dp.make_iterator(2, shuffle=True, seed=0):
        assert [f"u{r // 10}" for r in rows(b)] == uids(b)


def test_make_iterator_errors_at_call_time():
    with pytest.raises(ValueError, match="len 6 is not divisible by mini_batch_size=4"):
        make(6).make_iterator(4)
    with pytest.raises(ValueError, match="epochs must be an int >= 1, got 0"):
        make(6).make_iterator(2, epochs=0)


def test_to_device_in_place():
    dp = make(2)
    assert dp.to("cpu") is dp and dp.batch["ids"].device.type == "cpu"
    dp.to(torch.device("meta"))
    assert dp.batch["ids"].device.type == "meta" and uids(dp) == ["u0", "u1"]


# ---- serialization ------------------------------------------------------------------------------

def rich_batch(n=4):
    g = torch.Generator().manual_seed(0)
    base = torch.randn(n, 3, generator=g)
    return DataProto.from_dict(
        tensors={
            "f32": base,
            "bf16": base.to(torch.bfloat16),
            "f16": base.half(),
            "f8": base.to(torch.float8_e4m3fn),
            "i64": torch.arange(n * 3).view(n, 3),
            "u16": torch.arange(n).to(torch.uint16),
            "mask": torch.tensor([True, False] * (n // 2)),
            "strided": torch.arange(n * 4).view(4, n).t(),  # non-contiguous
            "grad": torch.ones(n, requires_grad=True),
        },
        non_tensors={"uid": [f"u{i}" for i in range(n)], "meta": [{"k": [i]} for i in range(n)],
                     "lens": np.arange(n, dtype=np.int32)},
        meta_info={"step": 3, "stats": {"a": 1.5}},
    )


def assert_same(a: DataProto, b: DataProto):
    assert set(a.batch) == set(b.batch) and set(a.non_tensor_batch) == set(b.non_tensor_batch)
    for k, v in a.batch.items():
        assert b.batch[k].dtype == v.dtype, k
        assert b.batch[k].shape == v.shape, k
        # compare bytes: float8/bf16 values and bit patterns must be exact
        assert torch.equal(b.batch[k].detach().contiguous().view(torch.uint8),
                           v.detach().contiguous().view(torch.uint8)), k
    for k, v in a.non_tensor_batch.items():
        assert b.non_tensor_batch[k].dtype == v.dtype and list(b.non_tensor_batch[k]) == list(v), k
    assert b.meta_info == a.meta_info


def oob_round_trip(dp, readonly=False):
    buffers = []
    payload = pickle.dumps(dp, protocol=5, buffer_callback=buffers.append)
    if readonly:  # what Ray's object store hands back
        buffers = [memoryview(b).toreadonly() for b in buffers]
    return pickle.loads(payload, buffers=buffers), payload, buffers


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_pickle_in_band_round_trip(protocol):
    dp = rich_batch()
    back = pickle.loads(pickle.dumps(dp, protocol=protocol))
    assert_same(dp, back)
    assert back.batch["bf16"].dtype == torch.bfloat16 and back.batch["f8"].dtype == torch.float8_e4m3fn
    assert back.non_tensor_batch["meta"][2] == {"k": [2]}
    assert not back.batch["grad"].requires_grad


def test_out_of_band_round_trip_is_zero_copy():
    dp = rich_batch()
    back, payload, buffers = oob_round_trip(dp)
    assert_same(dp, back)
    # every contiguous tensor came back as the same memory, including the bf16/f8 integer views
    for k in ["f32", "bf16", "f16", "f8", "i64", "u16", "mask", "grad"]:
        assert back.batch[k].data_ptr() == dp.batch[k].data_ptr(), k
    assert back.non_tensor_batch["lens"].ctypes.data == dp.non_tensor_batch["lens"].ctypes.data
    # the numeric payload is out of band; the in-band part holds only keys and object arrays
    assert len(buffers) >= 9


def test_large_buffer_not_copied_and_readonly_is_silent():
    big = torch.randn(1024, 1024)  # 4 MB
    dp = DataProto.from_dict(tensors={"x": big, "h": big.to(torch.bfloat16)})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        back, payload, _ = oob_round_trip(dp, readonly=True)
    assert not [w for w in caught if "not writable" in str(w.message)]
    assert len(payload) < 2000  # the 6 MB of data did not go in band
    assert back.batch["x"].data_ptr() == big.data_ptr()
    assert back.batch["h"].dtype == torch.bfloat16 and torch.equal(back.batch["h"], dp.batch["h"])
    # ordinary (out-of-place) ops on a received batch work; clone() gives writable memory
    assert torch.allclose((back.batch["x"] * 2).sum(), big.sum() * 2)
    DataProto.concat(back.chunk(4)).clone().batch["x"].add_(1)
    assert torch.equal(back.batch["x"], big)


def test_pickle_throughput_64mb():
    dp = DataProto.from_dict(
        tensors={"x": torch.randn(4096, 2048),  # 32 MB fp32
                 "y": torch.randn(4096, 4096).to(torch.bfloat16),  # 32 MB bf16
                 },
        non_tensors={"uid": [str(i) for i in range(4096)]},
    )
    assert dp.nbytes >= 64 * 2**20
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        back, _, _ = oob_round_trip(dp)
        best = min(best, time.perf_counter() - t0)
    gbps = dp.nbytes / best / 1e9
    print(f"\nDataProto pickle protocol 5 out-of-band round trip, {dp.nbytes / 2**20:.0f} MB: "
          f"{best * 1e3:.2f} ms, {gbps:.1f} GB/s")
    assert torch.equal(back.batch["y"], dp.batch["y"])
    assert gbps >= 1.0


def test_save_and_load_from_disk(tmp_path):
    dp = rich_batch()
    path = tmp_path / "batch.pkl"
    dp.save_to_disk(path)
    assert_same(dp, DataProto.load_from_disk(path))
    other = tmp_path / "other.pkl"
    other.write_bytes(pickle.dumps({"not": "a DataProto"}))
    with pytest.raises(TypeError, match="other.pkl holds a dict, not a DataProto"):
        DataProto.load_from_disk(other)


def test_unknown_format_version_is_refused():
    state = make(2).__getstate__()
    state["version"] = 999
    with pytest.raises(ValueError, match="unknown serialized format version 999"):
        DataProto.__new__(DataProto).__setstate__(state)


# ---- optional: through Ray ----------------------------------------------------------------------

@pytest.mark.serial  # starts Ray
@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("HYBRIDFLOW_RAY_TESTS") != "1", reason="set HYBRIDFLOW_RAY_TESTS=1 (starts Ray)")
def test_ray_driver_to_4_workers_and_back():
    ray = pytest.importorskip("ray")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # a short private temp dir: Ray's socket paths must stay under the unix path limit
    ray.init(num_cpus=4, include_dashboard=False, object_store_memory=512 * 2**20,
             _temp_dir=tempfile.mkdtemp(prefix="rayp", dir="/tmp"), log_to_driver=False)
    try:
        @ray.remote(num_cpus=0)
        class Echo:
            def work(self, dp: DataProto) -> DataProto:
                # a worker typically adds outputs; returning the inputs makes the payload 64 MB each way
                dp.batch["out"] = dp.batch["x"][:, :1] * 2
                return dp

        workers = [Echo.remote() for _ in range(4)]
        warm = DataProto.from_dict(tensors={"x": torch.zeros(4, 2)})
        ray.get([w.work.remote(warm) for w in workers], timeout=60)  # warm up
        dp = DataProto.from_dict(tensors={"x": torch.randn(4096, 2048),
                                          "y": torch.randn(4096, 4096).to(torch.bfloat16)},
                                 non_tensors={"uid": [str(i) for i in range(4096)]})
        def best_of(fn, reps=5):  # best of 5: the dev box is shared, single runs are noisy
            best, result = float("inf"), None
            for _ in range(reps):
                t0 = time.perf_counter()
                result = fn()
                best = min(best, time.perf_counter() - t0)
            return best, result

        def round_trip():
            return DataProto.concat(ray.get([w.work.remote(p) for w, p in zip(workers, dp.chunk(4))], timeout=60))

        best, out = best_of(round_trip)
        # The floor is one plain 64 MB copy on this machine right now; a round trip needs three
        # (args into the object store, the workers' returns, the driver's concat).
        parts = [p.batch for p in dp.chunk(4)]
        floor, _ = best_of(lambda: [np.concatenate([p[k].view(torch.int16).numpy() for p in parts]) for k in "xy"])
        gbps = dp.nbytes / best / 1e9
        print(f"\nRay driver -> 4 workers -> driver, {dp.nbytes / 2**20:.0f} MB: {best * 1e3:.1f} ms, {gbps:.2f} GB/s "
              f"(one 64 MB copy here: {floor * 1e3:.1f} ms)")
        assert torch.equal(out.batch["y"], dp.batch["y"]) and out.batch["y"].dtype == torch.bfloat16
        assert torch.equal(out.batch["out"][:, 0], dp.batch["x"][:, 0] * 2)
        assert list(out.non_tensor_batch["uid"]) == list(dp.non_tensor_batch["uid"])
        assert best <= 5 * floor + 0.03, "more copies than the three a round trip needs"
        if floor < 0.01:  # an idle machine (>= 6.4 GB/s memcpy) must reach the 1 GB/s target
            assert gbps >= 1.0
    finally:
        ray.shutdown()
