"""Length-prefixed msgpack frames over asyncio streams (engine RPC and peer link).

A frame is a 4-byte big-endian body length followed by the body. The length
is checked against a limit before anything is read, so a hostile or broken
peer cannot make the daemon allocate more than the limit.
"""

from __future__ import annotations

import asyncio
import struct
from typing import Any, Final

import msgspec

_LENGTH: Final = struct.Struct(">I")
PREFIX_BYTES: Final = _LENGTH.size


class FrameTooLarge(Exception):
    def __init__(self, length: int, limit: int) -> None:
        super().__init__(f"frame of {length} bytes exceeds the limit of {limit} bytes")
        self.length = length
        self.limit = limit


class EmptyFrame(Exception):
    """A zero-length frame: never valid, since every message has a tag."""


async def read_frame(reader: asyncio.StreamReader, limit: int) -> bytes:
    """Read one frame body; raises ``asyncio.IncompleteReadError`` at EOF."""
    (length,) = _LENGTH.unpack(await reader.readexactly(PREFIX_BYTES))
    if length > limit:
        raise FrameTooLarge(length, limit)
    if length == 0:
        raise EmptyFrame("zero-length frame")
    return await reader.readexactly(length)


class FrameEncoder:
    """Encodes messages into ready-to-send frames with one allocation."""

    __slots__ = ("_encoder",)

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder()

    def encode(self, message: Any) -> bytearray:
        buffer = bytearray(PREFIX_BYTES)
        self._encoder.encode_into(message, buffer, PREFIX_BYTES)
        _LENGTH.pack_into(buffer, 0, len(buffer) - PREFIX_BYTES)
        return buffer


def frame_bytes(body: bytes) -> bytes:
    """A raw body framed as-is (tests and fuzzers send arbitrary bodies)."""
    return _LENGTH.pack(len(body)) + body


class FrameWriter:
    """Frames for one stream: the first of a loop iteration leaves at once, the rest together.

    :meth:`send` encodes the message in place, into a buffer. The first frame
    of a loop iteration is handed to the transport at once (a lone reply
    waits for nothing); it also schedules, with ``call_soon``, the end of the
    iteration, and every frame sent until then waits in the buffer and
    leaves in one ``transport.write`` (one system call for all the replies a
    group commit releases, say). Order is kept: frames leave in the order
    sent. :meth:`flush` hands the buffer over at once (before a close, so
    nothing sent is lost). A frame over ``limit`` raises
    :class:`FrameTooLarge` and is not queued.
    """

    __slots__ = ("_buffer", "_encoder", "_in_iteration", "_loop", "_writer", "frames", "writes")

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self._writer = writer
        self._loop = asyncio.get_running_loop()
        self._encoder = msgspec.msgpack.Encoder()
        self._buffer = bytearray()
        self._in_iteration = False  # a frame went out this iteration; the end is scheduled
        self.frames = 0  # frames sent
        self.writes = 0  # transport writes made

    @property
    def pending(self) -> int:
        """Bytes sent and not yet handed to the transport."""
        return len(self._buffer)

    def send(self, message: Any, limit: int | None = None) -> None:
        buffer = self._buffer
        start = len(buffer)
        buffer += _NO_LENGTH
        try:
            self._encoder.encode_into(message, buffer, start + PREFIX_BYTES)
        except BaseException:
            del buffer[start:]
            raise
        length = len(buffer) - start - PREFIX_BYTES
        if limit is not None and length > limit:
            del buffer[start:]
            raise FrameTooLarge(length, limit)
        _LENGTH.pack_into(buffer, start, length)
        self.frames += 1
        if self._in_iteration:
            return  # leaves with the others at the end of the iteration
        self._in_iteration = True
        self._loop.call_soon(self._end_iteration)
        self.flush()

    def _end_iteration(self) -> None:
        self._in_iteration = False
        self.flush()

    def flush(self) -> None:
        """Hand what is queued to the transport now (dropped if it is closing)."""
        if not self._buffer:
            return
        data, self._buffer = self._buffer, bytearray()
        if self._writer.transport.is_closing():
            return
        self.writes += 1
        self._writer.write(data)


_NO_LENGTH: Final = bytes(PREFIX_BYTES)


class FrameReader:
    """Reads frames out of a stream in chunks: one await per chunk, not two per frame.

    ``read_frame`` awaits ``readexactly`` twice per frame; when a peer's
    frames arrive together (see :class:`FrameWriter`) this reads whatever
    the socket holds once and cuts every frame out of it without awaiting.
    The limits and errors are :func:`read_frame`'s: the length is checked
    before the body is waited for, a zero length raises :class:`EmptyFrame`
    (its prefix consumed, so the stream stays usable), and EOF raises
    ``asyncio.IncompleteReadError``.
    """

    __slots__ = ("_buffer", "_pos", "_reader")

    CHUNK: Final = 256 * 1024

    def __init__(self, reader: asyncio.StreamReader) -> None:
        self._reader = reader
        self._buffer = b""
        self._pos = 0

    async def read(self, limit: int) -> bytes:
        while True:
            buffer, pos = self._buffer, self._pos
            have = len(buffer) - pos
            if have >= PREFIX_BYTES:
                (length,) = _LENGTH.unpack_from(buffer, pos)
                if length > limit:
                    raise FrameTooLarge(length, limit)
                if length == 0:
                    self._pos = pos + PREFIX_BYTES
                    raise EmptyFrame("zero-length frame")
                end = pos + PREFIX_BYTES + length
                if end <= len(buffer):
                    self._pos = end
                    return buffer[pos + PREFIX_BYTES : end]
                want = end - len(buffer)
                if want > self.CHUNK:
                    # A large body: wait for all of it at once rather than
                    # gluing chunks together (quadratic in the body's size).
                    self._buffer, self._pos = b"", 0
                    head = buffer[pos + PREFIX_BYTES :]
                    try:
                        return head + await self._reader.readexactly(want)
                    except asyncio.IncompleteReadError as exc:
                        raise asyncio.IncompleteReadError(
                            buffer[pos:] + exc.partial, want + have
                        ) from None
            else:
                want = PREFIX_BYTES - have
            chunk = await self._reader.read(max(want, self.CHUNK))
            if not chunk:
                raise asyncio.IncompleteReadError(buffer[pos:], want + have)
            self._buffer = buffer[pos:] + chunk if pos < len(buffer) else chunk
            self._pos = 0
