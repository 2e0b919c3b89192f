"""Checks of a job's inputs that read a file or relate several keys, run by trainer.main.validate before Ray
starts, so a bad value fails in a second with the key (and file or row) named instead of minutes later inside
a worker, as a traceback from megatron, torch or vLLM.

Each function raises ValueError (FileNotFoundError for a missing path) whose message starts with the key.
Where a worker has its own check of the same fact (LRSchedule, resolve_dtype, the safetensors header check),
that check is called here, so there is one rule and only the time it runs differs.
"""

from __future__ import annotations

import json
import math
import os

# The config.json keys a layout check and the Megatron builder read; without them either fails deep down.
REQUIRED_MODEL_KEYS = ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size")
# One of these makes a directory loadable by AutoTokenizer (fast tokenizer, sentencepiece, BPE vocab).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def model_config(key: str, path: str) -> dict:
    """The config.json of the HF directory named by `key`, checked to be a JSON object with the shape keys."""
    file = os.path.join(path, "config.json") if path else ""
    if not path or not os.path.isfile(file):
        raise FileNotFoundError(f"{key}={path!r} has no config.json")
    try:
        with open(file, encoding="utf-8") as fh:
            cfg = json.load(fh)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{key}={path!r}: {file} is not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{key}={path!r}: {file} holds a {type(cfg).__name__}, not a JSON object")
    missing = [k for k in REQUIRED_MODEL_KEYS if k not in cfg]
    if missing:
        raise ValueError(f"{key}={path!r}: {file} lacks {missing} (a causal LM's config.json has all of "
                         f"{list(REQUIRED_MODEL_KEYS)})")
    bad = {k: cfg[k] for k in (*REQUIRED_MODEL_KEYS, "num_key_value_heads", "head_dim")
           if k in cfg and cfg[k] is not None and not _is_count(cfg[k])}
    if bad:
        raise ValueError(f"{key}={path!r}: {file} has {bad}; these must be positive integers")
    return cfg


def model_weights(key: str, path: str, hf_config: dict | None = None) -> None:
    """Every safetensors file of the directory exists and is complete (header parsed, size checked), with the
    reader the workers use; no tensor data is read. With `hf_config` (a causal LM: the actor), also that the
    model type is one the Megatron builder maps and that every tensor it will load is there, as
    megatron_workers.convert checks before a conversion."""
    from megatron_workers.hf_io import CheckpointError, check_checkpoint, checkpoint_weight_map, safetensors_header

    try:
        for file in sorted(set(checkpoint_weight_map(path).values())):
            safetensors_header(file)
        if hf_config is not None:
            from megatron_workers import hf_mapping

            check_checkpoint(path, {h for n in hf_mapping.mcore_param_names(hf_config)
                                    for h in hf_mapping.describe(n, hf_config).hf_names})
    except (CheckpointError, ValueError) as e:  # ValueError: UnsupportedModelError from the builder's table
        raise ValueError(f"{key}={path!r}: {e}") from None


def tokenizer_dir(key: str, path: str) -> None:
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{key}={path!r} is not a directory")
    if not any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES):
        raise FileNotFoundError(f"{key}={path!r} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); set "
                                "actor_rollout_ref.model.tokenizer_path to a directory that has one")


def model_dtype(key: str, name: str) -> None:
    from hybridflow.precision import canonical

    canonical(name, key)


def optim(key: str, o, total_steps: int | None) -> None:
    """An OptimConfig under `key`, with the workers' own LRSchedule rule. total_steps: the run's step count
    if the config fixes it; None skips the decay-length check (the trainer makes it once the data is read)."""
    from megatron_workers.optimizer import LRSchedule

    if not _finite(o.lr):
        raise ValueError(f"{key}.lr={o.lr} must be a finite number >= 0")
    steps = o.total_training_steps if o.total_training_steps > 0 else total_steps
    style = getattr(o, "lr_decay_style", None) or o.lr_scheduler  # verl's name wins when given
    try:
        LRSchedule(base_lr=float(o.lr), style=style, warmup_steps=int(o.lr_warmup_steps),
                   total_steps=steps if steps else int(o.lr_warmup_steps) + 1, min_lr_ratio=float(o.min_lr_ratio))
    except ValueError as e:
        text = str(e).removeprefix("optim.")
        if getattr(o, "lr_decay_style", None):
            text = text.replace("lr_scheduler=", "lr_decay_style=")
        raise ValueError(f"{key}.{text}") from None
    if not _finite(o.weight_decay) or o.weight_decay < 0:
        raise ValueError(f"{key}.weight_decay={o.weight_decay} must be a finite number >= 0")
    if not _finite(o.clip_grad) or o.clip_grad <= 0:
        raise ValueError(f"{key}.clip_grad={o.clip_grad} must be > 0 (the max grad norm)")
    if len(o.betas) != 2 or not all(_finite(b) and 0 <= b < 1 for b in o.betas):
        raise ValueError(f"{key}.betas={list(o.betas)} must be two numbers in [0, 1)")


