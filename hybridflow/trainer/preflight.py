"""Everything the trainer checks before Ray starts: each role's mesh against its model and pool, the loss and
KL names, verl's shared keys, validation data, the reference and reward models, and the cluster size.

`validate(cfg)` is the whole check; main() runs it (and `hybridflow.config.checks.data_files`) before any
worker exists, so a bad config costs seconds, not a cluster start. Pure: reads config.json files, no Ray.
"""

from __future__ import annotations

import logging
import math
import os

from hybridflow.config import checks
from hybridflow.config.checks import wants_validation
from hybridflow.config.schema import HybridFlowConfig

log = logging.getLogger("hybridflow")


def _hf_config(key: str, path: str, causal_lm: bool = False) -> dict:
    """The config.json of the HF directory named by config key `key`, checked with its safetensors files
    (complete, readable headers; for a causal LM also every tensor the loader needs), or an error naming the key."""
    config = checks.model_config(key, path)  # raises on a missing, invalid or incomplete config.json
    checks.model_weights(key, path, config if causal_lm else None)
    return config


def _role_dims(key: str, m, world: int, hf_config: dict, pool: str | None = None):
    """A role's Megatron mesh on `world` processes, checked against its model; errors name `key` (its megatron)
    and `pool` (Placement.describe: the role's pool and its size)."""
    from hybridflow.parallel.dims import LayoutError, ModelShape, ParallelDims

    tp, pp, cp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size, m.context_parallel_size
    where = pool or f"trainer.n_gpus_per_node*nnodes={world}"
    for name, size in (("tensor", tp), ("pipeline", pp), ("context", cp)):
        if size < 1:
            raise ValueError(f"{key}.{name}_model_parallel_size={size} must be >= 1")
    if tp * pp * cp > world:
        raise ValueError(f"{key} tp*pp*cp={tp}*{pp}*{cp}={tp * pp * cp} processes is larger than its {where}")
    if world % (tp * pp * cp):
        raise ValueError(f"{key} tp*pp*cp={tp}*{pp}*{cp}={tp * pp * cp} does not divide the size of its {where}")
    from hybridflow.parallel.dims import check_recompute
    from megatron_workers.model_builder import (
        ATTENTION_BACKENDS,
        TRANSFORMER_IMPLS,
        check_moe_options,
        moe_grouped_gemm,
    )

    if m.transformer_impl not in TRANSFORMER_IMPLS:
        raise ValueError(f"{key}.transformer_impl={m.transformer_impl!r}; choose one of {', '.join(TRANSFORMER_IMPLS)}")
    model = ModelShape.from_hf_config(hf_config)
    if m.sequence_parallel is None:  # null: resolved here, so the workers get the value checked below
        from hybridflow.parallel.dims import default_sequence_parallel

        m.sequence_parallel = default_sequence_parallel(tp, model)
    o = m.override_transformer_config
    check_moe_options(o, f"{key}.override_transformer_config")
    if model.is_moe:
        moe_grouped_gemm(m, key)
    if o.attention_backend not in ATTENTION_BACKENDS:
        raise ValueError(f"{key}.override_transformer_config.attention_backend={o.attention_backend!r}; "
                         f"choose one of {', '.join(ATTENTION_BACKENDS)}")
    if o.attention_backend == "unfused" and m.transformer_impl == "transformer_engine":
        raise ValueError(f"{key}.override_transformer_config.attention_backend={o.attention_backend} picks the local "
                         f"spec's attention; with {key}.transformer_impl=transformer_engine only auto is accepted")
    if o.recompute_granularity == "selective" and o.attention_backend != "unfused":
        # tests/test_planner.py measures it: the fused attention keeps no s x s tensor, so the checkpoint
        # saves nothing (it kept 1.7% more bytes) and only adds the attention's recompute to the backward.
        log.warning("%s.override_transformer_config.recompute_granularity=selective recomputes the core attention, "
                    "whose s x s scores the fused attention (attention_backend=auto: torch SDPA, or TE's) does "
                    "not keep: it saves no memory here. Use attention_backend=unfused with it, or full recompute.",
                    key)
    try:
        dims = ParallelDims.from_megatron_config(m, world).validate(world, model)
        check_recompute(f"{key}.override_transformer_config", o.recompute_granularity, o.recompute_method,
                        o.recompute_num_layers, dims, model)
    except LayoutError as e:
        raise ValueError(f"{key}: {e}") from None
    return dims


