"""Free listen ports for rendezvous stores, gloo groups and local Ray daemons; and whether a HOST:PORT answers.

A port is probed free here and bound by its server a moment later, often by another process. The kernel hands out
its ephemeral range (/proc/sys/net/ipv4/ip_local_port_range, 32768-60999 by default) both to bind(port 0) and to
the local side of every outgoing connect(): gloo's full mesh, Ray's gRPC clients, vLLM's sockets. A port probed
from that range can be taken in between by any of them, and a rank then dies with EADDRINUSE while its peers wait
on a store that never answers (seen in CI: a 2 + 2 process cross-pool test hung to its 600 s limit).

So the ports come from just below the ephemeral range, at random, where nothing but an explicit bind lands: the
only race left is with another caller of this module (two test processes picking the same one of ~12,000 ports).
Where the range leaves no such room, the kernel picks (port 0).
"""

from __future__ import annotations

import random
import socket
import time

_BELOW = 12_000  # how many ports under the ephemeral range to draw from
_LOWEST = 20_000  # and never under this: Ray's worker ports (10002-19999 by default), Ray's own (6379, 8265) and the
# well-known services all lie below it
_rng = random.SystemRandom()  # not seeded by the tests' random.seed: two processes must not draw alike


def ephemeral_range(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> tuple[int, int]:
    try:
        with open(path) as f:
            lo, hi = (int(x) for x in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def _candidates(lo: int) -> list[int]:
    start = max(_LOWEST, lo - _BELOW)
    if lo - start < 1000:
        return []
    return _rng.sample(range(start, lo), 200)


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """n distinct ports that nothing listens on now, drawn below the ephemeral range (the module docstring)."""
    held: list[socket.socket] = []  # kept bound until all n are found, so that they differ
    try:
        for port in _candidates(ephemeral_range()[0]):
            if len(held) == n:
                break
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                s.bind((host, port))
            except OSError:
                s.close()
                continue
            held.append(s)
        while len(held) < n:  # no room below the range, or all 200 draws taken: the kernel's choice
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            held.append(s)
        return [s.getsockname()[1] for s in held]
    finally:
        for s in held:
            s.close()


def free_port(host: str = "127.0.0.1") -> int:
    return free_ports(1, host)[0]


def split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"Ray address {address!r} must be HOST:PORT")
    return host, int(port)


def is_loopback_address(address: str) -> bool:
    """Whether a HOST:PORT address names this machine's loopback (localhost, 127.x, [::1]); "auto" and other
    non-HOST:PORT forms do not."""
    import ipaddress

    try:
        host = split_address(address)[0].strip("[]")
    except ValueError:
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def connect_within(host: str, port: int, timeout_s: float, refused_s: float | None = None) -> OSError | None:
    """Retry a TCP connect to host:port every 0.5 s until it succeeds (None) or `timeout_s` passes (the last
    error). A refused connection, i.e. a host that answers with nothing on the port, is retried only for
    `refused_s` when given (a head restarting), while silence is retried up to timeout_s.

    The one probe behind every "is the head/dashboard there" check (launch/, and the trainer's check of
    trainer.ray.address), so each fails in seconds with an error naming the address instead of after Ray's own
    minutes of reconnect attempts."""
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(5.0, deadline - time.monotonic()))):
                return None
        except ConnectionRefusedError as e:
            last = e
            if refused_s is not None and time.monotonic() - t0 > refused_s:
                return last
        except OSError as e:
            last = e
        if time.monotonic() + 0.5 > deadline:
            return last
        time.sleep(0.5)
