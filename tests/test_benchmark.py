"""launch.benchmark's pure parts on hand-built step metrics: the stage table, the totals, --compare, the pins.
(The real run, its JSON and --compare on it: tests/test_e2e_placement.py.)"""

from __future__ import annotations

import json

import pytest

from launch.benchmark.report import compare, load_result, render
from launch.benchmark.run import bench_overrides
from launch.benchmark.stages import summarize


def _row(gen, reshard, values, update_actor, step, tokens=1000.0, devices=4):
    return {"timing_s/gen": gen, "timing_s/reshard": reshard, "timing_s/reward": 0.5, "timing_s/values": values,
            "timing_s/update_actor": update_actor, "perf/time_per_step": step, "perf/total_num_tokens": tokens,
            "perf/throughput": tokens / (step * devices), "perf/aggregate_throughput": tokens / step}


def test_stage_table_by_hand():
    rows = [_row(4.0, 1.0, 1.0, 3.0, 9.0), _row(6.0, 2.0, 2.0, 5.0, 14.0)]
    out = summarize(rows, {"actor_rollout": 2, "critic": 1}, {"actor": 1_000_000, "critic": 500_000},
                    {"actor": 2, "critic": 1}, n_devices=4, peak_flops=1e12)
    s, t = out["stages"], out["totals"]
    assert list(s) == ["gen", "transition", "reward", "values", "update_actor"]  # table order, ran stages only
    assert (s["gen"]["mean_s"], s["gen"]["min_s"]) == (3.5, 3.0)  # generation without the transition inside it
    assert (s["transition"]["mean_s"], s["transition"]["min_s"]) == (1.5, 1.0)
    assert s["update_actor"]["share"] == pytest.approx(4.0 / 11.5)
    assert s["values"]["tokens_per_s_per_device"] == pytest.approx(1000 / 1.5)  # the critic's 1-process pool
    assert s["reward"]["devices"] == 4  # the driver's stage: every device waits
    # 2 * 1e6 params * 1000 tokens * 3 passes * 2 epochs / (4 s * 2 devices * 1e12)
    assert s["update_actor"]["mfu"] == pytest.approx(12e9 / 8e12)
    assert s["values"]["mfu"] == pytest.approx(1e9 / 1.5e12) and s["reward"]["mfu"] is None
    assert t["step_mean_s"] == 11.5 and t["step_min_s"] == 9.0
    assert t["untimed_s"] == pytest.approx(11.5 - (3.5 + 1.5 + 0.5 + 1.5 + 4.0))
    assert t["throughput_per_device"] == pytest.approx((1000 / 36 + 1000 / 56) / 2)
    with pytest.raises(ValueError, match="no timed steps"):
        summarize([], {}, {}, {}, 1, 1.0)


def _result(step_s: float, published=None) -> dict:
    out = summarize([_row(4.0, 1.0, 1.0, 3.0, step_s)], {"actor_rollout": 2}, {"actor": 10}, {}, 2, 1e12)
    return {"benchmark": "launch.benchmark", "config": "c.yaml", "overrides": [], "warmup": 1, "steps": 1, **out,
            "peak_memory": {"actor_rollout_ref": {"rss_peak_bytes": 2**30}},
            "layout": {"source": "trainer.placement=colocate", "pools": {"colocated": [2]}, "rollout_tp": 1,
                       "roles": {"actor_rollout": {"pool": "colocated", "tp": 2, "pp": 1, "cp": 1, "dp": 1}},
                       "n_devices": 2},
            "peak_flops": {"per_device": 1e12, "source": "test"}, "published": published, "device": "CPU",
            "git": {"commit": "0123456789abcdef", "dirty": False}}


def test_compare_side_by_side_with_a_published_figure(tmp_path):
    from launch.plan.published import PUBLISHED, RECIPE_PUBLISHED

    value, source = PUBLISHED[RECIPE_PUBLISHED["qwen2_7b_ppo_1node.yaml"]]
    a, b = _result(10.0), _result(20.0, {"throughput_per_device": value, "source": source})
    (tmp_path / "a.json").write_text(json.dumps(a))
    (tmp_path / "b.log").write_text(f"table\n{json.dumps(b)}\n")
    text = compare({"a": load_result(tmp_path / "a.json"), "b": load_result(tmp_path / "b.log")})
    lines = text.splitlines()
    assert lines[0].split() == ["a", "b", "b", "published"]
    assert next(x for x in lines if x.startswith("step s (mean)")).split()[-2:] == ["10.000", "20.000"]
    assert next(x for x in lines if x.startswith("tokens/s/device")).split()[-1] == "1,109"
    assert lines[-1] == f"b published: {source}"
    assert "published: 1,109 tokens/s per device" in render(b) and "untimed" in render(a)
    (tmp_path / "bad.log").write_text("no result here\n{\"x\": 1}\n")
    with pytest.raises(ValueError, match="bad.log: no launch.benchmark result line"):
        load_result(tmp_path / "bad.log")


