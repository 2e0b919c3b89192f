"""Build a Megatron-Core GPTModel from a Hugging Face causal-LM config (llama, mistral, qwen2, and the MoE
qwen3_moe, qwen2_moe, mixtral).

Everything here is about *what* model to build; parallel layout numbers come
from `ParallelDims`, and CPU-specific megatron fixes live in `cpu_compat`.
The layer spec is Transformer Engine's when TE is importable and CUDA is
present, megatron's local spec otherwise. The HF<->Megatron weight layout is
in `hf_mapping`, not here.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hybridflow.parallel.dims import ModelShape, ParallelDims

# model_type -> the HF architecture class name we map weights for
SUPPORTED_MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                         "qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                         "mixtral": "MixtralForCausalLM"}
MOE_MODEL_TYPES = ("qwen3_moe", "qwen2_moe", "mixtral")
# MoE families whose router Megatron's softmax top-k cannot express (or whose other parts we do not map): named,
# so the error says what is missing rather than just "unsupported".
UNSUPPORTED_ROUTERS = {
    "deepseek_v2": "DeepSeek's grouped routing (n_group/topk_group) and multi-latent attention",
    "deepseek_v3": "DeepSeek's grouped sigmoid routing with an expert-score bias (n_group/topk_group) and "
                   "multi-latent attention",
    "glm4_moe": "GLM-4.5's sigmoid routing with an expert-score bias (n_group/topk_group)",
    "qwen3_next": "Qwen3-Next's hybrid linear attention",
}
MOE_ROUTER_DTYPES = ("fp32", "fp64")
# flex (DeepEP's dispatcher) needs CUDA: where the model is built without it, alltoall runs instead
MOE_DISPATCHERS = ("alltoall", "allgather", "flex")

# Megatron-LM's convention: the vocab is padded so every TP shard has a multiple of 128 rows.
VOCAB_PAD_MULTIPLE = 128


class UnsupportedModelError(ValueError):
    """The HF config describes a model this builder does not map."""


def padded_vocab_size(vocab_size: int, tp: int) -> int:
    """The one vocab padding rule: round up to a multiple of 128 * tp (each TP shard then holds a multiple of 128)."""
    if vocab_size < 1 or tp < 1:
        raise ValueError(f"padded_vocab_size: vocab_size={vocab_size} and tp={tp} must be >= 1")
    multiple = VOCAB_PAD_MULTIPLE * tp
    return int(math.ceil(vocab_size / multiple) * multiple)


def _get(cfg, key, default=None):
    if isinstance(cfg, dict):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


@dataclass(frozen=True)
class HFModelFacts:
    """The HF config facts the builder and the weight mapping both need, read once and checked."""

    model_type: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    qkv_bias: bool
    tie_word_embeddings: bool
    initializer_range: float
    # MoE (num_experts 0: dense). moe_ffn_hidden_size: one expert's width; shared_expert_ffn: Qwen2-MoE's
    # always-on shared expert (0: none), gated by sigmoid(x . shared_expert_gate).
    num_experts: int = 0
    moe_topk: int = 0
    moe_ffn_hidden_size: int = 0
    shared_expert_ffn: int = 0
    norm_topk_prob: bool = True  # renormalise the top-k probabilities (Mixtral always; Qwen by config)
    qk_norm: bool = False  # Qwen3: RMSNorm over each head's q and k before RoPE

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0


def _rope_theta(cfg) -> float:
    # transformers >= 5 keeps RoPE settings in `rope_parameters`; older versions in rope_theta/rope_scaling.
    params = _get(cfg, "rope_parameters") or {}
    scaling = _get(cfg, "rope_scaling") or {}
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type != "default":
        raise UnsupportedModelError(f"rope_type={rope_type!r} is not supported (only 'default' RoPE is mapped)")
    theta = params.get("rope_theta", _get(cfg, "rope_theta"))
    if theta is None:
        raise UnsupportedModelError("HF config has no rope_theta (neither rope_parameters.rope_theta nor rope_theta)")
    return float(theta)


def read_hf_facts(cfg) -> HFModelFacts:
    """Check the config is a supported architecture and return the numbers the builder needs."""
    model_type = _get(cfg, "model_type")
    architectures = _get(cfg, "architectures") or []
    supported = ", ".join(f"{k} ({v})" for k, v in SUPPORTED_MODEL_TYPES.items())
    if model_type in UNSUPPORTED_ROUTERS:
        raise UnsupportedModelError(f"model_type={model_type!r} is not supported: {UNSUPPORTED_ROUTERS[model_type]} "
                                    f"is not mapped onto Megatron's MoE here; supported: {supported}")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(f"model_type={model_type!r} is not supported; supported: {supported}")
    bad_arch = [a for a in architectures if a != SUPPORTED_MODEL_TYPES[model_type]]
    if bad_arch:
        raise UnsupportedModelError(f"architectures={bad_arch} is not supported for model_type={model_type!r}; "
                                    f"supported: {supported}")
    if model_type in ("llama", "mistral"):
        for flag in ("attention_bias", "mlp_bias"):
            if _get(cfg, flag, False):
                raise UnsupportedModelError(f"{model_type} with {flag}=True is not supported")
    hidden, heads = _get(cfg, "hidden_size"), _get(cfg, "num_attention_heads")
    head_dim = _get(cfg, "head_dim") or hidden // heads
    if _get(cfg, "hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"hidden_act={_get(cfg, 'hidden_act')!r} is not supported (only silu/SwiGLU)")
    sliding = _get(cfg, "sliding_window") if model_type == "mistral" or _get(cfg, "use_sliding_window") else None
    if sliding:
        warnings.warn(
            f"{model_type}: sliding_window={sliding} is not applied by the Megatron model; sequences longer than "
            "the window will differ from HF",
            stacklevel=3,
        )
    return HFModelFacts(
        **(_moe_facts(cfg, model_type) if model_type in MOE_MODEL_TYPES else {}),
        model_type=model_type,
        num_layers=_get(cfg, "num_hidden_layers"),
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=_get(cfg, "num_key_value_heads") or heads,
        head_dim=head_dim,
        ffn_hidden_size=_get(cfg, "intermediate_size"),
        vocab_size=_get(cfg, "vocab_size"),
        rms_norm_eps=float(_get(cfg, "rms_norm_eps", 1e-6)),
        rope_theta=_rope_theta(cfg),
        max_position_embeddings=int(_get(cfg, "max_position_embeddings", 4096)),
        # Qwen2 (and Qwen2-MoE) have q/k/v biases (o_proj none); llama/mistral/mixtral/qwen3 none
        qkv_bias=model_type == "qwen2" or (model_type == "qwen2_moe" and bool(_get(cfg, "qkv_bias", True))),
        tie_word_embeddings=bool(_get(cfg, "tie_word_embeddings", False)),
        initializer_range=float(_get(cfg, "initializer_range", 0.02)),
    )


def _moe_facts(cfg, model_type: str) -> dict:
    """The MoE part of HFModelFacts, with every layer sparse (the layouts mapped here)."""
    from hybridflow.parallel.dims import moe_num_experts

    experts, topk = moe_num_experts(cfg), int(_get(cfg, "num_experts_per_tok") or 0)
    if experts < 1 or not 1 <= topk <= experts:
        raise UnsupportedModelError(f"{model_type}: num_experts={experts}, num_experts_per_tok={topk}: needs "
                                    "1 <= num_experts_per_tok <= num_experts")
    if model_type != "mixtral":
        step, dense_layers = _get(cfg, "decoder_sparse_step", 1), _get(cfg, "mlp_only_layers") or []
        if step != 1 or dense_layers:
            raise UnsupportedModelError(f"{model_type} with decoder_sparse_step={step}, mlp_only_layers="
                                        f"{dense_layers}: only models whose every layer is sparse are mapped")
    norm = True if model_type == "mixtral" else bool(_get(cfg, "norm_topk_prob", model_type == "qwen3_moe"))
    return dict(
        num_experts=experts,
        moe_topk=topk,
        moe_ffn_hidden_size=int(_get(cfg, "intermediate_size") if model_type == "mixtral"
                                else _get(cfg, "moe_intermediate_size")),
        shared_expert_ffn=int(_get(cfg, "shared_expert_intermediate_size") or 0) if model_type == "qwen2_moe" else 0,
        norm_topk_prob=norm,
        qk_norm=model_type == "qwen3_moe",
    )


def check_moe_options(o, key: str) -> None:
    """override_transformer_config's MoE keys (`key` names the section), at config time."""
    if o is None:
        return
    dtype = getattr(o, "moe_router_dtype", "fp32")
    if dtype not in MOE_ROUTER_DTYPES:
        raise ValueError(f"{key}.moe_router_dtype={dtype!r}; choose one of {', '.join(MOE_ROUTER_DTYPES)} (the "
                         "router runs in it whatever the params' dtype, so training and rollout route alike)")
    dispatcher = getattr(o, "moe_token_dispatcher_type", "alltoall")
    if dispatcher not in MOE_DISPATCHERS:
        raise ValueError(f"{key}.moe_token_dispatcher_type={dispatcher!r}; choose one of {', '.join(MOE_DISPATCHERS)}")
    coeff = getattr(o, "moe_aux_loss_coeff", 0.0)
    if not coeff >= 0:
        raise ValueError(f"{key}.moe_aux_loss_coeff={coeff} must be >= 0 (0: no load-balancing loss)")


