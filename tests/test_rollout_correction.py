"""Rollout correction (verl's algorithm.rollout_correction): hand-computed references on a 2 x 4 batch.

Every expected number below is written out by hand from the formulas in
hybridflow/algorithms/rollout_correction.py (products and logs of round numbers), never by calling the code
under test. The batch: row 0 has an interior hole (a tool token, response_mask 0) at position 1, row 1 two
padding positions. Masked positions hold wild values (old log-prob 5, advantage 9) that must change nothing.

Per valid token (row 0: positions 0, 2, 3; row 1: positions 0, 1):
  pi_old / pi_rollout   = 1.5, 3, 0.5 | 0.8, 2.5     (the hole: exp(5 - 0), which must not count)
  pi_theta / pi_old     = 1.1, 1.5, 0.7 | 0.9, 1.0
  advantage             = 1, -2, 1    | -1, 2
PPO per token (clip 0.2, dual clip 3): max(-A r, -A clip(r, 0.8, 1.2)), and for A < 0 min(that, -3 A):
  -1.1, 3.0, -0.7 | 0.9, -2.0        (sum 0.1)
"""

from __future__ import annotations

import math

import pytest
import torch

from hybridflow.algorithms import compute_policy_loss
from hybridflow.algorithms.rollout_correction import (
    apply_rollout_correction,
    rollout_corr_metrics,
    rollout_is_weights,
)
from hybridflow.config.schema import RolloutCorrectionConfig
from hybridflow.protocol import DataProto

L = math.log
MASK = torch.tensor([[1, 0, 1, 1], [1, 1, 0, 0]], dtype=torch.float32)
BEHAV = torch.tensor([[-1.0, 0.0, -2.0, -0.5], [-1.5, -3.0, 0.0, 0.0]])  # 0 at masked positions, as the engine
OLD = BEHAV + torch.tensor([[L(1.5), 5.0, L(3.0), L(0.5)], [L(0.8), L(2.5), 0.0, 0.0]])
NEW = OLD + torch.tensor([[L(1.1), 0.0, L(1.5), L(0.7)], [L(0.9), 0.0, 0.0, 0.0]])
ADV = torch.tensor([[1.0, 9.0, -2.0, 1.0], [-1.0, 2.0, 0.0, 0.0]])
PPO = dict(clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0)
TOL = dict(rel_tol=1e-5, abs_tol=1e-6)


def close(a, b) -> bool:
    return math.isclose(float(torch.as_tensor(a).detach()), b, **TOL)


# ---------------------------------------------------------------- the weights


def test_token_tis_weights():
    w = rollout_is_weights(OLD, BEHAV, MASK, "token", 2.0)
    # min(ratio, 2): 3 -> 2 and 2.5 -> 2; masked positions 0 (the hole's exp(5) too)
    expected = torch.tensor([[1.5, 0.0, 2.0, 0.5], [0.8, 2.0, 0.0, 0.0]])
    torch.testing.assert_close(w, expected, rtol=1e-5, atol=1e-6)


def test_sequence_tis_weights():
    w = rollout_is_weights(OLD, BEHAV, MASK, "sequence", 2.2)
    # row 0: 1.5 * 3 * 0.5 = 2.25 -> 2.2 (the hole's factor exp(5) left out); row 1: 0.8 * 2.5 = 2.0, kept
    expected = torch.tensor([[2.2, 0.0, 2.2, 2.2], [2.0, 2.0, 0.0, 0.0]])
    torch.testing.assert_close(w, expected, rtol=1e-5, atol=1e-6)


def test_weights_are_data_not_a_path_for_gradients():
    old = OLD.clone().requires_grad_(True)
    w = rollout_is_weights(old, BEHAV, MASK, "token", 2.0)
    assert not w.requires_grad


def test_safety_bound_keeps_a_huge_log_ratio_finite():
    old = torch.tensor([[200.0, -200.0]])
    behav = torch.zeros(1, 2)
    mask = torch.ones(1, 2)
    w = rollout_is_weights(old, behav, mask, "token", 1e30)
    assert torch.isfinite(w).all()
    assert close(w[0, 0], math.exp(20.0)) and close(w[0, 1], math.exp(-20.0))


