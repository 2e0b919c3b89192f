"""verl's reward managers for the rule/user scores (reward_model.reward_manager): `naive` keeps each score as its
scorer returns it; `dapo` adds DAPO's soft overlong punishment (Yu et al. 2025, "DAPO", section 3.4; verl's
DAPORewardManager with reward_kwargs.overlong_buffer_cfg):

    penalty(L) = min(-(L - (max_resp_len - len)) / len * penalty_factor, 0)

for a response of L tokens: 0 up to max_resp_len - len tokens, then falling linearly to -penalty_factor at
max_resp_len (and on, for a budget past it). L counts every response token the attention mask keeps, tool tokens
of a multi-turn trajectory included, as verl counts them. Pure: the trainer calls `shape_scores` in its reward
stage, for training and validation alike (verl's val reward manager is the same class).
"""

from __future__ import annotations

import math

import numpy as np

MANAGERS = ("naive", "dapo")


def overlong_penalty(lengths, max_resp_len: int, buffer_len: int, penalty_factor: float) -> np.ndarray:
    """The penalty of each response length (float32, <= 0)."""
    lengths = np.asarray(lengths, dtype=np.float64)
    exceed = lengths - (max_resp_len - buffer_len)
    return np.minimum(-exceed / buffer_len * penalty_factor, 0.0).astype(np.float32)


def max_resp_len(rm_cfg, max_response_length: int) -> int:
    return rm_cfg.reward_kwargs.max_resp_len or max_response_length


def shape_scores(rm_cfg, max_response_length: int, scores, lengths) -> tuple[np.ndarray, dict[str, float]]:
    """The manager's scores from the scorers' `scores` for responses of `lengths` tokens, and its metrics
    (with overlong_buffer_cfg.log: reward/overlong_reward, the mean penalty, and reward/overlong, the share
    penalised). rm_cfg: reward_model (reward_manager, reward_kwargs)."""
    scores = np.asarray(scores, dtype=np.float32)
    buffer = rm_cfg.reward_kwargs.overlong_buffer_cfg
    if rm_cfg.reward_manager != "dapo" or not buffer.enable:
        return scores, {}
    penalty = overlong_penalty(lengths, max_resp_len(rm_cfg, max_response_length), buffer.len,
                               buffer.penalty_factor)
    metrics = {}
    if buffer.log:
        metrics = {"reward/overlong_reward": float(penalty.mean()) if len(penalty) else 0.0,
                   "reward/overlong": float((penalty < 0).mean()) if len(penalty) else 0.0}
    return scores + penalty, metrics


def shape_batch_scores(cfg, batch, scores) -> tuple[np.ndarray, dict[str, float]]:
    """shape_scores for a scored rollout batch (DataProto): each response's length from its attention mask."""
    width = batch.batch["responses"].shape[1]
    lengths = batch.batch["attention_mask"][:, -width:].sum(-1).tolist()
    return shape_scores(cfg.reward_model, cfg.data.max_response_length, scores, lengths)


def check(rm_cfg, max_response_length: int) -> None:
    """reward_model.reward_manager and reward_kwargs, before Ray; each error names its key."""
    key = "reward_model.reward_kwargs"
    if rm_cfg.reward_manager not in MANAGERS:
        raise ValueError(f"reward_model.reward_manager={rm_cfg.reward_manager!r}; choose one of {', '.join(MANAGERS)}")
    buffer = rm_cfg.reward_kwargs.overlong_buffer_cfg
    if not buffer.enable:
        return
    if rm_cfg.reward_manager != "dapo":
        raise ValueError(f"{key}.overlong_buffer_cfg.enable=true is DAPO's penalty: set reward_model.reward_manager="
                         f"dapo (got {rm_cfg.reward_manager})")
    budget = max_resp_len(rm_cfg, max_response_length)
    if not isinstance(buffer.len, int) or not 1 <= buffer.len <= budget:
        raise ValueError(f"{key}.overlong_buffer_cfg.len={buffer.len} must be between 1 and {key}.max_resp_len="
                         f"{budget} (null: data.max_response_length), the budget the buffer ends at")
    if not math.isfinite(buffer.penalty_factor) or buffer.penalty_factor < 0:
        raise ValueError(f"{key}.overlong_buffer_cfg.penalty_factor={buffer.penalty_factor} must be a finite "
                         "number >= 0")