def resolved_transformer_impls(cfg: HybridFlowConfig) -> dict[str, str]:
    """{role's transformer_impl key: "local" | "transformer_engine" (why)}, as this process sees the machine.

    On a local run the workers share the driver's machine, so this is their choice too; on a remote cluster
    each worker logs its own at start-up (megatron_workers.engine.build_role_engine).
    """
    from megatron_workers.model_builder import resolve_transformer_impl

    roles = {"actor_rollout_ref.actor": cfg.actor_rollout_ref.actor.megatron,
             "actor_rollout_ref.ref": cfg.actor_rollout_ref.ref.megatron, "critic": cfg.critic.megatron,
             "reward_model": cfg.reward_model.megatron}
    out = {}
    for role, m in roles.items():
        key = f"{role}.megatron.transformer_impl"
        impl, why = resolve_transformer_impl(m.transformer_impl, key)
        out[key] = f"{impl} ({why})"
    return out


GRADIENT_CHECKPOINTING_RECOMPUTE = {"recompute_granularity": "full", "recompute_method": "uniform",
                                    "recompute_num_layers": 1}


def apply_gradient_checkpointing(cfg: HybridFlowConfig) -> None:
    """model.enable_gradient_checkpointing=true -> full recompute of every layer in that model's roles,
    where the role's override_transformer_config does not choose a recompute itself."""
    a = cfg.actor_rollout_ref
    for model, roles in ((a.model, (a.actor.megatron, a.ref.megatron)), (cfg.critic.model, (cfg.critic.megatron,))):
        if not model.enable_gradient_checkpointing:
            continue
        for m in roles:
            o = m.override_transformer_config
            if o.recompute_granularity is None and o.recompute_method is None and o.recompute_num_layers is None:
                for k, v in GRADIENT_CHECKPOINTING_RECOMPUTE.items():
                    setattr(o, k, v)


def needs_ref(cfg: HybridFlowConfig) -> bool:
    """The reference model is only run for a KL term (in the reward or in the loss)."""
    return cfg.algorithm.use_kl_in_reward or cfg.actor_rollout_ref.actor.use_kl_loss


def job_roles(cfg: HybridFlowConfig) -> list[str]:
    """The roles this job runs (hybridflow.trainer.placement.ROLES), actor_rollout first."""
    from hybridflow.algorithms import needs_critic

    critic = cfg.critic.enable if cfg.critic.enable is not None else needs_critic(cfg.algorithm.adv_estimator)
    return (["actor_rollout"] + (["ref"] if needs_ref(cfg) else []) + (["critic"] if critic else [])
            + (["reward_model"] if cfg.reward_model.enable else [])
            + (["rollout"] if "rollout" in (cfg.trainer.role_pools or {}) else []))


def placement_of(cfg: HybridFlowConfig):
    """The job's Placement (pools and role map); errors name the trainer key. Also what launch.plan plans."""
    from hybridflow.trainer import placement

    if cfg.trainer.placement == "split" and not cfg.trainer.resource_pools:
        log.warning("%s", placement.MIGRATION)
    try:
        return placement.resolve(cfg.trainer, job_roles(cfg))
    except placement.PlacementError as e:
        raise ValueError(str(e)) from None