# ---------------------------------------------------------------- the loss, each mode


def test_default_off_is_the_old_loss_exactly():
    without = compute_policy_loss(OLD, NEW, ADV, MASK, **PPO)
    with_none = compute_policy_loss(OLD, NEW, ADV, MASK, **PPO, rollout_is_weights=None)
    assert torch.equal(without["pg_loss"], with_none["pg_loss"])
    assert close(without["pg_loss"], 0.1 / 5)  # (-1.1 + 3.0 - 0.7 + 0.9 - 2.0) / 5


def test_decoupled_token_tis_loss_and_gradient():
    """AReaL's decoupled objective = verl's decoupled mode with rollout_is=token: the PPO clip around pi_old,
    times min(pi_old / pi_rollout, C)."""
    new = NEW.clone().requires_grad_(True)
    w = rollout_is_weights(OLD, BEHAV, MASK, "token", 2.0)
    out = compute_policy_loss(OLD, new, ADV, MASK, **PPO, rollout_is_weights=w)
    # -1.1 * 1.5, 3.0 * 2, -0.7 * 0.5 | 0.9 * 0.8, -2.0 * 2
    assert close(out["pg_loss"], (-1.65 + 6.0 - 0.35 + 0.72 - 4.0) / 5)
    out["pg_loss"].backward()
    # every token here is on the unclipped branch: d/dlog_prob = -A r, times its weight, / 5 tokens
    expected = torch.tensor([[-1.1 * 1.5, 0.0, 3.0 * 2.0, -0.7 * 0.5], [0.9 * 0.8, -2.0 * 2.0, 0.0, 0.0]]) / 5
    torch.testing.assert_close(new.grad, expected, rtol=1e-5, atol=1e-6)
    # the clip statistics are the PPO ones around pi_old, unweighted: r = 1.5 with A < 0 is unclipped (3 > 2.4)
    assert close(out["pg_clipfrac"], 0.0)


def test_decoupled_token_tis_seq_mean_token_mean():
    w = rollout_is_weights(OLD, BEHAV, MASK, "token", 2.0)
    out = compute_policy_loss(OLD, NEW, ADV, MASK, **PPO, rollout_is_weights=w, loss_agg_mode="seq-mean-token-mean")
    row0 = (-1.65 + 6.0 - 0.35) / 3
    row1 = (0.72 - 4.0) / 2
    assert close(out["pg_loss"], (row0 + row1) / 2)


def test_decoupled_sequence_tis_loss():
    w = rollout_is_weights(OLD, BEHAV, MASK, "sequence", 2.2)
    out = compute_policy_loss(OLD, NEW, ADV, MASK, **PPO, rollout_is_weights=w)
    # row 0 (-1.1 + 3.0 - 0.7) * 2.2, row 1 (0.9 - 2.0) * 2.0
    assert close(out["pg_loss"], (1.2 * 2.2 - 1.1 * 2.0) / 5)


def test_bypass_mode_takes_the_ratio_against_the_rollout():
    batch = DataProto.from_dict({"old_log_probs": OLD.clone(), "rollout_log_probs": BEHAV.clone(),
                                 "response_mask": MASK.clone()})
    batch.meta_info["old_log_prob_from_update"] = True  # what the step sets when it skipped the pass
    metrics = apply_rollout_correction(batch, RolloutCorrectionConfig(bypass_mode=True))
    assert metrics == {}
    assert torch.equal(batch.batch["old_log_probs"], BEHAV)
    assert "rollout_is_weights" not in batch.batch
    assert batch.meta_info["old_log_prob_from_update"] is False and batch.meta_info["rollout_correction_bypass"]
    out = compute_policy_loss(batch.batch["old_log_probs"], NEW, ADV, MASK, **PPO)
    # r = pi_theta / pi_rollout = (pi_theta / pi_old)(pi_old / pi_rollout): 1.65, 4.5, 0.35 | 0.72, 2.5
    # A=1, r=1.65: max(-1.65, -1.2) = -1.2 (clipped); A=-2, r=4.5: max(9, 2.4) = 9, dual min(9, 6) = 6;
    # A=1, r=0.35: max(-0.35, -0.8) = -0.35; A=-1, r=0.72: max(0.72, 0.8) = 0.8; A=2, r=2.5: max(-5, -2.4) = -2.4
    assert close(out["pg_loss"], (-1.2 + 6.0 - 0.35 + 0.8 - 2.4) / 5)
    assert close(out["pg_clipfrac"], 3 / 5)  # 1.65, 0.72 and 2.5 clipped
    assert close(out["pg_clipfrac_lower"], 1 / 5)  # the dual clip at 4.5


