"""Seconds per stage of one RL step, from FLOPs, memory bandwidth and interconnect bandwidth.

- generate: per wave of concurrent sequences, a compute-bound prefill, then `response_length` decode steps, each
  bound by the larger of its FLOPs and the bytes it reads (the rank's weights + the KV cache of every running
  sequence), plus the latency of the two TP all-reduces per layer. Every response is assumed to run to
  rollout.response_length (an upper bound when EOS stops them earlier).
- log-prob passes (old_log_prob, ref, values, rm): 2N FLOPs per token + attention, over all GPUs of the role,
  stretched by the pipeline bubble (p - 1)/m.
- updates: 6N per token + 3x the attention forward (+1 forward with full recompute, + the attention forward with
  selective), bubble (p - 1)/(v*m), then the distributed optimizer's gradient reduce-scatter and parameter
  all-gather per optimizer step.
- transition: the 3D-HybridEngine's per-rank receive volume M/t_g - M/(p*max(t, t_g))
  (hybridflow.resharding.planner.optimal_recv_bytes) over the link between the ranks that exchange.
The efficiencies are one table (EFFICIENCY) with their justification; none is fitted to a published case.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hybridflow.resharding.planner import optimal_recv_bytes
from launch.plan import memory as M
from launch.plan.fit import elem_bytes, train_micro_batches
from launch.plan.job import Job, Role

EFFICIENCY = {
    # Model FLOP utilisation of Megatron training: Narayanan et al. 2021 (SC'21, "Efficient Large-Scale Language
    # Model Training on GPU Clusters") report 44-52% of A100 peak for 18B-1T GPT, communication included; RL updates
    # use short sequences and small micro-batches, so 40% for the compute alone (TP/PP communication, the pipeline
    # bubble and the gradient sync are added separately below).
    "train_mfu": (0.40, "Megatron GPT training reaches 44-52% of peak (Narayanan et al. 2021); 40% for RL's small "
                        "micro-batches, communication counted apart"),
    # Forward-only passes run the same GEMMs without the backward: same efficiency.
    "forward_mfu": (0.40, "same kernels as training's forward"),
    # vLLM prefill is a batch of long sequences: large GEMMs, like a training forward.
    "prefill_mfu": (0.40, "prefill GEMMs are training-sized"),
    # Decode reads every weight once per step: a memory-bound GEMV; well-tuned kernels reach 70-85% of the HBM
    # peak (STREAM-like copy bandwidth on A100/H100 is ~85-90% of the datasheet); vLLM's scheduling and
    # sampling between steps take some of it: 70%.
    "decode_hbm": (0.70, "memory-bound decode: ~85% STREAM bandwidth less vLLM per-step overhead"),
    # NCCL ring all-gather / reduce-scatter and p2p reach ~80% of link bandwidth at large messages
    # (nccl-tests busbw on DGX A100/H100).
    "link": (0.80, "NCCL bus bandwidth at large messages ~80% of the link (nccl-tests)"),
    # One small all-reduce on NVLink: ~10-20 us (nccl-tests latency at 8 GPUs); decode does 2 per layer.
    "tp_allreduce_latency_s": (15e-6, "small-message NCCL all-reduce latency on NVLink (nccl-tests)"),
}


def eff(name: str) -> float:
    return EFFICIENCY[name][0]


@dataclass(frozen=True)
class StageTime:
    name: str
    seconds: float
    detail: str


def matmul_params(role_or_shape, scalar_head: bool = False) -> float:
    """Parameters that do matmuls (the input embedding is a lookup): the 2N / 6N in the FLOP count."""
    shape = role_or_shape.shape if isinstance(role_or_shape, Role) else role_or_shape
    return M.total_params(shape, scalar_head) - shape.vocab_size * shape.hidden_size


def attention_flops_fwd(shape, seq: int) -> float:
    """QK^T and PV of one causal sequence, forward: 2 matmuls * 2 FLOP * (s^2 / 2) * q_width per layer."""
    return 2 * seq * seq * shape.q_width * shape.num_layers


def forward_flops(role: Role, seq: int, sequences: int) -> float:
    return sequences * (2 * matmul_params(role.shape, role.scalar_head) * seq + attention_flops_fwd(role.shape, seq))


def link_bytes_s(job: Job, group_span: int) -> float:
    """A group whose ranks span `group_span` consecutive ranks talks over NVLink inside a node, else over the NICs."""
    dev = job.device
    return (dev.nvlink_bytes_s if group_span <= job.gpus_per_node else dev.internode_bytes_s) * eff("link")


def model_parallel_comm_s(job: Job, role: Role, collectives_per_layer: int) -> float:
    """Megatron's TP collectives (with or without SP: 2 all-reduces = 4 all-gather/reduce-scatter per layer forward,
    the same again backward), each moving (t-1)/t of the micro-batch activation [s, b, h] per GPU, over this GPU's
    share of the batch and layers; plus the PP send/recv of the activation (and its gradient when training) at each
    stage boundary. Not overlapped (our DDP runs without overlap; megatron_workers/optimizer.py)."""
    d, shape, e = role.dims, role.shape, elem_bytes(job)
    seqs = job.sequences / (d.dp * d.cp)
    act = job.seq_len * shape.hidden_size * e  # one sequence's [s, h] activation
    tp_bytes = seqs * shape.num_layers / d.pp * collectives_per_layer * (d.tp - 1) / d.tp * act if d.tp > 1 else 0.0
    directions = 2 if collectives_per_layer > 4 else 1
    pp_bytes = directions * seqs * act / (d.tp if d.sp else 1) if d.pp > 1 else 0.0
    return tp_bytes / link_bytes_s(job, d.tp) + pp_bytes / link_bytes_s(job, d.tp * d.cp * d.dp + 1)


def _bubble(pp: int, micro_batches: int, vpp: int = 1) -> float:
    return 1.0 + (pp - 1) / (vpp * max(1, micro_batches))


def forward_pass(job: Job, role: Role, name: str) -> StageTime:
    d = role.dims
    gpus = job.world
    m = max(1, job.sequences // d.dp // max(1, role.fwd_micro_batch))
    flops = forward_flops(role, job.seq_len, job.sequences)
    comm = model_parallel_comm_s(job, role, 4)
    sec = (flops / (gpus * job.device.peak_flops * eff("forward_mfu")) + comm) * _bubble(d.pp, m)
    return StageTime(name, sec, f"{flops:.3g} FLOP on {gpus} GPUs at {eff('forward_mfu'):.0%} MFU, TP/PP comm "
                                f"{comm:.1f} s, bubble p={d.pp} m={m}")


def dp_link_bytes_s(job: Job, role: Role) -> float:
    """DP peers sit tp*cp ranks apart: inside a node while tp*cp*dp fits in it, across nodes otherwise."""
    d = role.dims
    return link_bytes_s(job, d.tp * d.cp * d.dp)


def update(job: Job, role: Role, name: str) -> StageTime:
    d, opts = role.dims, job.options
    seq, seqs = job.seq_len, job.sequences
    extra_fwd = {"none": 0.0, "selective": 0.0, "full": 1.0}[opts.recompute]
    dense = 2 * matmul_params(role.shape, role.scalar_head) * seq * seqs
    attn = attention_flops_fwd(role.shape, seq) * seqs
    attn_passes = 3 + extra_fwd + (1 if opts.recompute == "selective" else 0)
    flops = role.epochs * (dense * (3 + extra_fwd) + attn * attn_passes)
    m = train_micro_batches(job, role)
    mp_comm = role.epochs * model_parallel_comm_s(job, role, 8 + (4 if opts.recompute == "full" else 0))
    compute = (flops / (job.world * job.device.peak_flops * eff("train_mfu")) + mp_comm) * _bubble(d.pp, m, opts.vpp)
    steps = role.epochs * (job.prompts // role.mini_batch)
    n_rank = M.stage_params(role.shape, d.tp, d.pp, 0, role.scalar_head)
    dpc = d.dp * d.cp
    b = M.BYTES_PER_PARAM[job.dtype]
    sync_bytes = (dpc - 1) / dpc * n_rank * (b["grad"] + b["param"]) if dpc > 1 else 0.0  # reduce-scatter + gather
    comm = steps * sync_bytes / dp_link_bytes_s(job, role)
    return StageTime(name, compute + comm, f"{flops:.3g} FLOP at {eff('train_mfu'):.0%} MFU, TP/PP comm "
                                           f"{mp_comm:.1f} s, bubble p={d.pp} m={m} v={opts.vpp}; {steps} optimizer "
                                           f"steps, grad sync {comm:.2f} s")


def transition_link_bytes_s(job: Job) -> float:
    """Ranks that exchange layers are in different PP stages (stride t*cp*dp) or in one generation TP group."""
    d = job.roles["actor"].dims
    across = (d.pp > 1 and d.tp * d.cp * d.dp >= job.gpus_per_node) or job.t_g > job.gpus_per_node
    return (job.device.internode_bytes_s if across else job.device.nvlink_bytes_s) * eff("link")


def transition(job: Job) -> StageTime:
    d, shape = job.roles["actor"].dims, job.roles["actor"].shape
    model_bytes = M.total_params(shape) * elem_bytes(job)
    recv = optimal_recv_bytes(model_bytes, d.tp, d.pp, job.t_g)
    sec = recv / transition_link_bytes_s(job)
    return StageTime("transition", sec, f"{recv / 1e9:.2f} GB received per GPU at "
                                        f"{transition_link_bytes_s(job) / 1e9:.3g} GB/s")


def generation(job: Job) -> StageTime:
    shape, e, dev, t_g = job.roles["actor"].shape, elem_bytes(job), job.device, job.t_g
    replicas = job.world // t_g
    per_replica = math.ceil(job.sequences / replicas)
    kv_tok = M.kv_bytes_per_token(shape, t_g, e)
    fits_kv = int(job.kv_cache_bytes // (kv_tok * job.seq_len))
    if fits_kv < 1:
        raise ValueError(f"actor_rollout_ref.rollout.kv_cache_memory_bytes={job.kv_cache_bytes} holds no sequence of "
                         f"{job.seq_len} tokens ({kv_tok * job.seq_len / M.GiB:.2f} GiB each at t_g={t_g})")
    conc = min(per_replica, job.options.max_num_seqs, fits_kv)
    waves = math.ceil(per_replica / conc)
    n_mm = matmul_params(shape)
    weights = M.total_params(shape) * e / t_g
    prefill = conc * (2 * n_mm * job.prompt_len + attention_flops_fwd(shape, job.prompt_len)) / t_g
    prefill_s = prefill / (dev.peak_flops * eff("prefill_mfu"))
    ctx = job.prompt_len + job.response_len / 2  # mean context over the decode
    step_flops = conc * (2 * n_mm + 4 * ctx * shape.q_width * shape.num_layers) / t_g
    step_bytes = weights + conc * ctx * kv_tok
    step_s = max(step_flops / (dev.peak_flops * eff("prefill_mfu")), step_bytes / (dev.hbm_bytes_s * eff("decode_hbm")))
    if t_g > 1:  # vLLM's 2 all-reduces per layer (attention out, MLP out) of [tokens, h]: latency + bandwidth
        allreduce = 2 * (t_g - 1) / t_g * shape.hidden_size * e / link_bytes_s(job, t_g)
        step_s += 2 * shape.num_layers * (eff("tp_allreduce_latency_s") + conc * allreduce)
        prefill_s += 2 * shape.num_layers * conc * job.prompt_len * allreduce
    sec = waves * (prefill_s + job.response_len * step_s)
    bound = "memory" if step_bytes / dev.hbm_bytes_s > step_flops / dev.peak_flops else "compute"
    return StageTime("generate", sec, f"{replicas} replicas x {per_replica} seqs, {conc} concurrent "
                                      f"({waves} wave{'s' if waves > 1 else ''}), decode step {step_s * 1e3:.1f} ms "
                                      f"({bound}-bound)")


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
    out = [transition(job), generation(job)]
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
