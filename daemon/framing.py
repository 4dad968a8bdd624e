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
