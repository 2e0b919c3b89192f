"""Advantage estimators: each returns (advantages, returns), both (batch, response_len).

Conventions shared by every estimator:
- Only tokens where `response_mask` is nonzero take part. A masked token is treated
  as absent: recursions over time carry their state straight across it (so a hole in
  the middle of a response, e.g. tool output in a multi-turn rollout, does not cut the
  credit chain), and whatever reward or value sits there is ignored.
- Outputs are 0 at masked positions.
- Sequence-level estimators (GRPO, RLOO, REINFORCE++-baseline) score a response as the
  sum of its valid token rewards and group responses by `index`, one id per prompt
  (e.g. the uid shared by the rollout.n samples of a prompt).
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Sequence

import numpy as np
import torch

from hybridflow.algorithms.masked import masked_sum, masked_whiten, require_same_shape

AdvFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def _zero_outside(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask.bool(), x, torch.zeros_like(x))


def _groups(index: Sequence | np.ndarray, batch_size: int) -> dict[object, list[int]]:
    """Row numbers per group id, in first-seen order."""
    ids = np.asarray(index)
    if ids.ndim != 1 or len(ids) != batch_size:
        raise ValueError(f"index must hold one group id per row: got shape {ids.shape} for batch size {batch_size}")
    rows: dict[object, list[int]] = {}
    for row, gid in enumerate(ids.tolist()):
        rows.setdefault(gid, []).append(row)
    return rows


def _scores(token_level_rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    require_same_shape(token_level_rewards=token_level_rewards, response_mask=response_mask)
    return masked_sum(token_level_rewards, response_mask, dim=-1)


@torch.no_grad()
def compute_gae(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized Advantage Estimation (Schulman et al. 2016).

    delta_t = r_t + gamma * V_{t+1} - V_t,  A_t = delta_t + gamma * lam * A_{t+1},
    with V and A after the last valid token taken as 0. returns = A + V (the critic's
    target) uses the raw A; the advantages handed to the actor are whitened over valid tokens.
    """
    require_same_shape(token_level_rewards=token_level_rewards, values=values, response_mask=response_mask)
    valid = response_mask.bool()
    batch, length = token_level_rewards.shape
    next_value = token_level_rewards.new_zeros(batch)
    next_adv = token_level_rewards.new_zeros(batch)
    raw_adv = torch.zeros_like(token_level_rewards)
    for t in reversed(range(length)):
        delta = token_level_rewards[:, t] + gamma * next_value - values[:, t]
        adv_t = delta + gamma * lam * next_adv
        # A masked step leaves the running (V_{t+1}, A_{t+1}) untouched: it is skipped.
        next_adv = torch.where(valid[:, t], adv_t, next_adv)
        next_value = torch.where(valid[:, t], values[:, t], next_value)
        raw_adv[:, t] = torch.where(valid[:, t], adv_t, torch.zeros_like(adv_t))
    returns = _zero_outside(raw_adv + values, response_mask)
    return masked_whiten(raw_adv, response_mask), returns