def validate(cfg: HybridFlowConfig) -> None:
    """Cheap checks that name the key, before anything expensive starts."""
    from hybridflow.algorithms import get_adv_estimator, needs_critic
    from hybridflow.parallel.dims import GenerationDims, LayoutError, ModelShape

    a = cfg.actor_rollout_ref
    checks.trainer_keys(cfg.trainer)  # the world size below is made of them
    actor_hf = _hf_config("actor_rollout_ref.model.path", a.model.path, causal_lm=True)
    checks.tokenizer_dir("actor_rollout_ref.model.tokenizer_path" if a.model.tokenizer_path else
                         "actor_rollout_ref.model.path", a.model.tokenizer_path or a.model.path)
    checks.model_dtype("actor_rollout_ref.model.dtype", a.model.dtype)
    if not cfg.data.train_files:
        raise ValueError("data.train_files is empty")
    for f in cfg.data.train_files:
        if not os.path.isfile(f):
            raise FileNotFoundError(f"data.train_files: {f} does not exist")
    get_adv_estimator(cfg.algorithm.adv_estimator)
    _validate_loss_names(cfg)
    _validate_old_log_prob(cfg)
    _validate_rollout_correction(cfg)
    from hybridflow.rollout.base import ENGINES

    if a.rollout.name not in ENGINES:
        raise ValueError(f"actor_rollout_ref.rollout.name={a.rollout.name!r}; choose one of {', '.join(ENGINES)}")
    place = placement_of(cfg)
    apply_gradient_checkpointing(cfg)
    dims = _role_dims("actor_rollout_ref.actor.megatron", a.actor.megatron, place.world("actor_rollout"), actor_hf,
                      place.describe("actor_rollout"))
    try:
        if "rollout" in place.role_pools:  # a pool of its own: t_g against the model and that pool (async_checks)
            from hybridflow.resharding.cross_pool_plan import RolloutLayout

            if place.world("rollout") % a.rollout.tensor_model_parallel_size == 0:
                RolloutLayout(ranks=place.world("rollout"), tp=a.rollout.tensor_model_parallel_size).validate(
                    ModelShape.from_hf_config(actor_hf))
        else:
            GenerationDims(a.rollout.tensor_model_parallel_size).validate(dims, ModelShape.from_hf_config(actor_hf))
    except LayoutError as e:
        raise ValueError(f"actor_rollout_ref.rollout.tensor_model_parallel_size="
                         f"{a.rollout.tensor_model_parallel_size}: {e}") from None
    from hybridflow.config.server_mode_checks import validate_server_mode

    validate_server_mode(a.rollout)
    from hybridflow.config.async_checks import validate_async

    validate_async(cfg, place)
    from hybridflow.trainer.remax import validate_remax

    validate_remax(cfg)
    from hybridflow.config.moe_checks import validate_moe

    validate_moe(cfg, actor_hf, place.world("rollout" if "rollout" in place.role_pools else "actor_rollout"))
    _validate_ref(cfg, place, actor_hf)
    checks.counts(cfg, ("data.train_batch_size", "actor_rollout_ref.rollout.n", "actor_rollout_ref.actor.ppo_epochs",
                        *(f"actor_rollout_ref.{k}" for k in ("actor.ppo_mini_batch_size",
                                                              "actor.ppo_micro_batch_size_per_gpu",
                                                              "rollout.log_prob_micro_batch_size_per_gpu",
                                                              "ref.log_prob_micro_batch_size_per_gpu"))))
    rows = cfg.data.train_batch_size
    if rows % dims.dp:
        raise ValueError(f"data.train_batch_size={rows} is not divisible by the actor dp size {dims.dp}")
    checks.update_batches("actor_rollout_ref.actor", a.actor.ppo_mini_batch_size, a.actor.ppo_micro_batch_size_per_gpu,
                          a.rollout.n, dims.dp, rows, dynamic=a.actor.use_dynamic_bsz)
    checks.sampling(cfg)
    steps = cfg.trainer.total_training_steps
    checks.optim("actor_rollout_ref.actor.optim", a.actor.optim, steps)
    if cfg.critic.enable is None:
        cfg.critic.enable = needs_critic(cfg.algorithm.adv_estimator)
    if needs_critic(cfg.algorithm.adv_estimator) and not cfg.critic.enable:
        raise ValueError(f"algorithm.adv_estimator={cfg.algorithm.adv_estimator} needs a critic; critic.enable=False")
    if cfg.critic.enable and not cfg.critic.model.path:
        cfg.critic.model.path = a.model.path
    if cfg.critic.enable:
        c = cfg.critic
        critic_hf = _hf_config("critic.model.path", c.model.path)
        checks.model_dtype("critic.model.dtype", c.model.dtype)
        critic_dims = _role_dims("critic.megatron", c.megatron, place.world("critic"), critic_hf,
                                 place.describe("critic"))
        checks.counts(cfg, ("critic.ppo_mini_batch_size", "critic.ppo_micro_batch_size_per_gpu", "critic.ppo_epochs"))
        checks.update_batches("critic", c.ppo_mini_batch_size, c.ppo_micro_batch_size_per_gpu, a.rollout.n,
                              critic_dims.dp, rows, dynamic=c.use_dynamic_bsz)
        checks.optim("critic.optim", c.optim, steps)
    _validate_precision(cfg)  # after critic.enable is known
    checks.token_budgets(cfg)  # after critic.enable is known
    checks.resume(cfg)  # after critic.enable is known: a critic run needs the checkpoint's critic
    checks.dist_checkpoints(cfg)
    checks.reward_fn(cfg.custom_reward_function)
    from hybridflow.rewards.overlong import check as check_reward_manager

    check_reward_manager(cfg.reward_model, cfg.data.max_response_length)
    _validate_verl_shared_keys(cfg)
    if cfg.algorithm.adv_estimator in ("grpo", "rloo", "reinforce_plus_plus_baseline") and a.rollout.n < 2:
        raise ValueError(f"algorithm.adv_estimator={cfg.algorithm.adv_estimator} compares samples of a prompt: "
                         f"actor_rollout_ref.rollout.n must be >= 2 (got {a.rollout.n})")
    _validate_reward_model(cfg, place, actor_hf)
    _validate_validation(cfg)
    if cfg.trainer.ray.address is None:  # a local run: the workers see this machine, so check the TE choice here
        resolved_transformer_impls(cfg)
    _validate_fault(cfg)
    from hybridflow.trainer.timeline import check_timeline_keys

    check_timeline_keys(cfg.trainer)


