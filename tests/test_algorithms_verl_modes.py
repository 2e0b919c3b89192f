"""verl's loss-aggregation modes, straight-through KL types and call signatures, against hand-computed numbers.

Definitions mirrored: verl/trainer/ppo/core_algos.py (agg_loss, kl_penalty / kl_penalty_forward,
compute_value_loss, compute_policy_loss_vanilla). The arithmetic is in the comments; nothing here
calls the code under test to produce an expected value. Pure torch, no Ray.
"""

from __future__ import annotations

import math

import pytest
import torch

from hybridflow.algorithms import (
    LOSS_AGG_MODES,
    agg_loss,
    compute_policy_loss,
    compute_value_loss,
    entropy_loss,
    kl_penalty,
)
from megatron_workers.engine import agg_count, micro_agg_mode

NAN, INF = float("nan"), float("inf")


def T(rows, grad=False):
    return torch.tensor(rows, dtype=torch.float64, requires_grad=grad)


def close(actual, expected, atol=1e-12):
    expected = expected if torch.is_tensor(expected) else T(expected)
    torch.testing.assert_close(actual, expected, atol=atol, rtol=0)


# ---------------------------------------------------------------- agg_loss: 3 rows, the middle one fully masked

# row 0: valid 1, 2, 3      -> s = 6,  n = 3
# row 1: no valid token     (padding row / filtered sample; its garbage must not leak)
# row 2: valid 4, 8         -> s = 12, n = 2
# horizon T = 4; valid tokens N = 5; non-empty rows |E| = 2 (verl divides by 2, not 3)
LOSS = [[1.0, 2.0, 3.0, 50.0], [NAN, INF, 7.0, -9.0], [4.0, 8.0, INF, 0.0]]
MASK = [[1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 0, 0]]


@pytest.mark.parametrize(
    "mode, expected, grad_row0, grad_row2",
    [
        ("token-mean", 3.6, 1 / 5, 1 / 5),  # 18 / 5 tokens
        ("token-sum", 18.0, 1.0, 1.0),  # 6 + 12
        ("seq-mean-token-sum", 9.0, 1 / 2, 1 / 2),  # (6 + 12) / 2 non-empty rows
        ("seq-mean-token-mean", 4.0, 1 / 6, 1 / 4),  # (6/3 + 12/2) / 2
        ("seq-mean-token-sum-norm", 2.25, 1 / 8, 1 / 8),  # (6 + 12) / 2 / T=4
    ],
)
def test_agg_loss_with_a_fully_masked_row(mode, expected, grad_row0, grad_row2):
    loss = T(LOSS, grad=True)
    out = agg_loss(loss, T(MASK), mode)
    close(out, expected)
    out.backward()
    # d out / d token: the per-token weight of each mode; 0 (not NaN) on padding and the empty row
    close(loss.grad, [[grad_row0] * 3 + [0.0], [0.0] * 4, [grad_row2] * 2 + [0.0, 0.0]])


def test_seq_mean_token_sum_norm_takes_verl_loss_scale_factor():
    close(agg_loss(T(LOSS), T(MASK), "seq-mean-token-sum-norm", loss_scale_factor=8), 9.0 / 8)
    with pytest.raises(ValueError, match="loss_scale_factor must be > 0"):
        agg_loss(T(LOSS), T(MASK), "seq-mean-token-sum-norm", loss_scale_factor=0)
    with pytest.raises(TypeError):  # verl's 4th positional argument is dp_size: not silently a scale here
        agg_loss(T(LOSS), T(MASK), "seq-mean-token-sum-norm", 2)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_agg_loss_of_an_all_masked_batch_is_zero_not_nan(mode):
    # verl divides 0 by 0 here; a micro-batch of padding rows must not put NaN into the gradient
    loss = T([[NAN, 1.0], [2.0, INF]], grad=True)
    out = agg_loss(loss, T([[0, 0], [0, 0]]), mode)
    close(out, 0.0)
    out.backward()
    close(loss.grad, [[0.0, 0.0], [0.0, 0.0]])


