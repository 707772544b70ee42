"""Download the published PolyTrace files into the trace cache, verified, never half-written.

Each file streams into a temporary file beside its target while its sha256 is computed; only a
file whose size and sha256 match the shipped manifest is renamed into place (an atomic rename on
one file system). A failed or interrupted download leaves the cache as it was: a good cached
copy is never replaced by a bad one. A fetch holds a lock on its temporary file, so the next fetch
of the same file removes what a killed one (SIGKILL, a power cut) left, and nothing of a live one.

Sources: the pinned upstream (default; `base_url` + upstream path), or a mirror: a URL or a
directory laid out either like the cache (local names) or like the upstream repository.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import os
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import httpx

from toolenv_core.flocks import lock_if_still_there

from .manifest import Manifest, ManifestEntry

CHUNK = 1 << 16
TIMEOUT_S = 60.0  # a source that sends nothing for this long is given up on
CONNECT_TIMEOUT_S = 10.0
TIMEOUT_HINT = "--timeout or TOOLENV_TRACES_TIMEOUT_S sets it"
Progress = Callable[[ManifestEntry, int], None]  # (file, bytes just received)


class FetchError(Exception):
    """One file could not be fetched or did not verify; the message names the file and why.
    `unreachable`: why the source itself is given up on (it refused the connection, or sent
    nothing within the timeout), so the other files would fail alike; empty when it may serve
    them."""

    def __init__(self, message: str, *, unreachable: str = "") -> None:
        super().__init__(message)
        self.unreachable = unreachable


@dataclass(frozen=True, slots=True)
class FetchResult:
    name: str
    status: Literal["fetched", "cached", "failed"]
    path: Path
    bytes: int
    source: str = ""
    error: str = ""
    unreachable: str = ""  # why the other files from this source are not worth trying


def file_digest(path: Path) -> tuple[int, str]:
    """Size and sha256 of a file on disk."""
    h = hashlib.sha256()
    size = 0
    with path.open("rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
            size += len(chunk)
    return size, h.hexdigest()


def is_cached(entry: ManifestEntry, target: Path) -> bool:
    """The target holds exactly the manifest's bytes (size checked first: cheap)."""
    if not target.is_file() or target.stat().st_size != entry.bytes:
        return False
    return file_digest(target) == (entry.bytes, entry.sha256)


def _is_url(source: str) -> bool:
    return source.startswith(("http://", "https://"))


def source_problem(source: str) -> str | None:
    """What is wrong with a `--from` source before any download: neither an http(s) URL with a
    host (`http://[::1` raised httpx's InvalidURL; `http://` failed every file alike) nor a
    directory; None when it will do."""
    if not _is_url(source):
        return (
            None
            if Path(source).expanduser().is_dir()
            else "not a URL (http:// or https://) nor a directory"
        )
    try:
        host = httpx.URL(source).host
    except httpx.InvalidURL as exc:
        return f"not a valid URL ({exc})"
    return None if host else "a URL without a host"


def _locked_part_file(target: Path) -> tuple[int, str]:
    """A new temporary file beside `target`, locked (flock) for as long as it is open."""
    while True:
        fd, name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".part")
        if lock_if_still_there(fd, name, wait=True):
            return fd, name
        os.close(fd)  # a sweep removed it before the lock was taken: make another


