"""Pure dispatch/collect functions: how one driver call becomes per-rank calls and back.

No Ray here, so every mode is unit-testable with plain lists. A mode is a pair
(dispatch_fn, collect_fn):

    dispatch_fn(ctx, args, kwargs) -> list[(args, kwargs) | None]   # None: rank not called
    collect_fn(ctx, outputs) -> result                              # outputs per rank, None where not called

Users can add their own modes with `register_dispatch_mode`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from hybridflow.controller.decorator import Dispatch


@dataclass(frozen=True)
class MeshCoords:
    """Where one rank sits in a worker's mesh, as the worker itself reports it."""

    dp_rank: int = 0
    dp_size: int = 1
    tp_rank: int = 0
    pp_rank: int = 0
    cp_rank: int = 0
    is_collect: bool = True  # owns the output of its dp replica (tp=0, last pp stage, cp=0)


@dataclass
class DispatchContext:
    world_size: int
    mesh: list[MeshCoords] = field(default_factory=list)  # one per rank, for DP modes


class DispatchError(ValueError):
    pass


def _one_to_all(ctx, args, kwargs):
    return [(args, kwargs)] * ctx.world_size


def _all_to_all(ctx, args, kwargs):
    n = ctx.world_size
    for i, a in enumerate(args):
        if not isinstance(a, list | tuple) or len(a) != n:
            raise DispatchError(f"ALL_TO_ALL needs each argument to be a list of {n} (one per rank); arg {i} is not")
    for k, v in kwargs.items():
        if not isinstance(v, list | tuple) or len(v) != n:
            raise DispatchError(f"ALL_TO_ALL needs each argument to be a list of {n}; keyword '{k}' is not")
    return [(tuple(a[r] for a in args), {k: v[r] for k, v in kwargs.items()}) for r in range(n)]


def _rank_zero(ctx, args, kwargs):
    return [(args, kwargs)] + [None] * (ctx.world_size - 1)


def _collect_list(ctx, outputs):
    return list(outputs)


def _collect_rank_zero(ctx, outputs):
    return outputs[0]


def dp_size_of(ctx: DispatchContext) -> int:
    if len(ctx.mesh) != ctx.world_size:
        raise DispatchError(f"DP dispatch needs mesh coordinates from all {ctx.world_size} ranks, got {len(ctx.mesh)}")
    sizes = {c.dp_size for c in ctx.mesh}
    if len(sizes) != 1:
        raise DispatchError(f"ranks disagree on dp_size: {sorted(sizes)}")
    dp = sizes.pop()
    owners = sorted(c.dp_rank for c in ctx.mesh if c.is_collect)
    if owners != list(range(dp)):
        raise DispatchError(f"each of the {dp} dp ranks needs exactly one collect rank; collect ranks cover {owners}")
    return dp


def split_for_dp(value, dp: int):
    """Split one argument into dp shards: DataProto-like objects (with .chunk) split, others are shared."""
    if hasattr(value, "chunk_for_dispatch"):  # a future from another group: split lazily on the workers
        return value.chunk_for_dispatch(dp)
    if hasattr(value, "chunk") and hasattr(value, "batch"):
        return value.chunk(dp)
    return [value] * dp


def _dp_compute_proto(ctx, args, kwargs):
    dp = dp_size_of(ctx)
    split_args = [split_for_dp(a, dp) for a in args]
    split_kwargs = {k: split_for_dp(v, dp) for k, v in kwargs.items()}
    calls = []
    for coords in ctx.mesh:
        d = coords.dp_rank
        calls.append((tuple(s[d] for s in split_args), {k: s[d] for k, s in split_kwargs.items()}))
    return calls


def _collect_per_replica(ctx, outputs):
    """One output per dp rank, from its is_collect rank, in dp order."""
    by_dp = [None] * dp_size_of(ctx)
    for coords, out in zip(ctx.mesh, outputs, strict=True):
        if coords.is_collect:
            by_dp[coords.dp_rank] = out
    return by_dp


def _collect_dp_proto(ctx, outputs):
    by_dp = _collect_per_replica(ctx, outputs)
    if any(o is None for o in by_dp):
        return by_dp  # methods returning nothing (e.g. save) give a list of Nones
    first = by_dp[0]
    if hasattr(first, "batch") and hasattr(type(first), "concat"):
        return type(first).concat(by_dp)
    return by_dp


def _dp_per_replica(ctx, args, kwargs):
    """Each positional argument is a list with one item per dp rank, already routed by the caller (the rollout
    server pins a trajectory to one replica); every tp/pp rank of replica d gets item d. Keyword arguments go
    to every rank as they are."""
    dp = dp_size_of(ctx)
    for i, a in enumerate(args):
        if not isinstance(a, list | tuple) or len(a) != dp:
            raise DispatchError(f"DP_PER_REPLICA needs each positional argument to be a list of {dp} (one per dp "
                                f"rank); argument {i} is not")
    return [(tuple(a[c.dp_rank] for a in args), dict(kwargs)) for c in ctx.mesh]



_MODES: dict[str, tuple[Callable, Callable]] = {
    Dispatch.ONE_TO_ALL.value: (_one_to_all, _collect_list),
    Dispatch.ALL_TO_ALL.value: (_all_to_all, _collect_list),
    Dispatch.RANK_ZERO.value: (_rank_zero, _collect_rank_zero),
    Dispatch.DP_COMPUTE_PROTO.value: (_dp_compute_proto, _collect_dp_proto),
    Dispatch.DP_PER_REPLICA.value: (_dp_per_replica, _collect_per_replica),
}


def register_dispatch_mode(name: str, dispatch_fn: Callable, collect_fn: Callable) -> None:
    """Add a user dispatch mode; use its name in `@register(dispatch=name)`."""
    if name in _MODES:
        raise DispatchError(f"dispatch mode '{name}' already exists")
    _MODES[name] = (dispatch_fn, collect_fn)


def get_mode(name: str) -> tuple[Callable, Callable]:
    try:
        return _MODES[name]
    except KeyError:
        raise DispatchError(f"unknown dispatch mode '{name}'; known: {sorted(_MODES)}") from None


def needs_mesh(name: str) -> bool:
    return name == Dispatch.DP_COMPUTE_PROTO.value or name.startswith("dp_")
