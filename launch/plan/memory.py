"""Bytes per GPU: model state, activations, the vLLM side and the resharding buffers. Pure arithmetic.

Every constant is in one of the three tables below with its source. The per-rank parameter count follows
our Megatron GPTModel exactly (megatron_workers/model_builder.py: vocab padded to 128*tp, per-group qkv,
[gate; up] fc1, scalar head for critic / reward model), and tests/test_planner.py checks it, the gradient
buffer and the optimizer state against the real tensors of a gloo run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hybridflow.models import param_count as count
from hybridflow.models.param_count import routed_expert_params
from launch.plan.shapes import Shape

GiB = 1024**3

# ---- 1. model state: bytes per parameter ----------------------------------------------------------------------
# Megatron-Core's distributed optimizer docs (docs.nvidia.com/megatron-core/developer-guide/latest/
# distrib_optimizer.html), table "theoretical number of bytes per parameter": bf16 params + fp32 grads = 6 + 12/d,
# fp32 params + fp32 grads = 8 + 8/d (distributed), 18 and 16 without. Split into its parts: the model's params
# (param dtype), the fp32 grad buffer (our DDP sets grad_reduce_in_fp32=True: megatron_workers/optimizer.py), and
# the optimizer state, sharded over DP by the distributed optimizer: fp32 main params (only when the params are
# not fp32 already) + Adam exp_avg and exp_avg_sq in fp32.
BYTES_PER_PARAM = {
    "bf16": {"param": 2, "grad": 4, "main_param": 4, "adam": 8},
    "fp16": {"param": 2, "grad": 4, "main_param": 4, "adam": 8},
    "fp32": {"param": 4, "grad": 4, "main_param": 0, "adam": 8},
}
DTYPE_NAMES = {"bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16", "fp32": "fp32",
               "float32": "fp32"}


# ---- 2. activations: what each layer saves for backward, per token ------------------------------------------
@dataclass(frozen=True)
class KernelProfile:
    """Which tensors the layer implementation keeps for backward (Korthikanti et al. 2022, "Reducing Activation
    Recomputation in Large Transformer Models", §4, counts them for GPT: 34sbh + 5as^2b bytes per layer in 16-bit
    with dropout, /t for the TP-split parts, all /t with sequence parallel)."""

    norm_saves_output: bool  # besides its input (and fp32 rstd), the norm keeps its normalised output
    attention: str  # "flash": saves q, k, v (kv at GQA width), out, fp32 lse; "sdpa", "unfused": see below
    ffn_tensors: int  # how many F-wide (per TP rank) tensors the SwiGLU MLP keeps
    source: str


KERNEL_PROFILES = {
    # GPU (Transformer Engine spec): fused RMSNorm+linear keeps input, ln_out and rsigma; flash/cuDNN attention
    # keeps q, k, v, out and the softmax lse (no s^2 tensor: what Korthikanti's selective recompute buys); fused
    # bias-SwiGLU keeps the fc1 output (2F) and fc2 its input (F). Korthikanti's GPT adapted: dropout 0 (no masks),
    # SwiGLU 2F+F instead of GeLU 4h+4h, GQA k/v at num_kv_heads*head_dim. Not measured (no GPU in the CI).
    "te": KernelProfile(False, "flash", 3, "derived: Korthikanti 2022 §4 adapted to TE kernels, GQA, SwiGLU"),
    # megatron-core local spec on CPU (torch RMSNorm): the norm also keeps x*rstd; the unfused glu keeps fc1's
    # output, silu's output, the product's operand and fc2's input (5F). Its core attention is torch's fused SDPA
    # (attention_backend=auto, megatron_workers/sdpa_attention.py): k, v repeated to all heads, q, its own output
    # and the fp32 lse, no s^2 tensor. Measured with saved_tensors_hooks (tests/mcore_scripts/plan_measure.py).
    "local": KernelProfile(True, "sdpa", 5, "measured: megatron-core local spec + fused SDPA, saved_tensors_hooks"),
    # The same with megatron's unfused DotProductAttention (attention_backend=unfused): q, k, v (repeated), the
    # softmax output (a*s^2*b) and a bool s^2 mask; what selective recompute is made for.
    "local_unfused": KernelProfile(True, "unfused", 5,
                                   "measured: megatron-core local spec, unfused attention, saved_tensors_hooks"),
}
# The profile a config's override_transformer_config.attention_backend picks on the local spec (launch.plan).
LOCAL_PROFILES = {"auto": "local", "unfused": "local_unfused"}
RECOMPUTE_MODES = ("none", "selective", "full")
# Logits on the last stage: bf16/fp32 logits (param dtype) + the fp32 copy our vocab-parallel log-prob keeps.
LOGIT_FP32_BYTES = 4

# ---- 3. fixed overheads per GPU ---------------------------------------------------------------------------------
OVERHEADS = {
    # CUDA context (~0.5 GiB), NCCL communicators and their buffers for TP/PP/DP/generation groups, and the caching
    # allocator's fragmentation. An assumption, not measured: 3 GiB is what Megatron/vLLM jobs commonly leave free.
    "framework_reserve": (3 * GiB, "assumption: CUDA context + NCCL buffers + allocator fragmentation"),
    # vLLM's own activations during its profile pass and CUDA graphs, outside weights and KV (vLLM logs it as
    # "activation peak" + "non_torch"); typically 1-3 GiB at 7B-70B. An assumption, not measured here.
    "vllm_runtime": (2 * GiB, "assumption: vLLM activation peak + CUDA graph pool"),
}


def dtype_key(name: str) -> str:
    key = DTYPE_NAMES.get(name.lower())
    if key is None:
        raise ValueError(f"dtype {name!r} is not one of {sorted(DTYPE_NAMES)}")
    return key


def padded_vocab(vocab: int, tp: int) -> int:
    """Megatron-LM's rule, as model_builder.padded_vocab_size: a multiple of 128 * tp."""
    multiple = 128 * tp
    return int(math.ceil(vocab / multiple) * multiple)


