"""The gateway's small parts in isolation: admission queue, buckets, budgets, quantiles, settings."""

from __future__ import annotations

import asyncio
import time

import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from gateway.policies import LatencyWindow, RetryBudget
from gateway.settings import GatewaySettings, HedgePolicy, RetryPolicy, ToolConfig
from gateway.upstream import Endpoint, pick, pick_another
from toolenv.cli import build_app
from toolenv_core.admission import Admission, RateLimits, Rejected, TokenBucket
from toolenv_core.deadline import DeadlineHeaderError


async def test_admission_is_fifo_bounded_and_survives_cancellation() -> None:
    adm = Admission("t", limit=2, queue_bound=2)
    await adm.acquire()
    await adm.acquire()
    order: list[str] = []

    async def waiter(name: str) -> None:
        await adm.acquire()
        order.append(name)

    w1 = asyncio.create_task(waiter("w1"))
    await asyncio.sleep(0)
    w2 = asyncio.create_task(waiter("w2"))
    await asyncio.sleep(0)
    assert adm.waiting == 2
    with pytest.raises(Rejected) as info:
        await adm.acquire()
    assert "saturated" in str(info.value) and int(info.value.retry_after_header) >= 1
    w1.cancel()  # a caller that gives up leaves the queue
    await asyncio.sleep(0)
    assert adm.waiting == 1
    adm.release()
    await w2
    assert order == ["w2"] and adm.in_flight == 2
    adm.release()
    adm.release()
    assert adm.in_flight == 0 and adm.waiting == 0


async def test_a_slot_handed_to_a_cancelled_waiter_is_passed_on() -> None:
    adm = Admission("t", limit=1, queue_bound=5)
    await adm.acquire()
    task = asyncio.create_task(adm.acquire())
    await asyncio.sleep(0)
    adm.release()  # hands the slot to the waiter...
    task.cancel()  # ...which is cancelled before it runs
    with pytest.raises(asyncio.CancelledError):
        await task
    assert adm.in_flight == 0  # the slot was not lost
    assert adm.try_acquire()


def test_token_bucket_and_rate_limits() -> None:
    bucket = TokenBucket(rate=10, burst=2)
    assert bucket.take() == 0 and bucket.take() == 0
    wait = bucket.take()
    assert 0 < wait <= 0.1
    limits = RateLimits(rate=1, burst=1)
    limits.check("a")
    limits.check("b")
    with pytest.raises(Rejected):
        limits.check("a")


def test_retry_budget_caps_retries_to_a_fraction_of_calls() -> None:
    budget = RetryBudget(RetryPolicy(enabled=True, budget_ratio=0.1, min_retries_per_s=0))
    for _ in range(20):
        budget.record_call()
    allowed = sum(budget.try_spend() for _ in range(10))
    assert allowed == 2
    floor = RetryBudget(RetryPolicy(enabled=True, budget_ratio=0, min_retries_per_s=3))
    assert sum(floor.try_spend() for _ in range(10)) == 3


def test_latency_window_hedges_after_the_configured_quantile() -> None:
    window = LatencyWindow(HedgePolicy(enabled=True, quantile=0.9, min_samples=10, min_delay_ms=1))
    for i in range(9):
        window.add(i / 100)
    assert window.hedge_delay() is None  # too few samples
    for i in range(9, 100):
        window.add(i / 100)
    assert window.hedge_delay() == pytest.approx(0.891, abs=0.01)
    floor = LatencyWindow(HedgePolicy(enabled=True, min_samples=1, min_delay_ms=50))
    floor.add(0.001)
    assert floor.hedge_delay() == 0.05


def test_pick_prefers_healthy_and_least_outstanding() -> None:
    a, b, c = (
        Endpoint("a", outstanding=3),
        Endpoint("b", outstanding=1),
        Endpoint("c", healthy=False),
    )
    assert pick([a, b, c]) is b
    assert pick([c]) is c  # nothing healthy: still try
    idle = [Endpoint("x"), Endpoint("y")]
    assert {pick(idle, turn=t).label for t in range(4)} == {"x", "y"}


def test_pick_another_prefers_healthy_then_unused() -> None:
    """A hedge's or a retry's endpoint: healthy and unused, else healthy, else unused, else any."""
    a, b, c = Endpoint("a", outstanding=3), Endpoint("b"), Endpoint("c", healthy=False)
    assert pick_another([a, b, c], used=[b]) is a  # busier, but healthy and unused
    assert pick_another([a, b, c], used=[a, b]) is b  # c is down: a healthy one, used or not
    d = Endpoint("d", healthy=False)
    assert pick_another([c, d], used=[c]) is d  # everything down: an unused one (a retry's)
    assert pick_another([c, d], used=[c, d]) in (c, d)
    assert pick_another([c], used=[c]) is c


