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

import asyncio
import contextlib
import itertools
import logging
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from concurrent.futures import Future as ThreadFuture
from typing import Any, Final, TypeVar

import msgspec

from daemon.framing import PREFIX_BYTES, EmptyFrame, FrameEncoder, FrameTooLarge, read_frame
from schemas import rpc
from schemas.kvlayout import GroupSpec, RegionSpec
from schemas.layout import Role
from schemas.reasons import Reason

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S: Final = 30.0

Event = rpc.Event
EventCallback = Callable[[rpc.Event], None]
_R = TypeVar("_R")
_T = TypeVar("_T")
_END: Final = object()  # event-queue sentinel: the connection is over


# ------------------------------------------------------------------- errors


class ClientError(Exception):
    """Base of everything this module raises on purpose."""


class RpcError(ClientError):
    """The daemon answered with an ``Error``: a refusal or a malformed request.

    ``code`` is the stable string from the wire; :attr:`reason` is the
    :class:`Reason` when the code is one (protocol codes such as
    ``bad_request`` are not).
    """

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message

    @property
    def reason(self) -> Reason | None:
        try:
            return Reason(self.code)
        except ValueError:
            return None


class ConnectionLost(ClientError):
    """The connection is closed or broke; pending and later calls fail with this.

    ``daemon_error`` is the last ``Error`` the daemon sent that answered no
    call (id 0: a refused connection, an oversized frame), which usually says
    why it hung up.
    """

    def __init__(self, message: str, daemon_error: RpcError | None = None) -> None:
        if daemon_error is not None:
            message = f"{message} (daemon said {daemon_error})"
        super().__init__(message)
        self.daemon_error = daemon_error


class ProtocolError(ClientError):
    """The daemon sent something this client cannot accept (wrong reply kind,
    undecodable reply, unsupported protocol version)."""


class CallTimeout(ClientError, TimeoutError):
    """No reply (or event) within the timeout. Also a :class:`TimeoutError`."""


class RequestTooLarge(ClientError):
    """The encoded request exceeds the frame limit; it was not sent."""


# ------------------------------------------------------------- async client


