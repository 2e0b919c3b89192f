"""Bad MoE input fails in trainer.main.validate, before Ray or any process starts, naming the key or tensor.

The same driver-side checks as tests/test_bad_input.py, on a tiny Qwen3-MoE written by hybridflow.models.tiny
(8 experts, top-2) and damaged copies of it.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hybridflow.config.load import load_config

pytestmark = [pytest.mark.moe, pytest.mark.bad_input]
ACTOR = "actor_rollout_ref.actor.megatron"
R3 = ["actor_rollout_ref.actor.router_replay.mode=R3", "actor_rollout_ref.rollout.enable_rollout_routing_replay=true"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from hybridflow.models.tiny import save_tiny_model

    root = tmp_path_factory.mktemp("moe_bad_input")
    rows = [{"prompt": [{"role": "user", "content": f"reverse: {w}"}], "data_source": "hybridflow/reverse",
             "reward_model": {"ground_truth": w[::-1], "style": "rule"}} for w in ("abc", "hello", "xyz", "qwerty")]
    pq.write_table(pa.Table.from_pylist(rows), root / "train.parquet")
    return {"model": save_tiny_model(root / "moe", arch="qwen3_moe"), "data": root / "train.parquet"}


def _validate(files, *overrides, model=None):
    from hybridflow.trainer.main import validate

    cfg = load_config(None, [f"actor_rollout_ref.model.path={model or files['model']}",
                             f"data.train_files=[{files['data']}]", "actor_rollout_ref.rollout.name=hf", *overrides])
    validate(cfg)
    return cfg


def test_a_good_moe_config_passes_without_importing_megatron(files):
    """The fixture is good, so each failure below is its one change; EP2 on 2 processes is a valid layout."""
    before = {m for m in ("megatron.core", "vllm", "ray") if m in sys.modules}
    _validate(files, "trainer.n_gpus_per_node=2", f"{ACTOR}.expert_model_parallel_size=2")
    assert {m for m in ("megatron.core", "vllm", "ray") if m in sys.modules} == before


CASES = {
    "experts_not_divisible_by_ep": (
        ["trainer.n_gpus_per_node=6", f"{ACTOR}.expert_model_parallel_size=6"],
        rf"{ACTOR}: expert_model_parallel_size=6 does not divide num_experts=8"),
    "ep_x_etp_does_not_fit_the_world": (
        ["trainer.n_gpus_per_node=2", f"{ACTOR}.expert_model_parallel_size=2",
         f"{ACTOR}.expert_tensor_parallel_size=2"],
        rf"{ACTOR}: expert_model_parallel_size x expert_tensor_parallel_size = 2 x 2 = 4 does not divide the ranks "
        r"of one pipeline stage, tp\*cp\*dp = 1\*1\*2 = 2"),
    "router_dtype": (
        [f"{ACTOR}.override_transformer_config.moe_router_dtype=bf16"],
        rf"{ACTOR}.override_transformer_config.moe_router_dtype='bf16'; choose one of fp32, fp64"),
    "negative_aux_loss": (
        [f"{ACTOR}.override_transformer_config.moe_aux_loss_coeff=-0.01"],
        rf"{ACTOR}.override_transformer_config.moe_aux_loss_coeff=-0.01 must be >= 0"),
    "router_replay_r2": (
        ["actor_rollout_ref.actor.router_replay.mode=R2"],
        r"actor_rollout_ref.actor.router_replay.mode=R2.*R2 \(replaying the old-log-prob forward's own routing\) "
        r"is not supported"),
    "router_replay_typo": (
        ["actor_rollout_ref.actor.router_replay.mode=r3"],
        r"unknown actor_rollout_ref.actor.router_replay.mode='r3'; valid: disabled, R3"),
    "replay_without_recording": (
        ["actor_rollout_ref.actor.router_replay.mode=R3"],
        r"router_replay.mode=R3 with actor_rollout_ref.rollout.enable_rollout_routing_replay=false: routing replay "
        r"needs both"),
    "recording_without_replay": (
        ["actor_rollout_ref.rollout.enable_rollout_routing_replay=true"],
        r"router_replay.mode=disabled with actor_rollout_ref.rollout.enable_rollout_routing_replay=true"),
    "replay_on_vllm": (
        [*R3, "actor_rollout_ref.rollout.name=vllm"],
        r"router_replay.mode=R3 needs actor_rollout_ref.rollout.name=hf"),
    "replay_with_recompute": (
        [*R3, f"{ACTOR}.override_transformer_config.recompute_granularity=selective",
         f"{ACTOR}.override_transformer_config.attention_backend=unfused"],
        r"router_replay.mode=R3 with .*recompute_granularity=selective: a recomputed forward would route by itself"),
    "vllm_replicas_split_experts": (
        ["trainer.n_gpus_per_node=4", f"{ACTOR}.expert_model_parallel_size=2", "actor_rollout_ref.rollout.name=vllm",
         "actor_rollout_ref.rollout.tensor_model_parallel_size=2"],
        r"rollout.tensor_model_parallel_size=2 on 4 processes is 2 vLLM data-parallel replicas: vLLM then splits "
        r"each expert over DP x TP ranks"),
    "vllm_on_cuda": (  # the GPU's direct copy into vLLM has no expert path yet: refused before Ray, not at the sync
        ["trainer.device=cuda", "actor_rollout_ref.rollout.name=vllm"],
        r"rollout.name=vllm with an MoE actor on CUDA \(trainer.device\): .* does not handle experts yet"),
    "tp_without_sp": (  # null (the default) turns it on for MoE under TP; an explicit false is refused
        ["trainer.n_gpus_per_node=2", f"{ACTOR}.tensor_model_parallel_size=2", f"{ACTOR}.sequence_parallel=false"],
        rf"{ACTOR}: an MoE model at tensor_model_parallel_size=2 needs sequence_parallel=true"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_moe_layout_and_options_name_the_key(files, name):
    overrides, match = CASES[name]
    with pytest.raises(ValueError, match=match):
        _validate(files, *overrides)


def test_ep_on_a_dense_model_names_the_key(files, tmp_path):
    from hybridflow.models.tiny import save_tiny_model

    dense = save_tiny_model(tmp_path / "dense")
    with pytest.raises(ValueError, match=rf"{ACTOR}: expert_model_parallel_size=2, .*the model is dense"):
        _validate(files, "trainer.n_gpus_per_node=2", f"{ACTOR}.expert_model_parallel_size=2", model=dense)


def test_routing_replay_on_a_dense_model_is_refused(files, tmp_path):
    from hybridflow.models.tiny import save_tiny_model

    dense = save_tiny_model(tmp_path / "dense")
    with pytest.raises(ValueError, match=r"router_replay.mode=R3: the actor model .* is dense; routing replay needs "
                                         r"an MoE model"):
        _validate(files, *R3, model=dense)


def test_a_checkpoint_missing_an_expert_tensor_names_it(files, tmp_path):
    from safetensors.torch import load_file, save_file

    model = Path(shutil.copytree(files["model"], tmp_path / "m"))
    tensors = load_file(model / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.6.up_proj.weight"]
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"actor_rollout_ref.model.path=.*model.safetensors: missing tensors "
                                         r"\['model.layers.1.mlp.experts.6.up_proj.weight'\]"):
        _validate(files, model=model)


@pytest.mark.parametrize("model_type, what", [
    ("deepseek_v3", "DeepSeek's grouped sigmoid routing"), ("glm4_moe", "GLM-4.5's sigmoid routing")])
def test_an_unsupported_router_is_named(files, tmp_path, model_type, what):
    model = Path(shutil.copytree(files["model"], tmp_path / "m"))
    config = json.loads((model / "config.json").read_text())
    config.update(model_type=model_type, architectures=["SomethingForCausalLM"])
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=rf"actor_rollout_ref.model.path=.*model_type='{model_type}' is not "
                                         rf"supported: {what}"):
        _validate(files, model=model)


def test_partly_dense_moe_models_are_refused(files, tmp_path):
    model = Path(shutil.copytree(files["model"], tmp_path / "m"))
    config = json.loads((model / "config.json").read_text())
    config.update(mlp_only_layers=[0])
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"qwen3_moe with decoder_sparse_step=1, mlp_only_layers=\[0\]: only models "
                                         r"whose every layer is sparse are mapped"):
        _validate(files, model=model)
