"""ReMax's greedy baseline, fast: the modes it runs in (refused before Ray starts elsewhere, naming the key), the
rollout seeds it leaves alone (real HFRollout on the tiny model), and the driver's step with an in-process stand-in
for the generation group (what the greedy call asks for, the baselines and advantages by hand, the dump).

The end-to-end runs (Ray, Megatron, vLLM; ReMax learning on the reverse task) are tests/test_e2e_estimators.py.
"""

from __future__ import annotations

import json

import pytest
import torch
from test_async_checks import SPLIT, files  # noqa: F401  (files: the tiny policy and data, a fixture)
from test_async_checks import _validate as validate_overrides
from test_validation import FakeActorRollout, _row, parquet_data  # noqa: F401  (parquet_data: a fixture)

from hybridflow.config.load import load_config
from hybridflow.config.schema import RolloutConfig
from hybridflow.protocol import DataProto

SOURCE = "hybridflow/reverse"


def _validate(files, *overrides):  # noqa: F811
    return validate_overrides(files, "algorithm.adv_estimator=remax", *overrides)


@pytest.mark.parametrize("overrides", [("actor_rollout_ref.rollout.n=1",), ("actor_rollout_ref.rollout.n=4",),
                                       SPLIT], ids=["colocated-n1", "colocated-n4", "split-sync"])
def test_remax_passes_in_the_synchronous_batch_modes(files, overrides):  # noqa: F811
    cfg = _validate(files, *overrides)
    assert cfg.algorithm.adv_estimator == "remax" and not cfg.critic.enable


@pytest.mark.bad_input
@pytest.mark.parametrize("overrides, message", [
    (("actor_rollout_ref.rollout.mode=async",), r"remax .* actor_rollout_ref.rollout.mode=async .* not supported"),
    ((*SPLIT, "actor_rollout_ref.rollout.mode=async"), r"actor_rollout_ref.rollout.mode=async"),
    ((*SPLIT, "async_training.mode=one_step_off_policy"), r"remax .* async_training.mode=one_step_off_policy"),
    ((*SPLIT, "async_training.mode=fully_async", "actor_rollout_ref.rollout.mode=async"),
     r"remax .* actor_rollout_ref.rollout.mode=async"),
], ids=["server-mode", "split-server-mode", "one-step-off-policy", "fully-async"])
def test_remax_is_refused_where_a_step_does_not_generate_its_own_batch(files, overrides, message):  # noqa: F811
    with pytest.raises(ValueError, match=message):
        _validate(files, *overrides)


def test_the_greedy_baseline_call_does_not_shift_the_training_seeds(tmp_path):
    """HFRollout (the same call counter as vLLM's): steps 1 and 2 sample the same tokens with or without a greedy
    call of step 1 between them, and a rollout that starts at step 2 (a resumed run) samples step 2's."""
    from hybridflow.data.rl_dataset import collate
    from hybridflow.models.tiny import build_tokenizer, save_tiny_model
    from hybridflow.rollout.hf_rollout import HFRollout
    from hybridflow.trainer.remax import greedy_prompts

    model = save_tiny_model(tmp_path / "m", seed=0)
    tok = build_tokenizer()
    rows = [{**_row(i, tok, f"reverse: {t}"), "index": i} for i, t in enumerate(["12345", "9876", "555", "01"])]
    tensors, objects = collate(rows, tok.pad_token_id, 24)
    step = lambda s: DataProto.from_dict(tensors, objects, {"global_step": s})
    cfg = RolloutConfig(name="hf", response_length=6, temperature=1.0, n=2, seed=3)

    plain = HFRollout(str(model), cfg)
    expected = [plain.generate_sequences(step(s)).batch["responses"] for s in (1, 2)]
    assert not torch.equal(expected[0], expected[1])  # consecutive steps sample differently: a shift would show
    with_baseline = HFRollout(str(model), cfg)
    got = []
    for s in (1, 2):
        got.append(with_baseline.generate_sequences(step(s)).batch["responses"])
        greedy, pad = greedy_prompts(step(s), 3)
        out = with_baseline.generate_sequences(greedy)
        assert (pad, len(out)) == (2, 6)  # 4 prompts padded to the group's 3 ranks, one greedy row each
    assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))
    assert torch.equal(HFRollout(str(model), cfg).generate_sequences(step(2)).batch["responses"], expected[1])


