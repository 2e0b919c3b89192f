"""Validation, fast: verl metric names and aggregation against hand-computed values, the schedule, the config
checks, the rollout's separate validation seed stream, and RayPPOTrainer.fit with in-process stand-ins for
the worker groups (what validation generates with, logs, dumps, and that it leaves training's data alone).

The end-to-end check against HF transformers' greedy generation is tests/test_e2e_validation.py.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from hybridflow.config.load import ConfigError, load_config
from hybridflow.config.schema import RolloutConfig, ValKwargsConfig
from hybridflow.protocol import DataProto
from hybridflow.rollout.base import SamplingSettings
from hybridflow.trainer import validation as V

SOURCE = "hybridflow/reverse"

# ---------------------------------------------------------------- metrics


def test_metrics_n1_are_the_mean_per_data_source():
    got = V.validation_metrics(["a", "b", "a"], [0, 1, 2], [1.0, 0.25, 0.5])
    assert got == {"val-core/a/reward/mean@1": 0.75, "val-core/b/reward/mean@1": 0.25}


def test_metrics_n3_summarise_each_prompt_then_average_over_prompts():
    # prompt 7: scores 1, 0, 0.5 (given interleaved with prompt 9's, to show grouping is by prompt id)
    # prompt 9: scores 0, 0, 0
    got = V.validation_metrics([SOURCE] * 6, [7, 9, 7, 9, 7, 9], [1.0, 0.0, 0.0, 0.0, 0.5, 0.0])
    std7 = math.sqrt((0.5**2 + 0.5**2 + 0.0**2) / 3)  # population std around the mean 0.5
    assert got == pytest.approx({
        f"val-core/{SOURCE}/reward/mean@3": (0.5 + 0.0) / 2,
        f"val-aux/{SOURCE}/reward/std@3": (std7 + 0.0) / 2,
        f"val-core/{SOURCE}/reward/best@3/mean": (1.0 + 0.0) / 2,
        f"val-aux/{SOURCE}/reward/worst@3/mean": (0.0 + 0.0) / 2,
    }, abs=1e-12)


def test_metrics_refuse_mismatched_inputs():
    with pytest.raises(ValueError, match="2 data sources, 2 prompt ids and 1 scores"):
        V.validation_metrics(["a", "a"], [0, 1], [1.0])
    with pytest.raises(ValueError, match="different sample counts"):
        V.validation_metrics(["a", "a", "a"], [0, 0, 1], [1.0, 1.0, 1.0])


def test_summary_line_names_each_mean_and_the_size():
    line = V.summary_line(4, {f"val-core/{SOURCE}/reward/mean@2": 0.5, f"val-aux/{SOURCE}/reward/std@2": 0.1,
                              "timing_s/testing": 1.25}, 16, 2)
    assert line == f"validation at step 4: {SOURCE}/reward/mean@2=0.5000 (16 prompts x 2, 1.2 s)"


# ---------------------------------------------------------------- schedule, chunks, sampling


def test_schedule_every_test_freq_steps_and_the_last():
    assert [s for s in range(1, 6) if V.should_validate(s, 5, 2)] == [2, 4, 5]
    assert [s for s in range(1, 6) if V.should_validate(s, 5, 1)] == [1, 2, 3, 4, 5]
    assert not any(V.should_validate(s, 5, f) for s in range(1, 6) for f in (-1, 0))


def test_before_training_unless_this_step_was_validated_already():
    assert V.validate_before_training(True, 0, None)
    assert V.validate_before_training(True, 3, 2)  # resumed at 3; 3 itself was not validated
    assert not V.validate_before_training(True, 3, 3)  # the checkpoint was written right after validating 3
    assert not V.validate_before_training(False, 0, None)


def test_chunks_walk_the_val_set_in_order():
    assert V.chunks(5, None) == [range(0, 5)]
    assert V.chunks(5, 2) == [range(0, 2), range(2, 4), range(4, 5)]
    assert V.chunks(0, 2) == []
    with pytest.raises(ValueError, match="data.val_batch_size=0"):
        V.chunks(5, 0)


def test_val_kwargs_reach_the_sampling_settings():
    train = SamplingSettings.from_config(RolloutConfig(n=4, temperature=1.0, seed=3))
    greedy = train.with_overrides(V.sampling_meta(ValKwargsConfig()))
    assert greedy.greedy and greedy.n == 1 and greedy.is_validation
    sampled = train.with_overrides(V.sampling_meta(ValKwargsConfig(do_sample=True, temperature=0.7, top_p=0.9,
                                                                   top_k=5, n=2)))
    assert (sampled.greedy, sampled.temperature, sampled.top_p, sampled.top_k, sampled.n) == (False, 0.7, 0.9, 5, 2)
    assert not train.is_validation and train.n == 4


def test_validation_calls_do_not_shift_the_training_seeds(tmp_path):
    """HFRollout: training calls 1 and 2 sample the same tokens with or without validation calls in between."""
    from hybridflow.data.rl_dataset import collate
    from hybridflow.models.tiny import build_tokenizer, save_tiny_model
    from hybridflow.rollout.hf_rollout import HFRollout

    model = save_tiny_model(tmp_path / "m", seed=0)
    tok = build_tokenizer()
    rows = [{**_row(i, tok, f"reverse: {t}"), "index": i} for i, t in enumerate(["12345", "9876", "555"])]
    tensors, objects = collate(rows, tok.pad_token_id, 24)
    train = DataProto.from_dict(tensors, objects)
    val = DataProto.from_dict(tensors, objects, V.sampling_meta(ValKwargsConfig(do_sample=True, temperature=1.0)))
    cfg = RolloutConfig(name="hf", response_length=6, temperature=1.0, seed=3)

    plain = HFRollout(str(model), cfg)
    expected = [plain.generate_sequences(train).batch["responses"] for _ in range(2)]
    assert not torch.equal(expected[0], expected[1])  # consecutive calls sample differently: a shift would show
    mixed = HFRollout(str(model), cfg)
    got = []
    for _ in range(2):
        mixed.generate_sequences(val)
        got.append(mixed.generate_sequences(train).batch["responses"])
    assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))


# ---------------------------------------------------------------- config


def test_new_keys_load_and_a_typo_names_the_nearest():
    cfg = load_config(None, ["actor_rollout_ref.rollout.val_kwargs.n=2", "trainer.test_freq=3",
                             "data.val_batch_size=4", "actor_rollout_ref.rollout.val_kwargs.do_sample=true"])
    assert (cfg.actor_rollout_ref.rollout.val_kwargs.n, cfg.trainer.test_freq, cfg.data.val_batch_size) == (2, 3, 4)
    assert ValKwargsConfig() == ValKwargsConfig(do_sample=False, temperature=0.0, top_p=1.0, top_k=-1, n=1)
    with pytest.raises(ConfigError, match="did you mean 'actor_rollout_ref.rollout.val_kwargs.temperature'"):
        load_config(None, ["actor_rollout_ref.rollout.val_kwargs.temperatur=1"])


@pytest.mark.parametrize("overrides, error, message", [
    ({"trainer.test_freq": 5}, ValueError, r"trainer.test_freq=5 validates on data.val_files, which is empty"),
    ({"trainer.val_before_train": "true"}, ValueError, r"trainer.val_before_train=true validates on data.val_files"),
    ({"data.val_files": "[nowhere.parquet]", "trainer.test_freq": 1}, FileNotFoundError,
     r"data.val_files: nowhere.parquet does not exist"),
    ({"data.val_batch_size": 0}, ValueError, r"data.val_batch_size=0 must be >= 1"),
    ({"actor_rollout_ref.rollout.val_kwargs.do_sample": "true"}, ValueError,
     r"val_kwargs.do_sample=true samples at actor_rollout_ref.rollout.val_kwargs.temperature, which is 0"),
    ({"actor_rollout_ref.rollout.val_kwargs.n": 0}, ValueError, r"actor_rollout_ref.rollout.val_kwargs.n=0"),
    ({"actor_rollout_ref.rollout.val_kwargs.top_p": 0}, ValueError, r"val_kwargs.top_p=0.0 must be in \(0, 1\]"),
])
def test_config_errors_name_the_key(overrides, error, message):
    from hybridflow.trainer.preflight import _validate_validation

    cfg = load_config(None, [f"{k}={v}" for k, v in overrides.items()])
    with pytest.raises(error, match=message):
        _validate_validation(cfg)


# ---------------------------------------------------------------- plot and summary


def test_plot_draws_val_points_on_the_reward_panel(tmp_path):
    from hybridflow.trainer.plots import plot_curves, val_series

    key = f"val-core/{SOURCE}/reward/mean@1"
    rows = [{"step": 0, key: 0.2, "timing_s/testing": 1.0},
            {"step": 1, "critic/score/mean": 0.3, "training/global_step": 1.0},
            {"step": 2, "critic/score/mean": 0.4, "training/global_step": 2.0, key: 0.5}]
    assert val_series(rows) == {"val": ([0, 2], [0.2, 0.5])}
    two = rows + [{"step": 2, "val-core/other/reward/mean@4": 0.1}]
    assert set(val_series(two)) == {f"val {SOURCE}", "val other"}
    assert plot_curves(rows, tmp_path / "c.png").stat().st_size > 5000
    assert plot_curves(rows[:1], tmp_path / "v.png").is_file()  # only the validation before training


def test_summary_counts_training_steps_and_shows_first_and_last_validation(capsys):
    from hybridflow.trainer.summary import print_summary

    key = f"val-core/{SOURCE}/reward/mean@1"
    text = print_summary([{"step": 0, key: 0.25}, {"step": 1, "critic/score/mean": 0.3, "training/global_step": 1},
                          {"step": 2, "critic/score/mean": 0.5, "training/global_step": 2, key: 0.75}])
    assert "Run summary (2 steps)" in capsys.readouterr().out
    assert f"{key} (step 0 -> 2)" in text and "0.25" in text and "0.75" in text


# ---------------------------------------------------------------- fit() with stand-in worker groups


def _row(i: int, tok, prompt: str) -> dict:
    text = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False)
    return {"input_ids": tok(text, add_special_tokens=False)["input_ids"], "data_source": SOURCE,
            "ground_truth": prompt.split(": ")[1][::-1], "extra_info": {}, "raw_prompt": prompt}


class FakeActorRollout:
    """Stands in for the actor/rollout worker group. Sample j of the prompt with dataset index i answers
    correctly (score 1) when i + j is even and with eos alone (score 0) otherwise. Records every call."""

    world_size = 2

    def __init__(self, tok, rollout: RolloutConfig):
        self.tok, self.rollout, self.calls = tok, rollout, []

    def generate_sequences(self, batch: DataProto) -> DataProto:
        from hybridflow.rollout.output import assemble_rollout_output

        assert len(batch) % self.world_size == 0, "the driver pads for DP dispatch"
        self.calls.append({**batch.meta_info, "rows": len(batch)})
        s = SamplingSettings.from_config(self.rollout).with_overrides(batch.meta_info)
        nt = batch.non_tensor_batch
        responses = []
        for truth, index in zip(nt["ground_truth"], nt["index"], strict=True):
            for j in range(s.n):
                text = truth if (int(index) + j) % 2 == 0 else ""
                responses.append(self.tok(text, add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id])
        out = assemble_rollout_output(batch, responses, [[-0.5] * len(r) for r in responses], s.n,
                                      s.response_length, self.tok.pad_token_id)
        out.meta_info["metrics"] = {"timing_s/reshard": 0.0}
        return out

    def update_actor(self, batch: DataProto) -> DataProto:
        return DataProto(meta_info={"metrics": {"actor/pg_loss": 0.0}})

    def save_checkpoint(self, path: str, extra: dict) -> None:
        import pathlib

        pathlib.Path(path).mkdir(parents=True)

    def load_checkpoint(self, path: str) -> None:
        pass


@pytest.fixture(scope="module")
def parquet_data(tmp_path_factory):
    from hybridflow.data.synthetic import make_reverse_rows, write_parquet

    root = tmp_path_factory.mktemp("data")
    test = make_reverse_rows(5, seed=1, alphabet="0123456789", split="test")
    held_out = {r["extra_info"]["text"] for r in test}
    write_parquet(make_reverse_rows(32, seed=0, alphabet="0123456789", exclude=held_out), root / "train.parquet")
    write_parquet(test, root / "test.parquet")
    return root


def _trainer(run_dir, data, total: int, **over):
    from hybridflow.data.rl_dataset import RLDataset
    from hybridflow.data.sampler import ResumableSampler
    from hybridflow.models.tiny import build_tokenizer
    from hybridflow.rewards.manager import RewardManager
    from hybridflow.trainer.ppo_trainer import RayPPOTrainer

    overrides = {"algorithm.adv_estimator": "reinforce_plus_plus", "critic.enable": "false",
                 "data.train_batch_size": 4, "actor_rollout_ref.actor.ppo_mini_batch_size": 4,
                 "actor_rollout_ref.rollout.n": 1, "actor_rollout_ref.rollout.response_length": 8,
                 "data.max_prompt_length": 24, "trainer.logger": "[jsonl]", "trainer.default_local_dir": run_dir,
                 "trainer.total_training_steps": total, "data.val_files": f"[{data / 'test.parquet'}]", **over}
    cfg = load_config(None, [f"{k}={v}" for k, v in overrides.items()])
    tok = build_tokenizer()
    make = lambda f: RLDataset([str(data / f)], tok, max_prompt_length=24)
    train = make("train.parquet")
    sampler = ResumableSampler(len(train), 4, cfg.data.seed, shuffle=True)
    arr = FakeActorRollout(tok, cfg.actor_rollout_ref.rollout)
    return RayPPOTrainer(cfg, tok, train, sampler, RewardManager(), arr, val_dataset=make("test.parquet")), arr


def _jsonl(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_fit_validates_before_every_test_freq_and_last_step_greedily(tmp_path, parquet_data):
    key = f"val-core/{SOURCE}/reward/mean@1"
    run = tmp_path / "val"
    trainer, arr = _trainer(run, parquet_data, total=3, **{
        "trainer.val_before_train": "true", "trainer.test_freq": 2, "data.val_batch_size": 2,
        "trainer.validation_data_dir": tmp_path / "val_dump"})
    trainer.fit()
    rows = _jsonl(run / "metrics.jsonl")
    assert [(r["step"], key in r, "critic/score/mean" in r) for r in rows] == [
        (0, True, False), (1, False, True), (2, True, True), (3, True, True)]
    # val prompts 0..4, the fake answers the even ones: 3 of 5, at every validation (the fake ignores weights)
    assert [r[key] for r in rows if key in r] == [0.6, 0.6, 0.6]
    assert all(r["timing_s/testing"] > 0 for r in rows if key in r)
    assert not any(k.startswith("val-aux/") for r in rows for k in r)  # n = 1: no spread to report
    val_calls = [c for c in arr.calls if c.get("validate")]
    # 3 validations x chunks of 2, 2 and 1 prompts (the last padded to the group's 2 ranks)
    assert [c["rows"] for c in val_calls] == [2, 2, 2] * 3
    assert all(c["do_sample"] is False and c["n"] == 1 for c in val_calls)
    assert [c["global_step"] for c in val_calls] == [0] * 3 + [2] * 3 + [3] * 3
    train_calls = [c for c in arr.calls if not c.get("validate")]
    assert len(train_calls) == 3 and not any("do_sample" in c or "n" in c for c in train_calls)
    dumped = _jsonl(tmp_path / "val_dump" / "step_0.jsonl")
    assert [(d["index"], d["score"]) for d in dumped] == [(0, 1.0), (1, 0.0), (2, 1.0), (3, 0.0), (4, 1.0)]
    assert sorted(p.name for p in (tmp_path / "val_dump").iterdir()) == ["step_0.jsonl", "step_2.jsonl",
                                                                         "step_3.jsonl"]

    # The same run without validation trains on the same batches, and its rows are the training rows.
    plain, _ = _trainer(tmp_path / "plain", parquet_data, total=3)
    plain.fit()
    assert (run / "data_trace.jsonl").read_text() == (tmp_path / "plain" / "data_trace.jsonl").read_text()
    plain_rows = _jsonl(tmp_path / "plain" / "metrics.jsonl")
    for a, b in zip(plain_rows, rows[1:], strict=True):
        assert a["critic/score/mean"] == b["critic/score/mean"]
    assert trainer.kl_ctrl.value == plain.kl_ctrl.value


def test_fit_sampled_validation_reports_verl_spread_metrics(tmp_path, parquet_data):
    trainer, arr = _trainer(tmp_path / "run", parquet_data, total=1, **{
        "trainer.test_freq": 1, "actor_rollout_ref.rollout.val_kwargs.do_sample": "true",
        "actor_rollout_ref.rollout.val_kwargs.temperature": 0.7, "actor_rollout_ref.rollout.val_kwargs.n": 2})
    trainer.fit()
    (row,) = _jsonl(tmp_path / "run" / "metrics.jsonl")
    # each prompt's 2 samples: one right, one wrong
    assert {k: v for k, v in row.items() if k.startswith("val-")} == {
        f"val-core/{SOURCE}/reward/mean@2": 0.5, f"val-aux/{SOURCE}/reward/std@2": 0.5,
        f"val-core/{SOURCE}/reward/best@2/mean": 1.0, f"val-aux/{SOURCE}/reward/worst@2/mean": 0.0}
    (val_call,) = [c for c in arr.calls if c.get("validate")]
    assert (val_call["do_sample"], val_call["temperature"], val_call["n"], val_call["rows"]) == (True, 0.7, 2, 6)


def test_resume_does_not_validate_a_finished_step_again(tmp_path, parquet_data):
    key = f"val-core/{SOURCE}/reward/mean@1"
    common = {"trainer.val_before_train": "true", "trainer.test_freq": 1, "trainer.save_freq": 1}
    first, _ = _trainer(tmp_path / "run", parquet_data, total=2, **common)
    first.fit()
    resumed, arr = _trainer(tmp_path / "run", parquet_data, total=3, **common)
    resumed.fit()
    assert [c["global_step"] for c in arr.calls if c.get("validate")] == [3]  # not 2 again before training
    rows = _jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows if key in r] == [0, 1, 2, 3]
    # A checkpoint whose step was not validated (test_freq=-1: only step 0 was) validates before training.
    again, _ = _trainer(tmp_path / "other", parquet_data, total=1, **{**common, "trainer.test_freq": -1})
    again.fit()
    resumed, arr = _trainer(tmp_path / "other", parquet_data, total=2, **{**common, "trainer.test_freq": -1})
    resumed.fit()
    assert [c["global_step"] for c in arr.calls if c.get("validate")] == [1]


class FakeRewardModel:
    """Stands in for the reward model group: 0.25 on each sample's last valid token. Three ranks, so a val chunk
    of 2 prompts has to be padded for it."""

    world_size = 3

    def __init__(self):
        self.rows = []

    def compute_rm_score(self, batch: DataProto) -> DataProto:
        from hybridflow.rewards.manager import scores_to_token_level

        assert len(batch) % self.world_size == 0, "the driver pads for the reward model's DP dispatch too"
        self.rows.append(len(batch))
        return DataProto.from_dict({"rm_scores": scores_to_token_level([0.25] * len(batch),
                                                                       batch.batch["response_mask"])})


@pytest.mark.parametrize("mode, expected", [("replace", 0.25), ("add", 0.6 + 0.25)])
def test_validation_scores_through_the_reward_model_as_training_does(tmp_path, parquet_data, mode, expected):
    trainer, _ = _trainer(tmp_path / "run", parquet_data, total=1, **{
        "data.val_batch_size": 2, "reward_model.reward_mode": mode})
    trainer.rm = FakeRewardModel()
    metrics = trainer.validate()
    assert metrics[f"val-core/{SOURCE}/reward/mean@1"] == pytest.approx(expected, abs=1e-7)  # float32 scores
    assert trainer.rm.rows == [3, 3, 3]  # chunks of 2, 2 and 1 prompts, each padded to the 3 ranks