def test_the_benchmark_pins_what_would_distort_a_timing():
    out = bench_overrides(["trainer.default_local_dir=/tmp/x"], 2, 3)
    assert "trainer.total_training_steps=5" in out and "trainer.save_freq=-1" in out
    assert sum(o.startswith("trainer.default_local_dir=") for o in out) == 1
    assert any(o.startswith("trainer.default_local_dir=runs/benchmark/") for o in bench_overrides([], 0, 1))
    with pytest.raises(ValueError, match="--steps 0"):
        bench_overrides([], 1, 0)


def test_gpu_check_script_parses_and_refuses_a_cpu_only_machine():
    """launch/gpu_check.sh needs a GPU (or --dry-run, ~2 min here; run by hand): its shell is valid, its Python
    part imports, and without CUDA it says so instead of measuring a CPU as a GPU."""
    import subprocess
    import sys
    from pathlib import Path

    import torch

    from launch import gpu_check

    repo = Path(__file__).resolve().parents[1]
    for script in ("gpu_check.sh", "gpu_check_wheels.sh"):
        assert subprocess.run(["bash", "-n", str(repo / "launch" / script)], timeout=30).returncode == 0
    assert isinstance(gpu_check.has_recompute_keys(), bool)
    if not torch.cuda.is_available():
        proc = subprocess.run([sys.executable, str(repo / "launch" / "gpu_check.py")], capture_output=True, text=True,
                              timeout=120, cwd=repo)
        assert proc.returncode == 2 and "no CUDA device here; use --dry-run" in proc.stderr


def test_gpu_check_reports_the_ranks_traceback_not_torchruns_summary():
    """A failed part's JSON names its cause: the rank's last traceback, whatever torchrun prints after it."""
    from launch.gpu_check import failure_cause

    rank = ["Traceback (most recent call last):", '  File "x.py", line 1, in <module>', "    import omegaconf",
            "ModuleNotFoundError: No module named 'omegaconf'"]
    torchrun = ["Traceback (most recent call last):", '  File "run.py", line 9, in main', "    raise ChildFailedError(",
                "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ", "=====", "Root Cause: rank 0"]
    out = "\n".join(["starting", "[rank0]: " + rank[0], *rank[1:], "UserWarning: noise", *torchrun])
    assert failure_cause(out) == "\n".join(rank)
    assert failure_cause("no traceback at all\nexit 1") == "no traceback at all\nexit 1"
    assert failure_cause("x" * 5000, limit=100) == "x" * 100


def test_perf_means_average_the_padding_and_imbalance_metrics_over_the_steps_that_report_them():
    from launch.benchmark.run import perf_means

    rows = [{"perf/padding_fraction/ref": 0.5, "perf/dp_token_imbalance": 1.2, "perf/throughput": 9.0},
            {"perf/padding_fraction/ref": 0.25}]
    assert perf_means(rows) == {"perf/padding_fraction/ref": 0.375, "perf/dp_token_imbalance": 1.2}


def test_long_tail_lengths_and_their_summary():
    from launch.benchmark.long_tail import MAX_LEN, MIN_LEN, length_summary, long_tail_lengths, percentile

    lengths = long_tail_lengths(4000, seed=3)
    assert lengths == long_tail_lengths(4000, seed=3) and MIN_LEN <= min(lengths) and max(lengths) == MAX_LEN
    s = length_summary(lengths)
    # Pareto(1) from 8: P(L >= x) = 8 / x, so the median is ~16, the 90th percentile ~80, ~6% at the cap of 128
    assert 14 <= s["p50"] <= 18 and 65 <= s["p90"] <= 95 and 0.04 < s["at_cap"] / s["n"] < 0.08
    # nearest rank, by hand
    assert [percentile([1, 2, 3, 4], q) for q in (0, 25, 50, 90, 100)] == [1, 1, 2, 4, 4]
    assert length_summary([9, 3, 128]) == {"n": 3, "min": 3, "p50": 9.0, "p90": 128.0, "max": 128, "mean": 140 / 3,
                                           "at_cap": 1}
    with pytest.raises(ValueError, match="no response lengths"):
        length_summary([])


