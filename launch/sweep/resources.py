"""What one sweep trial reserves: a bundle for the trial's driver, then every bundle of the trainer's pools.

Tune runs each trial in a Ray actor inside a placement group it makes from the trial's PlacementGroupFactory.
Ray has no nested placement groups: a placement group the trainer made inside the trial would be taken from
the cluster's free resources, not from the trial's (measured on Ray 2.60: it stayed pending although the trial
held the bundles). So the trial's placement group holds the pools' bundles too, and the trainer's pools take
them (hybridflow.controller.resource_pool.Reserved) instead of making their own. Tune then starts only as many
trials as the cluster holds, and a stopped trial's workers go with its placement group.

The pools and their bundles are the trainer's own (hybridflow.trainer.main.make_pools), so the bundles a trial
reserves are exactly what its worker groups ask for. STRICT_PACK: a trial's pools are on one node, as a pool's
local ranks must be.
"""

from __future__ import annotations

DRIVER_BUNDLE = {"CPU": 1.0}  # the trial's own actor: the trainer's driver (data, rewards, advantages, logging)


def trial_bundles(cfg, use_gpu: bool | None = None) -> tuple[list[dict], dict[str, int]]:
    """(bundles, {pool name: index of its first bundle}) of one trial of `cfg` (critic.enable may be unresolved).
    use_gpu: whether the pools take GPUs (None: the connected cluster has some)."""
    from hybridflow.trainer.main import job_roles, make_pools, placement_of

    if cfg.trainer.nnodes != 1:
        raise ValueError(f"trainer.nnodes={cfg.trainer.nnodes}: a sweep trial runs on one node (its pools share "
                         "one placement group, STRICT_PACK); sweep with trainer.nnodes=1")
    place = placement_of(cfg)
    pools = make_pools(cfg, job_roles(cfg), place)
    bundles, first = [dict(DRIVER_BUNDLE)], {}
    for name in place.pools:
        pool = next(p for p in pools.values() if p.name == name)
        if use_gpu is not None:
            pool.use_gpu = use_gpu
        first[name] = len(bundles)
        bundles += [pool.bundle(0) for _ in range(pool.world_size)]
    return bundles, first


def reserved_pools(pg, first: dict[str, int]) -> dict:
    """make_pools' `reserved`: each pool's share of the trial's placement group `pg`."""
    from hybridflow.controller.resource_pool import Reserved

    return {name: Reserved(pg, index) for name, index in first.items()}
