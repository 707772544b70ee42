"""A step's stdout and stderr, read on the event loop (no thread per run), each up to its cap.

A program that writes more than the cap is the caller's to kill (`on_cap`): the flood costs a
few milliseconds and never more than the cap in memory.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable

from ..models import decode_output

READ_CHUNK = 65536
STREAMS = ("stdout", "stderr")


class StepOutput:
    """Both pipes of one step: what was read, whether a cap cut it, which are still open."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        cap: int,
        on_cap: Callable[[str], None],
        on_eof: Callable[[], None],
    ) -> None:
        self.loop = loop
        self.cap = cap
        self.on_cap = on_cap  # a stream passed the cap (called again for each chunk past it)
        self.on_eof = on_eof  # a stream closed
        self.buffers = {s: bytearray() for s in STREAMS}
        self.truncated = dict.fromkeys(STREAMS, False)
        self.readers: dict[int, str] = {}  # open pipe fd -> its stream

    @property
    def open(self) -> bool:
        return bool(self.readers)

    def read(self, out_r: int, err_r: int) -> None:
        """Start reading both pipes (non-blocking, on the loop)."""
        for fd, stream in ((out_r, "stdout"), (err_r, "stderr")):
            os.set_blocking(fd, False)
            self.readers[fd] = stream
            self.loop.add_reader(fd, self._on_readable, fd)

    def _on_readable(self, fd: int) -> None:
        stream = self.readers.get(fd)
        if stream is None:
            return
        try:
            chunk = os.read(fd, READ_CHUNK)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._close_reader(fd)
            self.on_eof()
            return
        self._take(stream, chunk)

    def _take(self, stream: str, chunk: bytes) -> None:
        """Keep output up to the cap; past it, keep what fits and tell `on_cap`."""
        buf = self.buffers[stream]
        room = self.cap - len(buf)
        if len(chunk) > room:
            buf.extend(chunk[: max(room, 0)])
            self.truncated[stream] = True
            self.on_cap(stream)
            return
        buf.extend(chunk)

    def _close_reader(self, fd: int) -> None:
        if self.readers.pop(fd, None) is not None:
            self.loop.remove_reader(fd)

    def drain(self) -> None:
        """Take whatever is buffered in every pipe still open now, then stop reading them."""
        for fd in list(self.readers):
            stream = self.readers.get(fd)
            while stream is not None and not self.truncated[stream]:
                try:
                    chunk = os.read(fd, READ_CHUNK)
                except OSError:  # BlockingIOError included: nothing more now
                    break
                if not chunk:
                    break
                self._take(stream, chunk)
            self._close_reader(fd)

    def stop(self) -> None:
        """Stop reading without taking anything more (the fds are the caller's to close)."""
        for fd in list(self.readers):
            self.loop.remove_reader(fd)
        self.readers.clear()

    def text(self, stream: str) -> str:
        return decode_output(self.buffers[stream], self.truncated[stream])
