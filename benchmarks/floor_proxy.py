"""The floor under the gateway: the least an asyncio HTTP/1.1 proxy in Python does per call.

    python benchmarks/floor_proxy.py UPSTREAM_URL PORT

uvloop, httptools parsing the request, the gateway's own upstream client (`toolenv_core.http1_pool`,
one keep-alive pool) and one socket write per answer: no admission, deadline, metrics, trace,
keys or logs. `gateway_bench` runs it beside the gateway on the same CPU, so the gateway's CPU
per call reads against what any Python proxy pays on this machine at that moment (the kernel's
loopback TCP, the event loop, two parses and two writes).
"""

from __future__ import annotations

import asyncio
import sys

import httptools
import uvloop

from toolenv_core.http1_pool import Pool

READY = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"


class FloorProxy(asyncio.Protocol):
    """One client connection: each request forwarded as is, its answer written back."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.url = b""
        self.body = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_message_begin(self) -> None:
        self.url, self.body = b"", b""

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        assert self.transport is not None
        if self.url == b"/readyz":
            self.transport.write(READY)
            return
        asyncio.get_running_loop().create_task(self.forward(self.url.decode(), self.body))

    async def forward(self, path: str, body: bytes) -> None:
        assert self.transport is not None
        reply = await self.pool.request("POST", path, {"content-type": "application/json"}, body)
        head = b"HTTP/1.1 %d OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
        self.transport.write(head % (reply.status, len(reply.body)) + reply.body)


async def serve(upstream: str, port: int) -> None:
    pool = Pool(upstream, connect_timeout_s=5.0, keepalive_s=4.0, max_idle=1024)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: FloorProxy(pool), "127.0.0.1", port, backlog=2048)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    try:
        uvloop.run(serve(sys.argv[1], int(sys.argv[2])))
    except KeyboardInterrupt:
        pass
