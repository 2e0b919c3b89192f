"""A HybridFlow config, read into what the planner needs: roles with their model shape and layout, the batch.

Every check here happens before any number is computed and names the config key: a layout needing more GPUs
than trainer.nnodes * n_gpus_per_node, a TP/PP size that does not divide heads, KV groups or layers (through
ParallelDims.validate / GenerationDims.validate, the same checks the trainer runs), an unknown model. It does
not call hybridflow.trainer.main.validate, which needs the model weights and data files on disk.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from hybridflow.config.schema import HybridFlowConfig, MegatronConfig
from hybridflow.parallel.dims import GenerationDims, LayoutError, ParallelDims
from launch.plan.devices import Device, get_device
from launch.plan.lengths import Lengths, from_rollout_dir, from_stats
from launch.plan.memory import KERNEL_PROFILES, LOCAL_PROFILES, RECOMPUTE_MODES, dtype_key
from launch.plan.shapes import Shape, resolve_shape

DEFAULT_GPU = "h100"  # for a config that names no plan.gpu, planned without --gpu
PACKINGS = ("trim", "packed", "pad")
TRAIN_BACKENDS = ("megatron", "fsdp")


class PlanInputError(ValueError):
    """Bad planner input, found before anything is computed; the message names the key or flag."""


@dataclass(frozen=True)
class Options:
    """Planner-side knobs; kernels picks the activation profile. recompute and vpp left at their defaults
    take the actor's config (override_transformer_config.recompute_granularity, or
    model.enable_gradient_checkpointing; virtual_pipeline_model_parallel_size): see options_from_config."""

    gpu: str | None = None  # None: the config's plan.gpu, else DEFAULT_GPU
    recompute: str = "none"  # none | selective | full (Megatron's recompute_granularity; full = uniform, 1 layer)
    vpp: int = 1  # virtual pipeline chunks per stage (interleaved 1F1B)
    kernels: str = "te"  # te (GPU, Transformer Engine spec) | local (megatron-core local spec) | local_unfused
    dtype: str | None = None  # None: actor_rollout_ref.model.dtype, and bf16 for "auto" (a GPU plan)
    internode_gbps_per_node: float | None = None  # replaces the device table's network (e.g. the paper's testbed)
    max_num_seqs: int = 256  # vLLM's default concurrent sequences per engine (EngineArgs.max_num_seqs)
    # Real runs stop at EOS: the response-length distribution (launch/plan/lengths.py). None: every response at
    # rollout.response_length. A rollout_data_dir (a run's jsonl samples) gives a histogram and the prompt mean.
    response_length_mean: float | None = None
    response_length_p99: float | None = None
    rollout_data_dir: str | None = None
    prompt_length_mean: float | None = None  # None: data.max_prompt_length (or the rollout_data_dir mean)
    # How training/log-prob micro-batches are laid out: "trim" (ours: each micro-batch padded to its longest row),
    # "packed" (remove-padding / THD packing: real tokens only; verl's use_remove_padding, NeMo-RL's packing),
    # "pad" (every row at the full budget).
    packing: str = "trim"
    # Megatron DDP's overlap_grad_reduce/overlap_param_gather: the DP gradient sync hides behind the backward. Our
    # DDP runs without it (megatron_workers/optimizer.py); a planning what-if for other trainers (the paper's).
    overlap_grad_reduce: bool = False
    # Which trainer's training and forward passes to plan: "megatron" (ours: the TP/PP/DP terms below, each apart) or
    # "fsdp" (a planning what-if for FSDP trainers, e.g. verl's example scripts: every rank holds a data-parallel
    # shard, and one measured FSDP efficiency covers the math and FSDP's own gathers and reduce-scatters).
    train_backend: str = "megatron"


@dataclass(frozen=True)
class Role:
    name: str  # actor | ref | critic | reward_model
    key: str  # its config prefix, for messages
    shape: Shape
    dims: ParallelDims
    trainable: bool
    scalar_head: bool
    dist_opt: bool
    offload: dict[str, bool]  # params / grads / optimizer -> offloaded while the role is idle
    offload_keys: dict[str, str]
    micro_batch: int  # sequences per training micro-batch (trainable roles)
    fwd_micro_batch: int  # sequences per forward-only micro-batch
    mini_batch: int  # prompts per optimizer step
    epochs: int
    pool: str
    # Megatron's optimizer CPU offload (optim.override_optimizer_config.optimizer_cpu_offload with
    # optimizer_offload_fraction f): this share of the optimizer state stays on the GPU, the rest lives in host memory
    optimizer_on_gpu: float = 1.0


@dataclass(frozen=True)
class Job:
    roles: dict[str, Role]
    t_g: int
    n: int
    prompts: int
    prompt_len: int
    response_len: int
    kv_cache_bytes: int
    bucket_bytes: int
    nnodes: int
    gpus_per_node: int
    placement: str
    dtype: str
    device: Device
    options: Options
    old_log_prob_pass: bool
    algorithm: str
    lengths: Lengths
    prompt_mean: float
    notes: list[str] = field(default_factory=list)
    # The async layout (trainer.resource_pools with an actor pool and trainer.role_pools.rollout): the rollout pool,
    # every pool's processes per node, async_training.mode and trigger_parameter_sync_step. None/empty: the presets.
    rollout_pool: str | None = None
    pool_procs: dict[str, tuple[int, ...]] = field(default_factory=dict)
    async_mode: str = "sync"
    sync_every: int = 1
    staleness: float = 0.0  # async_training.staleness_threshold (fully_async)

    @property
    def world(self) -> int:
        """GPUs of the actor's pool (the training layout's world)."""
        if self.pool_procs:
            return sum(self.pool_procs[self.roles["actor"].pool])
        return self.nnodes * self.gpus_per_node

    @property
    def rollout_world(self) -> int:
        """GPUs that generate: the rollout pool's, or the actor's (the rollout in the actor's processes)."""
        return sum(self.pool_procs[self.rollout_pool]) if self.rollout_pool else self.world

    @property
    def pools(self) -> list[str]:
        return sorted({r.pool for r in self.roles.values()} | ({self.rollout_pool} if self.rollout_pool else set()))

    @property
    def total_gpus(self) -> int:
        if self.pool_procs:
            return sum(sum(self.pool_procs[p]) for p in self.pools)
        return self.world * len(self.pools)  # the presets: every pool nnodes x n_gpus_per_node

    @property
    def sequences(self) -> int:
        return self.prompts * self.n

    @property
    def seq_len(self) -> int:
        """The budget: what memory is planned for (a micro-batch of full-length rows can happen)."""
        return self.prompt_len + self.response_len

    @property
    def mean_tokens(self) -> float:
        """Real prompt + response tokens of one sample (what verl's perf/total_num_tokens counts)."""
        return self.prompt_mean + self.lengths.sample_mean()

    def compute_seq_len(self, micro_rows: int) -> float:
        """Tokens per row that a micro-batch of `micro_rows` rows computes on (Options.packing)."""
        if self.options.packing == "packed":
            return self.mean_tokens
        if self.options.packing == "pad":
            return float(self.seq_len)
        return min(float(self.seq_len), self.prompt_mean + self.lengths.expected_max(max(1, micro_rows)))


def _dims(key: str, m: MegatronConfig, world: int, shape: Shape) -> ParallelDims:
    tp, pp, cp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size, m.context_parallel_size
    if min(tp, pp, cp) < 1:
        raise PlanInputError(f"{key}: tp, pp, cp = {tp}, {pp}, {cp} must all be >= 1")
    if tp * pp * cp > world:
        raise PlanInputError(f"{key}: tp*pp*cp = {tp}*{pp}*{cp} = {tp * pp * cp} GPUs, more than "
                             f"trainer.nnodes*n_gpus_per_node = {world}")
    if world % (tp * pp * cp):
        raise PlanInputError(f"{key}: tp*pp*cp = {tp * pp * cp} does not divide trainer.nnodes*n_gpus_per_node "
                             f"= {world}")
    if m.sequence_parallel is None:  # null: the trainer's rule (preflight resolves it the same way)
        from hybridflow.parallel.dims import default_sequence_parallel

        m = replace(m, sequence_parallel=default_sequence_parallel(tp, shape.model_shape))
    try:
        return ParallelDims.from_megatron_config(m, world).validate(world, shape.model_shape)
    except LayoutError as e:
        raise PlanInputError(f"{key}: {e} (model {shape.name})") from None


def _offload(key: str, m: MegatronConfig) -> tuple[dict, dict]:
    flags = {"params": m.param_offload, "grads": m.grad_offload, "optimizer": m.optimizer_offload}
    keys = {"params": f"{key}.param_offload", "grads": f"{key}.grad_offload",
            "optimizer": f"{key}.optimizer_offload"}
    return flags, keys


def kv_cache_bytes(rollout, shape: Shape, dtype: str, device: Device) -> int:
    """vLLM's KV cache per GPU: rollout.kv_cache_memory_bytes when set; otherwise what gpu_memory_utilization of
    the device leaves after vLLM's weights and runtime (vLLM's own sizing on GPU: hybridflow.rollout.vllm_launch)."""
    from launch.plan import memory as M

    if rollout.kv_cache_memory_bytes is not None:
        return int(rollout.kv_cache_memory_bytes)
    util = rollout.gpu_memory_utilization
    if not 0 < util <= 1:
        raise PlanInputError(f"actor_rollout_ref.rollout.gpu_memory_utilization={util} must be in (0, 1]")
    weights = M.total_params(shape) * M.BYTES_PER_PARAM[dtype]["param"] / rollout.tensor_model_parallel_size
    kv = util * device.memory_bytes - weights - M.OVERHEADS["vllm_runtime"][0]
    if kv <= 0:
        raise PlanInputError(f"actor_rollout_ref.rollout.gpu_memory_utilization={util} leaves no KV cache: "
                             f"{util * device.memory_bytes / M.GiB:.1f} GiB for vLLM, its weights take "
                             f"{weights / M.GiB:.1f} GiB at tp={rollout.tensor_model_parallel_size}")
    return int(kv)


def optimizer_on_gpu(optim) -> float:
    """The share of a role's optimizer state its GPU holds: 1 - optimizer_offload_fraction with Megatron's optimizer
    CPU offload on (optim.override_optimizer_config), 1 otherwise."""
    other = optim.override_optimizer_config.other
    if not other.get("optimizer_cpu_offload"):
        return 1.0
    fraction = float(other.get("optimizer_offload_fraction", 0.0))
    if not 0.0 <= fraction <= 1.0:
        raise PlanInputError(f"optim.override_optimizer_config.optimizer_offload_fraction={fraction} must be in [0, 1]")
    return 1.0 - fraction


def options_from_config(cfg: HybridFlowConfig, options: Options) -> Options:
    """The actor's recompute and VPP from the config where the flags are at their defaults (flags win), and on
    the local spec the attention the config picks (`--kernels local` with attention_backend=unfused plans the
    unfused attention's s^2 tensors); vLLM's max_num_seqs from actor_rollout_ref.rollout.max_num_seqs.

    The planner models full recompute as megatron's uniform method with 1 layer per checkpoint."""

    a = cfg.actor_rollout_ref
    m = a.actor.megatron
    granularity = m.override_transformer_config.recompute_granularity
    if granularity is None and a.model.enable_gradient_checkpointing:
        granularity = "full"  # what hybridflow.trainer.main.apply_gradient_checkpointing sets
    if options.recompute == "none" and granularity is not None:
        options = replace(options, recompute=granularity)
    if options.vpp == 1 and (m.virtual_pipeline_model_parallel_size or 1) > 1:
        options = replace(options, vpp=m.virtual_pipeline_model_parallel_size)
    if options.kernels == "local":
        options = replace(options, kernels=LOCAL_PROFILES.get(m.override_transformer_config.attention_backend,
                                                              "local"))
    if options.max_num_seqs == Options.max_num_seqs and a.rollout.max_num_seqs:
        options = replace(options, max_num_seqs=a.rollout.max_num_seqs)
    return options


def read_job(cfg: HybridFlowConfig, options: Options) -> Job:
    from hybridflow.algorithms.advantages import needs_critic
    from hybridflow.trainer.main import needs_ref
    from hybridflow.trainer.ppo_trainer import skips_old_log_prob

    options = options_from_config(cfg, options)
    if options.recompute not in RECOMPUTE_MODES:
        raise PlanInputError(f"--recompute {options.recompute!r}; choose one of {', '.join(RECOMPUTE_MODES)}")
    if options.kernels not in KERNEL_PROFILES:
        raise PlanInputError(f"--kernels {options.kernels!r}; choose one of {', '.join(KERNEL_PROFILES)}")
    if options.vpp < 1:
        raise PlanInputError(f"--virtual-pipeline {options.vpp} must be >= 1")
    gpu, source = ((options.gpu, "--gpu") if options.gpu else (cfg.plan.gpu, "plan.gpu") if cfg.plan.gpu
                   else (DEFAULT_GPU, "--gpu"))
    try:
        device = get_device(gpu, options.internode_gbps_per_node, cfg.trainer.n_gpus_per_node, source)
    except ValueError as e:
        raise PlanInputError(str(e)) from None
    a, t = cfg.actor_rollout_ref, cfg.trainer
    if t.nnodes < 1 or t.n_gpus_per_node < 1:
        raise PlanInputError(f"trainer.nnodes={t.nnodes} and trainer.n_gpus_per_node={t.n_gpus_per_node} must be >= 1")
    world = t.nnodes * t.n_gpus_per_node
    dtype_name = options.dtype or (a.model.dtype if a.model.dtype != "auto" else "bf16")
    try:
        dtype = dtype_key(dtype_name)
    except ValueError as e:
        raise PlanInputError(f"actor_rollout_ref.model.dtype / --dtype: {e}") from None
    from hybridflow.trainer import placement as P
    from hybridflow.trainer.main import job_roles

    if t.resource_pools and "rollout" not in (t.role_pools or {}):
        raise PlanInputError(PRESETS_ONLY)
    try:  # the trainer's own role -> pool map, so the planner and the job place roles alike
        place = P.resolve(t, job_roles(cfg))
    except P.PlacementError as e:
        raise PlanInputError(str(e)) from None
    rollout_pool = _async_layout(cfg, place)
    if rollout_pool:
        world = place.world("actor_rollout")
    pool = place.role_pools.get
    own_ref = not place.shares_actor_pool("ref")  # the ref on a pool of its own, with its own mesh
    actor_shape = resolve_shape("actor_rollout_ref.model.path", a.model.path)
    key = "actor_rollout_ref.actor.megatron"
    actor_dims = _dims(key, a.actor.megatron, world, actor_shape)
    t_g = a.rollout.tensor_model_parallel_size
    if rollout_pool and (t_g > place.world("rollout") or place.world("rollout") % t_g):
        raise PlanInputError(f"actor_rollout_ref.rollout.tensor_model_parallel_size={t_g} does not divide the rollout "
                             f"pool's {place.world('rollout')} GPUs ({place.describe('rollout')})")
    if not rollout_pool and t_g > world:
        raise PlanInputError(f"actor_rollout_ref.rollout.tensor_model_parallel_size={t_g} needs more GPUs than "
                             f"trainer.nnodes*n_gpus_per_node = {world}")
    try:
        GenerationDims(a.rollout.tensor_model_parallel_size).validate(actor_dims, actor_shape.model_shape)
    except LayoutError as e:
        raise PlanInputError(f"actor_rollout_ref.rollout.tensor_model_parallel_size: {e}") from None
    rows = cfg.data.train_batch_size
    if rows % actor_dims.dp or rows % a.actor.ppo_mini_batch_size:
        raise PlanInputError(f"data.train_batch_size={rows} must be divisible by the actor dp size {actor_dims.dp} "
                             f"and by actor_rollout_ref.actor.ppo_mini_batch_size={a.actor.ppo_mini_batch_size}")
    roles: dict[str, Role] = {}
    off, off_keys = _offload(key, a.actor.megatron)
    roles["actor"] = Role("actor", "actor_rollout_ref.actor", actor_shape, actor_dims, True, False,
                          a.actor.megatron.use_distributed_optimizer, off, off_keys,
                          a.actor.ppo_micro_batch_size_per_gpu,
                          a.rollout.log_prob_micro_batch_size_per_gpu, a.actor.ppo_mini_batch_size, a.actor.ppo_epochs,
                          pool("actor_rollout"), optimizer_on_gpu(a.actor.optim))
    if needs_ref(cfg):
        ref_m = a.ref.megatron if own_ref else a.actor.megatron  # on the actor's pool, the ref shares its mesh
        rkey = "actor_rollout_ref.ref.megatron"
        off, off_keys = _offload(rkey, a.ref.megatron)
        roles["ref"] = Role("ref", "actor_rollout_ref.ref", actor_shape, _dims(rkey, ref_m, world, actor_shape),
                            False, False, False, off, off_keys, 0, a.ref.log_prob_micro_batch_size_per_gpu, 0, 0,
                            pool("ref"))
    critic_on = cfg.critic.enable if cfg.critic.enable is not None else needs_critic(cfg.algorithm.adv_estimator)
    if critic_on:
        c = cfg.critic
        shape = resolve_shape("critic.model.path", c.model.path) if c.model.path else actor_shape
        off, off_keys = _offload("critic.megatron", c.megatron)
        roles["critic"] = Role("critic", "critic", shape, _dims("critic.megatron", c.megatron, world, shape), True,
                               True, c.megatron.use_distributed_optimizer, off, off_keys,
                               c.ppo_micro_batch_size_per_gpu,
                               c.ppo_micro_batch_size_per_gpu, c.ppo_mini_batch_size, c.ppo_epochs,
                               pool("critic"), optimizer_on_gpu(c.optim))
    if cfg.reward_model.enable:
        rm = cfg.reward_model
        shape = resolve_shape("reward_model.model.path", rm.model.path)
        off, off_keys = _offload("reward_model.megatron", rm.megatron)
        roles["reward_model"] = Role("reward_model", "reward_model", shape,
                                     _dims("reward_model.megatron", rm.megatron, world, shape), False, True, False, off,
                                     off_keys, 0, rm.micro_batch_size_per_gpu, 0, 0,
                                     pool("reward_model"))
    if options.packing not in PACKINGS:
        raise PlanInputError(f"--packing {options.packing!r}; choose one of {', '.join(PACKINGS)}")
    if options.train_backend not in TRAIN_BACKENDS:
        raise PlanInputError(f"--train-backend {options.train_backend!r}; choose one of {', '.join(TRAIN_BACKENDS)}")
    budget = a.rollout.response_length
    try:
        if options.rollout_data_dir:
            lengths, prompt_mean = from_rollout_dir(budget, options.rollout_data_dir)
        else:
            lengths = from_stats(budget, options.response_length_mean, options.response_length_p99)
            prompt_mean = float(cfg.data.max_prompt_length)
    except ValueError as e:
        raise PlanInputError(str(e)) from None
    if options.prompt_length_mean is not None:
        if not 0 < options.prompt_length_mean <= cfg.data.max_prompt_length:
            raise PlanInputError(f"--prompt-length-mean {options.prompt_length_mean:g} must be in "
                                 f"(0, data.max_prompt_length={cfg.data.max_prompt_length}]")
        prompt_mean = float(options.prompt_length_mean)
    return Job(roles=roles, t_g=a.rollout.tensor_model_parallel_size, n=a.rollout.n, prompts=rows,
               prompt_len=cfg.data.max_prompt_length, response_len=a.rollout.response_length,
               kv_cache_bytes=kv_cache_bytes(a.rollout, actor_shape, dtype, device),
               bucket_bytes=a.rollout.reshard_bucket_bytes,
               nnodes=t.nnodes, gpus_per_node=t.n_gpus_per_node, placement=t.placement, dtype=dtype, device=device,
               options=options, old_log_prob_pass=not skips_old_log_prob(cfg), algorithm=cfg.algorithm.adv_estimator,
               lengths=lengths, prompt_mean=prompt_mean, rollout_pool=rollout_pool,
               pool_procs=dict(place.pools) if rollout_pool else {}, async_mode=cfg.async_training.mode,
               sync_every=cfg.async_training.trigger_parameter_sync_step,
               staleness=cfg.async_training.staleness_threshold)


PRESETS_ONLY = ("trainer.resource_pools: the planner models the presets (trainer.placement=colocate | split | "
                "standalone, every pool nnodes x n_gpus_per_node) and the async layout (an actor pool for every "
                "training role and a rollout pool: trainer.role_pools.rollout), not other pools yet")


def _async_layout(cfg: HybridFlowConfig, place) -> str | None:
    """The rollout pool of the async layout (None for the presets), after the checks the planner needs: two pools,
    every training role on the actor's, async_training.mode one the planner models."""
    from launch.plan.async_step import MODES

    a = cfg.async_training
    if a.mode not in MODES:
        raise PlanInputError(f"async_training.mode={a.mode!r}: the planner models {', '.join(MODES)}")
    if a.trigger_parameter_sync_step < 1:
        raise PlanInputError(f"async_training.trigger_parameter_sync_step={a.trigger_parameter_sync_step} must be >= 1")
    if not cfg.trainer.resource_pools:
        if a.mode != "sync":
            raise PlanInputError(f"async_training.mode={a.mode} needs the rollout on a pool of its own "
                                 "(trainer.resource_pools and trainer.role_pools.rollout)")
        return None
    actor_pool, rollout_pool = place.pool_of("actor_rollout"), place.pool_of("rollout")
    if rollout_pool == actor_pool:
        raise PlanInputError(f"trainer.role_pools.rollout={rollout_pool!r} is the actor's pool: a rollout pool must "
                             "be a pool of its own")
    others = {r: p for r, p in place.role_pools.items() if r != "rollout" and p != actor_pool}
    if others or len(place.pools) != 2:
        raise PlanInputError(PRESETS_ONLY + f"; got {place.summary()}")
    if resolve_shape("actor_rollout_ref.model.path", cfg.actor_rollout_ref.model.path).is_moe:
        raise PlanInputError("trainer.role_pools.rollout with an MoE actor: the cross-pool weight sync does not plan "
                             "routed experts (the trainer refuses it too)")
    return rollout_pool