def counts(cfg, keys: tuple[str, ...]) -> None:
    """Each dotted key of `cfg` holds an integer >= 1."""
    for key in keys:
        value = cfg
        for part in key.split("."):
            value = getattr(value, part)
        if not _is_count(value):
            raise ValueError(f"{key}={value} must be an integer >= 1")


def update_batches(role: str, mini: int, micro: int, n: int, dp: int, train_batch_size: int,
                   dynamic: bool = False) -> None:
    """How the workers cut one step's rows: each mini-batch of `mini` prompts (mini * n rows) is split over the
    dp ranks, and each rank's share into micro-batches of `micro` rows (the last one may not be short).
    dynamic: micro-batches are cut by tokens ({role}.use_dynamic_bsz), so `micro` is not used (as in verl)."""
    if mini > train_batch_size or train_batch_size % mini:
        raise ValueError(f"{role}.ppo_mini_batch_size={mini} must divide data.train_batch_size={train_batch_size}")
    rows = mini * n
    if rows % dp:
        raise ValueError(f"{role}.ppo_mini_batch_size * actor_rollout_ref.rollout.n = {mini}*{n} = {rows} rows per "
                         f"mini-batch is not divisible by the {role.split('.')[-1]} dp size {dp}")
    per_rank = rows // dp
    if not dynamic and per_rank % min(micro, per_rank):
        raise ValueError(f"{role}.ppo_micro_batch_size_per_gpu={micro} does not divide the {per_rank} rows each "
                         f"of the {dp} dp ranks gets per mini-batch ({role}.ppo_mini_batch_size={mini} * rollout.n="
                         f"{n} / dp {dp})")


def sampling(cfg) -> None:
    r, d = cfg.actor_rollout_ref.rollout, cfg.data
    key = "actor_rollout_ref.rollout"
    # The training log-probs are taken at the sampling temperature (logits / temperature), so 0 is not greedy
    # here but a division by zero; greedy belongs to validation (rollout.val_kwargs.do_sample=false).
    if not _finite(r.temperature) or r.temperature <= 0:
        raise ValueError(f"{key}.temperature={r.temperature} must be > 0: training rollouts are sampled and their "
                         f"log-probs are divided by it (greedy decoding is for {key}.val_kwargs)")
    if not _finite(r.top_p) or not 0 < r.top_p <= 1:
        raise ValueError(f"{key}.top_p={r.top_p} must be in (0, 1]")
    if r.top_k < -1:  # vLLM and HF both read 0 and -1 as off
        raise ValueError(f"{key}.top_k={r.top_k} must be -1 or 0 (off), or >= 1")
    for k, v in ((f"{key}.response_length", r.response_length), ("data.max_prompt_length", d.max_prompt_length),
                 ("data.max_response_length", d.max_response_length)):
        if not _is_count(v):
            raise ValueError(f"{k}={v} must be an integer >= 1 (tokens)")
    for k in ("max_num_batched_tokens", "max_num_seqs"):  # vLLM's engine arguments (null: its default)
        if getattr(r, k) is not None and not _is_count(getattr(r, k)):
            raise ValueError(f"{key}.{k}={getattr(r, k)} must be an integer >= 1 (or null: vLLM's default)")
    longest = d.max_prompt_length + r.response_length
    budget = r.max_num_batched_tokens
    if r.enable_chunked_prefill is False and budget is not None and budget < longest:
        # without chunked prefill vLLM schedules a whole prompt in one step, so it refuses to start
        raise ValueError(f"{key}.max_num_batched_tokens={r.max_num_batched_tokens} with {key}.enable_chunked_prefill="
                         f"false cannot hold one sequence of data.max_prompt_length + response_length = {longest} "
                         "tokens; raise it or turn chunked prefill on")


