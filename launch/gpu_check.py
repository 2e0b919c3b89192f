"""The GPU check (launch/gpu_check.sh runs it): one JSON line with what only a GPU can tell.

    python launch/gpu_check.py             # CUDA + NCCL: a ~0.97B Llama (bf16); the reshard part on every local GPU
    python launch/gpu_check.py --dry-run   # CPU + gloo: the same code at a tiny size (what CI can run)

Three parts, each in its own torchrun job (so one failure does not hide the others, and every job has a timeout):
- actor: the PPO update of ActorRolloutRefWorker (role "actor", distributed optimizer) through
  launch/bench_actor.py's worker: update tokens/s and MFU against the peak it names
  (hybridflow.trainer.metrics.PEAK_FLOPS: H200 = 989 TFLOP/s dense bf16), and the peak device memory;
- actor_recompute: the same with full activation recompute (megatron.override_transformer_config), when this
  build's MegatronConfig has that key; otherwise reported as skipped;
- reshard: the 3D-HybridEngine against the naive all-gather (launch/bench_reshard.py's bench_layout) on NCCL,
  t = every local GPU, t_g = t/2 (one GPU: t = t_g = 1, where every generation shard aliases its training shard).
The layer spec is what megatron_workers.model_builder picks: Transformer Engine when it imports, the local spec
otherwise (reported as transformer_engine).

Beside each actor part the check prints the planner's prediction for the same config (`planned`,
`planned_recompute`: memory per component, the peak, the log-prob and update seconds) and `actor_vs_plan`,
`actor_recompute_vs_plan`: the relative errors against the targets (peak memory within 10%, step time within 25%).
Filed under docs/measured/, the line becomes kind-"measured" cases of `launch.plan --against-published`
(published.gpu_check_cases). Nothing here has run on a GPU yet: the first run tells.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
# ~0.97B parameters (16 layers x 61M; the tiny tokenizer's 103-token vocab adds almost nothing): Llama-3.2-1B's
# width and depth.
LLAMA_1B = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                intermediate_size=8192)
FULL_SIZE = dict(preset="medium", model=LLAMA_1B, dtype="bf16", batch=16, micro_batch=4, prompt_len=512,
                 response_len=512, reps=3)
DRY_RUN = dict(preset="tiny4l", model={}, dtype="fp32", batch=4, micro_batch=2, prompt_len=16, response_len=16,
               reps=1)
RECOMPUTE = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
TINY_RESHARD = {"vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128}


def has_recompute_keys() -> bool:
    """Whether MegatronConfig has verl's override_transformer_config (activation recompute)."""
    from hybridflow.config.schema import MegatronConfig

    return "override_transformer_config" in {f.name for f in dataclasses.fields(MegatronConfig)}


def environment() -> dict:
    import torch

    env = {"torch": torch.__version__, "cuda": torch.cuda.is_available(),
           "transformer_engine": importlib.util.find_spec("transformer_engine") is not None}
    for name in ("megatron-core", "transformers"):
        try:
            env[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            env[name] = None
    if torch.cuda.is_available():
        env["device"] = torch.cuda.get_device_name()
        env["gpus"] = torch.cuda.device_count()
        env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return env


def failure_cause(output: str, limit: int = 1500) -> str:
    """What a failed torchrun job says went wrong: the last traceback a rank printed (its frames and exception),
    not torchrun's own ChildFailedError report, which names no cause and comes last. The lent GPU gives one try
    in a session, so the JSON line has to carry the reason. Falls back to the output's tail."""
    lines = [re.sub(r"^\[rank\d+\]:\s?", "", ln) for ln in output.splitlines() if "arning" not in ln]
    starts = [i for i, ln in enumerate(lines) if ln.startswith("Traceback (most recent call last)")]
    for start in reversed(starts):
        block = lines[start:]
        end = next((j for j, ln in enumerate(block) if j and ln and not ln[0].isspace()), len(block) - 1)
        block = block[:end + 1]
        if "ChildFailedError" not in block[-1]:
            return "\n".join(block)[-limit:]
    return "\n".join(lines)[-limit:]


def torchrun(nproc: int, script: list[str], timeout: float, dry_run: bool) -> tuple[dict | list | None, str]:
    """One torchrun job whose rank 0 writes JSON to the path after --out; (that JSON or None, its failure_cause)."""
    from hybridflow.ports import free_port  # stdlib only: the GPU machine has no Ray or vLLM
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1",
           f"--master-port={free_port()}", *script, "--out", out]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    if dry_run:
        env["CUDA_VISIBLE_DEVICES"] = ""  # gloo on CPU even where a GPU is present
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)
        text = Path(out).read_text() if proc.returncode == 0 and Path(out).stat().st_size else ""
        return (json.loads(text) if text else None), failure_cause(proc.stdout + proc.stderr)
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout:.0f} s"
    finally:
        Path(out).unlink(missing_ok=True)


