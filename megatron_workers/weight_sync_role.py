"""The actor's side of the cross-pool weight sync (rollout on a pool of its own, async_training.*).

Mixin of ActorRolloutRefWorker: `init_weight_sync` joins the sync group as this training rank (the actor group's
rank 0 serves its store) and makes the TrainerSender; `send_weights` sends every rollout rank its shard of the
live weights (hybridflow/resharding/cross_pool.py). Both are collective with the RolloutWorker group's
`init_weight_sync` / `receive_weights`: the driver calls the two groups together.
"""

from __future__ import annotations

import time

from hybridflow.controller import Dispatch, register


class WeightSenderRole:
    """Needs `self.actor` (MegatronEngine), `self.dims`, `self.config`, `self.rank`, `self.world_size`."""

    sender = None

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def init_weight_sync(self, host: str, port: int, num_rollout: int, timeout_s: float = 300.0) -> dict:
        from hybridflow.resharding.cross_pool import TrainerSender, make_sync_group
        from megatron_workers.hf_io import read_hf_config

        if self.actor is None:
            raise RuntimeError(f"init_weight_sync needs the actor; this worker's role is {self.role!r}")
        group = make_sync_group(host, port, self.rank, self.world_size + num_rollout, timeout_s=timeout_s)
        self.sender = TrainerSender.for_megatron(self.dims, self.actor.model, read_hf_config(self.config.model.path),
                                                 group)
        return {"send_bytes": float(self.sender.plan.send_bytes(self.rank))}

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def send_weights(self) -> dict:
        if self.sender is None:
            raise RuntimeError("send_weights before init_weight_sync")
        t = time.perf_counter()
        with self.actor_offload.resident():
            stats = self.sender.send()
        return {"weight_sync/send_s": time.perf_counter() - t,
                "weight_sync/bytes_sent_per_rank": float(stats.bytes)}
