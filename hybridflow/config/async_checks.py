"""Checks of async_training.* and the rollout pool (asynchronous RL), run by preflight before Ray starts;
each error names its key."""

from __future__ import annotations

from hybridflow.algorithms.choices import require_choice

MODES = ("sync", "one_step_off_policy", "fully_async")


def split_rollout(cfg) -> bool:
    """Whether the rollout runs on a pool of its own (trainer.role_pools.rollout)."""
    return "rollout" in (cfg.trainer.role_pools or {})


def validate_async(cfg, place) -> None:
    """`place`: the job's Placement (preflight.placement_of)."""
    a, r = cfg.async_training, cfg.actor_rollout_ref.rollout
    require_choice("async_training.mode", a.mode, MODES)
    if a.staleness_threshold < 0:
        raise ValueError(f"async_training.staleness_threshold={a.staleness_threshold} must be >= 0")
    if a.staleness_threshold > 0 and a.mode != "fully_async":
        raise ValueError(f"async_training.staleness_threshold={a.staleness_threshold}: a staleness bound belongs to "
                         f"async_training.mode=fully_async; got mode={a.mode} (one_step_off_policy is always one "
                         "version behind, sync none)")
    if a.partial_rollout and a.mode != "fully_async":
        raise ValueError("async_training.partial_rollout=true (continuing requests across a weight update) needs "
                         f"async_training.mode=fully_async; got mode={a.mode}")
    if a.trigger_parameter_sync_step < 1:
        raise ValueError(f"async_training.trigger_parameter_sync_step={a.trigger_parameter_sync_step} must be >= 1")
    total = cfg.trainer.total_training_steps
    if total and total % a.trigger_parameter_sync_step:
        raise ValueError(f"async_training.trigger_parameter_sync_step={a.trigger_parameter_sync_step} does not divide "
                         f"trainer.total_training_steps={total}: the last steps' weights would never reach the "
                         "rollout pool")
    if not split_rollout(cfg):
        if a.mode != "sync":
            raise ValueError(f"async_training.mode={a.mode} needs the rollout on a pool of its own "
                             "(trainer.resource_pools.<name> and trainer.role_pools.rollout=<name>): colocated with "
                             "the trainer, generation and training cannot overlap")
        if a.trigger_parameter_sync_step != 1:
            raise ValueError("async_training.trigger_parameter_sync_step needs the rollout on a pool of its own "
                             "(trainer.role_pools.rollout)")
        return
    if place.shares_actor_pool("rollout"):
        raise ValueError(f"trainer.role_pools.rollout={place.pool_of('rollout')!r} is the actor's pool: a rollout pool "
                         "must be a pool of its own (drop trainer.role_pools.rollout to run the rollout inside the "
                         "actor's processes, the 3D-HybridEngine)")
    world, t_g = place.world("rollout"), r.tensor_model_parallel_size
    if world % t_g:
        raise ValueError(f"actor_rollout_ref.rollout.tensor_model_parallel_size={t_g} does not divide the rollout "
                         f"pool's {world} processes ({place.describe('rollout')})")
    if t_g > 1 and world // t_g > 1:
        raise ValueError(f"a rollout pool of {world // t_g} replicas of actor_rollout_ref.rollout."
                         f"tensor_model_parallel_size={t_g} (vLLM data parallel) is not supported yet; use one replica "
                         "or t_g=1")
    if r.name != "vllm":
        raise ValueError(f"trainer.role_pools.rollout runs vLLM; actor_rollout_ref.rollout.name={r.name!r}")
    if a.mode == "fully_async" and r.mode != "async":
        raise ValueError("async_training.mode=fully_async produces request by request through the rollout server: "
                         f"set actor_rollout_ref.rollout.mode=async (got {r.mode!r})")
    if a.mode == "one_step_off_policy" and r.mode == "async":
        raise ValueError("async_training.mode=one_step_off_policy generates whole batches (actor_rollout_ref.rollout."
                         "mode=sync); in server mode use async_training.mode=fully_async with "
                         "async_training.staleness_threshold=1, its request-by-request equivalent")
