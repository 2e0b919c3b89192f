"""THE mapping between Hugging Face, Megatron-Core and vLLM parameter names and layouts.

Everything that converts weights (the HF loader/exporter, the resharding engine,
the weight sync to vLLM) goes through this module, so each layout fact is
written down exactly once:

- Names. Megatron names below are *global*: `decoder.layers.{i}` uses the
  global layer index. Under PP each stage numbers its layers from 0;
  `local_to_global_name` adds megatron's own layer offset.
- Layouts (per Megatron TP rank r of t, with nh heads, ng query groups, hd head dim):
  - linear_qkv: rows grouped by query group, each group [q heads of the group; k; v].
    Rank r holds groups [r*ng/t, (r+1)*ng/t), so its shard is a contiguous block of
    the full layout, built from contiguous rows of HF q_proj, k_proj and v_proj.
  - linear_fc1: full layout [gate; up], partition_stride=2: rank r holds [gate_r; up_r].
  - linear_proj / linear_fc2: split on the input dim (dim 1).
  - word embeddings / output layer: vocab rows, padded to `padded_vocab_size(vocab, t)`
    and split on dim 0. Padding rows are zero and are dropped on the way back.
  - norms: replicated.
- MoE layers (qwen3_moe, qwen2_moe, mixtral): `mlp.router.weight` is HF's router (`mlp.gate` /
  mixtral's `block_sparse_moe.gate`), replicated. Expert j of a rank is `mlp.experts.local_experts.{j}`
  in Megatron's own names; the *global* names here carry the global expert index e = ep_rank * E/ep + j
  (`local_to_global_name`), which maps to HF's `experts.{e}`. An expert's fc1/fc2 are laid out like the
  dense MLP's but split over the expert-tensor-parallel group (etp), not tp. Qwen2-MoE's shared expert
  is a dense MLP (`mlp.shared_experts.*`, split over tp) plus its sigmoid gate `gate_weight` (replicated).
  Qwen3's per-head q/k norms are `self_attention.{q,k}_layernorm` (replicated).
- vLLM (Llama-style models): qkv_proj = [q_r; k_r; v_r] per rank, gate_up_proj =
  [gate_r; up_r], o_proj/down_proj split on the input dim, embed/lm_head vocab
  split. vLLM's `reload_weights` accepts HF names and full tensors and does the
  fusing and sharding itself, so HF names are the common currency; `describe`
  records the vLLM side for planners that want to move only slices.

The core function `mcore_shard_from_hf` builds one Megatron TP shard from an
HF tensor *reader*, so the same code serves full conversion (t=1, reading a
dict) and sliced loading from safetensors (each rank reads only its rows).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from megatron_workers.model_builder import HFModelFacts, padded_vocab_size, read_hf_facts

# read(hf_name, dim, start, stop) -> tensor; dim=None means the whole tensor.
Reader = Callable[[str, "int | None", "int | None", "int | None"], torch.Tensor]

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight$")
# Transformer Engine's grouped-GEMM experts (TEGroupedMLP, moe_grouped_gemm on GPU) name local expert j's matrices
# `mlp.experts.linear_fc1.weight{j}`, laid out as the sequential experts' are; the global names are the sequential
# form, so everything past global_named_parameters sees one naming.
_GROUPED_EXPERT = re.compile(r"^mlp\.experts\.(linear_fc1|linear_fc2)\.weight(\d+)$")

# kinds of layout
REPLICATED, ROW, QKV, FC1, VOCAB = "replicated", "row", "qkv", "fc1", "vocab"

# Megatron per-layer suffix -> (HF per-layer suffixes, kind, vLLM fused suffix, vLLM TP dim)
_LAYER_TABLE: dict[str, tuple[tuple[str, ...], str, str, int | None]] = {
    "input_layernorm.weight": (("input_layernorm.weight",), REPLICATED, "input_layernorm.weight", None),
    # Transformer Engine spec fuses the norm into linear_qkv / linear_fc1
    "self_attention.linear_qkv.layer_norm_weight": (
        ("input_layernorm.weight",), REPLICATED, "input_layernorm.weight", None),
    "self_attention.linear_qkv.weight": (
        ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
        QKV, "self_attn.qkv_proj.weight", 0),
    "self_attention.linear_qkv.bias": (
        ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
        QKV, "self_attn.qkv_proj.bias", 0),
    "self_attention.linear_proj.weight": (("self_attn.o_proj.weight",), ROW, "self_attn.o_proj.weight", 1),
    "pre_mlp_layernorm.weight": (
        ("post_attention_layernorm.weight",), REPLICATED, "post_attention_layernorm.weight", None),
    "mlp.linear_fc1.layer_norm_weight": (
        ("post_attention_layernorm.weight",), REPLICATED, "post_attention_layernorm.weight", None),
    "mlp.linear_fc1.weight": (("mlp.gate_proj.weight", "mlp.up_proj.weight"), FC1, "mlp.gate_up_proj.weight", 0),
    "mlp.linear_fc2.weight": (("mlp.down_proj.weight",), ROW, "mlp.down_proj.weight", 1),
    # Qwen3: RMSNorm over each head's q and k
    "self_attention.q_layernorm.weight": (("self_attn.q_norm.weight",), REPLICATED, "self_attn.q_norm.weight", None),
    "self_attention.k_layernorm.weight": (("self_attn.k_norm.weight",), REPLICATED, "self_attn.k_norm.weight", None),
    # Qwen2-MoE's shared expert: a dense SwiGLU MLP split over tp, and its sigmoid gate
    "mlp.shared_experts.linear_fc1.weight": (
        ("mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight"), FC1,
        "mlp.shared_expert.gate_up_proj.weight", 0),
    "mlp.shared_experts.linear_fc2.weight": (
        ("mlp.shared_expert.down_proj.weight",), ROW, "mlp.shared_expert.down_proj.weight", 1),
    "mlp.shared_experts.gate_weight": (("mlp.shared_expert_gate.weight",), REPLICATED, "mlp.shared_expert_gate.weight",
                                       None),
}
# The MoE block's HF prefix, router and per-expert tensor names (fc1 = [gate; up], fc2 = down) per model type.
# vLLM fuses each layer's experts into FusedMoE's w13_weight [E, 2*ffn, hidden] and w2_weight [E, hidden, ffn]
# and loads them from these HF names.
_MOE_NAMES = {
    "qwen3_moe": ("mlp", ("gate_proj", "up_proj"), "down_proj"),
    "qwen2_moe": ("mlp", ("gate_proj", "up_proj"), "down_proj"),
    "mixtral": ("block_sparse_moe", ("w1", "w3"), "w2"),
}
_GLOBAL_TABLE: dict[str, tuple[tuple[str, ...], str, str, int | None]] = {
    "embedding.word_embeddings.weight": (("model.embed_tokens.weight",), VOCAB, "model.embed_tokens.weight", 0),
    "decoder.final_layernorm.weight": (("model.norm.weight",), REPLICATED, "model.norm.weight", None),
    "output_layer.weight": (("lm_head.weight",), VOCAB, "lm_head.weight", 0),
}


class MappingError(KeyError):
    """A parameter name this mapping does not know."""

    def __str__(self):  # KeyError would repr() the message
        return str(self.args[0])


@dataclass(frozen=True)
class ParamMapping:
    """How one global Megatron parameter relates to HF and vLLM tensors."""

    mcore_name: str
    hf_names: tuple[str, ...]  # HF tensors it is made of, in layout order (q,k,v / gate,up)
    kind: str  # replicated | row | qkv | fc1 | vocab
    vllm_name: str  # vLLM's (fused) parameter name
    vllm_tp_dim: int | None  # dim vLLM splits under TP; None = replicated
    # row | fc1: the full size of the split dim (fc1: per half), i.e. the MLP's, an expert's or the shared expert's
    # width, or the attention's heads x head_dim; 0 for the other kinds
    split_size: int = 0
    expert: int | None = None  # the global expert index of an expert's fc1/fc2 (split over etp, not tp)


def describe(mcore_name: str, hf_config) -> ParamMapping:
    """Mapping facts for a *global* Megatron parameter name."""
    facts = read_hf_facts(hf_config)
    m = _LAYER.match(mcore_name)
    if m:
        layer, suffix = int(m.group(1)), m.group(2)
        if layer >= facts.num_layers:
            raise MappingError(f"{mcore_name!r}: layer {layer} >= num_hidden_layers={facts.num_layers}")
        prefix = f"model.layers.{layer}."
        if facts.is_moe and (suffix == "mlp.router.weight" or _EXPERT.match(suffix)):
            return _describe_moe(mcore_name, suffix, prefix, facts)
        if suffix not in _LAYER_TABLE or (facts.is_moe and suffix.startswith("mlp.linear_fc")):
            raise MappingError(f"no HF mapping for Megatron parameter {mcore_name!r} (suffix {suffix!r}) of a "
                               f"{facts.model_type} model")
        hf, kind, vllm, vdim = _LAYER_TABLE[suffix]
        split = {"self_attention.linear_proj.weight": facts.num_heads * facts.head_dim,
                 "mlp.linear_fc1.weight": facts.ffn_hidden_size, "mlp.linear_fc2.weight": facts.ffn_hidden_size,
                 "mlp.shared_experts.linear_fc1.weight": facts.shared_expert_ffn,
                 "mlp.shared_experts.linear_fc2.weight": facts.shared_expert_ffn}.get(suffix, 0)
        return ParamMapping(mcore_name, tuple(prefix + h for h in hf), kind, prefix + vllm, vdim, split)
    if mcore_name not in _GLOBAL_TABLE:
        raise MappingError(f"no HF mapping for Megatron parameter {mcore_name!r}")
    hf, kind, vllm, vdim = _GLOBAL_TABLE[mcore_name]
    if mcore_name == "output_layer.weight" and facts.tie_word_embeddings:
        hf, vllm = ("model.embed_tokens.weight",), "model.embed_tokens.weight"  # tied: lm_head is embed_tokens
    return ParamMapping(mcore_name, hf, kind, vllm, vdim)


def _describe_moe(mcore_name: str, suffix: str, prefix: str, facts: HFModelFacts) -> ParamMapping:
    block, (gate, up), down = _MOE_NAMES[facts.model_type]
    if suffix == "mlp.router.weight":
        name = f"{prefix}{block}.gate.weight"
        return ParamMapping(mcore_name, (name,), REPLICATED, name, None)
    e, which = _EXPERT.match(suffix).groups()
    e = int(e)
    if e >= facts.num_experts:
        raise MappingError(f"{mcore_name!r}: expert {e} >= num_experts={facts.num_experts}")
    base = f"{prefix}{block}.experts.{e}."
    if which == "linear_fc1":
        return ParamMapping(mcore_name, (f"{base}{gate}.weight", f"{base}{up}.weight"), FC1,
                            f"{prefix}{block}.experts.w13_weight", 1, facts.moe_ffn_hidden_size, e)
    return ParamMapping(mcore_name, (f"{base}{down}.weight",), ROW, f"{prefix}{block}.experts.w2_weight", 2,
                        facts.moe_ffn_hidden_size, e)


def hf_tp_partition_dim(hf_name: str) -> int | None:
    """The dim Megatron and vLLM split this HF tensor on under TP (None: replicated)."""
    if hf_name.endswith(("o_proj.weight", "down_proj.weight", ".w2.weight")):
        return 1
    if hf_name.endswith(("norm.weight", "mlp.gate.weight", "block_sparse_moe.gate.weight",
                         "shared_expert_gate.weight")):
        return None  # norms, MoE routers and the shared expert's gate are replicated
    return 0


# --------------------------------------------------------------------------- names under PP


def layer_offset(model_chunk) -> int:
    """Global index of this chunk's first layer: megatron's own offset, for the chunk's virtual stage.

    With VPP a stage's chunks are not contiguous: chunk v of stage p starts at (v*pp + p) * layers per
    chunk (hybridflow.parallel.dims.ParallelDims.chunk_layer_offsets says the same).
    """
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    model = unwrap(model_chunk)
    return int(get_transformer_layer_offset(model.config, vp_stage=getattr(model, "vp_stage", None)))


def _shift(name: str, layers: int, experts: int) -> str:
    m = _LAYER.match(name)
    if not m:
        return name
    suffix = m.group(2)
    grouped = _GROUPED_EXPERT.match(suffix)
    if grouped:
        suffix = f"mlp.experts.local_experts.{grouped.group(2)}.{grouped.group(1)}.weight"
    e = _EXPERT.match(suffix)
    if e:
        suffix = f"mlp.experts.local_experts.{int(e.group(1)) + experts}.{e.group(2)}.weight"
    return f"decoder.layers.{int(m.group(1)) + layers}.{suffix}"


def local_to_global_name(name: str, offset: int, expert_offset: int = 0) -> str:
    """A chunk's own parameter name -> its global name: layer index + `offset`, expert index + `expert_offset`
    (this EP rank's first expert); a grouped-GEMM expert weight takes the sequential experts' name."""
    return _shift(name, offset, expert_offset)


def global_to_local_name(name: str, offset: int, expert_offset: int = 0) -> str:
    return _shift(name, -offset, -expert_offset)


def expert_offset(model_chunk) -> int:
    """Global index of this rank's first expert (0 for a dense model or without expert parallelism)."""
    config = unwrap(model_chunk).config
    experts = getattr(config, "num_moe_experts", None) or 0
    ep = getattr(config, "expert_model_parallel_size", 1) or 1
    if not experts or ep == 1:
        return 0
    from megatron.core import parallel_state

    return parallel_state.get_expert_model_parallel_rank() * (experts // ep)


def is_expert(mcore_name: str) -> bool:
    """An expert's weight (split over the expert-tensor-parallel group, one EP rank's own)."""
    m = _LAYER.match(mcore_name)
    return bool(m and _EXPERT.match(m.group(2)))


def unwrap(model_chunk):
    """The GPTModel inside DDP/Float16Module wrappers."""
    while hasattr(model_chunk, "module"):
        model_chunk = model_chunk.module
    return model_chunk


def global_named_parameters(model_chunk) -> Iterable[tuple[str, torch.nn.Parameter]]:
    """(global Megatron name, parameter) for one chunk; skips TE's _extra_state and buffers."""
    model = unwrap(model_chunk)
    offset, experts = layer_offset(model), expert_offset(model)
    for name, param in model.named_parameters():
        yield local_to_global_name(name, offset, experts), param


# --------------------------------------------------------------------------- HF -> Megatron


def _qkv_counts(f: HFModelFacts, tp_size: int) -> tuple[int, int, int]:
    groups_local = f.num_kv_heads // tp_size
    q_per_group = f.num_heads // f.num_kv_heads
    return groups_local, q_per_group, f.head_dim


def mcore_shard_from_hf(mcore_name: str, read: Reader, hf_config, tp_rank: int = 0, tp_size: int = 1) -> torch.Tensor:
    """Megatron TP shard `tp_rank` of `mcore_name` (global name), reading only the HF rows/cols it needs."""
    f = read_hf_facts(hf_config)
    mp = describe(mcore_name, hf_config)
    r, t = tp_rank, tp_size
    if mp.kind == REPLICATED:
        return read(mp.hf_names[0], None, None, None)
    if mp.kind == ROW:
        n = mp.split_size // t
        return read(mp.hf_names[0], 1, r * n, (r + 1) * n)
    if mp.kind == FC1:
        n = mp.split_size // t
        gate = read(mp.hf_names[0], 0, r * n, (r + 1) * n)
        up = read(mp.hf_names[1], 0, r * n, (r + 1) * n)
        return torch.cat([gate, up], dim=0)
    if mp.kind == QKV:
        g, qpg, hd = _qkv_counts(f, t)
        q = read(mp.hf_names[0], 0, r * g * qpg * hd, (r + 1) * g * qpg * hd)
        k = read(mp.hf_names[1], 0, r * g * hd, (r + 1) * g * hd)
        v = read(mp.hf_names[2], 0, r * g * hd, (r + 1) * g * hd)
        rest = q.shape[1:]
        per_group = [q.reshape(g, qpg * hd, *rest), k.reshape(g, hd, *rest), v.reshape(g, hd, *rest)]
        return torch.cat(per_group, dim=1).reshape(g * (qpg + 2) * hd, *rest)
    if mp.kind == VOCAB:
        rows = padded_vocab_size(f.vocab_size, t) // t
        start, stop = r * rows, (r + 1) * rows
        real_stop = min(stop, f.vocab_size)
        part = read(mp.hf_names[0], 0, start, real_stop) if start < real_stop else None
        width = part.shape[1] if part is not None else f.hidden_size
        dtype = part.dtype if part is not None else torch.float32
        out = torch.zeros(rows, width, dtype=dtype)
        if part is not None:
            out[: real_stop - start] = part
        return out
    raise AssertionError(f"unhandled kind {mp.kind}")


def dict_reader(hf_state: dict[str, torch.Tensor]) -> Reader:
    """A Reader over an in-memory HF state dict."""

    def read(name, dim, start, stop):
        if name not in hf_state:
            raise MappingError(f"HF state has no tensor {name!r}")
        x = hf_state[name]
        return x if dim is None else x.narrow(dim, start or 0, (x.shape[dim] if stop is None else stop) - (start or 0))

    return read


def mcore_param_names(hf_config, include_output_layer: bool | None = None, te_spec: bool = False) -> list[str]:
    """All global Megatron parameter names of the full (PP=1) model for this HF config."""
    f = read_hf_facts(hf_config)
    if include_output_layer is None:
        include_output_layer = not f.tie_word_embeddings
    norm1 = "self_attention.linear_qkv.layer_norm_weight" if te_spec else "input_layernorm.weight"
    # TE fuses the MLP's norm into linear_fc1; an MoE layer keeps it apart (its router reads the normed input)
    norm2 = "mlp.linear_fc1.layer_norm_weight" if te_spec and not f.is_moe else "pre_mlp_layernorm.weight"
    if f.is_moe:
        mlp = ["mlp.router.weight"]
        mlp += [f"mlp.experts.local_experts.{e}.{w}.weight" for e in range(f.num_experts)
                for w in ("linear_fc1", "linear_fc2")]
        if f.shared_expert_ffn:
            mlp += ["mlp.shared_experts.gate_weight", "mlp.shared_experts.linear_fc1.weight",
                    "mlp.shared_experts.linear_fc2.weight"]
    else:
        mlp = ["mlp.linear_fc1.weight", "mlp.linear_fc2.weight"]
    attention = ["self_attention.linear_qkv.weight", "self_attention.linear_proj.weight"]
    if f.qk_norm:
        attention += ["self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight"]
    per_layer = [norm1, *attention, norm2, *mlp]
    if f.qkv_bias:
        per_layer.insert(2, "self_attention.linear_qkv.bias")
    names = ["embedding.word_embeddings.weight"]
    names += [f"decoder.layers.{i}.{s}" for i in range(f.num_layers) for s in per_layer]
    names.append("decoder.final_layernorm.weight")
    if include_output_layer:
        names.append("output_layer.weight")
    return names


def hf_to_mcore_full(hf_state: dict[str, torch.Tensor], hf_config, tp: int = 1) -> dict[str, torch.Tensor]:
    """Full (TP-gathered) Megatron tensors under global names; vocab padded for `tp`."""
    read = dict_reader(hf_state)
    vocab = read_hf_facts(hf_config).vocab_size
    out = {}
    for name in mcore_param_names(hf_config):
        full = mcore_shard_from_hf(name, read, hf_config, 0, 1)
        if describe(name, hf_config).kind == VOCAB:  # t=1 padding -> padding for the target TP
            real = full[:vocab]
            full = torch.cat([real, real.new_zeros(padded_vocab_size(vocab, tp) - vocab, real.shape[1])])
        out[name] = full
    return out


# --------------------------------------------------------------------------- Megatron -> HF


def mcore_full_to_hf(mcore_name: str, tensor: torch.Tensor, hf_config) -> list[tuple[str, torch.Tensor]]:
    """HF (name, tensor) pairs for one full (TP-gathered) Megatron tensor with a global name.

    The output layer of a tied model maps to nothing (HF keeps only embed_tokens).
    """
    f = read_hf_facts(hf_config)
    mp = describe(mcore_name, hf_config)
    if mcore_name == "output_layer.weight" and f.tie_word_embeddings:
        return []
    if mp.kind in (REPLICATED, ROW):
        return [(mp.hf_names[0], tensor)]
    if mp.kind == VOCAB:
        return [(mp.hf_names[0], tensor[: f.vocab_size])]
    if mp.kind == FC1:
        gate, up = tensor.chunk(2, dim=0)
        return [(mp.hf_names[0], gate), (mp.hf_names[1], up)]
    if mp.kind == QKV:
        qpg, hd = f.num_heads // f.num_kv_heads, f.head_dim
        rest = tensor.shape[1:]
        grouped = tensor.reshape(f.num_kv_heads, qpg + 2, hd, *rest)
        q = grouped[:, :qpg].reshape(f.num_heads * hd, *rest)
        k = grouped[:, qpg].reshape(f.num_kv_heads * hd, *rest)
        v = grouped[:, qpg + 1].reshape(f.num_kv_heads * hd, *rest)
        return list(zip(mp.hf_names, (q, k, v)))
    raise AssertionError(f"unhandled kind {mp.kind}")


# --------------------------------------------------------------------------- TP shards, generic over parameters


@dataclass(frozen=True)
class TPLayout:
    """A parameter's TP layout, as megatron records it on the parameter itself."""

    tensor_model_parallel: bool
    partition_dim: int
    partition_stride: int

    @classmethod
    def of(cls, param) -> TPLayout:
        return cls(
            bool(getattr(param, "tensor_model_parallel", False)),
            int(getattr(param, "partition_dim", -1)),
            int(getattr(param, "partition_stride", 1)),
        )


def shard_for_rank(full: torch.Tensor, param, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This rank's shard of a full tensor, following the parameter's TP attributes (stride-aware)."""
    lay = param if isinstance(param, TPLayout) else TPLayout.of(param)
    if not lay.tensor_model_parallel or tp_size == 1:
        return full
    d, s = lay.partition_dim, lay.partition_stride
    if full.shape[d] % (s * tp_size):
        raise ValueError(f"dim {d} of size {full.shape[d]} is not divisible by stride*tp = {s}*{tp_size}")
    strides = full.chunk(s, dim=d)  # e.g. fc1: [gate], [up]
    return torch.cat([part.chunk(tp_size, dim=d)[tp_rank] for part in strides], dim=d)


def gather_to_full(shards: list[torch.Tensor], param) -> torch.Tensor:
    """Inverse of `shard_for_rank`: the full tensor from all TP shards in TP-rank order."""
    lay = param if isinstance(param, TPLayout) else TPLayout.of(param)
    if not lay.tensor_model_parallel or len(shards) == 1:
        return shards[0]
    d, s = lay.partition_dim, lay.partition_stride
    pieces = [shard.chunk(s, dim=d) for shard in shards]  # pieces[rank][stride_index]
    return torch.cat([pieces[r][j] for j in range(s) for r in range(len(shards))], dim=d)


# --------------------------------------------------------------------------- one TP shard -> HF regions
# (added for the resharding engine's weight sync: it has generation-layout shards, never full tensors)


@dataclass(frozen=True)
class HFSlice:
    """Where part of a Megatron TP shard lies in one full HF tensor: rows/cols [start, stop) of `dim`.

    dim None: `tensor` is the whole HF tensor (replicated parameters).
    """

    hf_name: str
    full_shape: tuple[int, ...]
    dim: int | None
    start: int
    stop: int
    tensor: torch.Tensor


def hf_slices_from_mcore_shard(mcore_name: str, shard: torch.Tensor, hf_config, tp_rank: int, tp_size: int,
                               vocab_rows: tuple[int, int] | None = None) -> list[HFSlice]:
    """The HF regions of Megatron TP shard `tp_rank` of `tp_size` (global name): per shard, no gather.

    The inverse of `mcore_shard_from_hf` for one shard. Vocab matrices: `shard` holds the real vocab
    rows `vocab_rows` = [lo, hi) (whatever split the caller uses; no padding rows). The output layer
    of a tied model maps to nothing.
    """
    f = read_hf_facts(hf_config)
    mp = describe(mcore_name, hf_config)
    r, t = tp_rank, tp_size
    rest = tuple(shard.shape[1:])
    if mp.kind == REPLICATED:
        return [HFSlice(mp.hf_names[0], tuple(shard.shape), None, 0, 0, shard)]
    if mp.kind == ROW:
        n = shard.shape[1]
        return [HFSlice(mp.hf_names[0], (shard.shape[0], n * t), 1, r * n, (r + 1) * n, shard)]
    if mp.kind == FC1:
        gate, up = shard.chunk(2, dim=0)
        n = gate.shape[0]
        return [HFSlice(name, (n * t, *rest), 0, r * n, (r + 1) * n, part)
                for name, part in zip(mp.hf_names, (gate, up))]
    if mp.kind == QKV:
        g, qpg, hd = _qkv_counts(f, t)
        if shard.shape[0] != g * (qpg + 2) * hd:
            raise ValueError(f"{mcore_name}: shard has {shard.shape[0]} rows, TP {r}/{t} holds {g} query groups "
                             f"of {qpg}+2 heads of {hd} = {g * (qpg + 2) * hd}")
        grouped = shard.reshape(g, qpg + 2, hd, *rest)
        q = grouped[:, :qpg].reshape(g * qpg * hd, *rest)
        k = grouped[:, qpg].reshape(g * hd, *rest)
        v = grouped[:, qpg + 1].reshape(g * hd, *rest)
        return [
            HFSlice(mp.hf_names[0], (f.num_heads * hd, *rest), 0, r * g * qpg * hd, (r + 1) * g * qpg * hd, q),
            HFSlice(mp.hf_names[1], (f.num_kv_heads * hd, *rest), 0, r * g * hd, (r + 1) * g * hd, k),
            HFSlice(mp.hf_names[2], (f.num_kv_heads * hd, *rest), 0, r * g * hd, (r + 1) * g * hd, v),
        ]
    if mp.kind == VOCAB:
        if mcore_name == "output_layer.weight" and f.tie_word_embeddings:
            return []
        if vocab_rows is None:
            raise ValueError(f"{mcore_name}: vocab_rows=(lo, hi) is needed to place a vocab shard")
        lo, hi = vocab_rows
        if shard.shape[0] != hi - lo or not 0 <= lo <= hi <= f.vocab_size:
            raise ValueError(f"{mcore_name}: shard of {shard.shape[0]} rows for vocab rows [{lo}, {hi}) "
                             f"of vocab_size={f.vocab_size}")
        return [HFSlice(mp.hf_names[0], (f.vocab_size, *rest), 0, lo, hi, shard)]
    raise AssertionError(f"unhandled kind {mp.kind}")
