"""daemon/framing.py on real Unix sockets: batched writes keep order, chunked reads keep limits."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass

import msgspec
import pytest

from daemon.framing import (
    EmptyFrame,
    FrameReader,
    FrameTooLarge,
    FrameWriter,
    frame_bytes,
    read_frame,
)


@dataclass
class Ends:
    reader: asyncio.StreamReader  # what the far end reads
    writer: asyncio.StreamWriter  # the near end, written to


@pytest.fixture
async def ends() -> AsyncIterator[Ends]:
    near, far = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    _, writer = await asyncio.open_unix_connection(sock=near)
    reader, far_writer = await asyncio.open_unix_connection(sock=far)
    yield Ends(reader, writer)
    writer.close()
    far_writer.close()


async def test_frames_of_one_iteration_leave_in_two_writes_in_order(ends: Ends) -> None:
    frames = FrameWriter(ends.writer)
    messages = [{"seq": i, "pad": "x" * (i % 7)} for i in range(200)]
    frames.send(messages[0])
    assert (frames.writes, frames.pending) == (1, 0)  # the first one leaves at once
    for message in messages[1:]:
        frames.send(message)
    assert frames.writes == 1 and frames.pending > 0  # the rest wait for the iteration's end
    await asyncio.sleep(0)
    assert (frames.frames, frames.writes, frames.pending) == (200, 2, 0)
    frames.send({"seq": 200, "pad": ""})  # a later iteration: at once again
    assert frames.writes == 3
    await asyncio.sleep(0)
    assert frames.writes == 3  # nothing was left to write at its end
    got = [msgspec.msgpack.decode(await read_frame(ends.reader, 1024)) for _ in range(201)]
    assert got == [*messages, {"seq": 200, "pad": ""}]


async def test_an_oversized_frame_is_refused_and_leaves_the_queue_intact(ends: Ends) -> None:
    frames = FrameWriter(ends.writer)
    frames.send("first", limit=64)
    frames.send("before", limit=64)
    with pytest.raises(FrameTooLarge) as info:
        frames.send("y" * 100, limit=64)
    assert info.value.limit == 64 and info.value.length > 64
    frames.send("after", limit=64)
    frames.flush()  # directly, as before a close
    assert frames.writes == 2
    reader = FrameReader(ends.reader)
    assert msgspec.msgpack.decode(await reader.read(64)) == "first"
    assert msgspec.msgpack.decode(await reader.read(64)) == "before"
    assert msgspec.msgpack.decode(await reader.read(64)) == "after"


async def test_frames_are_read_the_same_however_the_bytes_arrive(ends: Ends) -> None:
    bodies = [msgspec.msgpack.encode(["m", i, "z" * (i * 37 % 300)]) for i in range(50)]
    big = msgspec.msgpack.encode("b" * (FrameReader.CHUNK * 3 + 5))  # over a chunk
    bodies.insert(25, big)
    stream = b"".join(frame_bytes(b) for b in bodies)
    reader = FrameReader(ends.reader)

    async def trickle() -> None:
        # Byte by byte at first (a prefix split), then in uneven pieces.
        for i in range(9):
            ends.writer.write(stream[i : i + 1])
            await ends.writer.drain()
            await asyncio.sleep(0)
        pos, step = 9, 1
        while pos < len(stream):
            ends.writer.write(stream[pos : pos + step])
            await ends.writer.drain()
            pos += step
            step = step * 3 % 70_001 + 1

    sender = asyncio.create_task(trickle())
    got = [await reader.read(len(big)) for _ in bodies]
    await sender
    assert got == bodies


async def test_read_limits_and_empty_frames_match_read_frame(ends: Ends) -> None:
    reader = FrameReader(ends.reader)
    ends.writer.write(frame_bytes(b"") + frame_bytes(b"ok") + frame_bytes(b"z" * 100))
    with pytest.raises(EmptyFrame):
        await reader.read(64)
    assert await reader.read(64) == b"ok"  # the stream survives an empty frame
    with pytest.raises(FrameTooLarge) as info:
        await reader.read(64)  # refused from its prefix alone
    assert (info.value.length, info.value.limit) == (100, 64)


async def test_eof_in_the_middle_of_a_frame_is_an_incomplete_read(ends: Ends) -> None:
    reader = FrameReader(ends.reader)
    ends.writer.write(frame_bytes(b"whole") + frame_bytes(b"cut short")[:-3])
    ends.writer.write_eof()
    assert await reader.read(64) == b"whole"
    with pytest.raises(asyncio.IncompleteReadError):
        await reader.read(64)
