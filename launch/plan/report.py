"""Text tables for a Plan: memory per role and per stage, step time per stage, the assumptions behind them."""

from __future__ import annotations

from launch.plan import Plan
from launch.plan import memory as M
from launch.plan.fit import STATE, suggestions
from launch.plan.step_time import EFFICIENCY

GiB = M.GiB


def gib(x: float) -> str:
    return f"{x / GiB:.1f}"


def table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    def line(r):
        return "  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(r, widths)))

    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def layout_lines(plan: Plan) -> list[str]:
    j = plan.job
    if j.rollout_pool:
        pools = ", ".join(f"{p} {list(j.pool_procs[p])}" for p in j.pools)
        cluster = (f"cluster: {j.device.name}, async layout: pools {pools} (GPUs per node), {j.total_gpus} GPUs; "
                   f"rollout on '{j.rollout_pool}', async_training.mode={j.async_mode}, weight sync every "
                   f"{j.sync_every} step{'s' if j.sync_every > 1 else ''}")
    else:
        cluster = (f"cluster: {j.nnodes} nodes x {j.gpus_per_node} {j.device.name} = {j.world} GPUs per pool, "
                   f"placement={j.placement} ({len(j.pools)} pool{'s' if len(j.pools) > 1 else ''}, "
                   f"{j.total_gpus} GPUs)")
    out = [cluster,
           f"batch: {j.prompts} prompts x n={j.n}, {j.prompt_len} prompt + {j.response_len} response tokens, "
           f"dtype {j.dtype}, kernels {j.options.kernels}, recompute {j.options.recompute}, vpp {j.options.vpp}",
           f"lengths: responses {j.lengths.source} (mean {j.lengths.sample_mean():.0f} after the budget), prompt mean "
           f"{j.prompt_mean:.0f}, micro-batches {j.options.packing}"]
    for name, r in j.roles.items():
        d = r.dims
        moe = (f" ep={d.ep} etp={d.expert_tp} edp={d.expert_dp} ({r.shape.num_experts} experts, top-{r.shape.moe_topk}"
               f"; {M.total_params(r.shape) / 1e9:.1f}B total, {M.active_params(r.shape) / 1e9:.1f}B active)"
               if r.shape.is_moe else "")
        out.append(f"  {name:<12} {r.shape.name} ({r.shape.source}): tp={d.tp} pp={d.pp} dp={d.dp} cp={d.cp} "
                   f"sp={d.sp}{moe} dist_opt={r.dist_opt}")
    out.append(f"  {'rollout':<12} vLLM t_g={j.t_g}, {j.rollout_world // j.t_g} replicas, KV budget "
               f"{gib(j.kv_cache_bytes)} GiB")
    return out


def memory_table(plan: Plan) -> str:
    comps = [*STATE, "activations", "recompute working", "forward working"]
    rows = []
    for name, c in plan.memory.roles.items():
        if name == "rollout":
            continue
        rows.append([name, *(gib(c[k]) if k in c else "-" for k in comps), plan.memory.role_notes[name]])
    roles = table(["role (GiB/GPU)", *comps, "worst stage"], rows)
    ro = plan.memory.roles["rollout"]
    rollout = table(["rollout (GiB/GPU)", *ro], [["vllm", *(gib(v) for v in ro.values())]])
    phase_rows = []
    for p in plan.memory.phases:
        top = sorted(p.items, key=lambda x: -x[2])[:3]
        phase_rows.append([p.name, p.pool, gib(p.total), ", ".join(f"{r} {c} {gib(b)}" for r, c, b in top)])
    phases = table(["stage", "pool", "GiB/GPU", "largest items"], phase_rows)
    peak = plan.memory.peak
    verdict = "fits" if plan.memory.fits else "DOES NOT FIT"
    return "\n\n".join([roles, rollout, phases,
                        f"peak: {gib(peak.total)} GiB/GPU in stage {peak.name} of {gib(plan.memory.capacity)} GiB "
                        f"({plan.job.device.name}): {verdict}"])


def time_table(plan: Plan) -> str:
    rows = [[s.name, f"{s.seconds:.1f}", s.detail] for s in plan.stages]
    how = f"{plan.tokens:.0f} tokens, {plan.tokens_per_gpu_s:.0f} tokens/GPU/s"
    if plan.job.rollout_pool:
        gen, train, sync = plan.async_parts
        rollout_idle, train_idle = plan.idle_fractions
        formula = "gen + train + sync" if plan.job.async_mode == "sync" else "max(gen, train) + sync"
        how = (f"{plan.job.async_mode}: {formula} = gen {gen:.1f} (rollout pool), train {train:.1f} (actor pool), "
               f"sync {sync:.1f}; idle: rollout pool {rollout_idle:.0%}, actor pool {train_idle:.0%}; {how}")
    rows.append(["step", f"{plan.step_s:.1f}", how])
    return table(["stage", "seconds", "how"], rows)


def assumptions(plan: Plan) -> str:
    dev = plan.job.device
    lines = [f"device {dev.name}: {gib(dev.memory_bytes)} GiB, {dev.peak_flops / 1e12:.0f} TFLOP/s bf16, "
             f"HBM {dev.hbm_bytes_s / 1e12:.2f} TB/s, NVLink {dev.nvlink_bytes_s / 1e9:.0f} GB/s, "
             f"inter-node {dev.internode_bytes_s / 1e9:.3g} GB/s per GPU"]
    lines += [f"  {k}: {v}" for k, v in dev.sources]
    lines += [f"efficiency {k} = {v.value:g}: {v.source}" for k, v in EFFICIENCY.items()]
    lines += [f"overhead {k} = {gib(v[0])} GiB: {v[1]}" for k, v in M.OVERHEADS.items()]
    lines.append(f"activations: {M.KERNEL_PROFILES[plan.job.options.kernels].source}")
    return "\n".join(lines)


def fit_message(plan: Plan) -> str:
    """Empty when it fits; otherwise the stage, the largest component (role and name) and the overflow, and knobs."""
    if plan.memory.fits:
        return ""
    peak, cap = plan.memory.peak, plan.memory.capacity
    role, comp, nbytes = max(peak.items, key=lambda x: x[2])
    over = peak.total - cap
    hints = suggestions(plan.job, plan.memory, peak)
    return (f"does not fit: stage {peak.name} needs {gib(peak.total)} GiB per GPU on {plan.job.device.name} "
            f"({gib(cap)} GiB), over by {gib(over)} GiB; the largest part is {role} {comp} ({gib(nbytes)} GiB)"
            + ("\n  try: " + "\n  try: ".join(hints) if hints else ""))


def header_lines(plan: Plan, command: str) -> list[str]:
    """What a recipe's header says (tests/test_planner.py checks these numbers against the planner)."""
    peak = plan.memory.peak
    return [f"# plan: {command}",
            f"# expected memory per GPU: {peak.total / GiB:.1f} GiB (peak in stage {peak.name}, of "
            f"{plan.memory.capacity / GiB:.1f} GiB on {plan.job.device.name})",
            f"# expected step time: {plan.step_s:.0f} s ({plan.tokens_per_gpu_s:.0f} tokens/GPU/s)"]


def render(plan: Plan) -> str:
    return "\n\n".join(["\n".join(layout_lines(plan)), memory_table(plan), time_table(plan), assumptions(plan)])
