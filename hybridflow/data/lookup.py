"""Rows for the agent demo's lookup task (hybridflow/rewards/lookup.py), in verl's parquet layout."""

from __future__ import annotations

import random
import string

from hybridflow.rewards.lookup import DATA_SOURCE, make_prompt, secret


def make_lookup_rows(n: int, seed: int, key_length: int = 3, split: str = "train",
                     exclude: set[str] | frozenset[str] = frozenset()) -> list[dict]:
    """n distinct random lower-case keys and their secret values; `exclude` keeps test keys out of train."""
    possible = 26 ** key_length - len(exclude)
    if n > possible:
        raise ValueError(f"asked for {n} distinct keys of length {key_length}; only {possible} exist")
    rng = random.Random(seed)
    seen: set[str] = set()
    rows = []
    while len(rows) < n:
        key = "".join(rng.choice(string.ascii_lowercase) for _ in range(key_length))
        if key in seen or key in exclude:
            continue
        seen.add(key)
        rows.append({
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": make_prompt(key)}],
            "ability": "tool_use",
            "reward_model": {"style": "rule", "ground_truth": secret(key)},
            "extra_info": {"split": split, "index": len(rows), "key": key},
        })
    return rows
