"""What a role's update costs on this rank: peak memory and seconds per micro-batch, measured around its
method (not inside the engine).

`UpdatePerf` times each optimizer update (`engine.train_step`: the forward and backward of every micro-batch
plus the optimizer step) and divides by its micro-batches. The numbers go two ways:
- into the step metrics the method returns (`<role>/perf/...`, averaged over DP ranks by the driver), so the
  jsonl, TensorBoard and the prometheus logger's endpoint have them;
- into Ray's metrics agent of this worker's node as `hybridflow_worker_*` gauges labelled role and rank
  (Ray's Prometheus export shows them as `ray_hybridflow_worker_*`, one series per rank).

Peak memory: on CUDA verl's `max_memory_allocated_gb` / `max_memory_reserved_gb` (torch's caching allocator,
since the process started); always `peak_rss_gb`, the process's peak resident set (getrusage's ru_maxrss,
KiB on Linux), which is the number that matters on CPU.
"""

from __future__ import annotations

import logging
import resource
import time

import torch

log = logging.getLogger(__name__)
GIB = 1024**3


def peak_memory_gb() -> dict[str, float]:
    out = {"peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["max_memory_allocated_gb"] = torch.cuda.max_memory_allocated() / GIB
        out["max_memory_reserved_gb"] = torch.cuda.max_memory_reserved() / GIB
    return out


class UpdatePerf:
    """Accumulates the updates of one role-method call; `metrics()` at the end gives `<role>/perf/*`."""

    def __init__(self, role: str, rank: int):
        self.role, self.rank = role, rank
        self.seconds = 0.0
        self.micro = 0

    def timed(self, fn):
        """Run one `train_step` and count its micro-batches as it reports them (fixed-size or token-budget)."""
        t = time.perf_counter()
        out = fn()
        self.seconds += time.perf_counter() - t
        self.micro += int(out.get("num_micro_batches", 0))
        return out

    def metrics(self) -> dict[str, float]:
        values = dict(peak_memory_gb())
        if self.micro:
            values["update_s_per_micro_batch"] = self.seconds / self.micro
        export_to_ray(values, self.role, self.rank)
        return {f"{self.role}/perf/{k}": v for k, v in values.items()}


_GAUGES: dict[str, object] = {}


def export_to_ray(values: dict[str, float], role: str, rank: int) -> None:
    """hybridflow_worker_<name>{role, rank} gauges in this process's Ray metrics agent (no-op outside Ray)."""
    try:
        import ray
        from ray.util.metrics import Gauge
    except ImportError:
        return
    if not ray.is_initialized():
        return
    tags = {"role": role, "rank": str(rank)}
    for name, value in values.items():
        gauge_name = f"hybridflow_worker_{name}"
        if gauge_name not in _GAUGES:
            _GAUGES[gauge_name] = Gauge(gauge_name, description=f"HybridFlow worker {name}, per role and rank",
                                        tag_keys=("role", "rank"))
        _GAUGES[gauge_name].set(value, tags=tags)
