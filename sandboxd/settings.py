"""Sandbox service settings (section `sandbox`, env prefix `TOOLENV_SANDBOX_`)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from toolenv_core.config import FrontDoorSettings, LogLevel
from toolenv_core.fields import Integer, Number
from toolenv_core.net import is_loopback

from .languages import UnknownLanguage, get_language
from .sizing import host_sizing


class SandboxSettings(FrontDoorSettings):
    model_config = SettingsConfigDict(
        env_prefix="TOOLENV_SANDBOX_", extra="ignore", env_nested_delimiter="__"
    )
    section: ClassVar[str] = "sandbox"

    backend: Literal["process", "docker"] = "process"

    # ---- serving
    host: str = "127.0.0.1"
    port: Integer = Field(default=8081, ge=0, le=65535)
    log_level: LogLevel = Field(default="warning", description="uvicorn's, for `sandboxd serve`")
    shutdown_grace_s: Number = Field(
        default=30.0,
        ge=0,
        description="`sandboxd serve` on SIGINT/SIGTERM: how long runs in flight may take to finish",
    )

    # ---- admission: how many programs run at once, how many wait, how long they may wait
    max_concurrency: Integer = Field(
        default=0,
        ge=0,
        description="programs in flight at once; 0: sized from cores and memory (sandboxd.sizing); "
        "on Docker at most docker_pool_size",
    )
    queue_size: Integer = Field(
        default=256, ge=0, description="requests waiting beyond that; then 429"
    )
    queue_timeout_s: Number = Field(
        default=30.0, gt=0, description="longest wait for a slot before 429"
    )
    retry_after_s: Integer = Field(default=1, ge=0, description="Retry-After sent with a 429")
    default_deadline_s: Number | None = Field(
        default=None, gt=0, description="a call's deadline when it sends none (None: none)"
    )
    max_deadline_s: Number | None = Field(
        default=None, gt=0, description="cap on the deadline a caller sends (None: no cap)"
    )

    # ---- limits (per step); requests may ask for less, never more than the max_* values
    default_compile_timeout_s: Number = Field(default=10.0, gt=0)
    default_run_timeout_s: Number = Field(default=10.0, gt=0)
    max_timeout_s: Number = Field(default=60.0, gt=0, description="larger timeouts are a 422")
    default_memory_mb: Integer = Field(default=512, ge=16)
    max_memory_mb: Integer = Field(default=4096, ge=16)
    max_processes: Integer = Field(default=64, ge=4, description="pids cgroup limit per run")
    max_open_files: Integer = Field(default=256, ge=16)
    max_file_size_mb: Integer = Field(default=64, ge=1, description="RLIMIT_FSIZE per file")
    default_output_bytes: Integer = Field(
        default=1024 * 1024, ge=1024, description="stdout/stderr cap"
    )
    max_output_bytes: Integer = Field(default=16 * 1024 * 1024, ge=1024)
    max_tests_per_request: Integer = Field(default=1000, ge=1)
    max_run_tests_output_bytes: Integer = Field(
        default=16 * 1024 * 1024,
        ge=0,
        description="program output (stdout and stderr, every case) one run_tests answer "
        "carries; past it a case's output is cut there (its verdict is from the whole)",
    )
    max_files_per_request: Integer = Field(
        default=1000,
        ge=1,
        description="entries of files, and of fetch_files, in one request (a 422 beyond): each "
        "is handled on the event loop, for every run (100,000 empty files stalled it 5 s)",
    )
    run_cpu_shares: Integer = Field(
        default=1024,
        ge=2,
        le=262144,
        description="CPU weight of each run (cgroup cpu.shares; a docker container's cpu_shares): "
        "the CPU is shared per run, not per process",
    )

    # ---- process backend
    python: str | None = Field(
        default=None,
        description="interpreter Python programs run with; default /usr/bin/python3, else python3 on PATH",
    )
    bwrap_path: str | None = Field(default=None, description="default: `bwrap` on PATH")
    insecure_no_isolation: bool = Field(
        default=False, description="run programs without bubblewrap (only for trusted code)"
    )
    allow_unauthenticated: bool = Field(
        default=False,
        description="serve on an address other hosts reach (sandboxd has no authentication)",
    )
    workdir_root: str | None = Field(
        default=None, description="where run dirs live; default /dev/shm (tmpfs) else the tmp dir"
    )
    cgroup_pool_size: Integer = Field(default=0, ge=0, description="0: max_concurrency * 2")
    warm_sandboxes: Integer = Field(
        default=-1,
        ge=-1,
        description="sandboxes spawned ahead per warm language (-1: max concurrency, 0: off)",
    )
    warm_languages: list[str] = Field(
        default_factory=lambda: ["python"], examples=[["python", "bash"]]
    )
    fork_server: bool = Field(
        default=True,
        description="python runs fork from a zygote (one interpreter start-up for many runs) "
        "where the kernel allows it; else they take the warm-spawn path",
    )
    fork_server_max_forks: Integer = Field(
        default=1000, ge=1, description="forks per zygote before it is replaced"
    )
    fork_server_batch: bool = Field(
        default=True,
        description="the python cases of one run_tests request fork from one runner (their "
        "shared isolation boundary: network namespace and read-only root), a fresh process "
        "with fresh mount, IPC and PID namespaces per case; else one runner per case",
    )

    @field_validator("warm_languages")
    @classmethod
    def _known_languages(cls, names: list[str]) -> list[str]:
        """An unknown one was a traceback at start-up (UnknownLanguage), not a settings error."""
        for name in names:
            try:
                get_language(name)
            except UnknownLanguage as exc:
                raise ValueError(str(exc)) from None
        return names

    @model_validator(mode="after")
    def _defaults_within_bounds(self) -> SandboxSettings:
        """A default beyond its bound was applied as is: a request that sent no run_timeout ran
        100 s where one that sent 100 got a 422 (`max_timeout_s` 60)."""
        for default, bound in (
            ("default_run_timeout_s", "max_timeout_s"),
            ("default_compile_timeout_s", "max_timeout_s"),
            ("default_memory_mb", "max_memory_mb"),
            ("default_output_bytes", "max_output_bytes"),
            ("default_deadline_s", "max_deadline_s"),  # was cut to the cap without a word
        ):
            value, cap = getattr(self, default), getattr(self, bound)
            if value is not None and cap is not None and value > cap:
                raise ValueError(f"{default} ({value}) exceeds {bound} ({cap})")
        return self

    def check_bind(self) -> None:
        """Refuse an address other hosts reach unless explicitly allowed: sandboxd runs whatever
        program it is sent and has no authentication (`sandboxd serve --host 0.0.0.0` was open
        code execution for the whole network, without a word)."""
        if self.allow_unauthenticated or is_loopback(self.host):
            return
        raise ValueError(
            f"refusing to bind {self.host}: sandboxd has no authentication and runs any program "
            "sent to it; bind 127.0.0.1 and reach it through the gateway (which takes API keys), "
            "or pass --allow-unauthenticated where only trusted hosts reach the address (a "
            "private container network)"
        )

    @property
    def concurrency(self) -> int:
        """The effective number of programs run at once: on Docker, never more than the pool's
        containers (one run each). Admission sized from the host (8 on 2 cores) let in more
        runs than a pool of 4 holds: the rest waited inside for a container, past
        `queue_timeout_s` and `queue_size`, while the status said nothing waited."""
        limit = self._configured_concurrency()
        return min(limit, self.docker_pool_size) if self.backend == "docker" else limit

    def _configured_concurrency(self) -> int:
        return self.max_concurrency or host_sizing(self.default_memory_mb).limit

    def admission_reason(self) -> str:
        """Where the limit on programs in flight comes from (for /v1/sandbox/status)."""
        if self.max_concurrency:
            reason = f"{self.max_concurrency} programs in flight: the max_concurrency setting"
        else:
            reason = host_sizing(self.default_memory_mb).describe()
        if self.concurrency < self._configured_concurrency():
            return (
                f"{self.concurrency} programs in flight: docker_pool_size (one run per "
                f"container), below {reason}"
            )
        return reason

    # ---- docker backend (warm pool of containers from the project's sandbox image)
    docker_image: str = Field(default="toolenv/sandbox:0.1.0", description="built when missing")
    docker_base_image: str = Field(
        default="debian:bookworm-slim", description="BASE_IMAGE when the backend builds the image"
    )
    docker_pool_size: Integer = Field(default=4, ge=1, description="warm containers kept ready")
    docker_refill_concurrency: Integer = Field(
        default=2, ge=1, description="containers started at once"
    )
    docker_max_runs_per_container: Integer = Field(default=500, ge=1, description="then recycled")
    docker_memory_mb: Integer = Field(default=1024, ge=64, description="container limit (backstop)")
    docker_cpus: Number = Field(default=1.0, gt=0, description="CPU cores per container")
    docker_pids_limit: Integer = Field(
        default=128, ge=16, description="pids cgroup limit per container"
    )
    docker_workdir_mb: Integer = Field(default=64, ge=1, description="tmpfs size of /sandbox")
    docker_tmp_mb: Integer = Field(default=64, ge=1, description="tmpfs size of /tmp and /dev/shm")
    docker_run_uid: Integer = Field(
        default=65534, ge=1, description="uid (and gid) programs run as"
    )
    docker_state_dir: str | None = Field(
        default=None, description="agent sockets and pool locks; default /run/toolenv-sandboxd"
    )
    docker_start_timeout_s: Number = Field(default=60.0, gt=0, description="warm-up bound")
