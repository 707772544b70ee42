"""Gateway settings: where it listens, how it guards the front door, and the tools table.

The tools table is one list of `ToolConfig` (YAML/TOML/JSON section `gateway.tools`, or the
JSON env var `TOOLENV_GATEWAY_TOOLS`). With no table at all, the gateway mounts sandbox, search
and reward in-process (what `toolenv serve` runs).
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import NoDecode, SettingsConfigDict

from toolenv_core.config import FrontDoorSettings, LogLevel
from toolenv_core.errors import problems
from toolenv_core.fields import Integer, Number
from toolenv_core.http1 import Endpoint, TargetURLError
from toolenv_core.net import is_loopback

ToolKind = Literal["sandbox", "search", "reward", "http"]
_TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")

# The native endpoint each kind's generic call (`POST /v1/tools/{tool}/call`) is forwarded to.
NATIVE_CALL_PATH: dict[str, str] = {
    "sandbox": "/run_code",
    "search": "/v1/emulators/search/call",
    "reward": "/v1/emulators/reward/call",
    "http": "/call",
}
# What an active health check asks each upstream.
HEALTH_PATH: dict[str, str] = {
    "sandbox": "/v1/ping",
    "search": "/healthz",
    "reward": "/healthz",
    "http": "/healthz",
}
# The in-process application each built-in kind mounts in embedded mode, by mount name: the apps
# themselves are built by whoever wires the gateway (`toolenv serve`) and handed to `create_app`.
BUILTIN_MOUNT: dict[str, str] = {
    "sandbox": "sandboxd",
    "search": "emulators",
    "reward": "emulators",
}


class RetryPolicy(BaseModel):
    """Retries within a budget: connection errors (the upstream never saw the request) for any
    tool; calls broken mid-request (an upstream or a Ray replica died) for idempotent tools."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    enabled: bool = False
    max_attempts: Integer = Field(
        default=3, ge=1, le=10, description="attempts in total, first included"
    )
    backoff_ms: Number = Field(
        default=0.0,
        ge=0,
        le=10_000,
        description="wait before the first retry, doubled each time (rides out a restart); "
        "never past the call's deadline",
    )
    budget_ratio: Number = Field(default=0.2, ge=0, description="retries allowed per call made")
    min_retries_per_s: Number = Field(
        default=10.0, ge=0, description="retries always allowed per second"
    )


