"""Addresses and ports: which address a node advertises, whether a port is free, whether a head answers."""

from __future__ import annotations

import errno
import ipaddress
import socket

from hybridflow.ports import connect_within, split_address  # the probe, shared with the trainer's checks


def resolve_ipv4(name: str) -> str:
    """An IPv4 address for a host name or address literal; ValueError naming it otherwise."""
    try:
        return str(ipaddress.IPv4Address(name))
    except ValueError:
        pass
    try:
        return socket.gethostbyname(name)
    except OSError as e:
        raise ValueError(f"cannot resolve host {name!r} to an IPv4 address: {e}") from None


def default_node_ip(toward: str | None = None) -> str:
    """The address this host uses to reach `toward` (the head), or its primary interface's address.

    A UDP connect sends nothing; it only asks the kernel which source address it would route from. This is the
    address other nodes can reach us at, which a bind-everything 0.0.0.0 is not."""
    target = toward or "8.8.8.8"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((target, 1))
            ip = s.getsockname()[0]
    except OSError:
        ip = resolve_ipv4(socket.gethostname())
    if ip == "0.0.0.0":
        raise ValueError("could not find an address for this host: pass --node-ip-address")
    return ip


def check_node_ip(ip: str) -> str:
    """The address a node advertises must be one of this host's addresses (never the wildcard)."""
    if ip == "0.0.0.0":
        raise ValueError("--node-ip-address 0.0.0.0 is not an address other nodes can reach; give this host's "
                         "address (the one the other nodes use to reach it)")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((ip, 0))
        except OSError as e:
            if e.errno == errno.EADDRNOTAVAIL:
                raise ValueError(f"--node-ip-address {ip} is not an address of this host") from None
            raise
    return ip


def port_in_use(ip: str, port: int) -> bool:
    """True when something listens on ip:port or on the wildcard address at that port."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT leftovers do not count as in use
        try:
            s.bind((ip, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return True
            raise
    return False


def wait_reachable(address: str, timeout_s: float) -> None:
    """Wait until HOST:PORT accepts a TCP connect (a head may still be starting); ConnectionError after timeout_s."""
    host, port = split_address(address)
    last = connect_within(host, port, timeout_s)
    if last is not None:
        raise ConnectionError(f"cannot reach the Ray head at {address} within {timeout_s:.0f} s "
                              f"({last.strerror or last}); is the head running there and is the port open?")