# ---- parameter counts ------------------------------------------------------------------------------------------
# An MoE layer (Megatron's MoELayer, every layer sparse): the router [E, h], replicated on every rank; the routed
# experts, E/ep per rank, each expert's fc1 [2F, h] and fc2 [h, F] split over etp (F: one expert's width); a shared
# expert (Qwen2-MoE) split over tp like a dense MLP, with its [1, h] sigmoid gate replicated. Attention, norms and
# embeddings are laid out as in a dense model (tp x pp). Megatron keeps the experts' gradients and optimizer state
# on the expert data-parallel group (tp*cp*dp / (etp*ep) ranks), the rest on dp*cp.
def attention_params(shape: Shape, tp: int) -> int:
    """qkv (+ bias), the output projection and the two layer norms of one layer on one TP rank (+ Qwen3's q/k
    RMSNorm: head_dim weights each, replicated)."""
    h, hd, ng, nh = shape.hidden_size, shape.head_dim, shape.num_kv_heads, shape.num_heads
    qkv_rows = ng // tp * (nh // ng + 2) * hd
    qkv = qkv_rows * h + (qkv_rows if shape.qkv_bias else 0)
    proj = h * nh * hd // tp
    return qkv + proj + 2 * h + (2 * hd if shape.qk_norm else 0)  # + input_layernorm and pre_mlp_layernorm


def expert_params(shape: Shape) -> int:
    """One routed expert's SwiGLU matrices, whole: [gate; up] (2F x h) and down (h x F)."""
    return routed_expert_params(shape.hidden_size, shape.ffn_hidden_size)


def mlp_params(shape: Shape, tp: int) -> int:
    """The MLP of one layer on one TP rank, routed experts excluded: the dense SwiGLU, or for an MoE layer the
    router and the shared expert with its gate."""
    h = shape.hidden_size
    if not shape.is_moe:
        f = shape.ffn_hidden_size
        return 2 * f // tp * h + h * f // tp
    fs = shape.shared_expert_ffn
    shared = 2 * fs // tp * h + h * fs // tp + h if fs else 0
    return shape.num_experts * h + shared


def layer_expert_params(shape: Shape, ep: int = 1, etp: int = 1) -> int:
    """Routed-expert parameters of one layer on one rank: E/ep experts, each split over etp."""
    if not shape.is_moe:
        return 0
    return shape.num_experts // ep * expert_params(shape) // etp


def layer_params(shape: Shape, tp: int, ep: int = 1, etp: int | None = None) -> int:
    """One transformer layer on one rank (etp None: = tp, Megatron's default)."""
    return attention_params(shape, tp) + mlp_params(shape, tp) + layer_expert_params(shape, ep, tp if etp is None
                                                                                      else etp)


def stage_params(shape: Shape, tp: int, pp: int, stage: int, scalar_head: bool = False, ep: int = 1,
                 etp: int | None = None) -> int:
    """Parameters on one rank of pipeline stage `stage` (Megatron splits layers evenly over stages)."""
    h = shape.hidden_size
    vocab_rows = padded_vocab(shape.vocab_size, tp) // tp
    n = shape.num_layers // pp * layer_params(shape, tp, ep, etp)
    if stage == 0:
        n += vocab_rows * h  # word embeddings
    if stage == pp - 1:
        n += h  # final norm
        if scalar_head:
            n += h  # ScalarHead (1, hidden), replicated (megatron_workers/heads.py)
        elif not (shape.tie_word_embeddings and pp == 1):
            n += vocab_rows * h  # output layer (its own weight, or the tied copy Megatron keeps on the last stage)
    return n