class HedgePolicy(BaseModel):
    """Hedged requests for idempotent tools: a second attempt once the first is slow."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    enabled: bool = False
    quantile: Number = Field(
        default=0.95, gt=0, lt=1, description="hedge after this latency quantile"
    )
    min_delay_ms: Number = Field(default=5.0, ge=0, description="never hedge sooner than this")
    min_samples: Integer = Field(default=20, ge=1, description="recent calls needed before hedging")
    window: Integer = Field(
        default=512, ge=8, description="recent latencies the quantile is taken over"
    )

    @model_validator(mode="after")
    def _window_holds_the_samples(self) -> HedgePolicy:
        """A window smaller than `min_samples` never holds enough latencies: no call was ever
        hedged, without a word."""
        if self.min_samples > self.window:
            raise ValueError(
                f"min_samples ({self.min_samples}) is more than the window keeps "
                f"({self.window}), so no call would ever be hedged: lower min_samples or raise "
                "window"
            )
        return self


# a call's deadline when it sends none, by kind (`ToolConfig.deadline_default_ms`): 30 s, but
# PolyTrace's rllm_deepcoder verifies a batch of 64 responses in 37-125 s
DEFAULT_DEADLINE_MS: dict[str, float] = {"reward": 180_000}


class ToolConfig(BaseModel):
    """One tool behind the gateway."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    name: str = Field(description="1-64 letters, digits, '_' or '-' (a function name)")
    kind: ToolKind = "http"
    mode: Literal["embedded", "proxy"] = "embedded"
    upstreams: list[str] = Field(default_factory=list, description="base URLs (proxy mode)")
    app: str | None = Field(
        default=None,
        description='embedded custom tool: "module:factory" of its ASGI app, called with no '
        "arguments (the extension point for your own tools; built-in kinds need none)",
        pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$",
    )
    call_path: str | None = Field(default=None, description="native endpoint (default by kind)")
    health_path: str | None = None
    health_interval_s: Number = Field(default=2.0, gt=0)
    concurrency: Integer = Field(default=64, ge=1, description="calls in flight at once")
    queue: Integer = Field(
        default=1024, ge=0, description="calls waiting beyond that; more get 429"
    )
    default_deadline_ms: Number | None = Field(
        default=None,
        gt=0,
        description="a call's deadline without X-Toolenv-Deadline-Ms (default: 30,000; for "
        "reward 180,000, at most max_deadline_ms: a recorded batch of 64 takes 37-125 s)",
    )
    max_deadline_ms: Number = Field(default=300_000, gt=0)
    timeout_margin_ms: Number = Field(
        default=5_000,
        ge=0,
        description="sandbox pass-through without a deadline header: added to the request's own "
        "compile_timeout + run_timeout to make its deadline",
    )
    default_compile_timeout_s: Number = Field(
        default=10.0,
        gt=0,
        description="sandbox pass-through without a deadline header: the compile_timeout the "
        "sandbox applies where a request sends none (SandboxFusion's 10 s; an embedded sandbox's "
        "own default_compile_timeout_s unless set here)",
    )
    default_run_timeout_s: Number = Field(
        default=10.0,
        gt=0,
        description="the same for run_timeout (and a run_tests case's timeout): an embedded "
        "sandbox's own default_run_timeout_s unless set here",
    )
    idempotent: bool | None = Field(default=None, description="default: true for search and reward")
    retry: RetryPolicy = Field(default_factory=RetryPolicy)
    hedge: HedgePolicy = Field(default_factory=HedgePolicy)
    description: str | None = Field(default=None, description="for GET /v1/tools (default by kind)")
    parameters: dict[str, Any] | None = Field(
        default=None, description="JSON schema of `arguments` for GET /v1/tools (default by kind)"
    )

    @field_validator("upstreams")
    @classmethod
    def _urls(cls, value: list[str]) -> list[str]:
        for url in value:
            if not url.startswith("http://"):
                raise ValueError(
                    f"upstream {url!r} must be an http:// URL (put TLS in front of the gateway, not behind it)"
                )
            # What the upstream client will make of it, checked here: a URL without a host or with
            # a bad port was a traceback from the server's start-up (exit 3), not a settings line.
            try:
                Endpoint.parse(url)
            except TargetURLError as exc:
                raise ValueError(f"upstream {exc}") from exc
            if any(c.isspace() for c in url):  # "http://host :80" connected to "host "
                raise ValueError(f"upstream URL {url!r} contains whitespace")
            if "?" in url or "#" in url:  # a base URL: each request's path goes after its own
                raise ValueError(f"upstream URL {url!r} is a base URL: no ?query or #fragment")
        return [u.rstrip("/") for u in value]

    @field_validator("name")
    @classmethod
    def _function_name(cls, value: str) -> str:
        """What function-calling APIs take as a function name (OpenAI's and vLLM's `tools=`, which
        `GET /v1/tools` feeds): a dot in it was accepted here and refused there."""
        if not _TOOL_NAME.fullmatch(value):
            raise ValueError(
                "must be 1-64 letters, digits, '_' or '-' (a function name for function-calling "
                f"APIs), got {value[:80]!r}"
            )
        return value

    @field_validator("call_path", "health_path")
    @classmethod
    def _path(cls, value: str | None) -> str | None:
        """`call_path: call` (no slash) was sent as `POST call HTTP/1.1`: every call a 400."""
        if value is not None and (not value.startswith("/") or any(c.isspace() for c in value)):
            raise ValueError(f"must be a path starting with '/' (e.g. /call), got {value!r}")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> ToolConfig:
        if self.mode == "proxy" and not self.upstreams:
            raise ValueError(f"tool {self.name!r}: proxy mode needs at least one upstream URL")
        if self.mode == "embedded" and self.app is None and self.kind not in BUILTIN_MOUNT:
            raise ValueError(
                f"tool {self.name!r}: an embedded {self.kind!r} tool needs `app` "
                '("module:factory" of its ASGI app)'
            )
        if self.default_deadline_ms is not None and self.default_deadline_ms > self.max_deadline_ms:
            raise ValueError(f"tool {self.name!r}: default_deadline_ms exceeds max_deadline_ms")
        if self.hedge.enabled and not self.is_idempotent:  # it was switched off without a word
            raise ValueError(
                f"tool {self.name!r}: hedge.enabled needs `idempotent: true` (a hedge sends the "
                f"call twice; a {self.kind} tool is not idempotent unless you say so)"
            )
        return self

    @property
    def native_path(self) -> str:
        return self.call_path or NATIVE_CALL_PATH[self.kind]

    @property
    def health(self) -> str:
        return self.health_path or HEALTH_PATH[self.kind]

    @property
    def mount(self) -> str:
        """The in-process app this tool uses in embedded mode: a custom `app`, else by kind."""
        return self.app or BUILTIN_MOUNT[self.kind]

    @property
    def deadline_default_ms(self) -> float:
        """`default_deadline_ms`, else by kind: reward's emulated batches outlast 30 s (a call with
        no deadline of its own was a 504 at 30 s where the batch took 40)."""
        if self.default_deadline_ms is not None:
            return self.default_deadline_ms
        return min(DEFAULT_DEADLINE_MS.get(self.kind, 30_000), self.max_deadline_ms)

    @property
    def is_idempotent(self) -> bool:
        return self.idempotent if self.idempotent is not None else self.kind in ("search", "reward")


def default_tools() -> list[ToolConfig]:
    return [
        ToolConfig(name="sandbox", kind="sandbox", concurrency=16, queue=512),
        ToolConfig(name="search", kind="search", concurrency=256, queue=4096),
        ToolConfig(name="reward", kind="reward", concurrency=256, queue=4096),
    ]


