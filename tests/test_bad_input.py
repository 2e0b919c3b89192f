"""Bad input fails fast, before any worker starts, with an error that names the key, file or row.

One test per case (issue 14: "Bad input: at least 30 cases"). No Ray, no workers, no megatron processes: the
checks run in the driver (load_config, trainer.main.validate, hybridflow.config.checks, RLDataset, the reward
manager, the resume-path check), on real files written here: a tiny HF model saved by hybridflow.models.tiny,
damaged copies of it, and parquet files. Two cases go through `python -m hybridflow.trainer.main` itself.

Cases that an older test already covers (a typo'd key, the reward model's and critic's layouts, the val-file and
val_kwargs checks, a data file lacking data_source or reward_model.ground_truth, a reward scorer that raises,
returns NaN or hangs at run time) are not repeated; the ones here are new cases.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from hybridflow.config.load import ConfigError, load_config

pytestmark = pytest.mark.bad_input
REPO = Path(__file__).resolve().parents[1]


def _row(prompt, truth="abc", source="hybridflow/reverse"):
    return {"prompt": prompt, "data_source": source, "reward_model": {"ground_truth": truth, "style": "rule"}}


def _chat(text):
    return [{"role": "user", "content": text}]


def write_rows(path: Path, rows: list[dict]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from hybridflow.models.tiny import save_tiny_model

    root = tmp_path_factory.mktemp("bad_input")
    return {"root": root,
            "model": save_tiny_model(root / "policy"),  # 4 heads, 2 kv heads, 2 layers, ffn 128
            "model_ffn130": save_tiny_model(root / "ffn130", num_key_value_heads=4, intermediate_size=130),
            "data": write_rows(root / "train.parquet", [_row(_chat(f"reverse: {w}"), w[::-1]) for w in
                                                        ("abc", "hello", "xyz", "qwerty")])}


def _cfg(files, *overrides):
    return load_config(None, [f"actor_rollout_ref.model.path={files['model']}",
                              f"data.train_files=[{files['data']}]", *overrides])


def _validate(files, *overrides):
    from hybridflow.trainer.main import validate

    cfg = _cfg(files, *overrides)
    validate(cfg)
    return cfg


def _model_copy(files, tmp_path, name="m") -> Path:
    return Path(shutil.copytree(files["model"], tmp_path / name))


def test_the_base_config_passes(files):
    """The fixture itself is good, so every failure below is the one change it makes; and the checks import
    neither megatron nor vLLM nor Ray (when no earlier test in this process has)."""
    before = {m for m in ("megatron.core", "vllm", "ray") if m in sys.modules}
    cfg = _validate(files)
    from hybridflow.config import checks

    checks.data_files(cfg)
    assert {m for m in ("megatron.core", "vllm", "ray") if m in sys.modules} == before


# ---------------------------------------------------------------- config loading: types and shapes

@pytest.mark.parametrize("override, match", [
    ("data.train_batch_size=abc", r"invalid value for config key 'data.train_batch_size': Value 'abc' of type 'str'"),
    ("actor_rollout_ref.actor.optim.lr=[1e-6,1e-5]",
     r"config key 'actor_rollout_ref.actor.optim.lr': Value '\[1e-06, 1e-05\]' .* could not be converted to Float"),
    ("trainer.nnodes=null", r"config key 'trainer.nnodes': Incompatible value 'None'"),
    ("data.train_files={a: 1}", r"'data.train_files' is a list, got a mapping .* write data.train_files=\[a,b\]"),
    ("actor_rollout_ref.model=/models/x", r"'actor_rollout_ref.model' is a section of keys "
                                          r"\(actor_rollout_ref.model.path, .*not a value: got '/models/x'"),
], ids=["str_for_int", "list_for_float", "null_for_int", "mapping_for_list", "value_for_section"])
def test_wrong_types_name_the_key(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, [override])


def test_yaml_whose_top_level_is_a_list(tmp_path):
    (tmp_path / "job.yaml").write_text("- data\n- trainer\n")
    with pytest.raises(ConfigError, match=r"job.yaml: the top level must be a mapping of keys"):
        load_config(tmp_path / "job.yaml")


def test_yaml_that_does_not_parse_names_file_and_line(tmp_path):
    (tmp_path / "job.yaml").write_text("data:\n  train_files: [a.parquet\ntrainer:\n  nnodes: 1\n")
    with pytest.raises(ConfigError, match=r"(?s)config file .*job.yaml is not valid YAML: .*line 2, column 16"):
        load_config(tmp_path / "job.yaml")


def test_unknown_key_deep_in_a_yaml_section(tmp_path):
    (tmp_path / "job.yaml").write_text("trainer:\n  ray:\n    adress: 127.0.0.1:6379\n")
    with pytest.raises(ConfigError, match=r"unknown config key 'trainer.ray.adress' in .*job.yaml; "
                                          r"did you mean 'trainer.ray.address'"):
        load_config(tmp_path / "job.yaml")


# ---------------------------------------------------------------- validate(): layouts, batches, numbers

VALIDATE_CASES = {
    # parallel sizes that do not divide (world = trainer.n_gpus_per_node * nnodes)
    "world_vs_tp": (["trainer.n_gpus_per_node=3", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2"],
                    r"actor_rollout_ref.actor.megatron tp\*pp\*cp=2\*1\*1=2 does not divide the size of its pool "
                    r"'colocated' of 3 processes \(trainer.placement=colocate, "
                    r"trainer.nnodes x n_gpus_per_node = \[3\]\)"),
    "layers_vs_pp": (["trainer.n_gpus_per_node=4", "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=4"],
                     r"actor_rollout_ref.actor.megatron: pp=4 does not divide num_hidden_layers=2"),
    "heads_vs_tp": (["trainer.n_gpus_per_node=3", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=3"],
                    r"actor_rollout_ref.actor.megatron: tp=3 does not divide num_attention_heads=4"),
    "kv_heads_vs_tp": (["trainer.n_gpus_per_node=4", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=4"],
                       r"actor_rollout_ref.actor.megatron: tp=4 does not divide num_key_value_heads=2"),
    "kv_heads_vs_rollout_tp": (["trainer.n_gpus_per_node=4", "actor_rollout_ref.rollout.tensor_model_parallel_size=4"],
                               r"actor_rollout_ref.rollout.tensor_model_parallel_size=4: rollout tp=4 does not "
                               r"divide num_key_value_heads=2"),
    "world_vs_rollout_tp": (["trainer.n_gpus_per_node=4", "actor_rollout_ref.rollout.tensor_model_parallel_size=3"],
                            r"actor_rollout_ref.rollout.tensor_model_parallel_size=3: rollout tp=3 does not divide "
                            r"the world size 4"),
    "tp_zero": (["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=0"],
                r"actor_rollout_ref.actor.megatron.tensor_model_parallel_size=0 must be >= 1"),
    "sp_without_tp": (["actor_rollout_ref.actor.megatron.sequence_parallel=true"],
                      r"actor_rollout_ref.actor.megatron: sequence_parallel=True needs tp > 1"),
    "no_gpus": (["trainer.n_gpus_per_node=0"], r"trainer.n_gpus_per_node=0 must be an integer >= 1"),
    # batch sizes (train_batch_size counts prompts; rows = prompts * rollout.n)
    "train_batch_vs_dp": (["data.train_batch_size=7", "actor_rollout_ref.actor.ppo_mini_batch_size=7"],
                          r"data.train_batch_size=7 is not divisible by the actor dp size 2"),
    "mini_vs_train_batch": (["actor_rollout_ref.actor.ppo_mini_batch_size=3"],
                            r"actor_rollout_ref.actor.ppo_mini_batch_size=3 must divide data.train_batch_size=8"),
    "mini_times_n_vs_dp": (["trainer.n_gpus_per_node=4", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                            "critic.ppo_mini_batch_size=8"],
                           r"actor_rollout_ref.actor.ppo_mini_batch_size \* actor_rollout_ref.rollout.n = 2\*1 = 2 "
                           r"rows per mini-batch is not divisible by the actor dp size 4"),
    "micro_vs_rank_share": (["data.train_batch_size=12", "actor_rollout_ref.actor.ppo_mini_batch_size=6",
                             "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "critic.ppo_mini_batch_size=12"],
                            r"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2 does not divide the 3 rows each "
                            r"of the 2 dp ranks"),
    "critic_mini_vs_train_batch": (["critic.ppo_mini_batch_size=3"],
                                   r"critic.ppo_mini_batch_size=3 must divide data.train_batch_size=8"),
    "critic_micro_zero": (["critic.ppo_micro_batch_size_per_gpu=0"],
                          r"critic.ppo_micro_batch_size_per_gpu=0 must be an integer >= 1"),
    "rollout_n_zero": (["actor_rollout_ref.rollout.n=0"], r"actor_rollout_ref.rollout.n=0 must be an integer >= 1"),
    "train_batch_zero": (["data.train_batch_size=0"], r"data.train_batch_size=0 must be an integer >= 1"),
    "log_prob_micro_zero": (["actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=0"],
                            r"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=0 must be an integer >= 1"),
    # dtype and optimiser numbers
    "dtype_float17": (["actor_rollout_ref.model.dtype=float17"],
                      r"actor_rollout_ref.model.dtype='float17' is not one of \['auto', 'float32'"),
    "critic_dtype": (["critic.model.dtype=int8"], r"critic.model.dtype='int8' is not one of"),
    "actor_lr_negative": (["actor_rollout_ref.actor.optim.lr=-1e-6"],
                          r"actor_rollout_ref.actor.optim.lr=-1e-06 must be a finite number >= 0"),
    "critic_lr_nan": (["critic.optim.lr=nan"], r"critic.optim.lr=nan must be a finite number >= 0"),
    "actor_lr_inf": (["actor_rollout_ref.actor.optim.lr=inf"], r"actor_rollout_ref.actor.optim.lr=inf must be a fin"),
    "lr_scheduler_typo": (["actor_rollout_ref.actor.optim.lr_scheduler=cosinus"],
                          r"actor_rollout_ref.actor.optim.lr_scheduler='cosinus' is not one of"),
    "decay_shorter_than_warmup": (["critic.optim.lr_scheduler=cosine", "critic.optim.lr_warmup_steps=10",
                                   "trainer.total_training_steps=5"],
                                  r"critic.optim.lr_scheduler='cosine' needs total_training_steps > lr_warmup_steps"),
    "clip_grad_zero": (["actor_rollout_ref.actor.optim.clip_grad=0"],
                       r"actor_rollout_ref.actor.optim.clip_grad=0.0 must be > 0"),
    "beta_above_one": (["actor_rollout_ref.actor.optim.betas=[0.9,1.5]"],
                       r"actor_rollout_ref.actor.optim.betas=\[0.9, 1.5\] must be two numbers in \[0, 1\)"),
    # sampling and lengths
    "temperature_zero": (["actor_rollout_ref.rollout.temperature=0"],
                         r"actor_rollout_ref.rollout.temperature=0.0 must be > 0: training rollouts are sampled"),
    "top_p_above_one": (["actor_rollout_ref.rollout.top_p=1.5"], r"actor_rollout_ref.rollout.top_p=1.5 must be in"),
    "top_k_negative": (["actor_rollout_ref.rollout.top_k=-2"],
                       r"actor_rollout_ref.rollout.top_k=-2 must be -1 or 0 \(off\), or >= 1"),
    "response_length_zero": (["data.max_response_length=0"],
                             r"actor_rollout_ref.rollout.response_length=0 must be an integer >= 1"),
    "max_prompt_length_negative": (["data.max_prompt_length=-5"], r"data.max_prompt_length=-5 must be an integer"),
    # trainer
    "save_freq_zero": (["trainer.save_freq=0"], r"trainer.save_freq=0: save every N >= 1 steps, or -1"),
    "keep_zero_checkpoints": (["trainer.max_ckpt_to_keep=0"], r"trainer.max_ckpt_to_keep=0 must be >= 1"),
    "total_steps_zero": (["trainer.total_training_steps=0"], r"trainer.total_training_steps=0 must be >= 1"),
    "ray_timeout_zero": (["trainer.ray.timeout_s=0"], r"trainer.ray.timeout_s=0.0 must be > 0"),
    "reward_timeout_zero": (["custom_reward_function.timeout_s=0"],
                            r"custom_reward_function.timeout_s=0.0 must be > 0"),
    "kl_in_reward_with_no_old_log_probs": (
        ["actor_rollout_ref.recompute_old_log_prob=false", "algorithm.use_kl_in_reward=true",
         "actor_rollout_ref.rollout.calculate_log_probs=false"],
        r"recompute_old_log_prob=false with algorithm.use_kl_in_reward=true needs the rollout's log-probs: set "
        r"actor_rollout_ref.rollout.calculate_log_probs=true"),
    # precision (hybridflow/precision.py): refused before Ray, naming the key
    "fp16_on_cpu": (["actor_rollout_ref.model.dtype=fp16", "trainer.device=cpu"],
                    r"actor_rollout_ref.model.dtype=fp16: fp16 is not supported on CPU; use bfloat16"),
    "critic_fp16_on_gpu": (["critic.model.dtype=float16", "trainer.device=cuda"],
                           r"critic.model.dtype=float16: training in fp16 needs a loss scaler"),
    "device_typo": (["trainer.device=gpu"], r"trainer.device='gpu'; choose one of auto, cpu, cuda"),
}


@pytest.mark.parametrize("name", list(VALIDATE_CASES))
def test_validate_names_the_key(files, name):
    overrides, match = VALIDATE_CASES[name]
    with pytest.raises(ValueError, match=match):
        _validate(files, *overrides)


def test_bf16_on_a_cpu_without_native_bf16_is_refused_unless_forced(files, monkeypatch, caplog):
    """HYBRIDFLOW_CPU_BF16=0 stands for a CPU without amx_bf16/avx512_bf16: an explicit bf16 is refused naming the
    key, auto falls back to fp32, and trainer.force_slow_bf16 runs it with the slowdown measured in the warning."""
    import logging

    monkeypatch.setenv("HYBRIDFLOW_CPU_BF16", "0")
    with pytest.raises(ValueError, match=r"critic.model.dtype=bf16: this CPU has no native bf16 .*"
                                         r"trainer.force_slow_bf16=true"):
        _validate(files, "critic.model.dtype=bf16", "trainer.device=cpu")
    with caplog.at_level(logging.INFO, logger="hybridflow"):
        _validate(files, "trainer.device=cpu")
    assert "actor_rollout_ref float32 (auto: this CPU has no native bf16)" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="hybridflow"):
        _validate(files, "actor_rollout_ref.model.dtype=bfloat16", "trainer.device=cpu", "trainer.force_slow_bf16=true")
    assert re.search(r"actor_rollout_ref.model.dtype: bf16 on a CPU without native bf16 .* a bf16 matmul measured "
                     r"[0-9.]+x the fp32 speed here", caplog.text), caplog.text


def test_ffn_vs_tp(files):
    with pytest.raises(ValueError, match=r"actor_rollout_ref.actor.megatron: tp=4 does not divide "
                                         r"intermediate_size=130"):
        load = _cfg(files, f"actor_rollout_ref.model.path={files['model_ffn130']}", "trainer.n_gpus_per_node=4",
                    "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=4")
        from hybridflow.trainer.main import validate

        validate(load)


def test_train_file_that_does_not_exist(files, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"data.train_files: .*nowhere.parquet does not exist"):
        _validate(files, f"data.train_files=[{files['data']},{tmp_path / 'nowhere.parquet'}]")


def test_no_train_files(files):
    with pytest.raises(ValueError, match="data.train_files is empty"):
        _validate(files, "data.train_files=[]")


def test_nan_lr_is_refused_by_the_workers_schedule_too():
    """The worker-side rule (LRSchedule) used to let NaN through: `nan < 0` is False."""
    from megatron_workers.optimizer import LRSchedule

    with pytest.raises(ValueError, match=r"optim.lr=nan must be a finite number >= 0"):
        LRSchedule(base_lr=math.nan)


# ---------------------------------------------------------------- a missing or corrupt model

def test_truncated_safetensors(files, tmp_path):
    model = _model_copy(files, tmp_path)
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ValueError, match=rf"actor_rollout_ref.model.path='{model}': .*model.safetensors: "
                                         r"truncated safetensors file"):
        _validate(files, f"actor_rollout_ref.model.path={model}")


def test_no_weights_at_all(files, tmp_path):
    model = _model_copy(files, tmp_path)
    (model / "model.safetensors").unlink()
    with pytest.raises(ValueError, match=r"actor_rollout_ref.model.path=.*neither model.safetensors.index.json nor "
                                         r"model.safetensors exists"):
        _validate(files, f"actor_rollout_ref.model.path={model}")


def test_weights_missing_a_tensor_the_loader_needs(files, tmp_path):
    from safetensors.torch import load_file, save_file

    model = _model_copy(files, tmp_path)
    tensors = load_file(model / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"actor_rollout_ref.model.path=.*model.safetensors: missing tensors "
                                         r"\['model.layers.1.mlp.down_proj.weight'\]"):
        _validate(files, f"actor_rollout_ref.model.path={model}")


def test_a_model_type_the_builder_does_not_map(files, tmp_path):
    model = _model_copy(files, tmp_path)
    config = json.loads((model / "config.json").read_text())
    config.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"actor_rollout_ref.model.path=.*model_type='gpt2' is not supported"):
        _validate(files, f"actor_rollout_ref.model.path={model}")


def test_config_json_that_is_not_json(files, tmp_path):
    model = _model_copy(files, tmp_path)
    text = (model / "config.json").read_text()
    (model / "config.json").write_text(text[: len(text) // 2])  # cut mid-object, as an interrupted copy leaves it
    with pytest.raises(ValueError, match=r"actor_rollout_ref.model.path=.*config.json is not valid JSON"):
        _validate(files, f"actor_rollout_ref.model.path={model}")


def test_config_json_missing_keys(files, tmp_path):
    model = _model_copy(files, tmp_path)
    config = json.loads((model / "config.json").read_text())
    del config["num_attention_heads"], config["vocab_size"]
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"config.json lacks \['num_attention_heads', 'vocab_size'\]"):
        _validate(files, f"actor_rollout_ref.model.path={model}")


def test_config_json_with_a_string_for_a_size(files, tmp_path):
    model = _model_copy(files, tmp_path)
    config = json.loads((model / "config.json").read_text())
    config["hidden_size"] = "64"
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"config.json has \{'hidden_size': '64'\}; these must be positive integers"):
        _validate(files, f"actor_rollout_ref.model.path={model}")


def test_critic_model_with_a_bad_config_json_names_the_critic(files, tmp_path):
    critic = _model_copy(files, tmp_path, "critic")
    (critic / "config.json").write_text("[]")
    with pytest.raises(ValueError, match=r"critic.model.path=.*config.json holds a list, not a JSON object"):
        _validate(files, f"critic.model.path={critic}")


def test_missing_tokenizer_files(files, tmp_path):
    model = _model_copy(files, tmp_path)
    (model / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"actor_rollout_ref.model.path=.* has no tokenizer \(none of "
                                                r"tokenizer.json, tokenizer.model, vocab.json\)"):
        _validate(files, f"actor_rollout_ref.model.path={model}")


def test_tokenizer_that_does_not_load(files, tmp_path):
    from hybridflow.config import checks

    tok = tmp_path / "tok"
    tok.mkdir()
    for name in ("tokenizer_config.json", "tokenizer.json"):
        shutil.copy(files["model"] / name, tok / name)
    (tok / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    cfg = _validate(files, f"actor_rollout_ref.model.tokenizer_path={tok}")  # the file is there: validate passes
    with pytest.raises(ValueError, match=r"actor_rollout_ref.model.tokenizer_path=.*tok': the tokenizer does not "
                                         r"load"):
        checks.data_files(cfg)


# ---------------------------------------------------------------- data rows and files

def _dataset(path, **kw):
    from hybridflow.data.rl_dataset import RLDataset
    from hybridflow.models.tiny import build_tokenizer

    return RLDataset([str(path)], build_tokenizer(), max_prompt_length=kw.pop("max_prompt_length", 64), **kw)


@pytest.mark.parametrize("rows, match", [
    ([_row(_chat("ok")), _row(None)], r"row 1: column 'prompt' must be a string or a list of chat messages, got "
                                      r"NoneType"),
    ([_row("ok"), _row("ok"), _row("")], r"row 2: column 'prompt' is empty \(no text in any message\)"),
    ([_row("ok"), _row("  \n ")], r"row 1: column 'prompt' is empty"),
    ([_row([]), _row(_chat("ok"))], r"row 0: column 'prompt' is an empty list of chat messages"),
    ([_row(_chat("ok")), _row([{"role": "user", "content": None}])],
     r"row 1: column 'prompt': message 0 has content of type NoneType \(None\), not a string"),
    ([_row(7), _row(8)], r"row 0: column 'prompt' must be a string or a list of chat messages, got int: 7"),
], ids=["null", "empty_string", "whitespace", "empty_message_list", "null_content", "int"])
def test_bad_prompts_name_the_row(tmp_path, rows, match):
    path = write_rows(tmp_path / "bad.parquet", rows)
    with pytest.raises(ValueError, match=rf"data file '.*bad.parquet' {match}"):
        _dataset(path)


def test_null_ground_truth_names_the_row(tmp_path):
    path = write_rows(tmp_path / "gt.parquet", [_row("a"), _row("b"), _row("c", truth=None)])
    with pytest.raises(ValueError, match=r"gt.parquet' row 2: reward_model has no ground_truth"):
        _dataset(path)


def test_null_reward_model_struct_names_the_row(tmp_path):
    rows = [_row("a"), {**_row("b"), "reward_model": None}]
    path = write_rows(tmp_path / "rm.parquet", rows)
    with pytest.raises(ValueError, match=r"rm.parquet' row 1: reward_model has no ground_truth \(None\)"):
        _dataset(path)


def test_null_data_source_names_the_row(tmp_path):
    path = write_rows(tmp_path / "src.parquet", [_row("a"), _row("b", source=None)])
    with pytest.raises(ValueError, match=r"src.parquet' row 1: data_source is None; it names the reward scorer"):
        _dataset(path)


def test_data_source_without_a_scorer_fails_before_the_first_reward_stage(files, tmp_path):
    from hybridflow.config import checks

    data = write_rows(tmp_path / "mine.parquet", [_row("a"), _row("b"), _row("c", source="my/dataset")])
    cfg = _validate(files, f"data.train_files=[{data}]")
    with pytest.raises(ValueError, match=r"mine.parquet' row 2: data_source 'my/dataset' has no rule scorer \(1 rows"):
        checks.data_files(cfg)
    reward = _reward_file(tmp_path, "def compute_score(data_source, solution_str, ground_truth, extra_info):\n"
                                    "    return 0.0\n")
    checks.data_files(_validate(files, f"data.train_files=[{data}]", f"custom_reward_function.path={reward}"))


def test_missing_reward_model_column(tmp_path):
    path = write_rows(tmp_path / "cols.parquet", [{"prompt": "a", "data_source": "s"}])
    with pytest.raises(KeyError, match=r"cols.parquet' has no column 'reward_model' \(columns: \['prompt', "
                                       r"'data_source'\]\)"):
        _dataset(path)


def test_a_file_that_is_not_parquet(tmp_path):
    path = tmp_path / "train.parquet"
    path.write_text("prompt,data_source\nhello,openai/gsm8k\n")  # a CSV under a parquet name
    with pytest.raises(ValueError, match=r"data file '.*train.parquet' is not a readable parquet file"):
        _dataset(path)


def test_a_parquet_file_with_no_rows(tmp_path):
    schema = pa.Table.from_pylist([_row("a")]).schema
    path = tmp_path / "empty.parquet"
    pq.write_table(schema.empty_table(), path)
    with pytest.raises(ValueError, match=r"data file '.*empty.parquet' has no rows"):
        _dataset(path)


def test_overlong_val_prompt_with_filtering_off_names_the_val_file_and_row(files, tmp_path):
    """data.filter_overlong_prompts=false, data.truncation=error: checked up front (checks.data_files, which
    main() runs before Ray), for the val files as for the train files, with the file's own row number."""
    from hybridflow.config import checks

    val = write_rows(tmp_path / "val.parquet", [_row("short"), _row("x" * 200), _row("short too")])
    cfg = _validate(files, f"data.val_files=[{val}]", "trainer.test_freq=1", "data.max_prompt_length=40",
                    "data.filter_overlong_prompts=false", "data.truncation=error")
    with pytest.raises(ValueError, match=r"data file '.*val.parquet' row 1: prompt has \d+ tokens > "
                                         r"data.max_prompt_length=40 and data.truncation='error'"):
        checks.data_files(cfg)
    cfg.data.truncation = "left"
    checks.data_files(cfg)  # cut instead: passes


