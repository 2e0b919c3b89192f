"""The tiny models load offline through the plain HF entry points, and the tokenizer is character-exact."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hybridflow.models.tiny import PRESETS, build_tokenizer, main, save_tiny_model, save_tiny_reward_model


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("llama"), preset="tiny", arch="llama", seed=3)


def test_saved_dir_loads_offline_and_matches_preset(llama_dir):
    names = {p.name for p in llama_dir.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= names
    model = AutoModelForCausalLM.from_pretrained(llama_dir, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(llama_dir, local_files_only=True)
    cfg = model.config
    assert cfg.model_type == "llama"
    for key, value in PRESETS["tiny"].items():
        assert getattr(cfg, key) == value, key
    assert cfg.vocab_size == len(tok) < 128
    assert model.dtype == torch.float32
    assert not any("bias" in n for n, _ in model.named_parameters())
    # q_proj maps hidden 64 -> 4 heads x head_dim 32 (explicit head_dim, see PRESETS).
    assert model.model.layers[0].self_attn.q_proj.weight.shape == (4 * 32, 64)
    assert model.model.layers[0].self_attn.k_proj.weight.shape == (2 * 32, 64)
    assert model.generation_config.eos_token_id == tok.eos_token_id
    assert tok.pad_token_id != tok.bos_token_id


def test_seed_decides_weights(tmp_path, llama_dir):
    same = AutoModelForCausalLM.from_pretrained(save_tiny_model(tmp_path / "a", seed=3))
    other = AutoModelForCausalLM.from_pretrained(save_tiny_model(tmp_path / "b", seed=4))
    ref = AutoModelForCausalLM.from_pretrained(llama_dir)
    w = "model.layers.0.mlp.up_proj.weight"
    assert torch.equal(same.state_dict()[w], ref.state_dict()[w])
    assert not torch.equal(other.state_dict()[w], ref.state_dict()[w])


def test_forward_runs_and_is_deterministic(llama_dir):
    model = AutoModelForCausalLM.from_pretrained(llama_dir).eval()
    ids = torch.tensor([[1, 5, 20, 21, 22, 2, 6]])
    with torch.no_grad():
        a = model(ids).logits
        b = model(ids).logits
    assert a.shape == (1, 7, model.config.vocab_size)
    assert torch.isfinite(a).all() and torch.equal(a, b)


def test_qwen2_has_qkv_bias_and_tied_override(tmp_path):
    out = save_tiny_model(tmp_path / "q", arch="qwen2", tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.model_type == "qwen2"
    biases = {n for n, _ in model.named_parameters() if n.endswith("bias")}
    assert biases == {f"model.layers.{i}.self_attn.{p}_proj.bias" for i in range(2) for p in "qkv"}
    assert model.config.tie_word_embeddings
    # vLLM's Qwen2 sizes attention as hidden // heads, so the saved config must agree with it.
    assert model.config.head_dim * model.config.num_attention_heads == model.config.hidden_size
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_tokenizer_round_trips_every_character():
    tok = build_tokenizer()
    text = "Natalia sold 48/2 = 24 clips.\n#### 72 \t?"  # \t is outside the alphabet -> <unk>
    ids = tok(text)["input_ids"]
    assert len(ids) == len(text)  # one id per character, no bos/eos added
    assert tok.decode(ids) == text.replace("\t", "<unk>")
    plain = "".join(chr(c) for c in range(32, 127)) + "\n"
    assert tok.decode(tok(plain)["input_ids"]) == plain
    assert tok.convert_ids_to_tokens(tok("ab")["input_ids"]) == ["a", "b"]


def test_chat_template_with_generation_prompt(llama_dir):
    tok = AutoTokenizer.from_pretrained(llama_dir)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "reverse: 3a9k"}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<s><|system|>be brief</s><|user|>reverse: 3a9k</s><|assistant|>"
    ids = tok.encode(text, add_special_tokens=False)
    expected = [tok.bos_token_id, tok.convert_tokens_to_ids("<|system|>")] + tok.encode("be brief") + [
        tok.eos_token_id, tok.convert_tokens_to_ids("<|user|>")] + tok.encode("reverse: 3a9k") + [
        tok.eos_token_id, tok.convert_tokens_to_ids("<|assistant|>")]
    assert ids == expected
    no_prompt = tok.apply_chat_template(messages[1:], add_generation_prompt=False, tokenize=False)
    assert no_prompt == "<s><|user|>reverse: 3a9k</s>"
    with pytest.raises(Exception, match="unknown chat role"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)


def test_bad_arguments_name_the_problem(tmp_path):
    with pytest.raises(ValueError, match="unknown preset 'huge'"):
        save_tiny_model(tmp_path, preset="huge")
    with pytest.raises(ValueError, match="unknown arch 'gpt2'"):
        save_tiny_model(tmp_path, arch="gpt2")
    with pytest.raises(ValueError, match=r"unknown override\(s\) \['hiden_size'\]"):
        save_tiny_model(tmp_path, hiden_size=32)
    with pytest.raises(ValueError, match="head_dim=16"):
        save_tiny_model(tmp_path, head_dim=None)  # 64 / 4 heads
    with pytest.raises(ValueError, match="qwen2 needs head_dim == hidden_size // num_attention_heads"):
        save_tiny_model(tmp_path, preset="tiny4l", arch="qwen2", head_dim=64)


@pytest.mark.parametrize("preset,params_lo,params_hi", [("tiny4l", 0.5e6, 1.0e6), ("small", 15e6, 22e6)])
def test_preset_sizes(tmp_path, preset, params_lo, params_hi):
    model = AutoModelForCausalLM.from_pretrained(save_tiny_model(tmp_path, preset=preset))
    n = sum(p.numel() for p in model.parameters())
    assert params_lo < n < params_hi
    cfg = model.config
    for tp in (1, 2, 4) if preset == "small" else (1, 2):
        assert cfg.num_attention_heads % tp == 0 and cfg.num_key_value_heads % tp == 0


def test_cli(tmp_path):
    main(["--out", str(tmp_path / "m"), "--arch", "qwen2", "--seed", "7", "--set", "num_hidden_layers=1"])
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert cfg["model_type"] == "qwen2" and cfg["num_hidden_layers"] == 1


def test_reward_model_is_an_hf_sequence_classifier_with_the_policy_body(tmp_path, llama_dir):
    from safetensors import safe_open
    from transformers import AutoModelForSequenceClassification

    rm_dir = save_tiny_reward_model(tmp_path / "rm", body_from=llama_dir, seed=5)
    rm = AutoModelForSequenceClassification.from_pretrained(rm_dir, local_files_only=True)
    assert type(rm).__name__ == "LlamaForSequenceClassification" and rm.config.num_labels == 1
    assert rm.score.weight.shape == (1, 64) and rm.score.weight.abs().sum() > 0
    policy = AutoModelForCausalLM.from_pretrained(llama_dir)
    w = "layers.1.mlp.down_proj.weight"
    assert torch.equal(rm.model.state_dict()[w], policy.model.state_dict()[w])  # body copied
    with safe_open(str(rm_dir / "model.safetensors"), "pt") as f:  # the layout our Megatron loader reads
        assert "score.weight" in f.keys() and f"model.{w}" in f.keys()
    assert AutoTokenizer.from_pretrained(rm_dir).get_vocab() == AutoTokenizer.from_pretrained(llama_dir).get_vocab()
    ids = torch.tensor([[1, 40, 41, 42]])
    assert rm(input_ids=ids).logits.shape == (1, 1)
    other = AutoModelForSequenceClassification.from_pretrained(save_tiny_reward_model(tmp_path / "b", seed=6))
    assert not torch.equal(other.score.weight, rm.score.weight)  # the seed decides the head
    main(["--out", str(tmp_path / "cli"), "--reward-model", "--body-from", str(llama_dir)])
    assert json.loads((tmp_path / "cli" / "config.json").read_text())["architectures"] == [
        "LlamaForSequenceClassification"]
