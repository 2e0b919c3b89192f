"""ReMax's baseline (Li et al. 2023, arXiv 2310.10505), as verl's trainer computes it.

Each step, after `gen`, the same prompts go once more to the generation group, greedy (meta_info `do_sample=False`,
`n=1`): the actor's processes through the 3D-HybridEngine, or the rollout pool when it has one (split pools,
async_training.mode=sync), with the weights that sampled the step. The greedy responses are scored on training's
reward path (the reward model when enabled, then the rule/user scorers per reward_model.reward_mode); a prompt's
summed score is `reward_baselines` of every one of its rollout.n samples (matched by uid). The greedy tokens are
never trained on: the greedy batch is dropped once scored (with trainer.rollout_data_dir set it is written next to
the samples, as baseline_step_<N>.jsonl). The stage's time is `timing_s/gen_baseline`.

Seeds: the call is a training-kind call at the step's global_step, so the rollout pins its call counter to that step
for it and again for the next step's sampled call (BaseRollout.sampling_for), and greedy decoding draws nothing;
every sampled step therefore draws what it would without the baseline, also after a resume.

Supported where a step generates its batch in one synchronous call: colocated, or on a rollout pool of its own with
async_training.mode=sync. Refused before Ray starts (`validate_remax`): server mode (rollout.mode=async; agent
loops), one_step_off_policy and fully_async, whose batches are produced by weights the step no longer holds.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hybridflow.protocol import DataProto

BASELINE_STEM = "baseline_step"  # <trainer.rollout_data_dir>/baseline_step_<N>.jsonl: the greedy samples


def uses_remax(cfg) -> bool:
    return cfg.algorithm.adv_estimator == "remax"


def validate_remax(cfg) -> None:
    """The generation modes ReMax's greedy baseline runs in; errors name the key that picks another."""
    if not uses_remax(cfg):
        return
    why = "algorithm.adv_estimator=remax needs a greedy generation of the step's prompts by the weights that sampled"
    if cfg.actor_rollout_ref.rollout.mode != "sync":
        raise ValueError(f"{why} them, in one synchronous call: actor_rollout_ref.rollout.mode="
                         f"{cfg.actor_rollout_ref.rollout.mode} (server mode, agent loops) is not supported; set "
                         "actor_rollout_ref.rollout.mode=sync")
    if cfg.async_training.mode != "sync":
        raise ValueError(f"{why} them: async_training.mode={cfg.async_training.mode} generates batches ahead with "
                         "older weights and is not supported; set async_training.mode=sync")


def greedy_prompts(prompts: DataProto, world_size: int) -> tuple[DataProto, int]:
    """The step's prompts as one greedy call (a new DataProto; `prompts` is left as it is), padded to a multiple of
    the generation group's size for DP dispatch, as validation pads: (batch, pad rows)."""
    meta = {**prompts.meta_info, "do_sample": False, "n": 1}
    greedy = DataProto.from_dict(dict(prompts.batch), dict(prompts.non_tensor_batch), meta)
    return greedy.pad_to_divisor(world_size)


def generate_baseline(gen_group, prompts: DataProto, score: Callable[[DataProto], torch.Tensor]) -> DataProto:
    """One greedy response per prompt from `gen_group` (a worker group with generate_sequences), scored by
    `score` (token_level_scores of a batch, training's reward path): the greedy batch, one row per prompt, with
    `token_level_scores` set."""
    padded, pad = greedy_prompts(prompts, gen_group.world_size)
    out = gen_group.generate_sequences(padded)
    out.meta_info.pop("metrics", None)  # the gen stage reports the rollout's timings; this stage its own timer
    greedy = out.unpad(pad)
    if len(greedy) != len(prompts):
        raise RuntimeError(f"the greedy baseline call returned {len(greedy)} rows for {len(prompts)} prompts")
    greedy.batch["token_level_scores"] = score(greedy)
    return greedy


def per_sample_baselines(greedy: DataProto, uids) -> torch.Tensor:
    """reward_baselines (len(uids),): each row's prompt's greedy score (summed over tokens), by uid."""
    scores = greedy.batch["token_level_scores"].sum(-1)
    of_uid = {str(u): s for u, s in zip(greedy.non_tensor_batch["uid"], scores, strict=True)}
    missing = sorted({str(u) for u in uids} - of_uid.keys())
    if missing:
        raise RuntimeError(f"no greedy baseline for the prompts of uids {missing[:4]}")
    return torch.stack([of_uid[str(u)] for u in uids]).to(torch.float32)
