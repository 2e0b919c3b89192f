"""The benchmark's numbers from the trainer's own step metrics (pure: lists of metric dicts in, dicts out).

Each stage is one `timing_s/<stage>` timer of RayPPOTrainer.step; `transition` is the 3D-HybridEngine's
resharding (timing_s/reshard), which runs inside `gen`, so `gen` here is the generation alone (gen - reshard)
and the stages do not count the transition twice. What the step spends outside every timer (the next batch,
the metric reductions) is `untimed`.

Per stage, over the timed steps: seconds (mean, min), share of the mean step, tokens/s per device and, for the
forward/backward stages, MFU. Tokens are the step's prompt + response tokens (the paper's convention, verl's
perf/total_num_tokens) for every stage, so the per-stage rates compare with each other and with the totals.
A stage's devices are those of the pool of the role that runs it; the driver's stages (reward, adv) count every
device of the job, which waits for them. MFU = 2 * params * tokens * passes / (seconds * devices * peak), the
trainer's transformer_flops: passes is 1 for a forward (old_log_prob, ref, values, rm) and 3 per PPO epoch for
an update (forward + backward).
"""

from __future__ import annotations

from statistics import mean

from hybridflow.trainer.metrics import transformer_flops

STAGES = ("gen", "transition", "rm", "reward", "old_log_prob", "ref", "values", "adv", "update_critic",
          "update_actor")
# stage -> (role whose pool runs it, or None for the driver; model whose params count; forward passes per epoch)
STAGE_ROLES = {"gen": ("actor_rollout", None, 0), "transition": ("actor_rollout", None, 0),
               "rm": ("reward_model", "reward_model", 1), "reward": (None, None, 0),
               "old_log_prob": ("actor_rollout", "actor", 1), "ref": ("ref", "actor", 1),
               "values": ("critic", "critic", 1), "adv": (None, None, 0),
               "update_critic": ("critic", "critic", 3), "update_actor": ("actor_rollout", "actor", 3)}


def stage_seconds(row: dict) -> dict[str, float]:
    """One step's seconds per stage (only the stages it ran)."""
    out = {}
    reshard = row.get("timing_s/reshard", 0.0)
    for stage in STAGES:
        if stage == "transition":
            if "timing_s/reshard" in row:
                out[stage] = reshard
        elif stage == "gen":
            if "timing_s/gen" in row:
                out[stage] = row["timing_s/gen"] - reshard
        elif f"timing_s/{stage}" in row:
            out[stage] = row[f"timing_s/{stage}"]
    return out


def summarize(rows: list[dict], devices: dict[str, int], params: dict[str, int], epochs: dict[str, int],
              n_devices: int, peak_flops: float) -> dict:
    """The stage table and the totals over the timed `rows` (RayPPOTrainer.step metrics).

    devices: processes of each role's pool ({"actor_rollout": 2, "critic": 1, ...}; a ref on the actor's pool has
    the actor's); params: {"actor" | "critic" | "reward_model": parameter count}; epochs: {"actor": ppo_epochs,
    "critic": ppo_epochs}; n_devices: all the job's devices (the trainer's perf/throughput divisor).
    """
    if not rows:
        raise ValueError("no timed steps to summarize")
    step = [r["perf/time_per_step"] for r in rows]
    tokens = mean(r["perf/total_num_tokens"] for r in rows)
    per_step = [stage_seconds(r) for r in rows]
    step_mean = mean(step)
    table = {}
    for stage in STAGES:
        secs = [s[stage] for s in per_step if stage in s]
        if not secs:
            continue
        role, model, passes = STAGE_ROLES[stage]
        n_dev = devices.get(role, n_devices) if role else n_devices
        m = mean(secs)
        entry = {"mean_s": m, "min_s": min(secs), "share": m / step_mean, "devices": n_dev,
                 "tokens_per_s_per_device": tokens / (m * n_dev) if m > 0 else None, "mfu": None}
        if model and params.get(model) and m > 0 and peak_flops:
            n_passes = passes * (epochs.get(model, 1) if passes == 3 else 1)
            entry["mfu"] = transformer_flops(params[model], int(tokens), n_passes) / (m * n_dev * peak_flops)
        table[stage] = entry
    covered = sum(e["mean_s"] for e in table.values())
    totals = {"step_mean_s": step_mean, "step_min_s": min(step), "tokens_per_step": tokens,
              "throughput_per_device": mean(r["perf/throughput"] for r in rows),  # verl's perf/throughput
              "aggregate_throughput": mean(r["perf/aggregate_throughput"] for r in rows),  # the paper's
              "untimed_s": step_mean - covered, "stages_share": covered / step_mean, "n_devices": n_devices}
    if all("perf/mfu/actor" in r for r in rows):
        totals["mfu_actor"] = mean(r["perf/mfu/actor"] for r in rows)
    return {"stages": table, "totals": totals}