def test_entropy_shares_agg_loss():
    close(entropy_loss(T(LOSS), T(MASK), "seq-mean-token-mean"), 4.0)
    close(entropy_loss(T(LOSS), T(MASK), "token-sum"), 18.0)


# ---------------------------------------------------------------- the modes in the policy and value losses

# ratio 1 (log_prob == old_log_prob): no clip acts and the per-token PPO loss is -A.
# row 0: A = 1, 2 -> -1, -2 (s = -3, n = 2); row 1: empty; row 2: A = -4 -> 4 (s = 4, n = 1); T = 2
ADV = [[1.0, 2.0], [50.0, 50.0], [-4.0, 99.0]]
PMASK = [[1, 1], [0, 0], [1, 0]]


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", 1 / 3),  # (-3 + 4) / 3 tokens
        ("token-sum", 1.0),  # -3 + 4
        ("seq-mean-token-sum", 0.5),  # (-3 + 4) / 2 rows
        ("seq-mean-token-mean", 1.25),  # (-1.5 + 4) / 2
        ("seq-mean-token-sum-norm", 0.25),  # 0.5 / T=2
    ],
)
def test_policy_loss_modes(mode, expected):
    zeros = torch.zeros(3, 2, dtype=torch.float64)
    out = compute_policy_loss(zeros, zeros, T(ADV), T(PMASK), loss_agg_mode=mode)
    close(out["pg_loss"], expected)
    close(out["pg_clipfrac"], 0.0)


# vpreds == values: the value clip keeps vpreds, so the per-token loss is (v - R)^2:
# row 0: (1-0)^2, (2-0)^2 = 1, 4 (s = 5, n = 2); row 1: empty; row 2: (3-1)^2 = 4 (s = 4, n = 1); T = 2
VPREDS = [[1.0, 2.0], [0.0, 0.0], [3.0, 9.0]]
RETURNS = [[0.0, 0.0], [5.0, 5.0], [1.0, 0.0]]


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", 1.5),  # 0.5 * 9 / 3
        ("token-sum", 4.5),  # 0.5 * 9
        ("seq-mean-token-sum", 2.25),  # 0.5 * (5 + 4) / 2
        ("seq-mean-token-mean", 1.625),  # 0.5 * (2.5 + 4) / 2
        ("seq-mean-token-sum-norm", 1.125),  # 2.25 / T=2
    ],
)
def test_value_loss_modes(mode, expected):
    vf_loss, clipfrac = compute_value_loss(vpreds=T(VPREDS), returns=T(RETURNS), values=T(VPREDS),
                                           response_mask=T(PMASK), cliprange_value=0.5, loss_agg_mode=mode)
    close(vf_loss, expected)
    close(clipfrac, 0.0)


# ---------------------------------------------------------------- keyword-only signatures


def test_value_loss_is_keyword_only_so_verl_positional_calls_cannot_swap_values_and_returns():
    # vpred 2, old value 0, return 1, clip 0.5: clip(2) = 0.5; max((2-1)^2, (0.5-1)^2) = 1 -> 0.5 * 1 = 0.5.
    # With values and returns swapped (value 1, return 0): clip(2) = 1.5; max(4, 2.25) -> 2.0. Different answer.
    v, old, ret, m = T([[2.0]]), T([[0.0]]), T([[1.0]]), T([[1]])
    vf_loss, _ = compute_value_loss(vpreds=v, returns=ret, values=old, response_mask=m, cliprange_value=0.5)
    close(vf_loss, 0.5)
    with pytest.raises(TypeError):
        compute_value_loss(v, ret, old, m, 0.5)  # verl's positional order (vpreds, returns, values, ...)
    with pytest.raises(TypeError):
        compute_value_loss(v, ret, old, m, cliprange_value=0.5)


