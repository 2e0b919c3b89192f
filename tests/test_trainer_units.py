"""Pure trainer pieces: config loading, metrics, checkpoints, tracking backends, curves."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hybridflow.config.load import ConfigError, load_config
from hybridflow.protocol import DataProto
from hybridflow.trainer import metrics as M
from hybridflow.trainer.checkpoint import CheckpointManager
from hybridflow.trainer.tracking import Tracking, read_jsonl

REPO_ROOT = Path(__file__).resolve().parents[1]


def test_config_file_and_overrides(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("actor_rollout_ref:\n  actor:\n    optim:\n      lr: 0.5\ntrainer:\n  experiment_name: abc\n")
    cfg = load_config(f, ["actor_rollout_ref.actor.optim.lr=1e-5", "algorithm.adv_estimator=grpo"])
    assert cfg.actor_rollout_ref.actor.optim.lr == 1e-5
    assert cfg.algorithm.adv_estimator == "grpo"
    assert cfg.trainer.default_local_dir == "runs/abc"  # interpolation resolved


def test_one_loads_overrides_never_reach_the_next_load():
    """load_config shares one built copy of the schema's defaults between calls (hybridflow/config/load.py,
    _defaults): an override, or a write to a loaded config, must not leak into later loads."""
    from hybridflow.config.schema import HybridFlowConfig

    fresh = load_config()
    assert fresh.data.train_batch_size == HybridFlowConfig().data.train_batch_size
    changed = load_config(None, ["data.train_batch_size=3", "trainer.experiment_name=xyz"])
    changed.actor_rollout_ref.actor.optim.lr = 123.0
    assert changed.data.train_batch_size == 3 and changed.trainer.default_local_dir == "runs/xyz"
    again = load_config()
    assert again == fresh and again.actor_rollout_ref.actor.optim.lr != 123.0
    assert again.trainer.default_local_dir == f"runs/{fresh.trainer.experiment_name}"


def test_config_unknown_key_names_nearest(tmp_path):
    with pytest.raises(ConfigError, match="did you mean 'actor_rollout_ref.rollout.temperature'"):
        load_config(None, ["actor_rollout_ref.rollout.temprature=0.5"])
    f = tmp_path / "bad.yaml"
    f.write_text("data:\n  train_batch_sise: 3\n")
    with pytest.raises(ConfigError, match=r"'data.train_batch_sise' in .*bad.yaml; did you mean 'data.train_batch_siz"):
        load_config(f)
    with pytest.raises(ConfigError, match="lr"):
        load_config(None, ["actor_rollout_ref.actor.optim.lr=fast"])


def test_to_dict_gives_what_omegaconf_gives():
    """to_dict's dataclass shortcut against OmegaConf's own conversion, on a config with a file, overrides and
    interpolated defaults, and on one section."""
    from omegaconf import OmegaConf

    from hybridflow.config.load import to_dict

    cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / "ppo_tiny_cpu.yaml",
                      ["trainer.experiment_name=xyz", "algorithm.adv_estimator=grpo", "data.train_files=[a,b]"])
    for part in (cfg, cfg.actor_rollout_ref):
        assert to_dict(part) == OmegaConf.to_container(OmegaConf.structured(part), resolve=True)
    assert to_dict(cfg)["trainer"]["experiment_name"] == "xyz" and to_dict(cfg)["data"]["train_files"] == ["a", "b"]
    plain = load_config(None, ["trainer.experiment_name=xyz"])  # the yaml above sets the dir; the default follows
    assert to_dict(plain)["trainer"]["default_local_dir"] == "runs/xyz"


def _finished_batch():
    # 2 samples, prompt width 3, response width 4; sample 0 has 2 response tokens, sample 1 all 4.
    response_mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    prompt_mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    b = {
        "response_mask": response_mask,
        "attention_mask": torch.cat([prompt_mask, response_mask], 1),
        "token_level_scores": torch.tensor([[0, 1.0, 0, 0], [0, 0, 0, 0.5]]),
        "token_level_rewards": torch.tensor([[0, 0.9, 0, 0], [0, 0, 0, 0.4]]),
        "advantages": torch.tensor([[1.0, 3.0, 9, 9], [-1.0, -1.0, -1.0, -1.0]]),
        "returns": torch.tensor([[2.0, 2.0, 9, 9], [0.0, 0.0, 0.0, 0.0]]),
        "values": torch.tensor([[1.0, 1.0, 9, 9], [0.0, 0.0, 0.0, 0.0]]),
        "old_log_probs": torch.tensor([[-1.0, -2.0, 0, 0], [-1.0, -1.0, -1.0, -1.0]]),
        "rollout_log_probs": torch.tensor([[-1.5, -2.0, 0, 0], [-1.0, -1.0, -1.0, -0.5]]),
    }
    return DataProto.from_dict(b)


def test_data_metrics_by_hand():
    m = M.data_metrics(_finished_batch(), use_critic=True)
    assert m["critic/score/mean"] == pytest.approx(0.75) and m["critic/score/max"] == 1.0
    assert m["critic/rewards/mean"] == pytest.approx(0.65)
    # advantages over the 6 valid tokens: 1, 3, -1, -1, -1, -1 (the 9s are padding)
    assert m["critic/advantages/mean"] == pytest.approx(0.0) and m["critic/advantages/max"] == 3.0
    assert m["response_length/mean"] == 3.0 and m["response_length/max"] == 4.0
    assert m["response_length/clip_ratio"] == 0.5
    assert m["prompt_length/mean"] == 2.5
    # |rollout - old| over valid tokens: 0.5, 0, 0, 0, 0, 0.5
    assert m["rollout/logprob_diff_mean"] == pytest.approx(1 / 6) and m["rollout/logprob_diff_max"] == 0.5
    assert "critic/values/mean" in m


def test_throughput_and_timing_by_hand():
    t = M.timing_metrics({"gen": 2.0, "update_actor": 1.0}, n_prompt=30, n_response=10)
    assert t["timing_per_token_ms/gen"] == pytest.approx(200.0)  # 2 s over 10 response tokens
    assert t["timing_per_token_ms/update_actor"] == pytest.approx(25.0)  # 1 s over 40 tokens
    p = M.throughput_metrics(30, 10, step_time=4.0, n_devices=2, actor_flops=80.0, peak_flops_per_device=10.0)
    assert p["perf/throughput"] == 5.0 and p["perf/aggregate_throughput"] == 10.0
    assert p["perf/mfu/actor"] == pytest.approx(1.0)
    assert M.reduce_worker_metrics([{"a": 1.0}, {"a": 3.0, "b": 2.0}]) == {"a": 2.0, "b": 2.0}


def test_checkpoints_atomic_keep_last_and_latest(tmp_path):
    mgr = CheckpointManager(tmp_path, keep=2)
    for step in (1, 2, 3):
        d = mgr.staging_dir(step)
        (d / "actor").mkdir()
        mgr.commit(step, d, {"global_step": step})
    # a crashed write: staging dir without marker, and a final-named dir without marker
    mgr.staging_dir(4)
    (tmp_path / "global_step_5").mkdir()
    assert [s for s, _ in mgr.complete()] == [2, 3]
    step, path = mgr.latest()
    assert step == 3 and CheckpointManager.trainer_state(path) == {"global_step": 3}


def test_tracking_backends_all_at_once(tmp_path):
    tr = Tracking(["console", "jsonl", "tensorboard", "wandb", "mlflow"], tmp_path, "proj", "exp",
                  config={"a": {"b": 1}}, total_steps=2)
    tr.log({"critic/score/mean": 0.5, "perf/throughput": 10.0, "bad": float("nan")}, step=1)
    tr.log({"critic/score/mean": 0.7}, step=2)
    tr.finish()
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert rows == [{"step": 1, "critic/score/mean": 0.5, "perf/throughput": 10.0},
                    {"step": 2, "critic/score/mean": 0.7}]
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert list((tmp_path / "wandb").glob("offline-run-*"))
    import mlflow

    runs = mlflow.search_runs(experiment_names=["proj"], output_format="list")
    assert runs and runs[0].data.metrics["critic/score/mean"] == 0.7
    with pytest.raises(ValueError, match="unknown backend"):
        Tracking(["stdout"], tmp_path, "p", "e")


def test_metrics_jsonl_on_resume_and_on_a_fresh_run_in_an_old_directory(tmp_path):
    def run(start, steps):
        tr = Tracking(["jsonl"], tmp_path, "p", "e", start_step=start)
        for s in steps:
            tr.log({"x": float(s)}, step=s)
        tr.finish()
        return [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")]

    assert run(0, [1, 2, 3]) == [1, 2, 3]  # killed after step 3, its last checkpoint was step 2
    assert run(2, [3, 4]) == [1, 2, 3, 4]  # resumed at 2: step 3 is redone, and listed once
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl.0.old")] == [1, 2, 3]
    assert run(0, [1]) == [1]  # a fresh run (resume disabled) in the same directory starts a new file
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl.1.old")] == [1, 2, 3, 4]
    assert run(1, [2]) == [1, 2]  # nothing to drop: no copy is made
    assert not (tmp_path / "metrics.jsonl.2.old").exists()


def test_curves_png(tmp_path):
    from hybridflow.trainer.plots import plot_curves

    rows = [{"step": i, "critic/score/mean": i / 10, "perf/throughput": 100.0 + i} for i in range(1, 6)]
    out = plot_curves(rows, tmp_path / "c.png", title="t")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000
    json.dumps(rows)


def test_saved_run_config_reloads_to_the_same_config(tmp_path):
    from hybridflow.config.load import save_resolved, to_dict

    cfg = load_config(str(REPO_ROOT / "configs" / "ppo_tiny_cpu.yaml"),
                      ["actor_rollout_ref.actor.optim.lr=3e-5", "trainer.default_local_dir=/x/y"])
    path = save_resolved(cfg, tmp_path / "run" / "config.yaml")
    again = load_config(str(path), [])
    assert to_dict(again) == to_dict(cfg)
    assert again.actor_rollout_ref.actor.optim.lr == 3e-5 and again.trainer.default_local_dir == "/x/y"


def test_cpu_peak_is_the_actor_gemm_measured_in_its_dtype(monkeypatch):
    """perf/mfu's CPU peak: the actor's fc1 GEMM (micro-batch tokens x hidden -> 2 ffn / tp), timed here. The
    FLOP count is checked by hand, and the rate's arithmetic (the best of the timed products, not the mean) on a
    scripted clock: a wall-clock comparison against a plain loop failed in CI when another xdist worker ran."""
    import itertools
    import types

    from hybridflow.trainer import peak_flops
    from hybridflow.trainer.peak_flops import actor_gemm_shape, cpu_peak_flops, measure_gemm_flops

    cfg = {"hidden_size": 64, "intermediate_size": 176}
    shape = actor_gemm_shape(cfg, tp=2, micro_batch=4, seq_len=32)
    assert (shape.m, shape.k, shape.n) == (128, 64, 176) and shape.flops == 2 * 128 * 64 * 176
    assert actor_gemm_shape(cfg, tp=1, micro_batch=1000, seq_len=1000).m == 4096  # rows capped

    durations = itertools.cycle([0.005, 0.002, 0.004])  # each timed product's seconds, as the clock reports them
    clock = {"now": 0.0, "starts": 0}

    def perf_counter():
        if clock["starts"] % 2:  # an end reading: a product took the next scripted duration
            clock["now"] += next(durations)
        clock["starts"] += 1
        return clock["now"]

    threads = torch.get_num_threads()
    with monkeypatch.context() as m:
        m.setattr(peak_flops, "time", types.SimpleNamespace(perf_counter=perf_counter))
        rate = measure_gemm_flops(shape, "float32", threads=1, min_s=0.05)
    assert rate == pytest.approx(shape.flops / 0.002)  # the best product; the mean would give flops / 0.0037
    assert clock["starts"] >= 2 * 14  # kept timing until min_s (0.05 s over 0.0037 s products)
    assert torch.get_num_threads() == threads  # the caller's thread count is back
    assert measure_gemm_flops(shape, "float32", threads=1, min_s=0.0) > 0  # the real clock: a positive rate
    flops, source = cpu_peak_flops(cfg, 2, 4, 32, "bfloat16", n_devices_per_node=2)
    assert flops > 0 and source.startswith("measured bfloat16 matmul [128x64] @ [64x176]"), source
    _, source = cpu_peak_flops(None, 1, 1, 1, "float32", n_devices_per_node=2)  # no model config to read
    assert source.startswith("measured float32 matmul [1024x1024] @ [1024x1024]"), source
