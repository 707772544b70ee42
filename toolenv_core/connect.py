"""A TCP connection to a host by name, resolved before `loop.create_connection`.

Under uvloop, a `create_connection` to a host name that is cancelled while the name resolves (a
connect timeout, with an upstream's container stopped and its name slow to fail) leaves the
resolver's error behind: "Future exception was never retrieved ... socket.gaierror" in the log,
once per attempt (MagicStack/uvloop#437). `loop.getaddrinfo` cancelled alike leaves nothing, and
`create_connection` to an address resolves nothing.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Callable
from typing import TypeVar

P = TypeVar("P", bound=asyncio.Protocol)


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


async def connect(
    loop: asyncio.AbstractEventLoop, factory: Callable[[], P], host: str, port: int
) -> P:
    """The protocol of a connection to `host:port`, each resolved address tried in turn (as
    `create_connection` does); an OSError (`socket.gaierror` for a name that does not resolve)
    when none answers."""
    if _is_address(host):
        return (await loop.create_connection(factory, host, port))[1]
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    error: OSError = OSError(f"{host}: no address")
    for family, _, _, _, address in infos:
        try:
            return (await loop.create_connection(factory, address[0], address[1], family=family))[1]
        except OSError as exc:
            error = exc
    raise error
