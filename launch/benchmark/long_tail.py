"""The long-tailed workload and `python -m launch.benchmark --ablation long_tail`.

Real RL batches have long-tailed response lengths; the tiny demo task answers in <= 8 tokens, so padding and
DP imbalance never show on it. This workload makes the lengths long-tailed for real, in the model's own
samples: the tiny model is warm-started (hybridflow.trainer.warmstart.supervised_warmstart) on digit strings
whose lengths follow a Pareto(1) law from 8 tokens, capped at 128 (median ~16, ~6% at the cap). The prompt
does not say the length, so the model learns a per-position stop hazard and the rollout's (vLLM, temperature
1, response_length 128) lengths vary from a few tokens to the cap. The benchmark reports what was sampled
(min / p50 / p90 / max over the timed steps' rollouts, from trainer.rollout_data_dir), not the target law.
The reward (the reverse task's rule) scores ~0 here and does not matter: this measures throughput.

The ablation runs each row as its own `python -m launch.benchmark` process (same config, same seed, DP2 TP1):
the row's overrides, and for the "no trim" row the benchmark-only env var HYBRIDFLOW_NO_TRIM=1 (engine.py:
micro-batches keep the whole batch's trimmed width instead of their own longest row).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

from launch.benchmark.output import emit

REPO = Path(__file__).resolve().parents[2]
CONFIG = "configs/ppo_tiny_cpu.yaml"
ASSETS = "runs/long_tail_assets"
MIN_LEN, MAX_LEN = 8, 128
PROMPT_LEN = 24  # data.max_prompt_length: the reverse task's prompt of a 3-5 digit string fits
TOKEN_BUDGET = 1024  # per GPU, every dynamic-bsz key; >= PROMPT_LEN + MAX_LEN, as the config check demands
FIXED_MICRO = 8  # rows per micro-batch per GPU in the fixed rows
SFT_STEPS = 150
PAD_STAGES = ("old_log_prob", "ref", "values", "update_actor", "update_critic")  # the passes the switches change


def long_tail_lengths(n: int, seed: int, lo: int = MIN_LEN, hi: int = MAX_LEN) -> list[int]:
    """n target lengths: lo * Pareto(alpha=1), i.e. P(L >= x) = lo / x, capped at hi."""
    rng = random.Random(seed)
    return [min(hi, int(lo * rng.paretovariate(1.0))) for _ in range(n)]


def make_long_tail_rows(n: int, seed: int) -> list[dict]:
    """The reverse task's rows (verl parquet layout), each answer replaced by digits of a long-tailed length."""
    from hybridflow.data.synthetic import make_reverse_rows

    rng = random.Random(seed + 1)
    rows = make_reverse_rows(n, seed, min_len=3, max_len=5, alphabet="0123456789")
    for row, k in zip(rows, long_tail_lengths(n, seed), strict=True):
        row["reward_model"]["ground_truth"] = "".join(rng.choice("0123456789") for _ in range(k))
    return rows


def prepare_assets(out: str | Path = ASSETS, seed: int = 0, n: int = 2048, sft_steps: int = SFT_STEPS) -> dict:
    """Create (or reuse, keyed by the arguments) data/train.parquet, base_model/ and sft_model/ under `out`."""
    from hybridflow.data.synthetic import write_parquet
    from hybridflow.models.tiny import save_tiny_model
    from hybridflow.trainer.warmstart import supervised_warmstart

    out = Path(out)
    key = {"seed": seed, "n": n, "sft_steps": sft_steps, "lo": MIN_LEN, "hi": MAX_LEN, "version": 1}
    manifest = out / "manifest.json"
    if manifest.is_file() and json.loads(manifest.read_text()).get("key") == key:
        return json.loads(manifest.read_text())
    rows = make_long_tail_rows(n, seed)
    write_parquet(rows, out / "data" / "train.parquet")
    base = save_tiny_model(out / "base_model", preset="tiny", seed=seed)
    info = supervised_warmstart(base, rows, out / "sft_model", steps=sft_steps, seed=seed)
    result = {"key": key, "sft_steps": sft_steps, "sft_final_loss": info["sft_final_loss"], "sft_s": info["sft_s"],
              "model": str(out / "sft_model"), "train": str(out / "data" / "train.parquet")}
    manifest.write_text(json.dumps(result, indent=1))
    return result


