"""What a test may not leave in /dev/shm: vLLM's CPU shared-memory communicator segments and broadcast buffers.

Ours are named "hybridflow-<job token>-..." and unlinked as soon as every rank has mapped them
(hybridflow/rollout/vllm_launch.py, cpu_shm_communicator); an engine built around that (vLLM's default names,
"-tp:0-[0-1]-cpushm_<rank>") leaves its names behind at exit, and the next engine of the same TP size then fails
with EEXIST. A TP group's broadcast buffer (psm_*, 24 MiB) is unlinked once mapped too
(broadcast_buffers_unlinked); before that, a worker killed with its resource tracker left it for good.
tests/conftest.py takes the two fixtures at the end, which check every test against the names here.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

import pytest

SHM_DIR = Path("/dev/shm")
OUR_PREFIX = "hybridflow-"
VLLM_MARK = "cpushm"  # in every segment name vLLM's CPU communicator makes, with our prefix or its default one
BROADCAST_PREFIX = "psm_"  # Python's SharedMemory names: vLLM's TP-group broadcast buffers (shm_broadcast)


def segment_names(shm_dir: Path = SHM_DIR) -> set[str]:
    """vLLM's shared memory in shm_dir: the communicator segments (ours, or default-named ones) and the broadcast
    buffers."""
    try:
        return {n for n in os.listdir(shm_dir) if n.startswith((OUR_PREFIX, BROADCAST_PREFIX)) or VLLM_MARK in n}
    except FileNotFoundError:
        return set()


def mapped(names: set[str], shm_dir: Path = SHM_DIR, proc: Path = Path("/proc")) -> set[str]:
    """Those of `names` that a live process maps (an engine still running, e.g. the other xdist worker's)."""
    if not names:
        return set()
    paths = {str(shm_dir / n): n for n in names}
    found = set()
    for pid in os.listdir(proc):
        if not pid.isdigit():
            continue
        with contextlib.suppress(OSError):  # gone meanwhile, or not ours to read
            for line in (proc / pid / "maps").read_text().splitlines():
                fields = line.split(maxsplit=5)  # address perms offset dev inode [path]
                if len(fields) == 6 and fields[5].strip() in paths:
                    found.add(paths[fields[5].strip()])
        if found == set(names):
            break
    return found


def leftovers(before: set[str], shm_dir: Path = SHM_DIR, settle_s: float = 0.5) -> set[str]:
    """Segments that appeared since `before` and that no live process maps any more: left behind.

    A name seen in the moment its owner unlinks it (the other xdist worker's engine, unlinking once every rank has
    mapped it) is still listed but mapped only as "<path> (deleted)"; so a suspect is looked at again after
    `settle_s`, and only one that still exists, unmapped, counts."""
    new = segment_names(shm_dir) - before
    suspects = new - mapped(new, shm_dir)
    if not suspects:
        return set()
    time.sleep(settle_s)
    still = suspects & segment_names(shm_dir)
    return still - mapped(still, shm_dir)


def remove(names: set[str], shm_dir: Path = SHM_DIR) -> None:
    for n in names:
        with contextlib.suppress(FileNotFoundError):
            (shm_dir / n).unlink()


@pytest.fixture(scope="session")
def shm_before_session():
    """The communicator segments already in /dev/shm when this pytest process started: never blamed on a test."""
    return segment_names()


@pytest.fixture(autouse=True)
def _no_shm_segments_left(shm_before_session, request):
    """Fails the test that leaves vLLM shared-memory segments in /dev/shm (ours, or vLLM's default names), naming
    the test and the files, and removes them so the next engine can start. A segment still mapped by a live process
    is an engine at work (the other xdist worker's) and is not counted; the test beside this one could still end in
    the moment between this test's start and end, so on the rare failure read the name: ours carry their job's
    token."""
    before = segment_names() | shm_before_session
    yield
    left = leftovers(before)
    if left:
        remove(left)
        beside = " (or the test beside it on the other xdist worker)" if os.environ.get("PYTEST_XDIST_WORKER") else ""
        pytest.fail(f"{request.node.nodeid}{beside} left {len(left)} vLLM shared-memory segment(s) in /dev/shm "
                    f"(removed now): {sorted(left)}. Build engines through hybridflow.rollout.vllm_engine.build_llm, "
                    "or vLLM's groups inside vllm_launch.cpu_shm_communicator and broadcast_buffers_unlinked: they "
                    "unlink every name once all ranks have mapped it", pytrace=False)