def _validate_precision(cfg: HybridFlowConfig) -> dict[str, str]:
    """Every role's dtype for the driver's device (trainer.device, or CUDA if the driver sees it), refused with
    the key named where this code or this CPU cannot run it (hybridflow.precision.check_roles); logged once."""
    from hybridflow import precision

    device = cfg.trainer.device
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"trainer.device={device!r}; choose one of auto, cpu, cuda")
    if device == "auto":
        device = precision.local_device()
    roles = {"actor_rollout_ref.model.dtype": (cfg.actor_rollout_ref.model.dtype, True)}
    if cfg.critic.enable:
        roles["critic.model.dtype"] = (cfg.critic.model.dtype, True)
    if cfg.reward_model.enable:
        roles["reward_model.model.dtype"] = (cfg.reward_model.model.dtype, False)
    resolved = precision.check_roles(roles, device, force_slow_bf16=cfg.trainer.force_slow_bf16)
    emulated = [k for k, d in resolved.items() if d == "bfloat16" and device == "cpu" and not precision.cpu_bf16_flag()]
    if emulated:
        log.warning("%s: bf16 on a CPU without native bf16 (trainer.force_slow_bf16=true): a bf16 matmul measured "
                    "%.2fx the fp32 speed here", ", ".join(emulated), precision.measured_bf16_slowdown())
    log.info("precision: %s", ", ".join(f"{k.removesuffix('.model.dtype')} "
                                        f"{precision.why(roles[k][0], device)}" for k in resolved))
    return resolved


