"""Model shapes for the planner: the HF config.json when the model directory exists, else a table of known models.

The table holds each model's config.json fields as Hugging Face publishes them, so both paths go through the
same reader as the Megatron builder (`megatron_workers.model_builder.read_hf_facts`: head_dim, GQA, qkv bias,
tied embeddings) and the same layout check (`ParallelDims.validate` with `ModelShape`). The planner needs no
weights: a recipe can name `.../Meta-Llama-3-70B` on a laptop and be planned.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from hybridflow.parallel.dims import ModelShape


class UnknownModelError(ValueError):
    """A model path that neither exists (with config.json) nor names a model in KNOWN_CONFIGS."""


def _llama(layers, hidden, heads, kv, ffn, vocab, theta, max_pos, eps):
    return dict(model_type="llama", architectures=["LlamaForCausalLM"], num_hidden_layers=layers,
                hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv, intermediate_size=ffn,
                vocab_size=vocab, rope_theta=theta, max_position_embeddings=max_pos, rms_norm_eps=eps,
                hidden_act="silu", tie_word_embeddings=False)


# config.json of each model on the Hugging Face hub (the fields the planner reads), keyed by the repo's basename.
KNOWN_CONFIGS: dict[str, dict] = {
    # meta-llama/Meta-Llama-3-8B/config.json
    "Meta-Llama-3-8B": _llama(32, 4096, 32, 8, 14336, 128256, 500000.0, 8192, 1e-5),
    # meta-llama/Meta-Llama-3-70B/config.json
    "Meta-Llama-3-70B": _llama(80, 8192, 64, 8, 28672, 128256, 500000.0, 8192, 1e-5),
    # Qwen/Qwen2-7B/config.json (qkv bias, untied embeddings at 7B)
    "Qwen2-7B": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], num_hidden_layers=28, hidden_size=3584,
                     num_attention_heads=28, num_key_value_heads=4, intermediate_size=18944, vocab_size=152064,
                     rope_theta=1000000.0, max_position_embeddings=32768, rms_norm_eps=1e-6, hidden_act="silu",
                     tie_word_embeddings=False),
    # The HybridFlow paper's Llama sizes (arXiv 2409.19256 §8: 7B, 13B, 34B, 70B):
    # meta-llama/Llama-2-7b-hf, Llama-2-13b-hf, Llama-2-70b-hf; 34B: codellama/CodeLlama-34b-hf (no Llama-2-34B
    # was released; CodeLlama-34B is the public Llama-2 architecture at that size: GQA 8, 48 layers).
    "Llama-2-7b-hf": _llama(32, 4096, 32, 32, 11008, 32000, 10000.0, 4096, 1e-5),
    "Llama-2-13b-hf": _llama(40, 5120, 40, 40, 13824, 32000, 10000.0, 4096, 1e-5),
    "CodeLlama-34b-hf": _llama(48, 8192, 64, 8, 22016, 32000, 1000000.0, 16384, 1e-5),
    "Llama-2-70b-hf": _llama(80, 8192, 64, 8, 28672, 32000, 10000.0, 4096, 1e-5),
    # Qwen/Qwen3-32B/config.json: 64 layers, hidden 5120, 64 heads of head_dim 128 (q width 8192 > hidden), 8 KV
    # heads, ffn 25600, vocab 151936, untied. Planned as a Llama-architecture body: Qwen3 adds only q/k RMSNorm
    # (2 x 128 weights per layer) and has no qkv bias; the Megatron builder does not map model_type qwen3 yet.
    "Qwen3-32B": {**_llama(64, 5120, 64, 8, 25600, 151936, 1000000.0, 40960, 1e-6), "head_dim": 128},
    # Qwen/Qwen3-1.7B/config.json: 28 layers, hidden 2048, 16 heads of head_dim 128, 8 KV heads, ffn 6144, vocab
    # 151936, tied embeddings (the output layer is the input embedding). A Llama-architecture body, as Qwen3-32B.
    "Qwen3-1.7B": {**_llama(28, 2048, 16, 8, 6144, 151936, 1000000.0, 40960, 1e-6), "head_dim": 128,
                   "tie_word_embeddings": True},
    # Qwen/Qwen3-30B-A3B/config.json: 48 layers, hidden 2048, 32 heads of head_dim 128 (q width 4096 > hidden),
    # 4 KV heads, every layer sparse (decoder_sparse_step 1, no mlp_only_layers): 128 experts of width 768
    # (moe_intermediate_size), top-8 with norm_topk_prob, no shared expert; q/k RMSNorm; vocab 151936, untied.
    # intermediate_size 6144 is the dense MLP width no layer uses. Model card: 30.5B total, 3.3B activated.
    "Qwen3-30B-A3B": dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], num_hidden_layers=48,
                          hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                          intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                          num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                          vocab_size=151936, rope_theta=1000000.0, max_position_embeddings=40960, rms_norm_eps=1e-6,
                          hidden_act="silu", tie_word_embeddings=False),
    # mistralai/Mixtral-8x7B-v0.1/config.json: 32 layers, hidden 4096, 32 heads, 8 KV heads, 8 experts of width
    # 14336 (intermediate_size), top-2, vocab 32000, untied, no sliding window. Model card: 46.7B total, 12.9B
    # active per token.
    "Mixtral-8x7B-v0.1": dict(model_type="mixtral", architectures=["MixtralForCausalLM"], num_hidden_layers=32,
                              hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336,
                              num_local_experts=8, num_experts_per_tok=2, vocab_size=32000, rope_theta=1000000.0,
                              max_position_embeddings=32768, rms_norm_eps=1e-5, hidden_act="silu",
                              sliding_window=None, tie_word_embeddings=False),
}
# Fine-tuned variants share the base model's shape.
ALIASES = {"Meta-Llama-3-8B-Instruct": "Meta-Llama-3-8B", "Meta-Llama-3-70B-Instruct": "Meta-Llama-3-70B",
           "Llama-3-8B": "Meta-Llama-3-8B",
           # Llama 3.1 8B has Llama 3 8B's shape (it changes rope scaling and the context length only)
           "Llama-3.1-8B": "Meta-Llama-3-8B", "Llama-3.1-8B-Instruct": "Meta-Llama-3-8B",
           "Meta-Llama-3.1-8B-Instruct": "Meta-Llama-3-8B", "Llama-3-70B": "Meta-Llama-3-70B",
           # and Llama 3.1 / 3.3 70B have Llama 3 70B's
           "Llama-3.1-70B": "Meta-Llama-3-70B", "Llama-3.1-70B-Instruct": "Meta-Llama-3-70B",
           "Llama-3.3-70B-Instruct": "Meta-Llama-3-70B",
           "Qwen2-7B-Instruct": "Qwen2-7B",
           "Llama-2-7b": "Llama-2-7b-hf", "Llama-2-13b": "Llama-2-13b-hf", "Llama-2-70b": "Llama-2-70b-hf",
           "CodeLlama-34b": "CodeLlama-34b-hf", "Llama-2-7b-chat-hf": "Llama-2-7b-hf",
           "Llama-2-13b-chat-hf": "Llama-2-13b-hf", "Llama-2-70b-chat-hf": "Llama-2-70b-hf",
           "Qwen3-30B-A3B-Base": "Qwen3-30B-A3B", "Qwen3-30B-A3B-Instruct-2507": "Qwen3-30B-A3B",
           "Mixtral-8x7B": "Mixtral-8x7B-v0.1", "Mixtral-8x7B-Instruct-v0.1": "Mixtral-8x7B-v0.1"}


@dataclass(frozen=True)
class Shape:
    """What the planner needs of a model: the layout-relevant numbers and the source they came from."""

    name: str
    source: str  # "<dir>/config.json" or "known shape table"
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int  # the dense MLP's width; for an MoE model one expert's (as ModelShape)
    vocab_size: int
    qkv_bias: bool
    tie_word_embeddings: bool
    num_experts: int = 0  # routed experts per layer (every layer sparse); 0: dense
    moe_topk: int = 0  # experts each token is routed to
    shared_expert_ffn: int = 0  # Qwen2-MoE's always-on shared expert width; 0: none
    qk_norm: bool = False  # Qwen3: an RMSNorm of head_dim weights over each head's q and k

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def model_shape(self) -> ModelShape:
        """The layout check's view (hybridflow.parallel.dims)."""
        return ModelShape(num_layers=self.num_layers, hidden_size=self.hidden_size, num_heads=self.num_heads,
                          num_kv_heads=self.num_kv_heads, ffn_hidden_size=self.ffn_hidden_size,
                          vocab_size=self.vocab_size, num_experts=self.num_experts, moe_topk=self.moe_topk,
                          shared_expert_ffn=self.shared_expert_ffn)

    @property
    def q_width(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.num_kv_heads * self.head_dim


def shape_from_hf_config(name: str, cfg: dict, source: str) -> Shape:
    from megatron_workers.model_builder import SUPPORTED_MODEL_TYPES, read_hf_facts

    archs = cfg.get("architectures") or []
    if archs and all(a.endswith("ForSequenceClassification") for a in archs):
        # a reward model: the builder makes it the causal-LM body + a scalar head (engine.build_role_engine)
        cfg = {**cfg, "architectures": [SUPPORTED_MODEL_TYPES.get(cfg.get("model_type"), archs[0])]}
    f = read_hf_facts(cfg)  # rejects architectures the Megatron builder does not map
    return Shape(name=name, source=source, num_layers=f.num_layers, hidden_size=f.hidden_size, num_heads=f.num_heads,
                 num_kv_heads=f.num_kv_heads, head_dim=f.head_dim,
                 ffn_hidden_size=f.moe_ffn_hidden_size if f.is_moe else f.ffn_hidden_size,
                 vocab_size=f.vocab_size, qkv_bias=f.qkv_bias, tie_word_embeddings=f.tie_word_embeddings,
                 num_experts=f.num_experts, moe_topk=f.moe_topk, shared_expert_ffn=f.shared_expert_ffn,
                 qk_norm=f.qk_norm)


def known_name(path: str) -> str | None:
    """The KNOWN_CONFIGS key for a model path's basename (case-insensitive, aliases resolved), or None."""
    base = os.path.basename(os.path.normpath(path)) if path else ""
    lowered = {k.lower(): k for k in [*KNOWN_CONFIGS, *ALIASES]}
    key = lowered.get(base.lower())
    return ALIASES.get(key, key) if key else None


def resolve_shape(key: str, path: str) -> Shape:
    """The shape of the model at config key `key` = `path`: its config.json, else the known table by basename."""
    config_json = os.path.join(path, "config.json") if path else ""
    if config_json and os.path.isfile(config_json):
        with open(config_json) as fh:
            return shape_from_hf_config(os.path.basename(os.path.normpath(path)), json.load(fh), config_json)
    name = known_name(path)
    if name is None:
        raise UnknownModelError(
            f"{key}={path!r}: no config.json there and {os.path.basename(os.path.normpath(path)) or '(empty)'!r} "
            f"is not a known model; known: {', '.join(sorted(KNOWN_CONFIGS))} (or point {key} at an HF directory)")
    return shape_from_hf_config(name, KNOWN_CONFIGS[name], "known shape table (launch/plan/shapes.py)")