def stage_expert_params(shape: Shape, pp: int, ep: int = 1, etp: int = 1) -> int:
    """The routed-expert part of stage_params: what the expert data-parallel group shards and reduces."""
    return shape.num_layers // pp * layer_expert_params(shape, ep, etp)


def total_params(shape: Shape, scalar_head: bool = False) -> int:
    """The whole model, unpadded, every expert counted (what vLLM holds over its TP ranks, what the weight sync
    moves and what the memory plan holds)."""
    n = shape.num_layers * layer_params(shape, 1) + shape.vocab_size * shape.hidden_size + shape.hidden_size
    if scalar_head:
        return n + shape.hidden_size
    return n + (0 if shape.tie_word_embeddings else shape.vocab_size * shape.hidden_size)


def active_params(shape: Shape, scalar_head: bool = False) -> int:
    """Parameters one token's forward touches: total_params with the routed experts counted top-k times instead of
    E times (the FLOP count's N; = total_params for a dense model). The trainer's perf/mfu/actor counts the same
    (hybridflow/models/param_count.py, which both call)."""
    return count.active_params(total_params(shape, scalar_head), shape.num_layers, shape.num_experts, shape.moe_topk,
                               shape.hidden_size, shape.ffn_hidden_size)


def expected_experts_touched(num_experts: int, topk: int, tokens: float) -> float:
    """Distinct experts of one layer that a batch of `tokens` tokens routes to, each token choosing `topk` of
    `num_experts`: E * (1 - (1 - k/E)^B), assuming uniform, independent routing (a balanced router's aim; a skewed
    one touches fewer). k at B = 1, min(E, B*k) while B*k << E, all E at large B."""
    if num_experts <= 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - topk / num_experts) ** max(0.0, tokens))


def state_bytes(n_params: int, dtype: str, trainable: bool, dist_opt: bool, dp: int) -> dict[str, float]:
    """params / grads / optimizer bytes on one rank holding n_params (table 1)."""
    b = BYTES_PER_PARAM[dtype_key(dtype)]
    out = {"params": float(n_params * b["param"]), "grads": 0.0, "optimizer": 0.0}
    if trainable:
        out["grads"] = float(n_params * b["grad"])
        opt = n_params * (b["main_param"] + b["adam"])
        out["optimizer"] = opt / dp if dist_opt else float(opt)
    return out


# ---- activations -----------------------------------------------------------------------------------------------
def layer_activations(shape: Shape, tp: int, sp: bool, seq: int, micro: int, elem: int, profile: str,
                      recompute: str, etp: int | None = None) -> dict[str, float]:
    """Bytes one layer keeps for backward for one micro-batch of `micro` sequences of `seq` tokens (table 2).
    etp: the experts' tensor-parallel size (None: = tp)."""
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"--recompute {recompute!r} is not one of {RECOMPUTE_MODES}")
    prof = KERNEL_PROFILES[profile]
    tokens = seq * micro
    rep = 1 / tp if sp else 1.0  # the norm / linear-input parts are TP-replicated unless sequence parallel
    h, q, kv, a = shape.hidden_size, shape.q_width, shape.kv_width, shape.num_heads
    if recompute == "full":  # Megatron full recompute (uniform, 1 layer per checkpoint) keeps the layer input only
        return {"layer input (full recompute)": tokens * rep * h * elem}
    norms = 2 * tokens * rep * (h * elem * (2 if prof.norm_saves_output else 1) + 4)
    out = {"norms": norms, "linear inputs": 2 * tokens * rep * h * elem}
    if prof.attention == "unfused" and recompute != "selective":
        # q, and k, v repeated to all heads; the softmax output (elem * a*s^2*b / t) and a bool s^2 mask
        out["attention q,k,v"] = tokens * elem * 3 * q / tp
        out["attention s^2"] = elem * a / tp * seq * seq * micro + seq * seq
    elif prof.attention == "sdpa":
        # SDPA keeps q, k and v repeated to all heads (sdpa_attention.py repeats them for the fused CPU kernel),
        # its own output (before the copy linear_proj reads) and the fp32 lse. Selective recompute of a kernel
        # that keeps no s^2 tensor has nothing to drop: measured it keeps 1.7% more (the checkpoint's inputs),
        # so it is modelled as none.
        out["attention q,k,v"] = tokens * elem * 4 * q / tp + tokens * 4 * a / tp
        out["attention s^2"] = 0.0
    else:
        # flash keeps q and k/v at GQA width (+ fp32 lse); the selective checkpoint of core attention keeps its
        # inputs q, k, v only (Megatron recomputes the rest: Korthikanti §5 removes the 5as^2b term)
        out["attention q,k,v"] = tokens * elem * (q + 2 * kv) / tp
        out["attention s^2"] = 0.0
        if prof.attention == "flash" and recompute != "selective":
            out["attention q,k,v"] += tokens * 4 * a / tp  # lse
    out["attention out"] = tokens * elem * q / tp  # linear_proj input (= flash's saved output)
    if not shape.is_moe:
        out["mlp"] = tokens * elem * prof.ffn_tensors * shape.ffn_hidden_size / tp
        return out
    out.update(moe_activations(shape, tokens, rep, elem, prof.ffn_tensors, tp, tp if etp is None else etp))
    return out


