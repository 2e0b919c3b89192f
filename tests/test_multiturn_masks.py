"""Multi-turn masks: tool tokens (response_mask 0 inside a response, attention_mask 1) take no part in the math.

Hand-made 2-turn trajectories, R = 8:
  TRAJ: model tokens 0-2, tool tokens 3-5 (mask 0), model tokens 6-7     mask [1 1 1 0 0 0 1 1]
  TAIL: model 0-1, tool 2-3, model 4-5, tool 6, right padding 7           mask [1 1 0 0 1 1 0 0]
        (ends on a tool token: the last attended token is not a model token)
Every expected number is written out by hand below (the derivation is in the comments), or computed with
scalar Python arithmetic on the model tokens alone; none comes from the function under test.
"""

from __future__ import annotations

import math

import pytest
import torch

from hybridflow.algorithms import (
    FixedKLController,
    agg_loss,
    apply_kl_penalty,
    compute_advantage,
    compute_gae,
    compute_grpo,
    compute_policy_loss,
    compute_remax,
    compute_rloo,
    compute_value_loss,
    entropy_loss,
    kl_penalty,
)
from hybridflow.protocol import DataProto
from hybridflow.rewards.manager import scores_to_token_level
from hybridflow.trainer import metrics as M

TRAJ = [1, 1, 1, 0, 0, 0, 1, 1]
TAIL = [1, 1, 0, 0, 1, 1, 0, 0]
TRAJ_MODEL = [0, 1, 2, 6, 7]
TRAJ_TOOL = [3, 4, 5]
TAIL_MODEL = [0, 1, 4, 5]
TAIL_TOOL = [2, 3, 6]


def _row(values: dict[int, float], fill: float = 0.0, length: int = 8) -> list[float]:
    return [values.get(t, fill) for t in range(length)]