# ---------------------------------------------------------------- reward functions

def _reward_file(tmp_path, body, name="reward.py") -> Path:
    path = tmp_path / name
    path.write_text(body)
    return path


def test_reward_file_that_does_not_import_fails_in_validate(files, tmp_path):
    path = _reward_file(tmp_path, "def compute_score(data_source, solution_str, ground_truth, extra_info):\n"
                                  "    return 1.0 +\n")
    with pytest.raises(ValueError, match=r"custom_reward_function.path='.*reward.py' name='compute_score': importing "
                                         r"custom reward file .* failed: SyntaxError"):
        _validate(files, f"custom_reward_function.path={path}")


def test_reward_function_name_that_is_missing_fails_in_validate(files, tmp_path):
    path = _reward_file(tmp_path, "def compute_score(data_source, solution_str, ground_truth, extra_info):\n"
                                  "    return 1.0\n")
    with pytest.raises(ValueError, match=r"name='score_fn': custom reward file .* has no function 'score_fn'; it "
                                         r"defines: \['compute_score'\]"):
        _validate(files, f"custom_reward_function.path={path}", "custom_reward_function.name=score_fn")


@pytest.mark.serial  # timing: a 0.5 s limit must end it within 3.5 s
def test_reward_file_whose_import_hangs_fails_in_validate(files, tmp_path, monkeypatch):
    """A top level that does not return (here: 4 s, standing for forever) is bounded at start."""
    from hybridflow.rewards import user_fn

    monkeypatch.setattr(user_fn, "IMPORT_TIMEOUT_S", 0.5)
    path = _reward_file(tmp_path, "import time\ntime.sleep(4)\n"
                                  "def compute_score(data_source, solution_str, ground_truth, extra_info):\n"
                                  "    return 1.0\n")
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"custom_reward_function.path=.*reward.py' did not finish in 0.5 s"):
        _validate(files, f"custom_reward_function.path={path}")
    assert time.monotonic() - start < 3.5


