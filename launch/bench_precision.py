"""The demo job in fp32 and in bf16, one after the other in one run: wall time and what each learned.

    python launch/bench_precision.py                                   # the PPO demo (configs/ppo_tiny_cpu.yaml)
    python launch/bench_precision.py --config configs/grpo_tiny_cpu.yaml
    python launch/bench_precision.py --dtypes bfloat16 --steps 20      # one dtype, a shorter run

Each run is `python -m hybridflow.trainer.main --config CONFIG` with every role's model.dtype set (actor, ref and
rollout follow actor_rollout_ref.model.dtype; the critic has its own key), on the demo's warm-started assets
(created first if missing, as `make demo` does). Prints one JSON object per dtype, then one with the
bf16/fp32 ratios when both ran: wall_s (the whole command, start-up included), the median step time after the
first two steps, the last step's training score and the held-out mean@n at the first and last validation.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def ensure_assets(out: Path) -> None:
    if not (out / "sft_model" / "config.json").is_file():
        subprocess.run([sys.executable, "-m", "hybridflow.trainer.warmstart", "--out", str(out)], cwd=REPO,
                       check=True, timeout=900)


def run(config: str, dtype: str, steps: int | None, run_dir: Path, timeout_s: int) -> dict:
    import shutil

    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [sys.executable, "-m", "hybridflow.trainer.main", "--config", config,
           f"actor_rollout_ref.model.dtype={dtype}", f"critic.model.dtype={dtype}",
           f"trainer.default_local_dir={run_dir}", f"trainer.experiment_name={run_dir.name}", "trainer.save_freq=-1",
           "trainer.resume_mode=disable", *([f"trainer.total_training_steps={steps}"] if steps else [])]
    run_dir.mkdir(parents=True)
    t = time.perf_counter()
    with open(run_dir.parent / f"{run_dir.name}.log", "w") as log:
        proc = subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s)
    wall = time.perf_counter() - t
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}; see {run_dir.parent / run_dir.name}.log")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [r for r in rows if "perf/time_per_step" in r]
    val = [r for r in rows if any(k.startswith("val-core/") and "/mean@" in k for k in r)]
    val_key = next((k for r in val for k in r if k.startswith("val-core/") and "/mean@" in k), None)
    return {"dtype": dtype, "config": config, "wall_s": round(wall, 1), "steps": len(train),
            "median_step_s": round(statistics.median(r["perf/time_per_step"] for r in train[2:] or train), 3),
            "final_score": round(train[-1]["critic/score/mean"], 4),
            "val_key": val_key,
            "val_first": round(val[0][val_key], 4) if val else None,
            "val_last": round(val[-1][val_key], 4) if val else None}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/ppo_tiny_cpu.yaml")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="comma list, run in this order")
    ap.add_argument("--steps", type=int, default=None, help="trainer.total_training_steps (default: the config's)")
    ap.add_argument("--assets", default="runs/demo_assets", help="the warm-start output the demo configs read")
    ap.add_argument("--out", default="runs/bench_precision")
    ap.add_argument("--timeout-s", type=int, default=1800)
    args = ap.parse_args(argv)
    ensure_assets(REPO / args.assets)
    results = {}
    for dtype in [d for d in args.dtypes.split(",") if d]:
        results[dtype] = run(args.config, dtype, args.steps, REPO / args.out / f"{Path(args.config).stem}_{dtype}",
                             args.timeout_s)
        print(json.dumps(results[dtype]), flush=True)
    if {"float32", "bfloat16"} <= set(results):
        f, b = results["float32"], results["bfloat16"]
        print(json.dumps({"config": args.config, "bf16_vs_fp32_wall": round(b["wall_s"] / f["wall_s"], 3),
                          "bf16_vs_fp32_step": round(b["median_step_s"] / f["median_step_s"], 3)}), flush=True)


if __name__ == "__main__":
    main()
