"""hybridflow.algorithms against numbers worked out by hand (the arithmetic is in the comments).

Nothing here calls the code under test to produce an expected value.
"""

import math

import numpy as np
import pytest
import torch

from hybridflow.algorithms import (
    AdaptiveKLController,
    FixedKLController,
    agg_loss,
    apply_kl_penalty,
    compute_advantage,
    compute_gae,
    compute_grpo,
    compute_policy_loss,
    compute_reinforce_plus_plus,
    compute_reinforce_plus_plus_baseline,
    compute_remax,
    compute_rloo,
    compute_value_loss,
    entropy_loss,
    get_adv_estimator,
    kl_penalty,
    make_kl_controller,
    masked_mean,
    masked_var,
    masked_whiten,
    needs_critic,
)
from hybridflow.config.schema import KLCtrlConfig


def T(rows):
    return torch.tensor(rows, dtype=torch.float64)


def close(actual, expected, atol=1e-7):
    torch.testing.assert_close(actual, T(expected) if not torch.is_tensor(expected) else expected, atol=atol, rtol=0)


# ---------------------------------------------------------------- masked reductions


def test_masked_mean_var_whiten():
    x = T([[1.0, 2.0, 100.0], [3.0, float("nan"), float("inf")]])
    mask = T([[1, 1, 0], [1, 0, 0]])
    # valid: 1, 2, 3 -> mean 2; unbiased var ((1)^2 + 0 + 1^2) / 2 = 1
    close(masked_mean(x, mask), 2.0)
    close(masked_mean(x, mask, dim=-1), [1.5, 3.0])
    close(masked_var(x, mask), 1.0)
    close(masked_whiten(x, mask), [[-1.0, 0.0, 0.0], [1.0, 0.0, 0.0]], atol=1e-6)
    # shift_mean=False keeps the mean: (x - 2) / 1 + 2 = x on valid tokens
    close(masked_whiten(x, mask, shift_mean=False), [[1.0, 2.0, 0.0], [3.0, 0.0, 0.0]], atol=1e-6)


def test_masked_mean_of_empty_row_is_zero_and_var_needs_two():
    close(masked_mean(T([[5.0, 6.0]]), T([[0, 0]]), dim=-1), [0.0])
    with pytest.raises(ValueError, match="at least 2 valid positions, the mask has 1"):
        masked_var(T([[5.0, 6.0]]), T([[1, 0]]))


# ---------------------------------------------------------------- loss aggregation

LOSS = T([[1.0, 2.0, 3.0], [4.0, 100.0, float("nan")]])
LOSS_MASK = T([[1, 1, 1], [1, 0, 0]])


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", 2.5),  # (1 + 2 + 3 + 4) / 4 tokens
        ("seq-mean-token-sum", 5.0),  # (6 + 4) / 2 sequences
        ("seq-mean-token-mean", 3.0),  # (6/3 + 4/1) / 2 sequences
    ],
)
def test_agg_loss_modes(mode, expected):
    close(agg_loss(LOSS, LOSS_MASK, mode), expected)


def test_entropy_loss_uses_agg_mode():
    close(entropy_loss(LOSS, LOSS_MASK, "seq-mean-token-mean"), 3.0)


# ---------------------------------------------------------------- GAE


def test_gae_one_sequence_by_hand():
    # gamma = lam = 0.5, r = [0, 0, 1], V = [0.5, 0.5, 0.5], V after the end = 0
    # t=2: delta = 1 + 0 - 0.5 = 0.5                  A2 = 0.5
    # t=1: delta = 0 + 0.5*0.5 - 0.5 = -0.25          A1 = -0.25 + 0.25*0.5 = -0.125
    # t=0: delta = -0.25                              A0 = -0.25 + 0.25*(-0.125) = -0.28125
    # returns = A + V = [0.21875, 0.375, 1.0]
    # whiten: mean = 0.09375/3 = 0.03125; deviations [-0.3125, -0.15625, 0.46875]
    #   squares 0.09765625 + 0.0244140625 + 0.2197265625 = 0.341796875; unbiased var = 0.1708984375
    adv, ret = compute_gae(T([[0.0, 0.0, 1.0]]), T([[0.5, 0.5, 0.5]]), T([[1, 1, 1]]), gamma=0.5, lam=0.5)
    close(ret, [[0.21875, 0.375, 1.0]])
    close(adv, T([[-0.3125, -0.15625, 0.46875]]) / math.sqrt(0.1708984375 + 1e-8))


