"""The one bounded wait on a point-to-point work (the reshard's buckets, the cross-pool sync's messages)."""

from __future__ import annotations

import datetime


def wait_or_raise(work, timeout: datetime.timedelta, error: type[Exception], what: str) -> None:
    """work.wait(timeout), raising `error` naming `what` when it fails or times out (gloo raises, NCCL returns False):
    a peer that died or hung ends the transfer with a message instead of a hang."""
    try:
        ok = work.wait(timeout)
    except RuntimeError as e:
        raise error(f"{what} failed or timed out after {timeout.total_seconds():.0f} s: {e}") from e
    if ok is False:
        raise error(f"{what} timed out after {timeout.total_seconds():.0f} s")
