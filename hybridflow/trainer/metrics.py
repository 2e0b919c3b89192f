"""Step metrics, named as verl users know them. Pure functions over a finished step's batch.

Throughput follows two conventions side by side:
- `perf/throughput`: verl's tokens / (step time * n_devices), per device;
- `perf/aggregate_throughput`: the HybridFlow paper's all tokens / step time, over all devices.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # only annotations use it: launch.plan reads PEAK_FLOPS without importing torch
    import torch


def _stats(prefix: str, values: torch.Tensor) -> dict[str, float]:
    if values.numel() == 0:
        return {}
    v = values.float()
    return {f"{prefix}/mean": v.mean().item(), f"{prefix}/max": v.max().item(), f"{prefix}/min": v.min().item()}


def data_metrics(batch, use_critic: bool, rollout_vs_old: bool = True) -> dict[str, float]:
    b = batch.batch
    response_mask = b["response_mask"].bool()
    max_response = response_mask.shape[1]
    # response_length counts every attended response token: in a multi-turn rollout that includes the tool
    # tokens the agent loop inserted (response_mask 0, attention_mask 1), as verl counts it, and it is the count
    # the response budget (rollout.response_length) caps, so clip_ratio compares it with the budget.
    # response_length/model_tokens_* counts only the model's own tokens (response_mask 1: what is trained on).
    # Single-turn, both are the same numbers.
    response_len = b["attention_mask"][:, -max_response:].bool().sum(-1).float()
    model_len = response_mask.sum(-1).float()
    prompt_len = b["attention_mask"][:, :-max_response].sum(-1).float()
    out = {}
    out.update(_stats("critic/score", b["token_level_scores"].sum(-1)))
    if "rm_scores" in b:  # the reward model's part of the score (all of it with reward_mode=replace)
        out.update(_stats("critic/rm_score", b["rm_scores"].sum(-1)))
    out.update(_stats("critic/rewards", b["token_level_rewards"].sum(-1)))
    out.update(_stats("critic/advantages", b["advantages"][response_mask]))
    out.update(_stats("critic/returns", b["returns"][response_mask]))
    if use_critic and "values" in b:
        values = b["values"][response_mask]
        returns = b["returns"][response_mask]
        out.update(_stats("critic/values", values))
        var_r = returns.var()
        out["critic/vf_explained_var"] = (1 - (returns - values).var() / (var_r + 1e-5)).item()
    out.update(_stats("response_length", response_len))
    out["response_length/clip_ratio"] = (response_len == max_response).float().mean().item()
    out.update({f"response_length/model_tokens_{k.rsplit('/', 1)[1]}": v
                for k, v in _stats("response_length", model_len).items()})
    out.update(_stats("prompt_length", prompt_len))
    if rollout_vs_old and "rollout_log_probs" in b and "old_log_probs" in b:
        # How far the rollout engine's sampling probabilities are from the trainer's (resharding, kernels, dtype).
        diff = (b["rollout_log_probs"] - b["old_log_probs"]).abs()[response_mask]
        if diff.numel():
            out["rollout/logprob_diff_mean"] = diff.mean().item()
            out["rollout/logprob_diff_max"] = diff.max().item()
            p_roll, p_train = b["rollout_log_probs"].exp(), b["old_log_probs"].exp()
            out["rollout/prob_diff_mean"] = (p_roll - p_train).abs()[response_mask].mean().item()
    return out


def token_counts(batch) -> tuple[int, int]:
    """(prompt tokens, response tokens) actually present (attention_mask), for throughput.

    Response tokens include a multi-turn rollout's tool tokens (response_mask 0): every pass processes them.
    """
    r = batch.batch["response_mask"].shape[1]
    attended = batch.batch["attention_mask"].bool()
    return int(attended[:, :-r].sum()), int(attended[:, -r:].sum())


def timing_metrics(timings: dict[str, float], n_prompt: int, n_response: int) -> dict[str, float]:
    out = {f"timing_s/{k}": v for k, v in timings.items()}
    total = n_prompt + n_response
    for k, v in timings.items():
        # generation scales with response tokens; every other stage with all tokens (as verl reports it)
        n = n_response if k == "gen" else total
        if n:
            out[f"timing_per_token_ms/{k}"] = 1e3 * v / n
    return out


def throughput_metrics(n_prompt: int, n_response: int, step_time: float, n_devices: int,
                       actor_flops: float | None = None, peak_flops_per_device: float | None = None) -> dict:
    total = n_prompt + n_response
    out = {
        "perf/total_num_tokens": float(total),
        "perf/time_per_step": step_time,
        "perf/throughput": total / (step_time * n_devices),
        "perf/aggregate_throughput": total / step_time,
    }
    if actor_flops is not None and peak_flops_per_device:
        out["perf/mfu/actor"] = actor_flops / (step_time * n_devices * peak_flops_per_device)
    return out


# Dense bf16 peaks per device, for MFU (perf/mfu/actor and launch/bench_actor.py).
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12}


def known_peak_flops(device_name: str) -> tuple[float, str] | None:
    """(peak FLOP/s, what it is) for a device name as torch.cuda.get_device_name() gives it, or None."""
    for key, peak in PEAK_FLOPS.items():
        if key in device_name:
            return peak, f"{key} dense bf16"
    return None


def transformer_flops(n_params: float, n_tokens: int, passes: float) -> float:
    """Dense FLOPs ~= 2 * params * tokens per forward; `passes` forward-equivalents (train = 3)."""
    return 2.0 * n_params * n_tokens * passes


def reduce_worker_metrics(parts: list[dict] | dict) -> dict[str, float]:
    """Worker groups return a metrics dict per dp replica: average them."""
    if isinstance(parts, dict):
        return dict(parts)
    parts = [p for p in parts if p]
    keys = {k for p in parts for k in p}
    return {k: sum(p[k] for p in parts if k in p) / sum(1 for p in parts if k in p) for k in keys}
