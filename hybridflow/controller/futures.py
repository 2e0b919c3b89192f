"""Futures of worker-group calls, passable to another worker group without a trip through the driver.

`group.method.remote(batch)` returns a `GroupFuture` over the per-rank Ray
ObjectRefs. Handed to another group's data-parallel method, it is split into
`FutureShard`s that carry only ObjectRefs; each receiving worker fetches its
part straight from the object store (`resolve_futures`, run on the worker).
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridflow.controller.errors import WorkerError


@dataclass
class FutureShard:
    refs: list  # ObjectRefs of the source's collected outputs, in dp order
    index: int
    num_shards: int
    role: str

    def resolve(self):
        import ray

        if len(self.refs) == self.num_shards:
            # Shard counts match: shard i is exactly source output i (no concat, no copy).
            return _unwrap(ray.get(self.refs[self.index]), self.role, self.index)
        parts = [_unwrap(r, self.role, i) for i, r in enumerate(ray.get(list(self.refs)))]
        whole = type(parts[0]).concat(parts)
        return whole.chunk(self.num_shards)[self.index]


def _unwrap(result, role: str, rank: int):
    status, value = result
    if status != "ok":
        raise WorkerError(role, rank, "<future>", value)
    return value


class GroupFuture:
    """The pending result of one worker-group call."""

    def __init__(self, group, method: str, refs: list, ranks: list[int], collect, collect_refs: list):
        self._group, self._method, self._refs, self._ranks, self._collect = group, method, refs, ranks, collect
        self._collect_refs = collect_refs  # the refs holding the result, one per dp replica, in dp order

    def get(self, timeout_s: float | None = None):
        outputs = self._group._wait(self._method, self._refs, self._ranks, timeout_s)
        return self._collect(outputs)

    def chunk_for_dispatch(self, n: int) -> list[FutureShard]:
        return [FutureShard(self._collect_refs, i, n, self._group.role) for i in range(n)]


def _resolve(v):
    import ray

    if isinstance(v, FutureShard):
        return v.resolve()
    if isinstance(v, ray.ObjectRef):  # a batch the driver put once for many ranks
        return ray.get(v)
    return v


def resolve_futures(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Runs on the worker: fetch batches from the object store (zero-copy for numpy-backed tensors)."""
    return tuple(_resolve(a) for a in args), {k: _resolve(v) for k, v in kwargs.items()}
