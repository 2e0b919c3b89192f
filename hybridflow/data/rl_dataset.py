"""Prompts for RL from parquet files in verl's layout, tokenised once up front.

A row holds:
  prompt        list of chat messages [{"role": "user", "content": ...}] (a plain string also works)
  data_source   which rule reward scores it, e.g. "openai/gsm8k"
  reward_model  struct with "ground_truth" (and "style")
  extra_info    optional struct passed to custom reward functions
  ability       optional tag
so a parquet file prepared by verl's examples/data_preprocess scripts loads as is.
"""

from __future__ import annotations

import logging
import pathlib
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)

REQUIRED_COLUMNS = ("data_source", "reward_model")
TRUNCATIONS = ("error", "left", "right", "middle")  # data.truncation, verl's choices
OPTIONAL_COLUMNS = ("extra_info", "ability")


def _read_rows(file: str, prompt_key: str) -> list[dict]:
    import pyarrow.parquet as pq

    path = pathlib.Path(file)
    if not path.is_file():
        raise FileNotFoundError(f"data file {file!r} does not exist")
    import pyarrow as pa

    try:
        schema = pq.read_schema(path)
    except (pa.ArrowInvalid, OSError) as e:  # e.g. "Parquet magic bytes not found": a CSV or JSONL renamed
        raise ValueError(f"data file {file!r} is not a readable parquet file ({e})") from None
    for column in (prompt_key, *REQUIRED_COLUMNS):
        if column not in schema.names:
            raise KeyError(f"data file {file!r} has no column {column!r} (columns: {schema.names})")
    reward_type = schema.field("reward_model").type
    if hasattr(reward_type, "get_field_index") and reward_type.get_field_index("ground_truth") < 0:
        fields = [reward_type.field(i).name for i in range(reward_type.num_fields)]
        raise KeyError(f"column 'reward_model' of data file {file!r} has no field 'ground_truth' (fields: {fields})")
    columns = [prompt_key, *REQUIRED_COLUMNS, *(c for c in OPTIONAL_COLUMNS if c in schema.names)]
    rows = pq.read_table(path, columns=columns).to_pylist()
    if not rows:
        raise ValueError(f"data file {file!r} has no rows")
    return rows


class RLDataset:
    """Token ids (unpadded) plus the raw fields the reward needs, one entry per kept prompt."""

    def __init__(
        self,
        files: list[str] | str,
        tokenizer,
        prompt_key: str = "prompt",
        max_prompt_length: int = 64,
        apply_chat_template: bool = True,
        filter_overlong_prompts: bool = True,
        truncation: str = "error",
    ):
        if truncation not in TRUNCATIONS:
            raise ValueError(f"data.truncation={truncation!r}; choose one of {', '.join(TRUNCATIONS)}")
        files = [files] if isinstance(files, str) else list(files)
        if not files:
            raise ValueError("RLDataset needs at least one data file (data.train_files / data.val_files is empty)")
        self.files = files
        self.prompt_key = prompt_key
        self.max_prompt_length = max_prompt_length
        self.apply_chat_template = apply_chat_template

        rows, origin = [], []  # origin: (file, row number) for error messages
        for file in files:
            file_rows = _read_rows(file, prompt_key)
            rows.extend(file_rows)
            origin.extend((file, i) for i in range(len(file_rows)))
        self.origin = origin  # by item["index"]: (file, row) for error messages downstream
        for row, (file, i) in zip(rows, origin):
            if not isinstance(row["data_source"], str) or not row["data_source"]:
                raise ValueError(f"data file {file!r} row {i}: data_source is {row['data_source']!r}; it names the "
                                 "reward scorer (e.g. 'openai/gsm8k') and must be a non-empty string")
            reward = row["reward_model"]
            if not isinstance(reward, dict) or "ground_truth" not in reward or reward["ground_truth"] is None:
                raise ValueError(f"data file {file!r} row {i}: reward_model has no ground_truth ({reward!r})")

        texts = [self._prompt_text(row[prompt_key], tokenizer, file, i) for row, (file, i) in zip(rows, origin)]
        # Chat templates already carry bos; a plain prompt gets whatever the tokenizer adds by default.
        encoded = tokenizer(texts, add_special_tokens=not apply_chat_template)["input_ids"]

        self._items: list[dict[str, Any]] = []
        self.num_truncated = 0
        for index, (row, ids) in enumerate(zip(rows, encoded)):
            if len(ids) > max_prompt_length:
                if filter_overlong_prompts:  # as in verl, filtering comes first: truncation only sees what is kept
                    continue
                file, i = origin[index]
                ids = truncate_prompt(list(ids), max_prompt_length, truncation, f"data file {file!r} row {i}")
                self.num_truncated += 1
            self._items.append({
                "input_ids": list(ids),
                "raw_prompt": row[prompt_key],
                "data_source": row["data_source"],
                "ground_truth": row["reward_model"]["ground_truth"],
                "extra_info": row.get("extra_info") or {},
                "ability": row.get("ability"),
                "index": index,  # position across all files before filtering: stable and unique
            })
        self.num_total = len(rows)
        self.num_filtered = self.num_total - len(self._items)
        if self.num_filtered:
            logger.warning("filtered %d of %d prompts longer than max_prompt_length=%d tokens (%s)",
                           self.num_filtered, self.num_total, max_prompt_length, ", ".join(files))
        if self.num_truncated:
            logger.warning("truncated %d of %d prompts to max_prompt_length=%d tokens (data.truncation=%s; %s)",
                           self.num_truncated, self.num_total, max_prompt_length, truncation, ", ".join(files))
        if not self._items:
            raise ValueError(f"no prompts left in {files}: all {self.num_total} are longer than "
                             f"max_prompt_length={max_prompt_length} tokens")

    @classmethod
    def from_config(cls, files: list[str] | str, tokenizer, data) -> RLDataset:
        """As the run reads a DataConfig's files: the same prompt length, filtering and truncation for train
        and val files, and for the up-front check (hybridflow.config.checks.data_files)."""
        return cls(files, tokenizer, prompt_key=data.prompt_key, max_prompt_length=data.max_prompt_length,
                   apply_chat_template=data.apply_chat_template,
                   filter_overlong_prompts=data.filter_overlong_prompts, truncation=data.truncation)

    def _prompt_text(self, prompt, tokenizer, file: str, row: int) -> str:
        where = f"data file {file!r} row {row}: column {self.prompt_key!r}"
        if isinstance(prompt, str):
            messages = [{"role": "user", "content": prompt}]
        elif isinstance(prompt, list) and all(isinstance(m, dict) and "content" in m for m in prompt):
            messages = prompt
        else:
            raise ValueError(f"{where} must be a string or a list of chat messages, got {type(prompt).__name__}: "
                             f"{prompt!r:.200}")
        # An empty prompt would still tokenise (to the template's bos and generation prompt alone) and train on
        # nothing the data meant; a None content would render as the text "None".
        if not messages:
            raise ValueError(f"{where} is an empty list of chat messages")
        bad = [(j, m["content"]) for j, m in enumerate(messages) if not isinstance(m["content"], str)]
        if bad:
            j, content = bad[0]
            raise ValueError(f"{where}: message {j} has content of type {type(content).__name__} ({content!r:.80}), "
                             "not a string")
        if not any(m["content"].strip() for m in messages):
            raise ValueError(f"{where} is empty (no text in any message)")
        if not self.apply_chat_template:
            return prompt if isinstance(prompt, str) else "\n".join(m["content"] for m in messages)
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self._items[i]