def test_gae_lam_one_gamma_one_is_return_minus_value():
    # gamma = lam = 1: A_t = sum_{k>=t} r_k - V_t; r = [1, 2], V = [0.5, 3] -> A = [2.5, -1], returns = [3, 2]
    _, ret = compute_gae(T([[1.0, 2.0]]), T([[0.5, 3.0]]), T([[1, 1]]), gamma=1.0, lam=1.0)
    close(ret, [[3.0, 2.0]])


def test_gae_padding_and_holes_do_not_leak():
    # Row 0: right padding with garbage reward/value; row 1: a masked hole in the middle.
    # Both reduce to the 2-token sequence r = [0, 1], V = [0.5, 0.5], gamma = lam = 0.5:
    #   t=last: delta = 1 - 0.5 = 0.5 -> A = 0.5;  t=first: delta = 0.25 - 0.5 = -0.25 -> A = -0.25 + 0.25*0.5 = -0.125
    #   returns = [0.375, 1.0]
    rewards = T([[0.0, 1.0, 7.0], [0.0, 5.0, 1.0]])
    values = T([[0.5, 0.5, 99.0], [0.5, -42.0, 0.5]])
    mask = T([[1, 1, 0], [1, 0, 1]])
    adv, ret = compute_gae(rewards, values, mask, gamma=0.5, lam=0.5)
    close(ret, [[0.375, 1.0, 0.0], [0.375, 0.0, 1.0]])
    # whitening over the 4 valid raw advantages [-0.125, 0.5, -0.125, 0.5]: mean 0.1875,
    # deviations -+0.3125, unbiased var = 4 * 0.09765625 / 3 = 0.130208333...
    s = math.sqrt(4 * 0.09765625 / 3 + 1e-8)
    close(adv, [[-0.3125 / s, 0.3125 / s, 0.0], [-0.3125 / s, 0.0, 0.3125 / s]])


# ---------------------------------------------------------------- GRPO / RLOO / REINFORCE++ / ReMax

# Scores (sum of valid token rewards): row0 = 1 (split 0.5 + 0.5), row1 = 0, row2 = 3, row3 = 1, row4 = 2,
# row5 = 5 (the 9 is in padding). Groups: a = rows 0,1; b = rows 2,3,4; c = row 5 alone.
SEQ_REWARDS = T([[0.5, 0.5], [0.0, 0.0], [0.0, 3.0], [1.0, 0.0], [0.0, 2.0], [5.0, 9.0]])
SEQ_MASK = T([[1, 1], [1, 1], [1, 1], [1, 1], [1, 1], [1, 0]])
SEQ_INDEX = np.array(["a", "a", "b", "b", "b", "c"], dtype=object)


def _broadcast(per_row):
    return T(per_row).unsqueeze(-1) * SEQ_MASK


def test_grpo_with_std():
    # a: mean 0.5, unbiased std sqrt((0.25 + 0.25) / 1) = 0.70710678; b: mean 2, std sqrt((1 + 1 + 0) / 2) = 1
    # c: singleton -> mean 0, std 1
    eps = 1e-6
    sa = math.sqrt(0.5)
    expected = _broadcast([0.5 / (sa + eps), -0.5 / (sa + eps), 1 / (1 + eps), -1 / (1 + eps), 0.0, 5 / (1 + eps)])
    adv, ret = compute_grpo(SEQ_REWARDS, SEQ_MASK, SEQ_INDEX)
    close(adv, expected)
    close(ret, expected)


def test_grpo_without_std_is_dr_grpo():
    adv, _ = compute_grpo(SEQ_REWARDS, SEQ_MASK, SEQ_INDEX, norm_adv_by_std=False)
    close(adv, _broadcast([0.5, -0.5, 1.0, -1.0, 0.0, 5.0]))


def test_rloo_leave_one_out():
    # a: 1 - 0 = 1, 0 - 1 = -1; b: 3 - (1+2)/2 = 1.5, 1 - (3+2)/2 = -1.5, 2 - (3+1)/2 = 0; c: no baseline -> 5
    adv, _ = compute_rloo(SEQ_REWARDS, SEQ_MASK, SEQ_INDEX)
    close(adv, _broadcast([1.0, -1.0, 1.5, -1.5, 0.0, 5.0]))


def test_grpo_rejects_wrong_index_length():
    with pytest.raises(ValueError, match=r"one group id per row: got shape \(2,\) for batch size 6"):
        compute_grpo(SEQ_REWARDS, SEQ_MASK, np.array([0, 1]))


