"""Worker classes used by the controller tests (importable by Ray worker processes)."""

from __future__ import annotations

import os
import time

import torch

from hybridflow.controller import Dispatch, Worker, register
from hybridflow.protocol import DataProto


class EchoWorker(Worker):
    """Reports what each rank received, so tests can check dispatch exactly."""

    def __init__(self, tp: int = 1):
        super().__init__()
        self.tp = tp
        if tp > 1:  # a fake (dp, tp) mesh: tp fastest, like Megatron
            self.set_mesh_coords("model", dp_rank=self.rank // tp, dp_size=self.world_size // tp,
                                 tp_rank=self.rank % tp, is_collect=self.rank % tp == 0)

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def whoami(self, tag):
        return {"rank": self.rank, "world": self.world_size, "tag": tag, "pid": os.getpid(),
                "master": (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))}

    @register(dispatch=Dispatch.ALL_TO_ALL)
    def times_rank(self, x):
        return x * (self.rank + 1)

    @register(dispatch=Dispatch.RANK_ZERO)
    def only_zero(self):
        return self.rank

    @register(dispatch=Dispatch.DP_COMPUTE_PROTO, mesh="model")
    def double(self, data: DataProto) -> DataProto:
        out = DataProto.from_dict({"y": data.batch["x"] * 2},
                                  {"seen_by": [f"r{self.rank}"] * len(data)})
        # Non-collect ranks return something wrong on purpose: the collect must ignore it.
        if not self.get_mesh_coords("model").is_collect:
            out.batch["y"] = out.batch["y"] * 0 - 1
        return out

    @register(dispatch=Dispatch.DP_COMPUTE_PROTO)
    def identity(self, data: DataProto) -> DataProto:
        return data

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def init_dist(self, timeout_s: float = 60.0):
        self.init_process_group(timeout_s)
        return True

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def all_reduce(self, value: float):
        import torch.distributed as dist

        t = torch.tensor([value * (self.rank + 1)], dtype=torch.float64)
        dist.all_reduce(t)
        return float(t.item())

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def fail_on(self, rank: int):
        if self.rank == rank:
            raise ValueError(f"boom from rank {rank}")
        return "fine"

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def sleep(self, seconds: float):
        time.sleep(seconds)
        return seconds


class RefLikeWorker(Worker):
    """A second role for the fused-worker test: shares the process with EchoWorker."""

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def pid_and_group(self):
        import torch.distributed as dist

        return os.getpid(), dist.is_initialized() and dist.get_world_size()

    @register(dispatch=Dispatch.DP_COMPUTE_PROTO)
    def add_one(self, data: DataProto) -> DataProto:
        return DataProto.from_dict({"z": data.batch["y"] + 1})
