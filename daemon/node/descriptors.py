"""Descriptors an engine passes with its first bytes (SCM_RIGHTS), and the stream after them;
and the one reply that passes a descriptor the other way (:class:`Passing`).

An engine that shares its KV memory as a memfd attaches the descriptors to
the first bytes it sends on a connection (its Hello). A stream transport
reads with plain ``recv``, which makes the kernel drop any descriptor that
came along, so the server reads a new connection's first bytes itself, with
``recvmsg``, and only then hands the socket to a stream whose buffer starts
with those bytes. Descriptors anywhere later in the stream are dropped by
the kernel, unread: only the Hello's count.

The connection owns what it received (:class:`Carried`) until it closes;
a region mapped from one holds its own duplicate (daemon/dataplane/memory.py).
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import os
import socket
from dataclasses import dataclass
from typing import Any, Final

# More than any engine needs (its KV cache, a staging mirror, an offload
# pool): a connection that passes more is cut short, all of them closed.
MAX_DESCRIPTORS: Final = 16
_FIRST_READ_BYTES: Final = 64 * 1024
_INT: Final = array.array("i").itemsize


class Carried:
    """The descriptors a connection's first bytes carried; closed with the connection."""

    def __init__(self, fds: tuple[int, ...], truncated: bool) -> None:
        self.fds = fds
        # More were sent than MAX_DESCRIPTORS: the Hello is refused.
        self.truncated = truncated

    def close(self) -> None:
        fds, self.fds = self.fds, ()
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)


@dataclass(frozen=True, slots=True)
class Passing:
    """A reply whose frame carries ``fds`` (SCM_RIGHTS) to the client: the offload pool's.

    A handler returns it instead of the reply; the engine server sends the
    frame with :func:`send_with_fds` once everything sent before it left.
    The descriptors stay the sender's (the kernel passes duplicates).
    """

    reply: Any
    fds: tuple[int, ...]


def send_with_fds(sock: socket.socket, frame: bytes, fds: tuple[int, ...]) -> int | None:
    """Send ``frame`` with ``fds`` attached to its first byte; bytes sent, None if none could be.

    One non-blocking ``sendmsg``: the caller sends what is left of a frame
    sent in part through its stream (the descriptors went with the first
    byte), and tries again later when the socket's buffer was full.
    """
    rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
    try:
        return sock.sendmsg([frame], rights)
    except (BlockingIOError, InterruptedError):
        return None


async def accept_stream(
    sock: socket.socket, limit: int
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, Carried]:
    """A new connection as a stream, and the descriptors its first bytes carried.

    Waits for the first bytes (or the end of the connection); the caller
    owns ``sock``'s stream afterwards, and the returned :class:`Carried`.
    """
    loop = asyncio.get_running_loop()
    sock.setblocking(False)
    data, carried = await _first_bytes(loop, sock)
    try:
        reader = asyncio.StreamReader(limit=limit, loop=loop)
        # Before the transport exists: these bytes come before any it reads.
        if data:
            reader.feed_data(data)
        else:
            reader.feed_eof()
        protocol = asyncio.StreamReaderProtocol(reader, loop=loop)
        transport, _ = await loop.connect_accepted_socket(lambda: protocol, sock)
    except BaseException:
        carried.close()
        raise
    return reader, asyncio.StreamWriter(transport, protocol, reader, loop), carried


async def _first_bytes(
    loop: asyncio.AbstractEventLoop, sock: socket.socket
) -> tuple[bytes, Carried]:
    while True:
        try:
            data, ancillary, flags, _ = sock.recvmsg(
                _FIRST_READ_BYTES,
                socket.CMSG_SPACE(MAX_DESCRIPTORS * _INT),
                # Not inherited by the daemon's children (its log pump, say).
                socket.MSG_CMSG_CLOEXEC,
            )
        except (BlockingIOError, InterruptedError):
            await _readable(loop, sock)
            continue
        except ConnectionError:
            return b"", Carried((), False)
        fds = array.array("i")
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(payload[: len(payload) - len(payload) % _INT])
        carried = Carried(tuple(fds), bool(flags & socket.MSG_CTRUNC))
        if carried.truncated:
            carried.close()  # some arrived, not all: none is used
        return data, carried


async def _readable(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
    ready: asyncio.Future[None] = loop.create_future()
    fd = sock.fileno()
    loop.add_reader(fd, _wake, ready)
    try:
        await ready
    finally:
        loop.remove_reader(fd)


def _wake(ready: asyncio.Future[None]) -> None:
    if not ready.done():
        ready.set_result(None)