def truncate_prompt(ids: list[int], max_length: int, truncation: str, where: str = "prompt") -> list[int]:
    """A prompt's token ids cut to `max_length` as verl's data.truncation does: left keeps the last tokens
    (the end of the prompt, where generation starts), right the first, middle the first max_length // 2 and
    the last max_length - max_length // 2; error refuses (naming `where`)."""
    if len(ids) <= max_length:
        return ids
    if truncation == "left":
        return ids[-max_length:]
    if truncation == "right":
        return ids[:max_length]
    if truncation == "middle":
        head = max_length // 2
        return ids[:head] + ids[len(ids) - (max_length - head):]
    if truncation == "error":
        raise ValueError(f"{where}: prompt has {len(ids)} tokens > data.max_prompt_length={max_length} and "
                         "data.truncation='error'; set data.filter_overlong_prompts=true (drop such prompts) or "
                         "data.truncation=left|right|middle (cut them)")
    raise ValueError(f"data.truncation={truncation!r}; choose one of {', '.join(TRUNCATIONS)}")


def _object_array(values: list) -> np.ndarray:
    # np.array(values, dtype=object) would turn a list of equal-length lists into a 2-D array.
    out = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):
        out[i] = v
    return out


def collate(rows: list[dict], pad_id: int, max_prompt_length: int) -> tuple[dict[str, torch.Tensor], dict]:
    """Left-pad prompts to max_prompt_length, so every prompt ends where generation starts.

    Returns (tensors, non_tensors): input_ids, attention_mask, position_ids (B, max_prompt_length)
    int64 (position 0 at the first real token, pads also 0), and object arrays data_source,
    ground_truth, extra_info, raw_prompt and index.
    """
    if not rows:
        raise ValueError("collate got no rows")
    too_long = [(r["index"], len(r["input_ids"])) for r in rows if len(r["input_ids"]) > max_prompt_length]
    if too_long:
        raise ValueError(f"prompts longer than max_prompt_length={max_prompt_length} (index, length): {too_long[:8]}")
    batch = len(rows)
    input_ids = torch.full((batch, max_prompt_length), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((batch, max_prompt_length), dtype=torch.long)
    for i, row in enumerate(rows):
        n = len(row["input_ids"])
        if n:
            input_ids[i, -n:] = torch.tensor(row["input_ids"], dtype=torch.long)
            attention_mask[i, -n:] = 1
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    tensors = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
    non_tensors = {key: _object_array([r[key] for r in rows])
                   for key in ("data_source", "ground_truth", "extra_info", "raw_prompt", "index")}
    return tensors, non_tensors
