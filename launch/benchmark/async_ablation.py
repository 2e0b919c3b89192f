"""`python -m launch.benchmark --ablation async`: colocated sync vs split pools, sync vs one step off policy.

The long-tailed workload of long_tail.py (PPO, 16 prompts x 4 samples, responses of a few to 128 tokens), four
worker processes in every row, each row its own `python -m hybridflow.trainer.main` process, W warm-up + S timed
steps, one run after the other:
  colocated sync        one pool of 4: actor/ref/critic (TP1, DP4) and a vLLM engine in each process
  split sync            actor/ref/critic on 2 processes, vLLM on 2 others; generate, then train, then send weights
  split one-step        the same pools; step k+1 generates while step k trains (async_training.one_step_off_policy)
  split sync, server    split sync with the rollout served request by request (rollout.mode=async), what the
                        fully-async rows build on: it separates the server's cost from the overlap's gain
  split fully-async     the producer thread (async_training.fully_async), staleness 1 and 2, with and without
                        partial rollouts
Per row, from the timed steps' metrics: tokens/s (all tokens of a step / its wall time), the rollout pool's and
the training pool's idle shares of the step, the mean staleness (step minus the version of the weights that
sampled it) and the reward of the last step. The last line is one JSON object with `rows` and `ratios`.

What bounds the gain here: the two pools share this machine's cores, so overlapping them cannot add compute; it
only fills what one pool leaves idle while the other works (waits, Python, the driver). On a GPU cluster each pool
has devices of its own, and the overlap hides the shorter of generation and training.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from launch.benchmark.long_tail import CONFIG, base_overrides, prepare_assets
from launch.benchmark.output import emit

REPO = Path(__file__).resolve().parents[2]
SPLIT = ["trainer.resource_pools.actor=[2]", "trainer.resource_pools.rollout=[2]",
         "trainer.role_pools.actor_rollout=actor", "trainer.role_pools.ref=actor", "trainer.role_pools.critic=actor",
         "trainer.role_pools.rollout=rollout"]
SERVER = [*SPLIT, "actor_rollout_ref.rollout.mode=async"]


def fully_async(staleness: int, partial: bool) -> list[str]:
    return [*SERVER, "async_training.mode=fully_async", f"async_training.staleness_threshold={staleness}",
            f"async_training.partial_rollout={str(partial).lower()}"]


ROWS = [("colocated sync", ["trainer.n_gpus_per_node=4"]),
        ("split sync", [*SPLIT]),
        ("split one-step", [*SPLIT, "async_training.mode=one_step_off_policy"]),
        ("split sync, server mode", SERVER),
        ("split fully-async, staleness 1", fully_async(1, False)),
        ("split fully-async, staleness 2", fully_async(2, False)),
        ("split fully-async, staleness 1, partial rollouts", fully_async(1, True)),
        ("split fully-async, staleness 2, partial rollouts", fully_async(2, True))]


def row_metrics(rows: list[dict], colocated: bool) -> dict:
    """The table's numbers from the timed steps' metric rows (pure)."""
    mean = lambda xs: sum(xs) / len(xs)
    step = mean([r["perf/time_per_step"] for r in rows])
    gen_wait = mean([r.get("timing_s/gen", 0.0) for r in rows])
    sync_wait = mean([max(0.0, r.get("timing_s/weight_sync", 0.0) - r.get("weight_sync/send_s", 0.0)) for r in rows])
    if colocated:  # one set of processes: generating is the trainer's idle time and the other way round
        rollout_busy, train_idle = gen_wait, gen_wait / step
    else:
        rollout_busy = mean([r.get("rollout/gen_s_per_replica", 0.0) + r.get("weight_sync/recv_s", 0.0) for r in rows])
        train_idle = (gen_wait + sync_wait) / step
    # fully_async: per token (its batch's step minus the version that sampled it); the others: per batch
    staleness = [r["rollout/staleness_mean"] if "rollout/staleness_mean" in r
                 else r["step"] - r["rollout/weight_version"]
                 for r in rows if "rollout/staleness_mean" in r or "rollout/weight_version" in r]
    interrupted = sum(r.get("weight_sync/interrupted_requests", 0.0) for r in rows)
    return {"tokens_per_s": mean([r["perf/total_num_tokens"] for r in rows]) / step, "step_s": step,
            "rollout_idle_frac": max(0.0, 1.0 - rollout_busy / step), "train_idle_frac": min(1.0, train_idle),
            "staleness_mean": mean(staleness) if staleness else 0.0, "final_reward": rows[-1]["critic/score/mean"],
            "interrupted_requests": interrupted,
            "dropped_trajectories": sum(r.get("rollout/interrupted_dropped", 0.0) for r in rows)}


def run(warmup: int, steps: int, out_dir: Path, timeout_s: float = 1800) -> dict:
    assets = prepare_assets()
    out_dir.mkdir(parents=True, exist_ok=True)
    base = [*base_overrides(assets), "trainer.n_gpus_per_node=4", "trainer.save_freq=-1", "trainer.test_freq=-1",
            "trainer.val_before_train=false", "data.val_files=[]", f"trainer.total_training_steps={warmup + steps}",
            "trainer.logger=[console,jsonl]"]
    rows = []
    for i, (name, overrides) in enumerate(ROWS):
        run_dir = out_dir / f"row{i}"
        cmd = [sys.executable, "-m", "hybridflow.trainer.main", "--config", str(REPO / CONFIG), *base, *overrides,
               f"trainer.default_local_dir={run_dir}"]
        print(f"async ablation row {i} ({name})", file=sys.stderr, flush=True)
        t = time.perf_counter()
        proc = subprocess.run(cmd, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=timeout_s,
                              capture_output=True, text=True)
        (out_dir / f"row{i}.log").write_text(proc.stdout + proc.stderr)
        if proc.returncode != 0:
            raise RuntimeError(f"async ablation row {name!r} failed (rc {proc.returncode}); log: {out_dir}/row{i}.log\n"
                               + proc.stderr[-3000:])
        metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        timed = [r for r in metrics if r.get("step", 0) > warmup and "perf/time_per_step" in r]
        rows.append({"name": name, "wall_s": time.perf_counter() - t,
                     **row_metrics(timed, colocated=name.startswith("colocated"))})
    by = {r["name"]: r for r in rows}
    best_async = max(r["tokens_per_s"] for n, r in by.items() if "one-step" in n or "fully-async" in n)
    ratios = {"one_step_vs_split_sync": by["split one-step"]["tokens_per_s"] / by["split sync"]["tokens_per_s"],
              "best_async_vs_colocated_sync": best_async / by["colocated sync"]["tokens_per_s"]}
    return {"benchmark": "launch.benchmark --ablation async", "config": CONFIG, "warmup": warmup, "steps": steps,
            "processes": 4, "rows": rows, "ratios": ratios}


def render(result: dict) -> str:
    lines = ["| row | tokens/s | step s | rollout idle | train idle | staleness | final reward "
             "| interrupted / resampled |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['name']} | {r['tokens_per_s']:.0f} | {r['step_s']:.2f} | {r['rollout_idle_frac']:.2f} | "
                     f"{r['train_idle_frac']:.2f} | {r['staleness_mean']:.2f} | {r['final_reward']:.3f} | "
                     f"{r.get('interrupted_requests', 0):.0f} / {r.get('dropped_trajectories', 0):.0f} |")
    q = result["ratios"]
    lines.append(f"\none-step vs split sync: {q['one_step_vs_split_sync']:.2f}x; best async vs colocated sync: "
                 f"{q['best_async_vs_colocated_sync']:.2f}x")
    return "\n".join(lines)


def main(warmup: int, steps: int, out: str | None) -> int:
    out_dir = Path(out).parent if out else Path("runs/benchmark") / f"async-{time.strftime('%Y%m%d-%H%M%S')}"
    result = run(warmup, steps, out_dir)
    return emit(render(result), result, out)
