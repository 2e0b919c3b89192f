"""Convert a local GSM8K file (jsonl or parquet with question/answer) into our parquet layout.

The layout and the instruction match verl's gsm8k preprocessing, so parquet files from
either tool are interchangeable. No network: point it at a file you already have.

CLI: python -m hybridflow.data.prep_gsm8k --input train.jsonl --split train --out data/gsm8k/train.parquet
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re

from hybridflow.data.synthetic import write_parquet
from hybridflow.rewards.gsm8k import DATA_SOURCE

INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
_FINAL = re.compile(r"####\s*(-?[0-9.,]+)")


def final_answer(answer: str, where: str) -> str:
    """'... #### 1,234' -> '1234' (the ground truth the reward compares against)."""
    found = _FINAL.search(answer)
    if found is None:
        raise ValueError(f"{where}: answer has no '#### <number>' line: {answer[-120:]!r}")
    return found.group(1).replace(",", "")


def read_examples(path: str) -> list[dict]:
    file = pathlib.Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"GSM8K input {path!r} does not exist")
    if file.suffix == ".parquet":
        import pyarrow.parquet as pq

        examples = pq.read_table(file).to_pylist()
    else:
        examples = [json.loads(line) for line in file.read_text().splitlines() if line.strip()]
    for i, ex in enumerate(examples):
        for key in ("question", "answer"):
            if key not in ex:
                raise KeyError(f"{path} row {i}: no {key!r} field (fields: {sorted(ex)})")
    return examples


def to_rows(examples: list[dict], split: str, source: str = "input") -> list[dict]:
    rows = []
    for i, ex in enumerate(examples):
        rows.append({
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": ex["question"] + " " + INSTRUCTION}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": final_answer(ex["answer"], f"{source} row {i}")},
            "extra_info": {"split": split, "index": i, "answer": ex["answer"], "question": ex["question"]},
        })
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--input", required=True, help="GSM8K .jsonl or .parquet with question and answer")
    p.add_argument("--split", default="train")
    p.add_argument("--out", required=True, help="output .parquet")
    args = p.parse_args(argv)
    rows = to_rows(read_examples(args.input), args.split, args.input)
    write_parquet(rows, args.out)
    print(f"wrote {len(rows)} rows to {args.out}")


if __name__ == "__main__":
    main()