def test_reward_function_with_the_wrong_signature_fails_in_validate(files, tmp_path):
    """Called per sample it would raise on every one, each scored 0 and only counted: refused up front."""
    path = _reward_file(tmp_path, "def compute_score(solution_str, ground_truth):\n    return 1.0\n")
    with pytest.raises(ValueError, match=r"compute_score\(solution_str, ground_truth\) in custom reward file .* "
                                         r"cannot be called as compute_score\(data_source, solution_str, "
                                         r"ground_truth, extra_info\)"):
        _validate(files, f"custom_reward_function.path={path}")


def test_reward_that_returns_a_non_number_or_inf_scores_zero_and_is_counted(tmp_path):
    """Per-sample runtime failures do not stop the run (a decision: one odd response must not cost the job),
    but they are counted in reward/num_errors and never reach the scores as a non-number."""
    from hybridflow.config.schema import CustomRewardConfig
    from hybridflow.rewards.manager import RewardManager

    path = _reward_file(tmp_path, (
        "def compute_score(data_source, solution_str, ground_truth, extra_info):\n"
        "    return {'text': 'yes', 'inf': float('inf'), 'none': None}.get(solution_str, 1.0)\n"))
    mgr = RewardManager.from_config(CustomRewardConfig(path=str(path), timeout_s=2.0))
    scores, metrics = mgr.score(["text", "ok", "inf", "none"], ["t"] * 4, ["any/source"] * 4)
    np.testing.assert_array_equal(scores, np.array([0.0, 1.0, 0.0, 0.0], dtype=np.float32))
    assert metrics["reward/num_errors"] == 3 and metrics["reward/num_timeouts"] == 0


