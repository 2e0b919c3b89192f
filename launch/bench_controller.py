"""Controller benchmark: driver->workers call latency and DataProto dispatch+collect throughput.

Prints one JSON object on its last line:
    {"call_latency_ms": ..., "dataproto_gbps": ..., ...}
`dataproto_gbps` is (bytes sent + bytes received) / wall time for a 64 MB batch split
over 4 workers (DP_COMPUTE_PROTO) that return a same-size result, median of several rounds.
`raw_gbps` moves the same bytes to the same workers as plain numpy shards (Ray puts arguments this large in
its object store; the result comes back through ray.get), with no DataProto, dispatch or collect, in the same
run; `dataproto_vs_raw` is their ratio, which stays comparable when the shared machine's absolute GB/s moves
(0.57-1.20 GB/s measured for the same script on different runs).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hybridflow.controller import Dispatch, RayWorkerGroup, ResourcePool, Worker, init_ray, register  # noqa: E402
from hybridflow.protocol import DataProto  # noqa: E402


class BenchWorker(Worker):
    def __init__(self):
        super().__init__()
        # Declared like the Megatron workers declare theirs, so the group caches it and a call costs no
        # mesh query (undeclared meshes are asked for on every call: ~20 ms of a 64 MB round trip here).
        self.set_mesh_coords(dp_rank=self.rank, dp_size=self.world_size)

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def noop(self, x):
        return x

    @register(dispatch=Dispatch.DP_COMPUTE_PROTO)
    def transform(self, data: DataProto) -> DataProto:
        # A new tensor of the input's size, as a log-prob or value pass would return.
        return DataProto.from_dict({"out": data.batch["x"] + 1})

    def raw_transform(self, x):
        return x + 1  # the same work on a bare numpy shard (called through WorkerHost.call, undecorated)


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--mbytes", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=7)
    a = ap.parse_args()
    init_ray(num_cpus=max(8, os.cpu_count() or 1), object_store_memory=2 * 1024**3, run_dir="runs/bench")
    pool = ResourcePool("bench", [a.workers], cpus_per_proc=0.5, max_colocate=1)
    group = RayWorkerGroup(pool, BenchWorker, role="bench", timeout_s=300)
    group.noop(0)  # warm up
    lat = []
    for _ in range(50):
        t = time.perf_counter()
        group.noop(1)
        lat.append((time.perf_counter() - t) * 1e3)
    n = a.mbytes * 1024**2 // 4
    rows = 4096
    batch = DataProto.from_dict({"x": torch.randn(rows, n // rows)})
    nbytes = batch.nbytes
    times = []
    for i in range(a.rounds + 1):
        t = time.perf_counter()
        out = group.transform(batch)
        dt = time.perf_counter() - t
        if i:
            times.append(dt)
    assert torch.equal(out.batch["out"], batch.batch["x"] + 1)
    med = statistics.median(times)
    import numpy as np
    import ray

    hosts = [group.host(r) for r in range(a.workers)]
    shards = np.array_split(batch.batch["x"].numpy(), a.workers)
    raw_times = []
    for i in range(a.rounds + 1):
        t = time.perf_counter()
        results = ray.get([h.call.remote("bench", "raw_transform", (x,), {}) for h, x in zip(hosts, shards)],
                          timeout=300)
        raw = np.concatenate([r[1] for r in results])
        dt = time.perf_counter() - t
        if i:
            raw_times.append(dt)
    assert all(status == "ok" for status, _ in results) and np.array_equal(raw, batch.batch["x"].numpy() + 1)
    raw_med = statistics.median(raw_times)
    print(json.dumps({
        "call_latency_ms": round(statistics.median(lat), 3),
        "call_latency_p90_ms": round(sorted(lat)[int(0.9 * len(lat))], 3),
        "dataproto_gbps": round(2 * nbytes / med / 1e9, 3),
        "dataproto_bytes": nbytes,
        "dataproto_round_trip_s": round(med, 4),
        "raw_gbps": round(2 * nbytes / raw_med / 1e9, 3),
        "dataproto_vs_raw": round(raw_med / med, 3),
        "workers": a.workers,
    }))


if __name__ == "__main__":
    main()
