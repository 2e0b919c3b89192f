"""End-to-end runs of the reward-model path and of split placement (real Ray, Megatron TP=2, vLLM, tiny model).

- GRPO with reward_model.enable=true and reward_mode=replace: every sample the run dumped
  (trainer.rollout_data_dir) scores what HF transformers' LlamaForSequenceClassification gives the
  same token ids, and critic/score/mean in metrics.jsonl is the mean of those HF scores.
- PPO with trainer.placement=colocate and =split (actor+rollout, ref, critic each in their own pool),
  same seed: the same scores, values and KL at both steps.
"""

from __future__ import annotations

import json

import pytest
import torch
from test_e2e_trainer import _cmd, _rows, _run

# HF fp32 vs our Megatron fp32 forward of the same sequence (measured: at most 7.5e-8 on scores of ~0.2).
SCORE_ATOL = 1e-5


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from hybridflow.models.tiny import save_tiny_reward_model
    from hybridflow.trainer.warmstart import prepare

    root = tmp_path_factory.mktemp("assets")
    out = prepare(root, sft_steps=2, train_size=256, test_size=16)
    # A reward model on the policy's body with its own seeded score head, as RMs usually start.
    return {**out, "rm": str(save_tiny_reward_model(root / "rm", body_from=out["model"], seed=3))}


def _hf_scores(rm_dir: str, records: list[dict]) -> list[float]:
    """The reference: HF's sequence classifier on each sample's prompt + response ids, alone and unpadded.

    HF pools the row at its last token that is not pad_token_id. Our worker pools at the last token
    the attention mask marks valid, and a sampled <pad> id inside a response is a real token to it.
    With one unpadded row and pad_token_id unset, HF pools the last token too: both score the same one.
    """
    from transformers import AutoModelForSequenceClassification

    rm = AutoModelForSequenceClassification.from_pretrained(rm_dir, dtype=torch.float32).eval()
    rm.config.pad_token_id = None
    with torch.no_grad():
        return [rm(input_ids=torch.tensor([r["prompt_ids"] + r["response_ids"]])).logits[0, 0].item()
                for r in records]


@pytest.mark.slow
def test_grpo_with_reward_model_scores_like_hf(assets, tmp_path):
    run = tmp_path / "grpo_rm"
    rollouts = tmp_path / "rollouts"
    _run(_cmd("grpo_tiny_cpu.yaml", run, f"actor_rollout_ref.model.path={assets['model']}",
              f"data.train_files=[{assets['train']}]", "data.train_batch_size=4",
              "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.rollout.n=2",
              "trainer.total_training_steps=2", "trainer.save_freq=-1", "reward_model.enable=true",
              f"reward_model.model.path={assets['rm']}", "reward_model.reward_mode=replace",
              f"trainer.rollout_data_dir={rollouts}"), tmp_path / "grpo_rm.log")
    rows = _rows(run)
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        step = row["step"]
        records = [json.loads(x) for x in (rollouts / f"step_{step}.jsonl").read_text().splitlines()]
        assert len(records) == 8
        expected = _hf_scores(assets["rm"], records)
        got = [r["score"] for r in records]
        assert got == pytest.approx(expected, abs=SCORE_ATOL), step
        assert [r["rm_score"] for r in records] == got  # replace: the score is the model's alone
        assert max(expected) - min(expected) > 100 * SCORE_ATOL  # samples differ: a mix-up would show
        assert row["critic/score/mean"] == pytest.approx(sum(expected) / len(expected), abs=SCORE_ATOL)
        assert row["critic/rm_score/mean"] == pytest.approx(row["critic/score/mean"])
        assert "timing_s/rm" in row and "reward/mean" not in row  # the rule scorer was not called


# Measured on this CPU: colocate and split give bit-identical metrics at both steps. Every role runs the
# same TP=2 layout in both placements, each rank with one OMP thread, and the rollout is seeded by
# (seed, call, replica), so the same floating-point operations run in the same order, only in other
# processes. The tolerance is therefore not a statistical allowance; it only absorbs last-bit
# reduction-order noise. Step 2 holds only because step 1 is exact: a last-bit change in step 1's
# advantages could flip one sampled token in step 2 and move its score by a whole character's reward.
# (GPU kernels are not bitwise deterministic in general; there, compare step 1 only.)
PLACEMENT_REL, PLACEMENT_ABS = 1e-6, 1e-9
COMPARED = ("critic/score/mean", "critic/values/mean", "critic/rewards/mean", "actor/reward_kl_penalty",
            "critic/advantages/mean", "critic/vf_loss", "actor/pg_loss")


@pytest.mark.slow
def test_ppo_split_placement_matches_colocate(assets, tmp_path):
    results = {}
    for placement in ("colocate", "split"):
        run = tmp_path / placement
        log = tmp_path / f"{placement}.log"
        _run(_cmd("ppo_tiny_cpu.yaml", run, f"actor_rollout_ref.model.path={assets['model']}",
                  f"data.train_files=[{assets['train']}]", "data.train_batch_size=8",
                  "actor_rollout_ref.actor.ppo_mini_batch_size=8", "critic.ppo_mini_batch_size=8",
                  "trainer.total_training_steps=2", "trainer.save_freq=-1", f"trainer.placement={placement}"), log)
        results[placement] = _rows(run)
    assert "ref in pool 'ref', critic in pool 'critic'" in (tmp_path / "split.log").read_text()
    assert "ref in pool" not in (tmp_path / "colocate.log").read_text()  # colocated: the actor's processes
    colocate, split = results["colocate"], results["split"]
    assert [r["step"] for r in split] == [1, 2]
    for a, b in zip(colocate, split, strict=True):
        for key in COMPARED:
            assert b[key] == pytest.approx(a[key], rel=PLACEMENT_REL, abs=PLACEMENT_ABS), (a["step"], key)
    # the KL is a real signal at step 2 (the actor moved, the ref in its own pool did not)
    assert split[1]["actor/reward_kl_penalty"] > 1e-4