def trainer_keys(t) -> None:
    for k in ("nnodes", "n_gpus_per_node", "total_epochs"):
        if not _is_count(getattr(t, k)):
            raise ValueError(f"trainer.{k}={getattr(t, k)} must be an integer >= 1")
    if t.total_training_steps is not None and not _is_count(t.total_training_steps):
        raise ValueError(f"trainer.total_training_steps={t.total_training_steps} must be >= 1 "
                         "(or null: epochs x batches)")
    if t.save_freq == 0 or t.save_freq < -1:
        raise ValueError(f"trainer.save_freq={t.save_freq}: save every N >= 1 steps, or -1 to never save")
    if t.max_ckpt_to_keep is not None and not _is_count(t.max_ckpt_to_keep):
        raise ValueError(f"trainer.max_ckpt_to_keep={t.max_ckpt_to_keep} must be >= 1 (or null: keep all)")
    if not _finite(t.ray.timeout_s) or t.ray.timeout_s <= 0:
        raise ValueError(f"trainer.ray.timeout_s={t.ray.timeout_s} must be > 0 (every blocking wait is bounded)")
    if not isinstance(t.log_val_generations, int) or t.log_val_generations < 0:
        raise ValueError(f"trainer.log_val_generations={t.log_val_generations} must be >= 0 (samples shown per "
                         "validation; 0: none)")
    prometheus(t)


def prometheus(t) -> None:
    """trainer.prometheus, checked whether or not the logger is on (a typo should not wait for the day it is)."""
    from hybridflow.trainer.prometheus import MODES

    p = t.prometheus
    if p.mode not in MODES:
        raise ValueError(f"trainer.prometheus.mode={p.mode!r}: choose from {list(MODES)}")
    if not isinstance(p.port, int) or isinstance(p.port, bool) or not 0 <= p.port <= 65535:
        raise ValueError(f"trainer.prometheus.port={p.port!r} must be a port number 0-65535 (0: a free one)")
    if not _finite(p.linger_s) or p.linger_s < 0:
        raise ValueError(f"trainer.prometheus.linger_s={p.linger_s!r} must be >= 0 seconds")
    if not isinstance(p.host, str) or not p.host:
        raise ValueError(f"trainer.prometheus.host={p.host!r} must be an address to bind (127.0.0.1: loopback)")


def resume(cfg) -> None:
    from hybridflow.trainer.checkpoint import check_resume_path

    mode = str(cfg.trainer.resume_mode)
    if mode not in ("auto", "disable"):
        check_resume_path(mode, ("actor", "critic") if cfg.critic.enable else ("actor",))


def dist_checkpoints(cfg) -> None:
    """verl's use_dist_checkpointing: every role that starts from a Megatron dist checkpoint names one (the file
    dist_checkpointing writes first), before any worker would fail to read it."""
    a = cfg.actor_rollout_ref
    roles = {"actor_rollout_ref.actor": a.actor.megatron, "actor_rollout_ref.ref": a.ref.megatron}
    if cfg.critic.enable:
        roles["critic"] = cfg.critic.megatron
    if cfg.reward_model.enable:
        roles["reward_model"] = cfg.reward_model.megatron
    for role, m in roles.items():
        path = m.dist_checkpointing_path
        if m.use_dist_checkpointing and not (path and os.path.isfile(os.path.join(path, "metadata.json"))):
            raise FileNotFoundError(f"{role}.megatron.use_dist_checkpointing=true: {role}.megatron."
                                    f"dist_checkpointing_path={path!r} is not a Megatron dist checkpoint (no "
                                    "metadata.json); `python -m megatron_workers.convert hf-to-mcore` writes one")


def reward_fn(c) -> None:
    """custom_reward_function: imported here (a file that does not import, or lacks the function, fails the
    run now); how it behaves per sample (raises, NaN, hangs) is the RewardManager's: scored 0 and counted."""
    if not _finite(c.timeout_s) or c.timeout_s <= 0:
        raise ValueError(f"custom_reward_function.timeout_s={c.timeout_s} must be > 0 (seconds per sample)")
    if not c.path:
        return
    from hybridflow.rewards.user_fn import load_reward_fn

    try:
        load_reward_fn(c.path, c.name)
    except (FileNotFoundError, ImportError, AttributeError, TypeError, TimeoutError) as e:
        raise ValueError(f"custom_reward_function.path={c.path!r} name={c.name!r}: {e}") from None


def wants_validation(cfg) -> bool:
    """Whether any validation is scheduled (before training, or every trainer.test_freq steps)."""
    return cfg.trainer.val_before_train or cfg.trainer.test_freq > 0


