"""Bad inputs fail early with the numbers / file in the message, before megatron is imported or weights read."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "mcore_scripts"))

from mcore_cases import save_llama_vocab300  # noqa: E402

from hybridflow.parallel.dims import LayoutError, ParallelDims  # noqa: E402
from hybridflow.ports import free_port  # noqa: E402
from megatron_workers import hf_io, hf_mapping, model_builder, parallel_init  # noqa: E402
from megatron_workers.model_builder import UnsupportedModelError  # noqa: E402

LLAMA = dict(model_type="llama", architectures=["LlamaForCausalLM"], num_hidden_layers=4, hidden_size=64,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=129, vocab_size=300,
             rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


@pytest.mark.parametrize("dims, message", [
    (ParallelDims(tp=3, dp=1), "tp=3 does not divide num_attention_heads=4"),
    (ParallelDims(tp=4), "tp=4 does not divide num_key_value_heads=2"),
    (ParallelDims(tp=2, pp=1), "tp=2 does not divide intermediate_size=129"),
    (ParallelDims(pp=3), "pp=3 does not divide num_hidden_layers=4"),
])
def test_layout_errors_name_the_numbers_before_megatron_import(dims, message):
    cfg = dict(LLAMA, intermediate_size=129 if "intermediate" in message else 128)
    already = "megatron.core" in sys.modules
    with pytest.raises(LayoutError, match=message):
        model_builder.build_transformer_config(cfg, dims)
    if not already:
        assert "megatron.core" not in sys.modules  # failed before the 10 s import


@pytest.mark.parametrize("change, message", [
    (dict(model_type="gpt2", architectures=["GPT2LMHeadModel"]),
     r"model_type='gpt2' is not supported; supported: llama \(LlamaForCausalLM\), mistral"),
    (dict(architectures=["MistralForCausalLM"]), r"architectures=\['MistralForCausalLM'\] is not supported"),
    (dict(rope_parameters={"rope_type": "llama3", "rope_theta": 5e5}), "rope_type='llama3' is not supported"),
    (dict(attention_bias=True), "llama with attention_bias=True is not supported"),
    (dict(hidden_act="gelu"), "hidden_act='gelu' is not supported"),
])
def test_unsupported_models_are_named(change, message):
    with pytest.raises(UnsupportedModelError, match=message):
        model_builder.read_hf_facts(dict(LLAMA, **change))


def test_mistral_and_qwen2_are_accepted_and_read():
    mistral = dict(LLAMA, model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=None)
    facts = model_builder.read_hf_facts(mistral)
    assert (facts.num_kv_heads, facts.head_dim, facts.rope_theta, facts.qkv_bias) == (2, 16, 10000.0, False)
    qwen = dict(LLAMA, model_type="qwen2", architectures=["Qwen2ForCausalLM"], rope_theta=1e6,
                rope_parameters=None, tie_word_embeddings=True)
    facts = model_builder.read_hf_facts(qwen)
    assert facts.qkv_bias and facts.tie_word_embeddings and facts.rope_theta == 1e6


def test_world_size_mismatch_and_missing_env(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    if not torch.distributed.is_initialized():
        with pytest.raises(RuntimeError, match=r"\['RANK', 'WORLD_SIZE', 'MASTER_ADDR', 'MASTER_PORT'\]"):
            parallel_init.init_distributed(timeout_s=10)
    port = free_port()
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    created = not torch.distributed.is_initialized()
    try:
        parallel_init.init_distributed(timeout_s=10)
        with pytest.raises(LayoutError, match=r"world size 1 != tp\*pp\*dp\*cp = 2\*1\*1\*1 = 2"):
            parallel_init.init_model_parallel(ParallelDims(tp=2))
    finally:
        if created and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return save_llama_vocab300(tmp_path_factory.mktemp("ckpt") / "llama300", sharded=False)


def _needed(cfg):
    return {h for n in hf_mapping.mcore_param_names(cfg) for h in hf_mapping.describe(n, cfg).hf_names}


def test_checkpoint_ok_then_truncated(llama_dir, tmp_path):
    cfg = hf_io.read_hf_config(llama_dir)
    assert set(hf_io.check_checkpoint(llama_dir, _needed(cfg))) >= _needed(cfg)
    bad = tmp_path / "truncated"
    bad.mkdir()
    (bad / "config.json").write_text((llama_dir / "config.json").read_text())
    data = (llama_dir / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: len(data) - 1000])
    with pytest.raises(hf_io.CheckpointError, match=r"truncated/model.safetensors: truncated safetensors file"):
        hf_io.check_checkpoint(bad, _needed(cfg))
    (bad / "model.safetensors").write_bytes(data[:5])
    with pytest.raises(hf_io.CheckpointError, match="the header length alone is 8"):
        hf_io.check_checkpoint(bad, _needed(cfg))


def test_checkpoint_missing_file_tensor_and_config(llama_dir, tmp_path):
    cfg = hf_io.read_hf_config(llama_dir)
    names = sorted(_needed(cfg))
    # a sharded checkpoint whose index points at a shard that is not there
    index = {"metadata": {}, "weight_map": {n: ("model-00002-of-00002.safetensors" if "layers.3" in n
                                                  else "model-00001-of-00002.safetensors") for n in names}}
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    (sharded / "model-00001-of-00002.safetensors").write_bytes((llama_dir / "model.safetensors").read_bytes())
    with pytest.raises(hf_io.CheckpointError, match="model-00002-of-00002.safetensors: safetensors file is missing"):
        hf_io.check_checkpoint(sharded, names)
    with pytest.raises(hf_io.CheckpointError, match=r"missing tensors \['lm_head.bias'\]"):
        hf_io.check_checkpoint(llama_dir, names + ["lm_head.bias"])
    with pytest.raises(hf_io.CheckpointError, match="neither model.safetensors.index.json nor model.safetensors"):
        hf_io.check_checkpoint(tmp_path / "nothing", names)
    with pytest.raises(hf_io.CheckpointError, match="config.json not found"):
        hf_io.read_hf_config(tmp_path / "nothing")