def test_reinforce_plus_plus_discounting():
    # gamma 0.5. Row 0: r = [1, 0, 2] -> G = [1 + 0.5*1, 0 + 0.5*2, 2] = [1.5, 1, 2]
    # Row 1: r = [0, 1, (9 pad)] -> G = [0.5, 1, 0]
    # whiten over [1.5, 1, 2, 0.5, 1]: mean 1.2, devs [.3, -.2, .8, -.7, -.2], sum sq 1.3, var 1.3/4 = 0.325
    adv, ret = compute_reinforce_plus_plus(T([[1.0, 0.0, 2.0], [0.0, 1.0, 9.0]]), T([[1, 1, 1], [1, 1, 0]]), gamma=0.5)
    close(ret, [[1.5, 1.0, 2.0], [0.5, 1.0, 0.0]])
    s = math.sqrt(0.325 + 1e-8)
    close(adv, [[0.3 / s, -0.2 / s, 0.8 / s], [-0.7 / s, -0.2 / s, 0.0]])


def test_reinforce_plus_plus_baseline():
    # scores 1, 3 (group a, mean 2) -> -1, +1; score 2 alone in b -> 2 (no baseline)
    # tiled over masks [1,1,1], [1,1,0], [1,0,0]: valid values -1,-1,-1, 1,1, 2 -> mean 1/6
    # devs -7/6 x3, 5/6 x2, 11/6; sum sq (147 + 50 + 121)/36 = 318/36; var = 318/36/5
    rewards = T([[0.0, 0.0, 1.0], [0.0, 3.0, 0.0], [2.0, 0.0, 0.0]])
    mask = T([[1, 1, 1], [1, 1, 0], [1, 0, 0]])
    adv, _ = compute_reinforce_plus_plus_baseline(rewards, mask, np.array([0, 0, 1]))
    s = math.sqrt(318 / 36 / 5 + 1e-8)
    a, b, c = -7 / 6 / s, 5 / 6 / s, 11 / 6 / s
    close(adv, [[a, a, a], [b, b, 0.0], [c, 0.0, 0.0]])


def test_remax_returns_minus_greedy_baseline():
    # returns-to-go: row0 [0+1+2, 1+2, 2] = [3, 3, 2]; row1 [3, 0, pad]; baselines 1 and 2
    rewards = T([[0.0, 1.0, 2.0], [3.0, 0.0, 8.0]])
    mask = T([[1, 1, 1], [1, 1, 0]])
    adv, ret = compute_remax(rewards, T([1.0, 2.0]), mask)
    close(ret, [[3.0, 3.0, 2.0], [3.0, 0.0, 0.0]])
    close(adv, [[2.0, 2.0, 1.0], [1.0, -2.0, 0.0]])


def test_compute_advantage_dispatch_and_missing_input():
    adv, _ = compute_advantage("rloo", SEQ_REWARDS, SEQ_MASK, index=SEQ_INDEX)
    close(adv, _broadcast([1.0, -1.0, 1.5, -1.5, 0.0, 5.0]))
    with pytest.raises(ValueError, match="'gae' needs values"):
        compute_advantage("gae", SEQ_REWARDS, SEQ_MASK)


def test_registry_and_needs_critic():
    assert get_adv_estimator("grpo") is compute_grpo
    assert get_adv_estimator("remax") is compute_remax
    assert needs_critic("gae")
    assert not any(needs_critic(n) for n in ["grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"])


# ---------------------------------------------------------------- policy loss


def _policy(ratio, adv, **kw):
    ratio, adv = T([ratio]), T([adv])
    return compute_policy_loss(torch.zeros_like(ratio), ratio.log(), adv, torch.ones_like(ratio), **kw)


@pytest.mark.parametrize(
    "ratio, adv, loss, clipfrac, lower",
    [
        (1.1, 1.0, -1.1, 0.0, 0.0),  # inside the trust region: -A*r
        (1.5, 1.0, -1.2, 1.0, 0.0),  # r > 1+0.2 with A > 0: max(-1.5, -1.2) = -1.2 (clipped)
        (0.5, 1.0, -0.5, 0.0, 0.0),  # r < 1-0.2 with A > 0: max(-0.5, -0.8) = -0.5 (pessimistic side, not clipped)
        (0.5, -1.0, 0.8, 1.0, 0.0),  # r < 1-0.2 with A < 0: max(0.5, 0.8) = 0.8 (clipped); 0.8 < c*1 = 3
        (4.0, -1.0, 3.0, 0.0, 1.0),  # A < 0, r > c = 3: max(4, 1.2) = 4, dual clip min(4, 3) = 3
        (4.0, 1.0, -1.2, 1.0, 0.0),  # A > 0, r > c: dual clip does not apply
    ],
)
def test_policy_loss_clip_branches(ratio, adv, loss, clipfrac, lower):
    out = _policy([ratio], [adv])
    close(out["pg_loss"], loss)
    close(out["pg_clipfrac"], clipfrac)
    close(out["pg_clipfrac_lower"], lower)
    close(out["ppo_kl"], -math.log(ratio))