@torch.no_grad()
def compute_grpo(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence | np.ndarray,
    norm_adv_by_std: bool = True,
    epsilon: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO (Shao et al. 2024): (score - group mean) / (group std + eps), broadcast to every token.

    norm_adv_by_std=False gives Dr. GRPO (Liu et al. 2025), which drops the std division.
    The std is unbiased (n-1). A group of one has no peers: mean 0, std 1.
    """
    scores = _scores(token_level_rewards, response_mask)
    adv = torch.zeros_like(scores)
    for rows in _groups(index, scores.shape[0]).values():
        group = scores[rows]
        if len(rows) == 1:
            mean, std = group.new_zeros(()), group.new_ones(())
        else:
            mean, std = group.mean(), group.std()
        adv[rows] = (group - mean) / (std + epsilon) if norm_adv_by_std else group - mean
    adv = _zero_outside(adv.unsqueeze(-1).expand_as(token_level_rewards), response_mask)
    return adv, adv


@torch.no_grad()
def compute_rloo(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence | np.ndarray,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE Leave-One-Out (Kool et al. 2019; Ahmadian et al. 2024).

    A_i = s_i - mean_{j != i} s_j, which equals n/(n-1) * (s_i - mean_j s_j).
    A group of one has no one to leave out, so its baseline is 0.
    """
    scores = _scores(token_level_rewards, response_mask)
    adv = scores.clone()
    for rows in _groups(index, scores.shape[0]).values():
        n = len(rows)
        if n > 1:
            group = scores[rows]
            adv[rows] = (group - group.mean()) * n / (n - 1)
    adv = _zero_outside(adv.unsqueeze(-1).expand_as(token_level_rewards), response_mask)
    return adv, adv


def _discounted_returns(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = r_t + gamma * G_{t+1} over valid tokens; masked tokens are skipped."""
    valid = response_mask.bool()
    running = token_level_rewards.new_zeros(token_level_rewards.shape[0])
    returns = torch.zeros_like(token_level_rewards)
    for t in reversed(range(token_level_rewards.shape[1])):
        running = torch.where(valid[:, t], token_level_rewards[:, t] + gamma * running, running)
        returns[:, t] = torch.where(valid[:, t], running, torch.zeros_like(running))
    return returns


@torch.no_grad()
def compute_reinforce_plus_plus(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025): discounted returns-to-go, whitened over the batch's valid tokens."""
    require_same_shape(token_level_rewards=token_level_rewards, response_mask=response_mask)
    returns = _discounted_returns(token_level_rewards, response_mask, gamma)
    return masked_whiten(returns, response_mask), returns


@torch.no_grad()
def compute_reinforce_plus_plus_baseline(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence | np.ndarray,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline: score minus its group mean, broadcast to tokens, whitened over the batch.

    Unlike GRPO the scale comes from the whole batch, not from each group.
    """
    scores = _scores(token_level_rewards, response_mask)
    centered = scores.clone()
    for rows in _groups(index, scores.shape[0]).values():
        if len(rows) > 1:
            centered[rows] = scores[rows] - scores[rows].mean()
    tiled = _zero_outside(centered.unsqueeze(-1).expand_as(token_level_rewards), response_mask)
    adv = masked_whiten(tiled, response_mask)
    return adv, adv


@torch.no_grad()
def compute_remax(
    token_level_rewards: torch.Tensor,
    reward_baselines: torch.Tensor,
    response_mask: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax (Li et al. 2023): undiscounted returns-to-go minus the greedy response's reward.

    reward_baselines is (batch,): the score of the greedy (argmax) response to the same prompt.
    """
    require_same_shape(token_level_rewards=token_level_rewards, response_mask=response_mask)
    if tuple(reward_baselines.shape) != (token_level_rewards.shape[0],):
        raise ValueError(
            f"reward_baselines must be (batch,) = ({token_level_rewards.shape[0]},), "
            f"got {tuple(reward_baselines.shape)}"
        )
    returns = _discounted_returns(token_level_rewards, response_mask, gamma=1.0)
    adv = _zero_outside(returns - reward_baselines.unsqueeze(-1), response_mask)
    return adv, returns


ADV_ESTIMATORS: dict[str, AdvFn] = {
    "gae": compute_gae,
    "grpo": compute_grpo,
    "rloo": compute_rloo,
    "reinforce_plus_plus": compute_reinforce_plus_plus,
    "reinforce_plus_plus_baseline": compute_reinforce_plus_plus_baseline,
    "remax": compute_remax,
}


def _check_name(name: str) -> None:
    if name in ADV_ESTIMATORS:
        return
    close = difflib.get_close_matches(name, ADV_ESTIMATORS, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise ValueError(f"unknown adv_estimator {name!r}{hint} valid: {', '.join(ADV_ESTIMATORS)}")


def get_adv_estimator(name: str) -> AdvFn:
    _check_name(name)
    return ADV_ESTIMATORS[name]


def needs_critic(name: str) -> bool:
    """Only GAE bootstraps from a learned value function; the others use sampled baselines."""
    _check_name(name)
    return name == "gae"


def compute_advantage(
    name: str,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    values: torch.Tensor | None = None,
    index: Sequence | np.ndarray | None = None,
    reward_baselines: torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_adv_by_std_in_grpo: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One call for the trainer: picks the estimator by name and passes it the inputs it needs."""
    _check_name(name)
    needed = {
        "gae": "values",
        "grpo": "index",
        "rloo": "index",
        "reinforce_plus_plus_baseline": "index",
        "remax": "reward_baselines",
    }.get(name)
    given = {"values": values, "index": index, "reward_baselines": reward_baselines}
    if needed is not None and given[needed] is None:
        raise ValueError(f"adv_estimator {name!r} needs {needed}, got None")
    r, m = token_level_rewards, response_mask
    if name == "gae":
        return compute_gae(r, values, m, gamma=gamma, lam=lam)
    if name == "grpo":
        return compute_grpo(r, m, index, norm_adv_by_std=norm_adv_by_std_in_grpo)
    if name == "rloo":
        return compute_rloo(r, m, index)
    if name == "reinforce_plus_plus":
        return compute_reinforce_plus_plus(r, m, gamma=gamma)
    if name == "reinforce_plus_plus_baseline":
        return compute_reinforce_plus_plus_baseline(r, m, index)
    return compute_remax(r, reward_baselines, m)