class EngineClient:
    """One connection to the daemon; safe to use from many tasks of one loop.

    Build it with :meth:`connect`. Each call takes a fresh id, sends its
    request and awaits the reply with that id; calls may overlap freely.
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
    ) -> None:
        self._reader = reader
        self._writer = writer
        self._max_frame_bytes = max_frame_bytes
        self.timeout = timeout
        self._on_event = on_event
        self._queue_events = queue_events
        self._encoder = FrameEncoder()
        self._decoder = msgspec.msgpack.Decoder(rpc.ServerMessage)
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[rpc.Reply]] = {}
        self._events: asyncio.Queue[Any] = asyncio.Queue()
        self._write_lock = asyncio.Lock()
        self._lost: ConnectionLost | None = None
        self._orphan_error: RpcError | None = None
        self._reader_task: asyncio.Task[None] | None = None
        self.node = ""
        self.server_version = ""
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
    ) -> EngineClient:
        """Connect, say Hello, and check the daemon speaks our protocol.

        Raises :class:`ConnectionLost` when the socket cannot be reached,
        :class:`ProtocolError` on a protocol version mismatch, and
        :class:`RpcError` when the daemon refuses the Hello.
        """
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_unix_connection(socket_path), timeout
            )
        except (OSError, TimeoutError) as exc:
            raise ConnectionLost(f"cannot connect to {socket_path}: {exc}") from exc
        client = cls(
            reader,
            writer,
            max_frame_bytes=max_frame_bytes,
            timeout=timeout,
            on_event=on_event,
            queue_events=queue_events,
        )
        client._reader_task = asyncio.create_task(client._read_loop(), name="kvpushd-client-reader")
        try:
            await client._hello(client_name)
        except BaseException:
            await client.close()
            raise
        return client

    async def _hello(self, client_name: str) -> None:
        reply = await self._call(rpc.Hello(self._next_id(), client=client_name), rpc.HelloOk)
        if reply.protocol != rpc.PROTOCOL_VERSION:
            raise ProtocolError(
                f"daemon {reply.node!r} speaks protocol {reply.protocol}, "
                f"this client speaks {rpc.PROTOCOL_VERSION}"
            )
        self.node, self.server_version, self.protocol = reply.node, reply.version, reply.protocol

    async def close(self) -> None:
        """Close the connection; pending calls fail with :class:`ConnectionLost`."""
        self._lose(ConnectionLost("client closed"))
        task, self._reader_task = self._reader_task, None
        if task is not None and task is not asyncio.current_task():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._writer.close()
        with contextlib.suppress(OSError, ConnectionError):
            await self._writer.wait_closed()

    @property
    def closed(self) -> bool:
        return self._lost is not None

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
        timeout: float | None = None,
    ) -> rpc.Ok:
        """Declare the engine's KV layout and share its memory regions."""
        request = rpc.RegisterEngine(
            self._next_id(),
            engine_id=engine_id,
            groups=tuple(groups),
            regions=tuple(regions),
            offload=offload,
            offload_slots=offload_slots,
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
    ) -> rpc.RequestAccepted:
        """Register a request: logical block ids per group (see :class:`rpc.RegisterRequest`)."""
        request = rpc.RegisterRequest(
            self._next_id(),
            engine_id=engine_id,
            request_id=request_id,
            role=Role(role),
            blocks=tuple(tuple(ids) for ids in blocks),
            incarnation=incarnation,
            peer=peer,
            offload_slots=offload_slots,
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
    ) -> _R:
        """Send one request and await the reply with its id."""
        if self._lost is not None:
            raise _copy_lost(self._lost)
        frame = self._encoder.encode(request)
        if len(frame) - PREFIX_BYTES > self._max_frame_bytes:
            raise RequestTooLarge(
                f"{type(request).__name__} encodes to {len(frame) - PREFIX_BYTES} bytes, "
                f"over the {self._max_frame_bytes}-byte frame limit"
            )
        future: asyncio.Future[rpc.Reply] = asyncio.get_running_loop().create_future()
        self._pending[request.id] = future
        try:
            await self._send(frame)
            limit = self.timeout if timeout is None else timeout
            try:
                reply = await asyncio.wait_for(future, limit)
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

    async def _send(self, frame: bytearray) -> None:
        async with self._write_lock:
            if self._lost is not None:
                raise _copy_lost(self._lost)
            try:
                self._writer.write(frame)
                await self._writer.drain()
            except (OSError, ConnectionError) as exc:
                lost = ConnectionLost(f"send failed: {exc}")
                self._lose(lost)
                raise lost from exc

    async def _read_loop(self) -> None:
        """Read frames until the connection ends, then fail whatever is pending."""
        why = "daemon closed the connection"
        try:
            while True:
                body = await read_frame(self._reader, self._max_frame_bytes)
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
        for future in self._pending.values():
            if not future.done():
                future.set_exception(_copy_lost(exc))
        self._pending.clear()
        self._events.put_nowait(_END)


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


# ---------------------------------------------------------- blocking client