def base_overrides(assets: dict) -> list[str]:
    """The workload on configs/ppo_tiny_cpu.yaml: DP2 TP1 everywhere, 16 prompts x 4 samples, up to 128 tokens."""
    tp1 = [f"{role}.megatron.tensor_model_parallel_size=1"
           for role in ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic")]
    return [*tp1, f"data.train_files=[{assets['train']}]", f"actor_rollout_ref.model.path={assets['model']}",
            f"critic.model.path={assets['model']}", f"data.max_prompt_length={PROMPT_LEN}",
            f"data.max_response_length={MAX_LEN}", f"actor_rollout_ref.rollout.response_length={MAX_LEN}",
            "data.train_batch_size=16", "actor_rollout_ref.actor.ppo_mini_batch_size=16",
            "critic.ppo_mini_batch_size=16", "trainer.n_gpus_per_node=2",
            *(f"{k}={FIXED_MICRO}" for k in ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
                                             "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
                                             "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
                                             "critic.ppo_micro_batch_size_per_gpu"))]


DYNAMIC = ["actor_rollout_ref.actor.use_dynamic_bsz=true",
           f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={TOKEN_BUDGET}",
           "actor_rollout_ref.ref.log_prob_use_dynamic_bsz=true",
           f"actor_rollout_ref.ref.log_prob_max_token_len_per_gpu={TOKEN_BUDGET}",
           "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true",
           f"actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu={TOKEN_BUDGET}",
           "critic.use_dynamic_bsz=true", f"critic.ppo_max_token_len_per_gpu={TOKEN_BUDGET}",
           f"critic.forward_max_token_len_per_gpu={TOKEN_BUDGET}"]


def has_balance_batch() -> bool:
    """Whether this checkout's schema has trainer.balance_batch (the DP length balancing of issue 15)."""
    import dataclasses

    from hybridflow.config.schema import TrainerConfig

    return any(f.name == "balance_batch" for f in dataclasses.fields(TrainerConfig))


def ablation_rows(balance_available: bool) -> list[dict]:
    """The before/after rows: {name, overrides, env, pending}; a pending row is listed, not run."""
    bal = lambda on: [f"trainer.balance_batch={'true' if on else 'false'}"] if balance_available else []
    rows = [("fixed, no trim", bal(False), {"HYBRIDFLOW_NO_TRIM": "1"}, False),
            ("fixed (baseline)", bal(False), {}, False),
            ("+ balance_batch", bal(True), {}, not balance_available),
            ("+ dynamic bsz", [*bal(False), *DYNAMIC], {}, False),
            ("+ both", [*bal(True), *DYNAMIC], {}, not balance_available)]
    return [{"name": n, "overrides": o, "env": e, "pending": p} for n, o, e, p in rows]


def percentile(sorted_values: list[int], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]) of an ascending list."""
    if not sorted_values:
        raise ValueError("no values")
    k = max(0, min(len(sorted_values) - 1, -(-len(sorted_values) * q // 100) - 1))
    return float(sorted_values[int(k)])


def length_summary(lengths: list[int]) -> dict:
    """min / p50 / p90 / max / mean of response lengths (tokens), and how many hit the cap."""
    s = sorted(int(x) for x in lengths)
    if not s:
        raise ValueError("no response lengths to summarize")
    return {"n": len(s), "min": s[0], "p50": percentile(s, 50), "p90": percentile(s, 90), "max": s[-1],
            "mean": sum(s) / len(s), "at_cap": sum(x >= MAX_LEN for x in s)}


def rollout_lengths(rollout_dir: str | Path, first_step: int) -> list[int]:
    """Response lengths (tokens) of the dumped training samples of steps >= first_step."""
    out = []
    for path in sorted(Path(rollout_dir).glob("step_*.jsonl")):
        if int(path.stem.removeprefix("step_")) >= first_step:
            out += [len(json.loads(line)["response_ids"]) for line in path.read_text().splitlines() if line]
    return out


def row_summary(result: dict, lengths: list[int]) -> dict:
    """One table row from a benchmark result: the throughput, step time and the perf/ metrics it averaged."""
    perf, stages = result.get("perf", {}), result["stages"]
    return {"tokens_per_s_per_device": result["totals"]["throughput_per_device"],
            "step_mean_s": result["totals"]["step_mean_s"],
            # what the switches act on (the forward and update passes), apart from the generation they leave alone
            "fwd_bwd_s": sum(stages[s]["mean_s"] for s in PAD_STAGES if s in stages),
            "gen_s": stages["gen"]["mean_s"] if "gen" in stages else None,
            "actor_micro_batches": perf.get("actor/num_micro_batches"),
            "padding_fraction": {k.removeprefix("perf/padding_fraction/"): v for k, v in perf.items()
                                 if k.startswith("perf/padding_fraction/")},
            "dp_token_imbalance": perf.get("perf/dp_token_imbalance"),
            "dp_token_imbalance_before": perf.get("perf/dp_token_imbalance_before"),
            "response_length": length_summary(lengths) if lengths else None}



def imbalance_cell(summary: dict) -> str:
    """The step's DP token imbalance; with balancing on, what it was before too ("1.000 (1.352 before)")."""
    after, before = summary.get("dp_token_imbalance"), summary.get("dp_token_imbalance_before")
    if after is None:
        return "-"
    return f"{after:.3f}" + (f" ({before:.3f} before)" if before is not None else "")


