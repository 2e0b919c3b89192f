"""`@register`: tag a worker method with how the driver dispatches to it and collects from it.

The decorator only attaches metadata. `WorkerGroup` reads the tag when it binds
the method, so the driver calls `group.method(batch)` once and the dispatch
functions in `dispatch.py` decide what each rank receives.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from enum import StrEnum

ATTR = "__hybridflow_register__"


class Dispatch(StrEnum):
    ONE_TO_ALL = "one_to_all"  # same args to every rank, collect a list
    ALL_TO_ALL = "all_to_all"  # args are per-rank lists, collect a list
    RANK_ZERO = "rank_zero"  # run on rank 0 only, return its result
    DP_COMPUTE_PROTO = "dp_compute_proto"  # split DataProto over dp ranks, collect from is_collect ranks
    DP_PER_REPLICA = "dp_per_replica"  # positional args: one item per dp rank (routed by the driver); collect a
    #                                   list, one output per dp rank from its is_collect rank


class Execute(StrEnum):
    ALL = "all"
    RANK_ZERO = "rank_zero"


@dataclass(frozen=True)
class MethodSpec:
    dispatch: str  # a Dispatch value or the name of a user-registered mode
    execute: Execute
    mesh: str | None  # which mesh's dp coordinates a DP mode splits over
    blocking: bool


def register(dispatch: Dispatch | str = Dispatch.ALL_TO_ALL, execute: Execute = Execute.ALL,
             mesh: str | None = None, blocking: bool = True):
    """Mark a worker method as callable from the driver through a worker group.

    `mesh` names the coordinates (set by the worker with `set_mesh_coords`) that a
    data-parallel mode splits over; it defaults to "default".
    """
    mode = dispatch.value if isinstance(dispatch, Dispatch) else str(dispatch)
    if mode == Dispatch.RANK_ZERO.value:
        execute = Execute.RANK_ZERO
    spec = MethodSpec(dispatch=mode, execute=Execute(execute), mesh=mesh or "default", blocking=blocking)

    def wrap(fn):
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            return fn(*args, **kwargs)

        setattr(inner, ATTR, spec)
        return inner

    return wrap


def registered_methods(cls) -> dict[str, MethodSpec]:
    """All `@register`-tagged methods of a class (including inherited ones)."""
    out = {}
    for name in dir(cls):
        if name.startswith("__"):
            continue
        spec = getattr(getattr(cls, name, None), ATTR, None)
        if spec is not None:
            out[name] = spec
    return out
