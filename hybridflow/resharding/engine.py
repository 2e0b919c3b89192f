"""Execute a ReshardPlan with torch.distributed point-to-point messages, one bucket at a time.

Every rank walks the same list of buckets (consecutive parameters whose per-rank cost - new
generation shards + messages - fits `bucket_bytes`, computed from the plan, so identical on all
ranks). Per bucket a rank
  1. allocates the generation shards it does not alias, and copies in the rows it already holds,
  2. posts all of its sends and receives of the bucket at once (`batch_isend_irecv`; on NCCL that is
     one group call, so the order of pairs cannot deadlock), receiving straight into the shard when
     the target rows are contiguous and through a staging buffer otherwise,
  3. waits on every message with a timeout, then yields the bucket's finished shards.
So the memory beyond the training shards is one bucket of new shards plus its staging buffers.

Zero copy: where a rank's generation shard is exactly its training shard (t_g == t on the rank's own
stage, and replicated parameters of its own stage) the yielded tensor IS the training tensor.
"""

from __future__ import annotations

import datetime
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from hybridflow.resharding.intervals import intersect, local_offset, total_length
from hybridflow.resharding.planner import ParamSpec, ReshardPlan, Transfer
from hybridflow.resharding.waits import wait_or_raise

DEFAULT_BUCKET_BYTES = 256 << 20


class ReshardError(RuntimeError):
    """Local shards do not match the plan, or a message did not complete in time."""


@dataclass
class ReshardStats:
    bytes_sent: int = 0
    bytes_recv: int = 0
    bytes_local_copy: int = 0  # rows copied from this rank's own training shards into new shards
    bytes_aliased: int = 0  # generation shards that are the training tensor itself (zero copy)
    bytes_new_shards: int = 0  # generation shards allocated
    peak_extra_bytes: int = 0  # max over buckets: new shards of the bucket + staging buffers
    num_buckets: int = 0
    num_messages: int = 0
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)


def shared_dtypes(plan: ReshardPlan, train_shards: dict[str, torch.Tensor], group=None) -> dict[str, torch.dtype]:
    """dtype of every parameter; those of other stages are learned from their holders (one collective)."""
    local = {n: str(t.dtype).removeprefix("torch.") for n, t in train_shards.items()}
    gathered: list = [None] * plan.world_size
    dist.all_gather_object(gathered, local, group=group)
    merged: dict[str, torch.dtype] = {}
    for part in gathered:
        for n, d in part.items():
            merged.setdefault(n, getattr(torch, d))
    missing = [s.name for s in plan.specs if s.name not in merged]
    if missing:
        raise ReshardError(f"no rank holds a training shard of {missing[:5]}")
    return merged


def _as_rows(t: torch.Tensor, spec: ParamSpec) -> tuple[torch.Tensor, int]:
    """The tensor and the dim to slice rows on (a 0-d tensor is one row)."""
    return (t.reshape(1), 0) if not spec.full_shape else (t, spec.partition_dim)


