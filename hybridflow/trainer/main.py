"""Train a policy with PPO or GRPO from one config (YAML and key=value overrides): the trainer's entry point.

    python -m hybridflow.trainer.main --config configs/ppo_tiny_cpu.yaml [key=value ...]

Validates the whole config and the data before any Ray worker starts, then
builds the worker groups on their resource pools (hybridflow/trainer/placement.py: trainer.placement
colocate | split | standalone, or trainer.resource_pools + trainer.role_pools) and runs the loop.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys

from hybridflow.config import checks
from hybridflow.config.load import load_config, save_resolved, to_dict
from hybridflow.config.schema import HybridFlowConfig
from hybridflow.trainer.preflight import (  # noqa: F401  (re-exported: launch/ and tests import them from main)
    GRADIENT_CHECKPOINTING_RECOMPUTE,
    apply_gradient_checkpointing,
    job_roles,
    needs_ref,
    placement_of,
    resolved_transformer_impls,
    validate,
    validate_cluster,
    wants_validation,
)

log = logging.getLogger("hybridflow")


def make_pools(cfg: HybridFlowConfig, roles: list[str], place=None, reserved: dict | None = None) -> dict:
    """The ResourcePool of each role in `roles` (Placement: trainer.placement or trainer.resource_pools).

    Roles mapped to one pool share one ResourcePool, whose bundles hold one process of each group on it
    (max_colocate); the ref on the actor's pool is no group of its own (it runs in the actor's processes).
    Ray's CPUs are logical here (see build_and_run), so 4 standalone pools of 2 processes fit a 2-core box.
    Pools reserve nothing until a group is built on them. `reserved`: {pool name: controller Reserved}, bundles
    reserved by someone else that the pool uses instead (a sweep trial's; launch/sweep/resources.py).
    """
    from hybridflow.controller import ResourcePool
    from hybridflow.trainer import placement

    if place is None:
        try:
            place = placement.resolve(cfg.trainer, roles)
        except placement.PlacementError as e:
            raise ValueError(str(e)) from None
    groups = lambda pool: [r for r in place.roles_on(pool) if not (r == "ref" and place.shares_actor_pool("ref"))]
    pools = {name: ResourcePool(name, list(procs), max_colocate=max(1, len(groups(name))),
                                timeout_s=cfg.trainer.ray.timeout_s, reserved=(reserved or {}).get(name))
             for name, procs in place.pools.items()}
    return {role: pools[place.pool_of(role)] for role in roles}


def build_groups(cfg: HybridFlowConfig, place=None, teardown=None, reserved: dict | None = None) -> dict:
    """Every worker group the job needs, initialised: {"actor_rollout", "ref", "critic", "reward_model"}.

    The ref on the actor's pool is hosted by the actor group (role actor_rollout_ref) and "ref" is None;
    on a pool of its own it is an ActorRolloutRefWorker of role "ref" (only when a KL term needs it).
    `teardown` (a controller.Teardown) is told of every pool and group as it is made, so a stop half-way
    through still takes down what exists.
    """
    from hybridflow.controller import RayWorkerGroup
    from hybridflow.controller.teardown import Teardown
    from megatron_workers.actor_rollout_ref import ActorRolloutRefWorker

    a = cfg.actor_rollout_ref
    place = place or placement_of(cfg)
    separate_ref = "ref" in place.role_pools and not place.shares_actor_pool("ref")
    split_rollout = "rollout" in place.role_pools  # vLLM on a pool of its own: the actor's processes hold none
    # the actor's worker role names what its processes host: actor, actor_rollout, actor_ref or actor_rollout_ref
    hosts_ref = "ref" in place.role_pools and not separate_ref
    actor_role = "actor" + ("" if split_rollout else "_rollout") + ("_ref" if hosts_ref else "")
    specs = {"actor_rollout": (ActorRolloutRefWorker, (to_dict(a), actor_role), actor_role)}
    if split_rollout:
        from megatron_workers.rollout_worker import RolloutWorker

        specs["rollout"] = (RolloutWorker, (to_dict(a),), "rollout")
    if separate_ref:
        specs["ref"] = (ActorRolloutRefWorker, (to_dict(a), "ref"), "ref")
    if cfg.critic.enable:
        from megatron_workers.critic import CriticWorker

        specs["critic"] = (CriticWorker, (to_dict(cfg.critic),), "critic")
    if cfg.reward_model.enable:
        from megatron_workers.reward_model import RewardModelWorker

        specs["reward_model"] = (RewardModelWorker, (to_dict(cfg.reward_model),), "reward_model")
    pools = make_pools(cfg, list(place.role_pools), place, reserved)
    log.info("%s: %s%s", place.source, ", ".join(f"{name} in pool '{pools[name].name}' {pools[name].procs_per_node}"
                                                 for name in specs),
             " (the ref in the actor's processes)" if actor_role == "actor_rollout_ref" else "")
    env = {"TOKENIZERS_PARALLELISM": "false", **fault_env(cfg)}
    teardown = teardown if teardown is not None else Teardown()
    for pool in pools.values():
        teardown.add_pool(pool)
    groups = {}
    for name, (cls, args, role) in specs.items():
        groups[name] = RayWorkerGroup(pools[name], cls, args, role=role, env=env, timeout_s=cfg.trainer.ray.timeout_s,
                                      detect_timeout_s=cfg.trainer.fault.detect_timeout_s)
        teardown.add_group(groups[name])
        log.info("%s: %d ranks on nodes %s", name, groups[name].world_size,
                 " ".join(f"{i}={n[:8]}" for i, n in enumerate(pools[name].node_ids())))
    # One group at a time, the actor's first, each on a port picked just before its init (vLLM in the
    # actor processes opens ports while it starts).
    for group in groups.values():
        group.refresh_rendezvous()
        group.init_model()
    if split_rollout:
        connect_weight_sync(groups["actor_rollout"], groups["rollout"], cfg.trainer.fault.pg_timeout_s)
    return {name: groups.get(name) for name in ("actor_rollout", "ref", "critic", "reward_model", "rollout")}


def connect_weight_sync(actor, rollout, timeout_s: float) -> None:
    """The cross-pool sync group (hybridflow/resharding/cross_pool.py): the actor's rank 0 serves its store on a port
    probed there; both groups join together (the handshake is collective over both pools)."""
    host, port = actor._probe_rendezvous()
    sending = actor.init_weight_sync.remote(host, port, rollout.world_size, timeout_s)
    receiving = rollout.init_weight_sync.remote(host, port, actor.world_size, timeout_s)
    sending.get()
    expected = receiving.get()
    log.info("weight sync across pools: actor %d ranks -> rollout %d ranks via %s:%d, %.0f bytes per rollout rank",
             actor.world_size, rollout.world_size, host, port, expected[0]["expected_bytes"])


def fault_env(cfg: HybridFlowConfig) -> dict[str, str]:
    """trainer.fault as the workers read it (they get their role's config only), plus a test's fault hook."""
    from hybridflow.controller import fault_inject

    f = cfg.trainer.fault
    env = {"HYBRIDFLOW_PG_TIMEOUT_S": str(f.pg_timeout_s), "HYBRIDFLOW_SKIP_NONFINITE": str(int(f.skip_nonfinite)),
           "HYBRIDFLOW_MAX_NONFINITE": str(f.max_nonfinite)}
    for key in (fault_inject.ENV, fault_inject.STATE_ENV):
        if key in os.environ:
            env[key] = os.environ[key]
    return env


def build_and_run(cfg: HybridFlowConfig, validated: bool = False, data: tuple | None = None) -> list[dict]:
    """Build every worker group and run the loop; `validated`: main() already ran validate(cfg); `data`: the
    (tokenizer, dataset, val_dataset) that main()'s checks.data_files already read, so they are not read twice.
    With trainer.max_restarts, a dead worker takes every group down and the job resumes from its newest checkpoint."""
    import torch

    from hybridflow.controller.teardown import Teardown, exit_on_sigterm
    from hybridflow.trainer.restart import resume_mode_for_restart, run_with_restarts

    parts = _prepare_run(cfg, validated, data)
    place = placement_of(cfg)
    rng = torch.get_rng_state()  # each attempt starts where the first did (a resume then sets the saved one)
    original_mode, state = str(cfg.trainer.resume_mode), {"trainer": None, "saved": None}

    def attempt(n: int, restart_log) -> list[dict]:
        torch.set_rng_state(rng)
        cfg.trainer.resume_mode = resume_mode_for_restart(original_mode, state["saved"])
        teardown = Teardown()  # every group and placement group of this attempt, whatever happens
        try:
            trainer = _make_trainer(cfg, place, teardown, *parts)
            trainer.on_resumed = restart_log.resumed
            state["trainer"] = trainer
            history = trainer.fit()
            trainer.finish(history)
            return history
        finally:
            if state["trainer"] is not None and state["trainer"].last_saved is not None:
                state["saved"] = str(state["trainer"].last_saved)
            teardown.close()  # also on success: no worker outlives its run

    current_step = lambda: state["trainer"].global_step if state["trainer"] is not None else 0
    with exit_on_sigterm():  # `ray job stop`: unwind, then take the workers and placement groups down
        return run_with_restarts(cfg.trainer.max_restarts, attempt, cfg.trainer.default_local_dir, current_step)


@contextlib.contextmanager
def trainer_session(cfg: HybridFlowConfig, validated: bool = False, reserved: dict | None = None):
    """One attempt, no restarts: validate (unless `validated`), start Ray, build every worker group on its pool
    and yield a RayPPOTrainer ready to fit(); on leaving (normally, on an error, or on SIGTERM from `ray job stop`)
    every worker group and placement group it made is taken down. launch.benchmark runs its steps in here, and
    each launch.sweep trial, with `reserved` (make_pools) set to its pools' share of the trial's placement group."""
    with worker_session(cfg, validated, reserved) as make_trainer:
        yield make_trainer(cfg)


@contextlib.contextmanager
def worker_session(cfg: HybridFlowConfig, validated: bool = False, reserved: dict | None = None):
    """trainer_session's groups, yielding `make_trainer(c)`: a RayPPOTrainer for config `c` over them, `cfg` or a
    variant of it that changes only what the driver decides per step (DRIVER_SIDE: the algorithm, the actor's
    loss_agg_mode, the run's directory, length and logging). Several trainers may run on the warm groups one after
    another (tests/e2e_estimator_runs.py runs every estimator so); the critic group, built when `cfg` has one, is
    left unused by a variant without."""
    from hybridflow.controller.teardown import Teardown, exit_on_sigterm

    parts = _prepare_run(cfg, validated)
    place = placement_of(cfg)
    teardown = Teardown()
    with exit_on_sigterm():
        try:
            groups = build_groups(cfg, place, teardown, reserved)

            def make_trainer(variant: HybridFlowConfig):
                if variant is not cfg:
                    validate(variant)
                    check_driver_side_variant(cfg, variant)
                    save_resolved(variant, os.path.join(variant.trainer.default_local_dir, "config.yaml"))
                return trainer_on(variant, groups, place, *parts)

            yield make_trainer
        finally:
            teardown.close()


# What a trainer may change over worker groups built for another config: the workers keep the config they were
# built with, and these are read by the driver only (the actor's loss_agg_mode travels with each update_actor call).
DRIVER_SIDE = ("algorithm", "actor_rollout_ref.actor.loss_agg_mode", "critic.enable",
               *(f"trainer.{k}" for k in ("default_local_dir", "experiment_name", "project_name", "logger",
                                          "total_training_steps", "total_epochs", "save_freq", "resume_mode",
                                          "val_before_train", "test_freq", "rollout_data_dir", "validation_data_dir",
                                          "max_ckpt_to_keep")))


def check_driver_side_variant(built: HybridFlowConfig, variant: HybridFlowConfig) -> None:
    """Raise, naming the keys, unless `variant` differs from `built` (the workers' config) only in DRIVER_SIDE (and
    in critic.* when the variant runs no critic), and uses a critic only where `built` made one."""
    skip = (*DRIVER_SIDE, *(() if variant.critic.enable else ("critic",)))

    def flat(d: dict, prefix: str = "") -> dict:
        out = {}
        for k, v in d.items():
            key = f"{prefix}{k}"
            if any(key == s or key.startswith(s + ".") for s in skip):
                continue
            out.update(flat(v, key + ".") if isinstance(v, dict) and v else {key: v})
        return out

    a, b = flat(to_dict(built)), flat(to_dict(variant))
    changed = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
    if changed:
        raise ValueError(f"a trainer over worker groups built for another config may change only what the driver "
                         f"reads per step; these keys differ: {changed[:8]}")
    if variant.critic.enable and not built.critic.enable:
        raise ValueError(f"algorithm.adv_estimator={variant.algorithm.adv_estimator} needs a critic; the worker "
                         "groups were built without one")


def _prepare_run(cfg: HybridFlowConfig, validated: bool, data: tuple | None = None) -> tuple:
    """Validate (unless done), then the tokenizer, datasets (unless `data` holds them) and reward, then Ray:
    what every attempt shares."""
    from transformers import AutoTokenizer

    from hybridflow.controller import init_ray
    from hybridflow.data.rl_dataset import RLDataset
    from hybridflow.rewards.manager import RewardManager

    if not validated:
        validate(cfg)
        validate_cluster(cfg)
    a = cfg.actor_rollout_ref
    if data is not None:
        tokenizer, dataset, val_dataset = data
    else:
        tokenizer = AutoTokenizer.from_pretrained(a.model.tokenizer_path or a.model.path)
        # The same class, prompt length and filtering for both: a val prompt is what a training prompt would be.
        make_dataset = lambda files: RLDataset.from_config(files, tokenizer, cfg.data)
        dataset = make_dataset(cfg.data.train_files)
        val_dataset = make_dataset(cfg.data.val_files) if wants_validation(cfg) else None
    reward = RewardManager.from_config(cfg.custom_reward_function)

    r = cfg.trainer.ray
    # Ray's CPUs are logical: workers pin their own threads, so a local cluster may hold more ranks than cores.
    num_cpus = r.num_cpus or (None if r.address else max(16, os.cpu_count() or 1))
    run_dir = os.path.abspath(cfg.trainer.default_local_dir)
    if r.address and not os.path.isabs(cfg.trainer.default_local_dir):
        # Under `ray job submit` the working directory is Ray's unpacked copy, removed with the session.
        log.warning("trainer.default_local_dir=%s is relative: the run writes to %s (use an absolute path on a "
                    "cluster)", cfg.trainer.default_local_dir, run_dir)
    log.info("run dir: %s", run_dir)
    resolved = save_resolved(cfg, os.path.join(cfg.trainer.default_local_dir, "config.yaml"))
    impls = resolved_transformer_impls(cfg)
    for key, choice in impls.items():
        log.info("%s -> %s", key, choice)
    with open(resolved, "a") as fh:  # comments: the file still loads as a config, `auto` stays auto
        fh.write("# resolved on the driver's machine (workers log their own):\n")
        fh.writelines(f"#   {key}: {choice}\n" for key, choice in impls.items())
    from hybridflow.controller.worker_logs import LOG_DIR_ENV

    init_ray(r.address, num_cpus, r.include_dashboard, r.object_store_memory, run_dir=cfg.trainer.default_local_dir,
             env_vars={LOG_DIR_ENV: worker_log_dir(cfg)})  # WorkerHost sends each rank's output there
    return tokenizer, dataset, val_dataset, reward


def _make_trainer(cfg: HybridFlowConfig, place, teardown, tokenizer, dataset, val_dataset, reward, reserved=None):
    """Every worker group on its pool (told to `teardown` as made) and a RayPPOTrainer over them."""
    groups = build_groups(cfg, place, teardown, reserved)
    return trainer_on(cfg, groups, place, tokenizer, dataset, val_dataset, reward)


def trainer_on(cfg: HybridFlowConfig, groups: dict, place, tokenizer, dataset, val_dataset, reward):
    """A RayPPOTrainer for `cfg` over built worker groups (build_groups' dict), with a sampler of its own."""
    from hybridflow.data.sampler import ResumableSampler
    from hybridflow.trainer.ppo_trainer import RayPPOTrainer

    sampler = ResumableSampler(len(dataset), cfg.data.train_batch_size, cfg.data.seed, shuffle=cfg.data.shuffle)
    critic = groups["critic"] if cfg.critic.enable else None
    trainer = RayPPOTrainer(cfg, tokenizer, dataset, sampler, reward, groups["actor_rollout"], critic,
                            ref=groups["ref"], reward_model=groups["reward_model"], val_dataset=val_dataset,
                            rollout=groups["rollout"])
    trainer.n_devices = place.n_devices  # every pool's processes: verl's perf/throughput divides by them
    trainer.n_params = count_active_params(cfg.actor_rollout_ref.model.path)  # perf/mfu/actor's N
    return trainer


def worker_log_dir(cfg: HybridFlowConfig) -> str:
    """<run dir>/logs: each worker process's stdout/stderr (hybridflow/controller/worker_logs.py)."""
    return os.path.join(os.path.abspath(cfg.trainer.default_local_dir), "logs")


def count_params(path: str) -> int:
    """Parameters in an HF directory's safetensors files (read from the headers, no weights loaded)."""
    from safetensors import safe_open

    total = 0
    for name in os.listdir(path):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(path, name), "pt") as f:
                for k in f.keys():
                    total += _prod(f.get_slice(k).get_shape())
    return total


def count_active_params(path: str) -> int:
    """The parameters a token's forward touches in an HF directory: count_params less the routed experts it does not
    run (top-k of E per MoE layer; hybridflow/models/param_count.py, also launch.plan's count)."""
    import json

    from hybridflow.models.param_count import active_params
    from megatron_workers.model_builder import read_hf_facts

    with open(os.path.join(path, "config.json")) as f:
        facts = read_hf_facts(json.load(f))
    return active_params(count_params(path), facts.num_layers, facts.num_experts, facts.moe_topk, facts.hidden_size,
                         facts.moe_ffn_hidden_size)


def _prod(shape) -> int:
    out = 1
    for s in shape:
        out *= s
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=None, help="YAML file; keys as in hybridflow/config/schema.py")
    ap.add_argument("overrides", nargs="*", help="dotlist overrides, e.g. actor_rollout_ref.actor.optim.lr=1e-5")
    # verl's Hydra flags, so a pasted verl command line runs: its Megatron yaml's keys are our schema's defaults.
    ap.add_argument("--config-path", dest="verl_config_path", help=argparse.SUPPRESS)
    ap.add_argument("--config-name", dest="verl_config_name", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for flag, value in (("--config-path", args.verl_config_path), ("--config-name", args.verl_config_name)):
        if value is not None:
            log.warning("ignoring verl's %s=%s: the defaults here are hybridflow/config/schema.py's (see docs/verl.md, "
                        "'Coming from verl'); pass --config FILE for a YAML file of ours", flag, value)
    try:
        cfg = load_config(args.config, args.overrides)
        log.info("logs: %s (one file per worker process; the console shows errors and first-time warnings)",
                 worker_log_dir(cfg))
        validate(cfg)
        validate_cluster(cfg)
        data = checks.data_files(cfg)  # the rows too (prompts, ground truth, lengths), still before Ray starts
    except (ValueError, FileNotFoundError, KeyError) as e:
        print(f"config error: {e}", file=sys.stderr)
        sys.exit(2)
    build_and_run(cfg, validated=True, data=data)


if __name__ == "__main__":
    main()