def test_default_settings_mount_three_embedded_tools(monkeypatch) -> None:
    monkeypatch.delenv("TOOLENV_CONFIG", raising=False)
    s = GatewaySettings()
    assert [(t.name, t.kind, t.mode) for t in s.tools] == [
        ("sandbox", "sandbox", "embedded"),
        ("search", "search", "embedded"),
        ("reward", "reward", "embedded"),
    ]
    assert [t.is_idempotent for t in s.tools] == [False, True, True]
    assert not any(t.retry.enabled or t.hedge.enabled for t in s.tools)


def test_tools_table_from_a_config_file_and_clear_errors(tmp_path) -> None:
    config = tmp_path / "toolenv.yaml"
    config.write_text(
        "gateway:\n"
        "  mode: proxy\n"
        "  tools:\n"
        "    - {name: search, kind: search, upstreams: ['http://a:1/', 'http://b:2'],\n"
        "       concurrency: 8, queue: 16, hedge: {enabled: true, quantile: 0.9}}\n"
    )
    s = GatewaySettings.load(config)
    (tool,) = s.tool_table()
    assert tool.mode == "proxy" and tool.upstreams == ["http://a:1", "http://b:2"]
    assert tool.hedge.quantile == 0.9 and tool.native_path == "/v1/emulators/search/call"
    with pytest.raises(ValidationError, match="proxy mode needs at least one upstream"):
        ToolConfig(name="x", kind="search", mode="proxy")
    with pytest.raises(ValidationError, match="must be an http"):
        ToolConfig(name="x", mode="proxy", upstreams=["ftp://x"])
    with pytest.raises(ValidationError, match="unique"):
        GatewaySettings(tools=[ToolConfig(name="a", kind="search")] * 2)
    with pytest.raises(ValidationError, match="exceeds max_deadline_ms"):
        ToolConfig(name="x", kind="search", default_deadline_ms=10, max_deadline_ms=5)
    # a name function-calling APIs take (GET /v1/tools feeds their tools=): a dot was accepted
    for bad in ("web.search", "", "x" * 65, "a b"):
        with pytest.raises(ValidationError, match="must be 1-64 letters, digits, '_' or '-'"):
            ToolConfig(name=bad, kind="search")
    assert ToolConfig(name="web_search-2", kind="search").name == "web_search-2"


@pytest.mark.parametrize(
    ("url", "said"),
    [
        ("http://", "upstream URL 'http://' has no host"),
        ("http://a:b", "upstream URL 'http://a:b': Port could not be cast to integer value"),
        ("http://a:99999", "upstream URL 'http://a:99999': Port out of range 0-65535"),
        # it was read as port 80: calls went to whatever listened there
        ("http://a:0", "upstream URL 'http://a:0' names port 0, which no server listens on"),
        ("http://[::1", "upstream URL 'http://[::1': Invalid IPv6 URL"),
        ("http://a :1", "upstream URL 'http://a :1' contains whitespace"),
        ("http://a/x?y=1", "upstream URL 'http://a/x?y=1' is a base URL: no ?query or #fragment"),
        # the credentials were dropped without a word, and `config show` printed the password
        ("http://u:pw@a:1", "upstream URL 'http://***@a:1' carries credentials (user:password@)"),
        # refused before the port is read: its message showed the URL, password and all
        ("http://u:pw@a:b", "upstream URL 'http://***@a:b' carries credentials (user:password@)"),
    ],
)
def test_an_upstream_url_the_client_cannot_use_is_one_settings_line(tmp_path, url, said) -> None:
    """Before: each passed the settings and was a traceback from the server's start-up (exit 3);
    the one with a space started, with an upstream host "a " that never resolves."""
    config = tmp_path / "toolenv.yaml"
    config.write_text(f"gateway:\n  tools:\n    - {{name: t, mode: proxy, upstreams: ['{url}']}}\n")
    result = CliRunner().invoke(build_app(), ["config", "show", "--config", str(config)])
    assert result.exit_code == 2, (result.output, result.exception)
    assert result.stderr.startswith(f"error: invalid gateway settings: tools.0.upstreams: {said}")
    assert result.stderr.count("\n") == 1
    assert "pw@" not in result.stderr


