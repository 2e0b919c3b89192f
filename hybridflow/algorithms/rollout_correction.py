"""Rollout correction: off-policy samples (rollouts drawn by an older or different policy) in the PPO update.

verl's `algorithm.rollout_correction` (docs/algo/rollout_corr.md there), three log-probs per valid token:
  behav = rollout_log_probs   the engine that sampled the token (pi_rollout, the behaviour policy)
  old   = old_log_probs       the trainer's weights before this step's update (pi_old, the proximal policy)
  new   = the update's forward (pi_theta, being trained)

Decoupled mode (bypass_mode=false; AReaL's decoupled PPO objective), with rollout_is = token | sequence:
  token:    w_t = min(exp(old_t - behav_t), C)
  sequence: w_t = min(exp(sum_{s valid} (old_s - behav_s)), C)   the same for every token of the row
  loss_t    = w_t * ppo_t(new, old)      ppo_t: the clipped (dual-clip) surrogate of policy_loss.py, whose
                                         ratio new/old is clipped around the proximal policy, not the behaviour
then aggregated by loss_agg_mode, as the plain loss is. C = rollout_is_threshold; w is data (detached), 0 at masked
tokens; the log-ratio is clamped to [-20, 20] before exp (verl's safety bound). The pass that computes `old`
always runs in this mode (it is the proximal anchor), even where a single on-policy update would skip it.
(AReaL's own cap, behav_imp_weight_cap, drops tokens above it from the loss; verl's TIS, followed here,
truncates them to C.)

Bypass mode (bypass_mode=true): old := behav, no old-log-prob pass. The PPO ratio new/behav is itself the
importance ratio and is clipped; no weight is applied (rollout_is must stay null, as verl's loss_type=ppo_clip
applies none: it would count the ratio twice).

Off (rollout_is null, bypass_mode false, the default): nothing here runs and the loss is what it was.
"""

from __future__ import annotations

import torch

from hybridflow.algorithms.masked import masked_count, masked_mean, masked_sum, require_same_shape

ROLLOUT_IS_LEVELS = ("token", "sequence")
# exp() of a log-ratio beyond +-20 is clamped (verl's SAFETY_BOUND): exp(20) ~ 4.9e8 stays finite in fp32.
SAFETY_BOUND = 20.0


def enabled(rc) -> bool:
    """Whether an `algorithm.rollout_correction` section changes anything (False: today's update, bit for bit)."""
    return rc is not None and (rc.rollout_is is not None or bool(rc.bypass_mode))


def decoupled(rc) -> bool:
    """IS weights computed by the driver from (old, behav) and applied by the actor: rollout_is set, not bypass."""
    return rc is not None and rc.rollout_is is not None and not rc.bypass_mode


def _log_ratio(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, mask: torch.Tensor,
               rollout_is: str) -> torch.Tensor:
    """log(pi_old / pi_rollout) per token ("token") or per row broadcast over it ("sequence"), 0 at masked tokens."""
    require_same_shape(old_log_prob=old_log_prob, rollout_log_prob=rollout_log_prob, response_mask=mask)
    if rollout_is not in ROLLOUT_IS_LEVELS:
        raise ValueError(f"rollout_is={rollout_is!r}; valid: {', '.join(ROLLOUT_IS_LEVELS)}")
    valid = mask.bool()
    diff = torch.where(valid, old_log_prob.float() - rollout_log_prob.float(), torch.zeros_like(old_log_prob.float()))
    if rollout_is == "sequence":
        diff = diff.sum(dim=-1, keepdim=True).expand_as(diff)
    return diff


def rollout_is_weights(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor,
                       rollout_is: str = "token", rollout_is_threshold: float = 2.0) -> torch.Tensor:
    """Truncated IS weights (verl's `rollout_is_weights`): min(exp(log_ratio), threshold), detached, 0 where masked.

    log_ratio per `rollout_is`: "token" old_t - rollout_t; "sequence" the row's sum over valid tokens.
    """
    log_ratio = _log_ratio(old_log_prob, rollout_log_prob, response_mask, rollout_is)
    w = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)).clamp(max=rollout_is_threshold)
    return torch.where(response_mask.bool(), w, torch.zeros_like(w)).detach()


