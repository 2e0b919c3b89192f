"""Pure RL math on (batch, response_len) tensors with a response_mask: no Ray, no process groups."""

from hybridflow.algorithms.advantages import (
    ADV_ESTIMATORS,
    compute_advantage,
    compute_gae,
    compute_grpo,
    compute_reinforce_plus_plus,
    compute_reinforce_plus_plus_baseline,
    compute_remax,
    compute_rloo,
    get_adv_estimator,
    needs_critic,
)
from hybridflow.algorithms.choices import require_choice
from hybridflow.algorithms.kl import (
    KL_KINDS,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    check_kl_kind,
    kl_penalty,
    make_kl_controller,
)
from hybridflow.algorithms.masked import (
    LOSS_AGG_MODES,
    SUM_LOSS_AGG_MODES,
    agg_loss,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)
from hybridflow.algorithms.policy_loss import compute_policy_loss, entropy_loss
from hybridflow.algorithms.value_loss import compute_value_loss

__all__ = [
    "ADV_ESTIMATORS",
    "KL_KINDS",
    "LOSS_AGG_MODES",
    "SUM_LOSS_AGG_MODES",
    "AdaptiveKLController",
    "FixedKLController",
    "agg_loss",
    "apply_kl_penalty",
    "check_kl_kind",
    "compute_advantage",
    "compute_gae",
    "compute_grpo",
    "compute_policy_loss",
    "compute_reinforce_plus_plus",
    "compute_reinforce_plus_plus_baseline",
    "compute_remax",
    "compute_rloo",
    "compute_value_loss",
    "entropy_loss",
    "get_adv_estimator",
    "kl_penalty",
    "make_kl_controller",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "needs_critic",
    "require_choice",
]
