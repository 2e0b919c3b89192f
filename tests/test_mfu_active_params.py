"""perf/mfu/actor counts the parameters a token's forward touches, as launch.plan does: for MoE the top-k routed
experts (+ the shared expert), not all E. Checked on tiny random HF models written to disk, against a count made by
hand from their config.json (embedding, attention, norms, router, k experts, shared expert, final norm, lm head)."""

from __future__ import annotations

import json

import pytest


def _by_hand(cfg: dict) -> tuple[int, int]:
    """(every parameter, the ones one token's forward touches) of an HF Llama / Qwen2-MoE / Qwen3-MoE config.json."""
    h, layers, vocab = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or h // heads
    attention = (heads * hd * h + 2 * kv * hd * h  # q, k, v
                 + h * heads * hd  # o
                 + 2 * h)  # input_layernorm, post_attention_layernorm
    if cfg["model_type"] == "qwen2_moe":
        attention += (heads + 2 * kv) * hd  # q/k/v biases
    if cfg["model_type"] == "qwen3_moe":
        attention += 2 * hd  # q_norm, k_norm
    experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0
    if experts:
        topk, f = cfg["num_experts_per_tok"], cfg["moe_intermediate_size"]
        one_expert = 3 * f * h  # gate, up, down
        dense = experts * h  # the router
        if cfg.get("shared_expert_intermediate_size"):
            dense += 3 * cfg["shared_expert_intermediate_size"] * h + h  # the shared expert and its sigmoid gate
        every, active = dense + experts * one_expert, dense + topk * one_expert
    else:
        every = active = 3 * cfg["intermediate_size"] * h
    outside = vocab * h + h + (0 if cfg.get("tie_word_embeddings") else vocab * h)  # embedding, final norm, lm head
    return outside + layers * (attention + every), outside + layers * (attention + active)


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "llama"])
def test_the_trainer_and_the_planner_count_the_active_parameters(tmp_path, arch):
    from hybridflow.models.tiny import save_tiny_model
    from hybridflow.trainer.main import count_active_params, count_params
    from launch.plan import memory
    from launch.plan.shapes import resolve_shape

    path = save_tiny_model(tmp_path / arch, arch=arch)
    cfg = json.loads((path / "config.json").read_text())
    every, active = _by_hand(cfg)
    assert count_params(str(path)) == every  # the hand count is the model's: the safetensors hold as many
    assert count_active_params(str(path)) == active  # what perf/mfu/actor's FLOPs use
    shape = resolve_shape("actor_rollout_ref.model.path", str(path))
    assert memory.total_params(shape) == every and memory.active_params(shape) == active  # launch.plan's
    if arch == "qwen3_moe":  # the tiny Qwen3-MoE of docs/moe.md: 8 experts, top-2
        assert (cfg["num_local_experts"], cfg["num_experts_per_tok"]) == (8, 2)  # transformers 5 spells it so
        assert every - active == cfg["num_hidden_layers"] * 6 * 3 * cfg["moe_intermediate_size"] * cfg["hidden_size"]
    if arch == "llama":
        assert active == every
