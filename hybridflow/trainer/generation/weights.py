"""The actor's weights to a rollout pool of its own (trainer.role_pools.rollout), shard to shard."""

from __future__ import annotations

import logging

from hybridflow.trainer.metrics import reduce_worker_metrics

log = logging.getLogger(__name__)


class PoolWeights:
    """`version`: the step the rollout pool's weights serve (the weights after step version - 1's update; 0 until
    the first transfer). `every`: async_training.trigger_parameter_sync_step."""

    def __init__(self, actor, rollout, every: int):
        self.actor, self.rollout, self.every = actor, rollout, every
        self.version = 0

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def transfer(self, version: int) -> dict[str, float]:
        """Both groups at once: the actor's ranks send, the rollout's receive; the rollout then serves `version`."""
        sending = self.actor.send_weights.remote()
        receiving = self.rollout.receive_weights.remote(version)
        sent, received = sending.get(), receiving.get()
        metrics = reduce_worker_metrics(received)
        metrics.update(reduce_worker_metrics(sent))
        return metrics

    def first_transfer(self, version: int) -> None:
        """The rollout pool starts from the model path: the actor's (perhaps resumed) weights before any step."""
        m = self.transfer(version)
        self.version = version
        log.info("weights to the rollout pool: %.3f s, %.0f bytes per rollout rank (planned %.0f)",
                 m["weight_sync/recv_s"], m["weight_sync/bytes_recv_per_rank"],
                 m["weight_sync/expected_bytes_per_rank"])
