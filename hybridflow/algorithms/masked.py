"""Reductions over valid response tokens, and loss aggregation.

Every tensor here is (batch, response_len) with a `response_mask` that is
nonzero on valid response tokens. Positions outside the mask are *selected
away* (torch.where), not multiplied by 0, so a NaN or inf sitting in padding
(e.g. a log-prob of a pad token) cannot leak into a result.
"""

from __future__ import annotations

import torch

from hybridflow.algorithms.choices import require_choice

# verl's names (verl/trainer/ppo/core_algos.py, agg_loss). token-sum is the only one that is a sum
# over the batch rather than a mean; the engine needs to know (megatron_workers/engine.py, agg_count).
LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
SUM_LOSS_AGG_MODES = ("token-sum",)


def require_same_shape(**tensors: torch.Tensor) -> None:
    """Raise naming each argument and its shape when the shapes differ."""
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) > 1:
        listed = ", ".join(f"{name}={shape}" for name, shape in shapes.items())
        raise ValueError(f"shape mismatch: {listed}")


def _valid(mask: torch.Tensor) -> torch.Tensor:
    return mask.bool()


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    selected = torch.where(_valid(mask), x, torch.zeros_like(x))
    return selected.sum() if dim is None else selected.sum(dim=dim)


def masked_count(mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    valid = _valid(mask)
    return valid.sum() if dim is None else valid.sum(dim=dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean over valid positions; 0 where a slice has no valid position (an empty response)."""
    count = masked_count(mask, dim).to(x.dtype)
    return masked_sum(x, mask, dim) / count.clamp(min=1)


def masked_var(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Unbiased (n-1) variance over all valid positions."""
    count = int(masked_count(mask))
    if count < 2:
        raise ValueError(f"masked_var needs at least 2 valid positions, the mask has {count}")
    mean = masked_mean(x, mask)
    return masked_sum((x - mean) ** 2, mask) / (count - 1)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / std over valid positions; invalid positions come out as 0.

    With shift_mean=False the mean is added back, so only the scale changes.
    """
    mean = masked_mean(x, mask)
    whitened = (x - mean) * torch.rsqrt(masked_var(x, mask) + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(_valid(mask), whitened, torch.zeros_like(whitened))


def agg_loss(loss_mat: torch.Tensor, mask: torch.Tensor, mode: str, *,
             loss_scale_factor: float | None = None) -> torch.Tensor:
    """Reduce a per-token loss (B, T) to a scalar, the way verl's agg_loss does on one whole batch.

    loss_scale_factor is keyword-only: verl's 4th positional argument is dp_size. (The DP and
    micro-batch share of the global normaliser is applied by megatron_workers/engine.py instead.)

    With s_i = sum of row i's valid tokens, n_i its valid-token count, N = sum n_i and
    E = the rows with n_i > 0:
      token-mean:              sum_i s_i / N            (every valid token weighs the same)
      token-sum:               sum_i s_i                (no normaliser: scales with batch and length)
      seq-mean-token-sum:      sum_{i in E} s_i / |E|
      seq-mean-token-mean:     sum_{i in E} (s_i / n_i) / |E|   (every sequence weighs the same)
      seq-mean-token-sum-norm: sum_{i in E} s_i / |E| / loss_scale_factor
    The seq-mean modes average over non-empty rows only, as verl does: a fully masked row
    (padding, a filtered sample) neither adds to the numerator nor dilutes the mean.
    seq-mean-token-sum-norm is Dr. GRPO's constant normaliser: verl divides by
    `loss_scale_factor`, which defaults to the horizon T = loss_mask.shape[-1] (our responses
    are always padded to rollout.response_length, so T is constant over a run).
    Where verl divides 0 by 0 (no valid token / no non-empty row at all) this returns 0, not NaN.
    verl's seq-mean-token-mean divides by n_i + 1e-8; for n_i >= 1 that is the same fp32 number.
    """
    require_same_shape(loss_mat=loss_mat, response_mask=mask)
    require_choice("loss_agg_mode", mode, LOSS_AGG_MODES)
    if mode == "token-mean":
        return masked_mean(loss_mat, mask)
    if mode == "token-sum":
        return masked_sum(loss_mat, mask)
    counts = masked_count(mask, dim=-1)
    rows = (counts > 0).sum().to(loss_mat.dtype).clamp(min=1)
    if mode == "seq-mean-token-mean":
        per_row = masked_sum(loss_mat, mask, dim=-1) / counts.to(loss_mat.dtype).clamp(min=1)
    else:
        per_row = masked_sum(loss_mat, mask, dim=-1)
    loss = per_row.sum() / rows  # empty rows contribute 0 to the sum and nothing to `rows`
    if mode == "seq-mean-token-sum-norm":
        scale = loss_mat.shape[-1] if loss_scale_factor is None else loss_scale_factor
        if not scale > 0:
            raise ValueError(f"loss_scale_factor must be > 0, got {scale}")
        loss = loss / scale
    return loss
