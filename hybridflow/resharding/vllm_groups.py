"""Make vLLM's tensor-parallel groups the ones the resharding plan chose.

Why a patch, and why this one
-----------------------------
vLLM 0.32 builds every group from consecutive world ranks (`initialize_model_parallel` in
vllm/distributed/parallel_state.py: `torch.arange(world).reshape(-1, dp, pp, pcp, tp)`), and
Megatron's default order also makes training TP groups consecutive. With t_g < t the consecutive
generation groups are pieces of one training TP group and half the ranks hold none of their
generation shard: 3M/8 received per rank at t=4, t_g=2 instead of the optimal M/4 (FACTS.md).

Two ways out were considered:
1. Permute the training side so consecutive vLLM groups become optimal. That needs a Megatron TP
   group whose TP ranks do not grow with the world rank (t=4, t_g=2, d=1: ranks 0..3 must hold
   quarters 0,2,1,3). Megatron, like vLLM, creates groups with torch.distributed.new_group, which
   sorts the ranks, so the group rank would not be the TP rank. Not possible without patching
   Megatron as well, and it would move a decision about generation into the training layout.
2. Keep Megatron's default order (the paper's choice: generation TP strided, micro-DP
   consecutive) and let vLLM see the world ranks in the planned order. Chosen.

The patch renames ranks, nothing else: while vLLM runs `initialize_model_parallel`, every group
it builds through `init_model_parallel_group` has its "virtual" ranks v mapped to world ranks
`order[v]`, where `order` lists the planned generation TP groups one after another. So TP groups
are the planned ones, and DP/PP/EP groups stay consistent with them (all derived from the same
permuted rank grid). The world group is untouched.

Group rank vs. generation TP rank: vLLM's `GroupCoordinator.rank_in_group = ranks.index(rank)`
uses the list order, while torch.distributed.new_group sorts the list by default and gives the
torch group rank in sorted order; vLLM's collectives (all_gather of vocab-parallel logits, the
shm communicator) use the torch group rank. Both agree only when each group lists its ranks in
ascending order. The plan's groups are ascending whenever t_g <= t or t == 1. For t_g > t with
t > 1 no optimal placement has ascending groups (e.g. t=2, d=2, t_g=4: ranks 0..3 hold slices
0,1,0,1 and must become generation ranks 0,2,1,3), so for those plans the patch also asks torch
not to sort (`new_group(..., sort_ranks=False)`, present in torch 2.13; checked at run time),
again only inside the window.

The patch is version-checked (vLLM 0.32.x, the legacy new_group path, no elastic EP) and
scoped to a context manager that restores both functions on exit; `verify_vllm_groups` checks
afterwards, from inside each rank, that what vLLM built equals the plan.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Iterator
from contextlib import contextmanager

from hybridflow.resharding.planner import ReshardPlan

SUPPORTED_VLLM_MINOR = ("0.32",)


class VllmGroupError(RuntimeError):
    """vLLM's groups cannot be made, or were not made, as planned."""


def vllm_rank_order(plan: ReshardPlan) -> list[int]:
    """World rank of each of vLLM's virtual ranks: the planned generation TP groups, one after another."""
    return [rank for group in plan.gen_tp_groups for rank in group]


def _check_vllm_version() -> None:
    import vllm

    version = getattr(vllm, "__version__", "unknown")
    if not any(version == v or version.startswith(v + ".") for v in SUPPORTED_VLLM_MINOR):
        raise VllmGroupError(
            f"planned_vllm_groups patches vllm.distributed.parallel_state of vLLM {SUPPORTED_VLLM_MINOR}; "
            f"found vLLM {version}. Re-check initialize_model_parallel/GroupCoordinator before widening this."
        )