def test_policy_loss_batch_asymmetric_clip_and_gradient():
    # ratios [1.5, 0.5, 4, 1.1, 0.5], A [1, -1, -1, 1, 1], eps_low 0.2, eps_high 0.28, c 3, plus a padded column
    # per token: -1.28 (upper clip at 1.28), 0.8, 3.0 (dual), -1.1, -0.5 -> mean 0.92 / 5 = 0.184
    # clipfrac 2/5, lower 1/5; ppo_kl = -ln(1.5*0.5*4*1.1*0.5)/5 = -ln(1.65)/5
    ratio = T([[1.5, 0.5, 4.0, 1.1, 0.5, 1e6]])
    adv = T([[1.0, -1.0, -1.0, 1.0, 1.0, 50.0]])
    mask = T([[1, 1, 1, 1, 1, 0]])
    log_prob = ratio.log().requires_grad_(True)
    out = compute_policy_loss(torch.zeros_like(ratio), log_prob, adv, mask, clip_ratio_high=0.28)
    close(out["pg_loss"], 0.184)
    close(out["pg_clipfrac"], 0.4)
    close(out["pg_clipfrac_lower"], 0.2)
    close(out["ppo_kl"], -math.log(1.65) / 5)
    out["pg_loss"].backward()
    # d(-A r)/d log r = -A r on unclipped tokens, / 5 tokens; clipped, dual-clipped and padded tokens: 0
    close(log_prob.grad, [[0.0, 0.0, 0.0, -1.1 / 5, -0.5 / 5, 0.0]])


def test_policy_loss_seq_mean_token_sum():
    # row0 tokens: -1.1, -1.2 -> sum -2.3; row1: 0.8 -> mean over sequences (-2.3 + 0.8) / 2 = -0.75
    ratio, adv, mask = T([[1.1, 1.5], [0.5, 1.0]]), T([[1.0, 1.0], [-1.0, 7.0]]), T([[1, 1], [1, 0]])
    out = compute_policy_loss(torch.zeros_like(ratio), ratio.log(), adv, mask, loss_agg_mode="seq-mean-token-sum")
    close(out["pg_loss"], -0.75)


def test_policy_loss_rejects_clip_ratio_c_not_above_one():
    with pytest.raises(ValueError, match="clip_ratio_c must be > 1.*got 1.0"):
        _policy([1.0], [1.0], clip_ratio_c=1.0)


# ---------------------------------------------------------------- value loss


def test_value_loss_clipping():
    # cliprange 0.5; per token (V_old, v_pred, R):
    #   (0, 1, 1):   clip -> 0.5;  (1-1)^2 = 0,    (0.5-1)^2 = 0.25 -> 0.25, clipped
    #   (0, 0.2, 1): clip -> 0.2;  0.64 both                        -> 0.64
    #   (0, 2, 0):   clip -> 0.5;  4 vs 0.25                        -> 4
    #   (1, -1, -1): clip -> 0.5;  0 vs 2.25                        -> 2.25, clipped
    # vf_loss = 0.5 * (0.25 + 0.64 + 4 + 2.25) / 4 = 0.8925; clipfrac 2/4
    values = T([[0.0, 0.0, 0.0, 1.0, 0.0]])
    vpreds = T([[1.0, 0.2, 2.0, -1.0, 30.0]])
    returns = T([[1.0, 1.0, 0.0, -1.0, -30.0]])
    mask = T([[1, 1, 1, 1, 0]])
    vf_loss, clipfrac = compute_value_loss(vpreds=vpreds, returns=returns, values=values, response_mask=mask,
                                           cliprange_value=0.5)
    close(vf_loss, 0.8925)
    close(clipfrac, 0.5)


# ---------------------------------------------------------------- KL


# log_prob vs ref: d = -1 - (-1.5) = 0.5, d = -2 - (-1) = -1, d = -20 - 0 = -20
KL_LOGP = T([[-1.0, -2.0, -20.0]])
KL_REF = T([[-1.5, -1.0, 0.0]])


@pytest.mark.parametrize(
    "kinds, expected",
    [
        (["kl", "k1"], [0.5, -1.0, -20.0]),
        (["abs"], [0.5, 1.0, 20.0]),
        (["mse", "k2"], [0.125, 0.5, 200.0]),  # 0.5 * d^2
        # exp(-d) - 1 + d: e^-0.5 - 0.5 = 0.6065306597126334 - 0.5; e^1 - 2 = 0.718281828459045; e^20 - 21 -> clamp 10
        (["low_var_kl", "k3"], [0.1065306597126334, 0.718281828459045, 10.0]),
    ],
)
def test_kl_estimators(kinds, expected):
    for kind in kinds:
        close(kl_penalty(KL_LOGP, KL_REF, kind), [expected])