def test_policy_loss_takes_the_four_tensors_positionally_and_nothing_else():
    zeros = torch.zeros(1, 2, dtype=torch.float64)
    adv, mask = T([[1.0, 1.0]]), T([[1, 1]])
    close(compute_policy_loss(zeros, zeros, adv, mask)["pg_loss"], -1.0)  # verl's tensor order works
    with pytest.raises(TypeError):
        compute_policy_loss(zeros, zeros, adv, mask, "token-mean")  # compute_policy_loss_vanilla's 5th argument
    with pytest.raises(TypeError):
        compute_policy_loss(zeros, zeros, adv, mask, 0.2, 0.1, 0.3)  # deprecated: cliprange, low, high


# ---------------------------------------------------------------- straight-through KL ("+" suffix)

# d = log_prob - ref: 0.5, -1, -25 (the last one hits k3's clamps)
LOGP = [[-1.0, -2.0, -25.0]]
REF = [[-1.5, -1.0, 0.0]]
D = [[0.5, -1.0, -25.0]]
# k3 = exp(-d) - 1 + d: e^-0.5 - 0.5 = 0.10653065971263342; e - 2 = 0.7182818284590451;
# d = -25: -d clamps to 20, e^20 - 21 clamps to 10
K3 = [[math.exp(-0.5) - 0.5, math.e - 2.0, 10.0]]
# d k3 / d log_prob = 1 - exp(-d) where no clamp acts: 1 - e^-0.5, 1 - e; 0 where clamped
K3_GRAD = [[1.0 - math.exp(-0.5), 1.0 - math.e, 0.0]]


def _value_and_grads(kind):
    logp, ref = T(LOGP, grad=True), T(REF, grad=True)
    value = kl_penalty(logp, ref, kind)
    value.sum().backward()
    return value.detach(), logp.grad, ref.grad


@pytest.mark.parametrize("kind", ["k3+", "low_var_kl+"])
def test_k3_plus_has_k3_value_and_k2_gradient(kind):
    value, g_logp, g_ref = _value_and_grads(kind)
    close(value, K3)
    # d(0.5 d^2)/d log_prob = d, d/d ref = -d: the clamps on k3 do not cut this gradient
    close(g_logp, D)
    close(g_ref, [[-x for x in D[0]]])


def test_plain_k3_keeps_its_own_gradient():
    value, g_logp, _ = _value_and_grads("k3")
    close(value, K3)
    close(g_logp, K3_GRAD, atol=1e-12)


@pytest.mark.parametrize(
    "kind, value",
    [
        ("k1+", D),
        ("kl+", D),
        ("abs+", [[0.5, 1.0, 25.0]]),
        ("k2+", [[0.125, 0.5, 312.5]]),  # 0.5 d^2
        ("mse+", [[0.125, 0.5, 312.5]]),
    ],
)
def test_every_plus_kind_is_its_value_with_the_k2_gradient(kind, value):
    v, g_logp, _ = _value_and_grads(kind)
    close(v, value)
    close(g_logp, D)


# ---------------------------------------------------------------- micro-batching in the Megatron engine


def _engine_combination(loss, mask, mode, micro_rows):
    """What MegatronEngine.train_step optimises: sum_i agg_i * count_i / total (* total for a sum mode)."""
    micro_mode, sum_loss = micro_agg_mode(mode)
    micros = [(loss[i : i + micro_rows], mask[i : i + micro_rows]) for i in range(0, len(loss), micro_rows)]
    counts = [agg_count({"response_mask": m}, mode) for _, m in micros]
    total = torch.stack(counts).sum().clamp(min=1.0)
    out = sum(agg_loss(lm, m, micro_mode) * (c / total) for (lm, m), c in zip(micros, counts))
    return out * total if sum_loss else out


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", 3.6),
        ("token-sum", 18.0),
        ("seq-mean-token-sum", 9.0),
        ("seq-mean-token-mean", 4.0),
        ("seq-mean-token-sum-norm", 2.25),
    ],
)
def test_engine_micro_batches_recombine_to_the_whole_batch_value(mode, expected):
    # micro-batches of one row: the empty row is a micro-batch of its own, with count 0
    close(_engine_combination(T(LOSS), T(MASK), mode, micro_rows=1), expected)
    close(_engine_combination(T(LOSS), T(MASK), mode, micro_rows=2), expected)


