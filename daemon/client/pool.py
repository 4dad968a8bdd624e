"""An engine's map of its node's offload pool (README.md, "Offload tier").

The daemon owns the pool; a tier client asks for it once with
:func:`attach_pool`, on a blocking connection of its own: Hello,
``OffloadAttach``, and the reply read with ``recvmsg``, because the pool's
descriptor rides on that reply's first bytes (SCM_RIGHTS), which a stream
reader would drop. The connection closes at once; the mapping stays.

Which slot holds what, and who may write or read it, is the daemon's word
(``EngineClient.offload_grant`` / ``offload_store`` / ``offload_lease`` /
``offload_unlease``): write only the slots granted to you until you store
them, read only the slots you lease, and check each read against the
digest the lease hands you.
"""

from __future__ import annotations

import array
import contextlib
import mmap
import os
import socket
import struct
import time
from typing import Final, TypeVar

import msgspec

from daemon.client.errors import ConnectionLost, DaemonUnreachable, ProtocolError, RpcError
from daemon.framing import FrameEncoder
from schemas import rpc

_LENGTH: Final = struct.Struct(">I")
_INT: Final = array.array("i").itemsize
_MAX_REPLY: Final = 64 * 1024  # a HelloOk or an OffloadPool is a few hundred bytes
_R = TypeVar("_R")


class AttachedPool:
    """The node's offload pool mapped read-write into this process.

    Slot ``s`` is ``slot_bytes`` bytes at ``header_bytes + s * slot_bytes``.
    :meth:`view` hands a writable memoryview over one slot (wrap it with
    ``numpy.frombuffer`` or ``torch.frombuffer``, no copy); views must be
    released before :meth:`close` can unmap.
    """

    def __init__(
        self, mapping: mmap.mmap, *, slots: int, slot_bytes: int, header_bytes: int, pool_id: str
    ) -> None:
        self.slots = slots
        self.slot_bytes = slot_bytes
        self.header_bytes = header_bytes
        self.pool_id = pool_id
        self._mmap: mmap.mmap | None = mapping
        self._memory = memoryview(mapping)

    @property
    def memory(self) -> memoryview:
        """The whole pool, header included (a GPU engine pins this for DMA)."""
        if self._mmap is None:
            raise ValueError("the pool is closed")
        return self._memory

    def offset(self, slot: int) -> int:
        if not 0 <= slot < self.slots:
            raise IndexError(f"slot {slot} is not in a pool of {self.slots}")
        return self.header_bytes + slot * self.slot_bytes

    def view(self, slot: int) -> memoryview:
        """A writable view of ``slot``'s bytes."""
        start = self.offset(slot)
        return self.memory[start : start + self.slot_bytes]

    def close(self) -> None:
        """Unmap; idempotent. A view still alive keeps the pages (the unmap is then the GC's)."""
        mapping, self._mmap = self._mmap, None
        if mapping is None:
            return
        with contextlib.suppress(BufferError):
            self._memory.release()
            mapping.close()

    def __enter__(self) -> AttachedPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def attach_pool(
    socket_path: str, holder: str, timeout: float = 10.0, *, namespace: str = ""
) -> AttachedPool:
    """Map the node's offload pool: one blocking connection, closed before this returns.

    ``holder`` names this tier client (as its grants and leases do);
    ``namespace``, if given, binds it (schemas/rpc.py ``OffloadAttach``).
    Raises :class:`RpcError` when the daemon refuses (``no_offload_tier``:
    its ``[offload]`` is off; ``not_allowed``: this process may not use it),
    :class:`DaemonUnreachable` when nobody listens, :class:`ConnectionLost`
    when the connection breaks or ``timeout`` passes, :class:`ProtocolError`
    when the reply carries no descriptor.
    """
    deadline = time.monotonic() + timeout
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    fds: list[int] = []
    try:
        sock.settimeout(timeout)
        try:
            sock.connect(socket_path)
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            raise DaemonUnreachable(f"cannot connect to {socket_path}: {exc}") from exc
        encoder = FrameEncoder()
        decoder = msgspec.msgpack.Decoder(rpc.Reply)
        try:
            sock.sendall(encoder.encode(rpc.Hello(1, "offload-attach", rpc.PROTOCOL_VERSION)))
            hello = _reply(sock, decoder, fds, deadline)
            _expect(hello, rpc.HelloOk)
            sock.sendall(encoder.encode(rpc.OffloadAttach(2, holder=holder, namespace=namespace)))
            reply = _expect(_reply(sock, decoder, fds, deadline), rpc.OffloadPool)
        except (OSError, TimeoutError) as exc:
            raise ConnectionLost(f"attaching the offload pool at {socket_path}: {exc}") from exc
        if len(fds) != 1:
            raise ProtocolError(f"the offload pool's reply carried {len(fds)} descriptors, not 1")
        size = reply.header_bytes + reply.slots * reply.slot_bytes
        if os.fstat(fds[0]).st_size < size:
            raise ProtocolError(f"the offload pool is smaller than its {size} bytes")
        # Populated at once: a first touch of each page on a store would fault
        # on the request path (bench/tier_copy.py).
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        mapping = mmap.mmap(fds[0], size, flags, mmap.PROT_READ | mmap.PROT_WRITE)
        return AttachedPool(
            mapping,
            slots=reply.slots,
            slot_bytes=reply.slot_bytes,
            header_bytes=reply.header_bytes,
            pool_id=reply.pool_id,
        )
    finally:
        for fd in fds:  # the mapping holds the pages; the descriptor is not needed
            with contextlib.suppress(OSError):
                os.close(fd)
        sock.close()


def _expect(reply: rpc.Reply, kind: type[_R]) -> _R:
    if isinstance(reply, rpc.Error):
        raise RpcError(reply.code, reply.message)
    if not isinstance(reply, kind):
        raise ProtocolError(f"expected {kind.__name__}, got {type(reply).__name__}")
    return reply


def _reply(
    sock: socket.socket, decoder: msgspec.msgpack.Decoder, fds: list[int], deadline: float
) -> rpc.Reply:
    """One frame, read with recvmsg so that descriptors riding on it arrive (into ``fds``)."""
    prefix = _recv(sock, _LENGTH.size, fds, deadline)
    (length,) = _LENGTH.unpack(prefix)
    if not 0 < length <= _MAX_REPLY:
        raise ProtocolError(f"a reply frame of {length} bytes")
    try:
        return decoder.decode(_recv(sock, length, fds, deadline))
    except msgspec.MsgspecError as exc:
        raise ProtocolError(f"undecodable reply: {exc}") from exc


def _recv(sock: socket.socket, n: int, fds: list[int], deadline: float) -> bytes:
    data = bytearray()
    while len(data) < n:
        sock.settimeout(max(0.001, deadline - time.monotonic()))
        chunk, ancillary, flags, _ = sock.recvmsg(
            n - len(data), socket.CMSG_SPACE(4 * _INT), socket.MSG_CMSG_CLOEXEC
        )
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                got = array.array("i")
                got.frombytes(payload[: len(payload) - len(payload) % _INT])
                fds.extend(got)
        if flags & socket.MSG_CTRUNC:
            raise ProtocolError("more descriptors came than the offload pool's one")
        if not chunk:
            raise ConnectionLost("the daemon closed the connection")
        data += chunk
    return bytes(data)
