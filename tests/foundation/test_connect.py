"""`toolenv_core.connect`: a connection to a host by name, resolved first (the uvloop bug it
works around is in its module doc)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import uvloop

from toolenv_core.connect import connect
from toolenv_core.http1_pool import Pool


async def _served_once(reply: bytes) -> tuple[asyncio.Server, int]:
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(reply)
        await writer.drain()
        writer.close()

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
        protocol = await connect(loop, asyncio.Protocol, "localhost", port)
    finally:
        del loop.create_connection
        server.close()
    assert hosts and all(h in ("127.0.0.1", "::1") for h in hosts), hosts
    assert isinstance(protocol, asyncio.Protocol)


async def test_a_closed_port_is_an_os_error() -> None:
    server, port = await _served_once(b"")
    server.close()
    await server.wait_closed()
    with pytest.raises(OSError):
        await connect(asyncio.get_running_loop(), asyncio.Protocol, "localhost", port)