def test_decoupled_apply_adds_weights_and_metrics():
    batch = DataProto.from_dict({"old_log_probs": OLD.clone(), "rollout_log_probs": BEHAV.clone(),
                                 "response_mask": MASK.clone()})
    metrics = apply_rollout_correction(batch, RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=2.0))
    torch.testing.assert_close(batch.batch["rollout_is_weights"],
                               torch.tensor([[1.5, 0.0, 2.0, 0.5], [0.8, 2.0, 0.0, 0.0]]), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(batch.batch["old_log_probs"], OLD)  # pi_old stays the recomputed one
    assert close(metrics["rollout_corr/rollout_is_mean"], (1.5 + 3 + 0.5 + 0.8 + 2.5) / 5)


def test_off_changes_nothing_in_the_batch():
    batch = DataProto.from_dict({"old_log_probs": OLD.clone(), "rollout_log_probs": BEHAV.clone(),
                                 "response_mask": MASK.clone()})
    before = {k: v.clone() for k, v in batch.batch.items()}
    assert apply_rollout_correction(batch, RolloutCorrectionConfig()) == {}
    assert sorted(batch.batch.keys()) == sorted(before) and all(torch.equal(batch.batch[k], v)
                                                                 for k, v in before.items())
    assert "rollout_correction_bypass" not in batch.meta_info


def test_a_correction_without_rollout_log_probs_names_the_key():
    batch = DataProto.from_dict({"old_log_probs": OLD.clone(), "response_mask": MASK.clone()})
    with pytest.raises(KeyError, match="calculate_log_probs=true"):
        apply_rollout_correction(batch, RolloutCorrectionConfig(rollout_is="token"))


# ---------------------------------------------------------------- metrics


def test_metrics_token_level():
    m = rollout_corr_metrics(OLD, BEHAV, MASK, "token", 2.0)
    gaps = [L(1.5), L(3.0), L(2.0), L(1.25), L(2.5)]  # |log 0.5| = log 2, |log 0.8| = log 1.25
    assert close(m["rollout_corr/rollout_is_mean"], 8.3 / 5)  # 1.5 + 3 + 0.5 + 0.8 + 2.5, before truncation
    assert close(m["rollout_corr/rollout_is_max"], 3.0)  # not exp(5): the hole is absent
    assert close(m["rollout_corr/rollout_is_ratio_fraction_high"], 2 / 5)  # 3 and 2.5 above 2
    assert close(m["rollout_corr/logprob_diff_mean"], sum(gaps) / 5)
    assert close(m["rollout_corr/logprob_diff_max"], L(3.0))
    assert close(m["rollout_corr/kl"], -L(1.5 * 3.0 * 0.5 * 0.8 * 2.5) / 5)  # mean(rollout - old)


def test_metrics_sequence_level():
    m = rollout_corr_metrics(OLD, BEHAV, MASK, "sequence", 2.2)
    assert close(m["rollout_corr/rollout_is_mean"], (3 * 2.25 + 2 * 2.0) / 5)  # token-weighted, as verl
    assert close(m["rollout_corr/rollout_is_max"], 2.25)
    assert close(m["rollout_corr/rollout_is_ratio_fraction_high"], 1 / 2)  # one of two sequences above 2.2


def test_metrics_without_is_report_the_gap_only_and_nothing_for_an_empty_mask():
    m = rollout_corr_metrics(OLD, BEHAV, MASK)
    assert set(m) == {"rollout_corr/kl", "rollout_corr/logprob_diff_mean", "rollout_corr/logprob_diff_max"}
    assert rollout_corr_metrics(OLD, BEHAV, torch.zeros_like(MASK), "token") == {}


# ---------------------------------------------------------------- the step's old-log-prob pass


def test_skips_old_log_prob_by_mode():
    from hybridflow.config.load import load_config
    from hybridflow.trainer.ppo_trainer import skips_old_log_prob

    assert skips_old_log_prob(load_config(None, []))  # the default: one epoch over one mini-batch, on-policy
    # decoupled: pi_old is the proximal anchor, recomputed even where the update could stand in for it
    assert not skips_old_log_prob(load_config(None, ["algorithm.rollout_correction.rollout_is=token"]))
    # bypass: the rollout's log-probs are pi_old, no pass even where several updates would need one
    assert skips_old_log_prob(load_config(None, ["algorithm.rollout_correction.bypass_mode=true",
                                                 "actor_rollout_ref.actor.ppo_epochs=2"]))


# ---------------------------------------------------------------- bad input, named before Ray


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from hybridflow.models.tiny import save_tiny_model

    root = tmp_path_factory.mktemp("rollout_corr")
    rows = [{"prompt": [{"role": "user", "content": f"reverse: {w}"}], "data_source": "hybridflow/reverse",
             "reward_model": {"ground_truth": w[::-1], "style": "rule"}} for w in ("abc", "hello")]
    pq.write_table(pa.Table.from_pylist(rows), root / "train.parquet")
    return {"model": save_tiny_model(root / "policy"), "data": root / "train.parquet"}


def _validate(files, *overrides):
    from hybridflow.config.load import load_config
    from hybridflow.trainer.main import validate

    cfg = load_config(None, [f"actor_rollout_ref.model.path={files['model']}", f"data.train_files=[{files['data']}]",
                             *overrides])
    validate(cfg)
    return cfg


RC = "algorithm.rollout_correction"


@pytest.mark.bad_input
def test_good_corrections_pass(files):
    _validate(files, f"{RC}.rollout_is=token", f"{RC}.rollout_is_threshold=5")
    _validate(files, f"{RC}.rollout_is=sequence")
    _validate(files, f"{RC}.bypass_mode=true")


BAD = {
    "threshold_one": ([f"{RC}.rollout_is=token", f"{RC}.rollout_is_threshold=1.0"],
                      r"algorithm.rollout_correction.rollout_is_threshold=1.0 must be a finite number > 1"),
    "threshold_below_one_while_off": ([f"{RC}.rollout_is_threshold=0.5"],
                                      r"algorithm.rollout_correction.rollout_is_threshold=0.5 must be"),
    "threshold_nan": ([f"{RC}.rollout_is=token", f"{RC}.rollout_is_threshold=nan"],
                      r"algorithm.rollout_correction.rollout_is_threshold=nan must be a finite number > 1"),
    "threshold_inf": ([f"{RC}.rollout_is=token", f"{RC}.rollout_is_threshold=inf"],
                      r"algorithm.rollout_correction.rollout_is_threshold=inf must be a finite number > 1"),
    "unknown_level": ([f"{RC}.rollout_is=tokens"],
                      r"unknown algorithm.rollout_correction.rollout_is='tokens' \(did you mean 'token'\?\); "
                      r"valid: token, sequence"),
    "is_without_rollout_log_probs": ([f"{RC}.rollout_is=token", "actor_rollout_ref.rollout.calculate_log_probs=false"],
                                     r"rollout_is=token reads the rollout's log-probs, but "
                                     r"actor_rollout_ref.rollout.calculate_log_probs=false"),
    "bypass_without_rollout_log_probs": ([f"{RC}.bypass_mode=true",
                                          "actor_rollout_ref.rollout.calculate_log_probs=false"],
                                         r"bypass_mode=true reads the rollout's log-probs"),
    "bypass_with_is_weights": ([f"{RC}.bypass_mode=true", f"{RC}.rollout_is=sequence"],
                               r"bypass_mode=true with algorithm.rollout_correction.rollout_is=sequence"),
    "bypass_with_forced_recompute": ([f"{RC}.bypass_mode=true", "actor_rollout_ref.recompute_old_log_prob=true"],
                                     r"recompute_old_log_prob=true asks to recompute"),
    "is_with_no_recompute": ([f"{RC}.rollout_is=token", "actor_rollout_ref.recompute_old_log_prob=false"],
                             r"needs the recomputed pi_old that actor_rollout_ref.recompute_old_log_prob=false skips"),
}


@pytest.mark.bad_input
@pytest.mark.parametrize("name", list(BAD))
def test_bad_rollout_correction_names_the_key(files, name):
    overrides, match = BAD[name]
    with pytest.raises(ValueError, match=match):
        _validate(files, *overrides)


@pytest.mark.bad_input
@pytest.mark.parametrize("key,value,match", [
    ("rollout_rs", "token_k1", r"rollout_rs=token_k1' is refused here: rejection sampling"),
    ("loss_type", "reinforce", r"loss_type=reinforce' is refused here: bypass mode's REINFORCE loss"),
    ("rollout_is_batch_normalize", "true", r"rollout_is_batch_normalize=True' is refused here"),
])
def test_verl_keys_not_here_are_refused_at_load(key, value, match):
    from hybridflow.config.load import ConfigError, load_config

    with pytest.raises(ConfigError, match=match):
        load_config(None, [f"{RC}.{key}={value}"])
    # their off values, as verl's defaults, load
    load_config(None, [f"{RC}.rollout_rs=null", f"{RC}.loss_type=ppo_clip", f"{RC}.rollout_is_batch_normalize=false"])


# ---------------------------------------------------------------- the actor's loss function


def _actor_loss(monkeypatch, micro: dict, on_policy=False, bypass=False):
    """megatron_workers' loss_fn on a micro-batch, with the model's log-probs replaced by NEW (no Megatron)."""
    from types import SimpleNamespace

    import megatron_workers.actor_rollout_ref as arr
    from hybridflow.config.schema import ActorRolloutRefConfig

    new = NEW.clone().requires_grad_(True)
    monkeypatch.setattr(arr, "response_logprobs", lambda *a, **k: (new, torch.zeros_like(NEW)))
    cfg = ActorRolloutRefConfig()
    cfg.actor.entropy_coeff = 0.0
    cfg.actor.loss_agg_mode = "token-mean"
    fake = SimpleNamespace(config=cfg, actor=SimpleNamespace(hf_vocab_size=16))
    loss_fn = arr.ActorRolloutRefWorker._policy_loss_fn(fake, 4, 1.0, on_policy, bypass)
    loss, metrics = loss_fn(None, {"response_mask": MASK, "advantages": ADV, **micro})
    return loss, metrics, new


def test_actor_loss_applies_the_weights_and_is_unchanged_without(monkeypatch):
    loss, _, _ = _actor_loss(monkeypatch, {"old_log_probs": OLD})
    assert close(loss, 0.1 / 5)  # the default: no weights in the batch, today's loss
    w = rollout_is_weights(OLD, BEHAV, MASK, "token", 2.0)
    loss, _, new = _actor_loss(monkeypatch, {"old_log_probs": OLD, "rollout_is_weights": w})
    assert close(loss, (-1.65 + 6.0 - 0.35 + 0.72 - 4.0) / 5)
    loss.backward()
    assert close(new.grad[0, 2], 3.0 * 2.0 / 5) and new.grad[0, 1] == 0


def test_actor_reports_the_bypass_ratio(monkeypatch):
    loss, metrics, _ = _actor_loss(monkeypatch, {"old_log_probs": BEHAV}, bypass=True)
    assert close(loss, (-1.2 + 6.0 - 0.35 + 0.8 - 2.4) / 5)
    assert close(metrics["rollout_corr/rollout_is_mean"], (1.65 + 4.5 + 0.35 + 0.72 + 2.5) / 5)
    gaps = [L(1.65), L(4.5), -L(0.35), -L(0.72), L(2.5)]
    assert close(metrics["rollout_corr/logprob_diff_mean"], sum(gaps) / 5)