def test_a_nan_reward_does_not_reach_the_advantages(tmp_path):
    """A user function returning NaN for one sample of a GRPO group: that sample scores 0 (counted), and the
    group's advantages are finite and equal to those of the same group scored (1, 0) by hand."""
    from hybridflow.algorithms.advantages import compute_grpo
    from hybridflow.config.schema import CustomRewardConfig
    from hybridflow.rewards.manager import RewardManager, scores_to_token_level

    path = _reward_file(tmp_path, (
        "def compute_score(data_source, solution_str, ground_truth, extra_info):\n"
        "    return float('nan') if solution_str == 'bad' else 1.0\n"))
    mgr = RewardManager.from_config(CustomRewardConfig(path=str(path)))
    scores, metrics = mgr.score(["good", "bad"], ["t", "t"], ["s", "s"])
    assert metrics["reward/num_errors"] == 1
    mask = torch.ones(2, 3)
    adv, _ = compute_grpo(scores_to_token_level(scores, mask), mask, index=np.array([0, 0]))
    expected, _ = compute_grpo(scores_to_token_level(np.array([1.0, 0.0]), mask), mask, index=np.array([0, 0]))
    assert torch.isfinite(adv).all() and torch.equal(adv, expected)


# ---------------------------------------------------------------- resume paths

