"""Seconds per stage of one RL step, from FLOPs, memory bandwidth and interconnect bandwidth.

- generate: vLLM's continuous batching simulated per replica (launch/plan/batching.py: admission while the KV cache
  and max_num_seqs allow, preemption of the newest and its recompute when the cache is full) over the job's response
  lengths (launch/plan/lengths.py: the budget, a mean and p99, or a run's histogram). Each decode step
  (DecodeModel.step_s) costs vLLM's CPU overhead + the larger of the GEMM FLOPs at the CUDA-graph batch and the
  weight reads + the KV reads + two TP all-reduces per layer (+ the fused-MoE latency per MoE layer). The step waits
  for the slowest replica; its long tail (few sequences left, each step still reading every weight) comes out of
  it. Prefill, and the recompute of a preempted request, is compute-bound.
- log-prob passes (old_log_prob, ref, values, rm): 2N FLOPs per token + attention, over all GPUs of the role,
  stretched by the pipeline bubble (p - 1)/m.
- updates: 6N per token + 3x the attention forward (+1 forward with full recompute, + the attention forward with
  selective), bubble (p - 1)/(v*m), then the distributed optimizer's gradient reduce-scatter and parameter
  all-gather per optimizer step.
- transition: the 3D-HybridEngine's per-rank receive volume M/t_g - M/(p*max(t, t_g))
  (hybridflow.resharding.planner.optimal_recv_bytes) over the link between the ranks that exchange.
- MoE (every layer sparse, E experts, top-k): FLOPs count the active parameters (attention, router, shared expert
  and k experts: memory.active_params), memory and the weight sync every expert. The alltoall token dispatcher
  sends each token's hidden state to its k experts and back (dispatch + combine) in every forward and again in
  the backward, (ep-1)/ep of it off the rank (uniform routing), over the link the EP group spans. The experts'
  gradient sync runs over the expert data-parallel group. Decode reads the experts a step's batch touches:
  memory.expected_experts_touched (k at batch 1, all E at a large batch, uniform routing ASSUMED).
Tokens per row follow Options.packing (micro-batches trimmed to their longest row, packed, or padded to the budget).
The efficiencies are one table (EFFICIENCY) with their justification; the one chosen by looking at a published case
(internode_link) says so and keeps its prior for the leave-one-source-out check.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hybridflow.resharding.planner import optimal_recv_bytes
from launch.plan import memory as M
from launch.plan.batching import continuous_batching
from launch.plan.fit import elem_bytes, train_micro_batches
from launch.plan.job import Job, Role


@dataclass(frozen=True)
class Eff:
    """One efficiency: its value, why, which published sources (PUBLISHED_SOURCES in launch/plan/published.py) were
    looked at to choose it, and the value it would have without them (`prior`): the leave-one-source-out check
    replays a source's cases with `prior` for every entry that source informed."""

    value: float
    source: str
    informed_by: frozenset[str] = frozenset()
    prior: float | None = None


