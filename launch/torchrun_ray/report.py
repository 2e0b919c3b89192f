"""Pure parts of the end-of-job report: each rank's exit status and the tail of its error."""

from __future__ import annotations

import re
from dataclasses import dataclass

from .plan import RankSlot

# torchrun's ChildFailedError report lists every failed local worker as
#   rank      : 3 (local_rank: 1)
#   exitcode  : 1 (pid: 1234)
# (torch.distributed.elastic.multiprocessing.errors, unchanged since torch 1.9).
_FAILURE_RE = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank:\s*(\d+)\)\s*\n\s*exitcode\s*:\s*(-?\d+)")


_ROOT_MARK = "Root Cause (first observed failure):"


def parse_failures(torchrun_output: str) -> tuple[dict[int, int], int | None]:
    """From torchrun's failure report: global rank -> exit code of each worker it saw fail (signals are
    negative), and the rank it names as the root cause (the first one of its node to fail)."""
    failures = {int(m.group(1)): int(m.group(3)) for m in _FAILURE_RE.finditer(torchrun_output)}
    at = torchrun_output.rfind(_ROOT_MARK)
    root = _FAILURE_RE.search(torchrun_output, at) if at >= 0 else None
    return failures, int(root.group(1)) if root else None


@dataclass
class NodeOutcome:
    """What one node's agent says at the end (plain data, so it crosses Ray as is)."""

    node: int
    host: str
    exit_code: int | None  # torchrun's; None when it never started or could not be reached
    stopped: bool = False  # the launcher stopped it (another node failed, timeout, Ctrl-C)
    failures: dict[int, int] | None = None  # parsed from torchrun's report
    root_cause: int | None = None  # the rank torchrun names as its node's first failure
    stderr_tails: dict[int, list[str]] | None = None  # local rank -> last stderr lines
    error_messages: dict[int, str] | None = None  # local rank -> message from its error.json (@record)
    problem: str = ""  # why the node has no torchrun result (actor died, start failed...)


@dataclass
class RankRow:
    rank: int
    node: int
    local_rank: int
    host: str
    status: str  # ok | failed | stopped | unknown
    exit_code: int | None
    error: list[str]
    first: bool = False  # the root cause of the node that failed first: what broke the job


def rank_rows(slots: list[RankSlot], outcomes: dict[int, NodeOutcome], first_node: int | None = None,
              tail_lines: int = 8) -> list[RankRow]:
    """One row per rank. first_node is the node the launcher saw fail first; its root cause is marked."""
    first_rank = outcomes[first_node].root_cause if first_node in outcomes else None
    rows = []
    for s in slots:
        out = outcomes.get(s.node)
        host = out.host if out else "?"
        failures = (out.failures or {}) if out else {}
        tail = list(((out.stderr_tails or {}).get(s.local_rank) or [])[-tail_lines:]) if out else []
        message = (out.error_messages or {}).get(s.local_rank) if out else None
        if out is None or out.exit_code is None:
            status, code, tail = "unknown", None, [out.problem] if out and out.problem else tail
        elif s.rank in failures:
            code = failures[s.rank]
            status = "stopped" if code < 0 and (out.stopped or _root_failed_elsewhere(s, failures)) else "failed"
        elif out.exit_code == 0:
            status, code, tail = "ok", 0, []
        else:  # torchrun stopped by the launcher or by a signal before it could report this rank
            status, code = ("stopped" if out.stopped else "unknown"), None
        if message and status == "failed":
            tail = [*tail, f"error file: {message}"]
        rows.append(RankRow(s.rank, s.node, s.local_rank, host, status, code, tail if status != "ok" else [],
                            first=status == "failed" and s.rank == first_rank))
    return rows


_SIGTERM = -15  # what torchrun sends the surviving workers of its node once one fails


def _root_failed_elsewhere(slot: RankSlot, failures: dict[int, int]) -> bool:
    """A worker torchrun itself SIGTERMed because a sibling failed shows -15: call it stopped when some other
    rank of its node failed of something else: an exit code, or a signal of its own (a rank whose gloo threads
    abort the interpreter's teardown after an exception dies of SIGABRT, -6, not of a clean exit 1)."""
    if failures.get(slot.rank) != _SIGTERM:
        return False
    return any(code not in (0, _SIGTERM) for rank, code in failures.items() if rank != slot.rank)


def failed_ranks(rows: list[RankRow]) -> list[RankRow]:
    """Failed ranks, the job's first failure first."""
    return sorted((r for r in rows if r.status == "failed"), key=lambda r: (not r.first, r.rank))


def format_table(rows: list[RankRow]) -> str:
    """One line per rank, then the stderr tail of the first failure (of every failed rank if unknown)."""
    lines = [f"{'rank':>4}  {'node':>4}  {'local':>5}  {'host':<15}  {'status':<8}  {'exit':>4}  error",
             "-" * 72]
    for r in rows:
        last = ("(first failure) " if r.first else "") + (r.error[-1].strip() if r.error else "")
        code = "-" if r.exit_code is None else str(r.exit_code)
        lines.append(f"{r.rank:>4}  {r.node:>4}  {r.local_rank:>5}  {r.host:<15}  {r.status:<8}  {code:>4}  {last}")
    failed = failed_ranks(rows)
    for r in [r for r in failed if r.first] or failed:  # the cause, not every peer that lost its connection
        if r.error:
            lines.append(f"--- rank {r.rank} (node {r.node}, local rank {r.local_rank}) stderr tail ---")
            lines.extend(r.error)
    return "\n".join(lines)