def _validate_fault(cfg: HybridFlowConfig) -> None:
    """trainer.max_restarts, trainer.fault.* and the reward sandbox's limits (docs/reliability.md)."""
    t, f, r = cfg.trainer, cfg.trainer.fault, cfg.custom_reward_function
    checks = [("trainer.max_restarts", t.max_restarts, t.max_restarts >= 0, ">= 0"),
              ("trainer.fault.detect_timeout_s", f.detect_timeout_s, f.detect_timeout_s > 0, "> 0"),
              ("trainer.fault.pg_timeout_s", f.pg_timeout_s, f.pg_timeout_s > 0, "> 0"),
              ("trainer.fault.max_nonfinite", f.max_nonfinite, f.max_nonfinite >= 0, ">= 0 (0: never abort)"),
              ("custom_reward_function.sandbox_timeout_s", r.sandbox_timeout_s, r.sandbox_timeout_s > 0, "> 0"),
              ("custom_reward_function.memory_mb", r.memory_mb, r.memory_mb >= 64, ">= 64")]
    for key, value, ok, need in checks:
        if not ok:
            raise ValueError(f"{key}={value} must be {need}")
    if t.max_restarts and t.save_freq <= 0:
        log.warning("trainer.max_restarts=%d with trainer.save_freq=%d: a restart has no checkpoint of this run "
                    "and starts over from step 0", t.max_restarts, t.save_freq)


def _validate_loss_names(cfg: HybridFlowConfig) -> None:
    """Loss aggregation and KL estimator names, against the lists the loss code itself uses."""
    from hybridflow.algorithms import LOSS_AGG_MODES, check_kl_kind, require_choice

    actor = cfg.actor_rollout_ref.actor
    require_choice("actor_rollout_ref.actor.loss_agg_mode", actor.loss_agg_mode, LOSS_AGG_MODES)
    require_choice("critic.loss_agg_mode", cfg.critic.loss_agg_mode, LOSS_AGG_MODES)
    # Checked even when unused (use_kl_loss / use_kl_in_reward off): a typo should not wait for the flag.
    check_kl_kind("actor_rollout_ref.actor.kl_loss_type", actor.kl_loss_type)
    check_kl_kind("algorithm.kl_penalty", cfg.algorithm.kl_penalty)
    for key, factor in (("actor_rollout_ref.actor.loss_scale_factor", actor.loss_scale_factor),
                        ("critic.loss_scale_factor", cfg.critic.loss_scale_factor)):
        if factor is not None and not factor > 0:
            raise ValueError(f"{key}={factor} must be > 0 (or null: the padded response length, as verl)")


def _validate_old_log_prob(cfg: HybridFlowConfig) -> None:
    """A skipped old-log-prob pass leaves the KL penalty in the reward only the rollout's log-probs to read."""
    a = cfg.actor_rollout_ref
    if (str(a.recompute_old_log_prob).lower() in ("false", "0") and cfg.algorithm.use_kl_in_reward
            and not a.rollout.calculate_log_probs):
        raise ValueError("actor_rollout_ref.recompute_old_log_prob=false with algorithm.use_kl_in_reward=true needs "
                         "the rollout's log-probs: set actor_rollout_ref.rollout.calculate_log_probs=true, or "
                         "recompute_old_log_prob=auto")


