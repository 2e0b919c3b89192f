"""Per-GPU memory of every role, and the peak over the stages of one RL step: does the job fit?

The step runs its stages one after another (hybridflow/trainer/ppo_trainer.py). In a stage the active role holds
everything it owns (Offloader.resident() reloads it), idle roles hold what they do not offload
(MegatronConfig.param_offload / grad_offload / optimizer_offload), and vLLM holds weights and KV cache only while it
generates (it is released after generation). Colocated, all roles share the same GPUs; on separate pools (split,
standalone), each pool has its own.
The worst pipeline stage is taken for each role (stage 0 holds the most micro-batches in flight, the last stage the
logits, the first the embedding).
"""

from __future__ import annotations

from dataclasses import dataclass

from launch.plan import memory as M
from launch.plan.job import Job, Role


@dataclass(frozen=True)
class Phase:
    name: str
    pool: str
    items: tuple[tuple[str, str, float], ...]  # (role, component, bytes)

    @property
    def total(self) -> float:
        return sum(b for _, _, b in self.items)


@dataclass(frozen=True)
class MemoryPlan:
    roles: dict[str, dict[str, float]]  # role -> component -> bytes (its worst stage)
    role_notes: dict[str, str]
    phases: tuple[Phase, ...]
    capacity: float

    @property
    def peak(self) -> Phase:
        return max(self.phases, key=lambda p: p.total)

    @property
    def fits(self) -> bool:
        return self.peak.total <= self.capacity


def elem_bytes(job: Job) -> int:
    return M.BYTES_PER_PARAM[job.dtype]["param"]


