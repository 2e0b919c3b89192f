"""The rollout role of ActorRolloutRefWorker: vLLM in the same process as the Megatron actor.

The 3D-HybridEngine (hybridflow.resharding.HybridEngine) plans the transition
from the training layout (t, p, d) to the generation layout (t_g, p_g=1) once;
vLLM is created inside the plan's group order so its TP groups are the planned
ones. Before every generation the live Megatron shards are resharded bucket by
bucket into vLLM (each rank receives only what it lacks); the training shards
are never modified. After generation the rollout is released (vLLM sleep on
GPU; on CPU a logged no-op).
"""

from __future__ import annotations

import logging
import time

import torch

from hybridflow.controller import Dispatch, register
from hybridflow.protocol import DataProto
from megatron_workers.serving import ROLLOUT_MESH, ServingRole

logger = logging.getLogger(__name__)


class RolloutRole(ServingRole):
    """Mixin: needs `self.config` (ActorRolloutRefConfig), `self.dims`, `self.actor` (MegatronEngine)."""

    rollout = None
    hybrid = None

    def attach_rollout(self) -> None:
        from hybridflow.parallel.dims import GenerationDims

        cfg = self.config.rollout
        path = self.config.model.path
        if cfg.name == "vllm":
            from hybridflow.resharding.hybrid_engine import HybridEngine
            from hybridflow.rollout.vllm_rollout import VLLMRollout
            from megatron_workers.hf_io import read_hf_config

            self.hybrid = HybridEngine(self.dims, GenerationDims(cfg.tensor_model_parallel_size), self.actor.model,
                                       read_hf_config(path), bucket_bytes=cfg.reshard_bucket_bytes)
            self.rollout = VLLMRollout(path, cfg, dtype=self.config.model.dtype, group_order=self.hybrid.group_order)
            self.hybrid.verify_groups()
            replica, replicas, tp_rank = self.rollout.replica_rank, self.rollout.num_replicas, self.rollout.tp_rank
        elif cfg.name == "hf":
            if cfg.tensor_model_parallel_size != 1:
                raise ValueError("actor_rollout_ref.rollout.name=hf runs one full model per rank: "
                                 f"tensor_model_parallel_size must be 1, got {cfg.tensor_model_parallel_size}")
            from hybridflow.precision import resolve_local
            from hybridflow.rollout.hf_rollout import HFRollout

            dtype = resolve_local(self.config.model.dtype, "actor_rollout_ref.model.dtype")
            router = self.config.actor.megatron.override_transformer_config.moe_router_dtype
            self.rollout = HFRollout(path, cfg, dtype=dtype,
                                     router_dtype={"fp32": torch.float32, "fp64": torch.float64}[router])
            replica, replicas, tp_rank = self.rank, self.world_size, 0
        else:
            from hybridflow.rollout.base import ENGINES

            raise ValueError(f"actor_rollout_ref.rollout.name={cfg.name!r}; choose one of {', '.join(ENGINES)}")
        self.set_mesh_coords(ROLLOUT_MESH, dp_rank=replica, dp_size=replicas, tp_rank=tp_rank,
                             is_collect=tp_rank == 0)

    def _sync_weights(self) -> dict:
        if self.hybrid is not None:
            stats = self.hybrid.sync_to(self.rollout)
            return {"timing_s/reshard": stats["seconds"],
                    "reshard/bytes_recv_per_rank": float(stats["bytes_recv"]),
                    "reshard/expected_bytes_per_rank": float(stats["expected_recv_bytes"]),
                    "reshard/peak_extra_bytes": float(stats["peak_extra_bytes"])}
        # HF rollout: a full copy of the weights per rank (the reference path, not the fast one).
        from megatron_workers.hf_io import gather_hf_state, read_hf_config

        if self.dims.pp > 1:
            raise ValueError("actor_rollout_ref.rollout.name=hf needs pipeline_model_parallel_size=1; use vllm")
        t = time.perf_counter()
        self.rollout.load_weights(gather_hf_state(self.actor.model, read_hf_config(self.config.model.path)))
        return {"timing_s/reshard": time.perf_counter() - t}

    @register(dispatch=Dispatch.DP_COMPUTE_PROTO, mesh=ROLLOUT_MESH)
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Reshard the current actor weights into the rollout engine, then generate this replica's slice."""
        if self.rollout is None:
            raise RuntimeError(f"generate_sequences needs the rollout role; this worker's role is {self.role!r}")
        self.rollout.resume()
        with torch.profiler.record_function("reshard"):
            metrics = self._sync_weights()
        t = time.perf_counter()
        with torch.profiler.record_function("generate"):
            out = self.rollout.generate_sequences(prompts)
        metrics["rollout/gen_s_per_replica"] = time.perf_counter() - t
        self.rollout.release()
        out.meta_info["metrics"] = metrics
        return out

    # ---- server mode: begin_serving here (it reshards); serve_tick, interrupt_serving, end_serving in ServingRole

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def begin_serving(self, weight_version: int) -> dict:
        """Reshards the current actor weights into the engine once; `serve_tick` calls follow until
        `end_serving`. The weights then carry `weight_version` (the trainer's global step that made them)."""
        if not hasattr(self.rollout, "serve_tick"):
            raise RuntimeError(f"rollout.mode=async needs the vllm engine; {type(self.rollout).__name__} has no "
                               "add-request/step loop")
        self.rollout.resume()
        metrics = self._sync_weights()
        self.weight_version = int(weight_version)
        self._start_serving_clock()
        return metrics