EFFICIENCY: dict[str, Eff] = {
    # Megatron-LM's README: "up to 47% MFU on H100 clusters" (GPT 2B-462B, seq 4096); Narayanan et al. 2021 (SC'21):
    # 44-52% of A100 peak, communication included. RL updates run 1-4k-token rows in micro-batches of 1-4, smaller
    # GEMMs than pretraining's: the lower end, 40%, for the compute alone (TP/PP comm, the bubble and the gradient
    # sync are added separately).
    "train_mfu": Eff(0.40, "Megatron-LM README: up to 47% MFU on H100; Narayanan et al. 2021: 44-52% on A100; "
                           "40% at RL's short rows and small micro-batches, communication counted apart"),
    "forward_mfu": Eff(0.40, "same kernels as training's forward"),
    # FSDP trainers (Options.train_backend="fsdp", e.g. verl's example scripts): torchtitan's docs/performance.md
    # measured 1D FSDP2 training of Llama 3.1 8B on 8 H100 (500 W cap, bf16, local batch 2, seq 8192, selective
    # activation checkpointing) at 5,762 tokens/s/GPU eager and 6,667 with torch.compile, and states 33% to 39% MFU
    # for those runs: 33% for the eager one, which is how verl's FSDP workers run. End to end: FSDP's parameter
    # all-gathers and gradient reduce-scatters are inside the figure, so no separate communication term is added.
    # Not chosen by looking at any published RL case.
    "fsdp_mfu": Eff(0.33, "torchtitan docs/performance.md: 1D FSDP2, Llama 3.1 8B on 8 H100, eager, 33% MFU "
                          "(5,762 tokens/s/GPU), FSDP's communication included"),
    "prefill_mfu": Eff(0.40, "prefill GEMMs are training-sized (thousands of tokens per step)"),
    # Decode GEMMs are skinny (M = running sequences <= max_num_seqs): a bf16 8192^3 matmul reaches 80% of peak on
    # the lent H200 (FACTS.md), an M=256 one about half of that; only matters when the batch is large enough for the
    # FLOPs to exceed the weight reads.
    "decode_gemm_mfu": Eff(0.40, "skinny decode GEMMs (M <= 256-1024): about half the 80% a square bf16 GEMM "
                                 "reaches (FACTS.md, H200 8192^3 at 790 TFLOP/s)"),
    # Decode reads every weight and the KV cache of every running sequence once per step: memory-bound. STREAM-like
    # copies reach ~85-90% of the HBM datasheet bandwidth on A100/H100; paged-attention and GEMV kernels less.
    "decode_hbm": Eff(0.70, "memory-bound decode: ~85-90% STREAM bandwidth, less for paged KV reads and GEMV"),
    # Between two CUDA-graph replays vLLM schedules, prepares inputs and samples on the CPU. vLLM's "v0.6.0: 2.7x
    # throughput improvement" blog (2024-09-05) profiled Llama 3 8B on 1 H100: 29% of the time in scheduling and
    # input preparation (+33% in the HTTP server, which an offline LLM.generate does not have), at decode steps of
    # roughly 7-20 ms; v0.6+ and V1 overlap part of it. 2 ms per step is an estimate from those figures, not fitted.
    "decode_step_overhead_s": Eff(2e-3, "vLLM per-step scheduling + input prep + sampling on the CPU (vLLM v0.6.0 "
                                        "blog: 29% of an 8B H100 decode in scheduling before overlap); estimate"),
    # An MoE layer's decode runs vLLM's fused-MoE path: router top-k, the alignment of tokens to experts, two
    # grouped expert GEMMs, the activation and the weighted combine, several small kernels per layer. Measured
    # (tenstorrent/tt-inference-server issue #340, "Qwen3 Family: GPU Benchmarks", vLLM on one A100-80GB, ISL 128,
    # OSL 128, concurrency 1): Qwen3-30B-A3B 9.6 ms per output token, where this decode model gives 6.3 ms (its
    # attention, router and 8 experts read at decode_hbm, plus decode_step_overhead_s). The 3.3 ms over its 48 MoE
    # layers is ~69 us each. The same harness's dense Qwen3-1.7B (4.6 ms against 4.4 ms here) shows the rest of the
    # model is right at that point. ASSUMED: the excess is a per-layer latency (kernels too small to fill the GPU
    # at batch 1), not slower weight reads, so it is added once per MoE layer per step at any batch; a larger batch
    # already pays for the extra experts it touches through weights_read. One GPU assumed (61 GB of bf16 weights fit
    # an 80 GB A100). Not chosen by looking at any published RL case.
    "moe_decode_layer_s": Eff(69e-6, "vLLM fused-MoE path per MoE layer per decode step: tenstorrent/tt-inference-"
                                     "server #340, one A100, Qwen3-30B-A3B 9.6 ms/token at batch 1 against 6.3 ms "
                                     "modelled without it, over 48 layers"),
    # NCCL ring all-gather / reduce-scatter and p2p reach ~80% of NVLink bandwidth at large messages (nccl-tests
    # busbw on DGX A100/H100).
    "link": Eff(0.80, "NCCL bus bandwidth at large messages ~80% of NVLink (nccl-tests)"),
    # Between nodes, the paper's way: each rank's Table 2 receive volume over its share of the node's NIC (200 Gb/s
    # shared by 8 GPUs on the paper's testbed). The paper's two published 70B transition times (HybridFlow 9.6 s and
    # the DeepSpeed-Chat scheme 87.8 s, both derived from "-89.1%, 78.2 s") each imply half of that share: ASSUMED the
    # testbed's cross-node collectives ran at 50% of the quoted line rate (its 200 Gb/s counted over both directions,
    # or NCCL's ring over one NIC per node). nccl-tests alone would say ~80%: the prior, which leave-one-source-out
    # uses for the paper's cases. The one entry chosen by looking at a published case.
    "internode_link": Eff(0.50, "cross-node collectives at 50% of the per-GPU NIC share: both HybridFlow-paper "
                                "transition times imply it (nccl-tests alone: 0.8)",
                          informed_by=frozenset({"hybridflow-paper"}), prior=0.80),
    # MoE token dispatch (Megatron's alltoall dispatcher: NCCL all_to_all; per-rank messages of MBs at RL's token
    # counts). DeepEP's README measures its dispatch/combine kernels at ~150 of an H800's ~160 GB/s NVLink and
    # 40-60 GB/s over a ~50 GB/s CX7 NIC: an upper bound for the alltoall; NCCL's all_to_all is taken at the bus
    # bandwidth of large NCCL collectives (nccl-tests), as `link`. Not chosen by looking at any published case.
    "alltoall": Eff(0.80, "MoE token alltoall at ~80% of the link it spans (nccl-tests; DeepEP's README: its "
                          "kernels reach ~95% of NVLink, an upper bound); NVLink inside a node, the NIC across"),
    # One small all-reduce on NVLink: ~10-20 us (nccl-tests latency at 8 GPUs); decode does 2 per layer.
    "tp_allreduce_latency_s": Eff(15e-6, "small-message NCCL all-reduce latency on NVLink (nccl-tests)"),
    # Fine-grained routed experts (narrower than the hidden size: Qwen3-MoE, Qwen2-MoE) are many small GEMMs, with
    # the tokens' permutation and the router's work around them. Megatron-Bridge's docs/performance-summary.md
    # (25.11 container, DGX-H100) measured Qwen3-30B-A3B pretraining on 16 H100 (FP8-CS, GBS 512, MBS 2, sequence
    # 4096, TP1 PP2 VP24 EP8, routing force-balanced) at 5,275 tokens/s/GPU, 121 model TFLOP/s/GPU: the FLOPs per
    # token agree with matmul_params and attention_flops_fwd within 1%. With the rest of the model at train_mfu and
    # the EP8 alltoall on NVLink at `alltoall`, the experts' FLOPs ran at 7.7% of the bf16 peak
    # (tests/test_planner_moe.py recomputes it from that row). ASSUMED: bf16 runs them no faster than that FP8 run
    # did (FP8 only speeds GEMMs up), so this is an upper bound on their speed; coarse experts (Mixtral's, wider
    # than the hidden size) stay at train_mfu. Used for training and for the log-prob forwards. Not chosen by
    # looking at any published RL case.
    "moe_expert_mfu": Eff(0.077, "fine-grained routed experts' FLOPs: Megatron-Bridge performance summary, "
                                 "Qwen3-30B-A3B on 16 H100 at 5,275 tokens/s/GPU, the rest at train_mfu"),
}