def reshard_worker(args) -> None:
    """One torchrun rank: bench_reshard.bench_layout on this job's backend; rank 0 writes the row."""
    import torch
    import torch.distributed as dist

    import launch.bench_reshard as bench_reshard

    if args.tiny:
        bench_reshard.HF_CONFIG = {**bench_reshard.HF_CONFIG, **TINY_RESHARD}
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    row = bench_reshard.bench_layout(rank, world, (world, 1, 1, max(1, world // 2)), False, 32 * 2**20)
    if rank == 0:
        Path(args.out).write_text(json.dumps(row))
    dist.barrier()
    dist.destroy_process_group()


# What the planner is judged by on this check (issue: "the planner predicts what clusters really do").
PLAN_TARGETS = {"memory": 0.10, "time": 0.25}


# The actor parts the check measures, each with the megatron keys bench_actor adds (--megatron-extra): the planner
# reads the same keys (override_transformer_config's recompute) so each part gets its own plan.
PARTS = {"actor": {}, "actor_recompute": {"override_transformer_config": RECOMPUTE}}


def planner_overrides(model_dir: str, size: dict, megatron_extra: dict | None = None) -> list[str]:
    """The HybridFlow config of bench_actor's run: one GPU, TP1 PP1, distributed optimizer, no offload, one PPO
    mini-batch of `batch` rows in micro-batches of `micro_batch`, no ref or critic (GRPO without KL), plus the
    part's megatron keys."""
    a = "actor_rollout_ref"
    extra = [f"{a}.actor.megatron.override_transformer_config.{k}={v}"
             for k, v in (megatron_extra or {}).get("override_transformer_config", {}).items()]
    dtype = {"bf16": "bfloat16", "fp32": "float32"}[size["dtype"]]
    return [f"{a}.model.path={model_dir}", f"{a}.model.dtype={dtype}", "trainer.nnodes=1", "trainer.n_gpus_per_node=1",
            f"data.train_batch_size={size['batch']}", f"data.max_prompt_length={size['prompt_len']}",
            f"data.max_response_length={size['response_len']}", f"{a}.rollout.response_length={size['response_len']}",
            f"{a}.actor.ppo_mini_batch_size={size['batch']}",
            f"{a}.actor.ppo_micro_batch_size_per_gpu={size['micro_batch']}",
            f"{a}.rollout.log_prob_micro_batch_size_per_gpu={size['micro_batch']}", f"{a}.rollout.n=1",
            f"{a}.rollout.kv_cache_memory_bytes={2**30}", "algorithm.adv_estimator=grpo",
            f"{a}.actor.use_kl_loss=false", "algorithm.use_kl_in_reward=false",
            f"{a}.actor.megatron.use_distributed_optimizer=true", *extra]


def planner_prediction(model_dir: str, size: dict, gpu: str = "h200", transformer_engine: bool = False,
                       megatron_extra: dict | None = None) -> dict:
    """launch.plan's numbers for the actor part of this check: memory per component on the GPU (params, grads,
    optimizer, the update's activations, the log-prob pass's working set) and the seconds of compute_log_prob and
    update_actor. torch.cuda.max_memory_allocated() sees what the caching allocator handed out, so the planned peak
    leaves out the planner's framework reserve (CUDA context, NCCL buffers, fragmentation)."""
    from hybridflow.config.load import load_config
    from launch.plan import Options, plan_config
    from launch.plan.step_time import forward_pass

    plan = plan_config(load_config(None, planner_overrides(model_dir, size, megatron_extra)),
                       Options(gpu=gpu, kernels="te" if transformer_engine else "local"))
    comp = plan.memory.roles["actor"]
    stages = {s.name: s.seconds for s in plan.stages}
    state = sum(comp[k] for k in ("params", "grads", "optimizer"))
    return {"gpu": plan.job.device.name, "memory_bytes": {k: int(v) for k, v in comp.items()},
            # the update holds its activations plus, under full recompute, one layer's recomputed working set
            # (launch/plan/fit.py's update stage); the log-prob pass its forward working set
            "peak_allocated_bytes": int(state + max(comp.get("activations", 0.0) + comp.get("recompute working", 0.0),
                                                    comp.get("forward working", 0.0))),
            "logprob_s": forward_pass(plan.job, plan.job.roles["actor"], "log_prob").seconds,
            "update_s": stages["update_actor"], "recompute": plan.job.options.recompute,
            "note": "planner: no offload, one optimizer step, full-length rows (the check's masks trim a little)"}


def planned_gpu(env: dict) -> str:
    """The planner's device for this run: the GPU that is here (H200 on the lent machine), the H200 on a dry run."""
    from launch.plan.devices import UnknownDeviceError, device_key

    try:
        return device_key(env["device"]) if env.get("cuda") else "h200"
    except UnknownDeviceError:
        return "h200"


def compare_with_plan(planned: dict, measured: dict) -> dict:
    """Relative errors (planned - measured) / measured, and whether each is inside PLAN_TARGETS."""
    out = {}
    pairs = {"memory": ("peak_allocated_bytes", "device_peak_bytes"), "update": ("update_s", "update_s"),
             "logprob": ("logprob_s", "logprob_s")}
    for name, (p_key, m_key) in pairs.items():
        p, m = planned.get(p_key), measured.get(m_key)
        if p is None or not m:
            continue
        err = (p - m) / m
        target = PLAN_TARGETS["memory" if name == "memory" else "time"]
        out[name] = {"planned": p, "measured": m, "rel_error": round(err, 4), "target": target,
                     "within": abs(err) <= target}
    return out


def check(dry_run: bool, timeout: float) -> dict:
    """Every part; a part that fails reports its error (failure_cause) instead of numbers."""
    import torch

    from hybridflow.models.tiny import save_tiny_model

    size = DRY_RUN if dry_run else FULL_SIZE
    gpus = 0 if dry_run else torch.cuda.device_count()
    result = {"check": "launch/gpu_check", "dry_run": dry_run, "env": environment(), "size": size,
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        model = save_tiny_model(Path(tmp) / "model", preset=size["preset"], **size["model"])
        bench = [str(REPO / "launch" / "bench_actor.py"), "--worker", "--name", "llama-1b" if not dry_run else "tiny",
                 "--model", str(model), "--tp", "1", "--pp", "1", "--dtype", size["dtype"],
                 "--batch", str(size["batch"]), "--micro-batch", str(size["micro_batch"]),
                 "--prompt-len", str(size["prompt_len"]), "--response-len", str(size["response_len"]),
                 "--reps", str(size["reps"])]
        for name, extra in PARTS.items():
            if extra and not has_recompute_keys():
                result[name] = {"skipped": "this build's MegatronConfig has no override_transformer_config"}
                continue
            row, cause = torchrun(1, [*bench, "--megatron-extra", json.dumps(extra)], timeout, dry_run)
            result[name] = row if row is not None else {"error": cause}
            planned = "planned" + name.removeprefix("actor")  # planned, planned_recompute
            try:
                result[planned] = planner_prediction(str(model), size, planned_gpu(result["env"]),
                                                     result["env"]["transformer_engine"], extra)
                if dry_run:  # the plan is for the H200; a CPU run is not comparable, only the plumbing is
                    result[planned]["note"] += "; dry run: planned for an H200, measured on CPU"
                else:
                    result[f"{name}_vs_plan"] = compare_with_plan(result[planned], row or {})
            except Exception as e:  # the planner must never hide the measurement
                result[planned] = {"error": f"{type(e).__name__}: {e}"}
    reshard = [str(Path(__file__).resolve()), "--reshard-worker"] + (["--tiny"] if dry_run else [])
    row, cause = torchrun(max(gpus, 2 if dry_run else 1), reshard, timeout, dry_run)
    result["reshard"] = row if row is not None else {"error": cause}
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    result["ok"] = all("error" not in result[k] for k in ("actor", "actor_recompute", "reshard"))
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU + gloo at a tiny size (no GPU needed)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per part")
    ap.add_argument("--reshard-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.reshard_worker:
        reshard_worker(args)
        return 0
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; use --dry-run for the CPU/gloo path", file=sys.stderr)
        return 2
    result = check(args.dry_run, args.timeout)
    print(json.dumps(result), flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