class BlockingEngineClient:
    """The same client, synchronous, for engines that run their own loop.

    An :class:`EngineClient` runs on a private event loop in a daemon thread;
    each method submits to it and waits. Safe to call from many threads.
    Calling it from inside its own loop thread (e.g. from the event callback)
    would deadlock, so that raises ``RuntimeError``.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, thread: threading.Thread) -> None:
        self._loop = loop
        self._thread = thread
        self._client: EngineClient | None = None
        self._closed = False  # guarded by _lock: no submission after it is set
        self._lock = threading.Lock()

    @classmethod
    def connect(
        cls,
        socket_path: str,
        *,
        client_name: str = "",
        max_frame_bytes: int = rpc.MAX_FRAME_BYTES,
        timeout: float = DEFAULT_TIMEOUT_S,
        on_event: EventCallback | None = None,
        queue_events: bool = True,
    ) -> BlockingEngineClient:
        """Start the private loop and connect; raises like :meth:`EngineClient.connect`."""
        loop = _new_loop()
        thread = threading.Thread(target=loop.run_forever, name="kvpushd-client", daemon=True)
        thread.start()
        self = cls(loop, thread)
        try:
            self._client = self._submit(
                EngineClient.connect(
                    socket_path,
                    client_name=client_name,
                    max_frame_bytes=max_frame_bytes,
                    timeout=timeout,
                    on_event=on_event,
                    queue_events=queue_events,
                )
            )
        except BaseException:
            self._stop_loop()
            raise
        return self

    @property
    def client(self) -> EngineClient:
        """The underlying async client (use it only on its loop)."""
        if self._client is None or self._closed:
            raise ConnectionLost("client closed")
        return self._client

    @property
    def node(self) -> str:
        return self.client.node

    def register_engine(
        self,
        engine_id: str,
        groups: Sequence[GroupSpec],
        regions: Sequence[RegionSpec],
        offload: RegionSpec | None = None,
        offload_slots: int = 0,
        *,
        timeout: float | None = None,
    ) -> rpc.Ok:
        return self._run(
            self.client.register_engine(
                engine_id, groups, regions, offload, offload_slots, timeout=timeout
            )
        )

    def register_request(
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
    ) -> rpc.RequestAccepted:
        return self._run(
            self.client.register_request(
                engine_id,
                request_id,
                role,
                blocks,
                incarnation=incarnation,
                peer=peer,
                offload_slots=offload_slots,
                timeout=timeout,
            )
        )

    def kv_ready(
        self, request_id: str, incarnation: int = 1, *, timeout: float | None = None
    ) -> rpc.Ok:
        return self._run(self.client.kv_ready(request_id, incarnation, timeout=timeout))

    def release(
        self, request_id: str, incarnation: int = 1, *, timeout: float | None = None
    ) -> rpc.Ok | rpc.Deferred:
        return self._run(self.client.release(request_id, incarnation, timeout=timeout))

    def abort(
        self, request_id: str, incarnation: int = 1, *, timeout: float | None = None
    ) -> rpc.Ok | rpc.Deferred:
        return self._run(self.client.abort(request_id, incarnation, timeout=timeout))

    def status(self, *, timeout: float | None = None) -> dict[str, Any]:
        return self._run(self.client.status(timeout=timeout))

    def next_event(self, timeout: float | None = None) -> rpc.Event:
        """The next event; raises :class:`CallTimeout` or, at the end, :class:`ConnectionLost`."""
        return self._run(self.client.next_event(timeout))

    def events(self, timeout: float | None = None) -> Iterator[rpc.Event]:
        """Events until the connection ends, or until none arrives for ``timeout`` s."""
        while True:
            try:
                yield self.next_event(timeout)
            except (CallTimeout, ConnectionLost):
                return

    def close(self) -> None:
        """Close the connection and stop the private loop; idempotent.

        Calls in flight in other threads fail with :class:`ConnectionLost`;
        the loop is stopped only once every submitted call has finished, so
        no caller is left waiting on a loop that no longer runs.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            if self._client is not None:
                self._submit(self._client.close())
            self._submit(_drain_tasks(timeout=5.0))
        finally:
            self._stop_loop()

    def __enter__(self) -> BlockingEngineClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _run(self, coro: Awaitable[_T]) -> _T:
        """Run a public call on the private loop and wait for its result."""
        with self._lock:
            if self._closed:
                _discard(coro)
                raise ConnectionLost("client closed")
            future = self._start(coro)
        return future.result()

    def _submit(self, coro: Awaitable[_T]) -> _T:
        """Like :meth:`_run` but also while closing (connect and close use it)."""
        return self._start(coro).result()

    def _start(self, coro: Awaitable[_T]) -> ThreadFuture[_T]:
        if threading.current_thread() is self._thread:
            _discard(coro)
            raise RuntimeError("BlockingEngineClient called from its own loop thread")
        return asyncio.run_coroutine_threadsafe(coro, self._loop)  # type: ignore[arg-type]

    def _stop_loop(self) -> None:
        if self._loop.is_closed():
            return
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()


def _discard(coro: Awaitable[Any]) -> None:
    if asyncio.iscoroutine(coro):
        coro.close()  # never awaited: close it so Python does not warn


async def _drain_tasks(timeout: float) -> None:
    """Let every other task on this loop finish (calls failing after close)."""
    others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    if others:
        await asyncio.wait(others, timeout=timeout)


def _new_loop() -> asyncio.AbstractEventLoop:
    """uvloop when installed (as the daemon uses), else the default loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()