def test_ablation_rows_differ_by_one_switch_each_and_keep_the_workload():
    from launch.benchmark.long_tail import DYNAMIC, ablation_rows, base_overrides, render_markdown
    from launch.benchmark.run import bench_overrides

    rows = {r["name"]: r for r in ablation_rows(balance_available=True)}
    assert rows["fixed, no trim"]["env"] == {"HYBRIDFLOW_NO_TRIM": "1"} and not rows["fixed (baseline)"]["env"]
    assert rows["fixed (baseline)"]["overrides"] == ["trainer.balance_batch=false"]
    assert rows["+ balance_batch"]["overrides"] == ["trainer.balance_batch=true"]
    assert rows["+ dynamic bsz"]["overrides"] == ["trainer.balance_batch=false", *DYNAMIC]
    assert rows["+ both"]["overrides"] == ["trainer.balance_batch=true", *DYNAMIC]
    assert not any(r["pending"] for r in rows.values())
    without = ablation_rows(balance_available=False)
    assert [r["name"] for r in without if r["pending"]] == ["+ balance_batch", "+ both"]
    assert not any("balance_batch" in o for r in without for o in r["overrides"])
    table = render_markdown([{**without[2]}, {"name": "x", "summary": {
        "tokens_per_s_per_device": 1234.5, "step_mean_s": 2.0, "padding_fraction": {"ref": 0.5},
        "dp_token_imbalance": None}}]).splitlines()
    assert table[2].startswith("| + balance_batch | pending |")
    assert table[3] == "| x | 1,234 | 2.00 | - | - | - | - | 0.500 | - | - | - | - |"
    # the workload loads: DP2, TP1, 128-token responses, a token budget the config check accepts
    from hybridflow.config import checks
    from hybridflow.config.load import load_config

    assets = {"train": "runs/long_tail_assets/data/train.parquet", "model": "runs/long_tail_assets/sft_model"}
    cfg = load_config("configs/ppo_tiny_cpu.yaml", bench_overrides([*base_overrides(assets), *DYNAMIC], 1, 1))
    assert cfg.actor_rollout_ref.rollout.response_length == 128 and cfg.trainer.n_gpus_per_node == 2
    assert cfg.actor_rollout_ref.actor.megatron.tensor_model_parallel_size == 1
    assert cfg.actor_rollout_ref.actor.use_dynamic_bsz and cfg.critic.use_dynamic_bsz
    checks.token_budgets(cfg)  # raises on a budget below prompt + response


# ---- launch/bench_vs_trl.py: what bounds the ratio ----------------------------------------------------------------
def test_bench_vs_trl_arithmetic_and_ceiling_by_hand(monkeypatch):
    from launch import bench_vs_trl as B

    # 4 forward-equivalents x 2 FLOPs x 1e6 matmul params x 1000 tokens = 8 GFLOP in 2 s; 2 x 1e6 x 500 in 1 s
    assert B.arithmetic(10**6, 1000, 500, train_s=2.0, gen_s=1.0) == {
        "train_gflop": 8.0, "train_gflops_per_s": 4.0, "gen_gflops_per_s": 1.0}
    rates = {"fp32": 10.0, "bf16": 25.0}  # GFLOP/s per thread, by the dtype the bound asks the GEMM in
    monkeypatch.setattr(B, "matmul_gflops", lambda tokens, hidden, ffn, threads, dtype="fp32": rates[dtype] * threads)
    params = 10**6 + 100 * 64  # the input embedding (vocab 100 x hidden 64) is not a matmul
    tokens = B.PROMPTS_PER_STEP * B.GROUP * 150
    row = {"params": params,
           "hybridflow": {"tokens_per_step": tokens, "s_per_step": 30.0, "gen_s": 5.0,
                          "timing_s_median": {"ref": 4.0, "update_actor": 20.0}},
           "trl": {"tokens_per_step": tokens, "s_per_step": 33.0, "gen_s": 9.0}}
    out = B.bound(row, {"hidden": 64, "ffn": 128, "vocab": 100})
    train_gflop = 8 * 10**6 * tokens / 1e9
    assert out["matmul_params"] == 10**6 and out["gemm_gflops_2_threads"] == 20.0
    assert out["hybridflow"]["train_gflops_per_s"] == round(train_gflop / 24.0, 1)
    assert out["trl"]["train_gflops_per_s"] == round(train_gflop / 24.0, 1)
    # ours with its 24 s of training replaced by train_gflop at 20 GFLOP/s; gen and the rest (6 s) as measured
    assert out["ratio_if_our_training_ran_at_gemm_rate"] == round(33.0 / (6.0 + round(train_gflop, 1) / 20.0), 3)
    # generation against the decode-shaped GEMM of 2 one-thread replicas; training against the 2-thread GEMM
    assert out["decode_gemm_gflops"] == 20.0
    assert out["hybridflow"]["gen_frac_of_decode_gemm"] == round(out["hybridflow"]["gen_gflops_per_s"] / 20.0, 3)
    assert out["hybridflow"]["train_frac_of_gemm"] == round(out["hybridflow"]["train_gflops_per_s"] / 20.0, 3)
    # a bf16 row is bounded by the bf16 GEMM rate
    bf16 = B.bound(row, {"hidden": 64, "ffn": 128, "vocab": 100}, "bf16")
    assert bf16["gemm_dtype"] == "bf16" and bf16["gemm_gflops_2_threads"] == 50.0
    assert bf16["ratio_if_our_training_ran_at_gemm_rate"] == round(33.0 / (6.0 + round(train_gflop, 1) / 50.0), 3)