def _validate_rollout_correction(cfg: HybridFlowConfig) -> None:
    """algorithm.rollout_correction (hybridflow/algorithms/rollout_correction.py): names, the cap, and the
    log-probs it reads. Checked even while off, so a typo does not wait for the switch."""
    from hybridflow.algorithms import require_choice
    from hybridflow.algorithms.rollout_correction import ROLLOUT_IS_LEVELS

    rc, a, key = cfg.algorithm.rollout_correction, cfg.actor_rollout_ref, "algorithm.rollout_correction"
    if rc.rollout_is is not None:
        require_choice(f"{key}.rollout_is", rc.rollout_is, ROLLOUT_IS_LEVELS)
    t = rc.rollout_is_threshold
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or not t > 1:
        raise ValueError(f"{key}.rollout_is_threshold={t!r} must be a finite number > 1 (the cap on pi_old / "
                         "pi_rollout; 1 or less would scale down even on-policy tokens); verl's default is 2.0")
    if rc.rollout_is is None and not rc.bypass_mode:
        return
    if not a.rollout.calculate_log_probs:
        on = f"{key}.rollout_is={rc.rollout_is}" if rc.rollout_is is not None else f"{key}.bypass_mode=true"
        raise ValueError(f"{on} reads the rollout's log-probs, but actor_rollout_ref.rollout.calculate_log_probs=false "
                         "leaves none: set it to true")
    recompute = str(a.recompute_old_log_prob).lower()
    if rc.bypass_mode and rc.rollout_is is not None:
        raise ValueError(f"{key}.bypass_mode=true with {key}.rollout_is={rc.rollout_is}: in bypass mode the PPO ratio "
                         "pi_theta / pi_rollout is already the importance ratio, and a weight on top would count it "
                         f"twice (verl's loss_type=ppo_clip applies none): set {key}.rollout_is=null, or "
                         "bypass_mode=false for truncated IS weights against a recomputed pi_old")
    if rc.bypass_mode and recompute in ("true", "1"):
        raise ValueError(f"{key}.bypass_mode=true uses the rollout's log-probs as old_log_prob, which "
                         "actor_rollout_ref.recompute_old_log_prob=true asks to recompute: set it to auto")
    if rc.rollout_is is not None and recompute in ("false", "0"):
        raise ValueError(f"{key}.rollout_is={rc.rollout_is} weighs by pi_old / pi_rollout, which needs the recomputed "
                         "pi_old that actor_rollout_ref.recompute_old_log_prob=false skips: set it to auto, or use "
                         f"{key}.bypass_mode=true with rollout_is=null")


def _validate_verl_shared_keys(cfg: HybridFlowConfig) -> None:
    """Keys shared with verl whose values need a check here (after critic.enable is resolved): the rollout's
    memory, data.truncation, trainer.critic_warmup, and context parallelism (not supported yet)."""
    import torch

    from hybridflow.data.rl_dataset import TRUNCATIONS
    from hybridflow.rollout.vllm_launch import engine_memory_kwargs

    r = cfg.actor_rollout_ref.rollout
    on_gpu = torch.cuda.is_available()  # the driver's view, as for perf/mfu's device peak
    _, note = engine_memory_kwargs(r.gpu_memory_utilization, r.kv_cache_memory_bytes, on_gpu)  # raises if bad
    if note and r.name == "vllm":
        log.info("%s", note)  # here, once: the workers' own info lines do not reach the driver's console
    offloads = [f"{role}.megatron.{flag}" for role, m in (("actor_rollout_ref.actor", cfg.actor_rollout_ref.actor),
                                                          ("actor_rollout_ref.ref", cfg.actor_rollout_ref.ref),
                                                          ("critic", cfg.critic), ("reward_model", cfg.reward_model))
                for flag in ("param_offload", "grad_offload", "optimizer_offload") if getattr(m.megatron, flag)]
    if offloads and not on_gpu:
        log.info("%s: no CUDA, the models already live in host memory, so offload moves nothing (a no-op on CPU)",
                 ", ".join(offloads))
    from hybridflow.config.megatron_checks import log_cuda_only

    log_cuda_only(cfg, on_gpu)  # Megatron fields that need CUDA: one line naming them, where there is none
    if cfg.data.truncation not in TRUNCATIONS:
        raise ValueError(f"data.truncation={cfg.data.truncation!r}; choose one of {', '.join(TRUNCATIONS)}")
    warmup = cfg.trainer.critic_warmup
    if warmup < 0:
        raise ValueError(f"trainer.critic_warmup={warmup} must be >= 0")
    if warmup > 1 and not cfg.critic.enable:
        raise ValueError(f"trainer.critic_warmup={warmup} holds the actor back for the first {warmup - 1} steps "
                         f"to train the critic, but there is no critic (algorithm.adv_estimator="
                         f"{cfg.algorithm.adv_estimator}, critic.enable=false): those steps would train nothing; "
                         "set trainer.critic_warmup=0")
    roles = {"actor_rollout_ref.actor": cfg.actor_rollout_ref.actor.megatron}
    if needs_ref(cfg):
        roles["actor_rollout_ref.ref"] = cfg.actor_rollout_ref.ref.megatron
    if cfg.critic.enable:
        roles["critic"] = cfg.critic.megatron
    if cfg.reward_model.enable:
        roles["reward_model"] = cfg.reward_model.megatron
    for role, m in roles.items():
        if m.context_parallel_size != 1:
            raise ValueError(f"{role}.megatron.context_parallel_size={m.context_parallel_size}: context parallelism "
                             "needs Transformer Engine's attention on GPU (its ring attention over the sequence "
                             "shards), which this stack does not wire up; set it to 1 and cut activation memory "
                             f"with {role}.megatron.sequence_parallel=true, "
                             f"{role}.megatron.override_transformer_config.recompute_granularity=full, or smaller "
                             "micro-batches")