# The leave-one-source-out check swaps entries here (efficiency_overrides); eff() reads through it.
_OVERRIDES: dict[str, float] = {}


def eff(name: str) -> float:
    return _OVERRIDES.get(name, EFFICIENCY[name].value)


class efficiency_overrides:  # noqa: N801 - used as a context manager, like a function
    """`with efficiency_overrides({"train_mfu": 0.3}): ...` plans with those values instead of the table's."""

    def __init__(self, values: dict[str, float]):
        self.values = values

    def __enter__(self):
        self.saved = dict(_OVERRIDES)
        _OVERRIDES.update(self.values)

    def __exit__(self, *exc):
        _OVERRIDES.clear()
        _OVERRIDES.update(self.saved)


def without_source(source: str) -> dict[str, float]:
    """The table as it would be justified without looking at `source`: every entry it informed at its prior."""
    return {k: e.prior for k, e in EFFICIENCY.items() if source in e.informed_by and e.prior is not None}


# vLLM captures CUDA graphs for these decode batch sizes (its default capture list: 1, 2, 4, then every multiple of
# 8); a batch runs padded to the next captured size.
def cuda_graph_batch(batch: int) -> int:
    if batch <= 2:
        return max(1, batch)
    if batch <= 4:
        return 4
    return -(-batch // 8) * 8


@dataclass(frozen=True)
class StageTime:
    name: str
    seconds: float
    detail: str
    parts: tuple[tuple[str, float], ...] = ()  # the terms that add up to `seconds` (what a layout choice turns on)


def matmul_params(role_or_shape, scalar_head: bool = False) -> float:
    """Parameters that do matmuls for one token (the input embedding is a lookup; an MoE layer runs k of its E
    experts): the 2N / 6N in the FLOP count. Tied embeddings are one matrix that is both the lookup and the output
    layer's matmul, so it stays in; a scalar head replaces that output matmul."""
    shape = role_or_shape.shape if isinstance(role_or_shape, Role) else role_or_shape
    lookup_only = shape.vocab_size * shape.hidden_size
    if shape.tie_word_embeddings and not scalar_head:
        lookup_only = 0
    return M.active_params(shape, scalar_head) - lookup_only


def routed_expert_params(shape) -> float:
    """Every routed expert of every layer (what a decode step reads when its batch touches them all)."""
    return shape.num_layers * shape.num_experts * M.expert_params(shape) if shape.is_moe else 0.0


def attention_flops_fwd(shape, seq: float) -> float:
    """QK^T and PV of one causal sequence, forward: 2 matmuls * 2 FLOP * (s^2 / 2) * q_width per layer."""
    return 2 * seq * seq * shape.q_width * shape.num_layers


def forward_flops(role: Role, seq: float, sequences: int) -> float:
    return sequences * (2 * matmul_params(role.shape, role.scalar_head) * seq + attention_flops_fwd(role.shape, seq))


def fine_expert_params(shape) -> float:
    """The routed-expert matmul parameters one token runs through (k of E per layer) when the experts are
    fine-grained (narrower than the hidden size), else 0: their FLOPs run at EFFICIENCY moe_expert_mfu."""
    if not shape.is_moe or shape.ffn_hidden_size >= shape.hidden_size:
        return 0.0
    return shape.num_layers * shape.moe_topk * M.expert_params(shape)


def math_seconds(flops: float, expert_flops: float, gpus: int, peak: float, mfu: str) -> float:
    """`flops` on `gpus` GPUs: the fine-grained experts' share (`expert_flops`, inside `flops`) at moe_expert_mfu,
    the rest at `mfu`."""
    return ((flops - expert_flops) / eff(mfu) + expert_flops / eff("moe_expert_mfu")) / (gpus * peak)


def link_bytes_s(job: Job, group_span: int) -> float:
    """A group whose ranks span `group_span` consecutive ranks talks over NVLink inside a node, else over the NICs."""
    dev = job.device
    if group_span <= job.gpus_per_node:
        return dev.nvlink_bytes_s * eff("link")
    return dev.internode_bytes_s * eff("internode_link")


def model_parallel_comm_s(job: Job, role: Role, collectives_per_layer: int, seq: float) -> float:
    """Megatron's TP collectives (with or without SP: 2 all-reduces = 4 all-gather/reduce-scatter per layer forward,
    the same again backward), each moving (t-1)/t of the micro-batch activation [s, b, h] per GPU, over this GPU's
    share of the batch and layers; plus the PP send/recv of the activation (and its gradient when training) at each
    stage boundary. Not overlapped (our DDP runs without overlap; megatron_workers/optimizer.py)."""
    d, shape, e = role.dims, role.shape, elem_bytes(job)
    seqs = job.sequences / (d.dp * d.cp)
    act = seq * shape.hidden_size * e  # one sequence's [s, h] activation
    tp_bytes = seqs * shape.num_layers / d.pp * collectives_per_layer * (d.tp - 1) / d.tp * act if d.tp > 1 else 0.0
    directions = 2 if collectives_per_layer > 4 else 1
    pp_bytes = directions * seqs * act / (d.tp if d.sp else 1) if d.pp > 1 else 0.0
    return tp_bytes / link_bytes_s(job, d.tp) + pp_bytes / link_bytes_s(job, d.tp * d.cp * d.dp + 1)


def alltoall_bytes_s(job: Job, group_span: int) -> float:
    """The MoE dispatcher's alltoall over NVLink inside a node, the NICs when the EP group spans nodes."""
    dev = job.device
    raw = dev.nvlink_bytes_s if group_span <= job.gpus_per_node else dev.internode_bytes_s
    return raw * eff("alltoall")


def dispatch_bytes_per_token(shape, ep: int, etp: int, elem: int) -> float:
    """Bytes one rank sends per token and per alltoall (one dispatch, or one combine) of one MoE layer: the token's
    hidden state to each of its k experts, the (ep-1)/ep share on other ranks (uniform routing), and with etp > 1
    the rows gathered over the expert-TP group (etp - 1 copies)."""
    if not shape.is_moe:
        return 0.0
    return shape.moe_topk * shape.hidden_size * elem * ((ep - 1) / ep + (etp - 1))


def dispatcher_comm_s(job: Job, role: Role, alltoalls_per_layer: int, seq: float) -> float:
    """The token dispatcher's traffic on one GPU over the job's sequences: every MoE layer of its stage does
    `alltoalls_per_layer` alltoalls per token (forward: dispatch + combine = 2; a training step adds their
    backward, 4; full recompute one more forward, 6). A rank feeds the MoE layer its 1/tp share of the tokens
    with sequence parallel (Megatron requires SP for MoE under TP)."""
    d, shape = role.dims, role.shape
    if not shape.is_moe or d.ep * d.expert_tp == 1:
        return 0.0
    tokens = job.sequences / (d.dp * d.cp) * seq / (d.tp if d.sp else 1)
    per_token = dispatch_bytes_per_token(shape, d.ep, d.expert_tp, elem_bytes(job))
    total = tokens * shape.num_layers / d.pp * alltoalls_per_layer * per_token
    return total / alltoall_bytes_s(job, d.ep * d.expert_tp)


def _bubble(pp: int, micro_batches: int, vpp: int = 1) -> float:
    return 1.0 + (pp - 1) / (vpp * max(1, micro_batches))


def forward_pass(job: Job, role: Role, name: str) -> StageTime:
    d = role.dims
    gpus = job.world
    micro = max(1, role.fwd_micro_batch)
    m = max(1, job.sequences // d.dp // micro)
    seq = job.compute_seq_len(micro)
    flops = forward_flops(role, seq, job.sequences)
    if job.options.train_backend == "fsdp":  # as in update(): one end-to-end efficiency, communication inside it
        compute = flops / (gpus * job.device.peak_flops * eff("fsdp_mfu"))
        return StageTime(name, compute, f"{flops:.3g} FLOP on {gpus} GPUs at {eff('fsdp_mfu'):.0%} MFU (FSDP, "
                                        f"communication included; {seq:.0f} tokens/row)", (("compute", compute),))
    comm = model_parallel_comm_s(job, role, 4, seq)
    a2a = dispatcher_comm_s(job, role, 2, seq)
    experts = 2 * fine_expert_params(role.shape) * seq * job.sequences
    compute = math_seconds(flops, experts, gpus, job.device.peak_flops, "forward_mfu")
    bubble = _bubble(d.pp, m)
    sec = (compute + comm + a2a) * bubble
    return StageTime(name, sec, f"{flops:.3g} FLOP on {gpus} GPUs at {eff('forward_mfu'):.0%} MFU"
                                + (f" (routed experts at {eff('moe_expert_mfu'):.1%})" if experts else "")
                                + f" ({seq:.0f} tokens/row), TP/PP comm {comm:.1f} s"
                                + (f", EP alltoall {a2a:.1f} s" if a2a else "") + f", bubble p={d.pp} m={m}",
                     (("compute", compute), ("TP/PP comm", comm), ("EP alltoall", a2a),
                      ("pipeline bubble", sec - compute - comm - a2a)))


def dp_link_bytes_s(job: Job, role: Role) -> float:
    """DP peers sit tp*cp ranks apart: inside a node while tp*cp*dp fits in it, across nodes otherwise."""
    d = role.dims
    return link_bytes_s(job, d.tp * d.cp * d.dp)


def update(job: Job, role: Role, name: str) -> StageTime:
    d, opts = role.dims, job.options
    seq, seqs = job.compute_seq_len(max(1, role.micro_batch)), job.sequences
    extra_fwd = {"none": 0.0, "selective": 0.0, "full": 1.0}[opts.recompute]
    dense = 2 * matmul_params(role.shape, role.scalar_head) * seq * seqs
    attn = attention_flops_fwd(role.shape, seq) * seqs
    attn_passes = 3 + extra_fwd + (1 if opts.recompute == "selective" else 0)
    flops = role.epochs * (dense * (3 + extra_fwd) + attn * attn_passes)
    m = train_micro_batches(job, role)
    if opts.train_backend == "fsdp":  # one measured end-to-end efficiency, FSDP's communication inside it
        math_s = flops / (job.world * job.device.peak_flops * eff("fsdp_mfu"))
        return StageTime(name, math_s, f"{flops:.3g} FLOP at {eff('fsdp_mfu'):.0%} MFU (FSDP, communication "
                                       f"included; {seq:.0f} tokens/row)", (("compute", math_s),))
    mp_comm = role.epochs * model_parallel_comm_s(job, role, 8 + (4 if opts.recompute == "full" else 0), seq)
    a2a = role.epochs * dispatcher_comm_s(job, role, 4 + (2 if opts.recompute == "full" else 0), seq)
    experts = role.epochs * 2 * fine_expert_params(role.shape) * seq * seqs * (3 + extra_fwd)
    math_s = math_seconds(flops, experts, job.world, job.device.peak_flops, "train_mfu")
    compute = (math_s + mp_comm + a2a) * _bubble(d.pp, m, opts.vpp)
    steps = role.epochs * (job.prompts // role.mini_batch)
    n_rank = M.stage_params(role.shape, d.tp, d.pp, 0, role.scalar_head, d.ep, d.expert_tp)
    n_experts = M.stage_expert_params(role.shape, d.pp, d.ep, d.expert_tp)
    b = M.BYTES_PER_PARAM[job.dtype]

    def sync(n: float, group: int) -> float:  # the distributed optimizer's reduce-scatter + all-gather per step
        return (group - 1) / group * n * (b["grad"] + b["param"]) if group > 1 else 0.0

    # the expert-DP group strides etp*ep ranks inside the same tp*cp*dp block as the DP group: the same link
    sync_bytes = sync(n_rank - n_experts, d.dp * d.cp) + sync(n_experts, d.expert_dp)
    comm = steps * sync_bytes / dp_link_bytes_s(job, role)
    if opts.overlap_grad_reduce:  # hidden behind the backward (2/3 of the math without recompute), what is left shows
        comm = max(0.0, comm - math_s * 2 / (3 + extra_fwd))
    return StageTime(name, compute + comm, f"{flops:.3g} FLOP at {eff('train_mfu'):.0%} MFU"
                                           + (f" (routed experts at {eff('moe_expert_mfu'):.1%})" if experts else "")
                                           + f" ({seq:.0f} tokens/row), TP/PP comm {mp_comm:.1f} s"
                                           + (f", EP alltoall {a2a:.1f} s" if a2a else "")
                                           + f", bubble p={d.pp} m={m} v={opts.vpp}; {steps} "
                                           f"optimizer steps, grad sync {comm:.2f} s",
                     (("compute", math_s), ("TP/PP comm", mp_comm), ("EP alltoall", a2a),
                      ("pipeline bubble", compute - math_s - mp_comm - a2a), ("DP grad sync", comm)))


def transition_link_bytes_s(job: Job) -> float:
    """Ranks that exchange layers are in different PP stages (stride t*cp*dp), in one generation TP group, or (an
    expert held elsewhere) in one EP group of ep*etp consecutive ranks (every expert-DP replica holds all experts,
    so the nearest copy is inside the EP group)."""
    d = job.roles["actor"].dims
    across = ((d.pp > 1 and d.tp * d.cp * d.dp >= job.gpus_per_node) or job.t_g > job.gpus_per_node
              or d.ep * d.expert_tp > job.gpus_per_node)
    return job.device.internode_bytes_s * eff("internode_link") if across else job.device.nvlink_bytes_s * eff("link")


def transition_recv_bytes(job: Job) -> float:
    """Per-rank receive volume of the weight sync. Dense tensors: optimal_recv_bytes over (t, p). Routed experts:
    a rank trains E/ep experts of its stage, each split over etp, and generates with every expert split over t_g;
    the shards it already holds and keeps are its experts' slices: X/(p*ep*max(etp, t_g)), i.e. the same closed form
    with ep splitting like a pipeline stage (another axis than the tensor split)."""
    d, shape, e = job.roles["actor"].dims, job.roles["actor"].shape, elem_bytes(job)
    experts = routed_expert_params(shape) * e
    dense = M.total_params(shape) * e - experts
    recv = optimal_recv_bytes(dense, d.tp, d.pp, job.t_g)
    if experts:
        recv += optimal_recv_bytes(experts, d.expert_tp, d.pp * d.ep, job.t_g)
    return recv


def transition(job: Job) -> StageTime:
    recv = transition_recv_bytes(job)
    sec = recv / transition_link_bytes_s(job)
    return StageTime("transition", sec, f"{recv / 1e9:.2f} GB received per GPU at "
                                        f"{transition_link_bytes_s(job) / 1e9:.3g} GB/s")


def pool_link_bytes_s(job: Job) -> float:
    """Between the actor's pool and the rollout pool: NVLink when both fit in one node together, else the NICs
    (async_step.pools_share_node)."""
    from launch.plan.async_step import pools_share_node

    actor, rollout = job.pool_procs[job.roles["actor"].pool], job.pool_procs[job.rollout_pool]
    if pools_share_node(list(actor), list(rollout), job.gpus_per_node):
        return job.device.nvlink_bytes_s * eff("link")
    return job.device.internode_bytes_s * eff("internode_link")


def weight_sync(job: Job) -> StageTime:
    """The async layout's weight sync (launch/plan/async_step.py): each rollout rank receives its M/t_g shard, the
    busiest training rank sends its slice to each rollout replica it serves; amortised over
    trigger_parameter_sync_step steps."""
    from launch.plan import async_step as A

    d = job.roles["actor"].dims
    model = M.total_params(job.roles["actor"].shape) * elem_bytes(job)
    recv = A.rollout_rank_recv_bytes(model, job.t_g)
    send = A.busiest_sender_bytes(model, d.tp, d.pp, d.dp * d.cp, job.rollout_world // job.t_g)
    link = pool_link_bytes_s(job)
    one = A.weight_sync_s(recv, send, link)
    sec = A.sync_per_step_s(one, job.sync_every)
    return StageTime("weight_sync", sec, f"{recv / 1e9:.2f} GB received per rollout GPU, {send / 1e9:.2f} GB sent by "
                                         f"the busiest training GPU, at {link / 1e9:.3g} GB/s: {one:.1f} s every "
                                         f"{job.sync_every} step{'s' if job.sync_every > 1 else ''}")


# ---- generation ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DecodeModel:
    """What one decode step of one vLLM replica costs, per GPU of the replica (t_g GPUs share the work)."""

    peak_flops: float
    hbm_bytes_s: float
    matmul_params_rank: float  # matmul parameters one token runs through, on one generation rank (the FLOPs)
    elem: int
    kv_bytes_per_token: float  # one token's K and V over all layers, on one rank
    layers: int
    hidden: int
    t_g: int
    tp_link_bytes_s: float
    # MoE: every routed expert's parameters on one rank, and the router's E and k; a step reads the experts its
    # batch touches (memory.expected_experts_touched) besides the rest of matmul_params_rank
    expert_params_rank: float = 0.0
    num_experts: int = 0
    topk: int = 0

    def weights_read(self, batch: int) -> float:
        """Matmul parameters one decode step reads on one rank at `batch` running sequences."""
        if not self.num_experts:
            return self.matmul_params_rank
        per_expert = self.expert_params_rank / self.num_experts
        touched = M.expected_experts_touched(self.num_experts, self.topk, batch)
        return self.matmul_params_rank - self.topk * per_expert + touched * per_expert

    def step_s(self, batch: int, kv_tokens: float) -> float:
        """One decode step at `batch` running sequences whose contexts sum to `kv_tokens`: the linear layers (the
        larger of their FLOPs at the CUDA-graph batch and their weight reads), then attention reading the KV cache,
        the TP all-reduces (2 per layer: latency + bytes), vLLM's per-step CPU work, and for an MoE model its
        fused-MoE path's latency per layer (EFFICIENCY moe_decode_layer_s)."""
        hbm = self.hbm_bytes_s * eff("decode_hbm")
        gemm = max(2 * self.matmul_params_rank * cuda_graph_batch(batch) / (self.peak_flops * eff("decode_gemm_mfu")),
                   self.weights_read(batch) * self.elem / hbm)
        attn = kv_tokens * self.kv_bytes_per_token / hbm
        allreduce = 0.0
        if self.t_g > 1:
            per = 2 * (self.t_g - 1) / self.t_g * batch * self.hidden * self.elem / self.tp_link_bytes_s
            allreduce = 2 * self.layers * (eff("tp_allreduce_latency_s") + per)
        moe = self.layers * eff("moe_decode_layer_s") if self.num_experts else 0.0
        return eff("decode_step_overhead_s") + gemm + attn + allreduce + moe


def decode_model(shape, device, t_g: int, elem: int, tp_link_bytes_s: float) -> DecodeModel:
    """The decode step of one vLLM replica at tensor parallel t_g serving `shape` on `device`."""
    return DecodeModel(device.peak_flops, device.hbm_bytes_s, matmul_params(shape) / t_g, elem,
                       M.kv_bytes_per_token(shape, t_g, elem), shape.num_layers, shape.hidden_size, t_g,
                       tp_link_bytes_s, routed_expert_params(shape) / t_g, shape.num_experts, shape.moe_topk)


def generation(job: Job) -> StageTime:
    shape, e, dev, t_g = job.roles["actor"].shape, elem_bytes(job), job.device, job.t_g
    replicas = job.rollout_world // t_g  # the rollout pool's GPUs, or the actor's (the rollout in its processes)
    per_replica = math.ceil(job.sequences / replicas)
    kv_tok = M.kv_bytes_per_token(shape, t_g, e)
    prompt = job.prompt_mean
    if job.kv_cache_bytes < kv_tok * job.seq_len:
        raise ValueError(f"actor_rollout_ref.rollout.kv_cache_memory_bytes={job.kv_cache_bytes} holds no sequence of "
                         f"{job.seq_len} tokens ({kv_tok * job.seq_len / M.GiB:.2f} GiB each at t_g={t_g})")
    # The replica's KV cache in tokens; vLLM admits and preempts over it (launch/plan/batching.py). At the mean
    # length it holds ~`fits` sequences at once, the steady state the detail reports.
    kv_tokens = job.kv_cache_bytes / kv_tok
    fits = max(1, min(per_replica, job.options.max_num_seqs, int(kv_tokens // (prompt + job.lengths.sample_mean()))))
    model = decode_model(shape, dev, t_g, e, link_bytes_s(job, t_g))
    per_token_ar = 0.0
    if t_g > 1:
        per_token_ar = 2 * shape.num_layers * 2 * (t_g - 1) / t_g * shape.hidden_size * e / link_bytes_s(job, t_g)

    def prefill_s(tokens: float) -> float:  # one prefill of `tokens` tokens on one replica
        flops = (2 * matmul_params(shape) * tokens + attention_flops_fwd(shape, tokens)) / t_g
        return flops / (dev.peak_flops * eff("prefill_mfu")) + tokens * per_token_ar

    # The batch's lengths, dealt to the replicas in arrival order; generation ends with the slowest replica (the one
    # holding the batch's longest responses), which every other replica then waits for. A preempted request's
    # recompute is a prefill on its replica.
    every = job.lengths.sample(job.sequences)
    slowest, decode_s, recompute_s = None, 0.0, 0.0
    for r in range(min(replicas, job.sequences)):
        run = continuous_batching(every[r::replicas], kv_tokens, job.options.max_num_seqs, prompt)
        dec = sum(steps * model.step_s(batch, kv) for batch, steps, kv in run.segments)
        rec = sum(prefill_s(c) for c in run.recomputed)
        if slowest is None or dec + rec > decode_s + recompute_s:
            slowest, decode_s, recompute_s = run, dec, rec
    tail_steps = sum(steps for batch, steps, _ in slowest.segments if batch < fits / 4)
    prompts_s = per_replica * prefill_s(prompt)
    sec = prompts_s + recompute_s + decode_s
    preempted = (f", {len(slowest.recomputed)} preempted and recomputed ({recompute_s:.1f} s)"
                 if slowest.recomputed else "")
    return StageTime("generate", sec, f"{replicas} replicas x {per_replica} seqs, KV for ~{fits} at the mean "
                                      f"length; slowest replica {slowest.steps} decode steps ({tail_steps} in the "
                                      f"tail below {fits // 4} running{preempted}), "
                                      f"{decode_s / max(1, slowest.steps) * 1e3:.1f} ms/step mean, prefill "
                                      f"{prompts_s:.1f} s",
                     (("prefill", prompts_s + recompute_s), ("decode", decode_s)))


def offload_traffic(job: Job) -> StageTime:
    """Offloaded state moving over PCIe: Offloader.resident() reloads a role's params and optimizer state for each
    stage it runs in and copies them back after (gradients are dropped and re-zeroed, not copied)."""
    from launch.plan.fit import role_memory

    active = {"actor": 2 + int(job.old_log_prob_pass), "ref": 1, "critic": 2, "reward_model": 1}  # stages per step
    moved = 0.0
    for name, role in job.roles.items():
        comp, _ = role_memory(job, role)
        per_stage = sum(comp[k] for k in ("params", "optimizer") if role.offload[k] and comp.get(k))
        moved += 2 * per_stage * active[name]
    sec = moved / (job.device.pcie_bytes_s * eff("link"))
    return StageTime("offload", sec, f"{moved / 1e9:.1f} GB over PCIe per GPU")


def step_times(job: Job) -> list[StageTime]:
    out = [weight_sync(job) if job.rollout_pool else transition(job), generation(job)]
    r = job.roles
    if job.old_log_prob_pass:
        out.append(forward_pass(job, r["actor"], "old_log_prob"))
    if "ref" in r:
        out.append(forward_pass(job, r["ref"], "ref"))
    if "critic" in r:
        out.append(forward_pass(job, r["critic"], "values"))
    if "reward_model" in r:
        out.append(forward_pass(job, r["reward_model"], "rm"))
    if "critic" in r:
        out.append(update(job, r["critic"], "update_critic"))
    out.append(update(job, r["actor"], "update_actor"))
    out.append(offload_traffic(job))
    return out