def test_async_ablation_row_metrics_by_hand():
    """launch.benchmark --ablation async: tokens/s, idle shares and staleness from metric rows (numbers by hand)."""
    from launch.benchmark.async_ablation import row_metrics

    rows = [{"step": 3, "perf/time_per_step": 2.0, "perf/total_num_tokens": 1000, "timing_s/gen": 0.5,
             "timing_s/weight_sync": 0.4, "weight_sync/send_s": 0.1, "rollout/gen_s_per_replica": 1.2,
             "weight_sync/recv_s": 0.1, "rollout/weight_version": 2, "critic/score/mean": 0.25},
            {"step": 4, "perf/time_per_step": 2.0, "perf/total_num_tokens": 1400, "timing_s/gen": 0.3,
             "timing_s/weight_sync": 0.2, "weight_sync/send_s": 0.2, "rollout/gen_s_per_replica": 1.0,
             "weight_sync/recv_s": 0.1, "rollout/weight_version": 3, "critic/score/mean": 0.5}]
    split = row_metrics(rows, colocated=False)
    assert split["tokens_per_s"] == pytest.approx(1200 / 2.0)
    # rollout busy: mean(1.2 + 0.1, 1.0 + 0.1) = 1.2 of 2.0 s; trainer waits: gen 0.4 + sync beyond sending 0.15
    assert split["rollout_idle_frac"] == pytest.approx(1 - 1.2 / 2.0)
    assert split["train_idle_frac"] == pytest.approx((0.4 + 0.15) / 2.0)
    assert split["staleness_mean"] == 1.0 and split["final_reward"] == 0.5
    colocated = row_metrics(rows, colocated=True)
    assert colocated["rollout_idle_frac"] == pytest.approx(1 - 0.4 / 2.0)
    assert colocated["train_idle_frac"] == pytest.approx(0.4 / 2.0)
    # fully_async: the per-token staleness the producer reports wins over step - version; interruptions are summed
    for r, stale, cut, again in zip(rows, (0.5, 1.5), (3.0, 1.0), (2.0, 0.0), strict=True):
        r.update({"rollout/staleness_mean": stale, "weight_sync/interrupted_requests": cut,
                  "rollout/interrupted_dropped": again})
    fa = row_metrics(rows, colocated=False)
    assert fa["staleness_mean"] == 1.0 and fa["interrupted_requests"] == 4.0 and fa["dropped_trajectories"] == 2.0


def test_an_ablation_ends_with_its_json_line_also_written_to_out(tmp_path, capsys):
    import json

    from launch.benchmark.output import emit

    assert emit("| table |", {"b": 2, "a": 1}, str(tmp_path / "sub" / "r.json")) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed == ["| table |", '{"a": 1, "b": 2}']
    assert json.loads((tmp_path / "sub" / "r.json").read_text()) == {"a": 1, "b": 2}