def train_micro_batches(job: Job, role: Role) -> int:
    """Micro-batches per DP rank per optimizer step (what fills the pipeline)."""
    seqs = role.mini_batch * job.n // role.dims.dp
    return max(1, seqs // max(1, role.micro_batch))


def model_state(job: Job, role: Role, stage: int) -> dict[str, float]:
    """params / grads / optimizer bytes on one rank of pipeline stage `stage`: the routed experts (E/ep per rank,
    each over etp) with their optimizer state sharded over the expert data-parallel group, everything else over
    dp*cp, as Megatron's distributed optimizer keeps them."""
    d, shape = role.dims, role.shape
    n = M.stage_params(shape, d.tp, d.pp, stage, role.scalar_head, d.ep, d.expert_tp)
    experts = M.stage_expert_params(shape, d.pp, d.ep, d.expert_tp)
    dense = M.state_bytes(n - experts, job.dtype, role.trainable, role.dist_opt, d.dp * d.cp)
    moe = M.state_bytes(experts, job.dtype, role.trainable, role.dist_opt, d.expert_dp) if experts else {}
    out = {k: dense[k] + moe.get(k, 0.0) for k in dense}
    out["optimizer"] *= role.optimizer_on_gpu  # Megatron's optimizer CPU offload keeps the rest in host memory
    return out


def role_memory(job: Job, role: Role) -> tuple[dict[str, float], str]:
    """Components of one role on its worst pipeline stage, plus a note naming that stage."""
    d, shape, e, opts = role.dims, role.shape, elem_bytes(job), job.options
    seq = job.seq_len
    best: tuple[float, dict, int] | None = None
    for stage in range(d.pp):
        comp = model_state(job, role, stage)
        last = stage == d.pp - 1
        fwd_layer = sum(M.layer_activations(shape, d.tp, d.sp, seq, role.fwd_micro_batch, e, opts.kernels,
                                            "none", d.expert_tp).values())
        fwd = fwd_layer + (sum(M.head_activations(shape, d.tp, d.sp, seq, role.fwd_micro_batch, e, opts.kernels,
                                                  role.scalar_head).values()) if last else 0.0)
        comp["forward working"] = fwd
        if role.trainable:
            m = train_micro_batches(job, role)
            per_layer = sum(M.layer_activations(shape, d.tp, d.sp, seq, role.micro_batch, e, opts.kernels,
                                                opts.recompute, d.expert_tp).values())
            held = M.chunks_in_flight(d.pp, stage, m, opts.vpp)
            act = per_layer * shape.num_layers / d.pp * held
            if last:
                act += sum(M.head_activations(shape, d.tp, d.sp, seq, role.micro_batch, e, opts.kernels,
                                              role.scalar_head).values())
            comp["activations"] = act
            if opts.recompute == "full":  # backward recomputes one layer at a time: its full activations
                comp["recompute working"] = sum(M.layer_activations(shape, d.tp, d.sp, seq, role.micro_batch, e,
                                                                    opts.kernels, "none", d.expert_tp).values())
        total = sum(comp.values()) - comp["forward working"]
        if best is None or total > best[0]:
            best = (total, comp, stage)
    _, comp, stage = best
    return comp, f"stage {stage} of {d.pp}" if d.pp > 1 else "one stage"


def rollout_memory(job: Job) -> dict[str, float]:
    shape, e = job.roles["actor"].shape, elem_bytes(job)
    return {
        "vLLM weights": M.total_params(shape) * e / job.t_g,  # the paper's generation shard M/(t_g*p_g)
        "KV cache": float(job.kv_cache_bytes),  # rollout.kv_cache_memory_bytes, preallocated by vLLM
        "vLLM runtime": float(M.OVERHEADS["vllm_runtime"][0]),
        "reshard buffers": M.reshard_peak_bytes(shape, job.t_g, e, job.bucket_bytes),
    }


STATE = ("params", "grads", "optimizer")


def _idle(role: Role, comp: dict) -> list[tuple[str, str, float]]:
    return [(role.name, f"{k} (idle)", comp[k]) for k in STATE if comp.get(k) and not role.offload[k]]


def plan_memory(job: Job) -> MemoryPlan:
    roles, notes = {}, {}
    for name, role in job.roles.items():
        roles[name], notes[name] = role_memory(job, role)
    rollout = rollout_memory(job)
    roles["rollout"], notes["rollout"] = rollout, f"t_g={job.t_g}"
    reserve = ("gpu", "framework reserve", float(M.OVERHEADS["framework_reserve"][0]))
    actor_pool = job.roles["actor"].pool

    # (phase, active role, what the active role holds beyond its idle state)
    # On the async layout the rollout pool holds vLLM alone; it receives the weights bucket by bucket into the live
    # engine (KV cache kept), and the actor's pool holds no vLLM at all.
    first = ("weight_sync", "rollout", []) if job.rollout_pool else ("transition", "actor", ["params"])
    stages: list[tuple[str, str, list[str]]] = [first, ("generate", "rollout", [])]
    if job.old_log_prob_pass:
        stages.append(("old_log_prob", "actor", [*STATE, "forward working"]))
    if "ref" in job.roles:
        stages.append(("ref", "ref", ["params", "forward working"]))
    if "critic" in job.roles:
        stages.append(("values", "critic", [*STATE, "forward working"]))
    if "reward_model" in job.roles:
        stages.append(("rm", "reward_model", ["params", "forward working"]))
    if "critic" in job.roles:
        stages.append(("update_critic", "critic", [*STATE, "activations", "recompute working"]))
    stages.append(("update_actor", "actor", [*STATE, "activations", "recompute working"]))

    phases = []
    for phase, active, parts in stages:
        pool = (job.rollout_pool or actor_pool) if active == "rollout" else job.roles[active].pool
        items: list[tuple[str, str, float]] = [reserve]
        for name, role in job.roles.items():
            if role.pool != pool:
                continue
            if name == active:
                items += [(name, k, roles[name][k]) for k in parts if roles[name].get(k)]
                items += [x for x in _idle(role, roles[name]) if x[1].split(" ")[0] not in parts]
            else:
                items += _idle(role, roles[name])
        if phase == "transition":
            items += [("rollout", "vLLM weights", rollout["vLLM weights"]),
                      ("rollout", "reshard buffers", rollout["reshard buffers"])]
        if phase == "weight_sync":
            items += [("rollout", k, rollout[k]) for k in ("vLLM weights", "KV cache", "vLLM runtime")]
            items.append(("rollout", "receive bucket", min(float(job.bucket_bytes), rollout["vLLM weights"])))
        if phase == "generate":
            items += [("rollout", k, rollout[k]) for k in ("vLLM weights", "KV cache", "vLLM runtime")]
        phases.append(Phase(phase, pool, tuple(items)))
    return MemoryPlan(roles, notes, tuple(phases), float(job.device.memory_bytes))


def suggestions(job: Job, plan: MemoryPlan, phase: Phase) -> list[str]:
    """Knobs that would shrink the overflowing phase, each with what it saves there (largest first)."""
    out: list[tuple[float, str]] = []
    for role, comp, nbytes in phase.items:
        if comp.endswith("(idle)"):
            part = comp.split(" ")[0]
            r = job.roles[role]
            out.append((nbytes, f"{r.offload_keys[part]}=true (frees {nbytes / M.GiB:.1f} GiB)"))
        elif comp == "activations":
            r = job.roles[role]
            if job.options.recompute != "full":
                out.append((nbytes * 0.8, f"--recompute full (the planner's flag; Megatron's recompute_granularity, "
                                          f"not in the config schema yet) or a smaller {r.key}.ppo_micro_batch_size_"
                                          f"per_gpu (activations {nbytes / M.GiB:.1f} GiB)"))
            else:
                out.append((nbytes * 0.5, f"a smaller {r.key}.ppo_micro_batch_size_per_gpu or more pipeline stages "
                                          f"(activations {nbytes / M.GiB:.1f} GiB)"))
        elif comp == "KV cache":
            out.append((nbytes * 0.5, f"a smaller actor_rollout_ref.rollout.kv_cache_memory_bytes ({nbytes / M.GiB:.1f}"
                                      f" GiB; fewer concurrent sequences) or a larger rollout tensor_model_parallel_"
                                      f"size"))
        elif comp == "optimizer" and not job.roles[role].dist_opt:
            out.append((nbytes, f"{job.roles[role].key}.megatron.use_distributed_optimizer=true"))
    out.sort(key=lambda x: -x[0])
    seen, lines = set(), []
    for _, line in out:
        if line not in seen:
            seen.add(line)
            lines.append(line)
    return lines[:4]
