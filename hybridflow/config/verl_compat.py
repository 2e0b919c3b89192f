"""verl keys that are not in our schema: what happens to each when a pasted verl config uses it.

`hybridflow.config.load` consults `classify` for every key the schema does not know, before it reports
an unknown key. A rule either
  - IGNORES the key (it is dropped from its layer and logged once with the reason): it only concerns a
    backend or mode we do not have, or asks for what we do anyway, so dropping it changes nothing; or
  - REFUSES it, with what to use instead: a verl name we spell differently, a value whose meaning differs
    here, or a feature that is not supported yet (and what to do meanwhile).
Some rules depend on the value: `actor_rollout_ref.actor.strategy=megatron` is what we do (ignored), any
other strategy is refused.

Keys that exist in both schemas with the same meaning are not listed here: they are ours
(hybridflow/config/schema.py). The two tables of docs/verl.md ("Coming from verl") are generated from RULES
and DIFFERENCES (`python -m hybridflow.config.verl_compat --write` rewrites them there), and a test keeps the
page equal to them.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from pathlib import Path

IGNORED, REFUSED = "ignored", "refused"
# The page that shows both tables (a checkout's docs/; not part of an installed package).
PAGE = Path(__file__).resolve().parents[2] / "docs" / "verl.md"
NOT_YET = "not supported yet"


@dataclass(frozen=True)
class Rule:
    pattern: str  # a dotted key; fnmatch wildcards (`*` also crosses dots) for families of keys
    kind: str  # IGNORED or REFUSED (for values outside `ignore_values`)
    reason: str
    use: str = ""  # REFUSED: what to set instead (keys of our schema where there is one)
    # With a value rule: IGNORED for these values (compared as lower-case strings), REFUSED otherwise.
    ignore_values: tuple[str, ...] = ()


@dataclass(frozen=True)
class Verdict:
    key: str
    kind: str
    message: str


_MICRO = "verl's deprecated global micro-batch (verl divides it by the data-parallel size)"
_OVERRIDE_KEYS = "recompute_granularity, recompute_method, recompute_num_layers, attention_backend"
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
    # ---- Megatron features not there yet. Activation recompute (override_transformer_config.recompute_*,
    # model.enable_gradient_checkpointing) and virtual_pipeline_model_parallel_size are schema keys now.
    Rule("*.megatron.override_transformer_config.*", REFUSED,
         "only the activation-recompute fields and attention_backend of Megatron's TransformerConfig can be "
         f"overridden here ({_OVERRIDE_KEYS}); other overrides (fusions, ...) are " + NOT_YET,
         "drop it; the recompute fields go under the same prefix "
         "(actor_rollout_ref.actor.megatron.override_transformer_config.recompute_granularity and the like)"),
    Rule("*.megatron.override_ddp_config.*", REFUSED, "Megatron DDP config overrides are " + NOT_YET,
         "drop them (gradients are reduced in fp32; the DDP settings are in megatron_workers/optimizer.py)"),
    Rule("*.optim.override_optimizer_config.*", REFUSED, "Megatron optimizer config overrides are " + NOT_YET,
         "drop them; for optimizer memory use *.megatron.optimizer_offload=true"),
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
               "off by default here; verl turns it off at TP=1, so set it for TP > 1 to match"),
    Difference("actor_rollout_ref.actor.megatron.context_parallel_size", "1",
               "values > 1 are refused before Ray: context parallelism needs Transformer Engine's attention on GPU"),
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
    Difference("actor_rollout_ref.rollout.name", "vllm", "vllm or hf (HF generate, the reference); others are "
               "refused before Ray"),
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
        if not fnmatch.fnmatchcase(key, rule.pattern):
            continue
        if rule.ignore_values and _value_text(value) in rule.ignore_values:
            return Verdict(key, IGNORED, f"{key}={value}: nothing to change, this stack does that anyway")
        if rule.kind == IGNORED:
            return Verdict(key, IGNORED, f"{key}: {rule.reason}")
        return Verdict(key, REFUSED, f"verl key '{key}={value}' is refused here: {rule.reason}; instead: {rule.use}")
    return None


def _md(text: str) -> str:
    return text.replace("*", "\\*").replace("|", "/")


def markdown_table() -> str:
    """RULES as the markdown table in docs/verl.md ("Coming from verl")."""
    rows = ["| verl key | here | why | instead |", "|---|---|---|---|"]
    for r in RULES:
        here = r.kind if not r.ignore_values else f"ignored if `{'`/`'.join(r.ignore_values)}`, else refused"
        rows.append(f"| `{r.pattern}` | {here} | {_md(r.reason)} | {_md(r.use)} |")
    return "\n".join(rows)


def differences_table() -> str:
    """DIFFERENCES as the markdown table in docs/verl.md, with our defaults read from the schema."""
    from omegaconf import OmegaConf

    from hybridflow.config.load import load_config, to_dict

    ours = OmegaConf.create(to_dict(load_config()))
    rows = ["| key | verl default | default here | what differs |", "|---|---|---|---|"]
    for d in DIFFERENCES:
        value = OmegaConf.select(ours, d.key)
        value = OmegaConf.to_container(value) if OmegaConf.is_config(value) else value
        rows.append(f"| `{d.key}` | `{d.verl}` | `{value}` | {_md(d.note)} |")
    return "\n".join(rows)


def replace_tables(text: str) -> str:
    """`text` with each generated table, found by its header row, replaced by the current one (whole rows only)."""
    lines = text.split("\n")
    for table in (differences_table(), markdown_table()):
        rows = table.split("\n")
        if rows[0] not in lines:
            raise ValueError(f"no table with the header {rows[0]!r} to replace")
        start = end = lines.index(rows[0])
        while end < len(lines) and lines[end].startswith("|"):
            end += 1
        lines[start:end] = rows
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(
        prog="python -m hybridflow.config.verl_compat",
        description="Print the two verl tables (differing defaults, then verl keys that are not ours) as markdown, "
                    "or rewrite them in the docs page.",
        epilog=f"tests/test_verl_compat.py keeps {PAGE} equal to them.")
    ap.add_argument("--write", nargs="?", const=str(PAGE), metavar="PAGE",
                    help=f"replace the tables in PAGE (default {PAGE}) instead of printing them")
    args = ap.parse_args(argv)
    if args.write:
        page = Path(args.write)
        page.write_text(replace_tables(page.read_text()))
        print(f"wrote {page}")
    else:
        print(differences_table(), markdown_table(), sep="\n\n")


if __name__ == "__main__":
    main()
