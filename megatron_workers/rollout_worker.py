"""RolloutWorker: vLLM on a pool of its own (trainer.role_pools.rollout), for asynchronous RL.

No Megatron model here: the weights come from the training pool over the cross-pool sync group
(hybridflow/resharding/cross_pool.py), each rank receiving exactly its vLLM tensor-parallel shard. The rollout
pool's own torch.distributed world is vLLM's (its TP groups, consecutive ranks); the sync group is a separate
backend object spanning both pools, so neither world is disturbed.

Methods mirror the colocated rollout's (megatron_workers/rollout_role.py) so the driver calls either the same
way: `generate_sequences` (DP over the rollout mesh) or server mode (`begin_serving`, then ServingRole's
`serve_tick` / `interrupt_serving` / `end_serving`), plus `init_weight_sync` / `receive_weights`, which the actor
group's `init_weight_sync` / `send_weights` meet on the other side. In server mode the weights change between ticks
(`receive_weights` while serving: fully_async), never during one.
"""

from __future__ import annotations

import logging
import time

import torch

from hybridflow.config.schema import ActorRolloutRefConfig
from hybridflow.controller import Dispatch, Worker, register
from hybridflow.protocol import DataProto
from megatron_workers.engine import as_config
from megatron_workers.serving import ROLLOUT_MESH, ServingRole

logger = logging.getLogger(__name__)


class RolloutWorker(ServingRole, Worker):
    def __init__(self, config):
        super().__init__()
        self.config: ActorRolloutRefConfig = as_config(config, ActorRolloutRefConfig)
        self.role = "rollout"
        self.rollout = None
        self.receiver = None
        self.weight_version = 0

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        from hybridflow.rollout.vllm_rollout import VLLMRollout

        cfg = self.config.rollout
        if cfg.name != "vllm":
            raise ValueError(f"trainer.role_pools.rollout runs vLLM; actor_rollout_ref.rollout.name={cfg.name!r}")
        self.init_process_group()
        self.rollout = VLLMRollout(self.config.model.path, cfg, dtype=self.config.model.dtype)
        self.set_mesh_coords(ROLLOUT_MESH, dp_rank=self.rollout.replica_rank, dp_size=self.rollout.num_replicas,
                             tp_rank=self.rollout.tp_rank, is_collect=self.rollout.tp_rank == 0)

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def init_weight_sync(self, host: str, port: int, num_train: int, timeout_s: float = 300.0) -> dict:
        """Join the sync group as rank num_train + this rank (collective with the actor group's init_weight_sync)."""
        from hybridflow.resharding.cross_pool import RolloutReceiver, make_sync_group
        from hybridflow.resharding.cross_pool_plan import RolloutLayout

        world = num_train + self.world_size
        group = make_sync_group(host, port, num_train + self.rank, world, timeout_s=timeout_s)
        layout = RolloutLayout(ranks=self.world_size, tp=self.config.rollout.tensor_model_parallel_size)
        self.receiver = RolloutReceiver.connect(group, layout, self.rank,
                                                bucket_bytes=self.config.rollout.reshard_bucket_bytes)
        from megatron_workers.hf_io import read_hf_config

        self.hf_config = read_hf_config(self.config.model.path)  # read once, not at every sync
        return {"expected_bytes": float(self.receiver.plan.expected_recv_bytes(self.rank))}

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def receive_weights(self, weight_version: int) -> dict:
        """The training pool's current weights into this rank's engine (collective with `send_weights`)."""
        if self.receiver is None:
            raise RuntimeError("receive_weights before init_weight_sync")
        t = time.perf_counter()
        stats = self.receiver.receive_into(self.rollout, self.hf_config)
        self.weight_version = int(weight_version)
        return {"weight_sync/recv_s": time.perf_counter() - t,
                "weight_sync/bytes_recv_per_rank": float(stats.bytes),
                "weight_sync/expected_bytes_per_rank": float(self.receiver.plan.expected_recv_bytes(self.rank))}

    @register(dispatch=Dispatch.DP_COMPUTE_PROTO, mesh=ROLLOUT_MESH)
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """This replica's slice, with the weights last received; the output carries their version."""
        t = time.perf_counter()
        with torch.profiler.record_function("generate"):
            out = self.rollout.generate_sequences(prompts)
        out.meta_info["metrics"] = {"rollout/gen_s_per_replica": time.perf_counter() - t,
                                    "rollout/weight_version": float(self.weight_version)}
        return out

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def begin_serving(self, weight_version: int | None = None) -> dict:
        """Server mode on the rollout pool: the engine keeps the weights last received, and their version (not the
        driver's `weight_version`, which names the step it serves: validation at step 0 runs on version 1) tags
        every output."""
        self.rollout.resume()
        self._start_serving_clock()
        return {"rollout/weight_version": float(self.weight_version)}
