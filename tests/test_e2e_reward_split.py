"""End-to-end run of the reward-model path (real Ray, Megatron TP=2, vLLM, tiny model).

- GRPO with reward_model.enable=true and reward_mode=replace: every sample the run dumped
  (trainer.rollout_data_dir) scores what HF transformers' LlamaForSequenceClassification gives the
  same token ids, and critic/score/mean in metrics.jsonl is the mean of those HF scores.

Placements against colocate (standalone, resource pools of other sizes): tests/test_e2e_placement.py.
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
              f"trainer.rollout_data_dir={rollouts}",
              # fp32: the scores are compared with HF's reward model to 1e-5
              "actor_rollout_ref.model.dtype=float32", "reward_model.model.dtype=float32"), tmp_path / "grpo_rm.log")
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
