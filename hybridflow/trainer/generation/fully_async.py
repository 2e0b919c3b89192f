"""async_training.mode=fully_async: the rollout pool produces continuously; the trainer takes batch k at step k.

The producer thread (hybridflow/trainer/async_producer.py) starts at the first step this source serves, with the
rollout's weight version then, and keeps the rollout server running; weight syncs go through it, between two ticks
of the server, interrupting what is in flight (continued or sampled again, async_training.partial_rollout).
"""

from __future__ import annotations

from hybridflow.trainer.async_producer import AsyncProducer
from hybridflow.trainer.generation.batch import AgentGeneration
from hybridflow.trainer.generation.source import Generated
from hybridflow.trainer.generation.synchronous import SplitSync, sync_if_due
from hybridflow.trainer.generation.weights import PoolWeights


class FullyAsync(SplitSync):
    """SplitSync (the same first transfer and validation) whose batches a producer thread generates ahead, and whose
    weight syncs go through that producer."""

    def __init__(self, how: AgentGeneration, sampler, draw, weights: PoolWeights, last_step: int, *,
                 staleness: float, partial_rollout: bool, batch_groups: int):
        super().__init__(how, sampler, draw, weights)
        self.last_step = last_step
        self.options = {"staleness": staleness, "partial_rollout": partial_rollout, "batch_groups": batch_groups}
        self.producer: AsyncProducer | None = None
        self._busy_s = 0.0  # the rollout server's busy time at the last step taken

    def next(self, step: int) -> Generated:
        if self.producer is None:
            self.producer = AsyncProducer(self.draw, self.sampler, self.how.agent, first_step=step,
                                          last_step=self.last_step, version=self.weights.version, **self.options)
            self.producer.start()
        batch, metrics = self.producer.take(step)
        busy = self.how.agent.busy_s()  # its ticks ran while the trainer trained
        metrics["rollout/gen_s_per_replica"] = busy - self._busy_s
        self._busy_s = busy
        metrics.update(self.how.agent.server_metrics())
        return Generated(batch, metrics)

    def after_update(self, step: int, timings: dict) -> dict[str, float]:
        return sync_if_due(self.weights, step, timings, transfer=self._transfer_between_ticks)

    def _transfer_between_ticks(self, version: int) -> dict[str, float]:
        record = self.producer.update_weights(lambda: self.weights.transfer(version), version)
        metrics = record["transfer"]
        metrics["weight_sync/interrupt_s"] = record["interrupt_s"]
        metrics["weight_sync/interrupted_requests"] = record["interrupted"]
        return metrics

    def state(self, step: int) -> dict:
        """The sampler before step + 1's prompts: the batches generated ahead are generated again on a resume."""
        if self.producer is None:
            return {"sampler": self.sampler.state_dict()}
        return {"sampler": self.producer.sampler_state_before(step + 1)}

    def close(self) -> None:
        if self.producer is not None:
            self.producer.close()
            self.producer = None
