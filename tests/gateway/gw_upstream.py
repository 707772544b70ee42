"""A real loopback upstream for the gateway tests, run as its own process (so it can be killed).

Raw ASGI under uvicorn. Any POST echoes what it got; the JSON body steers the behaviour:
`{"sleep_s": 2}` answers after 2 s (or notices the caller hanging up first; with
`"sleep_on": NAME` only that upstream sleeps; `"sleep_by": {NAME: s}` per upstream), `{"status": 500}` answers that status (with
`"status_on": NAME` only that upstream does;
`"retry_after": 7`, that Retry-After too; `{"busy_first": 2}` answers 429 to this upstream's
first two calls, then as asked), `{"die": true}` kills the whole process mid-request,
`{"answer_bytes": N}` adds N bytes to the answer, as its `pad` (`"chunked": true` sends the
answer without a Content-Length); `{"injected_ms": X}` sends X as its X-Toolenv-Injected-Delay-Ms
(else the time it slept).
`GET /stats` says how many requests started, finished, and were abandoned by the caller (the
connection closed while the upstream was still working: what a gateway deadline must cause).

    python tests/gateway/gw_upstream.py --port 9001 --name a [--unhealthy]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from typing import Any


def make_app(name: str, unhealthy: bool = False, plain: bool = False) -> Any:
    stats = {"started": 0, "finished": 0, "abandoned": 0, "deadline_ms": []}

    async def reply(send, status: int, payload: Any, headers: list | None = None) -> None:
        body = json.dumps(payload).encode()
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", b"application/json"), *(headers or [])],
            }
        )
        await send({"type": "http.response.body", "body": body})

    async def app(scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        path = scope["path"]
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        headers = {k.decode(): v.decode() for k, v in scope["headers"]}
        if scope["method"] == "GET":
            if path == "/stats":
                await reply(send, 200, stats)
            elif path in ("/healthz", "/v1/ping", "/readyz"):
                await reply(send, 503 if unhealthy else 200, {"status": "ok", "name": name})
            else:
                await reply(send, 404, {"detail": "not found"})
            return
        stats["started"] += 1
        if "x-toolenv-deadline-ms" in headers:
            stats["deadline_ms"].append(float(headers["x-toolenv-deadline-ms"]))
        raw = b"".join(chunks)
        try:
            body = json.loads(raw) if raw else {}
        except ValueError:
            await reply(send, 400, {"detail": "body is not JSON"})
            return
        if not isinstance(body, dict) or plain:
            body = {"value": body}  # --plain: echo only, never steered (for fuzzing)
        if body.get("die"):
            os._exit(17)
        sleep_s = float(body.get("sleep_s", 0) or 0)
        if body.get("sleep_on") not in (None, name):
            sleep_s = 0.0  # only the named upstream is slow (hedging tests)
        sleep_s = float((body.get("sleep_by") or {}).get(name, sleep_s))
        if sleep_s > 0:
            waiter = asyncio.ensure_future(receive())  # resolves with http.disconnect on hang-up
            done, _ = await asyncio.wait({waiter}, timeout=sleep_s)
            if done:
                stats["abandoned"] += 1
                return
            waiter.cancel()
        stats["finished"] += 1
        status = int(body.get("status", 200))
        if body.get("status_on") not in (None, name):
            status = 200  # only the named upstream fails (hedging tests)
        if stats["started"] <= int(body.get("busy_first", 0)):
            status = 429  # a tool at capacity for its first calls: retried calls then get through
        payload = {
            "upstream": name,
            "path": path,
            "body": body,
            "deadline_ms": headers.get("x-toolenv-deadline-ms"),
            "request_id": headers.get("x-request-id"),
            "authorization": headers.get("authorization"),
            "content_type": headers.get("content-type"),
            "call_context": {k: headers.get(k) for k in ("x-trajectory-id", "x-step", "x-turn")},
        }
        if body.get("answer_bytes"):
            payload["pad"] = "x" * int(body["answer_bytes"])
        injected = body.get("injected_ms", sleep_s * 1000)  # a header it may get wrong
        extra = [(b"x-toolenv-injected-delay-ms", str(injected).encode())]
        if body.get("retry_after") is not None:  # with {"status": 429}: a tool's own backpressure
            extra.append((b"retry-after", str(body["retry_after"]).encode()))
        if body.get("chunked"):  # no content-length, several body messages: chunked encoding
            data = json.dumps(payload).encode()
            await send({"type": "http.response.start", "status": status,
                        "headers": [(b"content-type", b"application/json"), *extra]})  # fmt: skip
            for i in range(0, len(data), 7):
                await send(
                    {"type": "http.response.body", "body": data[i : i + 7], "more_body": True}
                )
            await send({"type": "http.response.body", "body": b""})
            return
        await reply(send, status, payload, extra)

    return app


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--name", default="upstream")
    parser.add_argument("--unhealthy", action="store_true")
    parser.add_argument("--plain", action="store_true")
    parser.add_argument(
        "--keep-alive-s", type=float, default=5.0, help="idle connections closed after"
    )
    args = parser.parse_args()
    uvicorn.run(
        make_app(args.name, args.unhealthy, args.plain),
        host="127.0.0.1",
        port=args.port,
        log_level="warning",
        access_log=False,
        http="httptools",
        loop="uvloop",
        timeout_keep_alive=args.keep_alive_s,
    )


if __name__ == "__main__":
    main()
