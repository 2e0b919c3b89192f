"""Batches of dataset indices across epochs, resumable at the exact batch where a run stopped.

Epoch e's order is a pure function of (seed, e), so the state is just (epoch, position):
a resumed run draws the same batches an uninterrupted run would have drawn.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np


class ResumableSampler:
    def __init__(self, dataset_len: int, batch_size: int, seed: int, shuffle: bool = True, drop_last: bool = True):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if dataset_len < (batch_size if drop_last else 1):
            raise ValueError(
                f"dataset of {dataset_len} rows cannot fill one batch of {batch_size} (drop_last={drop_last})"
            )
        self.dataset_len = dataset_len
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.epoch = 0
        self.position = 0  # batches already taken in this epoch

    def __len__(self) -> int:
        """Batches per epoch."""
        full, rest = divmod(self.dataset_len, self.batch_size)
        return full if self.drop_last or rest == 0 else full + 1

    def _order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.dataset_len)
        return np.random.default_rng([self.seed, epoch]).permutation(self.dataset_len)

    def next_batch(self) -> list[int]:
        """The next batch of indices; moves on to the next epoch after the last batch of this one."""
        if self.position >= len(self):
            self.epoch, self.position = self.epoch + 1, 0
        start = self.position * self.batch_size
        batch = self._order(self.epoch)[start : start + self.batch_size].tolist()
        self.position += 1
        return batch

    def __iter__(self) -> Iterator[list[int]]:
        """The rest of the current epoch (all of it after a finished one), like one pass of a DataLoader."""
        if self.position >= len(self):
            self.epoch, self.position = self.epoch + 1, 0
        while self.position < len(self):
            yield self.next_batch()

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "dataset_len": self.dataset_len,
                "batch_size": self.batch_size, "shuffle": self.shuffle, "drop_last": self.drop_last}

    def load_state_dict(self, state: dict) -> None:
        """Restore (epoch, position); refuses a state from different data or batching, which would not resume."""
        for key in ("seed", "dataset_len", "batch_size", "shuffle", "drop_last"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(f"sampler state has {key}={state[key]!r} but this sampler has {getattr(self, key)!r}; "
                                 "resuming would not continue the same data order")
        if not 0 <= state["position"] <= len(self):
            raise ValueError(f"sampler state position {state['position']} outside 0..{len(self)} batches per epoch")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