def test_adaptive_kl_controller_by_hand():
    ctl = AdaptiveKLController(init_kl_coef=0.1, target_kl=6.0, horizon=10000)
    ctl.update(current_kl=9.0, n_steps=1000)  # e = 9/6 - 1 = 0.5 -> clip 0.2; beta = 0.1 * (1 + 0.2*0.1) = 0.102
    assert ctl.value == pytest.approx(0.102, abs=1e-12)
    ctl.update(current_kl=5.4, n_steps=500)  # e = 0.9 - 1 = -0.1; beta = 0.102 * (1 - 0.1*0.05) = 0.10149
    assert ctl.value == pytest.approx(0.10149, abs=1e-12)
    ctl.update(current_kl=0.0, n_steps=10000)  # e = -1 -> clip -0.2; beta = 0.10149 * 0.8 = 0.081192
    assert ctl.value == pytest.approx(0.081192, abs=1e-12)


def test_fixed_kl_controller_and_factory():
    fixed = make_kl_controller(KLCtrlConfig(type="fixed", kl_coef=0.3))
    fixed.update(current_kl=100.0, n_steps=1000)
    assert isinstance(fixed, FixedKLController) and fixed.value == 0.3
    adaptive = make_kl_controller(KLCtrlConfig(type="adaptive", kl_coef=0.1, target_kl=6.0, horizon=10000))
    assert isinstance(adaptive, AdaptiveKLController)
    assert (adaptive.value, adaptive.target, adaptive.horizon) == (0.1, 6.0, 10000)


def test_apply_kl_penalty_by_hand():
    # k1 per token: row0 [0.1, 0.2, 0.3], row1 [0.4, 0.2, pad]; beta 0.5
    # rewards = scores - 0.5*kl: row0 [-0.05, -0.1, 1 - 0.15], row1 [-0.2, 2 - 0.1, 0]
    # KL metric = mean(row0 mean 0.2, row1 mean 0.3) = 0.25
    scores = T([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    ref = T([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    old = T([[0.1, 0.2, 0.3], [0.4, 0.2, 5.0]])
    mask = T([[1, 1, 1], [1, 1, 0]])
    ctl = AdaptiveKLController(init_kl_coef=0.5, target_kl=0.2, horizon=100)
    rewards, metrics = apply_kl_penalty(scores, old, ref, mask, ctl, kind="kl")
    close(rewards, [[-0.05, -0.1, 0.85], [-0.2, 1.9, 0.0]])
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(0.25, abs=1e-12)
    assert metrics["actor/reward_kl_penalty_coeff"] == 0.5  # the beta applied, before the update
    # update with n_steps = batch 2: e = 0.25/0.2 - 1 = 0.25 -> clip 0.2; beta = 0.5 * (1 + 0.2*2/100) = 0.502
    assert ctl.value == pytest.approx(0.502, abs=1e-12)


# ---------------------------------------------------------------- bad names and shapes


def test_invalid_names_list_the_valid_choices():
    with pytest.raises(ValueError, match=r"'grop'; did you mean 'grpo'\? valid: gae, grpo, rloo, reinforce_plus_plus"):
        get_adv_estimator("grop")
    with pytest.raises(ValueError, match="valid: gae, grpo"):
        needs_critic("ppo")
    with pytest.raises(ValueError, match="loss_agg_mode='token_mean' \\(did you mean 'token-mean'\\?\\); valid: "
                                         "token-mean, token-sum, seq-mean-token-sum, seq-mean-token-mean, "
                                         "seq-mean-token-sum-norm"):
        agg_loss(LOSS, LOSS_MASK, "token_mean")
    with pytest.raises(ValueError, match="'full'.*not supported.*valid: kl, k1, abs, mse, k2, low_var_kl, k3, kl\\+"):
        kl_penalty(KL_LOGP, KL_REF, "full")
    with pytest.raises(ValueError, match="'pid'; valid: fixed, adaptive"):
        make_kl_controller(KLCtrlConfig(type="pid"))


def test_shape_mismatch_names_arguments():
    with pytest.raises(ValueError, match=r"values=\(1, 2\)"):
        compute_gae(T([[1.0, 2.0, 3.0]]), T([[1.0, 2.0]]), T([[1, 1, 1]]), gamma=1.0, lam=1.0)
