"""What a sample dump holds (trainer.rollout_data_dir / validation_data_dir, one JSON line per sample): the prompt,
the response and how it scored, with the token ids so a sample can be re-scored exactly, and an agent loop's
transcript turn by turn. Pure: RayPPOTrainer.dump_samples writes the lines; launch/plan/lengths.py reads them."""

from __future__ import annotations

from hybridflow.protocol import DataProto


def rollout_records(batch: DataProto, tokenizer, responses: list[str], step: int) -> list[dict]:
    """One dict per sample of a scored batch (see RayPPOTrainer.dump_samples)."""
    b, nt = batch.batch, batch.non_tensor_batch
    r = b["responses"].shape[1]
    prompt_mask = b["attention_mask"][:, :-r].bool()
    response_mask = b["response_mask"].bool()
    score = b["token_level_scores"].sum(-1)
    rm_score = b["rm_scores"].sum(-1) if "rm_scores" in b else None
    advantage = None  # validation batches have none
    if "advantages" in b:
        advantage = (b["advantages"] * response_mask).sum(-1) / response_mask.sum(-1).clamp(min=1)
    out = []
    for i in range(len(responses)):
        prompt_ids = b["input_ids"][i, :-r][prompt_mask[i]].tolist()
        record = {"step": step, **{k: nt[k][i] if k in nt else None for k in ("uid", "data_source", "ground_truth")},
                  "prompt": tokenizer.decode(prompt_ids, skip_special_tokens=False),
                  "response": responses[i], "score": float(score[i]),
                  "prompt_ids": prompt_ids, "response_ids": b["responses"][i][response_mask[i]].tolist()}
        if advantage is not None:
            record["advantage_mean"] = float(advantage[i])
        if "index" in nt:  # the prompt's row in its dataset (validation dumps: which val prompt)
            record["index"] = int(nt["index"][i])
        if rm_score is not None:
            record["rm_score"] = float(rm_score[i])
        if "reward_baselines" in b:  # ReMax: the greedy response's score (its samples: baseline_step_<N>.jsonl)
            record["reward_baseline"] = float(b["reward_baselines"][i])
        if "num_turns" in nt:  # an agent loop's trajectory: the transcript turn by turn (tool turns: mask 0)
            record["num_turns"] = int(nt["num_turns"][i])
            record["turns"] = transcript(b["responses"][i], b["attention_mask"][i, -r:], b["response_mask"][i],
                                         tokenizer)
        out.append(record)
    return out


def transcript(response_ids, attention, loss_mask, tokenizer) -> list[dict]:
    """[{role: assistant | tool, ids, text}]: the response cut where the loss mask changes (the loop's inserted tokens
    are the tool turns), decoded with the special tokens, so the chat boundaries show."""
    turns: list[dict] = []
    ids = response_ids[attention.bool()].tolist()
    mask = loss_mask[attention.bool()].tolist()
    start = 0
    for k in range(1, len(ids) + 1):
        if k == len(ids) or mask[k] != mask[start]:
            turns.append({"role": "assistant" if mask[start] else "tool", "ids": ids[start:k],
                          "text": tokenizer.decode(ids[start:k], skip_special_tokens=False)})
            start = k
    return turns
