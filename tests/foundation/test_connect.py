"""`toolenv_core.connect`: connections to a host by name, resolved first (the uvloop bug it works
around is in its module doc) and once for all of a pool's connections while they succeed."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import uvloop

from toolenv_core.connect import Connector
from toolenv_core.http1_pool import ConnectFailed, Pool


async def _served_once(reply: bytes) -> tuple[asyncio.Server, int]:
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(reply)
            await writer.drain()
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


@pytest.mark.parametrize("loop_factory", [asyncio.new_event_loop, uvloop.new_event_loop])
def test_a_pool_reaches_a_server_by_name_on_either_loop(loop_factory: Any) -> None:
    """`localhost` (from /etc/hosts: no DNS traffic) resolves to the loopback server."""

    async def main() -> tuple[int, bytes]:
        server, port = await _served_once(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        pool = Pool(f"http://localhost:{port}", 5.0, 5.0)
        try:
            response = await pool.request("GET", "/", {}, b"")
        finally:
            pool.close()
            server.close()
        return response.status, response.body

    with asyncio.Runner(loop_factory=loop_factory) as runner:
        assert runner.run(main()) == (200, b"ok")


async def test_a_name_goes_to_create_connection_as_its_address() -> None:
    """uvloop resolves a name inside `create_connection`, and leaves the resolver's error
    unretrieved when the connect is cancelled meanwhile: it is given an address instead."""
    loop = asyncio.get_running_loop()
    hosts: list[str] = []
    real = loop.create_connection

    async def spy(factory: Any, host: str, port: int, **kw: Any) -> Any:
        hosts.append(host)
        return await real(factory, host, port, **kw)

    server, port = await _served_once(b"")
    try:
        loop.create_connection = spy  # type: ignore[method-assign]
        connector = Connector("localhost", port)
        protocol = await connector.connect(loop, asyncio.Protocol, await connector.addresses(loop))
    finally:
        del loop.create_connection
        server.close()
    assert hosts and all(h in ("127.0.0.1", "::1") for h in hosts), hosts
    assert isinstance(protocol, asyncio.Protocol)


async def test_a_closed_port_is_an_os_error() -> None:
    server, port = await _served_once(b"")
    server.close()
    await server.wait_closed()
    loop, connector = asyncio.get_running_loop(), Connector("localhost", port)
    with pytest.raises(OSError):
        await connector.connect(loop, asyncio.Protocol, await connector.addresses(loop))


# -- a pool's name, resolved once (a dead upstream's slow lookups filled the resolver's threads,
# and a live upstream's health check waited behind them)

CLOSE_OK = b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok"


class Lookups:
    """The loop's `getaddrinfo`, counted (and held at `gate` while it is closed); it delegates
    to the real resolver unless told to fail."""

    def __init__(self, loop: asyncio.AbstractEventLoop, fail: bool = False) -> None:
        self.loop, self.fail, self.calls = loop, fail, 0
        self.real = loop.getaddrinfo
        self.gate = asyncio.Event()
        self.gate.set()

    async def __call__(self, host: str, port: int, **kw: Any) -> Any:
        self.calls += 1
        await self.gate.wait()
        if self.fail:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return await self.real(host, port, **kw)

    def __enter__(self) -> Lookups:
        self.loop.getaddrinfo = self  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        del self.loop.getaddrinfo


async def _settle() -> None:
    """Every task started so far has run up to its first real wait."""
    for _ in range(20):
        await asyncio.sleep(0)


async def test_a_pools_connections_share_one_lookup_of_its_name() -> None:
    """Each answer closes its connection: five requests, five connections, one lookup."""
    server, port = await _served_once(CLOSE_OK)
    pool = Pool(f"http://localhost:{port}", 5.0, 5.0)
    try:
        with Lookups(asyncio.get_running_loop()) as lookups:
            for _ in range(5):
                assert (await pool.request("GET", "/", {}, b"")).body == b"ok"
    finally:
        pool.close()
        server.close()
    assert lookups.calls == 1


async def test_concurrent_opens_wait_on_one_lookup() -> None:
    server, port = await _served_once(CLOSE_OK)
    pool = Pool(f"http://localhost:{port}", 5.0, 5.0)
    try:
        with Lookups(asyncio.get_running_loop()) as lookups:
            lookups.gate.clear()
            calls = [asyncio.create_task(pool.request("GET", "/", {}, b"")) for _ in range(8)]
            await _settle()
            assert lookups.calls == 1  # eight connections opening, one lookup in flight
            lookups.gate.set()
            answers = await asyncio.gather(*calls)
    finally:
        pool.close()
        server.close()
    assert [a.body for a in answers] == [b"ok"] * 8
    assert lookups.calls == 1


async def test_an_upstream_closing_a_connection_makes_the_next_open_resolve_again() -> None:
    """A stopped container closes its connections; its address then vanishes, and a connect to it
    hangs until the host gives up (a call with a short deadline timed out, where a fresh lookup
    fails at once): a connection the upstream closed drops the kept addresses."""
    server, port = await _served_once(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
    pool = Pool(f"http://localhost:{port}", 5.0, 5.0)
    seen: list[int] = []
    try:
        with Lookups(asyncio.get_running_loop()) as lookups:
            for _ in range(2):  # kept alive by the pool, then closed by the server
                assert (await pool.request("GET", "/", {}, b"")).body == b"ok"
                for _ in range(50):
                    if all(c.closed for c in pool._idle):
                        break
                    await asyncio.sleep(0.01)
                seen.append(lookups.calls)
    finally:
        pool.close()
        server.close()
    assert seen == [1, 2]


async def test_a_failed_connect_makes_the_next_open_resolve_again() -> None:
    """The addresses are kept while connects to them succeed: the name may have moved."""
    server, port = await _served_once(CLOSE_OK)
    pool = Pool(f"http://localhost:{port}", 5.0, 5.0)
    seen: list[int] = []
    try:
        with Lookups(asyncio.get_running_loop()) as lookups:
            for _ in range(2):
                await pool.request("GET", "/", {}, b"")
                seen.append(lookups.calls)
            server.close()
            await server.wait_closed()
            for _ in range(2):
                with pytest.raises(ConnectFailed):
                    await pool.request("GET", "/", {}, b"")
                seen.append(lookups.calls)
    finally:
        pool.close()
    assert seen == [1, 1, 1, 2]  # the refused connect used the kept addresses; the next looks up


async def test_a_name_that_does_not_resolve_fails_its_waiters_together_and_is_not_kept() -> None:
    pool = Pool("http://upstream.invalid:80", 5.0, 5.0)
    try:
        with Lookups(asyncio.get_running_loop(), fail=True) as lookups:
            lookups.gate.clear()
            calls = [asyncio.create_task(pool.request("GET", "/", {}, b"")) for _ in range(4)]
            await _settle()
            lookups.gate.set()
            failures = await asyncio.gather(*calls, return_exceptions=True)
            assert lookups.calls == 1
            assert all(isinstance(f, ConnectFailed) for f in failures), failures
            assert "not known" in str(failures[0])
            with pytest.raises(ConnectFailed):
                await pool.request("GET", "/", {}, b"")
            assert lookups.calls == 2  # a failed lookup is not kept: the next open asks again
    finally:
        pool.close()


async def test_a_lookup_outlives_the_connect_timeouts_of_its_waiters(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A dead upstream's name slow to fail: each call's connect times out, and the next call
    waits on the same lookup rather than starting one more; its late error is logged nowhere."""
    pool = Pool("http://upstream.invalid:80", 0.05, 5.0)
    try:
        with Lookups(asyncio.get_running_loop(), fail=True) as lookups:
            lookups.gate.clear()
            for _ in range(3):
                with pytest.raises(ConnectFailed, match="lookup of 'upstream.invalid' took over"):
                    await pool.request("GET", "/", {}, b"")
            assert lookups.calls == 1
            lookups.gate.set()
            await _settle()
            gc.collect()
    finally:
        pool.close()
    assert "never retrieved" not in caplog.text


