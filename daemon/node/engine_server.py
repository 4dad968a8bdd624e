"""The engine RPC server: a Unix socket, one session per engine connection.

Every request gets exactly one reply with its id. Malformed input gets an
``Error`` reply (or, when the stream itself can no longer be trusted, a
closed connection); none of it reaches the core, and none of it stops the
server serving other connections.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import socket
import struct
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import msgspec
import structlog

from daemon import failpoints
from daemon.dataplane.memory import RegionError
from daemon.framing import EmptyFrame, FrameEncoder, FrameReader, FrameTooLarge, FrameWriter
from daemon.node.descriptors import (
    MAX_DESCRIPTORS,
    Carried,
    Passing,
    accept_stream,
    send_with_fds,
)
from daemon.node.lifecycle import Lifecycle
from daemon.node.serializer import KeyedSerializer
from daemon.node.socketclaim import SocketClaim
from daemon.version import VERSION
from schemas import rpc
from schemas.status import StatusDocument
from statemachine import Refusal

log = structlog.get_logger("kvpushd.rpc")

_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


# Linux >= 4.13; the socket module does not name it.
_SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)
_NGROUPS_MAX = 65536


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end (SO_PEERCRED)."""
    data = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size)
    return _CRED.unpack(data)


def peer_groups(sock: socket.socket) -> tuple[int, ...]:
    """Supplementary gids of the process at the other end, as of its connect() (SO_PEERGROUPS).

    SO_PEERCRED carries only the primary gid; an engine may belong to the
    allowed group as a supplementary member.
    """
    for size in (64 * 4, _NGROUPS_MAX * 4):
        try:
            data = sock.getsockopt(socket.SOL_SOCKET, _SO_PEERGROUPS, size)
        except OSError as exc:
            if exc.errno == errno.ERANGE:
                continue  # more groups than the buffer holds: ask with the largest
            if exc.errno in (errno.ENOPROTOOPT, errno.EINVAL):
                return ()  # a kernel without it: the primary gid alone decides
            raise
        return struct.unpack(f"{len(data) // 4}I", data[: len(data) // 4 * 4])
    return ()


class Session:
    """One engine connection.

    Replies and events are encoded into the connection's :class:`FrameWriter`
    and leave together once per loop iteration (one system call for all the
    replies a group commit releases, say), in the order they were sent.
    """

    def __init__(
        self,
        writer: asyncio.StreamWriter,
        pid: int,
        uid: int,
        gid: int,
        carried: Carried | None = None,
        sock: socket.socket | None = None,
    ) -> None:
        self.writer = writer
        # The connection's socket, for the one reply that passes a descriptor.
        self.sock = sock
        self.pid, self.uid, self.gid = pid, uid, gid
        # Descriptors the connection's first bytes carried (its Hello's).
        self.carried = carried or Carried((), False)
        self.frames = FrameWriter(writer)
        self.closed = False
        # Requests in flight on this connection, in a safe order (see EngineServer._submit).
        self.requests = KeyedSerializer()
        self.protocol = 1  # what its Hello said (protocol 2: events leave batched)
        self._events: list[rpc.Event] = []

    def send(self, message: Any) -> None:
        failpoints.hit("engine.reply")
        if self.closed or self.writer.is_closing():
            return
        if self._events:
            self._send_events()  # sent before this reply: they leave before it
        self.frames.send(message)

    def send_event(self, event: rpc.Event) -> None:
        """An event; on protocol 2 those of one loop iteration leave as one frame."""
        if self.protocol < rpc.BATCH_PROTOCOL:
            self.send(event)
            return
        if not self._events:
            asyncio.get_running_loop().call_soon(self._send_events)
        self._events.append(event)

    def _send_events(self) -> None:
        events, self._events = self._events, []
        if not events or self.closed or self.writer.is_closing():
            return
        failpoints.hit("engine.reply")
        self.frames.send(events[0] if len(events) == 1 else rpc.Events(tuple(events)))

    def flush(self) -> None:
        """Hand what was sent to the socket now, not at the end of this loop iteration."""
        with contextlib.suppress(Exception):
            self.frames.flush()

    async def send_passing(self, message: Any, fds: tuple[int, ...]) -> None:
        """``message`` with ``fds`` attached to its frame's first byte (SCM_RIGHTS).

        Everything sent before it leaves first: the frame goes straight to
        the socket only once the transport holds nothing unsent, with no
        await between that check and the send, so no other frame can come
        between; what a full socket buffer did not take goes on through the
        transport, in order. A client that reads nothing for
        ``PASS_TIMEOUT_S`` loses the connection.
        """
        failpoints.hit("engine.reply")
        frame = bytes(FrameEncoder().encode(message))
        transport = self.writer.transport
        deadline = asyncio.get_running_loop().time() + PASS_TIMEOUT_S
        while not (self.closed or self.writer.is_closing() or self.sock is None):
            if self._events:
                self._send_events()
            self.frames.flush()
            if not transport.get_write_buffer_size():
                sent = send_with_fds(self.sock, frame, fds)
                if sent is not None:
                    if sent < len(frame):
                        self.writer.write(frame[sent:])
                    return
            if asyncio.get_running_loop().time() > deadline:
                self.close()
                return
            await asyncio.sleep(0.001)

    @property
    def descriptors(self) -> tuple[int, ...]:
        return self.carried.fds

    def close(self) -> None:
        if not self.closed:
            self._send_events()
            self.flush()  # what was sent before the close still leaves
        self.closed = True
        self.carried.close()
        with contextlib.suppress(Exception):
            self.writer.close()


Handler = Callable[[Session, Any], Awaitable[rpc.Reply]]
# What an op of a batch is answered with (schemas/rpc.py OpReply).
_OP_REPLIES = (rpc.Ok, rpc.RequestAccepted, rpc.Deferred, rpc.Error)

# How long a reply passing descriptors waits for the client to read its socket.
PASS_TIMEOUT_S = 5.0
# Requests one connection may have in flight before the server stops reading it.
MAX_INFLIGHT_PER_CONNECTION = 1024
# How long, and how much, a refused client may still send before it is cut off.
REFUSED_LINGER_S = 2.0
REFUSED_DISCARD_BYTES = 1024 * 1024


class Admission(Protocol):
    """A call checked and its records appended (engine_rpc.Admitted)."""

    async def finish(self) -> rpc.Reply: ...


class EngineCalls(Protocol):
    """What each engine call does (daemon/node/engine_rpc.py ``EngineRpc``)."""

    def handlers(self) -> Mapping[type, Handler]: ...

    def waits_first(self, op: rpc.BatchOp) -> bool: ...

    def admit(self, session: Session, op: rpc.BatchOp) -> Admission: ...

    def refuse(self, request: Any, refusal: Refusal) -> Awaitable[Any] | None: ...

    async def record_refusal(self, request: Any, refusal: Refusal) -> bool: ...


@dataclass(frozen=True, slots=True)
class Identity:
    """Who answers: the node's name and this process's boot id (in every HelloOk)."""

    node: str
    boot_id: str


@dataclass(frozen=True, slots=True)
class EngineApp:
    """What the server serves, handed to it when serving starts (the node is open by then).

    ``calls`` serves the engine calls; ``status`` answers Status;
    ``disconnected`` hears of every connection that ends; ``life`` says
    whether the journal failed (every call is then refused).
    """

    calls: EngineCalls
    status: Callable[[], StatusDocument]
    disconnected: Callable[[Session], None]
    life: Lifecycle


class EngineServer:
    def __init__(
        self,
        path: str,
        identity: Identity,
        *,
        max_frame_bytes: int,
        allowed_uids: tuple[int, ...] = (),
        allowed_gids: tuple[int, ...] = (),
    ) -> None:
        self.path = Path(path)
        self.identity = identity
        self._app: EngineApp | None = None
        self.max_frame_bytes = max_frame_bytes
        self.allowed_uids = set(allowed_uids) or {os.getuid(), 0}
        self.allowed_gids = set(allowed_gids)
        self.sessions: set[Session] = set()
        self._acceptor: asyncio.Task[None] | None = None
        self._claim: SocketClaim | None = None
        self._decoder = msgspec.msgpack.Decoder(rpc.Request)
        # The application's calls join these two when serving starts (start()).
        self._handlers: dict[type, Handler] = {rpc.Hello: self._hello, rpc.Status: self._status}
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def app(self) -> EngineApp:
        """The application (connections are served only once start() handed it over)."""
        assert self._app is not None
        return self._app

    async def bind(self) -> None:
        """Claim the socket path and listen, without accepting yet.

        Raises :class:`daemon.startup.StartupError` when another daemon owns
        the path, or it cannot be bound (daemon/node/socketclaim.py).
        """
        if self._claim is None:
            self._claim = SocketClaim.take(self.path)
            self._claim.sock.setblocking(False)

    async def start(self, app: EngineApp) -> None:
        self._app = app
        self._handlers.update(app.calls.handlers())
        await self.bind()
        assert self._claim is not None
        self._acceptor = asyncio.create_task(
            self._accept(self._claim.sock), name="kvpushd-engine-accept"
        )

    def stop_accepting(self) -> None:
        if self._acceptor is not None:
            self._acceptor.cancel()
            self._acceptor = None

    async def close(self) -> None:
        self.stop_accepting()
        # Closing the transports ends each session's read loop cleanly;
        # cancelling the handler tasks would make asyncio log their
        # cancellation as an error.
        for session in list(self.sessions):
            session.close()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=2.0)
        for task in list(self._tasks):
            task.cancel()
        self.release()

    def release(self) -> None:
        """Close the listening socket and give the path up, removing it only if it is ours."""
        self.stop_accepting()
        if self._claim is not None:
            self._claim.sock.close()
            self._claim.release()
            self._claim = None

    async def _accept(self, listener: socket.socket) -> None:
        # Accepted here, not by asyncio's server: a connection's first bytes
        # may carry descriptors, which only recvmsg reads (daemon/node/descriptors.py).
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _ = await loop.sock_accept(listener)
            except OSError as exc:
                # Out of descriptors, say: the listener stays; try again shortly.
                log.warning("engine socket accept failed", node=self.identity.node, error=str(exc))
                await asyncio.sleep(0.1)
                continue
            task = asyncio.create_task(self._serve(conn), name="kvpushd-engine-session")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _allowed(self, uid: int, gid: int, groups: tuple[int, ...]) -> bool:
        if uid in self.allowed_uids or gid in self.allowed_gids:
            return True
        return not self.allowed_gids.isdisjoint(groups)

    async def _serve(self, conn: socket.socket) -> None:
        try:
            reader, writer, carried = await accept_stream(conn, self.max_frame_bytes + 64)
        except (OSError, asyncio.CancelledError):
            conn.close()
            return
        pid, uid, gid = peer_credentials(conn)
        groups = peer_groups(conn) if self.allowed_gids else ()
        session = Session(writer, pid, uid, gid, carried, conn)
        clog = log.bind(node=self.identity.node, peer_pid=pid, peer_uid=uid)
        try:
            if not self._allowed(uid, gid, groups):
                clog.warning("engine connection refused: credentials not allowed", gid=gid)
                session.send(
                    rpc.Error(
                        0,
                        rpc.NOT_ALLOWED,
                        f"uid {uid} / gid {gid} may not use this daemon: add the uid to "
                        f"allowed_uids or one of its groups to allowed_groups",
                    )
                )
                session.flush()  # before the EOF that _close_refused sends
                await _close_refused(reader, writer)
                return
            self.sessions.add(session)
            await self._loop(reader, session, clog)
        except asyncio.CancelledError:
            # Loop teardown after a journal failure cancels us. Ending normally
            # keeps asyncio from logging a spurious traceback after the one
            # line that says why the daemon exits.
            pass
        finally:
            self.sessions.discard(session)
            self.app.disconnected(session)
            session.close()

    async def _loop(self, reader: asyncio.StreamReader, session: Session, clog: Any) -> None:
        frames = FrameReader(reader)
        transport = session.writer.transport
        while True:
            # Only a transport with unsent bytes can be paused: skip the await otherwise.
            if transport.get_write_buffer_size() and not await _replies_drained(session.writer):
                return
            try:
                body = await frames.read(self.max_frame_bytes)
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            except FrameTooLarge as exc:
                # The stream cannot be resynchronised without reading the body.
                clog.warning("frame too large; closing", error=str(exc))
                session.send(rpc.Error(0, rpc.FRAME_TOO_LARGE, str(exc)))
                return
            except EmptyFrame as exc:
                session.send(rpc.Error(0, rpc.BAD_FRAME, str(exc)))
                continue
            try:
                request = self._decoder.decode(body)
            except msgspec.ValidationError as exc:
                session.send(rpc.Error(_request_id(body), rpc.BAD_REQUEST, str(exc)))
                continue
            except msgspec.DecodeError as exc:
                session.send(rpc.Error(0, rpc.BAD_FRAME, f"undecodable body: {exc}"))
                continue
            inflight = session.requests.inflight
            if len(inflight) >= MAX_INFLIGHT_PER_CONNECTION:
                # Backpressure: stop reading until a request finishes.
                await asyncio.wait(inflight, return_when=asyncio.FIRST_COMPLETED)
            if type(request) is rpc.Batch:
                self._submit_batch(session, request, clog)
            else:
                self._submit(session, request, clog)

    def _submit(self, session: Session, request: Any, clog: Any) -> None:
        """Run a request concurrently with the connection's others, in a safe order.

        Each request waits for the durable journal before its reply, so one
        at a time per connection would cap an engine at one fsync per
        request. Requests about one request id (or one offload holder) still
        run in arrival order, and those about neither (hello,
        register_engine, status) are barriers: they wait for everything
        before them, and everything after waits for them.
        """
        session.requests.submit(self._reply(session, request, clog), _key(request))

    def _submit_batch(self, session: Session, batch: rpc.Batch, clog: Any) -> None:
        """One task admits every op in one pass, then answers them in one frame.

        The batch runs after whatever came before about any of its requests
        (and before what comes after); its ops are checked and appended in
        order, with no await in between, so their records share one group
        commit; the BatchReply leaves once the last is durable. An op that
        must wait before it is admitted (a peer dialled on demand) runs whole
        where it stands.
        """
        keys = {op.request_id for op in batch.ops}
        session.requests.submit_many(self._run_batch(session, batch, clog), keys)

    async def _run_batch(self, session: Session, batch: rpc.Batch, clog: Any) -> None:
        calls = self.app.calls
        admitted = []
        for op in batch.ops:
            if calls.waits_first(op):
                admitted.append(await self._dispatch(session, op, clog))
            else:
                admitted.append(self._admit(session, op, clog))
        replies = []
        for op, admission in zip(batch.ops, admitted, strict=True):
            reply = await self._finish(session, op, admission, clog)
            if reply is None:
                return  # the connection was closed instead (engine.accepted)
            replies.append(reply)
        session.send(rpc.BatchReply(batch.id, tuple(replies)))  # type: ignore[arg-type]

    def _admit(self, session: Session, op: rpc.BatchOp, clog: Any) -> Any:
        """Admission, or (refusal, its Refused record's commit), or the error reply."""
        calls = self.app.calls
        try:
            return calls.admit(session, op)
        except Refusal as refusal:
            return refusal, calls.refuse(op, refusal)
        except Exception as exc:
            return self._error(op, exc, clog)

    async def _finish(
        self, session: Session, op: rpc.BatchOp, admission: Any, clog: Any
    ) -> rpc.Reply | None:
        if isinstance(admission, _OP_REPLIES):
            return self._accepted(session, admission)  # answered already
        try:
            if isinstance(admission, tuple):
                refusal, refused = admission
                if refused is None:
                    return rpc.Error(op.id, rpc.SHUTTING_DOWN, "the journal failed")
                await refused
                return rpc.Error(op.id, refusal.reason.value, refusal.message)
            reply = await admission.finish()
        except Exception as exc:
            return self._error(op, exc, clog)
        return self._accepted(session, reply)

    async def _reply(self, session: Session, request: Any, clog: Any) -> None:
        reply = await self._answer(session, request, clog)
        if type(reply) is Passing:
            await session.send_passing(reply.reply, reply.fds)
        elif reply is not None:
            session.send(reply)

    async def _answer(self, session: Session, request: Any, clog: Any) -> rpc.Reply | None:
        """The reply to one request; None if the connection was closed instead."""
        return self._accepted(session, await self._dispatch(session, request, clog))

    def _accepted(self, session: Session, reply: rpc.Reply) -> rpc.Reply | None:
        if isinstance(reply, rpc.RequestAccepted):
            try:
                failpoints.hit("engine.accepted")
            except OSError:
                # The registration holds; the engine never hears so: its
                # connection ends here, as a reset one would, and the daemon
                # lives on (the engine's requests stay its own).
                session.close()
                return None
        return reply

    async def _dispatch(self, session: Session, request: Any, clog: Any) -> rpc.Reply:
        handler = self._handlers[type(request)]
        try:
            return await handler(session, request)
        except Refusal as refusal:
            # Journaled (durably, before the engine hears of it) so that a
            # postmortem sees every refusal in order, not only the engine.
            if not await self.app.calls.record_refusal(request, refusal):
                return rpc.Error(request.id, rpc.SHUTTING_DOWN, "the journal failed")
            return rpc.Error(request.id, refusal.reason.value, refusal.message)
        except Exception as exc:
            return self._error(request, exc, clog)

    def _error(self, request: Any, exc: Exception, clog: Any) -> rpc.Error:
        if isinstance(exc, RegionError):
            return rpc.Error(request.id, exc.code or rpc.BAD_REGION, str(exc))
        if self.app.life.failed:
            return rpc.Error(request.id, rpc.SHUTTING_DOWN, "the journal failed")
        clog.exception("request failed", op=type(request).__name__)
        return rpc.Error(request.id, rpc.INTERNAL, f"{type(exc).__name__}: {exc}")

    async def _hello(self, session: Session, req: rpc.Hello) -> rpc.Reply:
        if req.protocol not in rpc.SUPPORTED_PROTOCOLS:
            speaks = ", ".join(str(p) for p in sorted(rpc.SUPPORTED_PROTOCOLS))
            return rpc.Error(
                req.id,
                rpc.BAD_REQUEST,
                f"protocol {req.protocol} not supported, this daemon speaks {speaks}",
            )
        carried = session.carried
        if carried.truncated or req.descriptors != len(carried.fds):
            arrived = f"more than {MAX_DESCRIPTORS}" if carried.truncated else len(carried.fds)
            carried.close()  # which region is which can no longer be told
            return rpc.Error(
                req.id,
                rpc.BAD_REQUEST,
                f"the Hello says it carries {req.descriptors} descriptors and {arrived} "
                "arrived with its first bytes: send them with the Hello's first bytes, "
                f"at most {MAX_DESCRIPTORS}",
            )
        # The client's own version: the one this connection speaks from now on.
        session.protocol = req.protocol
        me = self.identity
        return rpc.HelloOk(req.id, me.node, req.protocol, VERSION, me.boot_id)

    async def _status(self, session: Session, req: rpc.Status) -> rpc.Reply:
        return rpc.StatusReply(req.id, self.app.status())


def _key(request: Any) -> Any:
    """What a request is ordered by on its connection: its request id, an offload
    call's holder (a holder's calls in order, other holders' beside them), or
    None (a barrier)."""
    request_id = getattr(request, "request_id", None)
    if request_id is not None:
        return request_id
    if isinstance(request, rpc.OffloadRequest):
        return ("offload", request.holder)
    return None


async def _close_refused(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """End a refused connection so that the client reads the refusal, not a reset.

    Closing a Unix socket with unread bytes in it (the client's Hello, sent
    right after connect) makes the kernel reset the client's end, and a
    client still writing gets EPIPE before it reads why. So: send EOF after
    the refusal, and discard, unread, what the client sends until it hangs
    up, within bounds so that a refused client cannot hold the connection.
    """
    with contextlib.suppress(ConnectionError, OSError):
        await writer.drain()
        writer.write_eof()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(REFUSED_LINGER_S):
                discarded = 0
                while discarded < REFUSED_DISCARD_BYTES and (chunk := await reader.read(65536)):
                    discarded += len(chunk)


async def _replies_drained(writer: asyncio.StreamWriter) -> bool:
    """Wait while the connection's unsent replies are over the transport's high-water mark.

    Backpressure on the reply side: a client that sends requests but never
    reads its replies would otherwise make the daemon buffer replies without
    bound (every reply is written without waiting). Not reading its next
    request until the buffer drains bounds that buffer to the high-water mark
    plus the replies of the requests in flight. False: the connection is gone.
    """
    try:
        await writer.drain()
    except ConnectionError:
        return False
    return True


def _request_id(body: bytes) -> int:
    """Best effort: the id of a body that decodes as msgpack but not as a request."""
    try:
        raw = msgspec.msgpack.decode(body)
    except msgspec.DecodeError:
        return 0
    request_id = raw.get("id") if isinstance(raw, dict) else None
    # bool is an int subclass, but an Error with a bool id is itself
    # undecodable for the client (the reply's id is typed int).
    if isinstance(request_id, int) and not isinstance(request_id, bool):
        return request_id
    return 0
