"""HF <-> Megatron layout mapping, single process (no megatron import): hand-built layouts and round trips."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "mcore_scripts"))

from megatron_workers import hf_mapping  # noqa: E402
from megatron_workers.hf_mapping import TPLayout  # noqa: E402
from megatron_workers.model_builder import padded_vocab_size  # noqa: E402

# nh=4 heads in ng=2 groups, head_dim 1, hidden 1: small enough to write the layout by hand
HAND_CFG = dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], num_hidden_layers=1, hidden_size=1,
                num_attention_heads=4, num_key_value_heads=2, head_dim=1, intermediate_size=2, vocab_size=3,
                rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False)


def test_padded_vocab_size_rule():
    assert padded_vocab_size(300, 1) == 384
    assert padded_vocab_size(300, 2) == 512
    assert padded_vocab_size(256, 2) == 256
    assert padded_vocab_size(1, 4) == 512
    with pytest.raises(ValueError, match="vocab_size=0"):
        padded_vocab_size(0, 2)


def test_qkv_layout_by_hand():
    hf = {
        "model.layers.0.self_attn.q_proj.weight": torch.tensor([[0.0], [1.0], [2.0], [3.0]]),
        "model.layers.0.self_attn.k_proj.weight": torch.tensor([[10.0], [11.0]]),
        "model.layers.0.self_attn.v_proj.weight": torch.tensor([[20.0], [21.0]]),
    }
    read = hf_mapping.dict_reader(hf)
    name = "decoder.layers.0.self_attention.linear_qkv.weight"
    full = hf_mapping.mcore_shard_from_hf(name, read, HAND_CFG)
    # per query group: [q heads of the group, k, v]
    assert full.flatten().tolist() == [0, 1, 10, 20, 2, 3, 11, 21]
    # TP rank r holds group r
    assert hf_mapping.mcore_shard_from_hf(name, read, HAND_CFG, 1, 2).flatten().tolist() == [2, 3, 11, 21]
    back = dict(hf_mapping.mcore_full_to_hf(name, full, HAND_CFG))
    for k, v in hf.items():
        assert torch.equal(back[k], v)


def test_fc1_stride2_and_vocab_padding_by_hand():
    hf = {"model.layers.0.mlp.gate_proj.weight": torch.tensor([[1.0], [2.0]]),
          "model.layers.0.mlp.up_proj.weight": torch.tensor([[5.0], [6.0]]),
          "model.embed_tokens.weight": torch.tensor([[7.0], [8.0], [9.0]])}
    read = hf_mapping.dict_reader(hf)
    fc1 = "decoder.layers.0.mlp.linear_fc1.weight"
    assert hf_mapping.mcore_shard_from_hf(fc1, read, HAND_CFG).flatten().tolist() == [1, 2, 5, 6]  # [gate; up]
    r0 = hf_mapping.mcore_shard_from_hf(fc1, read, HAND_CFG, 0, 2)
    r1 = hf_mapping.mcore_shard_from_hf(fc1, read, HAND_CFG, 1, 2)
    assert r0.flatten().tolist() == [1, 5] and r1.flatten().tolist() == [2, 6]  # [gate_r; up_r]
    lay = TPLayout(True, 0, 2)
    assert torch.cat([r0, r1]).flatten().tolist() == [1, 5, 2, 6]  # why plain concatenation is wrong
    assert hf_mapping.gather_to_full([r0, r1], lay).flatten().tolist() == [1, 2, 5, 6]
    emb = "embedding.word_embeddings.weight"
    s1 = hf_mapping.mcore_shard_from_hf(emb, read, HAND_CFG, 1, 2)  # rows 128..255: padding only
    assert s1.shape == (128, 1) and not s1.any()
    s0 = hf_mapping.mcore_shard_from_hf(emb, read, HAND_CFG, 0, 2)
    assert s0[:3].flatten().tolist() == [7, 8, 9] and not s0[3:].any()


def _random_hf_state(cfg: dict) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    h, v, f = cfg["hidden_size"], cfg["vocab_size"], cfg["intermediate_size"]
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,), "lm_head.weight": (v, h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                       p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                       p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.q_proj.bias": (q,),
                       p + "self_attn.k_proj.bias": (kv,), p + "self_attn.v_proj.bias": (kv,),
                       p + "self_attn.o_proj.weight": (h, q), p + "mlp.gate_proj.weight": (f, h),
                       p + "mlp.up_proj.weight": (f, h), p + "mlp.down_proj.weight": (h, f)})
    return {k: torch.randn(s, generator=gen) for k, s in shapes.items()}


CFG = dict(HAND_CFG, num_hidden_layers=2, hidden_size=8, num_attention_heads=4, num_key_value_heads=2, head_dim=3,
           intermediate_size=6, vocab_size=200)


@pytest.mark.parametrize("tp", [1, 2])
def test_round_trip_and_shards_agree(tp):
    hf = _random_hf_state(CFG)
    full = hf_mapping.hf_to_mcore_full(hf, CFG, tp=tp)
    assert set(full) == set(hf_mapping.mcore_param_names(CFG))
    assert full["embedding.word_embeddings.weight"].shape[0] == padded_vocab_size(200, tp)
    back = {}
    for name, t in full.items():
        back.update(hf_mapping.mcore_full_to_hf(name, t, CFG))
    assert set(back) == set(hf)
    for k in hf:
        assert torch.equal(back[k], hf[k]), k
    # The sliced per-rank build equals slicing the full tensor by the parameter's own TP attributes.
    layouts = {"linear_qkv.weight": TPLayout(True, 0, 1), "linear_qkv.bias": TPLayout(True, 0, 1),
               "linear_proj.weight": TPLayout(True, 1, 1), "linear_fc1.weight": TPLayout(True, 0, 2),
               "linear_fc2.weight": TPLayout(True, 1, 1), "word_embeddings.weight": TPLayout(True, 0, 1),
               "output_layer.weight": TPLayout(True, 0, 1)}
    read = hf_mapping.dict_reader(hf)
    for name, t in full.items():
        lay = next((v for k, v in layouts.items() if name.endswith(k)), TPLayout(False, -1, 1))
        shards = [hf_mapping.mcore_shard_from_hf(name, read, CFG, r, tp) for r in range(tp)]
        for r in range(tp):
            assert torch.equal(shards[r], hf_mapping.shard_for_rank(t, lay, r, tp)), (name, r)
        assert torch.equal(hf_mapping.gather_to_full(shards, lay), t), name


def test_tied_output_layer_and_vllm_description():
    tied = dict(CFG, tie_word_embeddings=True)
    assert "output_layer.weight" not in hf_mapping.mcore_param_names(tied)
    assert hf_mapping.describe("output_layer.weight", tied).hf_names == ("model.embed_tokens.weight",)
    assert hf_mapping.mcore_full_to_hf("output_layer.weight", torch.zeros(256, 8), tied) == []
    d = hf_mapping.describe("decoder.layers.1.mlp.linear_fc1.weight", CFG)
    assert d.vllm_name == "model.layers.1.mlp.gate_up_proj.weight" and d.vllm_tp_dim == 0
    assert d.hf_names == ("model.layers.1.mlp.gate_proj.weight", "model.layers.1.mlp.up_proj.weight")
    assert hf_mapping.describe("decoder.layers.0.self_attention.linear_proj.weight", CFG).vllm_tp_dim == 1
    assert hf_mapping.hf_tp_partition_dim("model.layers.0.mlp.down_proj.weight") == 1
    assert hf_mapping.hf_tp_partition_dim("model.norm.weight") is None
    assert hf_mapping.local_to_global_name("decoder.layers.1.mlp.linear_fc2.weight", 2) == \
        "decoder.layers.3.mlp.linear_fc2.weight"
    assert hf_mapping.global_to_local_name("decoder.layers.3.mlp.linear_fc2.weight", 2) == \
        "decoder.layers.1.mlp.linear_fc2.weight"
    with pytest.raises(hf_mapping.MappingError, match="decoder.layers.5"):
        hf_mapping.describe("decoder.layers.5.mlp.linear_fc2.weight", CFG)
    with pytest.raises(hf_mapping.MappingError, match="rotary"):
        hf_mapping.describe("rotary_pos_emb.inv_freq", CFG)