def test_agg_count_counts_non_empty_rows_for_seq_modes():
    micro = {"response_mask": T(MASK)}
    assert float(agg_count(micro, "seq-mean-token-mean")) == 2.0  # not 3: the empty row is left out, as verl
    assert float(agg_count(micro, "token-sum")) == 5.0
    assert micro_agg_mode("token-sum") == ("token-mean", True)
    assert micro_agg_mode("seq-mean-token-sum-norm") == ("seq-mean-token-sum-norm", False)


# ---------------------------------------------------------------- bad names fail in validate(), before Ray


@pytest.fixture(scope="module")
def tiny_policy(tmp_path_factory):
    from hybridflow.models.tiny import save_tiny_model

    root = tmp_path_factory.mktemp("verl_modes")
    data = root / "train.parquet"
    data.write_bytes(b"")  # validate only checks that it exists
    return save_tiny_model(root / "policy"), data


def _validate(tiny_policy, *overrides):
    from hybridflow.config.load import load_config
    from hybridflow.trainer.main import validate

    policy, data = tiny_policy
    cfg = load_config(None, [f"actor_rollout_ref.model.path={policy}", f"data.train_files=[{data}]", *overrides])
    validate(cfg)


@pytest.mark.bad_input
@pytest.mark.parametrize(
    "override, message",
    [
        ("actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum-nrom",
         r"unknown actor_rollout_ref\.actor\.loss_agg_mode='seq-mean-token-sum-nrom' \(did you mean "
         r"'seq-mean-token-sum-norm'\?\); valid: token-mean, token-sum, seq-mean-token-sum, seq-mean-token-mean, "
         r"seq-mean-token-sum-norm"),
        ("critic.loss_agg_mode=mean", r"unknown critic\.loss_agg_mode='mean'.*; valid: token-mean, token-sum"),
        ("actor_rollout_ref.actor.kl_loss_type=k4",
         r"unknown actor_rollout_ref\.actor\.kl_loss_type='k4'; valid: kl, k1, abs, mse, "
         r"k2, low_var_kl, k3, kl\+, k1\+, abs\+, mse\+, k2\+, low_var_kl\+, k3\+"),
        ("actor_rollout_ref.actor.kl_loss_type=full",
         r"actor_rollout_ref\.actor\.kl_loss_type='full': the exact \(full-vocabulary\) KL .* not supported"),
        ("actor_rollout_ref.actor.loss_scale_factor=0",
         r"actor_rollout_ref\.actor\.loss_scale_factor=0\.0 must be > 0"),
        ("critic.loss_scale_factor=-2", r"critic\.loss_scale_factor=-2\.0 must be > 0"),
        ("algorithm.kl_penalty=lowvar_kl",
         r"unknown algorithm\.kl_penalty='lowvar_kl' \(did you mean 'low_var_kl'\?\); valid: kl, k1"),
    ],
)
def test_unknown_loss_names_fail_in_validate(tiny_policy, override, message):
    with pytest.raises(ValueError, match=message):
        _validate(tiny_policy, override)


def test_verl_names_pass_validate(tiny_policy):
    _validate(tiny_policy, "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum-norm",
              "critic.loss_agg_mode=token-sum", "actor_rollout_ref.actor.kl_loss_type=k3+",
              "actor_rollout_ref.actor.loss_scale_factor=512",
              "algorithm.kl_penalty=low_var_kl+")