def moe_grouped_gemm(megatron_cfg, key: str = "megatron") -> bool:
    """override_transformer_config.moe_grouped_gemm (null: auto): Transformer Engine's grouped GEMM over a rank's
    experts, which needs TE's layer spec (GPU); else the sequential experts (one GEMM pair per expert, portable).
    true without CUDA is one of the CUDA-only settings (megatron_checks.CUDA_ONLY): the sequential experts run;
    true on a GPU without TE's spec is refused. Checked on the GPU box only by launch/gpu_check.sh; set false to
    keep the sequential experts there too."""
    o = getattr(megatron_cfg, "override_transformer_config", None)
    asked = getattr(o, "moe_grouped_gemm", None)
    te = resolve_transformer_impl(getattr(megatron_cfg, "transformer_impl", "auto"))[0] == "transformer_engine"
    if asked and not te and not torch.cuda.is_available():
        return False
    if asked and not te:
        raise ValueError(f"{key}.override_transformer_config.moe_grouped_gemm=true needs Transformer Engine's "
                         f"layer spec ({key}.transformer_impl resolves to local here: TE does not import)")
    return te if asked is None else bool(asked)


def _moe_fields(facts: HFModelFacts, dims: ParallelDims, megatron_cfg) -> dict:
    """TransformerConfig's MoE fields for an MoE model: routing exactly as the HF model routes."""
    if not facts.is_moe:
        return {}
    o = getattr(megatron_cfg, "override_transformer_config", None)
    check_moe_options(o, "megatron.override_transformer_config")
    coeff = float(getattr(o, "moe_aux_loss_coeff", 0.0) or 0.0)
    fields = dict(
        num_moe_experts=facts.num_experts,
        moe_router_topk=facts.moe_topk,
        moe_ffn_hidden_size=facts.moe_ffn_hidden_size,
        # Megatron's default router takes the top-k logits, then softmaxes over those k: the same probabilities as
        # softmax over all experts renormalised over the top k (Mixtral; Qwen with norm_topk_prob). Without
        # renormalisation (Qwen's norm_topk_prob=false) the softmax runs over all experts first.
        moe_router_pre_softmax=not facts.norm_topk_prob,
        moe_router_dtype=getattr(o, "moe_router_dtype", "fp32"),
        moe_token_dispatcher_type=_portable(o, "moe_token_dispatcher_type", "alltoall"),
        moe_router_load_balancing_type="aux_loss" if coeff > 0 else "none",
        moe_aux_loss_coeff=coeff,
        moe_grouped_gemm=moe_grouped_gemm(megatron_cfg),
        # Gives each router a RouterReplay slot; it routes as usual until the engine hands it a rollout's
        # choices (routing replay, megatron_workers/engine.py _replay_routing), so it costs nothing otherwise.
        moe_enable_routing_replay=True,
        expert_model_parallel_size=dims.ep,
        expert_tensor_parallel_size=dims.expert_tp,
    )
    if facts.shared_expert_ffn:
        fields.update(moe_shared_expert_intermediate_size=facts.shared_expert_ffn, moe_shared_expert_gate=True)
    return fields


