"""verl keys that are not in our schema: what happens to each when a pasted verl config uses it.

`hybridflow.config.load` consults `classify` for every key the schema does not know, before it reports
an unknown key. A rule either
  - IGNORES the key (it is dropped from its layer and logged once with the reason): it only concerns a
    backend or mode we do not have, or asks for what we do anyway, so dropping it changes nothing; or
  - REFUSES it, with what to use instead: a verl name we spell differently, a value whose meaning differs
    here, or a feature that is not supported yet (and what to do meanwhile).
Some rules depend on the value: `actor_rollout_ref.actor.strategy=megatron` is what we do (ignored), any
other strategy is refused. A rule may also name a key of our schema with `keep_values`: verl's values we have
are accepted, the others (a verl feature we do not have, e.g. `actor_rollout_ref.rollout.name=sglang`) are
refused at load with what to write instead, so a pasted script shows them with its other refused keys.
Megatron's own fields under `override_transformer_config` / `override_optimizer_config` are checked by
hybridflow/config/megatron_checks.py.

Keys that exist in both schemas with the same meaning are not listed here: they are ours
(hybridflow/config/schema.py). The two tables of docs/verl.md ("Coming from verl") are generated from RULES
and DIFFERENCES (`python -m hybridflow.config.verl_scripts --write` rewrites them there), and a test keeps the
page equal to them.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

IGNORED, REFUSED = "ignored", "refused"
NOT_YET = "not supported yet"


@dataclass(frozen=True)
class Rule:
    pattern: str  # a dotted key; fnmatch wildcards (`*` also crosses dots) for families of keys
    kind: str  # IGNORED or REFUSED (for values outside `ignore_values`)
    reason: str
    use: str = ""  # REFUSED: what to set instead (keys of our schema where there is one)
    # With a value rule: IGNORED for these values (compared as lower-case strings), REFUSED otherwise.
    ignore_values: tuple[str, ...] = ()
    # A key of our schema: accepted for these values (lower-case strings), REFUSED for any other.
    keep_values: tuple[str, ...] = ()


@dataclass(frozen=True)
class Verdict:
    key: str
    kind: str
    message: str


_MICRO = "verl's deprecated global micro-batch (verl divides it by the data-parallel size)"
_VLLM_ARGS = ("actor_rollout_ref.rollout.enable_chunked_prefill, max_num_batched_tokens, max_num_seqs, "
              "enforce_eager, free_cache_engine, disable_log_stats")
# Our estimators (hybridflow.algorithms; tests/test_verl_compat.py keeps the two lists equal).
ADV_ESTIMATORS = ("gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax")
_ROLES = ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic", "reward_model")

RULES: tuple[Rule, ...] = (
    # ---- the same setting under another name
    Rule("actor_rollout_ref.actor.ppo_micro_batch_size", REFUSED, _MICRO,
         "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu (= the global value / data-parallel size)"),
    Rule("critic.ppo_micro_batch_size", REFUSED, _MICRO,
         "critic.ppo_micro_batch_size_per_gpu (= the global value / data-parallel size)"),
    Rule("actor_rollout_ref.rollout.log_prob_micro_batch_size", REFUSED, _MICRO,
         "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu (= the global value / data-parallel size)"),
    Rule("actor_rollout_ref.ref.log_prob_micro_batch_size", REFUSED, _MICRO,
         "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu (= the global value / data-parallel size)"),
    Rule("reward_model.micro_batch_size", REFUSED, _MICRO,
         "reward_model.micro_batch_size_per_gpu (= the global value / data-parallel size)"),
    Rule("actor_rollout_ref.actor.kl_loss.type", REFUSED, "an old spelling of the KL-loss estimator",
         "actor_rollout_ref.actor.kl_loss_type (with actor_rollout_ref.actor.use_kl_loss=true)"),
    Rule("actor_rollout_ref.actor.kl_loss.coef", REFUSED, "an old spelling of the KL-loss coefficient",
         "actor_rollout_ref.actor.kl_loss_coef (with actor_rollout_ref.actor.use_kl_loss=true)"),
    Rule("algorithm.in_reward_kl.coef", REFUSED, "an old spelling of the in-reward KL coefficient",
         "algorithm.kl_ctrl.kl_coef (with algorithm.use_kl_in_reward=true)"),
    Rule("actor_rollout_ref.nccl_timeout", REFUSED, "the workers' process-group timeout has our own key",
         "trainer.fault.pg_timeout_s (seconds; a stuck collective fails after it)"),
    Rule("actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes", REFUSED,
         "the weight-sync bucket has our own key, in bytes",
         "actor_rollout_ref.rollout.reshard_bucket_bytes (= megabytes * 1048576)"),
    # ---- Megatron: any field of TransformerConfig / OptimizerConfig passes through (megatron_checks.py)
    Rule("*.megatron.override_ddp_config.*", REFUSED, "Megatron DDP config overrides are " + NOT_YET,
         "drop them (gradients are reduced in fp32; the DDP settings are in megatron_workers/optimizer.py)"),
    Rule("*.megatron.use_mbridge", IGNORED, "verl's HF <-> Megatron weight bridge (mbridge); here "
         "megatron_workers/hf_mapping.py maps the weights of the families it supports, with or without it"),
    Rule("*.megatron.vanilla_mbridge", IGNORED, "a choice between two versions of verl's mbridge; here "
         "megatron_workers/hf_mapping.py maps the weights"),
    Rule("*.model.use_fused_kernels", IGNORED,
         "verl's fused output-layer + log-prob kernel (it saves the logits' memory on GPU); here log-probs and "
         "entropy are computed vocab-parallel (megatron_workers/logprob.py), with the same values either way"),
    Rule("*.use_torch_compile", IGNORED, "verl compiles its FSDP actor's entropy function; the Megatron path "
         "has none to compile"),
    Rule("*.trust_remote_code", IGNORED, "the model families mapped here are transformers' own classes, which "
         "need no remote code (a model_type that would is refused by name before Ray)"),
    Rule("actor_rollout_ref.model.lora.*", REFUSED, "LoRA adapters are " + NOT_YET,
         "drop the lora keys: every weight is trained (full fine-tuning; more optimizer memory)"),
    Rule("actor_rollout_ref.model.mtp.*", REFUSED, "multi-token prediction (MTP) is " + NOT_YET, "drop it",
         ignore_values=("false",)),
    Rule("*.model.override_config.*", REFUSED, "overriding fields of the HF model's config is " + NOT_YET,
         "copy the model directory and edit its config.json"),
    Rule("actor_rollout_ref.actor.policy_loss.loss_mode", REFUSED,
         "verl's other policy losses (gpg, clip_cov, kl_cov, gspo, ...) are " + NOT_YET,
         "drop it: the PPO clip loss (verl's vanilla), with actor_rollout_ref.actor.clip_ratio_low / clip_ratio_high",
         ignore_values=("vanilla",)),
    # ---- profiling: torch.profiler timelines of every rank instead of verl's profiler section
    Rule("*.profiler.*", REFUSED, "verl's nsys / torch profiler settings are not read here",
         "trainer.timeline_dir and trainer.timeline_steps (PyTorch profiler traces of the driver and every rank)",
         ignore_values=("false", "[]", "none")),
    Rule("global_profiler.*", REFUSED, "verl's nsys / torch profiler settings are not read here",
         "trainer.timeline_dir and trainer.timeline_steps (PyTorch profiler traces of the driver and every rank)",
         ignore_values=("none",)),
    # ---- backends and modes we do not have
    *(Rule(f"{role}.strategy", REFUSED, "this stack trains with Megatron only",
           f"drop it and use {role}.megatron.*", ignore_values=("megatron",)) for role in _ROLES),
    Rule("*.fsdp_config.*", IGNORED, "FSDP backend settings; this stack trains with Megatron"),
    Rule("*.ulysses_sequence_parallel_size", IGNORED,
         "FSDP's Ulysses sequence parallelism; with Megatron use *.megatron.sequence_parallel"),
    # ---- server mode and agent loops: verl's keys where the meaning matches are schema keys (rollout.mode,
    # rollout.multi_turn.*, rollout.agent.*); these are the others
    Rule("actor_rollout_ref.rollout.multi_turn.max_user_turns", REFUSED, "a cap on tool/user turns is " + NOT_YET,
         "actor_rollout_ref.rollout.multi_turn.max_assistant_turns (each assistant turn brings at most one round of "
         "tool results)"),
    Rule("actor_rollout_ref.rollout.multi_turn.interaction_config_path", REFUSED,
         "verl's interaction (a simulated user between turns) is " + NOT_YET,
         "write a step-based environment as an AgentLoop subclass (docs/agent_loop.md)"),
    Rule("actor_rollout_ref.rollout.multi_turn.tokenization_sanity_check_mode", IGNORED,
         "the agent loop never re-tokenises (token in, token out), so there is nothing to check"),
    Rule("actor_rollout_ref.rollout.multi_turn.use_inference_chat_template", IGNORED,
         "earlier turns are never re-rendered: the trained ids are the sampled ones plus the tool ids"),
    Rule("actor_rollout_ref.rollout.agent.num_workers", IGNORED,
         "agent loops run as asyncio tasks on the driver (tools in sandboxed child processes); "
         "actor_rollout_ref.rollout.agent.max_concurrent_trajectories bounds them"),
    Rule("actor_rollout_ref.rollout.agent.agent_loop_config_path", REFUSED, "agent-loop registries are " + NOT_YET,
         "actor_rollout_ref.rollout.multi_turn.enable=true uses the default ToolAgentLoop"),
    Rule("actor_rollout_ref.rollout.agent.custom_async_server", REFUSED, "a custom async server is " + NOT_YET,
         "drop it: actor_rollout_ref.rollout.mode=async serves from the trainer's own vLLM engines"),
    # ---- rollout correction: the IS weights and bypass mode are schema keys (algorithm.rollout_correction.*)
    Rule("algorithm.rollout_correction.rollout_rs", REFUSED, "rejection sampling (verl's rollout_rs) is " + NOT_YET,
         "algorithm.rollout_correction.rollout_is=token or sequence (truncated IS weights)", ignore_values=("none",)),
    Rule("algorithm.rollout_correction.rollout_rs_threshold", REFUSED,
         "rejection sampling (verl's rollout_rs) is " + NOT_YET, "drop it", ignore_values=("none",)),
    Rule("algorithm.rollout_correction.rollout_is_batch_normalize", REFUSED,
         "normalising the IS weights to mean 1 is " + NOT_YET, "drop it", ignore_values=("false",)),
    Rule("algorithm.rollout_correction.loss_type", REFUSED,
         "bypass mode's REINFORCE loss is " + NOT_YET + "; bypass mode uses the PPO clip (verl's ppo_clip)",
         "drop it", ignore_values=("ppo_clip",)),
    Rule("data.return_raw_chat", IGNORED,
         "the dataset always keeps each row's raw chat (raw_prompt) next to its token ids"),
    # ---- the rollout engine: the vLLM arguments we pass are schema keys (_VLLM_ARGS)
    Rule("actor_rollout_ref.rollout.engine_kwargs.vllm.disable_mm_preprocessor_cache", IGNORED,
         "vLLM's cache of multi-modal inputs; the models here are text-only"),
    Rule("actor_rollout_ref.rollout.engine_kwargs.vllm.*", REFUSED, "passing any vLLM engine argument is " + NOT_YET,
         f"the ones passed are keys of their own ({_VLLM_ARGS})"),
    Rule("actor_rollout_ref.rollout.engine_kwargs.*", IGNORED,
         "another engine's arguments (SGLang, TensorRT-LLM); the rollout here is vLLM or HF generate"),
    Rule("actor_rollout_ref.rollout.skip_tokenizer_init", IGNORED,
         "the engine here is given token ids and returns token ids anyway"),
    Rule("actor_rollout_ref.rollout.prometheus.*", REFUSED,
         "the rollout server's own Prometheus endpoint (verl's async server) is not here",
         "trainer.logger=[console,prometheus] and trainer.prometheus.port: the trainer's metrics as gauges",
         ignore_values=("false",)),
    # ---- verl's values of our keys that we do not have (keep_values: the ones we do)
    Rule("algorithm.adv_estimator", REFUSED, "that advantage estimator is " + NOT_YET,
         f"algorithm.adv_estimator=one of {', '.join(ADV_ESTIMATORS)}", keep_values=ADV_ESTIMATORS),
    Rule("actor_rollout_ref.rollout.name", REFUSED, "the rollout engines here are vLLM and HF generate "
         "(the reference); SGLang and TensorRT-LLM are " + NOT_YET, "actor_rollout_ref.rollout.name=vllm",
         keep_values=("vllm", "hf")),
    Rule("*.megatron.context_parallel_size", REFUSED, "context parallelism needs Transformer Engine's attention "
         "on GPU (its ring attention over the sequence shards), which this stack does not wire up",
         "drop it (1) and cut activation memory with *.megatron.sequence_parallel=true or "
         "*.megatron.override_transformer_config.recompute_granularity=full", keep_values=("1",)),
    Rule("actor_rollout_ref.actor.router_replay.mode", REFUSED,
         "R2 (replaying the old-log-prob forward's own routing) is " + NOT_YET,
         "actor_rollout_ref.actor.router_replay.mode=R3 with actor_rollout_ref.rollout.enable_rollout_routing_replay"
         "=true (the rollout's routing, replayed)", keep_values=("disabled", "r3")),
    Rule("*.optim.lr_decay_style", REFUSED, "that schedule (inverse_square_root, WSD) is " + NOT_YET,
         "*.optim.lr_decay_style=constant, linear or cosine", keep_values=("constant", "linear", "cosine", "none")),
    Rule("reward_model.reward_manager", REFUSED, "that reward manager is " + NOT_YET,
         "reward_model.reward_manager=naive, or dapo (naive plus the overlong penalty), or your own scorer in "
         "custom_reward_function.path", keep_values=("naive", "dapo")),
)


@dataclass(frozen=True)
class Difference:
    """A key both schemas have, whose default or behaviour differs here. `verl`: its default in verl's
    verl/trainer/config/ppo_megatron_trainer.yaml (volcengine/verl @ 028af31b); ours is read from the schema."""

    key: str
    verl: str
    note: str


_CPU_SIZED = "sized for a 2-core CPU run here; verl's scripts set it"
DIFFERENCES: tuple[Difference, ...] = (
    Difference("data.train_batch_size", "1024", _CPU_SIZED),
    Difference("data.max_prompt_length", "512", _CPU_SIZED),
    Difference("data.max_response_length", "512",
               _CPU_SIZED + "; as in verl, actor_rollout_ref.rollout.response_length follows it unless set"),
    Difference("data.filter_overlong_prompts", "False",
               "on here; with it off, data.truncation (error, as verl) applies when the dataset loads, before Ray"),
    Difference("actor_rollout_ref.actor.ppo_mini_batch_size", "256", _CPU_SIZED),
    Difference("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", "null (must be set)", "a number by default"),
    Difference("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu", "null (must be set)",
               "a number by default; the old-log-prob pass uses it"),
    Difference("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu", "null (must be set)",
               "a number by default"),
    Difference("actor_rollout_ref.actor.megatron.sequence_parallel", "True",
               "null here: on by rule for a Mixture-of-Experts model under TP > 1 (Megatron trains MoE layers under "
               "TP only with it), off for a dense model; verl turns it off at TP=1 and keeps it on at TP > 1, so "
               "set true to match for a dense model (resolved before Ray, for every role)"),
    Difference("actor_rollout_ref.actor.megatron.context_parallel_size", "1",
               "values > 1 are refused at load: context parallelism needs Transformer Engine's attention on GPU"),
    Difference("actor_rollout_ref.actor.megatron.override_transformer_config.attention_backend", "flash",
               "auto: torch SDPA on the local spec, Transformer Engine's choice on its spec; flash and fused ask TE "
               "(a GPU with TE), auto elsewhere; unfused: megatron's DotProductAttention (local spec)"),
    Difference("actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size", "null",
               "as verl (megatron's interleaved schedule); needs pp >= 2 and the layers per stage divisible by "
               "it (checked before Ray); a micro-batch count that is not a multiple of pp gets zero-loss padding"),
    Difference("actor_rollout_ref.model.enable_gradient_checkpointing", "False",
               "true means full / uniform / 1-layer recompute for the actor (critic.model's: the critic), unless "
               "*.megatron.override_transformer_config.recompute_granularity is set, which wins"),
    Difference("actor_rollout_ref.ref.megatron.tensor_model_parallel_size", "1",
               "follows actor_rollout_ref.actor.megatron's (so do pipeline/context_parallel_size): verl's colocated "
               "ref runs on the actor's parallel state whatever it says; colocated, a different value is refused"),
    Difference("actor_rollout_ref.actor.megatron.param_offload", "False",
               "as verl on GPU (also grad_offload, optimizer_offload, ref.megatron.param_offload); on CPU the "
               "model already lives in host memory, so it is a logged no-op"),
    Difference("actor_rollout_ref.rollout.name", "??? (must be set)", "vllm or hf (HF generate, the reference); "
               "sglang and trtllm are refused at load"),
    Difference("actor_rollout_ref.rollout.mode", "async", "sync here (one generate call over the batch, the "
               "HybridFlow paper's); async is server mode (docs/agent_loop.md), as verl"),
    Difference("actor_rollout_ref.rollout.max_num_batched_tokens", "8192",
               "null here: vLLM's own default; set, it goes to vLLM as verl passes it (so do enable_chunked_prefill, "
               "max_num_seqs and disable_log_stats)"),
    Difference("actor_rollout_ref.rollout.enforce_eager", "False", "as verl on GPU; on CPU vLLM always runs eager "
               "(no CUDA graphs there)"),
    Difference("actor_rollout_ref.rollout.free_cache_engine", "True", "as verl on GPU (vLLM sleeps between "
               "generations, freeing its KV cache and weights for training); vLLM has no sleep mode on CPU"),
    Difference("actor_rollout_ref.rollout.calculate_log_probs", "False",
               "on here: the rollout's log-probs give rollout/logprob_diff_* (the check that vLLM samples from the "
               "weights being trained); off, vLLM skips them, and a KL penalty in the reward then gets an "
               "old-log-prob pass"),
    Difference("actor_rollout_ref.rollout.gpu_memory_utilization", "0.5",
               "as verl on GPU, unless actor_rollout_ref.rollout.kv_cache_memory_bytes is set (it wins, as in "
               "vLLM); on CPU not used (logged once): the KV cache is kv_cache_memory_bytes, 256 MiB by default"),
    Difference("trainer.n_gpus_per_node", "8", "on CPU: worker processes per node"),
    Difference("trainer.total_epochs", "30", _CPU_SIZED),
    Difference("trainer.val_before_train", "True",
               "off here, so a config without data.val_files runs; on, it validates at step 0 as verl"),
    Difference("trainer.logger", "['console', 'wandb']",
               "wandb runs offline (no network) unless WANDB_MODE says otherwise; also jsonl, tensorboard, mlflow, "
               "prometheus ([Watching a run](watching.md))"),
    Difference("trainer.critic_warmup", "0", "verl's rule: the actor is updated at steps >= critic_warmup "
               "(counted from 1), so N gives N-1 critic-only steps; N > 1 without a critic is refused before Ray"),
    Difference("trainer.default_local_dir", "checkpoints/${trainer.project_name}/${trainer.experiment_name}",
               "the run directory: checkpoints, metrics, curves and the resolved config.yaml"),
)


def _value_text(value) -> str:
    return "none" if value is None else str(value).strip().lower()


def classify(key: str, value) -> Verdict | None:
    """What to do with verl key `key` (not in our schema) set to `value`; None: no rule (an unknown key)."""
    for rule in RULES:
        if rule.keep_values or not fnmatch.fnmatchcase(key, rule.pattern):
            continue
        if rule.ignore_values and _value_text(value) in rule.ignore_values:
            return Verdict(key, IGNORED, f"{key}={value}: nothing to change, this stack does that anyway")
        if rule.kind == IGNORED:
            return Verdict(key, IGNORED, f"{key}: {rule.reason}")
        return Verdict(key, REFUSED, f"verl key '{key}={value}' is refused here: {rule.reason}; instead: {rule.use}")
    return None


def check_value(key: str, value) -> Verdict | None:
    """A key of our schema set to a verl value we do not have: REFUSED, with what to write instead; None: fine."""
    for rule in _VALUE_RULES:
        if fnmatch.fnmatchcase(key, rule.pattern) and _value_text(value) not in rule.keep_values:
            return Verdict(key, REFUSED, f"verl key '{key}={value}' is refused here: {rule.reason}; "
                                         f"instead: {rule.use}")
    return None


_VALUE_RULES = tuple(r for r in RULES if r.keep_values)


def markdown_cell(text: str) -> str:
    return text.replace("*", "\\*").replace("|", "/")


def markdown_table() -> str:
    """RULES as the markdown table in docs/verl.md ("Coming from verl")."""
    rows = ["| verl key | here | why | instead |", "|---|---|---|---|"]
    for r in RULES:
        here = (f"ignored if `{'`/`'.join(r.ignore_values)}`, else refused" if r.ignore_values else
                f"ours for `{'`/`'.join(r.keep_values)}`, else refused" if r.keep_values else r.kind)
        rows.append(f"| `{r.pattern}` | {here} | {markdown_cell(r.reason)} | {markdown_cell(r.use)} |")
    return "\n".join(rows)
