"""Engine client library: how an inference engine talks to its node's kvpushd.

An engine integrates in a few calls::

    async with await EngineClient.connect("/run/kvpushd/kvpushd.sock") as client:
        await client.register_engine("eng0", groups, regions)
        await client.register_request("eng0", "req-1", Role.PUSHER, [[0, 1, 2]])
        await client.kv_ready("req-1")
        event = await client.next_event(timeout=10)  # BlocksFreeable
        await client.release("req-1")

Engines with their own (non-asyncio) loop use :class:`BlockingEngineClient`,
which runs an :class:`EngineClient` on a private loop in a background thread.

Wire: frames of a 4-byte big-endian length and a msgpack body
(:mod:`daemon.framing`); requests are :data:`schemas.rpc.Request`, and every
frame the daemon sends is a :data:`schemas.rpc.ServerMessage` (a reply carrying
the request's ``id``, or an unprompted event). One background reader task
demultiplexes: replies resolve the pending call with their id, whatever order
they come in; events go to a queue (and an optional callback).
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import itertools
import logging
import math
import socket
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Final, TypeVar

import msgspec

from daemon.client.errors import (
    CallTimeout,
    ConnectionLost,
    DaemonUnreachable,
    ProtocolError,
    RequestTooLarge,
    RpcError,
)
from daemon.framing import EmptyFrame, FrameEncoder, FrameReader, FrameTooLarge, FrameWriter
from schemas import rpc
from schemas.fingerprint import Fingerprint
from schemas.kvlayout import GroupSpec, MemoryNote, RegionSpec
from schemas.layout import Role

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S: Final = 30.0

Event = rpc.Event
EventCallback = Callable[[rpc.Event], None]
_R = TypeVar("_R")
_T = TypeVar("_T")
_END: Final = object()  # event-queue sentinel: the connection is over
# The calls a Batch frame may carry (schemas/rpc.py BatchOp).
_BATCHABLE: Final = frozenset({rpc.RegisterRequest, rpc.KvReady, rpc.Release, rpc.Abort, rpc.Hold})
# Room for a Batch frame's own fields around its ops.
_BATCH_HEADROOM: Final = 64


class _BatchOut(msgspec.Struct, frozen=True, tag_field="op", tag="batch"):
    """rpc.Batch as sent: ops already encoded (each was, to check its size)."""

    id: int
    ops: list[msgspec.Raw]


class EngineClient:
    """One connection to the daemon; safe to use from many tasks of one loop.

    Build it with :meth:`connect`. Each call takes a fresh id, sends its
    request and awaits the reply with that id; calls may overlap freely.
    Calls about requests (register_request, kv_ready, release, abort, hold)
    made in one loop iteration leave as one ``Batch`` frame when the daemon
    speaks protocol 2 (``batch=False`` at connect: always one frame each);
    each still gets its own reply and its own error.
    Events are queued for :meth:`events` / :meth:`next_event` (set
    ``queue_events=False`` when only the callback consumes them, so the
    queue does not grow). The callback runs on the reader task: it must not
    block.
    """

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        *,
        max_frame_bytes: int,
        timeout: float,
        on_event: EventCallback | None,
        queue_events: bool,
        batch: bool = True,
    ) -> None:
        self._reader = reader
        self._writer = writer
        self._max_frame_bytes = max_frame_bytes
        self.timeout = timeout
        self._on_event = on_event
        self._queue_events = queue_events
        self._frames = FrameWriter(writer)
        self._encoder = msgspec.msgpack.Encoder()
        self._want_batches = batch
        self._batching = False  # the daemon said protocol 2 (_hello)
        self._ops: list[msgspec.Raw] = []  # batchable calls of this iteration
        self._ops_bytes = 0
        self.batches_sent = 0  # Batch frames (each carrying two or more calls)
        self.calls_batched = 0  # calls that left in one
        self._decoder = msgspec.msgpack.Decoder(rpc.ServerMessage)
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[rpc.Reply]] = {}
        self._events: asyncio.Queue[Any] = asyncio.Queue()
        self._write_lock = asyncio.Lock()
        self._lost: ConnectionLost | None = None
        self._lost_event = asyncio.Event()
        self._orphan_error: RpcError | None = None
        self._reader_task: asyncio.Task[None] | None = None
        self.node = ""
        self.server_version = ""
        self.boot_id = ""  # the daemon process's (HelloOk), once connected
        self.protocol = 0

    # ------------------------------------------------------------ lifecycle

    @classmethod
    async def connect(
        cls,
        socket_path: str,
        *,
        client_name: str = "",
        max_frame_bytes: int = rpc.MAX_FRAME_BYTES,
        timeout: float = DEFAULT_TIMEOUT_S,
        on_event: EventCallback | None = None,
        queue_events: bool = True,
        batch: bool = True,
        descriptors: Sequence[int] = (),
    ) -> EngineClient:
        """Connect, say Hello, and check the daemon speaks our protocol.

        ``descriptors`` (memfds holding KV memory) travel with the Hello's
        first bytes (SCM_RIGHTS); a ``RegionSpec`` names one by its index
        here. They stay the caller's: the daemon holds its own duplicates.

        Raises :class:`ConnectionLost` when the socket cannot be reached,
        :class:`ProtocolError` on a protocol version mismatch, and
        :class:`RpcError` when the daemon refuses the Hello or the connection
        itself (code ``not_allowed``: this process's uid and groups may not
        use the daemon).
        """
        fds = tuple(descriptors)
        hello = rpc.Hello(1, client_name, rpc.PROTOCOL_VERSION, descriptors=len(fds))
        try:
            reader, writer = await asyncio.wait_for(_open(socket_path, fds, hello), timeout)
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            raise DaemonUnreachable(f"cannot connect to {socket_path}: {exc}") from exc
        except (OSError, TimeoutError) as exc:
            raise ConnectionLost(f"cannot connect to {socket_path}: {exc}") from exc
        client = cls(
            reader,
            writer,
            max_frame_bytes=max_frame_bytes,
            timeout=timeout,
            on_event=on_event,
            queue_events=queue_events,
            batch=batch,
        )
        client._reader_task = asyncio.create_task(client._read_loop(), name="kvpushd-client-reader")
        try:
            await client._hello(hello, sent=bool(fds))
        except ConnectionLost as exc:
            await client.close()
            # The daemon said why it hung up before answering (a refused
            # connection): that is the answer to the Hello.
            if exc.daemon_error is not None:
                raise exc.daemon_error from exc
            raise
        except BaseException:
            await client.close()
            raise
        return client

    async def _hello(self, hello: rpc.Hello, *, sent: bool) -> None:
        """Say ``hello`` (id 1; ``sent``: said already, with the descriptors, by ``_open``)."""
        next(self._ids)  # the Hello's id is taken
        try:
            reply = await self._call(hello, rpc.HelloOk, sent=sent)
        except RpcError as exc:
            if exc.code != rpc.BAD_REQUEST:
                raise
            if hello.descriptors and "descriptors" in exc.message:
                raise ProtocolError(
                    f"the daemon does not take the KV memory this engine passes by "
                    f"descriptor: {exc.message}"
                ) from exc
            if hello.descriptors or "protocol" not in exc.message:
                raise
            # A daemon from before protocol 2: speak 1 (no batches) with it.
            reply = await self._call(rpc.Hello(self._next_id(), hello.client, 1), rpc.HelloOk)
        if reply.protocol not in rpc.SUPPORTED_PROTOCOLS:
            speaks = ", ".join(str(p) for p in sorted(rpc.SUPPORTED_PROTOCOLS))
            raise ProtocolError(
                f"daemon {reply.node!r} speaks protocol {reply.protocol}, "
                f"this client speaks {speaks}"
            )
        self.node, self.server_version, self.protocol = reply.node, reply.version, reply.protocol
        self.boot_id = reply.boot_id
        self._batching = self._want_batches and reply.protocol >= rpc.BATCH_PROTOCOL

    async def close(self) -> None:
        """Close the connection; pending calls fail with :class:`ConnectionLost`."""
        self._lose(ConnectionLost("client closed"))
        task, self._reader_task = self._reader_task, None
        if task is not None and task is not asyncio.current_task():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        with contextlib.suppress(Exception):
            self._frames.flush()  # requests already sent still leave
        self._writer.close()
        with contextlib.suppress(OSError, ConnectionError):
            await self._writer.wait_closed()

    @property
    def closed(self) -> bool:
        return self._lost is not None

    async def wait_closed(self) -> ConnectionLost:
        """Until the connection ends (the daemon went away, or :meth:`close`); why it ended."""
        await self._lost_event.wait()
        assert self._lost is not None
        return _copy_lost(self._lost)

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # ---------------------------------------------------------------- calls

    async def register_engine(
        self,
        engine_id: str,
        groups: Sequence[GroupSpec],
        regions: Sequence[RegionSpec],
        offload: RegionSpec | None = None,
        offload_slots: int = 0,
        *,
        fingerprint: Fingerprint | None = None,
        memory_note: MemoryNote | None = None,
        timeout: float | None = None,
    ) -> rpc.Ok:
        """Declare the engine's KV layout and share its memory regions.

        ``fingerprint`` names what produced the KV (model, formats, parallel
        layout): pushes pair only engines with equal fingerprints.
        ``memory_note``: whose bytes the regions are and why (``kvpushd status``).
        """
        request = rpc.RegisterEngine(
            self._next_id(),
            engine_id=engine_id,
            groups=tuple(groups),
            regions=tuple(regions),
            offload=offload,
            offload_slots=offload_slots,
            fingerprint=fingerprint,
            memory_note=memory_note,
        )
        return await self._call(request, rpc.Ok, timeout)

    async def register_request(
        self,
        engine_id: str,
        request_id: str,
        role: Role | str,
        blocks: Sequence[Sequence[int]],
        *,
        incarnation: int = 1,
        peer: str = "",
        offload_slots: int = 0,
        timeout: float | None = None,
        peer_address: str = "",
        content: str = "",
        answered: bool = False,
    ) -> rpc.RequestAccepted:
        """Register a request: logical block ids per group (see :class:`rpc.RegisterRequest`).

        A receiver may give ``peer_address``, the pusher daemon's ``host:port``
        (from the prefill's kv_transfer_params), for a peer its daemon does
        not list: the daemon dials it, or refuses with ``peer_unreachable``.
        ``content``: what the blocks hold or are for (a prompt's digest); a
        push pairs only equal ones where both sides name one. ``answered``: a
        receiver registered from the prefill's answer (the prefill finished
        the request): a transfer the prefill never had fails within
        ``[deadlines] answered``, not ``registered``.
        """
        request = rpc.RegisterRequest(
            self._next_id(),
            engine_id=engine_id,
            request_id=request_id,
            role=Role(role),
            blocks=tuple(tuple(ids) for ids in blocks),
            incarnation=incarnation,
            peer=peer,
            offload_slots=offload_slots,
            peer_address=peer_address,
            content=content,
            answered=answered,
        )
        return await self._call(request, rpc.RequestAccepted, timeout)

    async def kv_ready(
        self, request_id: str, incarnation: int = 1, *, timeout: float | None = None
    ) -> rpc.Ok:
        """Prefill side: the request's KV is computed and may be pushed."""
        request = rpc.KvReady(self._next_id(), request_id=request_id, incarnation=incarnation)
        return await self._call(request, rpc.Ok, timeout)

    async def release(
        self, request_id: str, incarnation: int = 1, *, timeout: float | None = None
    ) -> rpc.Ok | rpc.Deferred:
        """Give the request's blocks back; ``Deferred`` means wait for ``Released``."""
        request = rpc.Release(self._next_id(), request_id=request_id, incarnation=incarnation)
        return await self._call(request, (rpc.Ok, rpc.Deferred), timeout)

    async def abort(
        self, request_id: str, incarnation: int = 1, *, timeout: float | None = None
    ) -> rpc.Ok | rpc.Deferred:
        """Cancel the request; ``Deferred`` when a write may still be in flight."""
        request = rpc.Abort(self._next_id(), request_id=request_id, incarnation=incarnation)
        return await self._call(request, (rpc.Ok, rpc.Deferred), timeout)

    async def hold(
        self,
        request_id: str,
        peer: str,
        peer_address: str = "",
        incarnation: int = 1,
        *,
        timeout: float | None = None,
    ) -> rpc.Ok:
        """Keep ``peer``'s push of ``request_id`` waiting: this engine's request is queued."""
        request = rpc.Hold(
            self._next_id(), request_id=request_id, peer=peer, peer_address=peer_address,
            incarnation=incarnation,
        )  # fmt: skip
        return await self._call(request, rpc.Ok, timeout)

    async def kv_mismatch(
        self,
        request_id: str,
        *,
        layer: int,
        position: int,
        difference: float,
        tolerance: float,
        detail: str = "",
        incarnation: int = 1,
        timeout: float | None = None,
    ) -> rpc.Ok:
        """Decode side: a load's KV is not this engine's (its own K/V of the recomputed token
        at ``position``, ``layer``, differs from the pushed by ``difference`` > ``tolerance``).

        ``request_id``/``incarnation``: the receiver as registered (it may be
        released already). Both daemons journal ``kv_mismatch`` and the
        prefill daemon quarantines the pairing of the two engines'
        fingerprints. :class:`RpcError` for a request the daemon has no
        receiver of (``unknown_request``) or ``bad_request`` for values out
        of range (schemas/rpc.py ``KvMismatch``).
        """
        request = rpc.KvMismatch(
            self._next_id(), request_id=request_id, layer=layer, position=position,
            difference=difference, tolerance=tolerance, detail=detail, incarnation=incarnation,
        )  # fmt: skip
        return await self._call(request, rpc.Ok, timeout)

    # ------------------------------------------------------ the offload tier
    # README.md, "Offload tier". ``holder`` names the tier client (one per
    # engine, say): what it was granted and leased is given up when the last
    # connection that named it closes. Map the pool with
    # daemon.client.pool.attach_pool. A refusal raises RpcError with a stable
    # code (schemas/reasons.py: slot_*, bad_offload; no_offload_tier).

    async def offload_grant(
        self, holder: str, n: int, *, timeout: float | None = None
    ) -> rpc.OffloadGranted:
        """Up to ``n`` zeroed slots to write (``slots``, ``generations``); fewer, even none,
        when the pool is short."""
        request = rpc.OffloadGrant(self._next_id(), holder=holder, n=n)
        return await self._call(request, rpc.OffloadGranted, timeout)

    async def offload_store(
        self,
        holder: str,
        namespace: str,
        slots: Sequence[int],
        generations: Sequence[int],
        keys: Sequence[bytes],
        digests: Sequence[bytes],
        *,
        timeout: float | None = None,
    ) -> tuple[bool, ...]:
        """Publish written slots (parallel sequences); per slot True committed, False a
        duplicate key (the first kept, this slot reset). Returns once durable."""
        request = rpc.OffloadStore(
            self._next_id(), holder=holder, namespace=namespace, slots=tuple(slots),
            generations=tuple(generations), keys=tuple(keys), digests=tuple(digests),
        )  # fmt: skip
        return (await self._call(request, rpc.OffloadStored, timeout)).committed

    async def offload_lease(
        self, holder: str, namespace: str, keys: Sequence[bytes], *, timeout: float | None = None
    ) -> rpc.OffloadLeased:
        """Look ``keys`` up; each hit is leased to ``holder`` until unleased.

        Parallel to ``keys``: ``slots`` (-1: a miss), ``generations``, ``digests``
        (the writer's digest of the slot's bytes; empty on a miss).
        """
        request = rpc.OffloadLease(
            self._next_id(), holder=holder, namespace=namespace, keys=tuple(keys)
        )
        return await self._call(request, rpc.OffloadLeased, timeout)

    async def offload_unlease(
        self,
        holder: str,
        slots: Sequence[int],
        generations: Sequence[int],
        *,
        timeout: float | None = None,
    ) -> rpc.Ok:
        """End ``holder``'s leases of ``slots`` (as leased, with their generations)."""
        request = rpc.OffloadUnlease(
            self._next_id(), holder=holder, slots=tuple(slots), generations=tuple(generations)
        )
        return await self._call(request, rpc.Ok, timeout)

    async def offload_condemn(
        self,
        holder: str,
        slots: Sequence[int],
        generations: Sequence[int],
        *,
        timeout: float | None = None,
    ) -> None:
        """Say leased ``slots`` (with their generations) are bad: the bytes loaded from them
        differ from their digest. They are never leased again (a lookup of their keys
        misses, and the keys may be stored anew) and are evicted and reset once no lease
        holds them; give your own leases back as usual. Returns once durable."""
        request = rpc.OffloadCondemn(
            self._next_id(), holder=holder, slots=tuple(slots), generations=tuple(generations)
        )
        await self._call(request, rpc.Ok, timeout)

    async def status(self, *, timeout: float | None = None) -> dict[str, Any]:
        """The daemon's status document (:class:`schemas.status.StatusDocument`), as a dict."""
        reply = await self._call(rpc.Status(self._next_id()), rpc.StatusReply, timeout)
        return msgspec.to_builtins(reply.status)

    # --------------------------------------------------------------- events

    async def next_event(self, timeout: float | None = None) -> rpc.Event:
        """The next queued event; :class:`CallTimeout` if none comes in time.

        Raises :class:`ConnectionLost` once the connection is over and every
        event received before that has been consumed.
        """
        try:
            item = await asyncio.wait_for(self._events.get(), timeout)
        except TimeoutError:
            raise CallTimeout(f"no event within {timeout} s") from None
        if item is _END:
            self._events.put_nowait(_END)  # keep the end visible to every consumer
            raise _copy_lost(self._lost or ConnectionLost("connection closed"))
        return item

    async def events(self) -> AsyncIterator[rpc.Event]:
        """Events as they arrive, until the connection is over."""
        while True:
            try:
                yield await self.next_event()
            except ConnectionLost:
                return

    # ------------------------------------------------------------- plumbing

    def _next_id(self) -> int:
        return next(self._ids)

    async def _call(
        self,
        request: rpc.Request,
        expect: type[_R] | tuple[type, ...],
        timeout: float | None = None,
        *,
        sent: bool = False,
    ) -> _R:
        """Send one request (unless ``sent`` already) and await the reply with its id."""
        if self._lost is not None:
            raise _copy_lost(self._lost)
        future: asyncio.Future[rpc.Reply] = asyncio.get_running_loop().create_future()
        self._pending[request.id] = future
        try:
            if not sent:
                await self._send(request)
            limit = self.timeout if timeout is None else timeout
            try:
                # math.inf: as long as the connection lives (its loss ends the wait).
                reply = await (future if limit == math.inf else asyncio.wait_for(future, limit))
            except TimeoutError:
                raise CallTimeout(
                    f"no reply to {type(request).__name__} (id {request.id}) within {limit} s"
                ) from None
        finally:
            self._pending.pop(request.id, None)
            if future.done() and not future.cancelled():
                # A failed send also failed this future (through _lose); the
                # caller gets the send's exception, so mark this one seen.
                future.exception()
        return _check_reply(request, reply, expect)

    async def _send(self, request: rpc.Request) -> None:
        """Queue the request's frame; the frames of one loop iteration leave together.

        Raises RequestTooLarge for a request over the frame limit, before
        anything is queued.
        """
        try:
            if self._batching and type(request) in _BATCHABLE:
                self._queue_op(request)
            else:
                if self._ops:
                    self._send_ops()  # calls made before this one leave before it
                self._frames.send(request, self._max_frame_bytes)
        except FrameTooLarge as exc:
            raise RequestTooLarge(
                f"{type(request).__name__} encodes to {exc.length} bytes, "
                f"over the {self._max_frame_bytes}-byte frame limit"
            ) from None
        async with self._write_lock:
            if self._lost is not None:
                raise _copy_lost(self._lost)
            try:
                await self._writer.drain()
            except (OSError, ConnectionError) as exc:
                lost = ConnectionLost(f"send failed: {exc}")
                self._lose(lost)
                raise lost from exc

    def _queue_op(self, request: rpc.Request) -> None:
        """Hold a call for this iteration's Batch frame (FrameTooLarge: not queued)."""
        encoded = self._encoder.encode(request)
        if len(encoded) > self._max_frame_bytes:
            raise FrameTooLarge(len(encoded), self._max_frame_bytes)
        room = self._max_frame_bytes - _BATCH_HEADROOM
        if self._ops and (
            self._ops_bytes + len(encoded) > room or len(self._ops) >= rpc.MAX_BATCH_OPS
        ):
            self._send_ops()  # full: this frame goes now, the call starts the next
        if not self._ops:
            asyncio.get_running_loop().call_soon(self._send_ops)
        self._ops.append(msgspec.Raw(encoded))
        self._ops_bytes += len(encoded)

    def _send_ops(self) -> None:
        """This iteration's calls: one alone as itself, two or more as one Batch."""
        ops, self._ops, self._ops_bytes = self._ops, [], 0
        if self._lost is not None or not ops:
            return  # the loss already failed their calls
        if len(ops) == 1:
            self._frames.send(ops[0])
            return
        self._frames.send(_BatchOut(self._next_id(), ops))
        self.batches_sent += 1
        self.calls_batched += len(ops)

    async def _read_loop(self) -> None:
        """Read frames until the connection ends, then fail whatever is pending."""
        why = "daemon closed the connection"
        frames = FrameReader(self._reader)
        try:
            while True:
                body = await frames.read(self._max_frame_bytes)
                self._dispatch(body)
        except asyncio.IncompleteReadError:
            pass
        except (FrameTooLarge, EmptyFrame) as exc:
            why = f"unreadable frame from the daemon: {exc}"
        except (OSError, ConnectionError) as exc:
            why = f"connection error: {exc}"
        self._lose(ConnectionLost(why, self._orphan_error))

    def _dispatch(self, body: bytes) -> None:
        try:
            message = self._decoder.decode(body)
        except msgspec.MsgspecError as exc:
            self._undecodable(body, exc)
            return
        if isinstance(
            message, rpc.KvArrived | rpc.BlocksFreeable | rpc.RequestFailed | rpc.Released
        ):
            self._deliver(message)
            return
        if isinstance(message, rpc.Events):
            for event in message.events:
                self._deliver(event)
            return
        if type(message) is rpc.BatchReply:
            for reply in message.replies:
                self._resolve(reply)
            return
        self._resolve(message)

    def _resolve(self, message: rpc.Reply) -> None:
        future = self._pending.get(message.id)
        if future is None or future.done():
            if isinstance(message, rpc.Error):
                self._orphan_error = RpcError(message.code, message.message)
            log.warning("dropping reply with no pending call: %r", message)
            return
        future.set_result(message)

    def _undecodable(self, body: bytes, exc: Exception) -> None:
        """Fail the call the frame answers, if it names one; drop it otherwise.

        The frame boundary is intact, so the stream stays usable: an unknown
        event kind from a newer daemon is dropped, not fatal.
        """
        try:
            raw = msgspec.msgpack.decode(body)
        except msgspec.MsgspecError:
            raw = None
        request_id = raw.get("id") if isinstance(raw, dict) else None
        future = self._pending.get(request_id) if isinstance(request_id, int) else None
        if future is not None and not future.done():
            future.set_exception(ProtocolError(f"undecodable reply: {exc}"))
        else:
            log.warning("dropping undecodable frame from the daemon: %s", exc)

    def _deliver(self, event: rpc.Event) -> None:
        if self._on_event is not None:
            try:
                self._on_event(event)
            except Exception:
                log.exception("event callback failed on %r", event)
        if self._queue_events:
            self._events.put_nowait(event)

    def _lose(self, exc: ConnectionLost) -> None:
        """Mark the connection over (once): fail pending calls, end the event stream."""
        if self._lost is not None:
            return
        self._lost = exc
        self._lost_event.set()
        for future in self._pending.values():
            if not future.done():
                future.set_exception(_copy_lost(exc))
        self._pending.clear()
        self._events.put_nowait(_END)


async def _open(
    socket_path: str, descriptors: tuple[int, ...], hello: rpc.Hello
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """The connection's stream; with descriptors, the Hello already sent, carrying them."""
    if not descriptors:
        return await asyncio.open_unix_connection(socket_path)
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.setblocking(False)
        await loop.sock_connect(sock, socket_path)
        frame = FrameEncoder().encode(hello)
        # A stream reads no ancillary data: the daemon reads the first bytes
        # with recvmsg (daemon/node/descriptors.py), so they go in one sendmsg,
        # which a new connection's empty buffer takes whole.
        sent = sock.sendmsg(
            [frame], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", descriptors))]
        )
        if sent != len(frame):
            raise ConnectionLost(f"the Hello went out in part ({sent} of {len(frame)} bytes)")
        return await asyncio.open_unix_connection(sock=sock)
    except BaseException:
        sock.close()
        raise


def _copy_lost(exc: ConnectionLost) -> ConnectionLost:
    """A fresh exception per raiser, so tracebacks do not pile up on one object."""
    copy = ConnectionLost(str(exc))
    copy.daemon_error = exc.daemon_error
    return copy


def _check_reply(request: rpc.Request, reply: rpc.Reply, expect: type[_R] | tuple[type, ...]) -> _R:
    if isinstance(reply, rpc.Error):
        raise RpcError(reply.code, reply.message)
    if not isinstance(reply, expect):
        raise ProtocolError(
            f"{type(request).__name__} (id {request.id}) got a {type(reply).__name__} reply"
        )
    return reply  # type: ignore[return-value]
