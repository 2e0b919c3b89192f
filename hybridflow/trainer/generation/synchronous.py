"""The synchronous modes: a step draws its prompts and waits for their rollout.

`Colocated`: the rollout runs in the actor's processes, which reshard their live weights into the engine inside
every `generate_sequences` (the 3D-HybridEngine), so nothing is sent after an update.
`SplitSync`: the rollout runs on a pool of its own, which gets the actor's weights after every
async_training.trigger_parameter_sync_step-th update (and once before the first step).
"""

from __future__ import annotations

from hybridflow.protocol import DataProto
from hybridflow.trainer.generation.source import Generated
from hybridflow.trainer.generation.weights import PoolWeights
from hybridflow.trainer.stages import stage, timer


class Colocated:
    def __init__(self, how, sampler, draw):
        """`how`: BatchGeneration or AgentGeneration; `draw(step)`: the prompts of `step` (advances `sampler`)."""
        self.how, self.sampler, self.draw = how, sampler, draw
        self.group = how.group

    def prepare(self, step: int) -> None:
        pass

    def next(self, step: int) -> Generated:
        prompts = self.draw(step)
        batch, metrics = self.how.generate(prompts)
        return Generated(batch, metrics, prompts)

    def after_update(self, step: int, timings: dict) -> dict[str, float]:
        return {}

    def state(self, step: int) -> dict:
        return {"sampler": self.sampler.state_dict()}

    def generate_validation(self, batch: DataProto) -> DataProto:
        return self.how.generate_validation(batch)

    def close(self) -> None:
        pass


class SplitSync(Colocated):
    def __init__(self, how, sampler, draw, weights: PoolWeights):
        super().__init__(how, sampler, draw)
        self.weights = weights

    def prepare(self, step: int) -> None:
        with stage("weight_sync"):
            self.weights.first_transfer(step + 1)

    def after_update(self, step: int, timings: dict) -> dict[str, float]:
        return sync_if_due(self.weights, step, timings)


def sync_if_due(weights: PoolWeights, step: int, timings: dict, transfer=None) -> dict[str, float]:
    """The weights after `step`'s update to the rollout pool, on the steps the sync period names: they then serve
    step + 1. `transfer(version)` replaces the plain transfer (fully_async goes through its producer)."""
    if not weights.due(step):
        return {}
    with timer("weight_sync", timings):
        metrics = (transfer or weights.transfer)(step + 1)
    weights.version = step + 1
    return metrics
