"""The NeMo-RL setting the planner replays (its performance summary and its v0.3 blog's step breakdown): the
options and config overrides of one NeMo-RL row, and planning a list of overrides. Used by published.py and
stage_breakdown.py, which both plan such rows."""

from __future__ import annotations

from launch.plan import Options, Plan, plan_config

# max_new_tokens to max_total_sequence_length and vLLM's max_model_len to the same 4096, so a response stops at
# 4096 minus its prompt ("real truncation occurs at vllm.max_model_len", its data.max_input_seq_length comment).
# ASSUMED: prompt mean 120 (OpenMathInstruct-2 problem + template), so a 3976-token budget, p99 at the budget
# (long-tailed math answers), optimizer state offloaded around generation.
NEMO_TOTAL, NEMO_PROMPT = 4096, 120
NEMO_OPTIONS = dict(gpu="h100", packing="packed", max_num_seqs=1024, prompt_length_mean=NEMO_PROMPT)


def nemo_options(mean: float, activation_checkpointing: bool) -> Options:
    """A NeMo-RL row's planner options: NEMO_OPTIONS, its published mean response and its recompute."""
    return Options(**NEMO_OPTIONS, recompute="full" if activation_checkpointing else "none",
                   response_length_mean=mean)


def nemo_overrides(model: str, nodes: int, t: int, p: int, t_g: int, logprob_micro: int, ep: int = 1,
                   gpu_memory_utilization: float = 0.6, offload: bool = True, etp: int | None = None) -> list[str]:
    a = "actor_rollout_ref"
    m = [f"tensor_model_parallel_size={t}", f"pipeline_model_parallel_size={p}", f"sequence_parallel={t > 1}",
         f"expert_model_parallel_size={ep}"]
    if etp is not None:  # else Megatron's default, the training TP
        m.append(f"expert_tensor_parallel_size={etp}")
    out = ["data.train_batch_size=64", f"data.max_prompt_length={NEMO_PROMPT}",
           f"data.max_response_length={NEMO_TOTAL - NEMO_PROMPT}",
           f"{a}.model.path=models/{model}", f"{a}.model.dtype=bfloat16", f"{a}.rollout.n=32",
           f"{a}.rollout.tensor_model_parallel_size={t_g}", f"{a}.rollout.response_length={NEMO_TOTAL - NEMO_PROMPT}",
           f"{a}.rollout.kv_cache_memory_bytes=null",
           f"{a}.rollout.gpu_memory_utilization={gpu_memory_utilization}",
           f"{a}.rollout.log_prob_micro_batch_size_per_gpu={logprob_micro}",
           f"{a}.ref.log_prob_micro_batch_size_per_gpu={logprob_micro}",
           f"{a}.actor.ppo_mini_batch_size=16", f"{a}.actor.ppo_micro_batch_size_per_gpu=1",
           f"{a}.actor.use_kl_loss=true", "algorithm.adv_estimator=grpo",
           f"trainer.nnodes={nodes}", "trainer.n_gpus_per_node=8"]
    if offload:
        out += [f"{a}.actor.megatron.optimizer_offload=true", f"{a}.actor.megatron.grad_offload=true"]
    for prefix in (f"{a}.actor.megatron", f"{a}.ref.megatron"):
        out += [f"{prefix}.{k}" for k in m]
    return out


def plan_overrides(overrides: list[str], options: Options) -> Plan:
    from hybridflow.config.load import load_config

    return plan_config(load_config(None, overrides), options)
