"""Half-open index intervals along one tensor dimension, and the shard layouts built from them.

The resharding planner describes "which rows of the full (TP=1) tensor does a rank hold / need"
as an ordered tuple of disjoint intervals along the partition dimension. The order matters: a
local shard tensor is the concatenation of its intervals in that order (for `partition_stride=2`
the fc1 shard [gate_r; up_r] is two intervals, one in each half of the full tensor).
"""

from __future__ import annotations

from functools import lru_cache

Interval = tuple[int, int]
Intervals = tuple[Interval, ...]


def total_length(ivs: Intervals) -> int:
    return sum(b - a for a, b in ivs)


def intersect(a: Intervals, b: Intervals) -> Intervals:
    """Pieces of `a` that also lie in `b`, in the order of `a` (each piece inside one interval of both)."""
    out = []
    for a0, a1 in a:
        for b0, b1 in b:
            lo, hi = max(a0, b0), min(a1, b1)
            if lo < hi:
                out.append((lo, hi))
    return tuple(out)


def subtract(a: Intervals, b: Intervals) -> Intervals:
    """Pieces of `a` not covered by `b`, in the order of `a`."""
    out = []
    for a0, a1 in a:
        pieces = [(a0, a1)]
        for b0, b1 in b:
            nxt = []
            for p0, p1 in pieces:
                if b1 <= p0 or b0 >= p1:
                    nxt.append((p0, p1))
                    continue
                if p0 < b0:
                    nxt.append((p0, b0))
                if b1 < p1:
                    nxt.append((b1, p1))
            pieces = nxt
        out.extend(pieces)
    return tuple(out)


def merge_adjacent(ivs: Intervals) -> Intervals:
    """Sort and join touching intervals (for messages: fewer, larger pieces)."""
    out: list[list[int]] = []
    for a, b in sorted(ivs):
        if out and out[-1][1] == a:
            out[-1][1] = b
        else:
            out.append([a, b])
    return tuple((a, b) for a, b in out)


def local_offset(layout: Intervals, start: int, stop: int) -> int:
    """Offset in a local shard (the concatenation of `layout`) of full-space piece [start, stop).

    The piece must lie inside one interval of the layout.
    """
    offset = 0
    for a, b in layout:
        if a <= start and stop <= b:
            return offset + (start - a)
        offset += b - a
    raise ValueError(f"piece [{start}, {stop}) is not inside one interval of the shard layout {layout}")


@lru_cache(maxsize=65536)  # pure in its ints; the planner asks for the same few shards per parameter shape
def strided_shard(length: int, stride: int, parts: int, index: int) -> Intervals:
    """Megatron's TP shard `index` of `parts` for a dimension of `length` with `partition_stride`.

    The full dimension is `stride` equal blocks (fc1: [gate; up]); shard `index` holds the
    `index`-th of `parts` equal pieces of every block, blocks in order.
    """
    if length % (stride * parts) != 0:
        raise ValueError(f"length {length} is not divisible by stride*parts = {stride}*{parts}")
    block = length // stride
    piece = block // parts
    # Adjacent pieces are joined (parts=1 with stride 2 is one interval): a shard's rows are the
    # concatenation of its intervals in order either way.
    return merge_adjacent(tuple((s * block + index * piece, s * block + (index + 1) * piece) for s in range(stride)))


@lru_cache(maxsize=65536)
def padded_shard(valid: int, pad_multiple: int, parts: int, index: int) -> Intervals:
    """Shard `index` of `parts` when `valid` rows are first padded up to a multiple of `pad_multiple`.

    This is vLLM's vocab-parallel split (pad the vocab to 64, then split evenly); only real rows
    (< valid) are returned, so the last shards may be shorter or empty.
    """
    padded = -(-valid // pad_multiple) * pad_multiple
    if padded % parts != 0:
        raise ValueError(f"padded size {padded} (valid {valid} padded to a multiple of {pad_multiple}) "
                         f"is not divisible by {parts}")
    per = padded // parts
    lo, hi = index * per, min((index + 1) * per, valid)
    return ((lo, hi),) if lo < hi else ()