def _checkpoint(root: Path, step: int, complete: bool = True, roles=("actor", "critic"), state=None) -> Path:
    d = root / f"global_step_{step}"
    for role in roles:
        (d / role).mkdir(parents=True)
    (d / "trainer_state.json").write_text(json.dumps(state or {"global_step": step, "sampler": {}}))
    if complete:
        (d / "COMPLETE").write_text(str(step))
    return d


def test_resume_path_that_does_not_exist(files, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"trainer.resume_mode='.*nowhere': not 'auto', 'disable' or an "
                                                r"existing checkpoint directory"):
        _validate(files, f"trainer.resume_mode={tmp_path / 'nowhere'}")


def test_resume_path_that_is_not_a_checkpoint(files):
    with pytest.raises(ValueError, match=rf"trainer.resume_mode='{files['model']}' has no COMPLETE marker"):
        _validate(files, f"trainer.resume_mode={files['model']}")


def test_resume_path_of_an_incomplete_save(files, tmp_path):
    partial = _checkpoint(tmp_path, 4, complete=False)
    with pytest.raises(ValueError, match=r"global_step_4' has no COMPLETE marker: not a checkpoint, or one whose "
                                         r"save did not finish"):
        _validate(files, f"trainer.resume_mode={partial}")


def test_resume_path_that_is_the_checkpoint_root_names_the_newest(files, tmp_path):
    _checkpoint(tmp_path, 2)
    newest = _checkpoint(tmp_path, 10)
    _checkpoint(tmp_path, 12, complete=False)
    with pytest.raises(ValueError, match=rf"is a checkpoint root, not a checkpoint: pass {newest} "):
        _validate(files, f"trainer.resume_mode={tmp_path}")
    _validate(files, f"trainer.resume_mode={newest}")  # the named one passes


