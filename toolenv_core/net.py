"""Loopback networking helpers shared by tests, benchmarks and test servers."""

from __future__ import annotations

import ipaddress
import socket


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def is_loopback(host: str) -> bool:
    """Whether a bind address is this machine's loopback (a server bound there is not reachable
    from another host): `localhost`, 127.0.0.0/8, `::1`."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
