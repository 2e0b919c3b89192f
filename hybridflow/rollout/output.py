"""Turns per-sample generated token lists into the verl-shaped output batch.

Both engines end with a list of token ids and a list of log-probs per sample
(already cut at the stop token); this module is the one place that pads them,
builds the masks and continues the position ids, so the engines cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hybridflow.protocol import DataProto
from hybridflow.rollout.base import prompt_position_ids

# Keys the rollout writes; an input tensor of the same name (other than the prompt's
# input_ids/attention_mask/position_ids, which are extended) would be ambiguous.
OUTPUT_KEYS = ("prompts", "responses", "input_ids", "attention_mask", "position_ids", "response_mask",
               "rollout_log_probs")


def assemble_rollout_output(
    prompts: DataProto,
    responses: Sequence[Sequence[int]],
    log_probs: Sequence[Sequence[float]] | None,
    n: int,
    response_length: int,
    pad_token_id: int,
) -> DataProto:
    """Builds the output of `Rollout.generate_sequences` (keys in hybridflow.rollout.base).

    responses[i * n + j] / log_probs[i * n + j]: sample j of prompt row i, each already cut after
    its stop token and at most `response_length` long. log_probs None (rollout.calculate_log_probs=false):
    the output has no rollout_log_probs.
    """
    num_rows = len(prompts)
    with_log_probs = log_probs is not None
    if not with_log_probs:
        log_probs = [()] * len(responses)
    if len(responses) != num_rows * n or len(log_probs) != num_rows * n:
        raise ValueError(f"rollout output: {num_rows} prompts x n={n} needs {num_rows * n} samples, "
                         f"got {len(responses)} responses and {len(log_probs)} log-prob lists")
    clash = [k for k in ("prompts", "responses", "response_mask", "rollout_log_probs") if k in prompts.batch]
    if clash:
        raise KeyError(f"rollout input already has output key(s) {clash}; pass only the prompt fields")

    rows = prompts.repeat(n, interleave=True) if n > 1 else prompts[:]
    prompt_ids = rows.batch["input_ids"]
    prompt_mask = rows.batch["attention_mask"]
    prompt_pos = prompt_position_ids(rows)
    device = prompt_ids.device

    total = len(responses)
    resp = torch.full((total, response_length), pad_token_id, dtype=prompt_ids.dtype)
    resp_logp = torch.zeros((total, response_length), dtype=torch.float32)
    lengths = torch.zeros(total, dtype=torch.long)
    for i, (toks, lps) in enumerate(zip(responses, log_probs)):
        if len(toks) > response_length:
            raise ValueError(f"rollout output: sample {i} has {len(toks)} tokens > response_length={response_length}")
        if with_log_probs and len(lps) != len(toks):
            raise ValueError(f"rollout output: sample {i} has {len(toks)} tokens but {len(lps)} log-probs")
        if toks:
            resp[i, : len(toks)] = torch.as_tensor(list(toks), dtype=prompt_ids.dtype)
            if with_log_probs:
                resp_logp[i, : len(toks)] = torch.as_tensor(list(lps), dtype=torch.float32)
        lengths[i] = len(toks)

    steps = torch.arange(response_length)
    response_mask = (steps.unsqueeze(0) < lengths.unsqueeze(1)).to(prompt_mask.dtype)
    # Positions keep counting through the response (and its padding), as verl does: the model
    # saw the response token at position last_prompt_position + k.
    response_pos = prompt_pos[:, -1:] + (steps + 1).to(device=device, dtype=prompt_pos.dtype).unsqueeze(0)

    resp, resp_logp, response_mask = resp.to(device), resp_logp.to(device), response_mask.to(device)
    generated = {
        "prompts": prompt_ids,
        "responses": resp,
        "input_ids": torch.cat([prompt_ids, resp], dim=1),
        "attention_mask": torch.cat([prompt_mask, response_mask], dim=1),
        "position_ids": torch.cat([prompt_pos, response_pos], dim=1),
        "response_mask": response_mask,
    }
    if with_log_probs:
        generated["rollout_log_probs"] = resp_logp
    extra = {k: v for k, v in rows.batch.items() if k not in generated}
    return DataProto(batch={**generated, **extra}, non_tensor_batch=dict(rows.non_tensor_batch),
                     meta_info=dict(prompts.meta_info))


def cut_at_stop(tokens: Sequence[int], stop_ids: set[int]) -> int:
    """Length of `tokens` up to and including the first stop id (all of it if none occurs)."""
    for i, t in enumerate(tokens):
        if t in stop_ids:
            return i + 1
    return len(tokens)
