"""Baseline for comparison: every rank all-gathers the full model, then keeps its generation shard.

This is the HybridFlow-V / "gather everything" transition: per parameter an all_gather over the
training TP group of the parameter's stage (stride-aware reassembly), then a broadcast of the
full tensor over the pipeline group, so every rank receives (t*p - 1)/(t*p) * M. Peak extra memory
is the largest full parameter plus its gathered pieces (the paper's table counts the whole model M
because those systems keep it; this baseline frees each full tensor after slicing).
Used by launch/bench_reshard.py and as a second, independent path in the engine tests.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch
import torch.distributed as dist

from hybridflow.resharding.engine import ReshardStats, shared_dtypes
from hybridflow.resharding.planner import ParamSpec, ReshardPlan


class NaiveAllGather:
    def __init__(self, plan: ReshardPlan, timeout_s: float = 120.0):
        import datetime

        if dist.get_world_size() != plan.world_size:
            raise RuntimeError(f"world has {dist.get_world_size()} ranks, the plan {plan.world_size}")
        self.plan, self.rank = plan, dist.get_rank()
        timeout = datetime.timedelta(seconds=timeout_s)
        self.tp_group = self.pp_group = None
        self.pp_ranks: list[int] = []
        # Every rank takes part in creating every group, in the same order.
        by_tp: dict[tuple, list[int]] = {}
        by_pp: dict[tuple, list[int]] = {}
        for pl in plan.placements:
            by_tp.setdefault((pl.pp, pl.cp, pl.dp), []).append(pl.rank)
            by_pp.setdefault((pl.tp, pl.cp, pl.dp), []).append(pl.rank)
        for ranks in by_tp.values():
            g = dist.new_group(ranks, timeout=timeout)
            if self.rank in ranks:
                self.tp_group = g
        for ranks in by_pp.values():
            g = dist.new_group(ranks, timeout=timeout)
            if self.rank in ranks:
                self.pp_group, self.pp_ranks = g, ranks  # ordered by stage
        self.stats = ReshardStats()

    def _full(self, spec: ParamSpec, shard: torch.Tensor | None, dtype, device) -> torch.Tensor:
        plan, st = self.plan, self.stats
        t = plan.train.tp
        extra = 0
        full = None
        if shard is not None:  # this rank's stage: gather the TP shards
            if spec.tensor_parallel and t > 1:
                pieces = [torch.empty_like(shard) for _ in range(t)]
                dist.all_gather(pieces, shard.contiguous(), group=self.tp_group)
                st.bytes_recv += (t - 1) * shard.numel() * shard.element_size()
                dim, stride = spec.partition_dim, spec.partition_stride
                blocks = [p.chunk(stride, dim=dim) for p in pieces]  # each rank's shard is [block_0; block_1; ...]
                full = torch.cat([blocks[i][b] for b in range(stride) for i in range(t)], dim=dim)
                extra += 2 * full.numel() * full.element_size()
            else:
                full = shard
        if plan.train.pp > 1:
            src = self.pp_ranks[spec.pp_stage]
            if full is None:
                full = torch.empty(spec.full_shape, dtype=dtype, device=device)
                st.bytes_recv += full.numel() * full.element_size()
                extra += full.numel() * full.element_size()
            dist.broadcast(full, src=src, group=self.pp_group)
        st.peak_extra_bytes = max(st.peak_extra_bytes, extra)
        return full

    def iter_shards(self, train_shards: dict[str, torch.Tensor]) -> Iterator[dict[str, torch.Tensor]]:
        self.stats = ReshardStats()
        start = time.perf_counter()
        dtypes = shared_dtypes(self.plan, train_shards)
        some = next(iter(train_shards.values()), None)
        device = some.device if some is not None else torch.device("cpu")
        self.stats.seconds += time.perf_counter() - start
        for spec in self.plan.specs:
            start = time.perf_counter()
            with torch.no_grad():
                full = self._full(spec, train_shards.get(spec.name), dtypes[spec.name], device)
                rows, dim = (full.reshape(1), 0) if not spec.full_shape else (full, spec.partition_dim)
                need = self.plan.needs(self.rank, spec)
                shard = torch.cat([rows.narrow(dim, a, b - a) for a, b in need], dim=dim)
                shard = shard.reshape(()) if not spec.full_shape else shard
            self.stats.num_buckets += 1
            self.stats.seconds += time.perf_counter() - start
            yield {spec.name: shard}

    def run(self, train_shards: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for part in self.iter_shards(train_shards):
            out.update(part)
        return out
