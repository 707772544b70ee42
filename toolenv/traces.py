"""`toolenv traces ...`: fetch the published PolyTrace files into the trace cache, list them.

The data is downloaded, never shipped: the package carries only the manifest (names, sizes,
sha256 and the pinned upstream commit). Every command that takes a trace finds these files by
name in the cache (`toolenv_core.polytrace.cache`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.table import Table

from toolenv_core.config import config_error
from toolenv_core.console import report_console
from toolenv_core.outputs import output_dir_problem
from toolenv_core.polytrace.cache import TracesSettings, cache_dir_problem
from toolenv_core.polytrace.fetch import Fetcher, FetchResult, is_cached, source_problem
from toolenv_core.polytrace.manifest import ManifestEntry, load_manifest
from toolenv_core.sigterm import sigterm_unwinds

CacheDirOption = Annotated[
    Path | None,
    typer.Option(
        "--dest",
        help="Cache directory (default: TOOLENV_TRACES_CACHE_DIR or ~/.cache/toolenv/polytrace).",
    ),
]

app = typer.Typer(
    help="The published PolyTrace files: fetch them into the cache, list them.",
    no_args_is_help=True,
)


def _fail(message: str, code: int = 2) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code)


def _cache_dir(settings: TracesSettings) -> Path:
    """The cache directory in force; one that is a file is bad input (exit 2)."""
    cache_dir = Path(settings.cache_dir).expanduser()
    problem = cache_dir_problem(cache_dir)
    if problem:
        raise _fail(f"the trace cache {cache_dir} {problem} (--dest or TOOLENV_TRACES_CACHE_DIR)")
    return cache_dir


def _settings(
    dest: Path | None, source: str | None, timeout: float | None = None
) -> TracesSettings:
    overrides = {"cache_dir": dest, "source": source, "timeout_s": timeout}
    try:
        return TracesSettings.load(None, **{k: v for k, v in overrides.items() if v is not None})
    except ValueError as exc:  # the config file or a TOOLENV_TRACES_* variable
        raise _fail(config_error(exc)) from exc


def _select(names: list[str] | None) -> list[ManifestEntry]:
    try:
        return load_manifest().select(names)
    except ValueError as exc:
        raise _fail(str(exc)) from exc


@app.command("fetch")
def fetch_command(
    names: Annotated[
        list[str] | None,
        typer.Argument(
            help="Files to fetch: directories (search_r1), globs or file names. Default: all."
        ),
    ] = None,
    dest: CacheDirOption = None,
    source: Annotated[
        str | None,
        typer.Option(
            "--from",
            help="A mirror URL or directory (laid out like the cache or the upstream repo). "
            "Default: the pinned upstream commit.",
        ),
    ] = None,
    force: Annotated[
        bool, typer.Option("--force", help="Download again even when the cached copy verifies.")
    ] = False,
    timeout: Annotated[
        float | None,
        typer.Option(
            "--timeout",
            help="Seconds a URL source may send nothing before it is given up on, the files not "
            "yet fetched from it not tried (default: TOOLENV_TRACES_TIMEOUT_S or 60).",
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON.")] = False,
) -> None:
    """Download the published PolyTrace files, verify size and sha256, keep them in the cache."""
    entries = _select(names)
    if timeout is not None and not (timeout > 0 and math.isfinite(timeout)):
        # inf passed here and failed as "invalid traces settings: timeout_s: ...", not naming
        # the option
        raise _fail(f"--timeout {timeout:g}: give a number of seconds above 0")
    settings = _settings(dest, source, timeout)
    where = settings.source
    problem = source_problem(where) if where else None
    if problem:
        raise _fail(f"--from {where}: {problem}")
    cache_dir = _cache_dir(settings)
    problem = output_dir_problem(cache_dir)  # else every file would fail alike
    if problem:
        raise _fail(f"the trace cache {cache_dir}: {problem} (--dest or TOOLENV_TRACES_CACHE_DIR)")
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # checked a moment ago: only a race gets here, said in one line
        raise _fail(f"the trace cache {cache_dir}: cannot make it: {exc.strerror or exc}") from exc
    manifest = load_manifest()
    console = Console(stderr=True)
    progress = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=as_json,
    )
    total = progress.add_task("PolyTrace", total=sum(e.bytes for e in entries))
    fetcher = Fetcher(
        manifest,
        cache_dir,
        where,
        progress=lambda entry, n: progress.update(total, advance=n, description=entry.name),
        timeout_s=settings.timeout_s,
    )
    results: list[FetchResult] = []
    settled = 0  # bytes of the files already handled (a failed file's partial bytes drop out)
    try:
        with sigterm_unwinds(), progress:
            for entry in entries:
                result = fetcher.fetch(entry, force=force)
                results.append(result)
                settled += entry.bytes if result.status != "failed" else 0
                wanted = progress.tasks[0].total - (entry.bytes if result.status == "failed" else 0)
                progress.update(total, completed=settled, total=wanted)
                if result.unreachable:
                    break  # refused, or silent past the timeout: every other file would fail alike
    finally:
        fetcher.close()
    failed = [r for r in results if r.status == "failed"]
    not_tried = [e.name for e in entries[len(results) :]]
    report = {
        "cache_dir": str(cache_dir),
        "source": where or manifest.base_url,
        "commit": manifest.commit,
        "fetched": sum(r.status == "fetched" for r in results),
        "cached": sum(r.status == "cached" for r in results),
        "failed": len(failed),
        "not_tried": not_tried,
        "files": [
            {
                "name": r.name,
                "status": r.status,
                "path": str(r.path),
                "bytes": r.bytes,
                **({"source": r.source} if r.source else {}),
                **({"error": r.error} if r.error else {}),
            }
            for r in results
        ],
    }
    if as_json:
        typer.echo(json.dumps(report, indent=2))
    else:
        console = report_console()
        console.print(
            f"{report['fetched']} fetched, {report['cached']} already cached, "
            f"{report['failed']} failed; cache: {cache_dir}"
        )
    for r in failed:
        typer.echo(f"error: {r.error}", err=True)
    if not_tried:
        typer.echo(
            f"error: {len(not_tried)} more file(s) not tried: {results[-1].unreachable}", err=True
        )
    if failed:
        raise typer.Exit(1)


@app.command("list")
def list_command(
    names: Annotated[
        list[str] | None, typer.Argument(help="Directories, globs or file names.")
    ] = None,
    dest: CacheDirOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """The published files, their sizes, and whether the cache holds a verified copy."""
    entries = _select(names)
    cache_dir = _cache_dir(_settings(dest, None))
    rows = [
        {"name": e.name, "bytes": e.bytes, "cached": is_cached(e, cache_dir / e.name)}
        for e in entries
    ]
    if as_json:
        typer.echo(json.dumps({"cache_dir": str(cache_dir), "files": rows}, indent=2))
        return
    table = Table(title=f"PolyTrace files (cache: {cache_dir})", title_justify="left")
    table.add_column("file")
    table.add_column("bytes", justify="right")
    table.add_column("cached")
    for row in rows:
        table.add_row(row["name"], f"{row['bytes']:,}", "yes" if row["cached"] else "-")
    report_console().print(table)
