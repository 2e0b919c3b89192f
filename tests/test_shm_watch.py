"""The /dev/shm guard (tests/shm_watch.py): which names it watches, how it tells a live engine's segment from a
leftover, and that it fails the very test that leaves one, naming the test and the file."""

from __future__ import annotations

import mmap
import uuid

import shm_watch

pytest_plugins = ["pytester"]


def test_only_communicator_segments_are_watched(tmp_path):
    for name in ("hybridflow-abc-tp:0-[0-1]-cpushm_0", "-tp:0-[0-1]-cpushm_1", "psm_123", "sem.ray", "torch_1"):
        (tmp_path / name).write_bytes(b"")
    assert shm_watch.segment_names(tmp_path) == {"hybridflow-abc-tp:0-[0-1]-cpushm_0", "-tp:0-[0-1]-cpushm_1",
                                                 "psm_123"}
    assert shm_watch.segment_names(tmp_path / "absent") == set()


def test_a_mapped_segment_is_in_use_and_an_unmapped_one_is_left_over(tmp_path):
    live, dead = "hybridflow-live-tp:0-[0-1]-cpushm_0", "hybridflow-dead-tp:0-[0-1]-cpushm_0"
    before = shm_watch.segment_names(tmp_path)
    for name in (live, dead):
        (tmp_path / name).write_bytes(b"\0" * 4096)
    with open(tmp_path / live, "r+b") as f, mmap.mmap(f.fileno(), 4096):  # this process maps it, as an engine would
        assert shm_watch.mapped({live, dead}, tmp_path) == {live}
        assert shm_watch.leftovers(before, tmp_path) == {dead}
    assert shm_watch.leftovers(before, tmp_path) == {live, dead}
    shm_watch.remove({live, dead}, tmp_path)
    assert shm_watch.segment_names(tmp_path) == set()


def test_a_segment_its_owner_unlinks_meanwhile_is_not_a_leftover(tmp_path):
    """The other xdist worker's engine unlinks its names once every rank has mapped them: seen in that moment, a name
    is listed but mapped only as "(deleted)". It must not be blamed on this test, nor removed under the engine."""
    import threading

    transient, stuck = "hybridflow-going-tp:0-[0-1]-cpushm_0", "hybridflow-stuck-tp:0-[0-1]-cpushm_0"
    before = shm_watch.segment_names(tmp_path)
    for name in (transient, stuck):
        (tmp_path / name).write_bytes(b"")
    owner = threading.Timer(0.05, (tmp_path / transient).unlink)
    owner.start()
    try:
        assert shm_watch.leftovers(before, tmp_path, settle_s=0.5) == {stuck}
    finally:
        owner.cancel()


def test_the_test_that_leaves_a_segment_fails_by_name(pytester):
    name = f"hybridflow-selftest{uuid.uuid4().hex[:8]}-tp:0-[0-1]-cpushm_0"
    pytester.makeconftest("from shm_watch import _no_shm_segments_left, shm_before_session  # noqa: F401\n")
    pytester.makepyfile(test_leaky=f"""
        from pathlib import Path

        def test_clean():
            pass

        def test_leaks():
            Path("/dev/shm/{name}").write_bytes(b"")
    """)
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, errors=1)
    errors = [line for line in result.stdout.lines if "left 1 vLLM shared-memory segment" in line]
    assert errors and errors[0].startswith("test_leaky.py::test_leaks") and name in errors[0], result.stdout
    assert name not in shm_watch.segment_names()  # removed, so the next engine can start
