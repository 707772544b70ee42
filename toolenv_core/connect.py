"""TCP connections to a host by name: the name resolved before `loop.create_connection`, once for
all the connections of one `Connector` (one per upstream pool).

Why resolve first: under uvloop, a `create_connection` to a host name that is cancelled while the
name resolves (a connect timeout, with an upstream's container stopped and its name slow to fail)
leaves the resolver's error behind: "Future exception was never retrieved ... socket.gaierror" in
the log, once per attempt (MagicStack/uvloop#437). `loop.getaddrinfo` cancelled alike leaves
nothing, and `create_connection` to an address resolves nothing.

Why once: a lookup takes a thread of the resolver's small pool (4 under uvloop/libuv) for as long
as it lasts. With an upstream's container stopped and 64 calls trying it, one lookup per new
connection filled the pool, and a live upstream's lookup (its health check's) waited behind them
until it timed out. A `Connector` has at most one lookup in flight, which every connection opened
meanwhile waits on (a waiter that gives up, at its connect timeout, leaves it running for the
next), and keeps the addresses while connects to them succeed: they are looked up again after a
connect to them fails (refused, unreachable, cut by the connect timeout: the name may have moved),
after the upstream closes a connection itself (`forget`: a stopped container closes its
connections, and a connect to its vanished address would hang until the host gives up on it,
where a fresh lookup fails at once), or `ttl_s` after the lookup. A failed lookup is not kept.
An address literal is never looked up.

A name with several addresses of the resolver's first family (a compose service run with
`--scale`: the replicas' addresses under one name) gets each new connection started at the next of
them in turn, the others tried after it: one lookup's connections spread over the replicas. Before,
every connection went to the first address, and the other replicas got no call.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

P = TypeVar("P", bound=asyncio.Protocol)

# How long a lookup's addresses are kept at most. A live name's lookup is quick, so a second's
# reuse already spares the resolver's threads; a short keep also bounds how long calls go to the
# address of an upstream that went away without a word (no connection of ours open to it).
DNS_TTL_S = 1.0


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


@dataclass(frozen=True, slots=True, eq=False)
class Resolved:
    """One lookup's answer: (family, sockaddr) in the resolver's order, and when it expires."""

    addresses: list[tuple[int, Any]]
    expires: float


def _starting_at(addresses: list[tuple[int, Any]], turn: int) -> list[tuple[int, Any]]:
    """The addresses of the first family rotated to start at `turn` (modulo), then the rest."""
    if not addresses:
        return []
    first = [a for a in addresses if a[0] == addresses[0][0]]
    k = turn % len(first)
    return first[k:] + first[:k] + [a for a in addresses if a[0] != addresses[0][0]]


async def _first_answering(
    loop: asyncio.AbstractEventLoop,
    factory: Callable[[], P],
    host: str,
    addresses: list[tuple[int, Any]],
) -> P:
    """Each address tried in turn, as `create_connection` does with a name."""
    error: OSError = OSError(f"{host}: no address")
    for family, address in addresses:
        try:
            return (await loop.create_connection(factory, address[0], address[1], family=family))[1]
        except OSError as exc:
            error = exc
    raise error


class Connector:
    """Connections to one `host:port`, the name looked up at most once at a time and its addresses
    kept (the rules are in the module doc)."""

    def __init__(
        self,
        host: str,
        port: int,
        ttl_s: float = DNS_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.host = host
        self.port = port
        self.ttl_s = ttl_s
        self._clock = clock
        self._literal = _is_address(host)
        self._kept: Resolved | None = None
        self._lookup: asyncio.Task[Resolved] | None = None
        self._turn = 0  # which address the next connection starts at

    async def addresses(self, loop: asyncio.AbstractEventLoop) -> Resolved | None:
        """The kept addresses, or a lookup's (`socket.gaierror` when the name does not resolve);
        None for an address literal."""
        if self._literal:
            return None
        found = self._kept
        if found is None or self._clock() >= found.expires:
            # shielded: a waiter cancelled (its connect timeout) does not cancel the others' lookup
            found = await asyncio.shield(self._looking_up(loop))
        return found

    async def connect(
        self, loop: asyncio.AbstractEventLoop, factory: Callable[[], P], found: Resolved | None
    ) -> P:
        """The protocol of a new connection to one of `found` (from `addresses`); an OSError when
        none answers, and the addresses are then dropped."""
        if found is None:
            return (await loop.create_connection(factory, self.host, self.port))[1]
        order = _starting_at(found.addresses, self._turn)
        self._turn += 1
        try:
            return await _first_answering(loop, factory, self.host, order)
        except (OSError, asyncio.CancelledError):
            if self._kept is found:  # not a newer lookup's answer: that one is still untried
                self._kept = None
            raise

    def forget(self) -> None:
        """Drop the kept addresses: the next connection looks the name up again."""
        self._kept = None

    def _looking_up(self, loop: asyncio.AbstractEventLoop) -> asyncio.Task[Resolved]:
        if self._lookup is None:
            self._lookup = loop.create_task(self._look_up(loop))
            self._lookup.add_done_callback(self._looked_up)
        return self._lookup

    async def _look_up(self, loop: asyncio.AbstractEventLoop) -> Resolved:
        infos = await loop.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
        found = Resolved([(i[0], i[4]) for i in infos], self._clock() + self.ttl_s)
        self._kept = found
        return found

    def _looked_up(self, lookup: asyncio.Task[Resolved]) -> None:
        self._lookup = None
        if not lookup.cancelled():
            lookup.exception()  # retrieved: one every waiter left logs nothing ("never retrieved")
