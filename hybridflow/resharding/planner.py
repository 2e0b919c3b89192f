"""The 3D-HybridEngine's resharding plan: pure logic, no torch.distributed.

Given the training layout (t, p, d[, cp]) and the generation layout (t_g, p_g = 1) this decides
1. which generation replica and generation-TP rank every world rank plays (`place_ranks`), and
2. per parameter, which rank sends which rows of the full tensor to which rank (`plan_resharding`),
so that every rank ends with its generation TP shard of every parameter of every layer, while
receiving only what it does not already hold.

Rank placement (the paper's mesh, HybridFlow section 5): with Megatron's order (tp fastest, then
cp, dp, pp), the ranks sharing (cp, dp, pp) form one training TP group g = rank // t.
  * t_g <= t, k = t / t_g: generation TP groups are strided by k inside a training TP group
    (ranks g*t + i0 + k*j, j = 0..t_g-1, for each i0 < k), and the k ranks with equal j (the
    micro-DP group) are consecutive. Training slice tp = i0 + k*j lies inside generation slice j.
  * t_g > t, k = t_g / t: a generation group joins k consecutive training TP groups G*k + m,
    and the rank with training slice i of group m takes generation slice i*k + m, which lies
    inside its training slice. Within such a group the generation rank does not grow with the
    world rank when t > 1 (`ReshardPlan.groups_ascending` is False) - see vllm_groups.py.
Either way every rank's generation shard and training shard nest, which makes the received bytes
per rank the minimum M/t_g - M_s/max(t, t_g) (M_s: bytes of the rank's own pipeline stage;
M/t_g - M/(p*max(t, t_g)) with equal stages; the paper's (t - t_g)/(t_g*t)*M for p = 1, t_g <= t).

Experts (MoE): an expert's weights live in the expert mesh, not the dense one. Megatron gives each
expert-parallel (EP) rank E/ep whole experts and splits each over the expert-TP group (etp, not tp),
ranks ordered etp-ep-edp-pp (`ParallelDims.expert_coords`). A spec says so with `ep_owner` (the EP
rank whose ranks hold it); it is then held by the ranks of that EP rank on its stage, split over
etp, and by no other rank. The generation side is unchanged: vLLM TP needs every expert on every
rank, each split on its FFN dim like a dense MLP. The routing below does not care which mesh a slice
comes from, so experts are planned by the same loop and every rank again receives exactly what it
needs minus what it holds; experts do not nest with the generation shards, so no closed form.

Index space: a parameter's rows are counted along its `partition_dim` in the full (TP = 1)
Megatron tensor, vocab padding included. A shard is an ordered tuple of intervals in that space
(see intervals.py); `partition_stride=2` (fc1 = [gate; up]) makes it two intervals.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from functools import cached_property
from math import prod

from hybridflow.parallel.dims import GenerationDims, LayoutError, ModelShape, ParallelDims
from hybridflow.resharding.intervals import (
    Intervals,
    intersect,
    merge_adjacent,
    padded_shard,
    strided_shard,
    subtract,
    total_length,
)


@dataclass(frozen=True)
class ParamSpec:
    """One parameter as the planner sees it: full shape plus Megatron's own TP attributes.

    name           global and PP-independent (layer numbers already offset by the stage)
    full_shape     the TP = 1 Megatron shape, vocab padding included
    valid_size     rows along partition_dim that are real (the unpadded vocab); None: all
    gen_pad_multiple  the generation engine pads valid_size up to this multiple and splits the
                   result evenly by t_g (vLLM's vocab-parallel layers pad to 64); 1: no padding
    ep_owner       None: the dense mesh (every rank of the stage holds it, split over tp). An int:
                   an expert's weight, held only by the ranks with this expert-parallel rank and
                   split over the expert-TP size etp (`train_split`)
    """

    name: str
    full_shape: tuple[int, ...]
    dtype_bytes: int
    tensor_parallel: bool = False
    partition_dim: int = 0
    partition_stride: int = 1
    pp_stage: int = 0
    valid_size: int | None = None
    gen_pad_multiple: int = 1
    ep_owner: int | None = None

    @property
    def length(self) -> int:
        """Rows along the partition dim (1 for a 0-d tensor, which is then moved whole)."""
        return self.full_shape[self.partition_dim] if self.full_shape else 1

    @cached_property
    def row_bytes(self) -> int:
        """Bytes of one index along the partition dim."""
        return prod(self.full_shape) * self.dtype_bytes // self.length

    @property
    def nbytes(self) -> int:
        return prod(self.full_shape) * self.dtype_bytes

    def train_split(self, train: ParallelDims) -> int:
        """The TP size the training shards are split over: tp, or etp for an expert's weight."""
        return train.tp if self.ep_owner is None else train.expert_tp

    def train_layout(self, tp_rank: int, t: int) -> Intervals:
        """Rows the training rank with TP rank `tp_rank` holds (padding rows included)."""
        if not self.tensor_parallel:
            return ((0, self.length),)
        return strided_shard(self.length, self.partition_stride, t, tp_rank)

    def gen_layout(self, gen_rank: int, t_g: int) -> Intervals:
        """Rows generation TP rank `gen_rank` needs (real rows only)."""
        if not self.tensor_parallel:
            return ((0, self.length),)
        if self.valid_size is not None:
            return padded_shard(self.valid_size, self.gen_pad_multiple, t_g, gen_rank)
        return strided_shard(self.length, self.partition_stride, t_g, gen_rank)

    def shard_shape(self, layout: Intervals) -> tuple[int, ...]:
        if not self.full_shape:
            return ()
        shape = list(self.full_shape)
        shape[self.partition_dim] = total_length(layout)
        return tuple(shape)

    def validate(self, train: ParallelDims, gen: GenerationDims) -> None:
        where = f"parameter {self.name!r} (shape {self.full_shape})"
        if self.dtype_bytes < 1:
            raise LayoutError(f"{where}: dtype_bytes={self.dtype_bytes} must be >= 1")
        if not 0 <= self.pp_stage < train.pp:
            raise LayoutError(f"{where}: pp_stage={self.pp_stage} outside pipeline size {train.pp}")
        if self.full_shape and not 0 <= self.partition_dim < len(self.full_shape):
            raise LayoutError(f"{where}: partition_dim={self.partition_dim} out of range")
        if self.ep_owner is not None and not 0 <= self.ep_owner < train.ep:
            raise LayoutError(f"{where}: ep_owner={self.ep_owner} outside expert parallel size {train.ep}")
        if not self.tensor_parallel:
            return
        stride = self.partition_stride
        if stride < 1:
            raise LayoutError(f"{where}: partition_stride={stride} must be >= 1")
        t, t_name = (train.tp, "tp") if self.ep_owner is None else (train.expert_tp, "etp")
        if self.length % (stride * t) != 0:
            raise LayoutError(f"{where}: dim {self.partition_dim} = {self.length} is not divisible by "
                              f"partition_stride*{t_name} = {stride}*{t}")
        if self.valid_size is None:
            if self.length % (stride * gen.tp) != 0:
                raise LayoutError(f"{where}: dim {self.partition_dim} = {self.length} is not divisible by "
                                  f"partition_stride*rollout_tp = {stride}*{gen.tp}")
            return
        if stride != 1:
            raise LayoutError(f"{where}: valid_size (vocab padding) needs partition_stride=1, got {stride}")
        if not 0 < self.valid_size <= self.length:
            raise LayoutError(f"{where}: valid_size={self.valid_size} must be in [1, {self.length}]")
        padded = -(-self.valid_size // self.gen_pad_multiple) * self.gen_pad_multiple
        if padded % gen.tp != 0:
            raise LayoutError(f"{where}: generation vocab {self.valid_size} padded to a multiple of "
                              f"{self.gen_pad_multiple} = {padded} is not divisible by rollout tp={gen.tp}")


def spec_named(cache: dict, specs, name: str, plan: str) -> ParamSpec:
    """A plan's ParamSpec by parameter name (the name index built once into the plan's `cache`)."""
    if "specs" not in cache:
        cache["specs"] = {s.name: s for s in specs}
    try:
        return cache["specs"][name]
    except KeyError:
        raise KeyError(f"parameter {name!r} is not in {plan}") from None


@dataclass(frozen=True)
class RankPlacement:
    """One world rank in both layouts."""

    rank: int
    tp: int
    cp: int
    dp: int
    pp: int
    replica: int  # generation replica (which vLLM engine instance / micro-DP slot)
    gen_tp: int  # rank inside its generation TP group
    ep: int = 0  # the expert mesh (ParallelDims.expert_coords): expert-parallel rank
    etp: int = 0  # and expert-TP rank


def train_slice(pl: RankPlacement, spec: ParamSpec) -> int | None:
    """Which training TP slice of `spec` the rank holds (its TP rank, or its expert-TP rank for an expert's
    weight); None: none (another pipeline stage, or another EP rank's expert)."""
    if pl.pp != spec.pp_stage:
        return None
    if spec.ep_owner is None:
        return pl.tp
    return pl.etp if pl.ep == spec.ep_owner else None


@dataclass(frozen=True)
class Transfer:
    """Rows `intervals` (full index space, in the receiver's shard order) of `name` from src to dst."""

    name: str
    src: int
    dst: int
    intervals: Intervals
    nbytes: int


@dataclass(frozen=True)
class ReshardPlan:
    train: ParallelDims
    gen: GenerationDims
    specs: tuple[ParamSpec, ...]
    placements: tuple[RankPlacement, ...]  # indexed by world rank
    gen_tp_groups: tuple[tuple[int, ...], ...]  # by replica; each in generation-TP-rank order
    transfers: tuple[Transfer, ...]  # grouped by parameter, in spec order
    _cache: dict = field(default_factory=dict, compare=False, repr=False)  # lazy caches

    @property
    def world_size(self) -> int:
        return self.train.world_size

    @property
    def groups_ascending(self) -> bool:
        """True when every generation group's world ranks grow with the generation TP rank.

        torch.distributed.new_group sorts ranks by default, so only ascending groups keep the
        group rank equal to the generation TP rank without asking torch not to sort.
        """
        return all(list(g) == sorted(g) for g in self.gen_tp_groups)

    def spec(self, name: str) -> ParamSpec:
        return spec_named(self._cache, self.specs, name, "the resharding plan")

    def holds(self, rank: int, spec: ParamSpec) -> Intervals:
        """Rows of `spec` in `rank`'s training shard; () if the parameter lives on another stage or EP rank."""
        i = train_slice(self.placements[rank], spec)
        return () if i is None else spec.train_layout(i, spec.train_split(self.train))

    def needs(self, rank: int, spec: ParamSpec) -> Intervals:
        return spec.gen_layout(self.placements[rank].gen_tp, self.gen.tp)

    def aliases(self, rank: int, spec: ParamSpec) -> bool:
        """The generation shard is exactly the training shard (same rows, same order): no copy needed."""
        held = self.holds(rank, spec)
        return bool(held) and held == self.needs(rank, spec)

    def expected_recv_bytes(self, rank: int) -> int:
        """The lower bound for `rank`: bytes of its generation shards it does not already hold."""
        return sum(total_length(subtract(self.needs(rank, s), self.holds(rank, s))) * s.row_bytes for s in self.specs)

    def recv_bytes(self, rank: int) -> int:
        return self._totals()[0][rank]

    def send_bytes(self, rank: int) -> int:
        return self._totals()[1][rank]

    def _totals(self) -> tuple[list[int], list[int]]:
        if "totals" not in self._cache:
            recv, sent = [0] * self.world_size, [0] * self.world_size
            for tr in self.transfers:
                recv[tr.dst] += tr.nbytes
                sent[tr.src] += tr.nbytes
            self._cache["totals"] = (recv, sent)
        return self._cache["totals"]

    def transfers_for(self, rank: int) -> list[Transfer]:
        return [tr for tr in self.transfers if rank in (tr.src, tr.dst)]


def check_layouts(train: ParallelDims, gen: GenerationDims, model: ModelShape | None = None) -> None:
    """Every layout error at plan time, with the numbers."""
    train.validate(model=model)
    gen.validate(train, model)
    t, t_g = train.tp, gen.tp
    if t % t_g != 0 and t_g % t != 0:
        raise LayoutError(f"rollout tp={t_g} and training tp={t} must divide one another so that shards nest")
    if t_g > t and (train.world_size // t) % (t_g // t) != 0:
        raise LayoutError(f"rollout tp={t_g} = {t_g // t} training TP groups of {t}, which does not divide the "
                          f"{train.world_size // t} training TP groups (cp*dp*pp = {train.cp}*{train.dp}*{train.pp})")


def place_ranks(
    train: ParallelDims, gen: GenerationDims
) -> tuple[tuple[RankPlacement, ...], tuple[tuple[int, ...], ...]]:
    """The paper's mesh: every rank's (replica, generation TP rank), and the generation TP groups."""
    check_layouts(train, gen)
    t, t_g = train.tp, gen.tp
    placements = []
    for rank in range(train.world_size):
        c = train.coords(rank)
        g = rank // t  # training TP group index: (cp, dp, pp) flattened in Megatron's order
        if t_g <= t:
            k = t // t_g
            replica, gen_tp = g * k + c["tp"] % k, c["tp"] // k
        else:
            k = t_g // t
            replica, gen_tp = g // k, c["tp"] * k + g % k
        e = train.expert_coords(rank)
        placements.append(RankPlacement(rank, c["tp"], c["cp"], c["dp"], c["pp"], replica, gen_tp, e["ep"], e["etp"]))
    groups = [[-1] * t_g for _ in range(train.world_size // t_g)]
    for pl in placements:
        groups[pl.replica][pl.gen_tp] = pl.rank
    return tuple(placements), tuple(tuple(g) for g in groups)


def plan_resharding(
    train: ParallelDims,
    gen: GenerationDims,
    specs: list[ParamSpec] | tuple[ParamSpec, ...],
    model: ModelShape | None = None,
) -> ReshardPlan:
    """Place ranks, then for every parameter route each missing piece from the least-loaded holder."""
    check_layouts(train, gen, model)
    names = [s.name for s in specs]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise LayoutError(f"parameter names must be unique across pipeline stages; repeated: {dupes[:5]}")
    for s in specs:
        s.validate(train, gen)
    placements, groups = place_ranks(train, gen)

    world = train.world_size
    # Holders of each training slice: (pp stage, owner, slice) -> world ranks. Dense slices (owner None)
    # are TP ranks, held by all cp and dp replicas; an expert's (owner = its EP rank) are expert-TP ranks,
    # held by the expert-DP replicas of that EP rank.
    holders: dict[tuple[int, int | None, int], list[int]] = defaultdict(list)
    for pl in placements:
        holders[(pl.pp, None, pl.tp)].append(pl.rank)
        holders[(pl.pp, pl.ep, pl.etp)].append(pl.rank)

    sent = [0] * world
    transfers: list[Transfer] = []
    for spec in specs:
        # Candidate sources per owned slice of this parameter: each slice with the ranks holding it.
        n = spec.train_split(train)
        if spec.tensor_parallel:
            owners = [(spec.train_layout(i, n), holders[(spec.pp_stage, spec.ep_owner, i)]) for i in range(n)]
        else:
            stage_ranks = sorted(r for i in range(n) for r in holders[(spec.pp_stage, spec.ep_owner, i)])
            owners = [(((0, spec.length),), stage_ranks)]
        need_by_j = [spec.gen_layout(j, gen.tp) for j in range(gen.tp)]
        hold_by_i = [spec.train_layout(i, n) for i in range(n)]
        # Ranks holding the same slice (None: none) with the same gen_tp miss the same pieces: work them out once.
        pieces_by_kind: dict[tuple[int | None, int], list] = {}
        per_pair: dict[tuple[int, int], list] = defaultdict(list)
        for dst in range(world):
            pl = placements[dst]
            held = train_slice(pl, spec)
            kind = (held, pl.gen_tp)
            if kind not in pieces_by_kind:
                missing = subtract(need_by_j[pl.gen_tp], hold_by_i[held] if held is not None else ())
                found = []
                for owned, candidates in owners if missing else ():
                    pieces = intersect(missing, owned)
                    if pieces:
                        found.append((pieces, total_length(pieces) * spec.row_bytes, candidates))
                pieces_by_kind[kind] = found
            for pieces, nbytes, candidates in pieces_by_kind[kind]:
                # Least-loaded holder; ties rotate with dst so equal loads spread over the replicas.
                src = min((r for r in candidates if r != dst), key=lambda r: (sent[r], (r - dst) % world))
                sent[src] += nbytes
                per_pair[(src, dst)].extend(pieces)
        for (src, dst), pieces in sorted(per_pair.items(), key=lambda kv: (kv[0][1], kv[0][0])):
            ivs = merge_adjacent(tuple(pieces))
            transfers.append(Transfer(spec.name, src, dst, ivs, total_length(ivs) * spec.row_bytes))
    return ReshardPlan(train, gen, tuple(specs), placements, groups, tuple(transfers))


# ---- closed forms (bytes received per rank), M = model bytes --------------------------------------------------


def optimal_recv_bytes(M: float, t: int, p: int, t_g: int) -> float:
    """Minimum per rank with nested shards and equal pipeline stages: M/t_g - M/(p*max(t, t_g))."""
    return M / t_g - M / (p * max(t, t_g))


def paper_recv_bytes(M: float, t: int, p: int, t_g: int, p_g: int = 1) -> float:
    """HybridFlow Table 2: (t*p - t_g*p_g) / (t_g*p_g*t*p) * M (stated for t_g*p_g <= t*p)."""
    return (t * p - t_g * p_g) / (t_g * p_g * t * p) * M


def naive_allgather_recv_bytes(M: float, t: int, p: int) -> float:
    """Every rank gathers the full model from its TP/PP shards (HybridFlow-V): (t*p - 1)/(t*p) * M."""
    return (t * p - 1) / (t * p) * M


def deepspeed_chat_recv_bytes(M: float, t: int, p: int, d: int) -> float:
    """ZeRO-style all-gather over all t*p*d ranks (DeepSpeed-Chat): (t*p*d - 1)/(t*p*d) * M."""
    n = t * p * d
    return (n - 1) / n * M