def _portable(o, name: str, portable):
    """A typed override field's value for a model built here: a CUDA-only value (megatron_checks.CUDA_ONLY) is
    replaced by the portable one where there is no CUDA (preflight logs that once)."""
    from hybridflow.config.megatron_checks import TRANSFORMER, needs_cuda

    value = getattr(o, name, portable)
    return portable if not torch.cuda.is_available() and needs_cuda(TRANSFORMER, name, value) else value


TRANSFORMER_IMPLS = ("auto", "local", "transformer_engine")
# override_transformer_config.attention_backend: auto and unfused pick the local spec's attention (torch SDPA,
# megatron's DotProductAttention); flash and fused are Transformer Engine's kernels (TE's spec, GPU), and auto on
# the local spec
ATTENTION_BACKENDS = ("auto", "unfused", "flash", "fused")


def _transformer_engine_usable() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine  # noqa: F401
    except Exception:  # noqa: BLE001 - TE missing or broken: fall back to the local spec
        return False
    return True


def resolve_transformer_impl(name: str = "auto", key: str = "megatron.transformer_impl") -> tuple[str, str]:
    """(local | transformer_engine, why) for MegatronConfig.transformer_impl; auto = TE when usable here."""
    if name not in TRANSFORMER_IMPLS:
        raise ValueError(f"{key}={name!r}; choose one of {', '.join(TRANSFORMER_IMPLS)}")
    usable = _transformer_engine_usable()
    if name == "transformer_engine" and not usable:
        why = "no CUDA device" if not torch.cuda.is_available() else "transformer_engine does not import"
        raise ValueError(f"{key}=transformer_engine but Transformer Engine is not usable here ({why}); "
                         "use local or auto")
    if name == "auto":
        return ("transformer_engine", "auto: TE imports and CUDA is present") if usable else (
            "local", "auto: " + ("no CUDA device" if not torch.cuda.is_available() else "transformer_engine missing"))
    return name, "asked for"