class ReshardEngine:
    """Runs `plan` on this rank. `group` (default: WORLD) must list the plan's ranks in plan order."""

    def __init__(
        self,
        plan: ReshardPlan,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        group: dist.ProcessGroup | None = None,
        timeout_s: float = 120.0,
        rank: int | None = None,
    ):
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes={bucket_bytes} must be >= 1")
        self.plan = plan
        self.group = group
        self.rank = dist.get_rank(group) if rank is None else rank
        size = dist.get_world_size(group)
        if size != plan.world_size:
            raise ReshardError(f"process group has {size} ranks, the plan {plan.world_size}")
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.bucket_bytes = bucket_bytes
        self._transfers: dict[str, list[Transfer]] = defaultdict(list)
        for tr in plan.transfers:
            self._transfers[tr.name].append(tr)
        self.buckets = self._make_buckets()
        self.stats = ReshardStats()
        self._dtype_cache: dict[str, torch.dtype] | None = None

    # ---- bucketing (pure, identical on every rank) --------------------------------------------------------

    def _cost(self, rank: int, spec: ParamSpec) -> int:
        new_shard = 0 if self.plan.aliases(rank, spec) else total_length(self.plan.needs(rank, spec)) * spec.row_bytes
        moved = sum(tr.nbytes for tr in self._transfers[spec.name] if rank in (tr.src, tr.dst))
        return new_shard + moved

    def _make_buckets(self) -> list[list[ParamSpec]]:
        """Consecutive parameters while the most loaded rank stays within bucket_bytes (>= 1 parameter each)."""
        buckets: list[list[ParamSpec]] = []
        load = [0] * self.plan.world_size
        for spec in self.plan.specs:
            costs = [self._cost(r, spec) for r in range(self.plan.world_size)]
            if buckets and max(a + c for a, c in zip(load, costs)) <= self.bucket_bytes:
                buckets[-1].append(spec)
                load = [a + c for a, c in zip(load, costs)]
            else:
                buckets.append([spec])
                load = costs
        return buckets

    # ---- execution -------------------------------------------------------------------------------------

    def _peer(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def _check_shard(self, spec: ParamSpec, shards: dict[str, torch.Tensor]) -> torch.Tensor | None:
        held = self.plan.holds(self.rank, spec)
        if not held:
            return None
        if spec.name not in shards:
            raise ReshardError(f"rank {self.rank}: training shard of {spec.name!r} (stage {spec.pp_stage}) is missing")
        t = shards[spec.name]
        want = spec.shard_shape(held)
        if tuple(t.shape) != want:
            raise ReshardError(f"rank {self.rank}: {spec.name!r} has shape {tuple(t.shape)}, the plan expects {want}")
        if t.element_size() != spec.dtype_bytes:
            raise ReshardError(f"rank {self.rank}: {spec.name!r} has {t.element_size()}-byte elements, "
                               f"the plan expects {spec.dtype_bytes}")
        return t

    def iter_shards(self, train_shards: dict[str, torch.Tensor]) -> Iterator[dict[str, torch.Tensor]]:
        """Yield, bucket by bucket, {name: this rank's generation shard} for every parameter of the model.

        `train_shards` maps global parameter names to this rank's training shards (its stage only).
        All ranks of the group must consume the generator to the end, in step.
        """
        self.stats = ReshardStats()
        some = next(iter(train_shards.values()), None)
        device = some.device if some is not None else torch.device("cpu")
        start = time.perf_counter()
        dtypes = self._dtypes(train_shards)
        self.stats.seconds += time.perf_counter() - start
        for bucket in self.buckets:
            start = time.perf_counter()  # engine time only, not the consumer's time between buckets
            with torch.no_grad():
                part = self._run_bucket(bucket, train_shards, dtypes, device)
            self.stats.seconds += time.perf_counter() - start
            yield part

    def _dtypes(self, train_shards: dict[str, torch.Tensor]) -> dict[str, torch.dtype]:
        if self._dtype_cache is None:
            self._dtype_cache = shared_dtypes(self.plan, train_shards, self.group)
        return self._dtype_cache

    def run(self, train_shards: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """All generation shards at once (materialised); prefer `iter_shards` to stream into vLLM."""
        out: dict[str, torch.Tensor] = {}
        for part in self.iter_shards(train_shards):
            out.update(part)
        return out

    def _run_bucket(self, bucket, train_shards, dtypes, device) -> dict[str, torch.Tensor]:
        plan, me, st = self.plan, self.rank, self.stats
        out: dict[str, torch.Tensor] = {}
        extra = 0
        ops: list[dist.P2POp] = []
        unstage: list[tuple[torch.Tensor, torch.Tensor]] = []  # (staging buffer, destination view)
        tag = 0  # same running message number on every rank: gloo matches messages by (peer, tag)
        for spec in bucket:
            held, need = plan.holds(me, spec), plan.needs(me, spec)
            src_tensor = self._check_shard(spec, train_shards)
            if plan.aliases(me, spec):
                out[spec.name] = src_tensor
                st.bytes_aliased += src_tensor.numel() * src_tensor.element_size()
            else:
                shard = torch.empty(spec.shard_shape(need), dtype=dtypes[spec.name], device=device)
                out[spec.name] = shard
                nbytes = shard.numel() * shard.element_size()
                st.bytes_new_shards += nbytes
                extra += nbytes
                if src_tensor is not None:
                    src_rows, dim = _as_rows(src_tensor, spec)
                    dst_rows, _ = _as_rows(shard, spec)
                    for a, b in intersect(need, held):
                        dst_rows.narrow(dim, local_offset(need, a, b), b - a).copy_(
                            src_rows.narrow(dim, local_offset(held, a, b), b - a))
                        st.bytes_local_copy += (b - a) * spec.row_bytes
            for tr in self._transfers[spec.name]:
                for a, b in tr.intervals:
                    tag += 1
                    if tr.src == me:
                        rows, dim = _as_rows(src_tensor, spec)
                        view = rows.narrow(dim, local_offset(held, a, b), b - a)
                        if not view.is_contiguous():
                            view = view.contiguous()
                            extra += view.numel() * view.element_size()
                        ops.append(dist.P2POp(dist.isend, view, self._peer(tr.dst), self.group, tag))
                        st.bytes_sent += view.numel() * view.element_size()
                    elif tr.dst == me:
                        rows, dim = _as_rows(out[spec.name], spec)
                        view = rows.narrow(dim, local_offset(need, a, b), b - a)
                        if not view.is_contiguous():
                            buf = torch.empty(view.shape, dtype=view.dtype, device=device)
                            extra += buf.numel() * buf.element_size()
                            unstage.append((buf, view))
                            view = buf
                        ops.append(dist.P2POp(dist.irecv, view, self._peer(tr.src), self.group, tag))
                        st.bytes_recv += view.numel() * view.element_size()
        if ops:
            works = dist.batch_isend_irecv(ops)
            for i, work in enumerate(works):
                wait_or_raise(work, self.timeout, ReshardError, f"rank {me}: message {i + 1}/{len(works)} of bucket "
                              f"{st.num_buckets} ({[s.name for s in bucket][:3]}...)")
            st.num_messages += len(ops)
        for buf, view in unstage:
            view.copy_(buf)
        st.num_buckets += 1
        st.peak_extra_bytes = max(st.peak_extra_bytes, extra)
        return out
