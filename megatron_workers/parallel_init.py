"""Process-group and Megatron model-parallel set-up for one SPMD worker.

The layout numbers come only from `hybridflow.parallel.dims.ParallelDims`.
The backend is detected (nccl with CUDA, gloo without), not chosen by a
separate code path, and every collective set-up has a timeout so that a dead
peer turns into an error instead of a hang.
"""

from __future__ import annotations

import datetime
import os
import random
import warnings

import numpy as np
import torch
import torch.distributed as dist

from hybridflow.parallel.dims import LayoutError, ParallelDims
from megatron_workers.cpu_compat import apply_cpu_compat

_ENV_KEYS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_distributed(timeout_s: float = 120.0, backend: str | None = None) -> tuple[int, int]:
    """Join the default process group from torchrun-style env vars. Returns (rank, world_size).

    Reuses an existing default group (for example one created by vLLM in the same process).
    """
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    missing = [k for k in _ENV_KEYS if k not in os.environ]
    if missing:
        raise RuntimeError(f"init_distributed: environment variables {missing} are not set (expected torchrun-style)")
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if not 0 <= rank < world_size:
        raise RuntimeError(f"init_distributed: RANK={rank} outside WORLD_SIZE={world_size}")
    backend = backend or default_backend()
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(
        backend=backend,
        init_method=f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    return rank, world_size


# torch 2.13 deprecates the collective names megatron-core 0.16 calls on every step (distributed optimizer,
# sequence parallel). The FutureWarning repeats from each rank every step and buries the driver's console;
# nothing for a user to act on, so it is silenced in the worker processes, and only these two names.
_MCORE_DEPRECATED_COLLECTIVES = r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated"


def init_model_parallel(dims: ParallelDims, seed: int = 1234, timeout_s: float = 120.0) -> None:
    """Create Megatron's TP/PP/DP/CP groups for `dims` and seed all RNGs (per-TP-rank streams included)."""
    if not dist.is_initialized():
        raise RuntimeError("init_model_parallel: call init_distributed() first")
    warnings.filterwarnings("ignore", message=_MCORE_DEPRECATED_COLLECTIVES, category=FutureWarning)
    dims.validate(world_size=dist.get_world_size())  # before the slow megatron import
    from megatron.core import parallel_state, tensor_parallel

    apply_cpu_compat()
    if parallel_state.model_parallel_is_initialized():
        have = (
            parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_pipeline_model_parallel_world_size(),
        )
        vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size() or 1
        if vpp != dims.vpp:
            raise LayoutError(f"model parallel already initialized with vpp={vpp}, asked for vpp={dims.vpp}")
        if have != (dims.tp, dims.pp):
            raise LayoutError(
                f"model parallel already initialized with (tp, pp)={have}, asked for {(dims.tp, dims.pp)}"
            )
        experts = (parallel_state.get_expert_model_parallel_world_size(),
                   parallel_state.get_expert_tensor_parallel_world_size())
        if experts != (dims.ep, dims.expert_tp):
            raise LayoutError(f"model parallel already initialized with (ep, etp)={experts}, asked for "
                              f"{(dims.ep, dims.expert_tp)}")
    else:
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=dims.tp,
            pipeline_model_parallel_size=dims.pp,
            context_parallel_size=dims.cp,
            expert_model_parallel_size=dims.ep,
            expert_tensor_parallel_size=dims.expert_tp,
            virtual_pipeline_model_parallel_size=dims.vpp if dims.vpp > 1 else None,
            distributed_timeout_minutes=max(1, int(round(timeout_s / 60))),
            # megatron's optimizer set-up asks for its gloo side-channel groups even when everything is gloo
            create_gloo_process_groups=True,
        )
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def destroy() -> None:
    """Tear down Megatron's groups and the default group (safe to call twice)."""
    try:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
    except ImportError:
        pass
    if dist.is_initialized():
        dist.destroy_process_group()
