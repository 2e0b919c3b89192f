"""How one batch of prompts becomes a rollout batch: the axis of generation that every mode shares.

- `BatchGeneration`: one `generate_sequences` call on a worker group (actor_rollout_ref.rollout.mode=sync), the batch
  split over the group's DP ranks.
- `AgentGeneration`: agent loops over the rollout server (rollout.mode=async; hybridflow/trainer/agent_rollout.py),
  request by request.

Both return the verl-shaped rollout batch (hybridflow/rollout/base.py) and gen's metrics.
"""

from __future__ import annotations

from hybridflow.protocol import DataProto
from hybridflow.trainer.metrics import reduce_worker_metrics


class BatchGeneration:
    def __init__(self, group):
        self.group = group

    def generate(self, prompts: DataProto) -> tuple[DataProto, dict[str, float]]:
        out = self.group.generate_sequences(prompts)
        return out, reduce_worker_metrics(out.meta_info.pop("metrics", {}))

    def generate_validation(self, batch: DataProto) -> DataProto:
        """Padded to a multiple of the group's size (DP dispatch splits it evenly; any val set size works); the pad
        rows, n samples each, are dropped from the output."""
        padded, pad = batch.pad_to_divisor(self.group.world_size)
        out = self.group.generate_sequences(padded)
        out.meta_info.pop("metrics", None)  # the reshard/gen timings describe training rollouts
        return out.unpad(pad * batch.meta_info["n"])


class AgentGeneration:
    def __init__(self, agent_rollout):
        self.agent = agent_rollout
        self.group = agent_rollout.group

    def generate(self, prompts: DataProto) -> tuple[DataProto, dict[str, float]]:
        return self.agent.generate(prompts)

    def generate_validation(self, batch: DataProto) -> DataProto:
        out, _ = self.agent.generate(batch)  # requests one by one: no padding to the group's size
        return out