def rollout_corr_metrics(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor,
                         rollout_is: str | None = None, rollout_is_threshold: float = 2.0) -> dict[str, float]:
    """The step's `rollout_corr/*` metrics over valid tokens (empty dict when no token is valid).

    Train-vs-rollout gap, with d_t = old_t - rollout_t:
      rollout_corr/kl                  mean(rollout - old), verl's k1 estimate of KL(pi_rollout || pi_old)
      rollout_corr/logprob_diff_mean   mean |d_t|
      rollout_corr/logprob_diff_max    max |d_t|
    With rollout_is set, the importance ratio before truncation (exp of the safety-bounded log-ratio, as verl):
      rollout_corr/rollout_is_mean                 token level: over valid tokens; sequence level: over valid
                                                   tokens too (each token carries its row's ratio), as verl
      rollout_corr/rollout_is_max                  over valid tokens (token) / non-empty rows (sequence)
      rollout_corr/rollout_is_ratio_fraction_high  share of those above the threshold: what truncation clipped
    """
    valid = response_mask.bool()
    n = int(masked_count(response_mask))
    if n == 0:
        return {}
    d = (old_log_prob.float() - rollout_log_prob.float())
    abs_d = torch.where(valid, d.abs(), torch.zeros_like(d))
    out = {"rollout_corr/kl": float(masked_mean(-d, response_mask)),
           "rollout_corr/logprob_diff_mean": float(masked_sum(abs_d, response_mask) / n),
           "rollout_corr/logprob_diff_max": float(abs_d[valid].max())}
    if rollout_is is None:
        return out
    log_ratio = _log_ratio(old_log_prob, rollout_log_prob, response_mask, rollout_is)
    ratio = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    out["rollout_corr/rollout_is_mean"] = float(masked_mean(ratio, response_mask))
    if rollout_is == "token":
        per = ratio[valid]
    else:  # one ratio per non-empty row
        per = ratio[:, 0][valid.any(dim=-1)]
    out["rollout_corr/rollout_is_max"] = float(per.max())
    out["rollout_corr/rollout_is_ratio_fraction_high"] = float((per > rollout_is_threshold).float().mean())
    return out


def apply_rollout_correction(batch, rc) -> dict[str, float]:
    """The driver's part, on the step's DataProto after the old-log-prob stage; returns its rollout_corr/* metrics.

    bypass_mode: old_log_probs := rollout_log_probs, and the update takes its ratio against them (meta_info
    rollout_correction_bypass; the update reports rollout_corr/rollout_is_mean and logprob_diff_mean of
    pi_theta / pi_rollout, as verl's actor does in bypass mode). Decoupled with rollout_is: adds
    `rollout_is_weights` (verl's key) for the actor's loss. Either way needs `rollout_log_probs`.
    """
    if not enabled(rc):
        return {}
    b = batch.batch
    if "rollout_log_probs" not in b:
        raise KeyError("algorithm.rollout_correction needs the rollout's log-probs (rollout_log_probs) in the batch: "
                       "set actor_rollout_ref.rollout.calculate_log_probs=true (an agent loop whose engine gave none "
                       "leaves them out)")
    behav, mask = b["rollout_log_probs"], b["response_mask"]
    if rc.bypass_mode:
        b["old_log_probs"] = behav
        batch.meta_info["old_log_prob_from_update"] = False
        batch.meta_info["rollout_correction_bypass"] = True
        return {}
    if batch.meta_info.get("old_log_prob_from_update"):
        raise RuntimeError("rollout_correction.rollout_is needs the old-log-prob pass (pi_old), which was skipped")
    old = b["old_log_probs"]
    b["rollout_is_weights"] = rollout_is_weights(old, behav, mask, rc.rollout_is, rc.rollout_is_threshold)
    return rollout_corr_metrics(old, behav, mask, rc.rollout_is, rc.rollout_is_threshold)