def test_resume_into_a_critic_run_from_a_checkpoint_without_a_critic(files, tmp_path):
    ckpt = _checkpoint(tmp_path, 3, roles=("actor",))
    with pytest.raises(ValueError, match=r"global_step_3': no critic directory in the checkpoint"):
        _validate(files, f"trainer.resume_mode={ckpt}")  # gae: the critic is on
    _validate(files, f"trainer.resume_mode={ckpt}", "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2")


def test_resume_path_with_a_corrupt_trainer_state(files, tmp_path):
    ckpt = _checkpoint(tmp_path, 5)
    (ckpt / "trainer_state.json").write_text('{"global_step": 5, "samp')
    with pytest.raises(ValueError, match=r"global_step_5': trainer_state.json is missing or unreadable"):
        _validate(files, f"trainer.resume_mode={ckpt}")


# ---------------------------------------------------------------- through the real entry point

def _main(tmp_path, *overrides) -> tuple[subprocess.CompletedProcess, float]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_TMPDIR": str(tmp_path / "ray")}
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "hybridflow.trainer.main", *overrides,
                           f"trainer.default_local_dir={tmp_path / 'run'}"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    return proc, time.monotonic() - start


def test_main_exits_2_on_a_bad_lr_before_ray(files, tmp_path):
    proc, elapsed = _main(tmp_path, f"actor_rollout_ref.model.path={files['model']}",
                          f"data.train_files=[{files['data']}]", "actor_rollout_ref.actor.optim.lr=nan")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "config error: actor_rollout_ref.actor.optim.lr=nan must be a finite number >= 0" in proc.stderr
    assert "Traceback" not in proc.stderr
    # Ray never started: its temp dir and the run directory (written just before ray.init) do not exist.
    assert not (tmp_path / "ray").exists() and not (tmp_path / "run").exists()
    print(f"main: config error after {elapsed:.1f} s (imports included)")
    assert elapsed < 60  # a few seconds alone; generous for a loaded shared machine


def test_main_exits_2_on_a_bad_data_row_before_ray(files, tmp_path):
    data = write_rows(tmp_path / "rows.parquet", [_row("ok"), _row("ok"), _row(""), _row("ok")])
    proc, elapsed = _main(tmp_path, f"actor_rollout_ref.model.path={files['model']}", f"data.train_files=[{data}]")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "config error: data file" in proc.stderr and "rows.parquet' row 2: column 'prompt' is empty" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "ray").exists() and not (tmp_path / "run").exists()
    print(f"main: data error after {elapsed:.1f} s (imports included)")
