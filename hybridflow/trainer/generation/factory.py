"""The one place a run's generation mode is chosen from its config (hybridflow/trainer/generation/source.py).

A new mode is a class with GenerationSource's methods and one entry in SPLIT_MODES (or a branch for a new
placement). The config checks (hybridflow/config/async_checks.py) have refused the combinations no mode serves:
one_step_off_policy in server mode, fully_async in batch mode, any async mode without a rollout pool.
"""

from __future__ import annotations

from hybridflow.trainer.agent_rollout import AgentRollout
from hybridflow.trainer.generation.batch import AgentGeneration, BatchGeneration
from hybridflow.trainer.generation.fully_async import FullyAsync
from hybridflow.trainer.generation.one_step import OneStepPrefetch
from hybridflow.trainer.generation.source import GenerationSource
from hybridflow.trainer.generation.synchronous import Colocated, SplitSync
from hybridflow.trainer.generation.weights import PoolWeights

# async_training.mode -> the source over a rollout pool of its own
SPLIT_MODES = {
    "sync": lambda cfg, how, sampler, draw, weights, last_step: SplitSync(how, sampler, draw, weights),
    "one_step_off_policy": lambda cfg, how, sampler, draw, weights, last_step: OneStepPrefetch(
        how, sampler, draw, weights, last_step),
    "fully_async": lambda cfg, how, sampler, draw, weights, last_step: FullyAsync(
        how, sampler, draw, weights, last_step, staleness=float(cfg.async_training.staleness_threshold),
        partial_rollout=bool(cfg.async_training.partial_rollout), batch_groups=cfg.data.train_batch_size),
}


def make_generation(cfg, actor, rollout, tokenizer, sampler, draw, last_step: int) -> GenerationSource:
    """`actor`: the actor group; `rollout`: the rollout pool's group, or None (the rollout runs in the actor's
    processes); `draw(step)`: the prompts of `step`, advancing `sampler`; `last_step`: the run's last step."""
    group = rollout if rollout is not None else actor
    if cfg.actor_rollout_ref.rollout.mode == "async":  # server mode: agent loops over the rollout server
        how = AgentGeneration(AgentRollout(cfg, group, tokenizer))
    else:
        how = BatchGeneration(group)
    if rollout is None:
        return Colocated(how, sampler, draw)
    weights = PoolWeights(actor, rollout, cfg.async_training.trigger_parameter_sync_step)
    return SPLIT_MODES[cfg.async_training.mode](cfg, how, sampler, draw, weights, last_step)
