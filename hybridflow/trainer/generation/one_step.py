"""async_training.mode=one_step_off_policy: the rollout pool generates step k+1's batch while step k trains.

Step k takes the batch launched during step k-1 (the first step after a start or a resume launches its own and
waits), then launches step k+1's before anything else runs. Batch k+1 is therefore sampled by the weights after step
k-1's update: one step off-policy. The weights go to the pool as in SplitSync; the receive queues behind the
generation in flight, so a sync waits for it.

A checkpoint of step k keeps the sampler as it was before step k+1's prompts were drawn: a resume draws (and
regenerates) them again, never skipped, never trained twice.
"""

from __future__ import annotations

from hybridflow.trainer.generation.batch import BatchGeneration
from hybridflow.trainer.generation.source import Generated
from hybridflow.trainer.generation.synchronous import SplitSync
from hybridflow.trainer.generation.weights import PoolWeights
from hybridflow.trainer.metrics import reduce_worker_metrics


class OneStepPrefetch(SplitSync):
    """SplitSync (the same first transfer, weight sync and validation) whose batch k was launched during step k-1."""

    def __init__(self, how: BatchGeneration, sampler, draw, weights: PoolWeights, last_step: int):
        super().__init__(how, sampler, draw, weights)
        self.last_step = last_step
        self._ahead = None  # (its generation in flight, the sampler's state before its prompts were drawn)

    def _launch(self, step: int) -> None:
        state = self.sampler.state_dict()
        prompts = self.draw(step)
        self._ahead = (self.group.generate_sequences.remote(prompts), state)

    def next(self, step: int) -> Generated:
        if self._ahead is None:  # the first step (or the first after a resume): nothing in flight yet
            self._launch(step)
        pending, _ = self._ahead
        self._ahead = None
        batch = pending.get()
        metrics = reduce_worker_metrics(batch.meta_info.pop("metrics", {}))
        if step < self.last_step:
            self._launch(step + 1)  # overlaps the rest of the step, on the rollout pool
        return Generated(batch, metrics)

    def state(self, step: int) -> dict:
        return {"sampler": self._ahead[1] if self._ahead is not None else self.sampler.state_dict()}
