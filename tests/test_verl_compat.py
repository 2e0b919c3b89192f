"""verl's own Megatron example command lines, pasted: every key is accepted with verl's meaning, ignored with a
logged reason, or refused with what to use instead (hybridflow/config/verl_compat.py), and what remains passes
the trainer's pre-Ray checks.

The override lists are in tests/data/verl_overrides/ (source repo, path and commit in each header). The class
of every line is written down here by hand, from verl's meaning of the key, not derived from the compat table.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from hybridflow.config import verl_compat
from hybridflow.config.load import ConfigError, is_valid_key, load_config, to_dict

FIXTURES = sorted((Path(__file__).parent / "data" / "verl_overrides").glob("*.txt"))
PAGE = Path(__file__).parent.parent / "docs" / "verl.md"

# key=value lines (as in the fixtures) that are dropped with a logged reason.
IGNORED = {
    "data.return_raw_chat=",  # the dataset always keeps the raw chat
}
# key=value lines that are refused -> what the message must offer instead (a key of our schema, or a way out).
# (virtual_pipeline_model_parallel_size=2, model.enable_gradient_checkpointing, use_dynamic_bsz=True and
# ppo_max_token_len_per_gpu=12000 are accepted: schema keys.)
REFUSED = {
    "actor_rollout_ref.actor.ppo_micro_batch_size=8": ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",),
    "actor_rollout_ref.rollout.log_prob_micro_batch_size=8":
        ("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",),
    "actor_rollout_ref.ref.log_prob_micro_batch_size=8": ("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",),
    "critic.ppo_micro_batch_size=8": ("critic.ppo_micro_batch_size_per_gpu",),
    "actor_rollout_ref.actor.kl_loss.type=low_var_kl": ("actor_rollout_ref.actor.kl_loss_type",
                                                        "actor_rollout_ref.actor.use_kl_loss"),
    "actor_rollout_ref.actor.kl_loss.coef=0.001": ("actor_rollout_ref.actor.kl_loss_coef",),
    "algorithm.in_reward_kl.coef=0": ("algorithm.kl_ctrl.kl_coef", "algorithm.use_kl_in_reward"),
}
PATH_KEYS = ("data.train_files", "data.val_files", "actor_rollout_ref.model.path", "critic.model.path")


def read_overrides(path: Path) -> list[str]:
    return [line for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")]


def header(path: Path) -> dict:
    return dict(re.match(r"# (\w+): (.+)", line).groups() for line in path.read_text().splitlines()[:2])


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    """Tiny stand-ins for the scripts' data and models: a verl-layout GSM8K parquet and a Qwen2 whose heads,
    KV heads and layers divide the scripts' TP=4 / PP=4 x VPP=2 layouts (8 layers: 1 per model chunk)."""
    from test_data import write_verl_gsm8k

    from hybridflow.models.tiny import save_tiny_model

    root = tmp_path_factory.mktemp("verl_local")
    data = root / "gsm8k.parquet"
    write_verl_gsm8k(data)
    model = save_tiny_model(root / "qwen2", preset="tiny4l", arch="qwen2", num_key_value_heads=4,
                            num_hidden_layers=8)
    return {"data": str(data), "model": str(model)}


def localise(line: str, local: dict) -> str:
    key, value = line.split("=", 1)
    if key.startswith(PATH_KEYS[:2]):
        return f"{key}=[{local['data']}]" if value.startswith("[") else f"{key}={local['data']}"
    if key in PATH_KEYS:
        return f"{key}={local['model']}"
    return line


def expected_value(line: str):
    """What the line's value parses to, independently of our loader (a list key given one string is a list)."""
    key, _ = line.split("=", 1)
    value = OmegaConf.select(OmegaConf.from_dotlist([line]), key)
    default = OmegaConf.select(OmegaConf.create(to_dict(load_config())), key)
    if isinstance(default, list) and isinstance(value, str):
        return [value]
    return OmegaConf.to_container(value) if OmegaConf.is_config(value) else value


