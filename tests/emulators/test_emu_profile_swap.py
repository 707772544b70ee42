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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
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


class Held:
    """One piece of the emulators' work, held open until released (what the event loop would
    wait for, were the work done on it)."""

    def __init__(self) -> None:
        self.reached, self.release = threading.Event(), threading.Event()

    def wrap(self, work: Callable[..., Any]) -> Callable[..., Any]:
        def held(*args: Any) -> Any:
            self.reached.set()
            self.release.wait(timeout=30)  # on the event loop, this held every other call too
            return work(*args)

        return held


@contextmanager
def sent_and_held(held: Held, send: Callable[[], httpx.Response]) -> Iterator[list[httpx.Response]]:
    """`send` from a thread until its work is held; the block makes other calls meanwhile. The
    list gets its answer once the work is released (it is still empty in the block)."""
    answers: list[httpx.Response] = []
    sender = threading.Thread(target=lambda: answers.append(send()))
    sender.start()
    try:
        assert held.reached.wait(timeout=30), "the request never reached the held work"
        yield answers
    finally:
        held.release.set()
        sender.join(timeout=60)
    assert answers, "the held request got no answer"


def test_calls_are_answered_while_a_profile_is_parsed(
    served: InProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    search = served.app.state.emulators["search"]
    held = Held()
    monkeypatch.setattr(search, "parse_profile", held.wrap(search.parse_profile))
    url = served.url + "/v1/emulators/search/profile"
    with sent_and_held(held, lambda: httpx.put(url, json=PROFILE, timeout=60)) as put:
        with httpx.Client(timeout=10) as client:  # a failure bound only: it is answered at once
            listed = client.get(served.url + "/v1/emulators")
            call = client.post(served.url + "/retrieve", json={"queries": ["q"], "topk": 1})
        assert listed.status_code == 200 and call.status_code == 200, (listed.text, call.text)
        assert not put  # answered during the parse
        assert {t["tool"]: t["kind"] for t in listed.json()["tools"]}["search"] == "empirical"
    assert put[0].status_code == 200, put[0].text
    assert put[0].json() == {"tool": "search", "kind": "constant", "active": True}
    assert search.profile.model.kind == "constant"  # swapped in once built


def test_calls_are_answered_while_a_get_writes_the_profile(
    served: InProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A GET wrote the profile on the event loop: for a million samples about 0.6 s, during
    which every call waited. It is written in a worker thread now, once per profile."""
    search = served.app.state.emulators["search"]
    held, writes = Held(), []
    write = held.wrap(profiles_router.profile_json)

    def counted_write(profile: Any) -> bytes:
        writes.append(profile)
        return write(profile)

    monkeypatch.setattr(profiles_router, "profile_json", counted_write)
    url = served.url + "/v1/emulators/search/profile"
    with sent_and_held(held, lambda: httpx.get(url, timeout=60)) as got:
        with httpx.Client(timeout=10) as client:  # a failure bound only: it is answered at once
            call = client.post(served.url + "/retrieve", json={"queries": ["q"], "topk": 1})
        assert call.status_code == 200, call.text
        assert not got  # answered while the profile was being written
    assert got[0].status_code == 200, got[0].text
    assert got[0].headers["content-type"] == "application/json"
    assert got[0].json() == search.profile.model_dump(mode="json", exclude_none=True)
    again = httpx.get(url, timeout=10)
    assert again.content == got[0].content and writes == [search.profile]  # kept


def test_calls_are_answered_while_a_heavy_reply_draws_its_sizes(
    served: InProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reply of more than 64 documents is rendered on a worker thread, but its queries'
    sizes were drawn on the event loop first: 256 new queries held every call 15-35 ms."""
    search = served.app.state.emulators["search"]
    held = Held()
    monkeypatch.setattr(search, "tokens_for", held.wrap(search.tokens_for))
    heavy = {"queries": [f"heavy {i}" for i in range(65)], "topk": 1}
    send = lambda: httpx.post(served.url + "/retrieve", json=heavy, timeout=60)  # noqa: E731
    with sent_and_held(held, send) as answered:
        light = {"query": "light", "response_tokens": 10, "delay_s": 0}  # sized by the caller
        with httpx.Client(timeout=10) as client:  # a failure bound only: it is answered at once
            call = client.post(served.url + "/v1/emulators/search/call", json=light)
        assert call.status_code == 200, call.text
        assert not answered  # answered while the heavy reply was being sized
    assert answered[0].status_code == 200, answered[0].text
    assert len(answered[0].json()["result"]) == 65
