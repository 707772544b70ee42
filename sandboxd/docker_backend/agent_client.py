"""Host side of the agent protocol: length-prefixed JSON over the container's unix socket."""

from __future__ import annotations

import asyncio
import json
import struct
from typing import Any

MAX_FRAME = 256 * 1024 * 1024


class AgentError(RuntimeError):
    """The agent broke the protocol, closed the connection, or answered with an error."""


class AgentConnection:
    """One persistent connection to one container's agent; one request at a time."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer

    @classmethod
    async def open(cls, socket_path: str) -> AgentConnection:
        reader, writer = await asyncio.open_unix_connection(socket_path, limit=1 << 20)
        return cls(reader, writer)

    async def send(self, msg: dict[str, Any]) -> None:
        data = json.dumps(msg).encode()
        self._writer.write(struct.pack(">I", len(data)) + data)
        await self._writer.drain()

    async def receive(self) -> dict[str, Any]:
        try:
            (size,) = struct.unpack(">I", await self._reader.readexactly(4))
            if size > MAX_FRAME:
                raise AgentError(f"agent sent a frame of {size} bytes")
            return json.loads(await self._reader.readexactly(size))
        except asyncio.IncompleteReadError as exc:
            raise AgentError("the agent closed the connection") from exc
        except ValueError as exc:
            raise AgentError(f"the agent sent malformed JSON: {exc}") from exc

    async def request(self, msg: dict[str, Any]) -> dict[str, Any]:
        await self.send(msg)
        return await self.receive()

    @property
    def closed(self) -> bool:
        """The agent hung up: its container died or was removed (seen without a request, as
        the connection's reader takes the end of the stream in the background)."""
        return self._reader.at_eof() or self._writer.is_closing()

    def close(self) -> None:
        self._writer.close()