def _recompute_fields(megatron_cfg, dims: ParallelDims, model: ModelShape) -> dict:
    """TransformerConfig's recompute fields from override_transformer_config, checked with our key names."""
    from hybridflow.parallel.dims import check_recompute

    o = getattr(megatron_cfg, "override_transformer_config", None)
    if o is None or o.recompute_granularity is None:
        check_recompute("megatron.override_transformer_config", None, getattr(o, "recompute_method", None),
                        getattr(o, "recompute_num_layers", None))
        return {}
    check_recompute("megatron.override_transformer_config", o.recompute_granularity, o.recompute_method,
                    o.recompute_num_layers, dims, model)
    fields = {"recompute_granularity": o.recompute_granularity}
    if o.recompute_granularity == "full":
        fields.update(recompute_method=o.recompute_method, recompute_num_layers=o.recompute_num_layers)
    else:
        fields["recompute_modules"] = ["core_attn"]
    return fields


def build_transformer_config(hf_config, dims: ParallelDims, dtype: torch.dtype = torch.float32, megatron_cfg=None):
    """A megatron TransformerConfig equivalent to the HF config, for layout `dims` (with its VPP size).

    megatron_cfg (a MegatronConfig, optional): its override_transformer_config's recompute settings.
    """
    # Validate first: bad layouts and configs fail before the (slow) megatron import.
    facts = read_hf_facts(hf_config)
    shape = ModelShape.from_hf_config(hf_config)
    dims.validate(model=shape)
    recompute = _recompute_fields(megatron_cfg, dims, shape)
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype={dtype} is not supported (float32, bfloat16, float16)")
    from megatron.core.transformer.transformer_config import TransformerConfig

    from hybridflow.config.megatron_checks import transformer_fields

    o = getattr(megatron_cfg, "override_transformer_config", None)
    # The user's other TransformerConfig fields win over the builder's choices below (the fields the builder owns
    # are refused at load: megatron_checks.OWNED); CUDA-only ones are not among them without CUDA.
    overrides = transformer_fields(o, torch.cuda.is_available()) if o is not None else {}
    backend = _te_attention_backend(megatron_cfg)
    fields = dict(
        **recompute,
        **_moe_fields(facts, dims, megatron_cfg),
        **({"attention_backend": backend} if backend is not None else {}),
        qk_layernorm=facts.qk_norm,
        virtual_pipeline_model_parallel_size=dims.vpp if dims.vpp > 1 else None,
        num_layers=facts.num_layers,
        hidden_size=facts.hidden_size,
        num_attention_heads=facts.num_heads,
        num_query_groups=facts.num_kv_heads,
        kv_channels=facts.head_dim,
        ffn_hidden_size=facts.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=facts.rms_norm_eps,
        gated_linear_unit=True,  # SwiGLU: fc1 = [gate; up]
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=facts.qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=facts.initializer_range,
        tensor_model_parallel_size=dims.tp,
        pipeline_model_parallel_size=dims.pp,
        context_parallel_size=dims.cp,
        sequence_parallel=dims.sp,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=not torch.cuda.is_available(),
        # gloo (no CUDA) matches batch_isend_irecv's sends and receives per peer in posting order; at PP=2
        # the interleaved schedule exchanges activations and gradients with the same peer in one batch, so a
        # gradient landed in an activation buffer (measured: micro-batches 3-4 of 4 got wrong log-probs).
        # The unbatched path orders the ops by rank parity and splits the directions over two groups.
        batch_p2p_comm=torch.cuda.is_available(),
        # Fused kernels need CUDA/apex; the unfused paths are exact and portable.
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
    )
    return TransformerConfig(**{**fields, **overrides})