def render_markdown(rows: list[dict]) -> str:
    """The docs/benchmarks.md table (long-tailed batches): a row per ablation row (pending rows say so)."""
    def f(x, fmt):
        return "-" if x is None else format(x, fmt)

    head = ["row", "tokens/s/device", "step s", "gen s", "fwd+bwd s", "actor micro-batches",
            *(f"pad {s}" for s in PAD_STAGES), "dp imbalance"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if r.get("pending") or "summary" not in r:
            cells = [r["name"], *["pending"] * (len(head) - 1)]
        else:
            s = r["summary"]
            cells = [r["name"], f(s["tokens_per_s_per_device"], ",.0f"), f(s["step_mean_s"], ".2f"),
                     f(s.get("gen_s"), ".2f"), f(s.get("fwd_bwd_s"), ".2f"), f(s.get("actor_micro_batches"), ".1f"),
                     *(f(s["padding_fraction"].get(st), ".3f") for st in PAD_STAGES), imbalance_cell(s)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run_ablation(warmup: int, steps: int, out_dir: str | Path, timeout_s: float = 900) -> dict:
    """Every non-pending row as a `python -m launch.benchmark` process; the rows, the table and the lengths."""
    assets = prepare_assets()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = ablation_rows(has_balance_batch())
    for i, row in enumerate(rows):
        if row["pending"]:
            continue
        run_dir = out_dir / f"row{i}"
        overrides = [*base_overrides(assets), *row["overrides"], f"trainer.default_local_dir={run_dir}",
                     f"trainer.rollout_data_dir={run_dir}/rollouts"]
        cmd = [sys.executable, "-m", "launch.benchmark", CONFIG, *overrides, "--warmup", str(warmup),
               "--steps", str(steps), "--out", str(run_dir / "result.json")]
        env = {**os.environ, "PYTHONPATH": str(REPO), **row["env"]}
        print(f"ablation row {i} ({row['name']}): {' '.join(cmd[2:])}", file=sys.stderr, flush=True)
        proc = subprocess.run(cmd, cwd=REPO, env=env, timeout=timeout_s, capture_output=True, text=True)
        (run_dir / "log.txt").write_text(proc.stdout + proc.stderr)
        if proc.returncode != 0:
            raise RuntimeError(f"ablation row {row['name']!r} failed (rc {proc.returncode}); log: {run_dir}/log.txt\n"
                               + proc.stderr[-3000:])
        result = json.loads((run_dir / "result.json").read_text())
        row["summary"] = row_summary(result, rollout_lengths(run_dir / "rollouts", warmup + 1))
    return {"benchmark": "launch.benchmark --ablation long_tail", "config": CONFIG,
            "base_overrides": base_overrides(assets), "warmup": warmup, "steps": steps,
            "token_budget": TOKEN_BUDGET, "fixed_micro_batch": FIXED_MICRO, "assets": assets, "rows": rows}


def render(result: dict) -> str:
    out = [render_markdown(result["rows"]), ""]
    for r in result["rows"]:
        rl = (r.get("summary") or {}).get("response_length")
        if rl:
            out.append(f"{r['name']}: response length min {rl['min']} p50 {rl['p50']:.0f} p90 {rl['p90']:.0f} "
                       f"max {rl['max']} (mean {rl['mean']:.1f}, {rl['at_cap']}/{rl['n']} at {MAX_LEN})")
    return "\n".join(out)


def main(warmup: int, steps: int, out: str | None) -> int:
    import time

    out_dir = Path(out).parent if out else Path("runs/benchmark") / f"long_tail-{time.strftime('%Y%m%d-%H%M%S')}"
    result = run_ablation(warmup, steps, out_dir)
    return emit(render(result), result, out)