def sweep_abandoned_parts(target: Path) -> None:
    """Remove the temporary files of fetches of `target` that were killed before they could
    clean up (SIGKILL, a power cut): hidden, they held their space for ever. A live fetch holds
    the lock on its own file, so only a file nobody holds is removed."""
    for part in target.parent.glob(f".{glob.escape(target.name)}.*.part"):
        try:
            fd = os.open(part, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            part.unlink(missing_ok=True)
        except OSError:  # held (BlockingIOError): a fetch is writing it
            pass
        finally:
            os.close(fd)


class _Sink:
    """The temporary file a download streams into, hashed and bounded as it is written."""

    def __init__(self, entry: ManifestEntry, target: Path, progress: Progress | None) -> None:
        self.entry = entry
        self.progress = progress
        fd, name = _locked_part_file(target)
        self.path = Path(name)
        self.file = os.fdopen(fd, "wb")
        self.hash = hashlib.sha256()
        self.size = 0

    def write(self, chunk: bytes, source: str) -> None:
        self.size += len(chunk)
        if self.size > self.entry.bytes:
            raise FetchError(
                f"{self.entry.name}: size mismatch: more than the expected {self.entry.bytes} "
                f"bytes (from {source})"
            )
        self.hash.update(chunk)
        self.file.write(chunk)
        if self.progress is not None:
            self.progress(self.entry, len(chunk))

    def commit(self, target: Path, source: str) -> None:
        """Verify, flush to disk and rename into place."""
        self.file.flush()
        os.fchmod(self.file.fileno(), 0o644)  # as any download: mkstemp made it owner-only
        os.fsync(self.file.fileno())
        e = self.entry
        if self.size != e.bytes:
            raise FetchError(
                f"{e.name}: size mismatch: expected {e.bytes} bytes, got {self.size} (from {source})"
            )
        got = self.hash.hexdigest()
        if got != e.sha256:
            raise FetchError(
                f"{e.name}: sha256 mismatch: expected {e.sha256}, got {got} (from {source})"
            )
        os.replace(self.path, target)  # before the close that unlocks it: no sweep can take it
        self.file.close()

    def discard(self) -> None:
        # On a full disk close() fails too (it flushes what is buffered): the file is removed
        # all the same, else every failed fetch left a `.part` file taking the space it lacked.
        with contextlib.suppress(OSError):
            self.file.close()
        self.path.unlink(missing_ok=True)


@contextlib.contextmanager
def _sink(entry: ManifestEntry, target: Path, progress: Progress | None) -> Iterator[_Sink]:
    sink = _Sink(entry, target, progress)
    try:
        yield sink
    except BaseException:
        sink.discard()  # failed, mismatched or interrupted: nothing half-written stays
        raise


def _remove_empty(made: list[Path]) -> None:
    """The directories a failed download made, deepest first, if still empty: an empty
    `search_r1/` left in the cache was found by name, and the commands that read it said it
    held no trace instead of pointing at `toolenv traces fetch`."""
    for directory in made:
        try:
            directory.rmdir()
        except OSError:
            return


def _file_chunks(entry: ManifestEntry, path: Path) -> Iterator[bytes]:
    """A local source file's bytes. Only its own read errors are the source's: a full cache
    failed the write, and was reported as `cannot read` the source file."""
    try:
        with path.open("rb") as f:
            while chunk := f.read(CHUNK):
                yield chunk
    except OSError as exc:
        raise FetchError(f"{entry.name}: cannot read {path}: {exc}") from exc


class Fetcher:
    """Fetches manifest entries from one source into one cache directory."""

    def __init__(
        self,
        manifest: Manifest,
        dest: Path,
        source: str | Path | None = None,
        *,
        client: httpx.Client | None = None,
        progress: Progress | None = None,
        timeout_s: float = TIMEOUT_S,
    ) -> None:
        self.manifest = manifest
        self.dest = Path(dest)
        self.source = str(source) if source is not None else None
        self.progress = progress
        self.client = client or httpx.Client(
            follow_redirects=True,
            timeout=httpx.Timeout(timeout_s, connect=min(CONNECT_TIMEOUT_S, timeout_s)),
        )

    def close(self) -> None:
        self.client.close()

    def fetch(self, entry: ManifestEntry, *, force: bool = False) -> FetchResult:
        target = self.dest / entry.name
        sweep_abandoned_parts(target)
        if not force and is_cached(entry, target):
            return FetchResult(entry.name, "cached", target, entry.bytes)
        made = [d for d in (target.parent, *target.parent.parents) if not d.exists()]
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            with _sink(entry, target, self.progress) as sink:
                where = self._download(entry, sink)
                sink.commit(target, where)
        except FetchError as exc:
            _remove_empty(made)
            where = self.source or self.manifest.base_url
            return FetchResult(entry.name, "failed", target, 0, where, str(exc), exc.unreachable)
        except OSError as exc:  # the cache itself: a file where a directory goes, or read-only
            _remove_empty(made)
            error = f"{entry.name}: cannot write {target}: {exc}"
            return FetchResult(entry.name, "failed", target, 0, "", error)
        except BaseException:
            _remove_empty(made)
            raise
        return FetchResult(entry.name, "fetched", target, entry.bytes, where)

    def _download(self, entry: ManifestEntry, sink: _Sink) -> str:
        """Stream the entry into the sink; return where it came from."""
        if self.source is None:
            url = self.manifest.base_url.rstrip("/") + "/" + entry.upstream
            self._get(entry, url, sink, fallback=False)
            return url
        if _is_url(self.source):
            base = self.source.rstrip("/") + "/"
            for url in (base + entry.name, base + entry.upstream):
                if self._get(entry, url, sink, fallback=True):
                    return url
            raise FetchError(  # the cache's layout was tried first: a 404 named only the other
                f"{entry.name}: HTTP 404 from {base + entry.name} and from {base + entry.upstream}"
            )
        root = Path(self.source).expanduser()
        for candidate in (root / entry.name, root / entry.upstream):
            if candidate.is_file():
                for chunk in _file_chunks(entry, candidate):
                    sink.write(chunk, str(candidate))
                return str(candidate)
        raise FetchError(
            f"{entry.name}: not in {root} (looked for {entry.name} and {entry.upstream})"
        )

    def _get(self, entry: ManifestEntry, url: str, sink: _Sink, *, fallback: bool) -> bool:
        """Stream one URL into the sink. False on a 404 when another layout may be tried."""
        try:
            with self.client.stream("GET", url) as response:
                if response.status_code == 404 and fallback:
                    return False
                if response.status_code != 200:
                    raise FetchError(f"{entry.name}: HTTP {response.status_code} from {url}")
                for chunk in response.iter_bytes(CHUNK):
                    sink.write(chunk, url)
        except httpx.TimeoutException as exc:
            # A source that hangs cost the full timeout for every file (a refused one stopped
            # the rest at once): it is given up on alike, the remaining files not tried.
            limits = self.client.timeout
            said = (
                f"did not accept a connection within {limits.connect:g} s"
                if isinstance(exc, httpx.ConnectTimeout)
                else f"sent nothing for {limits.read:g} s"
            )
            raise FetchError(
                f"{entry.name}: {url} {said} ({TIMEOUT_HINT})",
                unreachable=f"the source {said}",
            ) from exc
        except httpx.TransportError as exc:
            unreachable = (
                "the source does not answer" if isinstance(exc, httpx.ConnectError) else ""
            )
            raise FetchError(
                f"{entry.name}: cannot download {url}: {exc}", unreachable=unreachable
            ) from exc
        except httpx.HTTPError as exc:
            raise FetchError(f"{entry.name}: cannot download {url}: {exc}") from exc
        return True
