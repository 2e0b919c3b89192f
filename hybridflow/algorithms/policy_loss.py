"""PPO clipped surrogate with dual clip, and the entropy bonus term.

Per token, with r = exp(log_prob - old_log_prob) and advantage A:
  clipped = max(-A * r, -A * clip(r, 1 - eps_low, 1 + eps_high))     (Schulman et al. 2017)
  where A < 0: loss = min(clipped, -A * c)                              (dual clip, Ye et al. 2020)
  where A >= 0: loss = clipped
The dual clip bounds the loss of a negative-advantage token whose ratio has blown up
(r > c), which plain PPO clipping leaves unbounded on that side.
"""

from __future__ import annotations

import torch

from hybridflow.algorithms.masked import agg_loss, masked_mean, require_same_shape

# exp() of a log-ratio above ~88 overflows fp32; beyond +-20 the token is clipped anyway.
_LOG_RATIO_CLAMP = 20.0


def compute_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    loss_scale_factor: float | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Returns pg_loss (differentiable scalar) and detached metrics.

    The four tensors come in verl's order (old_log_prob, log_prob, advantages, response_mask);
    everything after them is keyword-only, because verl's 5th positional argument is a
    symmetric `cliprange` (deprecated compute_policy_loss) or `loss_agg_mode`
    (compute_policy_loss_vanilla), and a positional call written for either would silently
    mean something else here. loss_scale_factor: see masked.agg_loss (seq-mean-token-sum-norm).

    pg_clipfrac: fraction of valid tokens where the ratio clip chose the loss.
    pg_clipfrac_lower: fraction where the dual clip (A < 0, large ratio) chose it.
    ppo_kl: masked mean of old_log_prob - log_prob (a k1 estimate of KL(old || new)).
    rollout_is_weights: verl's rollout correction (rollout_correction.py), (B, R) detached weights that
    multiply each token's loss before aggregation; None (the default) leaves the loss exactly as without them.
    """
    require_same_shape(old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages, response_mask=response_mask)
    if not clip_ratio_c > 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 (the dual clip bounds ratios above 1), got {clip_ratio_c}")
    if clip_ratio_low < 0 or clip_ratio_high < 0:
        raise ValueError(
            f"clip ratios must be >= 0, got clip_ratio_low={clip_ratio_low}, clip_ratio_high={clip_ratio_high}"
        )

    log_ratio = log_prob - old_log_prob
    ratio = torch.exp(log_ratio.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP))

    unclipped = -advantages * ratio
    ratio_clipped = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    clipped = torch.maximum(unclipped, ratio_clipped)
    dual = -advantages * clip_ratio_c
    negative = advantages < 0
    per_token = torch.where(negative, torch.minimum(clipped, dual), clipped)
    if rollout_is_weights is not None:
        require_same_shape(log_prob=log_prob, rollout_is_weights=rollout_is_weights)
        per_token = per_token * rollout_is_weights.detach()

    pg_loss = agg_loss(per_token, response_mask, loss_agg_mode, loss_scale_factor=loss_scale_factor)
    with torch.no_grad():
        clipfrac = masked_mean((ratio_clipped > unclipped).to(per_token.dtype), response_mask)
        clipfrac_lower = masked_mean((negative & (clipped > dual)).to(per_token.dtype), response_mask)
        ppo_kl = masked_mean(-log_ratio, response_mask)
    return {
        "pg_loss": pg_loss,
        "pg_clipfrac": clipfrac,
        "ppo_kl": ppo_kl,
        "pg_clipfrac_lower": clipfrac_lower,
    }


def entropy_loss(entropy: torch.Tensor, response_mask: torch.Tensor, mode: str = "token-mean", *,
                 loss_scale_factor: float | None = None) -> torch.Tensor:
    """Aggregate per-token entropy the same way as the policy loss (the actor subtracts coeff * this)."""
    return agg_loss(entropy, response_mask, mode, loss_scale_factor=loss_scale_factor)
