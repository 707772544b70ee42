"""A request the upstream read but never answered, on a kept-alive connection, against a real
loopback upstream: sent again only to an idempotent tool.

The upstream here is a raw HTTP server in a thread: it answers every request, except one asking
`{"drop": true}` on a connection that has served before, which it reads and counts, then hangs up
without a byte (as a worker killed mid-run behind a shared port does); the request sent again on
a fresh connection is answered.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections import Counter

import httpx
import pytest
from gw_support import metric_value, proxy_tool

from toolenv_core.net import free_port


class DroppingUpstream:
    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.seen: Counter[str] = Counter()
        self.loop = asyncio.new_event_loop()
        started = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(started,), daemon=True)
        self.thread.start()
        assert started.wait(10)

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        server = self.loop.run_until_complete(
            asyncio.start_server(self._serve, "127.0.0.1", self.port)
        )
        started.set()
        self.loop.run_forever()
        server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        served = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.decode("latin-1").split("\r\n"):
                    name, _, value = line.partition(":")
                    if name.strip().lower() == "content-length":
                        length = int(value)
                body = await reader.readexactly(length) if length else b""
                if head.startswith(b"POST"):
                    self.seen[body.decode()] += 1
                    if served and json.loads(body).get("drop"):
                        writer.transport.abort()  # read, maybe acted on, never answered
                        return
                payload = json.dumps({"served": served}).encode()
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                    b"content-length: %d\r\n\r\n%s" % (len(payload), payload)
                )
                await writer.drain()
                served += 1
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


@pytest.fixture
def dropping():
    up = DroppingUpstream()
    yield up
    up.stop()


@pytest.mark.parametrize("idempotent", [False, True])
def test_an_unanswered_request_is_sent_again_only_to_an_idempotent_tool(
    dropping, gateway, idempotent
) -> None:
    """Before: the upstream client sent any request again on a fresh connection when a reused one
    closed without a byte of answer (taken for a stale keep-alive connection), so a tool that is
    not idempotent (a sandbox run) ran twice behind the caller's one 200, and no retry was
    counted, against the documented rule (calls broken mid-request are retried for idempotent
    tools only). The gateway closes idle upstream connections before the upstream does
    (`upstream_keepalive_s`), so a stale one is rare: for such a tool it is now a 502."""
    gw = gateway([proxy_tool("t", dropping.url, idempotent=idempotent, health_interval_s=60)])
    with httpx.Client(base_url=gw.url, timeout=30) as client:
        first = client.post("/v1/tools/t/call", json={"arguments": {"drop": False}})
        assert first.status_code == 200, first.text  # its connection is kept for the next call
        r = client.post("/v1/tools/t/call", json={"arguments": {"drop": True}})
    runs = sum(n for body, n in dropping.seen.items() if json.loads(body)["drop"])
    if idempotent:  # sent again on a fresh connection, where it is answered
        assert r.status_code == 200 and r.json()["status"] == "ok", r.text
        assert runs == 2
    else:
        assert r.status_code == 502 and r.json()["status"] == "upstream_failed", r.text
        assert runs == 1  # the upstream got it once: nothing ran twice
    text = gw.metrics_text()
    failed = metric_value(text, "toolenv_gateway_calls_total", tool="t", outcome="upstream_failed")
    assert failed == (0 if idempotent else 1)
