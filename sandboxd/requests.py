"""Turning a request's fields into a `RunSpec` within the configured bounds (or a `BadRequest`)."""

from __future__ import annotations

import base64
import binascii
import os
from collections.abc import Mapping
from pathlib import Path

from .languages import Language, UnknownLanguage, get_language
from .models import Limits, RunSpec
from .process.cgroups import MIN_CPU_LIMIT
from .process.paths import InvalidPath, safe_relative_path
from .settings import SandboxSettings


class BadRequest(ValueError):
    """A request the client must fix: `status` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class RequestBounds:
    """Validates request fields against one service's settings."""

    def __init__(self, settings: SandboxSettings) -> None:
        self.settings = settings
        self.cores = os.cpu_count() or 1  # read once: it reads /sys on every call

    def timeout(self, value: float | None, default: float, field: str) -> float:
        if value is None:
            return default
        if not 0 < value <= self.settings.max_timeout_s:
            raise BadRequest(
                422, f"{field} must be > 0 and <= {self.settings.max_timeout_s} s, got {value}"
            )
        return float(value)

    def limits(
        self,
        *,
        wall: float,
        memory_mb: int | None,
        cpu_limit: float | None,
        max_output_bytes: int | None,
    ) -> Limits:
        s = self.settings
        if memory_mb is None or memory_mb in (-1, 0):
            memory_mb = s.default_memory_mb
        elif not 0 < memory_mb <= s.max_memory_mb:
            raise BadRequest(
                422,
                f"memory_limit_MB must be -1 or 0 (the default, {s.default_memory_mb}) or "
                f"1..{s.max_memory_mb}, got {memory_mb}",
            )
        cores = self.cores
        if cpu_limit is not None and not MIN_CPU_LIMIT <= cpu_limit <= cores:
            raise BadRequest(
                422,
                f"cpu_limit must be >= {MIN_CPU_LIMIT} (the smallest CFS quota) and <= {cores} "
                f"cores, got {cpu_limit}",
            )
        if max_output_bytes is not None and not 0 < max_output_bytes <= s.max_output_bytes:
            raise BadRequest(
                422, f"max_output_bytes must be 1..{s.max_output_bytes}, got {max_output_bytes}"
            )
        return Limits(
            wall_time_s=wall,
            memory_mb=memory_mb,
            cpu_limit=cpu_limit,
            max_output_bytes=max_output_bytes or s.default_output_bytes,
            max_processes=s.max_processes,
            max_open_files=s.max_open_files,
            max_file_size_mb=s.max_file_size_mb,
        )

    def count(self, names: Mapping[str, str | None] | list[str], field: str) -> None:
        """At most `max_files_per_request` paths: each one costs the event loop, every run."""
        if len(names) > (most := self.settings.max_files_per_request):
            raise BadRequest(422, f"at most {most} {field} per request, got {len(names)}")

    def decode_files(self, files: Mapping[str, str | None]) -> dict[str, bytes]:
        """The files to write, decoded and checked. A null content writes no file, as SandboxFusion
        does (it skips it unchecked; an empty file is `""`)."""
        self.count(files, "files")
        out: dict[str, bytes] = {}
        paths: dict[Path, str] = {}
        for name, b64 in files.items():
            if b64 is None:
                continue
            try:
                path = safe_relative_path(name)
            except InvalidPath as exc:
                raise BadRequest(422, str(exc)) from exc
            if path in paths:
                raise BadRequest(422, f"files {paths[path]!r} and {name!r} name the same file")
            paths[path] = name
            try:
                # Line breaks allowed: `base64` and `base64.encodebytes` wrap at 76 characters,
                # and SandboxFusion reads such content (it was a 422 here); other junk is not.
                out[name] = base64.b64decode("".join(b64.split()), validate=True)
            except (binascii.Error, ValueError) as exc:
                raise BadRequest(422, f"files[{name!r}] is not valid base64: {exc}") from exc
        # A file that is also another's directory cannot be written (it was a SandboxError).
        for path, name in paths.items():
            for parent in path.parents[:-1]:
                if parent in paths:
                    raise BadRequest(
                        422, f"files {paths[parent]!r} and {name!r} conflict: "
                        f"{paths[parent]!r} cannot be both a file and a directory"
                    )  # fmt: skip
        return out

    @staticmethod
    def _refuse_reserved(files: Mapping[str, bytes], lang: Language) -> None:
        """A file where sandboxd writes the program's source or its binary was silently replaced
        (SandboxFusion writes the code under a random name beside the files), and a directory
        there failed the compile: `files: {"main/data.txt": ...}` read "compilation failed"."""
        reserved = {lang.source_file: "source file"}
        if lang.artifact is not None:
            reserved[lang.artifact] = "binary"
        for name in files:
            top = Path(name).parts[0]
            if top in reserved:
                raise BadRequest(
                    422,
                    f"files {name!r}: {top!r} is the {lang.name} program's {reserved[top]} in "
                    "the working dir; give the file another name",
                )

    def spec(
        self,
        *,
        code: str,
        language: str,
        stdin: str,
        files: dict[str, bytes],
        fetch_files: list[str],
        compile_timeout: float | None,
        run_timeout: float | None,
        memory_mb: int | None,
        cpu_limit: float | None,
        max_output_bytes: int | None,
    ) -> RunSpec:
        s = self.settings
        try:
            lang = get_language(language)
        except UnknownLanguage as exc:
            raise BadRequest(400, str(exc)) from exc
        self._refuse_reserved(files, lang)
        self.count(fetch_files, "fetch_files")
        for name in fetch_files:
            try:
                safe_relative_path(name)
            except InvalidPath as exc:
                raise BadRequest(422, str(exc)) from exc
        run_wall = self.timeout(run_timeout, s.default_run_timeout_s, "run_timeout")
        compile_wall = self.timeout(compile_timeout, s.default_compile_timeout_s, "compile_timeout")
        run_limits = self.limits(
            wall=run_wall,
            memory_mb=memory_mb,
            cpu_limit=cpu_limit,
            max_output_bytes=max_output_bytes,
        )
        # the program's limits never squeeze its compiler below the defaults: a max_output_bytes
        # of 64 killed gcc at its first warning, and the program never ran ("Failed")
        compile_limits = self.limits(
            wall=compile_wall,
            memory_mb=max(run_limits.memory_mb or 0, s.default_memory_mb),
            cpu_limit=None,
            max_output_bytes=max(run_limits.max_output_bytes or 0, s.default_output_bytes),
        )
        return RunSpec(
            language=lang.name,
            code=code,
            stdin=stdin,
            files=files,
            fetch_files=fetch_files,
            compile_limits=compile_limits,
            run_limits=run_limits,
        )
