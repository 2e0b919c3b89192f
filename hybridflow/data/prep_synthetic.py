"""Write train/test parquet files for the reverse task; no test string appears in train.

CLI: python -m hybridflow.data.prep_synthetic --out data/reverse --train-size 2048 --test-size 128
"""

from __future__ import annotations

import argparse
import pathlib

from hybridflow.data.synthetic import DEFAULT_ALPHABET, make_reverse_rows, write_parquet


def prepare(out_dir, train_size: int, test_size: int, seed: int = 0, min_len: int = 3, max_len: int = 5,
            alphabet: str = DEFAULT_ALPHABET) -> tuple[pathlib.Path, pathlib.Path]:
    out = pathlib.Path(out_dir)
    test = make_reverse_rows(test_size, seed + 1, min_len, max_len, alphabet, split="test")
    held_out = {row["extra_info"]["text"] for row in test}
    train = make_reverse_rows(train_size, seed, min_len, max_len, alphabet, split="train", exclude=held_out)
    write_parquet(train, out / "train.parquet")
    write_parquet(test, out / "test.parquet")
    return out / "train.parquet", out / "test.parquet"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--train-size", type=int, default=2048)
    p.add_argument("--test-size", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--min-len", type=int, default=3)
    p.add_argument("--max-len", type=int, default=5)
    p.add_argument("--alphabet", default=DEFAULT_ALPHABET)
    args = p.parse_args(argv)
    paths = prepare(args.out, args.train_size, args.test_size, args.seed, args.min_len, args.max_len, args.alphabet)
    print("wrote", *paths)


if __name__ == "__main__":
    main()