def _t(*rows: list[float]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def _mask(*rows: list[int]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long)


def _whiten_by_hand(xs: list[float], eps: float = 1e-8) -> list[float]:
    n = len(xs)
    mean = sum(xs) / n
    var = sum((x - mean) ** 2 for x in xs) / (n - 1)
    return [(x - mean) / math.sqrt(var + eps) for x in xs]


def _at(x: torch.Tensor, row: int, cols: list[int]) -> list[float]:
    return [float(x[row, c]) for c in cols]


# ---------------------------------------------------------------- GAE

# gamma 0.9, lam 0.8 (gamma * lam = 0.72) on TRAJ. Rewards at model tokens: 0.1 at t1, 1.0 at t7 (the score).
# Values at model tokens: V0 .5, V1 .4, V2 .3, V6 .6, V7 .7. The hole is skipped, so t2's next step is t6:
#   t7: delta = 1.0 + 0          - 0.7 = 0.3     A7 = 0.3
#   t6: delta = 0   + 0.9 * 0.7  - 0.6 = 0.03    A6 = 0.03  + 0.72 * 0.3     = 0.246
#   t2: delta = 0   + 0.9 * 0.6  - 0.3 = 0.24    A2 = 0.24  + 0.72 * 0.246   = 0.41712
#   t1: delta = 0.1 + 0.9 * 0.3  - 0.4 = -0.03   A1 = -0.03 + 0.72 * 0.41712 = 0.2703264
#   t0: delta = 0   + 0.9 * 0.4  - 0.5 = -0.14   A0 = -0.14 + 0.72 * 0.2703264 = 0.054635008
# returns = A + V: 0.554635008, 0.6703264, 0.71712, 0.846, 1.0
GAE_RAW = {0: 0.054635008, 1: 0.2703264, 2: 0.41712, 6: 0.246, 7: 0.3}
GAE_RETURNS = {0: 0.554635008, 1: 0.6703264, 2: 0.71712, 6: 0.846, 7: 1.0}


def _gae_inputs(tool_value: float, tool_reward: float):
    rewards = _t(_row({1: 0.1, 7: 1.0} | {t: tool_reward for t in TRAJ_TOOL}))
    values = _t(_row({0: 0.5, 1: 0.4, 2: 0.3, 6: 0.6, 7: 0.7} | {t: tool_value for t in TRAJ_TOOL}))
    return rewards, values, _mask(TRAJ)


def test_gae_skips_the_tool_span_by_hand():
    rewards, values, mask = _gae_inputs(tool_value=0.0, tool_reward=0.0)
    adv, ret = compute_gae(rewards, values, mask, gamma=0.9, lam=0.8)
    assert _at(ret, 0, TRAJ_MODEL) == pytest.approx([GAE_RETURNS[t] for t in TRAJ_MODEL], abs=1e-6)
    expected_adv = _whiten_by_hand([GAE_RAW[t] for t in TRAJ_MODEL])  # whitened over the 5 model tokens
    assert _at(adv, 0, TRAJ_MODEL) == pytest.approx(expected_adv, abs=1e-5)
    assert _at(adv, 0, TRAJ_TOOL) == [0.0] * 3 and _at(ret, 0, TRAJ_TOOL) == [0.0] * 3


@pytest.mark.parametrize("tool_value,tool_reward", [(100.0, 0.0), (-3.0, 5.0), (1e6, -1e6), (float("nan"), 0.0)])
def test_gae_ignores_values_and_rewards_at_tool_positions(tool_value, tool_reward):
    clean = compute_gae(*_gae_inputs(0.0, 0.0), gamma=0.9, lam=0.8)
    wild = compute_gae(*_gae_inputs(tool_value, tool_reward), gamma=0.9, lam=0.8)
    for a, b in zip(clean, wild, strict=True):
        assert torch.equal(a, b)


def test_reinforce_returns_and_remax_skip_the_tool_span_by_hand():
    # G_t over model tokens only, gamma 0.9, rewards 0.1 at t1 and 1.0 at t7, junk 9.0 at tool t4:
    #   G7 = 1, G6 = 0.9, G2 = 0.81, G1 = 0.1 + 0.729 = 0.829, G0 = 0.9 * 0.829 = 0.7461
    rewards = _t(_row({1: 0.1, 4: 9.0, 7: 1.0}))
    _, ret = compute_advantage("reinforce_plus_plus", rewards, _mask(TRAJ), gamma=0.9)
    assert _at(ret, 0, TRAJ_MODEL) == pytest.approx([0.7461, 0.829, 0.81, 0.9, 1.0], abs=1e-6)
    assert _at(ret, 0, TRAJ_TOOL) == [0.0] * 3
    # ReMax: undiscounted G = 1.1, 1.1, 1.0, 1.0, 1.0 minus the greedy baseline 0.25
    adv, ret = compute_remax(rewards, torch.tensor([0.25]), _mask(TRAJ))
    assert _at(ret, 0, TRAJ_MODEL) == pytest.approx([1.1, 1.1, 1.0, 1.0, 1.0], abs=1e-6)
    assert _at(adv, 0, TRAJ_MODEL) == pytest.approx([0.85, 0.85, 0.75, 0.75, 0.75], abs=1e-6)
    assert _at(adv, 0, TRAJ_TOOL) == [0.0] * 3


# ---------------------------------------------------------------- GRPO / RLOO

def _group_rewards():
    # one prompt, 3 samples. Scores over model tokens: 1.0 (TRAJ), 0.0 (TAIL), 0.5 (TRAJ).
    # Junk rewards at tool positions (7.0, -4.0, 3.0) would change every score if they were summed.
    rewards = _t(_row({7: 1.0, 4: 7.0}), _row({5: 0.0, 2: -4.0}), _row({1: 0.25, 7: 0.25, 3: 3.0}))
    return rewards, _mask(TRAJ, TAIL, TRAJ), ["p", "p", "p"]


def test_grpo_scores_model_tokens_only_and_broadcasts_onto_them():
    rewards, mask, index = _group_rewards()
    adv, ret = compute_grpo(rewards, mask, index)
    # scores 1, 0, 0.5: mean 0.5, unbiased std sqrt((0.25 + 0.25 + 0) / 2) = 0.5; eps 1e-6
    per_row = [0.5 / (0.5 + 1e-6), -0.5 / (0.5 + 1e-6), 0.0]
    for row, (cols, tool) in enumerate([(TRAJ_MODEL, TRAJ_TOOL), (TAIL_MODEL, TAIL_TOOL + [7]),
                                        (TRAJ_MODEL, TRAJ_TOOL)]):
        assert _at(adv, row, cols) == pytest.approx([per_row[row]] * len(cols), abs=1e-7)
        assert _at(adv, row, tool) == [0.0] * len(tool)
    assert torch.equal(adv, ret)


def test_rloo_scores_model_tokens_only():
    rewards, mask, index = _group_rewards()
    adv, _ = compute_rloo(rewards, mask, index)
    # A_i = s_i - mean of the other two: 1 - 0.25 = 0.75, 0 - 0.75 = -0.75, 0.5 - 0.5 = 0
    assert _at(adv, 0, TRAJ_MODEL) == pytest.approx([0.75] * 5)
    assert _at(adv, 1, TAIL_MODEL) == pytest.approx([-0.75] * 4)
    assert _at(adv, 2, TRAJ_MODEL) == pytest.approx([0.0] * 5)
    assert _at(adv, 0, TRAJ_TOOL) == [0.0] * 3 and _at(adv, 1, TAIL_TOOL) == [0.0] * 3


# ---------------------------------------------------------------- reward placement

def test_score_sits_on_the_last_model_token():
    out = scores_to_token_level([2.0, -1.0], _mask(TRAJ, TAIL))
    # TRAJ: last model token 7 (mask.sum() - 1 = 4 would be a tool token); TAIL: 5, not the tool token 6
    assert out.tolist() == [_row({7: 2.0}), _row({5: -1.0})]


# ---------------------------------------------------------------- policy loss

# TRAJ's model tokens (clip 0.2 / 0.2, dual clip c = 3):
#   t0: old -1,   new -1    r = 1          A  0.5  loss -0.5
#   t1: old -1,   new -0.5  r = e^.5=1.649 A  1    max(-1.649, -1.2) = -1.2           (ratio clip)
#   t2: old -2,   new -2    r = 1          A -1    loss 1
#   t6: old -0.5, new -1    r = e^-.5=.607 A -1    max(0.607, 0.8) = 0.8             (ratio clip)
#   t7: old -1,   new 0.5   r = e^1.5=4.48 A -2    max(8.96, 2.4) = 8.96 > dual 6 -> 6 (dual clip)
# token-mean = (-0.5 - 1.2 + 1 + 0.8 + 6) / 5 = 1.22; clipfrac 2/5; clipfrac_lower 1/5;
# ppo_kl = mean(old - new) = (0 - 0.5 + 0 + 0.5 - 1.5) / 5 = -0.3
PG_OLD = {0: -1.0, 1: -1.0, 2: -2.0, 6: -0.5, 7: -1.0}
PG_NEW = {0: -1.0, 1: -0.5, 2: -2.0, 6: -1.0, 7: 0.5}
PG_ADV = {0: 0.5, 1: 1.0, 2: -1.0, 6: -1.0, 7: -2.0}


def _pg(tool: float, tool_adv: float):
    def at_tool(v):
        return {t: v for t in TRAJ_TOOL}
    old = _t(_row(PG_OLD | at_tool(tool)))
    new = _t(_row(PG_NEW | at_tool(-tool))).requires_grad_(True)
    adv = _t(_row(PG_ADV | at_tool(tool_adv)))
    return old, new, adv


def test_policy_loss_by_hand():
    old, new, adv = _pg(0.0, 0.0)
    out = {k: v.detach() for k, v in compute_policy_loss(old, new, adv, _mask(TRAJ)).items()}
    assert float(out["pg_loss"]) == pytest.approx(1.22, abs=1e-6)
    assert float(out["pg_clipfrac"]) == pytest.approx(0.4)
    assert float(out["pg_clipfrac_lower"]) == pytest.approx(0.2)
    assert float(out["ppo_kl"]) == pytest.approx(-0.3, abs=1e-6)


@pytest.mark.parametrize("tool,tool_adv", [(1e6, -1e6), (-1e6, 1e6), (30.0, 5.0)])
def test_policy_loss_and_gradient_ignore_tool_positions(tool, tool_adv):
    old, new, adv = _pg(0.0, 0.0)
    clean = compute_policy_loss(old, new, adv, _mask(TRAJ))
    clean["pg_loss"].backward()
    old_w, new_w, adv_w = _pg(tool, tool_adv)
    wild = compute_policy_loss(old_w, new_w, adv_w, _mask(TRAJ))
    wild["pg_loss"].backward()
    for k in clean:
        assert torch.equal(clean[k].detach(), wild[k].detach()), k
    assert torch.equal(new.grad, new_w.grad)
    assert _at(new_w.grad, 0, TRAJ_TOOL) == [0.0] * 3


def test_policy_loss_values_ignore_nan_at_tool_positions():
    # NaN at a tool position never reaches a loss value or a metric (positions are selected away, not
    # multiplied by 0). The pipeline never puts NaN there (advantages are 0, log-probs finite), so only the
    # forward values are checked: a NaN *advantage* at a masked position would still give a NaN gradient there.
    old, new, adv = _pg(0.0, 0.0)
    clean = compute_policy_loss(old, new, adv, _mask(TRAJ))
    old_n, new_n, _ = _pg(float("nan"), 0.0)
    wild = compute_policy_loss(old_n, new_n, adv, _mask(TRAJ))
    for k in clean:
        assert torch.equal(clean[k].detach(), wild[k].detach()), k


# ---------------------------------------------------------------- entropy / agg modes

# entropies at model tokens: TRAJ 0.1 0.2 0.3 0.4 0.5 (sum 1.5, n 5, mean 0.3); TAIL 1 2 3 4 (sum 10, n 4, mean 2.5)
#   token-mean              (1.5 + 10) / 9        = 11.5 / 9
#   token-sum               1.5 + 10              = 11.5
#   seq-mean-token-sum      (1.5 + 10) / 2        = 5.75
#   seq-mean-token-mean     (0.3 + 2.5) / 2       = 1.4
#   seq-mean-token-sum-norm 5.75 / 8 (horizon R)  = 0.71875
AGG_EXPECTED = {"token-mean": 11.5 / 9, "token-sum": 11.5, "seq-mean-token-sum": 5.75,
                "seq-mean-token-mean": 1.4, "seq-mean-token-sum-norm": 0.71875}


def _entropies(tool: float) -> torch.Tensor:
    traj = dict(zip(TRAJ_MODEL, [0.1, 0.2, 0.3, 0.4, 0.5], strict=True)) | {t: tool for t in TRAJ_TOOL}
    tail = dict(zip(TAIL_MODEL, [1.0, 2.0, 3.0, 4.0], strict=True)) | {t: tool for t in TAIL_TOOL + [7]}
    return _t(_row(traj), _row(tail))


@pytest.mark.parametrize("mode", sorted(AGG_EXPECTED))
@pytest.mark.parametrize("tool", [0.0, 1e6, -1e6, float("nan"), float("inf")])
def test_entropy_agg_modes_by_hand_whatever_sits_at_tool_positions(mode, tool):
    got = entropy_loss(_entropies(tool), _mask(TRAJ, TAIL), mode)
    assert float(got) == pytest.approx(AGG_EXPECTED[mode], rel=1e-6)


# ---------------------------------------------------------------- KL: in the reward and as a loss

# TRAJ, d = old - ref at model tokens: 0.1, -0.2, 0, 0.3, 0.5 (old 0 at tool positions as the rollout gives)
KL_D = dict(zip(TRAJ_MODEL, [0.1, -0.2, 0.0, 0.3, 0.5], strict=True))


def _kl_inputs(tool_old: float, tool_ref: float):
    old = _t(_row({t: -1.0 + d for t, d in KL_D.items()} | {t: tool_old for t in TRAJ_TOOL}))
    ref = _t(_row({t: -1.0 for t in TRAJ_MODEL} | {t: tool_ref for t in TRAJ_TOOL}))
    return old, ref


def _k3(d: float) -> float:
    return math.exp(-d) - 1.0 + d


@pytest.mark.parametrize("kind", ["kl", "low_var_kl"])
@pytest.mark.parametrize("tool_old,tool_ref", [(0.0, -1.0), (1e6, -1e6), (-1e6, 1e6), (float("nan"), 0.0)])
def test_kl_penalty_in_reward_by_hand(kind, tool_old, tool_ref):
    old, ref = _kl_inputs(tool_old, tool_ref)
    scores = _t(_row({7: 1.0}))
    rewards, metrics = apply_kl_penalty(scores, old, ref, _mask(TRAJ), FixedKLController(0.1), kind)
    est = {t: (d if kind == "kl" else _k3(d)) for t, d in KL_D.items()}
    expected = _row({t: (1.0 if t == 7 else 0.0) - 0.1 * k for t, k in est.items()})
    assert rewards[0].tolist() == pytest.approx(expected, abs=1e-6)
    # k1: (0.1 - 0.2 + 0 + 0.3 + 0.5) / 5 = 0.14
    mean_kl = 0.14 if kind == "kl" else sum(est.values()) / 5
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(mean_kl, abs=1e-6)


@pytest.mark.parametrize("kind", ["kl", "abs", "mse", "low_var_kl", "low_var_kl+"])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_kl_loss_by_hand_and_its_gradient_ignores_tool_positions(kind, mode):
    # The actor's KL loss: agg_loss(kl_penalty(log_prob, ref_log_prob, kind), response_mask, mode).
    per_token = {"kl": lambda d: d, "abs": abs, "mse": lambda d: 0.5 * d * d,
                 "low_var_kl": _k3, "low_var_kl+": _k3}[kind]
    ests = [per_token(d) for d in KL_D.values()]
    # one row: token-mean and seq-mean-token-mean are the mean over the 5 model tokens, seq-mean-token-sum the sum
    expected = sum(ests) if mode == "seq-mean-token-sum" else sum(ests) / 5

    grads = []
    for tool_old, tool_ref in [(0.0, -1.0), (1e6, -1e6), (-1e6, 1e6)]:
        lp, ref = _kl_inputs(tool_old, tool_ref)
        lp.requires_grad_(True)
        loss = agg_loss(kl_penalty(lp, ref, kind), _mask(TRAJ), mode)
        assert loss.item() == pytest.approx(expected, abs=1e-6)
        loss.backward()
        assert _at(lp.grad, 0, TRAJ_TOOL) == [0.0] * 3
        grads.append(lp.grad)
    assert all(torch.equal(grads[0], g) for g in grads[1:])


def test_kl_loss_value_ignores_nan_at_tool_positions():
    lp, ref = _kl_inputs(float("nan"), float("nan"))
    for kind in ("kl", "mse", "low_var_kl", "low_var_kl+"):
        loss = agg_loss(kl_penalty(lp, ref, kind), _mask(TRAJ), "token-mean")
        assert math.isfinite(float(loss)), kind


# ---------------------------------------------------------------- value loss

# cliprange 0.5, TRAJ's model tokens (vpred, old value, return) -> max(unclipped, clipped) squared error:
#   t0 (1.0, 0.8, 1.2): clip(1.0) = 1.0          -> 0.04
#   t1 (2.0, 1.0, 0.0): clip = 1.5, 4 vs 2.25    -> 4
#   t2 (0.0, 1.0, 2.0): clip = 0.5, 4 vs 2.25    -> 4
#   t6 (1.0, 0.0, 2.0): clip = 0.5, 1 vs 2.25    -> 2.25   (clipped chosen)
#   t7 (0.5, 0.5, 0.5):                          -> 0
# vf_loss = 0.5 * (0.04 + 4 + 4 + 2.25 + 0) / 5 = 1.029; vf_clipfrac = 1/5
def _value_inputs(tool: float):
    at_tool = {t: tool for t in TRAJ_TOOL}
    vpreds = _t(_row({0: 1.0, 1: 2.0, 2: 0.0, 6: 1.0, 7: 0.5} | at_tool))
    values = _t(_row({0: 0.8, 1: 1.0, 2: 1.0, 6: 0.0, 7: 0.5} | {t: -tool for t in TRAJ_TOOL}))
    returns = _t(_row({0: 1.2, 1: 0.0, 2: 2.0, 6: 2.0, 7: 0.5} | at_tool))
    return vpreds.requires_grad_(True), values, returns


@pytest.mark.parametrize("tool", [0.0, 1e6, -1e6])
def test_value_loss_by_hand_ignores_tool_positions(tool):
    vpreds, values, returns = _value_inputs(tool)
    vf_loss, clipfrac = compute_value_loss(vpreds=vpreds, returns=returns, values=values,
                                           response_mask=_mask(TRAJ), cliprange_value=0.5)
    assert vf_loss.item() == pytest.approx(1.029, abs=1e-6)
    assert float(clipfrac) == pytest.approx(0.2)
    vf_loss.backward()
    assert _at(vpreds.grad, 0, TRAJ_TOOL) == [0.0] * 3


# ---------------------------------------------------------------- step metrics

def _finished_two_turn_batch():
    # prompt width 2 (both real); TRAJ attends all 8 response tokens, TAIL 7 (position 7 is padding)
    response_mask = _mask(TRAJ, TAIL)
    attention = torch.cat([torch.ones(2, 2, dtype=torch.long), _mask([1] * 8, [1] * 7 + [0])], dim=1)
    junk = 1e6
    adv = _t(_row({t: 1.0 for t in TRAJ_MODEL} | {t: junk for t in TRAJ_TOOL}),
             _row({t: -1.0 for t in TAIL_MODEL} | {t: junk for t in TAIL_TOOL}))
    old = _t(_row({t: -1.0 for t in TRAJ_MODEL}), _row({t: -2.0 for t in TAIL_MODEL}))
    rollout = _t(_row({0: -1.5} | {t: -1.0 for t in TRAJ_MODEL[1:]}), _row({t: -2.0 for t in TAIL_MODEL}))
    rollout[0, TRAJ_TOOL] = junk  # any value at tool positions (the rollout gives 0 there)
    rollout[1, TAIL_TOOL] = junk
    b = {"response_mask": response_mask, "attention_mask": attention,
         "token_level_scores": _t(_row({7: 1.0}), _row({5: 0.0})),
         "token_level_rewards": _t(_row({7: 1.0}), _row({5: 0.0})),
         "advantages": adv, "returns": adv}
    b |= {"old_log_probs": old, "rollout_log_probs": rollout}
    return DataProto.from_dict(b)


def test_step_metrics_on_a_two_turn_batch():
    batch = _finished_two_turn_batch()
    m = M.data_metrics(batch, use_critic=False)
    # response_length: attended response tokens (tool tokens included), 8 and 7; TRAJ fills the budget
    assert m["response_length/mean"] == 7.5 and m["response_length/max"] == 8.0
    assert m["response_length/clip_ratio"] == 0.5
    # model tokens only: 5 and 4
    assert m["response_length/model_tokens_mean"] == 4.5
    assert m["response_length/model_tokens_max"] == 5.0 and m["response_length/model_tokens_min"] == 4.0
    # advantages over the 9 model tokens: five 1s and four -1s (the junk at tool positions is not read)
    assert m["critic/advantages/mean"] == pytest.approx(1 / 9) and m["critic/advantages/max"] == 1.0
    # |rollout - old| over model tokens: 0.5 once, 0 elsewhere
    assert m["rollout/logprob_diff_mean"] == pytest.approx(0.5 / 9) and m["rollout/logprob_diff_max"] == 0.5
    # throughput counts every attended token: prompts 2 + 2, responses 8 + 7
    assert M.token_counts(batch) == (4, 15)
