"""to_batch: hand-made multi-turn trajectories become the rollout output, tensors written out by hand."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridflow.agent.trajectory import Trajectory, to_batch
from hybridflow.rollout.output import OUTPUT_KEYS

PAD = 0


def _two_turn(prompt, turn1, lp1, tool, turn2, lp2) -> Trajectory:
    t = Trajectory(prompt_ids=list(prompt))
    t.add_model_turn(turn1, lp1, "stop", weight_version=3)
    t.add_inserted(tool)
    t.add_model_turn(turn2, lp2, "stop", weight_version=4)
    return t


def test_two_turn_trajectories_give_exact_tensors():
    a = _two_turn([5, 6], [10, 11], [-1.0, -2.0], [20, 21], [12], [-3.0])
    b = _two_turn([7, 8, 9], [13], [-0.5], [22], [14, 15], [-0.25, -0.75])
    b.reward = 1.0
    out = to_batch([a, b], pad_token_id=PAD, prompt_length=4, response_length=7)

    assert set(OUTPUT_KEYS) <= set(out.batch)
    assert out.batch["prompts"].tolist() == [[0, 0, 5, 6], [0, 7, 8, 9]]
    assert out.batch["responses"].tolist() == [[10, 11, 20, 21, 12, 0, 0], [13, 22, 14, 15, 0, 0, 0]]
    assert out.batch["input_ids"].tolist() == [[0, 0, 5, 6, 10, 11, 20, 21, 12, 0, 0],
                                               [0, 7, 8, 9, 13, 22, 14, 15, 0, 0, 0]]
    # the model attends to tool tokens: attention 1 over every real response token
    assert out.batch["attention_mask"].tolist() == [[0, 0, 1, 1, 1, 1, 1, 1, 1, 0, 0],
                                                    [0, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0]]
    # the loss mask: 0 on the tool tokens the loop inserted
    assert out.batch["response_mask"].tolist() == [[1, 1, 0, 0, 1, 0, 0], [1, 0, 1, 1, 0, 0, 0]]
    assert out.batch["rollout_log_probs"].tolist() == [[-1.0, -2.0, 0.0, 0.0, -3.0, 0.0, 0.0],
                                                       [-0.5, 0.0, -0.25, -0.75, 0.0, 0.0, 0.0]]
    # positions: 0 at the first real prompt token, counting on through the response and its padding
    assert out.batch["position_ids"].tolist() == [[0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8],
                                                  [0, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9]]
    assert out.non_tensor_batch["num_turns"].tolist() == [2, 2]
    assert out.non_tensor_batch["truncated"].tolist() == [False, False]
    assert np.isnan(out.non_tensor_batch["agent_reward"][0]) and out.non_tensor_batch["agent_reward"][1] == 1.0
    assert (a.min_weight_version, a.max_weight_version) == (3, 4)
    assert a.turns[0].ids == [10, 11] and a.turns[0].tool_ids == [20, 21] and a.turns[1].tool_ids == []


def test_response_longer_than_R_is_cut_with_masks_kept_right():
    t = _two_turn([5], [10, 11, 12], [-1.0, -1.0, -1.0], [20, 21, 22], [13, 14], [-2.0, -2.0])
    out = to_batch([t], pad_token_id=PAD, prompt_length=2, response_length=5)
    assert out.batch["responses"].tolist() == [[10, 11, 12, 20, 21]]
    assert out.batch["response_mask"].tolist() == [[1, 1, 1, 0, 0]]
    assert out.batch["attention_mask"].tolist() == [[0, 1, 1, 1, 1, 1, 1]]
    assert out.batch["rollout_log_probs"].tolist() == [[-1.0, -1.0, -1.0, 0.0, 0.0]]
    assert out.non_tensor_batch["truncated"].tolist() == [True]
    assert "agent_reward" not in out.non_tensor_batch


def test_no_log_probs_means_no_key_and_bad_prompt_is_named():
    t = Trajectory(prompt_ids=[1, 2])
    t.add_model_turn([3, 4], None, "stop")
    out = to_batch([t], pad_token_id=PAD, prompt_length=2, response_length=3)
    assert "rollout_log_probs" not in out.batch
    assert out.batch["response_mask"].dtype == out.batch["attention_mask"].dtype
    with pytest.raises(ValueError, match="trajectory 0 has a 2-token prompt > prompt_length=1"):
        to_batch([t], pad_token_id=PAD, prompt_length=1, response_length=3)


def test_empty_response_row_is_all_padding():
    t = Trajectory(prompt_ids=[4])
    out = to_batch([t], pad_token_id=PAD, prompt_length=1, response_length=2)
    assert out.batch["responses"].tolist() == [[0, 0]]
    assert out.batch["response_mask"].tolist() == [[0, 0]]
    assert torch.equal(out.batch["attention_mask"], torch.tensor([[1, 0, 0]]))