def _validate_validation(cfg: HybridFlowConfig) -> None:
    """data.val_files, data.val_batch_size, trainer.test_freq / val_before_train and rollout.val_kwargs."""
    d, t, vk = cfg.data, cfg.trainer, cfg.actor_rollout_ref.rollout.val_kwargs
    for f in d.val_files:
        if not os.path.isfile(f):
            raise FileNotFoundError(f"data.val_files: {f} does not exist")
    if wants_validation(cfg) and not d.val_files:
        asked = "trainer.val_before_train=true" if t.val_before_train else f"trainer.test_freq={t.test_freq}"
        raise ValueError(f"{asked} validates on data.val_files, which is empty (set data.val_files=[...], "
                         "or trainer.val_before_train=false trainer.test_freq=-1)")
    if d.val_files and not wants_validation(cfg):
        log.warning("data.val_files is set but no validation is scheduled (trainer.val_before_train=false, "
                    "trainer.test_freq=%d): it is not read", t.test_freq)
    if d.val_batch_size is not None and d.val_batch_size < 1:
        raise ValueError(f"data.val_batch_size={d.val_batch_size} must be >= 1 (or null: the whole val set at once)")
    key = "actor_rollout_ref.rollout.val_kwargs"
    if vk.n < 1:
        raise ValueError(f"{key}.n={vk.n} must be >= 1")
    if vk.temperature < 0:
        raise ValueError(f"{key}.temperature={vk.temperature} must be >= 0")
    if not 0 < vk.top_p <= 1:
        raise ValueError(f"{key}.top_p={vk.top_p} must be in (0, 1]")
    if vk.do_sample and vk.temperature == 0:
        # vLLM treats temperature 0 as greedy: the run would say "sampled" and validate greedily.
        raise ValueError(f"{key}.do_sample=true samples at {key}.temperature, which is 0 (greedy); "
                         f"set {key}.temperature > 0 or {key}.do_sample=false")
    if not vk.do_sample and vk.n > 1:
        log.warning("%s.do_sample=false with n=%d: greedy gives %d identical samples per prompt", key, vk.n, vk.n)