def _te_attention_backend(megatron_cfg):
    """megatron's AttnBackend for attention_backend=flash / fused with TE's spec on CUDA; None otherwise (the
    default, or the local spec, whose attention build_layer_spec picks)."""
    name = getattr(getattr(megatron_cfg, "override_transformer_config", None), "attention_backend", "auto")
    impl = resolve_transformer_impl(getattr(megatron_cfg, "transformer_impl", "auto"))[0]
    if name not in ("flash", "fused") or impl != "transformer_engine":
        return None
    from megatron.core.transformer.enums import AttnBackend

    return AttnBackend[name]


def build_layer_spec(transformer_impl: str = "auto", attention_backend: str = "auto",
                     facts: HFModelFacts | None = None, grouped_gemm: bool = False):
    """TE's spec, or megatron's local spec whose core attention is torch's fused SDPA (auto) or megatron's
    unfused DotProductAttention (attention_backend=unfused, which selective recompute is made for).
    facts: the model's (MoE experts and q/k norms pick the spec's MLP and attention norms)."""
    moe = dict(num_experts=facts.num_experts if facts is not None and facts.is_moe else None,
               qk_layernorm=bool(facts is not None and facts.qk_norm))
    if moe["num_experts"]:
        moe["moe_grouped_gemm"] = grouped_gemm
    from megatron.core.models.gpt import gpt_layer_specs

    key = "megatron.override_transformer_config.attention_backend"
    if attention_backend not in ATTENTION_BACKENDS:
        raise ValueError(f"{key}={attention_backend!r}; choose one of {', '.join(ATTENTION_BACKENDS)}")
    if resolve_transformer_impl(transformer_impl)[0] == "transformer_engine":
        if attention_backend == "unfused":
            raise ValueError(f"{key}={attention_backend} selects the local spec's attention; with "
                             "megatron.transformer_impl=transformer_engine TE picks its own (use auto, flash or "
                             "fused, or the local spec)")
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(**moe)
    if attention_backend in ("flash", "fused"):  # TE's kernels; the local spec's fused attention is SDPA
        attention_backend = "auto"
    spec = gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm", **moe)
    if attention_backend == "auto":
        # The local spec's DotProductAttention materialises the s x s scores; the same attention through
        # torch's fused SDPA is exact for the engine's causal, unmasked batches and falls back otherwise.
        from megatron_workers.sdpa_attention import SDPADotProductAttention

        spec.submodules.self_attention.submodules.core_attention = SDPADotProductAttention
    return spec