def data_files(cfg) -> tuple:
    """Read train (and, when validation is scheduled, val) files as the run will: columns, every row's prompt
    and ground truth, and prompt lengths against data.max_prompt_length / data.truncation. Costs a tokenizer
    load and one tokenisation of the prompts (about a second for GSM8K's 7.5k).

    Returns (tokenizer, train dataset, val dataset or None), which the run then uses as they are
    (trainer.main.build_and_run's `data`), so the prompts are read and tokenised once."""
    from transformers import AutoTokenizer

    from hybridflow.data.rl_dataset import RLDataset

    m = cfg.actor_rollout_ref.model
    key = "actor_rollout_ref.model.tokenizer_path" if m.tokenizer_path else "actor_rollout_ref.model.path"
    try:
        tokenizer = AutoTokenizer.from_pretrained(m.tokenizer_path or m.path)
    except (OSError, ValueError) as e:
        raise ValueError(f"{key}={m.tokenizer_path or m.path!r}: the tokenizer does not load ({e})") from None
    validating = wants_validation(cfg)
    datasets = []
    for files in (cfg.data.train_files, cfg.data.val_files if validating else []):
        dataset = RLDataset.from_config(files, tokenizer, cfg.data) if files else None
        if dataset is not None:
            _scorers_exist(cfg, dataset)
        datasets.append(dataset)
    return tokenizer, *datasets


def _scorers_exist(cfg, dataset) -> None:
    """Every row's data_source has a rule scorer, unless a user function or a replacing reward model scores
    all rows; otherwise the first reward stage would fail, after every worker has started."""
    from hybridflow.rewards.manager import BUILTIN_SCORERS

    rm = cfg.reward_model
    if cfg.custom_reward_function.path or (rm.enable and rm.reward_mode == "replace"):
        return
    unknown = [item for item in dataset if item["data_source"] not in BUILTIN_SCORERS]
    if unknown:
        file, row = dataset.origin[unknown[0]["index"]]
        sources = sorted({item["data_source"] for item in unknown})
        raise ValueError(f"data file {file!r} row {row}: data_source {unknown[0]['data_source']!r} has no rule "
                         f"scorer ({len(unknown)} rows, sources {sources[:5]}; known: {sorted(BUILTIN_SCORERS)}); "
                         "set custom_reward_function.path, or reward_model.enable=true")


def token_budgets(cfg) -> None:
    """Each pass with token-budget micro-batches (verl's use_dynamic_bsz) has a budget that holds the longest
    row the run can make: data.max_prompt_length + actor_rollout_ref.rollout.response_length valid tokens.

    A flag on with no usable budget (null, 0, negative, not an integer) contradicts itself and is refused
    naming both keys; verl ignores a budget while its flag is off, and so does this check. The
    *_micro_batch_size_per_gpu keys are not used while a flag is on (verl's rule), so setting both is allowed:
    verl's own scripts do (tests/data/verl_overrides).
    """
    a = cfg.actor_rollout_ref
    longest = cfg.data.max_prompt_length + a.rollout.response_length
    passes = [("actor_rollout_ref.actor.use_dynamic_bsz", a.actor.use_dynamic_bsz,
               "actor_rollout_ref.actor.ppo_max_token_len_per_gpu", a.actor.ppo_max_token_len_per_gpu),
              ("actor_rollout_ref.rollout.log_prob_use_dynamic_bsz", a.rollout.log_prob_use_dynamic_bsz,
               "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu", a.rollout.log_prob_max_token_len_per_gpu),
              ("actor_rollout_ref.ref.log_prob_use_dynamic_bsz", a.ref.log_prob_use_dynamic_bsz,
               "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu", a.ref.log_prob_max_token_len_per_gpu)]
    if cfg.critic.enable:
        c = cfg.critic
        passes += [("critic.use_dynamic_bsz", c.use_dynamic_bsz, "critic.ppo_max_token_len_per_gpu",
                    c.ppo_max_token_len_per_gpu),
                   ("critic.use_dynamic_bsz", c.use_dynamic_bsz, "critic.forward_max_token_len_per_gpu",
                    c.forward_max_token_len_per_gpu)]
    if cfg.reward_model.enable:
        passes.append(("reward_model.use_dynamic_bsz", cfg.reward_model.use_dynamic_bsz,
                       "reward_model.forward_max_token_len_per_gpu", cfg.reward_model.forward_max_token_len_per_gpu))
    for flag, on, key, budget in passes:
        if not on:
            continue
        if not _is_count(budget):
            raise ValueError(f"{key}={budget!r} contradicts {flag}=true: token-budget micro-batches need a "
                             f"positive token count per micro-batch (at least {longest}, see below); set {key} or "
                             f"{flag}=false to cut micro-batches by rows")
        if budget < longest:
            raise ValueError(f"{key}={budget} is smaller than the longest row the run can make: "
                             f"data.max_prompt_length + actor_rollout_ref.rollout.response_length = "
                             f"{cfg.data.max_prompt_length} + {a.rollout.response_length} = {longest} tokens; "
                             f"a row never splits over micro-batches, so set {key} >= {longest}")