def test_fixtures_name_their_source():
    assert len(FIXTURES) >= 5
    kinds = set()
    for path in FIXTURES:
        h = header(path)
        assert h["source"].startswith("volcengine/verl examples/") and h["source"].endswith(".sh"), path
        assert re.fullmatch(r"[0-9a-f]{40}", h["commit"]), path
        kinds.add(h["source"].split("/")[2])
    assert kinds == {"ppo_trainer", "grpo_trainer"}


@pytest.mark.parametrize("path", FIXTURES, ids=lambda p: p.stem)
def test_every_key_of_a_verl_script_is_accepted_ignored_or_refused(path, local, caplog):
    defaults = to_dict(load_config())
    for line in read_overrides(path):
        key = line.split("=", 1)[0]
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="hybridflow.config.load"):
            if line in REFUSED:
                with pytest.raises(ConfigError) as err:
                    load_config(None, [localise(line, local)])
                message = str(err.value)
                assert f"'{key}=" in message and "instead:" in message, message
                for want in REFUSED[line]:
                    assert want in message, (want, message)
                    if "." in want and " " not in want:
                        assert is_valid_key(want), want  # the replacement exists in our schema
                continue
            cfg = load_config(None, [localise(line, local)])
        warnings = [r.getMessage() for r in caplog.records if "ignoring verl key" in r.getMessage()]
        if line in IGNORED:
            assert len(warnings) == 1 and key in warnings[0], (line, warnings)
            assert to_dict(cfg) == defaults, line  # dropped: nothing changed
        else:  # accepted: a key of our schema, holding the script's value
            assert not warnings, (line, warnings)
            assert is_valid_key(key), line
            if key not in PATH_KEYS:
                got = OmegaConf.select(OmegaConf.create(to_dict(cfg)), key)
                assert (OmegaConf.to_container(got) if OmegaConf.is_config(got) else got) == expected_value(line)


def classify_fixture_lines() -> dict[str, set[str]]:
    lines = {line for path in FIXTURES for line in read_overrides(path)}
    return {"refused": lines & set(REFUSED), "ignored": lines & IGNORED, "accepted": lines - set(REFUSED) - IGNORED}


def test_every_listed_line_occurs_in_a_fixture():
    classes = classify_fixture_lines()
    assert classes["refused"] == set(REFUSED) and classes["ignored"] == IGNORED
    keys = {c: {line.split("=", 1)[0] for line in lines} for c, lines in classes.items()}
    # over the six scripts: 55 distinct keys accepted (rollout.mode=sync is a schema key now), 1 ignored, 7 refused
    # (printed for the record with -s)
    print({c: len(k) for c, k in keys.items()})


@pytest.mark.parametrize("path", FIXTURES, ids=lambda p: p.stem)
def test_a_pasted_script_passes_the_pre_ray_checks_once_its_refused_keys_are_dropped(path, local):
    from hybridflow.trainer.main import validate

    lines = [localise(line, local) for line in read_overrides(path)]
    refused = [line for line in read_overrides(path) if line in REFUSED]
    if refused:  # all of them in one error, each named
        with pytest.raises(ConfigError) as err:
            load_config(None, lines)
        assert (f"{len(refused)} config keys cannot be used" in str(err.value)) if len(refused) > 1 else True
        for line in refused:
            assert f"'{line.split('=', 1)[0]}=" in str(err.value)
    kept = [localise(line, local) for line in read_overrides(path) if line not in REFUSED]
    cfg = load_config(None, kept)
    validate(cfg)
    given = dict(line.split("=", 1) for line in read_overrides(path))
    # verl's rollout.response_length is ${data.max_response_length}: the script's response budget is used
    assert cfg.actor_rollout_ref.rollout.response_length == int(given["data.max_response_length"])
    assert cfg.trainer.n_gpus_per_node == int(given["trainer.n_gpus_per_node"])
    assert cfg.trainer.logger == given["trainer.logger"].strip("[]").replace('"', "").split(",")
    assert cfg.critic.enable == (given.get("algorithm.adv_estimator", "gae") == "gae")
    # verl's enable_gradient_checkpointing=True became full recompute of every layer (validate applies it)
    for flag, m in (("actor_rollout_ref.model", cfg.actor_rollout_ref.actor.megatron),
                    ("critic.model", cfg.critic.megatron)):
        on = given.get(f"{flag}.enable_gradient_checkpointing") == "True"
        o = m.override_transformer_config
        assert (o.recompute_granularity, o.recompute_method, o.recompute_num_layers) == (
            ("full", "uniform", 1) if on else (None, None, None)), (path.stem, flag)


