"""The gen stage as a type: what every generation mode gives the trainer's loop.

`RayPPOTrainer.step` asks its GenerationSource for the step's rollout batch (`next`), runs the same stages on it
whatever the mode, and hands control back after the updates (`after_update`: the mode's weight-sync policy). The
modes (one class each, picked in hybridflow/trainer/generation/factory.py):

| mode | class | where the rollout runs | weights to the rollout |
|---|---|---|---|
| colocated (batch or agent) | `Colocated` | the actor's processes (3D-HybridEngine) | resharded in each generate |
| split, synchronous | `SplitSync` | a rollout pool of its own | sent every trigger_parameter_sync_step updates |
| one_step_off_policy | `OneStepPrefetch` | the rollout pool, one batch ahead | as split sync |
| fully_async | `FullyAsync` | the rollout pool, continuously (a producer thread) | between two server ticks |

How one batch is generated is the other axis (hybridflow/trainer/generation/batch.py): `BatchGeneration` (one
`generate_sequences` call on a group) or `AgentGeneration` (agent loops over the rollout server, rollout.mode=async).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from hybridflow.protocol import DataProto


@dataclass
class Generated:
    """A step's rollout batch, gen's metrics, and the prompts it was sampled from where the step drew them now
    (None for a batch generated ahead of its step: the prompts' uids are in the batch)."""

    batch: DataProto
    metrics: dict[str, float]
    prompts: DataProto | None = None


class GenerationSource(Protocol):
    group: object  # the worker group that runs generate_sequences (ReMax's greedy call goes there too)

    def prepare(self, step: int) -> None:
        """Before the first step of fit, at `step` (0, or the resumed step): a rollout pool gets the actor's
        weights."""

    def next(self, step: int) -> Generated:
        """The gen stage of `step` (timed by the trainer as `gen`)."""

    def after_update(self, step: int, timings: dict) -> dict[str, float]:
        """After step's updates: this mode's weight sync (timed into `timings` as `weight_sync` when it runs)."""

    def state(self, step: int) -> dict:
        """What a checkpoint of `step` must hold to resume exactly (the sampler before any prompts
        drawn ahead of their step)."""

    def generate_validation(self, batch: DataProto) -> DataProto:
        """A validation batch (meta_info carries the val sampling) through this mode's generation."""

    def close(self) -> None:
        """Stop anything running in the background; idempotent."""
