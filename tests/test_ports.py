"""hybridflow.ports: listen ports come from below the kernel's ephemeral range, distinct, and never one in use."""

import socket

from hybridflow import ports


def test_ports_lie_below_the_ephemeral_range_and_differ():
    lo, _ = ports.ephemeral_range()
    got = ports.free_ports(16)
    assert len(set(got)) == 16
    if lo - max(ports._LOWEST, lo - ports._BELOW) >= 1000:  # room below the range (Linux's default leaves 12,000)
        assert all(max(ports._LOWEST, lo - ports._BELOW) <= p < lo for p in got), (got, lo)
    for p in got:  # each one can really be bound
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_a_port_in_use_is_never_returned(monkeypatch):
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    taken = held.getsockname()[1]
    # The only candidates are the taken port and one free neighbour region: the taken one must be skipped.
    monkeypatch.setattr(ports, "_candidates", lambda lo: [taken] * 5)
    try:
        got = ports.free_ports(2)
    finally:
        held.close()
    assert taken not in got and len(set(got)) == 2  # fell back to the kernel's choice for both


def test_ephemeral_range_reads_the_file_and_falls_back(tmp_path):
    f = tmp_path / "range"
    f.write_text("40000\t50000\n")
    assert ports.ephemeral_range(str(f)) == (40000, 50000)
    assert ports.ephemeral_range(str(tmp_path / "missing")) == (32768, 60999)
    f.write_text("garbage")
    assert ports.ephemeral_range(str(f)) == (32768, 60999)


def test_no_room_below_the_range_means_the_kernel_picks():
    assert ports._candidates(20_500) == []  # the range starts too low: nothing between _LOWEST and it
    cands = ports._candidates(32768)
    assert len(cands) == 200 and all(20768 <= p < 32768 for p in cands)
