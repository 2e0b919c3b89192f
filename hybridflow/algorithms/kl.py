"""Per-token KL estimators, KL-coefficient controllers, and the in-reward KL penalty.

The estimators follow Schulman's "Approximating KL Divergence" note, for KL(pi || ref)
sampled from pi, with d = log_prob - ref_log_prob:
  k1 ("kl"):          d                        unbiased, high variance, can be negative
  "abs":              |d|
  k2 ("mse"):         0.5 * d^2                biased, low variance
  k3 ("low_var_kl"):  exp(-d) - 1 + d          unbiased, always >= 0
A "+" suffix ("k3+", "low_var_kl+", "k1+", ...) is verl's straight-through variant: the
forward value of the named estimator with the gradient of k2. The k1 and k3 values are
unbiased estimates of the KL, but their gradients are not unbiased estimates of the KL's
gradient; k2's gradient is (E_pi[d * grad log pi] = grad KL). "k2+" / "mse+" equal k2.
verl also names "full" (exact KL over the vocabulary) and raises NotImplementedError for it;
it needs full-vocabulary log-probs, so it is rejected here with a clear error.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from hybridflow.algorithms.choices import require_choice
from hybridflow.algorithms.masked import masked_mean, require_same_shape

# verl's names (verl/trainer/ppo/core_algos.py, kl_penalty / kl_penalty_forward).
_KL_ESTIMATORS = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
KL_KINDS = _KL_ESTIMATORS + tuple(f"{k}+" for k in _KL_ESTIMATORS)
KL_CTRL_TYPES = ("fixed", "adaptive")

# k3 of a token whose log-ratio is far off is exp(huge); clamping keeps one bad token
# from dominating the batch (verl's bounds: the log-ratio to +-20, k3 itself to +-10).
_K3_LOG_RATIO_CLAMP = 20.0
_K3_CLAMP = 10.0


def check_kl_kind(key: str, kind: str) -> None:
    """ValueError naming `key` unless `kind` is one of KL_KINDS."""
    if kind.removesuffix("+") == "full":
        raise ValueError(f"{key}={kind!r}: the exact (full-vocabulary) KL needs every token's log-prob and is not "
                         f"supported (verl raises NotImplementedError for it); valid: {', '.join(KL_KINDS)}")
    require_choice(key, kind, KL_KINDS)


def _estimate(d: torch.Tensor, kind: str) -> torch.Tensor:
    if kind in ("kl", "k1"):
        return d
    if kind == "abs":
        return d.abs()
    if kind in ("mse", "k2"):
        return 0.5 * d.square()
    neg = (-d).clamp(-_K3_LOG_RATIO_CLAMP, _K3_LOG_RATIO_CLAMP)  # low_var_kl / k3
    return (torch.exp(neg) - neg - 1.0).clamp(-_K3_CLAMP, _K3_CLAMP)


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate; same shape as the inputs. See the module docstring for `kind`."""
    require_same_shape(log_prob=log_prob, ref_log_prob=ref_log_prob)
    check_kl_kind("kl penalty kind", kind)
    d = log_prob - ref_log_prob
    value = _estimate(d, kind.removesuffix("+"))
    if not kind.endswith("+"):
        return value
    k2 = 0.5 * d.square()
    return k2 - k2.detach() + value.detach()  # value of `value`, gradient of k2


class FixedKLController:
    """A constant KL coefficient."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        pass


class AdaptiveKLController:
    """Proportional controller of Ziegler et al. 2019 (Fine-Tuning LMs from Human Preferences, sec. 2.2).

    e = clip(KL / target - 1, -0.2, 0.2);  beta <- beta * (1 + e * n_steps / horizon).
    The clip keeps one outlier batch from moving beta by more than 0.2 * n_steps / horizon.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int):
        if target_kl <= 0 or horizon <= 0:
            raise ValueError(f"adaptive KL needs target_kl > 0 and horizon > 0, got {target_kl} and {horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        error = float(np.clip(current_kl / self.target - 1.0, -0.2, 0.2))
        self.value *= 1.0 + error * n_steps / self.horizon


KLController = FixedKLController | AdaptiveKLController


class KLCtrlSettings(Protocol):
    """algorithm.kl_ctrl's fields (hybridflow/config/schema.py KLCtrlConfig); the algorithms know no config."""

    type: str
    kl_coef: float
    target_kl: float
    horizon: int


def make_kl_controller(cfg: KLCtrlSettings) -> KLController:
    if cfg.type == "fixed":
        return FixedKLController(cfg.kl_coef)
    if cfg.type == "adaptive":
        return AdaptiveKLController(cfg.kl_coef, cfg.target_kl, cfg.horizon)
    raise ValueError(f"unknown algorithm.kl_ctrl.type {cfg.type!r}; valid: {', '.join(KL_CTRL_TYPES)}")


@torch.no_grad()
def apply_kl_penalty(
    token_level_scores: torch.Tensor,
    old_log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_ctrl: KLController,
    kind: str = "kl",
) -> tuple[torch.Tensor, dict[str, float]]:
    """token_level_rewards = scores - beta * KL per valid token; then feed the batch KL to the controller.

    The reported KL is the mean over sequences of each sequence's mean token KL; the
    controller advances by one step per sequence (n_steps = batch size). The reported
    coefficient is the beta that was applied, i.e. before this update.
    """
    require_same_shape(token_level_scores=token_level_scores, response_mask=response_mask)
    kld = kl_penalty(old_log_prob, ref_log_prob, kind)
    kld = torch.where(response_mask.bool(), kld, torch.zeros_like(kld))
    beta = kl_ctrl.value
    token_level_rewards = token_level_scores - beta * kld
    current_kl = float(masked_mean(kld, response_mask, dim=-1).mean())
    kl_ctrl.update(current_kl=current_kl, n_steps=token_level_scores.shape[0])
    metrics = {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}
    return token_level_rewards, metrics