async def test_the_kept_addresses_expire_after_the_ttl() -> None:
    now = [100.0]
    server, port = await _served_once(b"")
    connector = Connector("localhost", port, ttl_s=5.0, clock=lambda: now[0])
    loop = asyncio.get_running_loop()
    seen: list[int] = []
    try:
        with Lookups(loop) as lookups:
            for step in (0.0, 4.9, 0.2):
                now[0] += step
                found = await connector.addresses(loop)
                protocol = await connector.connect(loop, asyncio.Protocol, found)
                seen.append(lookups.calls)
                assert isinstance(protocol, asyncio.Protocol)
    finally:
        server.close()
    assert seen == [1, 1, 2]


async def test_an_address_is_never_looked_up() -> None:
    server, port = await _served_once(CLOSE_OK)
    pool = Pool(f"http://127.0.0.1:{port}", 5.0, 5.0)
    try:
        with Lookups(asyncio.get_running_loop()) as lookups:
            assert (await pool.request("GET", "/", {}, b"")).body == b"ok"
    finally:
        pool.close()
        server.close()
    assert lookups.calls == 0


async def test_a_dead_upstreams_calls_leave_the_resolver_to_a_live_one() -> None:
    """The finding: with an upstream's container stopped, its name slow to fail and 64 calls
    trying it, each call's lookup held one of the resolver's 4 threads (libuv's default, as
    here), and the live upstream's health check waited behind them until it timed out."""
    loop = asyncio.get_running_loop()
    loop.set_default_executor(ThreadPoolExecutor(4))
    real, stuck = loop.getaddrinfo, threading.Event()

    async def lookup(host: str, port: int, **kw: Any) -> Any:
        if host != "search":
            return await real(host, port, **kw)
        await loop.run_in_executor(None, stuck.wait, 10.0)  # a thread held until the name fails
        raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")

    server, port = await _served_once(CLOSE_OK)
    dead, live = Pool("http://search:80", 5.0, 5.0), Pool(f"http://localhost:{port}", 5.0, 5.0)
    loop.getaddrinfo = lookup  # type: ignore[method-assign]
    calls = [asyncio.create_task(dead.request("GET", "/", {}, b"")) for _ in range(64)]
    try:
        await _settle()
        async with asyncio.timeout(2.0):  # the gateway's health-check timeout
            assert (await live.request("GET", "/healthz", {}, b"")).status == 200
    finally:
        stuck.set()
        failures = await asyncio.gather(*calls, return_exceptions=True)
        del loop.getaddrinfo
        dead.close()
        live.close()
        server.close()
    assert all(isinstance(f, ConnectFailed) for f in failures)


