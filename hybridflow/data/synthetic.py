"""Rows for the synthetic reverse task, in verl's parquet layout, so they flow through the same RLDataset."""

from __future__ import annotations

import random
import string

from hybridflow.rewards.synthetic import DATA_SOURCE, make_prompt

DEFAULT_ALPHABET = string.digits + string.ascii_lowercase


def make_reverse_rows(
    n: int,
    seed: int,
    min_len: int = 3,
    max_len: int = 5,
    alphabet: str = DEFAULT_ALPHABET,
    split: str = "train",
    exclude: set[str] | frozenset[str] = frozenset(),
) -> list[dict]:
    """n distinct random strings and their reversals; `exclude` keeps test strings out of train."""
    if not 1 <= min_len <= max_len:
        raise ValueError(f"need 1 <= min_len <= max_len, got min_len={min_len}, max_len={max_len}")
    if not alphabet:
        raise ValueError("alphabet is empty")
    possible = sum(len(alphabet) ** k for k in range(min_len, max_len + 1)) - len(exclude)
    if n > possible:
        raise ValueError(f"asked for {n} distinct strings but lengths {min_len}-{max_len} over "
                         f"{len(alphabet)} characters allow only {possible}")
    rng = random.Random(seed)
    seen: set[str] = set()
    rows = []
    while len(rows) < n:
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(min_len, max_len)))
        if text in seen or text in exclude:
            continue
        seen.add(text)
        rows.append({
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": make_prompt(text)}],
            "ability": "reverse",
            "reward_model": {"style": "rule", "ground_truth": text[::-1]},
            "extra_info": {"split": split, "index": len(rows), "text": text},
        })
    return rows


def write_parquet(rows: list[dict], path) -> None:
    """One parquet file; nested dicts and lists become parquet structs and lists, as verl writes them."""
    import pathlib

    import pyarrow as pa
    import pyarrow.parquet as pq

    if not rows:
        raise ValueError(f"no rows to write to {path}")
    pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