def _remax_trainer(run_dir, data, **over):
    from hybridflow.data.rl_dataset import RLDataset
    from hybridflow.data.sampler import ResumableSampler
    from hybridflow.models.tiny import build_tokenizer
    from hybridflow.rewards.manager import RewardManager
    from hybridflow.trainer.ppo_trainer import RayPPOTrainer

    overrides = {"algorithm.adv_estimator": "remax", "critic.enable": "false", "data.train_batch_size": 4,
                 "actor_rollout_ref.actor.ppo_mini_batch_size": 4, "actor_rollout_ref.rollout.n": 2,
                 "actor_rollout_ref.rollout.response_length": 8, "data.max_prompt_length": 24,
                 "trainer.logger": "[jsonl]", "trainer.default_local_dir": run_dir, "trainer.total_training_steps": 1,
                 "data.shuffle": "false", **over}
    cfg = load_config(None, [f"{k}={v}" for k, v in overrides.items()])
    tok = build_tokenizer()
    train = RLDataset([str(data / "train.parquet")], tok, max_prompt_length=24)
    sampler = ResumableSampler(len(train), 4, cfg.data.seed, shuffle=False)
    arr = FakeActorRollout(tok, cfg.actor_rollout_ref.rollout)
    return RayPPOTrainer(cfg, tok, train, sampler, RewardManager(), arr), arr


def test_a_remax_step_subtracts_each_prompts_greedy_score_from_its_samples(tmp_path, parquet_data):  # noqa: F811
    """The stand-in answers sample j of prompt i right (score 1) when i + j is even, else with eos alone (0); its
    greedy answer is sample 0's. So the baseline is 1 for even i, 0 for odd i, and the advantage of sample j is
    score - baseline: 0 and -1 for even i, 0 and +1 for odd i, on every response token."""
    trainer, arr = _remax_trainer(tmp_path / "run", parquet_data, **{"trainer.rollout_data_dir": tmp_path / "dump"})
    trainer.fit()
    assert [(c["rows"], c.get("do_sample"), c.get("n"), c["global_step"]) for c in arr.calls] == [
        (4, None, None, 1), (4, False, 1, 1)]  # the greedy call: the same prompts, one answer each
    records = [json.loads(x) for x in (tmp_path / "dump" / "step_1.jsonl").read_text().splitlines()]
    greedy = [json.loads(x) for x in (tmp_path / "dump" / "baseline_step_1.jsonl").read_text().splitlines()]
    assert len(records) == 8 and len(greedy) == 4
    by_uid = {g["uid"]: g for g in greedy}
    for k, r in enumerate(records):
        i, j = r["index"], k % 2
        assert r["score"] == (1.0 if (i + j) % 2 == 0 else 0.0)
        assert by_uid[r["uid"]]["index"] == i and by_uid[r["uid"]]["response"] == (r["ground_truth"] if i % 2 == 0
                                                                                   else "")
        assert r["reward_baseline"] == by_uid[r["uid"]]["score"] == (1.0 if i % 2 == 0 else 0.0)
        assert r["advantage_mean"] == {(0, 0): 0.0, (0, 1): -1.0, (1, 0): 0.0, (1, 1): 1.0}[(i % 2, j)]
    (row,) = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert row["timing_s/gen_baseline"] > 0 and row["timing_s/gen_max"] == row["timing_s/gen_baseline"]
    # the greedy responses are not trained on: the step's tokens are the sampled ones only
    assert row["response_length/mean"] == pytest.approx(sum(len(r["response_ids"]) for r in records) / 8)


def test_a_trainer_built_for_a_mode_remax_does_not_support_refuses_it(tmp_path, parquet_data):  # noqa: F811
    with pytest.raises(ValueError, match=r"async_training.mode=one_step_off_policy"):
        _remax_trainer(tmp_path / "run", parquet_data, **{"async_training.mode": "one_step_off_policy"})
