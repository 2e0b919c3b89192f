"""Bad token budgets (verl's use_dynamic_bsz / *max_token_len_per_gpu) fail in validate(), before Ray starts,
naming the key and the numbers (hybridflow/config/checks.py: token_budgets). Same fixture as test_bad_input.py."""

from __future__ import annotations

import pytest
from test_bad_input import _validate, files  # noqa: F401  (files is the module-scoped fixture)

pytestmark = pytest.mark.bad_input
ON = "actor_rollout_ref.actor.use_dynamic_bsz=true"


@pytest.mark.parametrize("override, key", [
    ("actor_rollout_ref.actor.ppo_max_token_len_per_gpu=50", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu"),
    # the ref's and the rollout's budgets follow the actor's unless set; set alone, each is named
    ("actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=95", "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu"),
    ("actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=95",
     "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu"),
    ("critic.forward_max_token_len_per_gpu=64", "critic.forward_max_token_len_per_gpu"),  # gae: the critic is on
])
def test_a_budget_smaller_than_the_longest_row_names_the_key_and_both_numbers(files, override, key):  # noqa: F811
    # data.max_prompt_length 64 + rollout.response_length 32 (= data.max_response_length) = 96 tokens
    value = override.split("=")[1]
    with pytest.raises(ValueError, match=rf"^{key}={value} is smaller than the longest row the run can make: "
                                         rf"data.max_prompt_length \+ actor_rollout_ref.rollout.response_length = "
                                         rf"64 \+ 32 = 96 tokens"):
        _validate(files, ON, override)


def test_the_longest_row_counts_the_response_length_actually_used(files):  # noqa: F811
    with pytest.raises(ValueError, match=r"= 64 \+ 40 = 104 tokens"):
        _validate(files, ON, "actor_rollout_ref.rollout.response_length=40",
                  "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=100")
    _validate(files, ON, "actor_rollout_ref.rollout.response_length=40",
              "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=104")  # exactly the longest row fits


@pytest.mark.parametrize("budget", ["null", "0", "-5"])
def test_dynamic_bsz_with_no_usable_budget_contradicts_itself(files, budget):  # noqa: F811
    value = "None" if budget == "null" else budget
    with pytest.raises(ValueError, match=rf"^actor_rollout_ref.actor.ppo_max_token_len_per_gpu={value} contradicts "
                                         rf"actor_rollout_ref.actor.use_dynamic_bsz=true: .* set "
                                         rf"actor_rollout_ref.actor.ppo_max_token_len_per_gpu or "
                                         rf"actor_rollout_ref.actor.use_dynamic_bsz=false"):
        _validate(files, ON, f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={budget}")


def test_a_budget_is_not_read_while_its_flag_is_off_and_micro_batch_sizes_not_while_it_is_on(files):  # noqa: F811
    # verl's rules: a budget with use_dynamic_bsz=false is not used (no error); with it on, the row
    # micro-batch size is not used, so one that does not divide the rank's rows is fine.
    _validate(files, "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=1", "critic.ppo_max_token_len_per_gpu=1")
    with pytest.raises(ValueError, match="ppo_micro_batch_size_per_gpu=3 does not divide"):
        _validate(files, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3")
    cfg = _validate(files, ON, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3",
                    "critic.ppo_micro_batch_size_per_gpu=3")
    assert cfg.critic.use_dynamic_bsz and cfg.actor_rollout_ref.ref.log_prob_use_dynamic_bsz  # verl's defaults follow
