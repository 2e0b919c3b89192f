"""The cross-pool weight-sync plan (asynchronous RL): which training rank sends which rows of which parameter
to which rollout rank, in which bucket. Pure: no torch.distributed; cross_pool.py carries it out.

The plan (`plan_cross_pool`, pure) - for every rollout rank r and parameter:
  * rollout layout: R ranks in R/t_g replicas of consecutive ranks (vLLM's own order): replica
    q = r // t_g, generation TP rank j = r % t_g. Rank r needs exactly `ParamSpec.gen_layout(j, t_g)`,
    the rows of its vLLM shard (vocab: vLLM's split of the real vocab padded to its multiple, as the
    colocated planner); it receives all of it, nothing is held locally.
  * source replica: replica q reads from training data replica m = q mod (cp*d) (cp and dp replicas
    hold the same weights), so the sending load spreads over the training replicas.
  * source stage: the parameter's own pipeline stage (each stage sends its own layers).
  * source TP rank: a tensor-parallel parameter is split by the training TP slices it overlaps
    (one message per overlap, training TP rank i of replica m and the stage); a replicated one
    (norms, biases of row-parallel layers) comes whole from TP rank (spec index + r) mod t.
  So every rollout rank receives its shard once, bytes = sum of its gen_layout rows = M/t_g for every
  matrix split evenly (all but the vocab matrices when vLLM's padded split is uneven: the tiny
  model's 104-token vocab at t_g = 2 is 64 + 40 rows); the ranks of a replica together receive the
  model M exactly once. No rank ever assembles more than its own shard.
  * buckets: consecutive parameters while the largest per-rollout-rank receive stays within
    bucket_bytes; message tags are the plan's message numbers, identical on both sides.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from hybridflow.parallel.dims import GenerationDims, LayoutError, ModelShape, ParallelDims
from hybridflow.resharding.intervals import Intervals, intersect, total_length
from hybridflow.resharding.planner import ParamSpec, spec_named

DEFAULT_BUCKET_BYTES = 256 << 20


class CrossPoolError(RuntimeError):
    """The pools disagree with the plan, or a message did not complete in time."""


@dataclass(frozen=True)
class RolloutLayout:
    """The rollout pool: `ranks` processes, vLLM TP `tp` (t_g), replicas of consecutive ranks."""

    ranks: int
    tp: int = 1

    @property
    def replicas(self) -> int:
        return self.ranks // self.tp

    def coords(self, rank: int) -> tuple[int, int]:
        """(replica, generation TP rank) of rollout rank `rank`."""
        if not 0 <= rank < self.ranks:
            raise LayoutError(f"rollout rank {rank} outside the rollout pool of {self.ranks} ranks")
        return divmod(rank, self.tp)

    def validate(self, model: ModelShape | None = None) -> RolloutLayout:
        if self.tp < 1 or self.ranks < 1:
            raise LayoutError(f"rollout pool: ranks={self.ranks} and tensor_model_parallel_size={self.tp} must be >= 1")
        if self.ranks % self.tp:
            raise LayoutError(f"rollout tensor_model_parallel_size={self.tp} does not divide the rollout pool's "
                              f"{self.ranks} ranks")
        if model is not None:
            for what, n in (("num_attention_heads", model.num_heads), ("num_key_value_heads", model.num_kv_heads),
                            ("intermediate_size", model.ffn_hidden_size)):
                if n % self.tp:
                    raise LayoutError(f"rollout tp={self.tp} does not divide {what}={n}")
        return self


@dataclass(frozen=True)
class RolloutPlacement:
    """One rollout rank (the fields VllmShardConverter reads from a plan's placements)."""

    rank: int
    replica: int
    gen_tp: int


@dataclass(frozen=True)
class Message:
    """Rows [start, stop) (full index space along partition_dim) of `name`, training rank src -> rollout rank dst."""

    name: str
    src: int  # training rank = its sync-group rank
    dst: int  # rollout rank; its sync-group rank is T + dst
    start: int
    stop: int
    nbytes: int
    tag: int  # the message's number in the plan


@dataclass(frozen=True)
class CrossPoolPlan:
    """Who sends which rows to whom. Quacks like ReshardPlan for VllmShardConverter with rank = rollout rank."""

    train: ParallelDims
    rollout: RolloutLayout
    specs: tuple[ParamSpec, ...]
    messages: tuple[Message, ...]  # by parameter (spec order), then dst, then src, then rows
    buckets: tuple[tuple[int, int], ...]  # [first, stop) spec indices of each bucket
    dtypes: tuple[str, ...] = ()  # torch dtype name per spec ("float32"); () in pure plans
    _cache: dict = field(default_factory=dict, compare=False, repr=False)

    # -- what VllmShardConverter reads --
    @property
    def gen(self) -> GenerationDims:
        return GenerationDims(tp=self.rollout.tp)

    @property
    def placements(self) -> tuple[RolloutPlacement, ...]:
        if "placements" not in self._cache:
            self._cache["placements"] = tuple(RolloutPlacement(r, *self.rollout.coords(r))
                                              for r in range(self.rollout.ranks))
        return self._cache["placements"]

    def spec(self, name: str) -> ParamSpec:
        return spec_named(self._cache, self.specs, name, "the cross-pool plan")

    def needs(self, rollout_rank: int, spec: ParamSpec) -> Intervals:
        """Rows of `spec` in rollout rank `rollout_rank`'s vLLM shard."""
        return spec.gen_layout(self.rollout.coords(rollout_rank)[1], self.rollout.tp)

    # -- sizes --
    @property
    def num_train(self) -> int:
        return self.train.world_size

    @property
    def world_size(self) -> int:
        """Ranks of the sync group: T training + R rollout."""
        return self.train.world_size + self.rollout.ranks

    def sync_rank(self, rollout_rank: int) -> int:
        return self.num_train + rollout_rank

    def holds(self, train_rank: int, spec: ParamSpec) -> Intervals:
        """Rows of `spec` in training rank `train_rank`'s shard; () on another stage."""
        c = self.train.coords(train_rank)
        if c["pp"] != spec.pp_stage:
            return ()
        return spec.train_layout(c["tp"], self.train.tp)

    def source_replica(self, replica: int) -> int:
        """The training data replica (cp and dp flattened, cp fastest) rollout replica `replica` reads from."""
        return replica % (self.train.cp * self.train.dp)

    def expected_recv_bytes(self, rollout_rank: int) -> int:
        """Bytes of rollout rank's generation shards (it holds nothing before): the lower bound and the plan."""
        return sum(total_length(self.needs(rollout_rank, s)) * s.row_bytes for s in self.specs)

    @property
    def model_bytes(self) -> int:
        """M: bytes of the model's real rows (vocab padding excluded); each replica receives exactly this."""
        return sum((s.valid_size if s.valid_size is not None else s.length) * s.row_bytes for s in self.specs)

    def recv_bytes(self, rollout_rank: int) -> int:
        return sum(m.nbytes for m in self.messages if m.dst == rollout_rank)

    def send_bytes(self, train_rank: int) -> int:
        return sum(m.nbytes for m in self.messages if m.src == train_rank)

    def bucket_messages(self, bucket: int) -> tuple[Message, ...]:
        if "by_bucket" not in self._cache:
            names = {}
            for b, (lo, hi) in enumerate(self.buckets):
                for s in self.specs[lo:hi]:
                    names[s.name] = b
            by_bucket: list[list[Message]] = [[] for _ in self.buckets]
            for m in self.messages:
                by_bucket[names[m.name]].append(m)
            self._cache["by_bucket"] = tuple(tuple(x) for x in by_bucket)
        return self._cache["by_bucket"][bucket]

    def dtype_of(self, spec_index: int) -> torch.dtype:
        if not self.dtypes:
            raise CrossPoolError("this plan carries no dtypes (a pure plan); build it through the handshake")
        return getattr(torch, self.dtypes[spec_index])


def _train_rank(train: ParallelDims, tp: int, replica: int, pp: int) -> int:
    return train.rank_of(tp=tp, cp=replica % train.cp, dp=replica // train.cp, pp=pp)


def plan_cross_pool(
    train: ParallelDims,
    rollout: RolloutLayout,
    specs: list[ParamSpec] | tuple[ParamSpec, ...],
    model: ModelShape | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    gen_vocab_pad_multiple: int | None = None,
    dtypes: tuple[str, ...] | list[str] = (),
) -> CrossPoolPlan:
    """The plan (see the module docstring for the rules). gen_vocab_pad_multiple: the rollout engine's vocab padding,
    replacing the specs' own for the vocab matrices (the trainer does not know vLLM's; the rollout side tells it)."""
    train.validate(model=model)
    rollout.validate(model)
    if bucket_bytes < 1:
        raise LayoutError(f"bucket_bytes={bucket_bytes} must be >= 1")
    if dtypes and len(dtypes) != len(specs):
        raise LayoutError(f"{len(dtypes)} dtypes for {len(specs)} parameters")
    names = [s.name for s in specs]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise LayoutError(f"parameter names must be unique across pipeline stages; repeated: {dupes[:5]}")
    if gen_vocab_pad_multiple is not None:
        specs = [replace(s, gen_pad_multiple=gen_vocab_pad_multiple) if s.valid_size is not None else s for s in specs]
    gen = GenerationDims(tp=rollout.tp)
    for s in specs:
        s.validate(train, gen)
    t = train.tp
    messages: list[Message] = []
    for k, spec in enumerate(specs):
        for r in range(rollout.ranks):
            q, j = rollout.coords(r)
            m = q % (train.cp * train.dp)
            need = spec.gen_layout(j, rollout.tp)
            if spec.tensor_parallel:  # the training TP slices it overlaps, in the shard's row order
                pieces = [(i, piece) for iv in need for i in range(t)
                          for piece in intersect((iv,), spec.train_layout(i, t))]
            else:  # replicated: whole, from a TP rank that rotates with the parameter and the receiver
                pieces = [((k + r) % t, iv) for iv in need]
            for i, (a, b) in pieces:
                messages.append(Message(spec.name, _train_rank(train, i, m, spec.pp_stage), r, a, b,
                                        (b - a) * spec.row_bytes, len(messages)))
    # Buckets: consecutive specs while the largest per-rollout-rank receive fits (>= 1 spec each).
    buckets: list[tuple[int, int]] = []
    load = [0] * rollout.ranks
    for k, spec in enumerate(specs):
        cost = [total_length(spec.gen_layout(rollout.coords(r)[1], rollout.tp)) * spec.row_bytes
                for r in range(rollout.ranks)]
        if buckets and max(a + c for a, c in zip(load, cost)) <= bucket_bytes:
            buckets[-1] = (buckets[-1][0], k + 1)
            load = [a + c for a, c in zip(load, cost)]
        else:
            buckets.append((k, k + 1))
            load = cost
    return CrossPoolPlan(train, rollout, tuple(specs), tuple(messages), tuple(buckets), tuple(dtypes))
