"""vLLM's continuous batching of one replica's requests over its paged KV cache, as events: pure, no I/O.

What vLLM does (its docs, "Preemption"; the V1 scheduler): a waiting request is admitted when the KV blocks for
its prompt are free and fewer than max_num_seqs run; every running request then decodes one token per step and
takes KV blocks as it grows. When a step finds no free block, the newest running request is preempted: its blocks
are freed, it goes back to the front of the waiting queue with the tokens it generated, and when it is admitted
again it recomputes them (one prefill of prompt + generated tokens) and goes on. So a replica holding a few more
requests than its KV cache fits at full length starts them all, and pays for the overflow late, with a recompute,
not by running the overflow from scratch after the others.

Modelled at token granularity (blocks of one token, no watermark), in arrival order; no request is admitted in the
same event that preempted one (the scheduler does not schedule waiting requests in a step that preempted).
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field


@dataclass
class Batching:
    """segments: (running sequences, steps, KV tokens per step on average), one per stretch between events; the
    long tail is the last segments, where few sequences decode and each step still reads every weight.
    recomputed: the context (prompt + generated tokens) of every re-admitted preempted request, each one prefill."""

    segments: list[tuple[int, int, float]] = field(default_factory=list)
    recomputed: list[float] = field(default_factory=list)

    @property
    def steps(self) -> int:
        return sum(steps for _, steps, _ in self.segments)


def continuous_batching(lengths: list[int], kv_tokens: float, max_seqs: int, prompt: float) -> Batching:
    """Decode `lengths` (response tokens per request, arrival order) on one replica whose KV cache holds `kv_tokens`
    tokens, at most `max_seqs` running, every prompt `prompt` tokens long (the module docstring)."""
    out = Batching()
    if not lengths:
        return out
    if prompt + max(lengths) > kv_tokens:
        raise ValueError(f"a request of {prompt:g} + {max(lengths)} tokens does not fit a KV cache of {kv_tokens:g}")
    max_seqs = max(1, max_seqs)
    waiting: deque[tuple[int, int]] = deque((length, 0) for length in lengths)  # (length, tokens generated so far)
    # running: finish step -> entries; each entry (finish, order, start, done_at_start, length); the KV a request
    # holds at step s is prompt + done_at_start + (s - start)
    running: list[tuple[int, int, int, int, int]] = []
    order = 0  # admission order: the newest running request is preempted first
    offset = 0.0  # sum over running of (done_at_start - start): KV(s) = n * prompt + offset + n * s
    now = 0

    def kv(step: int) -> float:
        return len(running) * prompt + offset + len(running) * step

    def admit() -> None:
        nonlocal order, offset
        while waiting and len(running) < max_seqs:
            length, done = waiting[0]
            if kv(now) + prompt + done > kv_tokens:
                break
            waiting.popleft()
            if done:
                out.recomputed.append(prompt + done)
            heapq.heappush(running, (now + length - done, order, now, done, length))
            order += 1
            offset += done - now

    admit()
    while running:
        n = len(running)
        finish = running[0][0]
        room = int((kv_tokens - kv(now)) // n)  # steps every running request can still take a block for
        if room <= 0:
            # preempt the newest until the rest can take one more step
            while running and kv(now) + len(running) > kv_tokens:
                newest = max(running, key=lambda e: e[1])
                running.remove(newest)
                heapq.heapify(running)
                _, _, start, done, length = newest
                offset -= done - start
                waiting.appendleft((length, done + now - start))
            continue
        end = min(finish, now + room)
        steps = end - now
        total = steps * (n * prompt + offset) + n * (now + end - 1) * steps / 2
        out.segments.append((n, steps, total / steps))
        now = end
        finished = False
        while running and running[0][0] == now:
            _, _, start, done, _ = heapq.heappop(running)
            offset -= done - start
            finished = True
        if finished or not running:
            admit()
    return out