class GatewaySettings(FrontDoorSettings):
    model_config = SettingsConfigDict(
        env_prefix="TOOLENV_GATEWAY_", extra="ignore", env_nested_delimiter="__"
    )
    section: ClassVar[str] = "gateway"

    host: str = "127.0.0.1"
    port: Integer = Field(default=8080, ge=0, le=65535)
    log_level: LogLevel = "info"
    mode: Literal["embedded", "proxy"] | None = Field(
        default=None, description="force every tool into this mode (None: as each tool says)"
    )
    tools: list[ToolConfig] = Field(
        default_factory=default_tools,
        examples=[[{"name": "search", "kind": "search"}, {"name": "code", "kind": "sandbox"}]],
    )
    api_keys: Annotated[list[SecretStr], NoDecode] = Field(
        default_factory=list,
        description="bearer keys (env: comma-separated or a JSON list); empty = open",
    )
    allow_unauthenticated: bool = False
    shutdown_grace_s: Number = Field(
        default=30.0,
        ge=0,
        description="on SIGINT/SIGTERM, how long calls in flight may take to finish",
    )
    rate_limit_per_s: Number | None = Field(
        default=None, gt=0, description="per API key (or client)"
    )
    rate_limit_burst: Number = Field(default=100.0, ge=1)
    trace_path: str | None = Field(default=None, description="JSONL file for trace capture")
    backlog: Integer = Field(
        default=4096, ge=64, description="listen backlog (bursts of connections)"
    )
    upstream_connect_timeout_s: Number = Field(
        default=10.0, gt=0, description="generous: an overloaded event loop must not fail connects"
    )
    upstream_keepalive_s: Number = Field(
        default=2.0,
        gt=0,
        description="idle upstream connections closed after this (keep it below the upstream's own)",
    )
    upstream_pool_size: Integer = Field(
        default=1024, ge=1, description="idle connections kept per upstream"
    )
    upstream_max_body_bytes: Integer = Field(
        default=256 * 1024 * 1024,
        ge=1024,
        description="largest upstream answer body taken in (proxy mode); past it the call is a "
        "502 and the connection is closed, the rest unread. Ample: sandboxd's largest answer is four "
        "16 MiB output streams (its max_output_bytes)",
    )

    @field_validator("api_keys", mode="before")
    @classmethod
    def _split_keys(cls, value: Any) -> Any:
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("["):
                return json.loads(text)
            return [k.strip() for k in text.split(",") if k.strip()]
        return value

    @field_validator("api_keys")
    @classmethod
    def _usable_keys(cls, keys: list[SecretStr]) -> list[SecretStr]:
        """An empty key let in `Authorization: Bearer ` (nothing after it) and, being a key,
        allowed a non-loopback bind: `api_keys: ["${KEY}"]` with KEY unset opened the gateway.
        A key is never echoed: said by its position."""
        for i, key in enumerate(keys):
            value = key.get_secret_value()
            if not value.strip():
                raise ValueError(
                    f"key {i} is empty, which would let in any `Authorization: Bearer ` with "
                    "nothing after it (an unset variable in the list?): remove it or set it"
                )
            if value != value.strip():  # the bearer a caller sends is read without them
                raise ValueError(
                    f"key {i} starts or ends with whitespace, so no caller could send it: "
                    "remove the whitespace"
                )
        return keys

    @field_validator("tools")
    @classmethod
    def _unique(cls, tools: list[ToolConfig]) -> list[ToolConfig]:
        names = [t.name for t in tools]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"tool names must be unique, repeated: {', '.join(dupes)}")
        return tools

    @model_validator(mode="after")
    def _mode_override_fits(self) -> GatewaySettings:
        try:
            self.tool_table()  # a forced mode must still make sense for every tool: say which not
        except ValidationError as exc:
            # said as the forced mode's doing: "tool 'sandbox': proxy mode needs ..." named a
            # mode and a tool (the default table) the caller never wrote
            said = "; ".join(message for _, message in problems(exc))
            if "tools" not in self.model_fields_set:
                said += " (with no tools table, the tools are sandbox, search and reward)"
            raise ValueError(
                f"mode {self.mode!r} (--mode, TOOLENV_GATEWAY_MODE or gateway.mode) forces every "
                f"tool into {self.mode} mode, and {said}"
            ) from None
        return self

    def tool_table(self) -> list[ToolConfig]:
        """The tools with the global `mode` override applied (validated again)."""
        if self.mode is None:
            return list(self.tools)
        return [
            ToolConfig.model_validate({**t.model_dump(), "mode": self.mode}) for t in self.tools
        ]

    def check_bind(self) -> None:
        """Refuse a non-loopback bind without keys unless explicitly allowed (why: open RCE)."""
        if self.api_keys or self.allow_unauthenticated or is_loopback(self.host):
            return
        raise ValueError(
            f"refusing to bind {self.host} without API keys: set TOOLENV_GATEWAY_API_KEYS "
            "or pass --allow-unauthenticated"
        )
