"""Run under torchrun with 4 processes: vLLM's parallel state, built inside planned_vllm_groups, equals the plan.

For each layout it creates vLLM's groups exactly as an external_launcher engine does
(init_distributed_environment + initialize_model_parallel under a VllmConfig with
data_parallel_size = replicas), checks them with verify_vllm_groups, all-gathers each rank's
generation TP rank through vLLM's own TP group (must come back as 0..t_g-1), and checks the DP group.
A control run without the patch must NOT match the plan for t=4, t_g=2.
Prints one JSON line per check from rank 0; exits non-zero on any mismatch.
"""

import json
import os
import sys

import torch


def main() -> int:
    from vllm.config import ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    from hybridflow.parallel.dims import GenerationDims, ParallelDims
    from hybridflow.resharding.planner import plan_resharding
    from hybridflow.resharding.vllm_groups import VllmGroupError, planned_vllm_groups, verify_vllm_groups
    from hybridflow.rollout.vllm_launch import broadcast_buffers_unlinked, cpu_shm_communicator, job_token

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    ps.init_distributed_environment(world, rank, "env://", int(os.environ["LOCAL_RANK"]), backend="gloo")
    failures = 0

    def build(t_g: int, replicas: int, patched_plan=None):
        cfg = VllmConfig(parallel_config=ParallelConfig(
            tensor_parallel_size=t_g, data_parallel_size=replicas, distributed_executor_backend="external_launcher"))
        # The TP groups' CPU communicators and broadcast buffers are built here as in an engine: shm segments named per
        # job and unlinked once mapped (hybridflow/rollout/vllm_engine.py says why); a rank forked by rank_launch
        # exits without running the buffers' destructors, so a name left to them would outlive the test
        with set_current_vllm_config(cfg), cpu_shm_communicator(job_token()), broadcast_buffers_unlinked():
            if patched_plan is None:
                ps.initialize_model_parallel(t_g, 1, backend="gloo")
            else:
                with planned_vllm_groups(patched_plan):
                    ps.ensure_model_parallel_initialized(t_g, 1, backend="gloo")

    layouts = [(4, 1, 1, 2), (2, 1, 2, 4), (1, 2, 2, 2), (2, 2, 1, 1)]
    for t, p, d, t_g in layouts:
        plan = plan_resharding(ParallelDims(tp=t, pp=p, dp=d), GenerationDims(tp=t_g), [])
        replicas = len(plan.gen_tp_groups)
        build(t_g, replicas, plan)
        me = plan.placements[rank]
        result = {"layout": [t, p, d, t_g], "groups": plan.gen_tp_groups, "ascending": plan.groups_ascending}
        try:
            verify_vllm_groups(plan)
            gathered = ps.get_tp_group().all_gather(torch.tensor([float(me.gen_tp)]), dim=0)
            if gathered.tolist() != [float(j) for j in range(t_g)]:
                raise VllmGroupError(f"rank {rank}: TP all_gather of gen_tp ranks gave {gathered.tolist()}")
            want_dp = [g[me.gen_tp] for g in plan.gen_tp_groups]
            if list(ps.get_dp_group().ranks) != want_dp:
                raise VllmGroupError(f"rank {rank}: vLLM DP group {ps.get_dp_group().ranks} != {want_dp}")
            result["ok"] = True
        except VllmGroupError as e:
            result["ok"], result["error"] = False, str(e)
            failures += 1
        oks = [None] * world
        torch.distributed.all_gather_object(oks, result["ok"])
        result["ok_all_ranks"] = all(oks)
        if rank == 0:
            print(json.dumps(result), flush=True)
        ps.destroy_model_parallel()

    # Control: vLLM's own consecutive groups are not the plan for t=4, t_g=2 (the check can fail).
    plan = plan_resharding(ParallelDims(tp=4), GenerationDims(tp=2), [])
    build(2, 2, None)
    try:
        verify_vllm_groups(plan)
        control_detected = False
    except VllmGroupError:
        control_detected = True
    flags = [None] * world
    torch.distributed.all_gather_object(flags, control_detected)
    if rank == 0:
        print(json.dumps({"control_unpatched_mismatch_detected_on_ranks": flags,
                          "vllm_consecutive_groups": ps.get_tp_group().group_ranks}), flush=True)
    if not any(flags):
        failures += 1
    ps.destroy_model_parallel()
    ps.destroy_distributed_environment()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
