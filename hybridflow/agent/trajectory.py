"""One multi-turn rollout as token ids, and the batch a list of them becomes.

A trajectory's response interleaves what the model sampled (response_mask 1: trained on) and what the loop
inserted, tool results and chat boundaries (response_mask 0: attended to, not trained on). Its ids are only
ever the ids the engine returned plus the ids the loop appended: no text is re-tokenised (token in, token out),
so the sequence the trainer scores is exactly the one that was sampled.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from hybridflow.protocol import DataProto
from hybridflow.rollout.output import assemble_rollout_output


@dataclass
class TurnRecord:
    """One assistant turn: the ids the engine sampled, and the ids the loop appended after it."""

    ids: list[int]
    log_probs: list[float] | None
    finish_reason: str
    weight_version: int
    tool_ids: list[int] = field(default_factory=list)
    calls: list[dict] = field(default_factory=list)  # per call: name, status (ok/error/timeout/skipped), latency_s


@dataclass
class Trajectory:
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)  # 1 model tokens, 0 tokens the loop inserted
    rollout_log_probs: list[float] | None = field(default_factory=list)  # 0.0 at mask 0; None: engine gave none
    num_turns: int = 0  # assistant turns
    reward: float | None = None  # a score the loop itself assigns (an environment's), else None
    tool_calls: int = 0
    tool_errors: int = 0  # calls whose observation is an error, timeouts and malformed calls included
    tool_timeouts: int = 0
    tool_parse_errors: int = 0  # malformed calls (bad JSON, unknown tool, wrong arguments)
    tool_latencies_s: list[float] = field(default_factory=list)
    min_weight_version: int | None = None  # over the model's tokens
    max_weight_version: int | None = None
    truncated: bool = False  # a length limit (the response budget or a turn's max_tokens) ended it
    stop_reason: str = ""  # no_tool_call | max_assistant_turns | budget | turn_length | abort | done
    turns: list[TurnRecord] = field(default_factory=list)
    extra: dict = field(default_factory=dict)  # anything a custom loop wants to hand on

    def add_model_turn(self, ids: Sequence[int], log_probs: Sequence[float] | None, finish_reason: str,
                       weight_version: int = 0, min_weight_version: int | None = None) -> TurnRecord:
        """Appends what the engine sampled for one assistant turn (mask 1). `min_weight_version`: the oldest
        version among its tokens, where a weight update came in the middle of the turn (partial rollouts)."""
        ids = list(ids)
        if log_probs is not None and len(log_probs) != len(ids):
            raise ValueError(f"turn {self.num_turns}: {len(ids)} tokens but {len(log_probs)} log-probs")
        self.response_ids += ids
        self.response_mask += [1] * len(ids)
        if log_probs is None:
            self.rollout_log_probs = None
        elif self.rollout_log_probs is not None:
            self.rollout_log_probs += [float(x) for x in log_probs]
        if ids:
            lo, hi = self.min_weight_version, self.max_weight_version
            first = weight_version if min_weight_version is None else min(min_weight_version, weight_version)
            self.min_weight_version = first if lo is None else min(lo, first)
            self.max_weight_version = weight_version if hi is None else max(hi, weight_version)
        self.num_turns += 1
        record = TurnRecord(ids, None if log_probs is None else list(log_probs), finish_reason, weight_version)
        self.turns.append(record)
        return record

    def add_inserted(self, ids: Sequence[int]) -> None:
        """Appends ids the loop inserts (tool results, chat boundaries): mask 0, log-prob 0."""
        ids = list(ids)
        self.response_ids += ids
        self.response_mask += [0] * len(ids)
        if self.rollout_log_probs is not None:
            self.rollout_log_probs += [0.0] * len(ids)
        if self.turns:
            self.turns[-1].tool_ids += ids


def to_batch(trajectories: Sequence[Trajectory], pad_token_id: int, prompt_length: int,
             response_length: int) -> DataProto:
    """The rollout output (keys and conventions of hybridflow/rollout/base.py) for these trajectories.

    prompts left-padded to prompt_length; responses right-padded (cut) to response_length; attention_mask is
    1 on every real response token, tool tokens included; response_mask is the loss mask (0 on tool tokens);
    rollout_log_probs 0 at mask-0 and padded positions (absent when any trajectory has none).
    non_tensor_batch: num_turns, truncated (the trajectory's flag, or cut here), tool_calls, and
    agent_reward (NaN where the loop gave none) when any trajectory has a reward.
    """
    if not trajectories:
        raise ValueError("to_batch: no trajectories")
    rows = len(trajectories)
    prompt_ids = torch.full((rows, prompt_length), pad_token_id, dtype=torch.long)
    prompt_mask = torch.zeros((rows, prompt_length), dtype=torch.long)
    for i, t in enumerate(trajectories):
        n = len(t.prompt_ids)
        if n > prompt_length:
            raise ValueError(f"to_batch: trajectory {i} has a {n}-token prompt > prompt_length={prompt_length} "
                             "(data.max_prompt_length)")
        if n:
            prompt_ids[i, prompt_length - n:] = torch.as_tensor(t.prompt_ids, dtype=torch.long)
            prompt_mask[i, prompt_length - n:] = 1
    with_log_probs = all(t.rollout_log_probs is not None for t in trajectories)
    responses = [t.response_ids[:response_length] for t in trajectories]
    log_probs = [t.rollout_log_probs[:response_length] for t in trajectories] if with_log_probs else None
    out = assemble_rollout_output(DataProto.from_dict({"input_ids": prompt_ids, "attention_mask": prompt_mask}),
                                  responses, log_probs, n=1, response_length=response_length,
                                  pad_token_id=pad_token_id)
    # assemble's response_mask is 1 on every real token: that is the attention mask over the response (already
    # in attention_mask); the loss mask is the loop's, 0 on what the loop inserted.
    loss_mask = torch.zeros((rows, response_length), dtype=out.batch["response_mask"].dtype)
    for i, t in enumerate(trajectories):
        mask = t.response_mask[:response_length]
        if len(mask) != len(t.response_ids[:response_length]):
            raise ValueError(f"to_batch: trajectory {i} has {len(t.response_ids)} response ids but "
                             f"{len(t.response_mask)} mask entries")
        if mask:
            loss_mask[i, : len(mask)] = torch.as_tensor(mask, dtype=loss_mask.dtype)
    batch = {**out.batch, "response_mask": loss_mask.to(out.batch["attention_mask"].device)}
    extra = {}
    extra["num_turns"] = np.array([t.num_turns for t in trajectories], dtype=np.int64)
    extra["truncated"] = np.array(
        [t.truncated or len(t.response_ids) > response_length for t in trajectories], dtype=bool)
    extra["tool_calls"] = np.array([t.tool_calls for t in trajectories], dtype=np.int64)
    if any(t.reward is not None for t in trajectories):
        extra["agent_reward"] = np.array(
            [np.nan if t.reward is None else float(t.reward) for t in trajectories], dtype=np.float64)
    return DataProto(batch=batch, non_tensor_batch={**out.non_tensor_batch, **extra}, meta_info=out.meta_info)
