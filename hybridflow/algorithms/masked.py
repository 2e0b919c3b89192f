"""Reductions over valid response tokens, and loss aggregation.

Every tensor here is (batch, response_len) with a `response_mask` that is
nonzero on valid response tokens. Positions outside the mask are *selected
away* (torch.where), not multiplied by 0, so a NaN or inf sitting in padding
(e.g. a log-prob of a pad token) cannot leak into a result.
"""

from __future__ import annotations

import torch

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")


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


def agg_loss(loss_mat: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """Reduce a per-token loss to a scalar.

    token-mean: every valid token weighs the same (long responses weigh more).
    seq-mean-token-sum: sum per sequence, then mean over sequences.
    seq-mean-token-mean: mean per sequence, then mean over sequences (every sequence weighs the same).
    """
    require_same_shape(loss_mat=loss_mat, response_mask=mask)
    if mode == "token-mean":
        return masked_mean(loss_mat, mask)
    if mode == "seq-mean-token-sum":
        return masked_sum(loss_mat, mask, dim=-1).mean()
    if mode == "seq-mean-token-mean":
        return masked_mean(loss_mat, mask, dim=-1).mean()
    raise ValueError(f"unknown loss_agg_mode {mode!r}; valid: {', '.join(LOSS_AGG_MODES)}")