def _validate_ref(cfg: HybridFlowConfig, place, actor_hf: dict) -> None:
    """On the actor's pool the ref runs in the actor's processes and Megatron groups (same tp/pp/cp); on a pool
    of its own it only has to fit that pool. Without a KL term there is no ref to place."""
    a = cfg.actor_rollout_ref
    if "ref" not in place.role_pools:
        return
    if not place.shares_actor_pool("ref"):
        _role_dims("actor_rollout_ref.ref.megatron", a.ref.megatron, place.world("ref"), actor_hf,
                   place.describe("ref"))
        return
    layout = lambda m: (m.tensor_model_parallel_size, m.pipeline_model_parallel_size,
                        m.virtual_pipeline_model_parallel_size or 1, m.context_parallel_size)
    if layout(a.ref.megatron) != layout(a.actor.megatron):
        raise ValueError(f"the ref shares the actor's {place.describe('ref')} and runs in the actor's processes, "
                         f"so actor_rollout_ref.ref.megatron (tp, pp, vpp, cp)={layout(a.ref.megatron)} must equal "
                         f"actor_rollout_ref.actor.megatron's {layout(a.actor.megatron)} "
                         "(or give the ref a pool of its own: trainer.placement=standalone, or trainer.role_pools.ref)")


def _validate_reward_model(cfg: HybridFlowConfig, place, actor_hf: dict) -> None:
    from hybridflow.rewards.manager import REWARD_MODES

    rm = cfg.reward_model
    if not rm.enable:
        return
    if rm.reward_mode not in REWARD_MODES:
        raise ValueError(f"reward_model.reward_mode={rm.reward_mode!r}; choose one of {', '.join(REWARD_MODES)}")
    try:
        rm_hf = _hf_config("reward_model.model.path", rm.model.path)
    except FileNotFoundError as e:
        hint = "python -m hybridflow.models.tiny --reward-model --out DIR writes a tiny one"
        raise FileNotFoundError(f"{e} (reward_model.enable=true needs an HF reward model directory; {hint})") from None
    checks.model_dtype("reward_model.model.dtype", rm.model.dtype)
    _role_dims("reward_model.megatron", rm.megatron, place.world("reward_model"), rm_hf,
               place.describe("reward_model"))
    # The reward model reads the policy's token ids as they are: it must know every id the policy can emit.
    if rm_hf.get("vocab_size", 0) < actor_hf.get("vocab_size", 0):
        raise ValueError(f"reward_model.model.path: vocab_size {rm_hf.get('vocab_size')} is smaller than the "
                         f"actor's {actor_hf.get('vocab_size')}; the reward model must use the policy's tokenizer")
    if rm.micro_batch_size_per_gpu < 1:
        raise ValueError(f"reward_model.micro_batch_size_per_gpu={rm.micro_batch_size_per_gpu} must be >= 1")


def validate_cluster(cfg: HybridFlowConfig, connect_timeout_s: float = 10.0) -> None:
    """Without trainer.ray.address the trainer starts a one-machine cluster, which cannot hold several nodes; with a
    host:port one, something must answer there (within connect_timeout_s)."""
    address = cfg.trainer.ray.address
    if not address and cfg.trainer.nnodes > 1:
        raise ValueError(f"trainer.nnodes={cfg.trainer.nnodes} needs a multi-node Ray cluster: set "
                         "trainer.ray.address (auto, or host:port) or trainer.nnodes=1")
    if address and address != "auto" and "://" not in address:
        _gcs_answers(address, connect_timeout_s)


def _gcs_answers(address: str, timeout_s: float) -> None:
    """A TCP connect to the cluster's GCS port. Why: ray.init retries a GCS that is not there for many minutes
    (measured: over 10 on Ray 2.60, a port nothing listened on), and trainer.ray.timeout_s does not bound it."""
    from hybridflow.ports import connect_within, split_address

    try:
        host, port = split_address(address)
    except ValueError:
        raise ValueError(f"trainer.ray.address={address!r}: expected auto or host:port (the head's GCS, as "
                         "`ray start --head` prints it)") from None
    error = connect_within(host.strip("[]"), port, timeout_s, refused_s=0.0)  # [::1]:6379 too
    if error is not None:
        raise ValueError(f"trainer.ray.address={address!r}: nothing answers at {host}:{port} ({error}); start the "
                         "cluster (`ray start --head`) or fix the address")