def test_compat_rules_name_real_replacements():
    """Every key a refusal offers (a dotted name without wildcards) exists in our schema."""
    for rule in verl_compat.RULES:
        assert rule.kind in (verl_compat.IGNORED, verl_compat.REFUSED)
        assert not is_valid_key(rule.pattern), f"{rule.pattern} is a schema key: it needs no rule"
        if rule.kind == verl_compat.REFUSED:
            assert rule.use, rule.pattern
            for name in re.findall(r"(?<![\w.*/])[a-z_]+(?:\.[a-z_]+)+\b", rule.use):
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


def test_docs_tables_are_the_compat_tables():
    assert verl_compat.PAGE == PAGE.resolve()
    text = PAGE.read_text()
    stale = "docs/verl.md is stale: python -m hybridflow.config.verl_compat --write"
    assert verl_compat.markdown_table() in text, stale
    assert verl_compat.differences_table() in text, stale
    assert verl_compat.replace_tables(text) == text, stale  # no leftover rows of an older table either


def test_write_replaces_a_stale_table_and_keeps_the_rest():
    text = PAGE.read_text()
    rows = verl_compat.markdown_table().split("\n")
    stale = text.replace(rows[2], rows[2].replace("refused", "ignored", 1) + "\n| `old.key` | ignored | gone | |")
    assert stale != text
    assert verl_compat.replace_tables(stale) == text
    with pytest.raises(ValueError, match="no table with the header"):
        verl_compat.replace_tables("# a page without the tables\n")


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
    ("+actor_rollout_ref.actor.megatron.override_transformer_config.apply_rope_fusion=true",
     r"'actor_rollout_ref.actor.megatron.override_transformer_config.apply_rope_fusion=True' is refused.*"
     r"only the activation-recompute fields and attention_backend"),
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
    ("actor_rollout_ref.actor.megatron.context_parallel_size=2",
     r"actor_rollout_ref.actor.megatron.context_parallel_size=2: context parallelism needs Transformer Engine's "
     r"attention on GPU"),
])
def test_shared_key_values_are_checked_before_ray(override, match, local):
    from hybridflow.trainer.main import validate

    cfg = load_config(None, [f"actor_rollout_ref.model.path={local['model']}", f"data.train_files=[{local['data']}]",
                             override])
    with pytest.raises(ValueError, match=match):
        validate(cfg)


@pytest.mark.bad_input
def test_critic_warmup_without_a_critic_is_refused(local):
    from hybridflow.trainer.main import validate

    base = [f"actor_rollout_ref.model.path={local['model']}", f"data.train_files=[{local['data']}]",
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

    cfg = load_config(None, [f"actor_rollout_ref.model.path={local['model']}", f"data.train_files=[{local['data']}]",
                             "actor_rollout_ref.rollout.gpu_memory_utilization=0.4",
                             "actor_rollout_ref.actor.megatron.param_offload=True"])
    with caplog.at_level(logging.INFO, logger="hybridflow"):
        validate(cfg)
    text = caplog.text
    assert text.count("gpu_memory_utilization=0.4 is a GPU memory fraction, not used on CPU") == 1
    assert "kv_cache_memory_bytes=268435456 (256 MiB)" in text
    assert "actor_rollout_ref.actor.megatron.param_offload: no CUDA" in text
