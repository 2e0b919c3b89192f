"""The base class of every SPMD worker, and the Ray actor host that runs one or more of them.

A `WorkerHost` is the Ray actor: it sets the torch.distributed environment for
its rank *before* any role is constructed, then instantiates each role. A plain
worker group has one role per host; a fused group has several (actor, ref,
rollout...) sharing the process, its devices and its process group.
"""

from __future__ import annotations

import os
import traceback

from hybridflow import ports
from hybridflow.controller.dispatch import MeshCoords


def detect_device() -> str:
    from hybridflow.precision import local_device  # one source: the device the dtype is resolved for

    return local_device()


def dist_backend(device: str) -> str:
    return "nccl" if device == "cuda" else "gloo"


class Worker:
    """Base of worker roles. Reads its rank from the environment the worker group set."""

    def __init__(self):
        self.rank = int(os.environ.get("RANK", 0))
        self.world_size = int(os.environ.get("WORLD_SIZE", 1))
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        self.device = detect_device()
        self.backend = dist_backend(self.device)
        self._mesh_coords: dict[str, MeshCoords] = {}

    def set_mesh_coords(self, mesh: str = "default", *, dp_rank: int, dp_size: int, tp_rank: int = 0,
                        pp_rank: int = 0, cp_rank: int = 0, is_collect: bool | None = None) -> None:
        if is_collect is None:
            is_collect = tp_rank == 0 and cp_rank == 0  # callers with pp > 1 must say which stage collects
        self._mesh_coords[mesh] = MeshCoords(dp_rank, dp_size, tp_rank, pp_rank, cp_rank, bool(is_collect))

    def get_mesh_coords(self, mesh: str = "default") -> MeshCoords:
        if mesh not in self._mesh_coords:
            # Without a mesh, every rank is its own data-parallel replica.
            return MeshCoords(dp_rank=self.rank, dp_size=self.world_size, is_collect=True)
        return self._mesh_coords[mesh]

    def init_process_group(self, timeout_s: float = 300.0) -> None:
        """Default torch.distributed group over the whole worker group (gloo on CPU, nccl on GPU)."""
        import datetime

        import torch.distributed as dist

        if dist.is_initialized():
            return
        if self.device == "cuda":
            import torch

            torch.cuda.set_device(self.local_rank if torch.cuda.device_count() > 1 else 0)
        dist.init_process_group(backend=self.backend, rank=self.rank, world_size=self.world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))


def node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address()


def free_port() -> int:
    """A free port on every interface of this node (other nodes reach the rendezvous): hybridflow/ports.py."""
    return ports.free_port("")


class WorkerHost:
    """The Ray actor process. `roles` maps role name -> (class, args, kwargs)."""

    def __init__(self, env: dict[str, str], roles: dict[str, tuple]):
        os.environ.update({k: str(v) for k, v in env.items()})
        from hybridflow.controller.worker_logs import LOG_DIR_ENV, redirect_worker_output

        if os.environ.get(LOG_DIR_ENV):  # before any role imports megatron/vLLM and their warnings
            role = os.environ.get("HYBRIDFLOW_ROLE", "worker")
            self._log_path = redirect_worker_output(os.environ[LOG_DIR_ENV], role, int(os.environ.get("RANK", 0)))
        self._profiler = None
        self._roles = {}
        for name, (cls, args, kwargs) in roles.items():
            self._roles[name] = cls(*args, **kwargs)

    def call(self, role: str, method: str, args: tuple, kwargs: dict):
        """Run one method; exceptions come back as (traceback text), never as a pickled object."""
        from hybridflow.controller import fault_inject
        from hybridflow.controller.futures import resolve_futures

        try:
            args, kwargs = resolve_futures(args, kwargs)
            if fault_inject.ENV in os.environ:  # tests: die (or go NaN) at an exact stage, rank and step
                where = (method, fault_inject.step_of(args, kwargs), int(os.environ.get("RANK", 0)), role)
                fault_inject.maybe_kill(*where)
                fault_inject.set_nan(fault_inject.wants_nan(*where))
            return ("ok", getattr(self._roles[role], method)(*args, **kwargs))
        except BaseException:  # noqa: BLE001 - any failure must reach the driver with its traceback
            return ("error", traceback.format_exc())

    def mesh_coords(self, role: str, mesh: str) -> tuple[MeshCoords, bool]:
        """The role's coordinates in `mesh`, and whether the role set them itself (cacheable)."""
        worker = self._roles[role]
        return worker.get_mesh_coords(mesh), mesh in getattr(worker, "_mesh_coords", {})

    def set_env(self, env: dict[str, str]) -> None:
        os.environ.update({k: str(v) for k, v in env.items()})

    def peak_memory(self) -> dict:
        """This process's peak memory so far: resident set (Linux ru_maxrss) and, when CUDA was used, the peak
        bytes torch allocated on the device (what the caching allocator handed out, not what it reserved)."""
        import resource
        import sys

        out = {"rss_peak_bytes": float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)}
        torch = sys.modules.get("torch")  # never import torch (or touch CUDA) just to ask
        if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
            out["device_peak_bytes"] = float(torch.cuda.max_memory_allocated())
        return out

    def profile_start(self) -> None:
        """Record the named ranges (forward/backward/optimizer/reshard...) until profile_stop: a timeline step."""
        from hybridflow.controller.profile import RangeProfiler

        self._profiler = self._profiler or RangeProfiler()
        self._profiler.start()

    def profile_stop(self) -> list[dict]:
        """The ranges since profile_start, as torch.profiler's trace events with absolute timestamps."""
        if self._profiler is None:
            raise RuntimeError("profile_stop without profile_start")
        return self._profiler.stop()

    def ping(self) -> dict:
        import ray

        return {"ip": node_ip(), "pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id()}


def probe_master() -> tuple[str, int]:
    """Runs on rank 0's bundle: the address and a free port for torch.distributed's rendezvous."""
    return node_ip(), free_port()
