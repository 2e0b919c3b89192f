"""Entry point: python -m hybridflow.trainer.main --config configs/ppo_tiny_cpu.yaml [key=value ...]

Validates the whole config and the data before any Ray worker starts, then
builds the worker groups (colocated hybrid engine by default) and runs the loop.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from hybridflow.config.load import load_config, to_dict
from hybridflow.config.schema import HybridFlowConfig

log = logging.getLogger("hybridflow")


def validate(cfg: HybridFlowConfig) -> None:
    """Cheap checks that name the key, before anything expensive starts."""
    from hybridflow.algorithms import get_adv_estimator, needs_critic
    from hybridflow.parallel.dims import GenerationDims, ModelShape, ParallelDims

    a = cfg.actor_rollout_ref
    if not a.model.path or not os.path.isfile(os.path.join(a.model.path, "config.json")):
        raise FileNotFoundError(f"actor_rollout_ref.model.path={a.model.path!r} has no config.json")
    if not cfg.data.train_files:
        raise ValueError("data.train_files is empty")
    for f in cfg.data.train_files:
        if not os.path.isfile(f):
            raise FileNotFoundError(f"data.train_files: {f} does not exist")
    get_adv_estimator(cfg.algorithm.adv_estimator)
    import json

    with open(os.path.join(a.model.path, "config.json")) as fh:
        shape = ModelShape.from_hf_config(json.load(fh))
    world = cfg.trainer.n_gpus_per_node * cfg.trainer.nnodes
    m = a.actor.megatron
    tp, pp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size
    if world % (tp * pp * m.context_parallel_size):
        raise ValueError(f"trainer.n_gpus_per_node*nnodes={world} is not divisible by actor tp*pp*cp="
                         f"{tp}*{pp}*{m.context_parallel_size}")
    dims = ParallelDims(tp=tp, pp=pp, cp=m.context_parallel_size, dp=world // (tp * pp * m.context_parallel_size),
                        sp=m.sequence_parallel).validate(world, shape)
    GenerationDims(a.rollout.tensor_model_parallel_size).validate(dims, shape)
    rows = cfg.data.train_batch_size
    if rows % dims.dp:
        raise ValueError(f"data.train_batch_size={rows} is not divisible by the actor dp size {dims.dp}")
    if a.actor.ppo_mini_batch_size > rows or rows % a.actor.ppo_mini_batch_size:
        raise ValueError(f"actor_rollout_ref.actor.ppo_mini_batch_size={a.actor.ppo_mini_batch_size} must divide "
                         f"data.train_batch_size={rows}")
    if cfg.critic.enable is None:
        cfg.critic.enable = needs_critic(cfg.algorithm.adv_estimator)
    if needs_critic(cfg.algorithm.adv_estimator) and not cfg.critic.enable:
        raise ValueError(f"algorithm.adv_estimator={cfg.algorithm.adv_estimator} needs a critic; critic.enable=False")
    if cfg.critic.enable and not cfg.critic.model.path:
        cfg.critic.model.path = a.model.path
    if cfg.algorithm.adv_estimator in ("grpo", "rloo", "reinforce_plus_plus_baseline") and a.rollout.n < 2:
        raise ValueError(f"algorithm.adv_estimator={cfg.algorithm.adv_estimator} compares samples of a prompt: "
                         f"actor_rollout_ref.rollout.n must be >= 2 (got {a.rollout.n})")


def build_and_run(cfg: HybridFlowConfig) -> list[dict]:
    from transformers import AutoTokenizer

    from hybridflow.controller import RayWorkerGroup, ResourcePool, init_ray
    from hybridflow.data.rl_dataset import RLDataset
    from hybridflow.data.sampler import ResumableSampler
    from hybridflow.rewards.manager import RewardManager
    from hybridflow.trainer.ppo_trainer import RayPPOTrainer
    from megatron_workers.actor_rollout_ref import ActorRolloutRefWorker

    validate(cfg)
    a = cfg.actor_rollout_ref
    tokenizer = AutoTokenizer.from_pretrained(a.model.tokenizer_path or a.model.path)
    dataset = RLDataset(cfg.data.train_files, tokenizer, prompt_key=cfg.data.prompt_key,
                        max_prompt_length=cfg.data.max_prompt_length,
                        apply_chat_template=cfg.data.apply_chat_template,
                        filter_overlong_prompts=cfg.data.filter_overlong_prompts)
    sampler = ResumableSampler(len(dataset), cfg.data.train_batch_size, cfg.data.seed, shuffle=cfg.data.shuffle)
    reward = RewardManager.from_config(cfg.custom_reward_function)

    r = cfg.trainer.ray
    # Ray's CPUs are logical: workers pin their own threads, so a local cluster may hold more ranks than cores.
    num_cpus = r.num_cpus or (None if r.address else max(16, os.cpu_count() or 1))
    init_ray(r.address, num_cpus, r.include_dashboard, r.object_store_memory, run_dir=cfg.trainer.default_local_dir)
    procs = [cfg.trainer.n_gpus_per_node] * cfg.trainer.nnodes
    env = {"TOKENIZERS_PARALLELISM": "false"}
    actor_pool = ResourcePool("actor_rollout_ref", procs, timeout_s=r.timeout_s)
    arr = RayWorkerGroup(actor_pool, ActorRolloutRefWorker, (to_dict(a), "actor_rollout_ref"),
                         role="actor_rollout_ref", env=env, timeout_s=r.timeout_s)
    critic = None
    if cfg.critic.enable:
        from megatron_workers.critic import CriticWorker

        critic_pool = actor_pool if cfg.trainer.placement == "colocate" else ResourcePool(
            "critic", procs, timeout_s=r.timeout_s)
        critic = RayWorkerGroup(critic_pool, CriticWorker, (to_dict(cfg.critic),), role="critic", env=env,
                                timeout_s=r.timeout_s)
    # Each group rendezvous on a port picked just before its init (vLLM opens ports while it starts).
    arr.refresh_rendezvous()
    arr.init_model()
    if critic is not None:
        critic.refresh_rendezvous()
        critic.init_model()
    trainer = RayPPOTrainer(cfg, tokenizer, dataset, sampler, reward, arr, critic)
    trainer.n_params = _count_params(a.model.path)
    history = trainer.fit()
    trainer.finish(history)
    return history


def _count_params(path: str) -> int:
    from safetensors import safe_open

    total = 0
    for name in os.listdir(path):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(path, name), "pt") as f:
                for k in f.keys():
                    total += _prod(f.get_slice(k).get_shape())
    return total


def _prod(shape) -> int:
    out = 1
    for s in shape:
        out *= s
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=None, help="YAML file; keys as in hybridflow/config/schema.py")
    ap.add_argument("overrides", nargs="*", help="dotlist overrides, e.g. actor_rollout_ref.actor.optim.lr=1e-5")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = load_config(args.config, args.overrides)
        validate(cfg)
    except (ValueError, FileNotFoundError, KeyError) as e:
        print(f"config error: {e}", file=sys.stderr)
        sys.exit(2)
    build_and_run(cfg)


if __name__ == "__main__":
    main()
