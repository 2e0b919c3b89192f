"""Token-budget micro-batches (verl's use_dynamic_bsz): group rows so each group's valid tokens fit a budget.

Pure logic on row lengths (the attention-mask sum of each row: prompt + response tokens); no torch, no
process groups. The Megatron engine (megatron_workers/engine.py) calls it per mini-batch / forward batch.

Packing is first-fit decreasing: rows are taken longest first and put in the first micro-batch that still
has room, which needs at most ~11/9 of the optimal count. A caller can ask for more micro-batches than the
packing needs (`min_micro_batches`: every DP rank of a train step runs the same count, see the engine); the
extra ones come from halving the heaviest multi-row micro-batch, which never breaks the budget. No
micro-batch is ever empty.

The loss does not depend on this grouping: the engine normalises every micro-batch's loss by the global
(mini-batch, all DP ranks) token or sequence count, not by its own.
"""

from __future__ import annotations

from collections.abc import Sequence


class TokenBudgetError(ValueError):
    pass


def _check(lengths: Sequence[int], max_tokens: int) -> list[int]:
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise TokenBudgetError(f"token budget must be a positive int, got {max_tokens!r}")
    lengths = [int(n) for n in lengths]
    too_long = [(i, n) for i, n in enumerate(lengths) if n > max_tokens]
    if too_long:
        i, n = max(too_long, key=lambda t: t[1])
        raise TokenBudgetError(f"row {i} has {n} valid tokens, more than the token budget {max_tokens} "
                               f"({len(too_long)} such rows); raise the *max_token_len_per_gpu key")
    return lengths


def _first_fit_decreasing(lengths: list[int], max_tokens: int) -> list[list[int]]:
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))  # stable: ties by row index
    groups: list[list[int]] = []
    loads: list[int] = []
    for i in order:
        for g, load in enumerate(loads):
            if load + lengths[i] <= max_tokens:
                groups[g].append(i)
                loads[g] += lengths[i]
                break
        else:
            groups.append([i])
            loads.append(lengths[i])
    return groups


def micro_batches_needed(lengths: Sequence[int], max_tokens: int) -> int:
    """How many micro-batches the packing makes for these rows (0 for no rows)."""
    return len(_first_fit_decreasing(_check(lengths, max_tokens), max_tokens))


def pack_by_token_budget(lengths: Sequence[int], max_tokens: int, min_micro_batches: int = 1) -> list[list[int]]:
    """Row indices per micro-batch; each micro-batch's summed length <= max_tokens; every row exactly once.

    min_micro_batches: make at least this many (needs that many rows). Within a micro-batch the indices are
    ascending; micro-batches are ordered by their first index, so the result is deterministic.
    """
    lengths = _check(lengths, max_tokens)
    if min_micro_batches > len(lengths):
        raise TokenBudgetError(f"cannot make {min_micro_batches} non-empty micro-batches out of {len(lengths)} rows")
    groups = _first_fit_decreasing(lengths, max_tokens)
    while len(groups) < min_micro_batches:
        # Halve the heaviest group that has two rows or more (there is one: rows >= target > groups).
        g = max((g for g in groups if len(g) > 1), key=lambda g: (sum(lengths[i] for i in g), -g[0]))
        groups.remove(g)
        half = len(g) // 2
        groups += [g[:half], g[half:]]
    groups = [sorted(g) for g in groups]
    return sorted(groups, key=lambda g: g[0])


def fixed_micro_batches(n: int, micro_batch_size: int) -> list[list[int]]:
    """Consecutive groups of micro_batch_size rows (the last may be shorter): the non-dynamic split."""
    if micro_batch_size < 1:
        raise TokenBudgetError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    return [list(range(i, min(i + micro_batch_size, n))) for i in range(0, n, micro_batch_size)]


def inverse_permutation(order: Sequence[int]) -> list[int]:
    """inv with order[inv[i]] == i: rows concatenated in `order` come back to their original positions
    by indexing with inv."""
    inv = [-1] * len(order)
    for pos, i in enumerate(order):
        if not 0 <= i < len(order) or inv[i] != -1:
            raise ValueError(f"not a permutation of 0..{len(order) - 1}: {list(order)}")
        inv[i] = pos
    return inv


def padding_fraction(valid_tokens: int, computed_slots: int) -> float:
    """Share of the token slots a forward computed that were padding (0 when nothing ran)."""
    return 0.0 if computed_slots <= 0 else 1.0 - valid_tokens / computed_slots