async def test_a_connect_cut_by_its_timeout_says_so_and_drops_the_addresses() -> None:
    """The addresses answer nothing (a connect that hangs, as to a stopped container's old
    address): the call fails as a connect timeout, not a lookup's, and the next looks up again."""
    loop = asyncio.get_running_loop()
    server, port = await _served_once(CLOSE_OK)
    pool = Pool(f"http://localhost:{port}", 0.05, 5.0)

    async def hangs(*args: Any, **kw: Any) -> Any:
        await asyncio.Event().wait()

    try:
        with Lookups(loop) as lookups:
            assert (await pool.request("GET", "/", {}, b"")).body == b"ok"
            loop.create_connection = hangs  # type: ignore[method-assign]
            try:
                with pytest.raises(ConnectFailed) as failed:
                    await pool.request("GET", "/", {}, b"")
            finally:
                del loop.create_connection
            assert str(failed.value) == "connect timed out"
            assert lookups.calls == 1
            assert (await pool.request("GET", "/", {}, b"")).body == b"ok"
            assert lookups.calls == 2
    finally:
        pool.close()
        server.close()


async def test_an_ipv6_upstream_gets_a_well_formed_host_header() -> None:
    """`Host: ::1:8080` (the address unbracketed) is a 400 to a strict server (Go's net/http)."""
    heads: list[bytes] = []

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        heads.append(await reader.readuntil(b"\r\n\r\n"))
        writer.write(CLOSE_OK)
        await writer.drain()
        writer.close()

    try:
        server = await asyncio.start_server(answer, "::1", 0)
    except OSError:
        pytest.skip("no IPv6 loopback here")
    port = server.sockets[0].getsockname()[1]
    pool = Pool(f"http://[::1]:{port}", 5.0, 5.0)
    try:
        assert (await pool.request("GET", "/", {}, b"")).body == b"ok"
    finally:
        pool.close()
        server.close()
    assert f"host: [::1]:{port}\r\n".encode() in heads[0], heads


async def test_closing_a_pool_leaves_a_call_waiting_on_the_lookup_to_finish() -> None:
    """`close` drops the idle connections only: a call waiting on the lookup was never
    cancelled, and must not end in a CancelledError (its caller would take it for its own)."""
    server, port = await _served_once(CLOSE_OK)
    pool = Pool(f"http://localhost:{port}", 5.0, 5.0)
    try:
        with Lookups(asyncio.get_running_loop()) as lookups:
            lookups.gate.clear()
            call = asyncio.create_task(pool.request("GET", "/", {}, b""))
            await _settle()
            pool.close()
            lookups.gate.set()
            assert (await call).body == b"ok"
    finally:
        server.close()


async def test_a_name_with_several_addresses_spreads_its_connections_over_them() -> None:
    """A compose service run with `--scale` answers its name with each replica's address: new
    connections take them in turn (every one went to the first, and the other replicas idled)."""
    loop = asyncio.get_running_loop()
    servers = [await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0) for _ in "ab"]
    ports = [s.sockets[0].getsockname()[1] for s in servers]
    reached: list[int] = []

    class Peer(asyncio.Protocol):
        def connection_made(self, transport: Any) -> None:
            reached.append(transport.get_extra_info("peername")[1])
            transport.close()

    async def replicas(host: str, port: int, **kw: Any) -> Any:
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", p)) for p in ports]

    connector = Connector("sandbox", 8002)
    loop.getaddrinfo = replicas  # type: ignore[method-assign]
    try:
        for _ in range(4):
            await connector.connect(loop, Peer, await connector.addresses(loop))
    finally:
        del loop.getaddrinfo
        for server in servers:
            server.close()
    assert sorted(reached) == sorted(ports * 2), reached