@contextmanager
def planned_vllm_groups(plan: ReshardPlan) -> Iterator[None]:
    """Create vLLM engines (or call `initialize_model_parallel`) inside this block to get the plan's groups.

    Use with `distributed_executor_backend="external_launcher"`, `tensor_parallel_size=plan.gen.tp`,
    `pipeline_parallel_size=1` and `data_parallel_size=len(plan.gen_tp_groups)` when there is more
    than one replica. Ranks in one generation group must be given the same prompts.
    """
    import torch.distributed as dist
    from vllm import envs
    from vllm.distributed import parallel_state as ps

    _check_vllm_version()
    if envs.VLLM_DISTRIBUTED_USE_SPLIT_GROUP:
        raise VllmGroupError("VLLM_DISTRIBUTED_USE_SPLIT_GROUP=1: split_group always sorts group ranks; unset it")
    keep_order = not plan.groups_ascending
    if keep_order and "sort_ranks" not in inspect.signature(dist.new_group).parameters:
        raise VllmGroupError(
            f"generation groups {plan.gen_tp_groups} are not ascending (t_g={plan.gen.tp} > t={plan.train.tp}) and "
            "this torch has no new_group(sort_ranks=False); use a layout with t_g <= t or t == 1"
        )
    order = vllm_rank_order(plan)
    original_init = ps.initialize_model_parallel
    original_group = ps.init_model_parallel_group
    original_new_group = dist.new_group

    def remapped_group(group_ranks, *args, **kwargs):
        return original_group([[order[r] for r in ranks] for ranks in group_ranks], *args, **kwargs)

    @functools.wraps(original_new_group)
    def unsorted_new_group(ranks=None, *args, **kwargs):
        if ranks is not None:
            kwargs.setdefault("sort_ranks", False)
        return original_new_group(ranks, *args, **kwargs)

    @functools.wraps(original_init)
    def planned_init(
        tensor_model_parallel_size: int = 1,
        pipeline_model_parallel_size: int = 1,
        prefill_context_model_parallel_size: int = 1,
        decode_context_model_parallel_size: int | None = 1,
        backend: str | None = None,
    ) -> None:
        got = (tensor_model_parallel_size, pipeline_model_parallel_size, prefill_context_model_parallel_size,
               decode_context_model_parallel_size or 1, dist.get_world_size())
        want = (plan.gen.tp, 1, 1, 1, plan.world_size)
        if got != want:
            raise VllmGroupError(f"vLLM asked for (tp, pp, pcp, dcp, world) = {got}; the resharding plan is {want}")
        from vllm.config import get_current_vllm_config

        if get_current_vllm_config().parallel_config.enable_elastic_ep:
            raise VllmGroupError("elastic EP builds stateless groups from local ranks; planned groups do not apply")
        ps.init_model_parallel_group = remapped_group
        if keep_order:
            dist.new_group = unsorted_new_group
        try:
            original_init(tensor_model_parallel_size, pipeline_model_parallel_size,
                          prefill_context_model_parallel_size, decode_context_model_parallel_size, backend)
        finally:
            ps.init_model_parallel_group = original_group
            dist.new_group = original_new_group

    ps.initialize_model_parallel = planned_init
    try:
        yield
    finally:
        ps.initialize_model_parallel = original_init


def verify_vllm_groups(plan: ReshardPlan) -> None:
    """On this rank: vLLM's TP group is the planned one, and vLLM's and torch's group ranks are both gen_tp."""
    import torch.distributed as dist
    from vllm.distributed import parallel_state as ps

    rank = dist.get_rank()
    placement = plan.placements[rank]
    want = list(plan.gen_tp_groups[placement.replica])
    tp = ps.get_tp_group()
    got = {
        "ranks": list(tp.ranks),
        "rank_in_group": tp.rank_in_group,
        "torch_group_rank": dist.get_rank(tp.device_group),
        "torch_cpu_group_rank": dist.get_rank(tp.cpu_group),
    }
    expected = {"ranks": want, "rank_in_group": placement.gen_tp, "torch_group_rank": placement.gen_tp,
                "torch_cpu_group_rank": placement.gen_tp}
    if got != expected:
        raise VllmGroupError(f"rank {rank}: vLLM TP group {got} != planned {expected}")
