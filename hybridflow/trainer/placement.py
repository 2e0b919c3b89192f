"""Where each role runs: named resource pools and the role -> pool map (pure; no Ray).

verl's `resource_pool_spec` and role mapping, as two trainer keys:

    trainer.resource_pools: {name: [processes on node 0, processes on node 1, ...]}
    trainer.role_pools:     {actor_rollout: name, ref: name, critic: name, reward_model: name}

The HybridFlow paper's three placements (section 8.1) are presets over the same two maps, every pool
`nnodes x n_gpus_per_node` processes:

    colocate    one pool for every role
    split       actor+rollout+ref on one pool, critic+reward model on another
    standalone  a pool per role

Roles on one pool share its bundles (separate processes, a fraction of each device); the ref on the actor's
pool runs inside the actor's processes (role actor_rollout_ref), so it uses the actor's Megatron groups.

`trainer.placement=split` meant "a pool per role" before the presets followed the paper; that is now
`standalone` (MIGRATION below is logged when split is used).
"""

from __future__ import annotations

from dataclasses import dataclass

PRESETS = ("colocate", "split", "standalone")
# rollout: vLLM on a pool of its own (asynchronous RL, async_training.*); without it the rollout lives in the actor's
# processes (the 3D-HybridEngine).
ROLES = ("actor_rollout", "ref", "critic", "reward_model", "rollout")
# The config key of each role's Megatron mesh, for error messages.
MESH_KEYS = {"actor_rollout": "actor_rollout_ref.actor.megatron", "ref": "actor_rollout_ref.ref.megatron",
             "critic": "critic.megatron", "reward_model": "reward_model.megatron",
             "rollout": "actor_rollout_ref.rollout.tensor_model_parallel_size"}
_SPLIT = {"actor_rollout": "actor_ref", "ref": "actor_ref", "critic": "critic_rm", "reward_model": "critic_rm"}
MIGRATION = ("trainer.placement=split follows the HybridFlow paper: actor+rollout+ref on one pool ('actor_ref', the "
             "ref in the actor's processes), critic+reward model on another ('critic_rm'); for a pool per role, "
             "what split meant before, use trainer.placement=standalone")


class PlacementError(ValueError):
    pass


@dataclass(frozen=True)
class Placement:
    pools: dict[str, tuple[int, ...]]  # only the pools some role uses
    role_pools: dict[str, str]  # only the roles the job runs
    source: str  # how it was given: "trainer.placement=<preset>" or "trainer.resource_pools"

    def pool_of(self, role: str) -> str:
        return self.role_pools[role]

    def world(self, role: str) -> int:
        return sum(self.pools[self.role_pools[role]])

    def procs(self, role: str) -> list[int]:
        return list(self.pools[self.role_pools[role]])

    def shares_actor_pool(self, role: str) -> bool:
        return self.role_pools.get(role) == self.role_pools["actor_rollout"]

    def roles_on(self, pool: str) -> list[str]:
        return [r for r, p in self.role_pools.items() if p == pool]

    @property
    def n_devices(self) -> int:
        """Processes over all pools (devices on GPU): verl's perf/throughput divides by it."""
        return sum(sum(p) for p in self.pools.values())

    def describe(self, role: str) -> str:
        """The role's pool and its size, as the config gave it (for errors that name role, pool and size)."""
        name = self.role_pools[role]
        if self.source == "trainer.resource_pools":
            how = f"trainer.resource_pools.{name}={list(self.pools[name])}, trainer.role_pools.{role}={name}"
        else:
            how = f"{self.source}, trainer.nnodes x n_gpus_per_node = {list(self.pools[name])}"
        return f"pool '{name}' of {sum(self.pools[name])} processes ({how})"

    def summary(self) -> str:
        return ", ".join(f"{r} in pool '{p}' {list(self.pools[p])}" for r, p in self.role_pools.items())


def resolve(trainer, roles: list[str]) -> Placement:
    """The pools and role map for the roles the job runs (a subset of ROLES, actor_rollout first).

    `trainer` is the TrainerConfig. Errors name the key; nothing here starts a process.
    """
    unknown = [r for r in roles if r not in ROLES]
    if unknown or "actor_rollout" not in roles:
        raise PlacementError(f"roles {roles}: expected a subset of {ROLES} with actor_rollout")
    if trainer.resource_pools:
        return _from_pools(trainer, roles)
    if trainer.role_pools:
        raise PlacementError(f"trainer.role_pools={dict(trainer.role_pools)} names pools, but trainer.resource_pools "
                             "is empty: define them, e.g. trainer.resource_pools.actor=[2]")
    if trainer.placement not in PRESETS:
        raise PlacementError(f"trainer.placement={trainer.placement!r}; choose one of {', '.join(PRESETS)} "
                             "(or give trainer.resource_pools and trainer.role_pools)")
    per_node = (trainer.n_gpus_per_node,) * trainer.nnodes
    if trainer.placement == "colocate":
        role_pools = {r: "colocated" for r in roles}
    elif trainer.placement == "split":
        role_pools = {r: _SPLIT[r] for r in roles}
    else:
        role_pools = {r: r for r in roles}
    return Placement({p: per_node for p in dict.fromkeys(role_pools.values())}, role_pools,
                     f"trainer.placement={trainer.placement}")


def _from_pools(trainer, roles: list[str]) -> Placement:
    pools, role_pools = dict(trainer.resource_pools), dict(trainer.role_pools)
    for name, procs in pools.items():
        procs = list(procs)
        key = f"trainer.resource_pools.{name}={procs}"
        if not procs or any(int(n) < 1 for n in procs):
            raise PlacementError(f"{key}: give a process count >= 1 for each node the pool uses")
        if len(procs) > trainer.nnodes:
            raise PlacementError(f"{key} spans {len(procs)} nodes, but trainer.nnodes={trainer.nnodes}")
        if max(procs) > trainer.n_gpus_per_node:
            raise PlacementError(f"{key}: a node holds at most trainer.n_gpus_per_node={trainer.n_gpus_per_node} "
                                 "processes of one pool")
    bad_roles = sorted(set(role_pools) - set(ROLES))
    if bad_roles:
        raise PlacementError(f"trainer.role_pools: unknown role(s) {bad_roles}; the roles are {', '.join(ROLES)}")
    missing = [r for r in roles if r not in role_pools]
    if missing:
        raise PlacementError(f"trainer.role_pools has no pool for role(s) {missing}, which this job runs; "
                             f"add e.g. trainer.role_pools.{missing[0]}={next(iter(pools))} "
                             f"(pools: {', '.join(pools)})")
    for role in roles:
        if role_pools[role] not in pools:
            raise PlacementError(f"trainer.role_pools.{role}={role_pools[role]!r} is not a pool of "
                                 f"trainer.resource_pools ({', '.join(pools)})")
    used = {role_pools[r] for r in roles}
    unused = [p for p in pools if p not in used]
    if unused:
        # verl fails late on an unused pool (its placement group is never scheduled); here it is a config error.
        idle = sorted(r for r in role_pools if r not in roles)
        note = f" (role(s) {idle} map to it but do not run in this job)" if idle else ""
        raise PlacementError(f"trainer.resource_pools: pool(s) {unused} are used by no role{note}; "
                             "remove them or map a role to them in trainer.role_pools")
    return Placement({p: tuple(int(n) for n in pools[p]) for p in pools},
                     {r: role_pools[r] for r in roles}, "trainer.resource_pools")
