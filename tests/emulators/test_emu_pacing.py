"""The emulators' pacing: response path and intake latency, the arrival stamp, on-time sleeps."""

from __future__ import annotations

import asyncio
import gc
import sys
import threading
import time

import httpx
import numpy as np
import uvicorn
import uvloop

from emulators.timing import (
    RECEIVED_AT,
    Pacer,
    StampingHttpToolsProtocol,
    received_at,
)
from toolenv_core.net import free_port
from toolenv_core.timer import precise_timer, sleep_until


def test_the_pacer_wakes_by_the_median_response_path_and_stays_bounded() -> None:
    """Simulated replies: each leaves `path - lead` after its target, path ~ U(0.2, 0.6) ms."""
    rng = np.random.default_rng(3)
    pacer = Pacer()
    for path in rng.uniform(0.0002, 0.0006, 5000):
        pacer.observe(path - pacer.lead_s)
    assert abs(pacer.lead_s - 0.0004) < 0.00003  # the median path: half late, half early
    late = rng.uniform(0.0002, 0.0006, 2000) - pacer.lead_s
    assert abs(np.mean(late > 0) - 0.5) < 0.05
    for _ in range(5000):  # a machine so slow that every reply is 10 ms late: capped lead
        pacer.observe(0.010)
    assert pacer.lead_s == pacer.max_lead_s
    for _ in range(5000):  # replies that leave at once: no lead at all, never negative
        pacer.observe(-pacer.lead_s)
    assert pacer.lead_s == 0.0


def test_the_pacer_learns_the_loops_intake_latency_and_caps_the_sum() -> None:
    """Wake-ups that overshoot by ~U(30, 90) us: the intake estimate is their median, added to
    the lead; the sum stays within `max_lead_s`, and pacing off (cap 0) adds nothing."""
    rng = np.random.default_rng(5)
    pacer = Pacer()
    for _ in range(3000):
        pacer.observe(0.0002 - pacer.lead_s)  # a 0.2 ms response path
        pacer.observe_wake(rng.uniform(30e-6, 90e-6))
    assert abs(pacer.intake_s - 60e-6) < 8e-6 and abs(pacer.lead_s - 0.0002) < 8e-6
    assert abs(pacer.early_s - 0.00026) < 12e-6
    for _ in range(5000):  # a stalled loop: each estimate capped, and so is their sum
        pacer.observe(0.01)
        pacer.observe_wake(0.01)
    assert pacer.intake_s == pacer.lead_s == pacer.early_s == pacer.max_lead_s
    off = Pacer(max_lead_s=0.0)
    off.observe(0.001)
    off.observe_wake(0.001)
    assert off.early_s == 0.0


def test_the_stamping_protocol_marks_when_a_request_reached_the_process() -> None:
    """A real uvicorn with the protocol `toolenv emulators serve` runs: each request's scope
    carries when its first byte was parsed, before the handler's own clock."""
    seen: list[tuple[float, float]] = []

    async def app(scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        seen.append((scope["extensions"][RECEIVED_AT], time.monotonic()))
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    port = free_port()
    config = uvicorn.Config(
        app, host="127.0.0.1", port=port, http=StampingHttpToolsProtocol, lifespan="off",
        log_level="warning",
    )  # fmt: skip
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}") as client:
            for _ in range(3):
                assert client.get("/").status_code == 204
    finally:
        server.should_exit = True
        thread.join(10)
    assert len(seen) == 3
    assert all(0 <= handled - stamp < 1.0 for stamp, handled in seen)
    assert seen[0][0] < seen[1][0] < seen[2][0]  # one stamp per request, not per connection
    before = time.monotonic()
    assert received_at({"type": "http"}) >= before  # in-process calls: now


def test_sleep_until_wakes_at_the_target_never_before_and_in_order() -> None:
    """Many sleepers at once, some abandoned: each wakes at or after its own target (the timerfd
    of this loop on Linux, whose millisecond-free wake-ups the emulators' timing relies on)."""

    async def main() -> tuple[list[float], list[float], bool]:
        loop = asyncio.get_running_loop()
        base = time.monotonic() + 0.005
        targets = [base + (i * 7919 % 200) * 0.0001 for i in range(200)]  # 0-20 ms, shuffled
        tasks = [asyncio.ensure_future(sleep_until(t)) for t in targets]
        for task in tasks[::10]:
            task.cancel()  # a client that hung up: its wake-up is skipped, the others still come
        woke = await asyncio.gather(*tasks, return_exceptions=True)
        kept = [(t, w) for t, w in zip(targets, woke, strict=True) if isinstance(w, float)]
        return [t for t, _ in kept], [w for _, w in kept], precise_timer(loop) is not None

    # A full collection of the suite's heap (about 90 ms once every module of the CLI is loaded)
    # would land inside the 20 ms window and wake every sleeper that late: not the timer's doing.
    gc.collect()
    gc.disable()
    try:
        targets, woke, precise = uvloop.run(main())
    finally:
        gc.enable()
    late = np.array(woke) - np.array(targets)
    assert len(woke) == 180 and late.min() >= 0
    assert np.median(late) < 0.01  # a wake-up, not a drift
    assert precise == sys.platform.startswith("linux")
