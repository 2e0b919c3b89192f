"""Clipped value loss for the critic (the PPO value clip).

The new prediction may move at most cliprange_value away from the value recorded at
rollout time; the loss is the larger (pessimistic) of the clipped and unclipped squared
errors, so clipping can only remove the incentive to move further, never add one.
"""

from __future__ import annotations

import torch

from hybridflow.algorithms.masked import agg_loss, masked_mean, require_same_shape


def compute_value_loss(
    *,
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    loss_scale_factor: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (vf_loss, vf_clipfrac): 0.5 * agg(max((v - R)^2, (clip(v) - R)^2)), and the clipped fraction.

    Keyword-only: verl's order is (vpreds, returns, values), an earlier order here was
    (vpreds, values, returns); a positional call from either would silently swap the old
    values and the returns, so positional calls raise TypeError instead.
    """
    require_same_shape(vpreds=vpreds, values=values, returns=returns, response_mask=response_mask)
    if cliprange_value < 0:
        raise ValueError(f"cliprange_value must be >= 0, got {cliprange_value}")
    vpred_clipped = torch.clamp(vpreds, values - cliprange_value, values + cliprange_value)
    loss_unclipped = (vpreds - returns) ** 2
    loss_clipped = (vpred_clipped - returns) ** 2
    vf_loss = 0.5 * agg_loss(torch.maximum(loss_unclipped, loss_clipped), response_mask, loss_agg_mode,
                             loss_scale_factor=loss_scale_factor)
    with torch.no_grad():
        vf_clipfrac = masked_mean((loss_clipped > loss_unclipped).to(vpreds.dtype), response_mask)
    return vf_loss, vf_clipfrac