def moe_activations(shape: Shape, tokens: float, rep: float, elem: int, ffn_tensors: int, tp: int,
                    etp: int) -> dict[str, float]:
    """What an MoE layer keeps for a micro-batch of `tokens` tokens, of which a rank feeds it tokens*rep (rep = 1/tp
    with sequence parallel).
    Derived, not measured (no GPU in the CI): the router's fp32 logits (E per token, for the softmax's backward);
    each token arrives at its k experts (the alltoall dispatcher's permuted rows; with etp > 1 gathered over the
    expert-TP group, so etp times the rows at F/etp width), and each row keeps the expert's input and output (h wide:
    fc1's input and the output the weighted un-permute multiplies by its probability) plus the SwiGLU's F-wide
    tensors (as the dense MLP, per the kernel profile); the shared expert as a dense MLP over tp. Uniform routing:
    the dispatcher gives each rank tokens*k rows on average (a skewed router gives the busiest rank more)."""
    h, f, k = shape.hidden_size, shape.ffn_hidden_size, shape.moe_topk
    rows = tokens * rep * k * etp
    out = {"moe router": tokens * rep * shape.num_experts * 4.0,
           "moe expert rows": rows * elem * (2 * h + ffn_tensors * f / etp)}
    if shape.shared_expert_ffn:
        out["mlp"] = tokens * elem * ffn_tensors * shape.shared_expert_ffn / tp
    return out


def head_activations(shape: Shape, tp: int, sp: bool, seq: int, micro: int, elem: int, profile: str,
                     scalar_head: bool) -> dict[str, float]:
    """The last stage beyond its layers: the final norm, the output layer's input and the logits."""
    tokens, rep, h = seq * micro, (1 / tp if sp else 1.0), shape.hidden_size
    prof = KERNEL_PROFILES[profile]
    out = {"final norm": tokens * rep * (h * elem * (2 if prof.norm_saves_output else 1) + 4),
           "output input": tokens * rep * h * elem}
    if not scalar_head:
        out["logits"] = tokens * padded_vocab(shape.vocab_size, tp) / tp * (elem + LOGIT_FP32_BYTES)
    return out


def chunks_in_flight(pp: int, stage: int, micro_batches: int, vpp: int = 1) -> float:
    """Micro-batches whose activations a pipeline stage holds at its peak, in units of the stage's layers.

    1F1B: stage k holds min(p - k, m) (Korthikanti §4.2.3: stage 0 holds p). Interleaved with v chunks per
    stage: Megatron's warmup count (schedules.py: (p - k - 1) * 2 + (v - 1) * p, plus the one in its forward)
    in chunks of L/(p*v) layers; for stage 0 that is L * (1 + (p - 1)/(p*v)) layers' worth."""
    if vpp <= 1:
        return float(min(pp - stage, micro_batches))
    chunks = min((pp - stage - 1) * 2 + (vpp - 1) * pp + 1, micro_batches * vpp)
    return chunks / vpp


# ---- the generation side ----------------------------------------------------------------------------------------
def kv_bytes_per_token(shape: Shape, t_g: int, elem: int) -> float:
    """K and V of every layer for one token on one generation rank: 2 * L * kv_heads * head_dim * bytes / t_g
    (vLLM replicates KV heads when t_g > kv_heads: each rank keeps at least one)."""
    heads_per_rank = max(shape.num_kv_heads / t_g, 1.0)
    return 2 * shape.num_layers * heads_per_rank * shape.head_dim * elem


def reshard_peak_bytes(shape: Shape, t_g: int, elem: int, bucket_bytes: int) -> float:
    """The 3D-HybridEngine's memory beyond the training shards while it reshards: one bucket of new generation
    shards + staging (hybridflow/resharding/engine.py), but at least the largest single parameter's generation
    shard twice (a bucket holds >= 1 parameter): the vocab-parallel embedding / output layer."""
    largest = max(shape.vocab_size * shape.hidden_size, 2 * shape.ffn_hidden_size * shape.hidden_size) / t_g * elem
    return max(float(bucket_bytes), 2 * largest)
