"""Independent references for the rollout tests: prompts, HF greedy, teacher-forced log-probs.

Kept free of hybridflow.rollout code on purpose: the tests compare the rollouts against these.
"""

from __future__ import annotations

import torch

from hybridflow.protocol import DataProto

# Different lengths (1 to 27 characters) so left padding and per-row positions matter.
PROMPT_TEXTS = [
    "hi",
    "a",
    "what is 2+2?",
    "The quick brown fox jumps",
    "x=1; y=2; print(x+y)",
    "Once upon a time",
    "0123456789",
    "RL from human feedback!",
    "zz top",
]


def make_prompts(tokenizer, texts=PROMPT_TEXTS, meta_info=None) -> DataProto:
    """Left-padded prompts with a bos in front, plus a per-row uid to follow through repeats."""
    rows = [[tokenizer.bos_token_id, *tokenizer(t, add_special_tokens=False)["input_ids"]] for t in texts]
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.tensor(r)
        mask[i, width - len(r):] = 1
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    return DataProto.from_dict({"input_ids": ids, "attention_mask": mask, "position_ids": pos},
                               {"uid": [f"u{i}" for i in range(len(rows))]}, meta_info=meta_info or {})


@torch.no_grad()
def hf_greedy(model, prompts: DataProto, max_new_tokens: int) -> list[list[int]]:
    """Plain HF greedy decoding of each row, no stop tokens, attention_mask passed explicitly."""
    ids, mask = prompts.batch["input_ids"], prompts.batch["attention_mask"]
    # An out-of-vocabulary eos id never matches, so every row runs the full length.
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=[model.config.vocab_size], pad_token_id=model.config.pad_token_id)
    return out[:, ids.shape[1]:].tolist()


@torch.no_grad()
def teacher_forced_log_probs(model, output: DataProto, temperature: float = 1.0) -> torch.Tensor:
    """log_softmax(logits / T) of each response token, from one forward pass over prompt+response."""
    prompt_len = output.batch["prompts"].shape[1]
    responses = output.batch["responses"]
    logits = model(input_ids=output.batch["input_ids"], attention_mask=output.batch["attention_mask"],
                   position_ids=output.batch["position_ids"]).logits.float()
    # Position t predicts token t+1: the response tokens are predicted from P-1 .. P+R-2.
    step_logits = logits[:, prompt_len - 1: prompt_len - 1 + responses.shape[1]] / temperature
    logp = torch.log_softmax(step_logits, dim=-1).gather(-1, responses.unsqueeze(-1)).squeeze(-1)
    return logp * output.batch["response_mask"]
