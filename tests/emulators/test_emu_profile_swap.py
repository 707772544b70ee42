"""What takes long runs off the event loop: the emulators keep answering meanwhile.

A profile PUT is parsed, checked and built, a profile GET is written, and a heavy reply's sizes
are drawn on worker threads. Before, a large profile (1.4M samples) was parsed on the event loop
for about 1.3 s, and every other call of the emulator waited. Here each piece of work is held
open by an event (instead of a huge body, whose duration would be a timing), and other calls
must be answered while it is held.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import uvicorn

from emulators import profiles_router
from emulators.app import create_app
from emulators.settings import EmulatorSettings
from toolenv_core.net import free_port

PROFILE = {"model": {"kind": "constant", "value_s": 0.001}}  # the shipped one is empirical


class InProcess:
    """The emulators app on a loopback port, served by uvicorn in a thread (so its emulators
    can be reached from the test)."""

    def __init__(self) -> None:
        self.app = create_app(EmulatorSettings())
        self.url = f"http://127.0.0.1:{free_port()}"
        port = int(self.url.rsplit(":", 1)[1])
        config = uvicorn.Config(self.app, host="127.0.0.1", port=port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=lambda: asyncio.run(self.server.serve()))
        self.thread.start()
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("the emulators did not start")
            threading.Event().wait(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)


@pytest.fixture
def served() -> Iterator[InProcess]:
    s = InProcess()
    yield s
    s.stop()


def test_calls_are_answered_while_a_profile_is_parsed(
    served: InProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    search = served.app.state.emulators["search"]
    parsing, release = threading.Event(), threading.Event()
    parse = search.parse_profile

    def held_parse(data: Any):
        parsing.set()
        release.wait(timeout=30)  # on the event loop, this held every other call too
        return parse(data)

    monkeypatch.setattr(search, "parse_profile", held_parse)
    answers: dict[str, httpx.Response] = {}

    def put() -> None:
        answers["put"] = httpx.put(
            served.url + "/v1/emulators/search/profile", json=PROFILE, timeout=60
        )

    putter = threading.Thread(target=put)
    putter.start()
    try:
        assert parsing.wait(timeout=30), "the PUT never reached its parse"
        with httpx.Client(timeout=10) as client:  # a failure bound only: it is answered at once
            listed = client.get(served.url + "/v1/emulators")
            call = client.post(served.url + "/retrieve", json={"queries": ["q"], "topk": 1})
        assert listed.status_code == 200 and call.status_code == 200, (listed.text, call.text)
        assert "put" not in answers and not release.is_set()  # answered during the parse
        assert {t["tool"]: t["kind"] for t in listed.json()["tools"]}["search"] == "empirical"
    finally:
        release.set()
        putter.join(timeout=60)
    assert answers["put"].status_code == 200, answers["put"].text
    assert answers["put"].json() == {"tool": "search", "kind": "constant", "active": True}
    assert search.profile.model.kind == "constant"  # swapped in once built


def test_calls_are_answered_while_a_get_writes_the_profile(
    served: InProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A GET wrote the profile on the event loop: for a million samples about 0.6 s, during
    which every call waited. It is written in a worker thread now, once per profile."""
    search = served.app.state.emulators["search"]
    writing, release = threading.Event(), threading.Event()
    write = profiles_router.profile_json
    writes: list[object] = []

    def held_write(profile: Any) -> bytes:
        writes.append(profile)
        writing.set()
        release.wait(timeout=30)  # on the event loop, this held every other call too
        return write(profile)

    monkeypatch.setattr(profiles_router, "profile_json", held_write)
    answers: dict[str, httpx.Response] = {}

    def get() -> None:
        answers["get"] = httpx.get(served.url + "/v1/emulators/search/profile", timeout=60)

    getter = threading.Thread(target=get)
    getter.start()
    try:
        assert writing.wait(timeout=30), "the GET never reached its write"
        with httpx.Client(timeout=10) as client:  # a failure bound only: it is answered at once
            call = client.post(served.url + "/retrieve", json={"queries": ["q"], "topk": 1})
        assert call.status_code == 200, call.text
        assert "get" not in answers  # answered while the profile was being written
    finally:
        release.set()
        getter.join(timeout=60)
    assert answers["get"].status_code == 200, answers["get"].text
    assert answers["get"].headers["content-type"] == "application/json"
    assert answers["get"].json() == search.profile.model_dump(mode="json", exclude_none=True)
    again = httpx.get(served.url + "/v1/emulators/search/profile", timeout=10)
    assert again.content == answers["get"].content and writes == [search.profile]  # kept


def test_calls_are_answered_while_a_heavy_reply_draws_its_sizes(
    served: InProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reply of more than 64 documents is rendered on a worker thread, but its queries'
    sizes were drawn on the event loop first: 256 new queries held every call 15-35 ms."""
    search = served.app.state.emulators["search"]
    sizing, release = threading.Event(), threading.Event()
    tokens_for = search.tokens_for

    def held_tokens_for(*args: Any) -> int:
        sizing.set()
        release.wait(timeout=30)  # on the event loop, this held every other call too
        return tokens_for(*args)

    monkeypatch.setattr(search, "tokens_for", held_tokens_for)
    heavy = {"queries": [f"heavy {i}" for i in range(65)], "topk": 1}
    answers: dict[str, httpx.Response] = {}

    def post() -> None:
        answers["heavy"] = httpx.post(served.url + "/retrieve", json=heavy, timeout=60)

    poster = threading.Thread(target=post)
    poster.start()
    try:
        assert sizing.wait(timeout=30), "the heavy reply never drew its sizes"
        light = {"query": "light", "response_tokens": 10, "delay_s": 0}  # sized by the caller
        with httpx.Client(timeout=10) as client:  # a failure bound only: it is answered at once
            call = client.post(served.url + "/v1/emulators/search/call", json=light)
        assert call.status_code == 200, call.text
        assert "heavy" not in answers  # answered while the heavy reply was being sized
    finally:
        release.set()
        poster.join(timeout=60)
    assert answers["heavy"].status_code == 200, answers["heavy"].text
    assert len(answers["heavy"].json()["result"]) == 65
