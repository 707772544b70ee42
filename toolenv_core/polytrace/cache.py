"""Where fetched PolyTrace files live, and how a trace named on a command line is found there.

`toolenv traces fetch` fills the cache (default: the platform's user cache directory, e.g.
`~/.cache/toolenv/polytrace`; `TOOLENV_TRACES_CACHE_DIR` or the `traces.cache_dir` setting move it).
Every command that takes a trace resolves it here: a path that exists is used as given; otherwise a
relative name (`search_r1`, `search_r1/multiturn_workload_step_0.jsonl`) or a bare file name
(`multiturn_workload_step_0.jsonl`) is looked up in the cache.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import ClassVar

import platformdirs
from pydantic import Field
from pydantic_settings import SettingsConfigDict

from toolenv_core.config import ServiceSettings

from .errors import TraceFormatError
from .fetch import TIMEOUT_S


def default_cache_dir() -> Path:
    return Path(platformdirs.user_cache_dir("toolenv")) / "polytrace"


class TracesSettings(ServiceSettings):
    """Trace cache settings (env prefix `TOOLENV_TRACES_`, config-file section `traces`)."""

    model_config = SettingsConfigDict(
        env_prefix="TOOLENV_TRACES_", extra="ignore", env_nested_delimiter="__"
    )
    section: ClassVar[str] = "traces"

    cache_dir: Path = Field(
        default_factory=default_cache_dir,
        description="where `toolenv traces fetch` keeps the PolyTrace files",
    )
    source: str | None = Field(
        default=None,
        description="where fetch downloads from: a URL or a directory (default: the pinned upstream)",
    )
    timeout_s: float = Field(
        default=TIMEOUT_S,
        gt=0,
        description="seconds a URL source may send nothing before fetch gives up on it "
        "(the files not yet fetched from it are not tried)",
    )


def trace_cache_dir(config_file: str | Path | None = None) -> Path:
    """The cache directory in force (settings < the config file, `config_file` else
    `TOOLENV_CONFIG` < env var)."""
    return Path(TracesSettings.load(config_file).cache_dir).expanduser()


def cache_dir_problem(root: Path) -> str | None:
    """Why `root` cannot be the trace cache, as `is ...`, or None: it (or a path above it) is a
    file. `traces list --dest FILE` showed every file as not cached, `fetch` said "File exists"."""
    for path in (root, *root.parents):
        if path.exists():
            if path.is_dir():
                return None
            return "is a file, not a directory" if path == root else f"is under {path}, a file"
    return None


def resolve_trace(path: str | Path, cache_dir: Path | None = None) -> Path:
    """The file or directory a trace argument names: as given when it exists, else in the cache."""
    p = Path(path).expanduser()
    if p.exists() or p.is_absolute():
        return p
    root = cache_dir if cache_dir is not None else trace_cache_dir()
    cached = root / p
    if cached.exists():
        return cached
    if len(p.parts) == 1 and root.is_dir():
        hits = sorted(root.glob(f"*/{p.name}"))
        if len(hits) == 1:
            return hits[0]
        if len(hits) > 1:
            names = ", ".join(str(h.relative_to(root)) for h in hits)
            raise TraceFormatError(p, 0, "", f"ambiguous in the trace cache {root}: {names}")
    return p


def missing_trace_error(path: str | Path, cache_dir: Path | None = None) -> TraceFormatError:
    """A trace that is neither on disk nor in the cache: say where we looked and how to fetch."""
    root = cache_dir if cache_dir is not None else trace_cache_dir()
    problem = cache_dir_problem(root)
    which = f", which {problem}" if problem else ""
    return TraceFormatError(
        path,
        0,
        "",
        f"no such file or directory (nor in the trace cache {root}{which}; "
        "`toolenv traces fetch` downloads the published PolyTrace files there)",
    )


def resolve_traces(paths: Iterable[str | Path], cache_dir: Path | None = None) -> list[Path]:
    """Each argument resolved; one that exists nowhere raises `TraceFormatError`."""
    out = []
    for raw in paths:
        p = resolve_trace(raw, cache_dir)
        if not p.exists():
            raise missing_trace_error(raw, cache_dir)
        out.append(p)
    return out


def confine_trace(path: str | Path, roots: Sequence[Path]) -> Path:
    """Where a trace named by an untrusted caller (a profile `PUT` over HTTP) may be read: inside
    one of `roots` (symlinks and `..` resolved first), looked up there like `resolve_trace` does
    in the cache, never relative to the working directory. Raises ValueError otherwise, with the
    same words whether or not the path exists (a 422 must not probe the server's files)."""
    p = Path(path)
    for base in roots:
        root = base.expanduser().resolve()
        candidate = p if p.is_absolute() else root / p
        if not p.is_absolute() and not candidate.exists() and len(p.parts) == 1 and root.is_dir():
            hits = sorted(root.glob(f"*/{p.name}"))
            if len(hits) == 1:
                candidate = hits[0]
        real = candidate.resolve()
        if real.is_relative_to(root):
            return real
    where = ", ".join(str(r) for r in roots)
    raise ValueError(
        f"{path}: a profile sent over HTTP reads traces only from the trace cache and "
        f"emulators.trace_dirs ({where}); name a file there, or the profile in the config file"
    )