@pytest.mark.parametrize(
    ("key", "value"), [("call_path", "call"), ("health_path", "healthz"), ("call_path", "/a b")]
)
def test_a_tool_path_without_its_slash_is_one_settings_line(tmp_path, key, value) -> None:
    """Before: `call_path: call` was sent as the request line `POST call HTTP/1.1`, and every
    call came back a 400 from the tool."""
    config = tmp_path / "toolenv.yaml"
    config.write_text(
        "gateway:\n  tools:\n"
        f"    - {{name: t, mode: proxy, upstreams: ['http://a:1'], {key}: '{value}'}}\n"
    )
    result = CliRunner().invoke(build_app(), ["config", "show", "--config", str(config)])
    assert result.exit_code == 2, (result.output, result.exception)
    said = f"tools.0.{key}: must be a path starting with '/' (e.g. /call), got {value!r}\n"
    assert result.stderr == f"error: invalid gateway settings: {said}"


def test_deadline_for_caps_and_defaults() -> None:
    from gateway.dispatch import ToolRuntime
    from gateway.metrics import GatewayMetrics

    class _NoBackend:
        endpoints: list = []

    rt = ToolRuntime(
        ToolConfig(name="x", kind="search", default_deadline_ms=100, max_deadline_ms=200),
        _NoBackend(),  # type: ignore[arg-type]
        GatewayMetrics(),
    )
    deadline, ms = rt.deadline_for(None)
    assert ms == 100 and 0.09 < deadline.remaining() <= 0.1
    assert rt.deadline_for(None, 10_000)[1] == 200
    assert rt.deadline_for("10000")[1] == 200
    assert rt.deadline_for(None, 0)[1] == 0
    assert rt.deadline_for("0")[1] == 0
    assert time.monotonic() < rt.deadline_for(None, 50)[0].at
    # a header and a body deadline: the earlier wins, whichever carries it
    assert rt.deadline_for("80", 150)[1] == 80
    assert rt.deadline_for("150", 80)[1] == 80
    with pytest.raises(DeadlineHeaderError):
        rt.deadline_for("soon", 50)


def test_tools_table_from_the_environment_and_forced_modes(monkeypatch) -> None:
    monkeypatch.setenv(
        "TOOLENV_GATEWAY_TOOLS",
        '[{"name": "s", "kind": "search", "mode": "proxy", "upstreams": ["http://a:1"]}]',
    )
    (tool,) = GatewaySettings().tool_table()
    assert tool.name == "s" and tool.upstreams == ["http://a:1"]
    assert GatewaySettings(mode="embedded").tool_table()[0].mode == "embedded"
    monkeypatch.delenv("TOOLENV_GATEWAY_TOOLS")
    with pytest.raises(ValidationError, match="proxy mode needs at least one upstream"):
        GatewaySettings(mode="proxy")  # the default tools are embedded and name no upstreams


def test_a_forced_mode_that_does_not_fit_says_it_was_forced(tmp_path) -> None:
    """Before: `--mode embedded` over a proxy table said "tool 'dead': an embedded 'http' tool
    needs `app`" of a tool the file says is proxy, and `TOOLENV_GATEWAY_MODE=proxy` with no table
    named a tool 'sandbox' the caller never wrote."""
    config = tmp_path / "toolenv.yaml"
    config.write_text(
        "gateway:\n  tools:\n    - {name: dead, mode: proxy, upstreams: ['http://127.0.0.1:9']}\n"
    )
    forced = "(--mode, TOOLENV_GATEWAY_MODE or gateway.mode) forces every tool into"
    for args, env, said in [
        (["--config", str(config), "--mode", "embedded"], {},
         f"mode 'embedded' {forced} embedded mode, and tool 'dead': an embedded 'http' tool "
         'needs `app` ("module:factory" of its ASGI app)'),
        ([], {"TOOLENV_GATEWAY_MODE": "proxy"},
         f"mode 'proxy' {forced} proxy mode, and tool 'sandbox': proxy mode needs at least one "
         "upstream URL (with no tools table, the tools are sandbox, search and reward)"),
    ]:  # fmt: skip
        result = CliRunner().invoke(
            build_app(),
            ["gateway", "serve", "--port", "1", *args],
            env={"TOOLENV_CONFIG": None, **env},
        )
        assert result.exit_code == 2, (result.output, result.exception)
        assert result.stderr == f"error: invalid gateway settings: {said}\n"