def build_gpt_model(
    hf_config,
    dims: ParallelDims,
    pre_process: bool | None = None,
    post_process: bool | None = None,
    dtype: torch.dtype = torch.float32,
    share_embeddings: bool | None = None,
    parallel_output: bool = True,
    megatron_cfg=None,
    vp_stage: int | None = None,
):
    """One GPTModel chunk for this rank's pipeline stage (model chunk `vp_stage` of dims.vpp with VPP).

    pre_process/post_process default to "this chunk is the first/last of the whole pipeline".
    share_embeddings defaults to the HF config's tie_word_embeddings. megatron_cfg: a MegatronConfig
    (recompute, attention_backend and transformer_impl); None: no recompute, auto.
    """
    config = build_transformer_config(hf_config, dims, dtype, megatron_cfg)  # validates before importing megatron
    facts = read_hf_facts(hf_config)
    impl = getattr(megatron_cfg, "transformer_impl", "auto")
    attention = getattr(getattr(megatron_cfg, "override_transformer_config", None), "attention_backend", "auto")
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_model import GPTModel

    from megatron_workers.cpu_compat import apply_cpu_compat

    apply_cpu_compat()
    if dims.vpp > 1 and vp_stage is None:
        raise ValueError(f"vpp={dims.vpp}: build_gpt_model needs vp_stage (use build_model_chunks)")
    if pre_process is None:
        pre_process = parallel_state.is_pipeline_first_stage() and vp_stage in (None, 0)
    if post_process is None:
        post_process = parallel_state.is_pipeline_last_stage() and vp_stage in (None, dims.vpp - 1)
    if share_embeddings is None:
        share_embeddings = facts.tie_word_embeddings
    model = GPTModel(
        config=config,
        transformer_layer_spec=build_layer_spec(impl, attention, facts, config.moe_grouped_gemm),
        vocab_size=padded_vocab_size(facts.vocab_size, dims.tp),
        max_sequence_length=facts.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=parallel_output,
        share_embeddings_and_output_weights=share_embeddings,
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=int(facts.rope_theta) if float(facts.rope_theta).is_integer() else facts.rope_theta,
        **({"vp_stage": vp_stage} if vp_stage is not None else {}),
    )
    model.hf_vocab_size = facts.vocab_size  # the real vocab, for masking padded logits
    _torch_norms_in(model, dtype)
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    return model


def _torch_norms_in(model, dtype: torch.dtype) -> None:
    """The local spec's torch RMSNorm/LayerNorm (megatron's fallback without apex) are built in fp32 whatever
    params_dtype says; TE's norms and Megatron-LM's Float16Module give bf16 ones. Cast them, so that a bf16 model
    is bf16 throughout as on GPU: with fp32 weights torch's rms_norm cannot take its fused path on bf16 input
    ("Mismatch dtype between input and weight"), and the optimizer's fp32 main copy is kept for them anyway.
    `Module.to` keeps the Parameter objects, so their sequence_parallel tags stay."""
    if dtype == torch.float32:
        return
    for module in model.modules():
        if isinstance(module, torch.nn.RMSNorm | torch.nn.LayerNorm):
            module.to(dtype)


def build_model_chunks(hf_config, dims: ParallelDims, dtype: torch.dtype = torch.float32, megatron_cfg=None,
                       share_embeddings: bool | None = None, parallel_output: bool = True) -> list:
    """This rank's model chunks: one GPTModel per virtual stage (dims.vpp of them; one without VPP)."""
    stages = [None] if dims.vpp == 1 else list(range(dims.vpp))
    return [build_gpt_model(hf_config, dims, dtype=dtype, share_embeddings=share_embeddings,
                            parallel_output=parallel_output, megatron_cfg=megatron_cfg, vp_stage=v)
            for v in stages]
