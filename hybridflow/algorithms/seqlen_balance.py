"""DP length balancing (trainer.balance_batch): a row permutation that gives every DP rank about the same tokens.

DP dispatch (hybridflow/controller/dispatch.py) splits a batch into k equal consecutive shards, so a balanced
order is k groups of exactly B/k rows each whose token sums are close. Pure logic; the driver applies the
permutation with DataProto.reorder (hybridflow/trainer/ppo_trainer.py).

Method: greedy largest-first under the row-count cap (each row, longest first, goes to the lightest group that
still has room), then pairwise swaps between the heaviest and the lightest group while a swap lowers the
heaviest. Greedy alone already bounds the spread by about the longest row; the swaps close the rest on small
groups, where the cap makes greedy's last picks forced.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

_MAX_SWAPS = 1000  # each swap strictly lowers the heaviest group or the spread, so this is only a guard


def balanced_partitions(lengths: Sequence[int], k: int) -> list[list[int]]:
    """k lists of row indices, each exactly len(lengths)/k long, with close length sums; indices sorted."""
    n = len(lengths)
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"balanced_partitions: k must be an int >= 1, got {k!r}")
    if n % k:
        raise ValueError(f"balanced_partitions: {n} rows do not split into {k} equal parts")
    cap = n // k
    groups: list[list[int]] = [[] for _ in range(k)]
    sums = [0] * k
    # ties broken by index, so the result is deterministic
    for i in sorted(range(n), key=lambda i: (-lengths[i], i)):
        g = min((g for g in range(k) if len(groups[g]) < cap), key=lambda g: (sums[g], g))
        groups[g].append(i)
        sums[g] += lengths[i]
    for _ in range(_MAX_SWAPS):
        hi = max(range(k), key=lambda g: sums[g])
        lo = min(range(k), key=lambda g: sums[g])
        gap = sums[hi] - sums[lo]
        # moving d = l_a - l_b from hi to lo leaves a spread of |gap - 2d| between the two; best d is gap/2
        best = None
        for a in groups[hi]:
            for b in groups[lo]:
                d = lengths[a] - lengths[b]
                if 0 < d < gap and (best is None or abs(gap - 2 * d) < best[0]):
                    best = (abs(gap - 2 * d), a, b, d)
        if best is None:
            break
        _, a, b, d = best
        groups[hi][groups[hi].index(a)] = b
        groups[lo][groups[lo].index(b)] = a
        sums[hi] -= d
        sums[lo] += d
    return [sorted(g) for g in groups]


def balance_permutation(lengths: Sequence[int], k: int) -> list[int]:
    """The order in which to put the rows so that k equal consecutive shards are balanced."""
    return [i for g in balanced_partitions(lengths, k) for i in g]


def imbalance(lengths: Sequence[int], k: int) -> float:
    """max over mean of the token sums of k equal consecutive shards (1.0: perfectly even)."""
    n = len(lengths)
    if n % k:
        raise ValueError(f"imbalance: {n} rows do not split into {k} equal parts")
    size = n // k
    sums = [sum(lengths[r * size:(r + 1) * size]) for r in range(k)]
    mean = sum(sums) / k
    return max(sums) / mean if mean > 0 else 1.0


def balance_parts(n_rows: int, actor_dp: int, critic_dp: int | None = None) -> int:
    """How many equal parts to balance: the lcm of the actor's and the critic's DP sizes when the batch splits
    into it (any run of consecutive balanced parts is balanced too, so both groups are served), else the
    actor's (its passes are the most: old log-prob, ref, update)."""
    if critic_dp and critic_dp != actor_dp:
        both = math.lcm(actor_dp, critic_dp)
        if n_rows % both == 0:
            return both
    return actor_dp


def measure_imbalance(batch, report_dp: int) -> dict[str, float]:
    """perf/dp_token_imbalance of `batch` as it stands (trainer.balance_batch off): what balancing would fix."""
    lengths = [int(x) for x in batch.batch["attention_mask"].sum(-1).tolist()]
    return {"perf/dp_token_imbalance": imbalance(lengths, report_dp)} if len(lengths) % report_dp == 0 else {}


def balance_batch(batch, parts: int, report_dp: int) -> dict[str, float]:
    """Reorders `batch` (a DataProto) in place so `parts` equal consecutive shards hold about the same valid
    tokens (attention_mask sums: prompt + response); returns the imbalance over `report_dp` shards before and
    after. A batch that does not split into `parts` is left as it is (dispatch pads it) and only measured."""
    lengths = [int(x) for x in batch.batch["attention_mask"].sum(-1).tolist()]
    out = {}
    if len(lengths) % report_dp == 0:
        out["perf/dp_token_imbalance_before"] = imbalance(lengths, report_dp)
    if len(lengths) % parts == 0 and parts > 1:
        perm = balance_permutation(lengths, parts)
        batch.reorder(perm)
        lengths = [lengths[i] for i in perm]
    if len(lengths) % report_dp == 0:
        out["perf/dp_token_imbalance"] = imbalance(lengths, report_dp)
    return out
