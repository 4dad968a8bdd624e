"""The blocking engine client: an :class:`EngineClient` on a private loop in a thread.

For engines with their own (non-asyncio) loop; every method blocks until the
daemon replies and raises the same errors as the async client.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Iterator, Sequence
from concurrent.futures import Future as ThreadFuture
from typing import Any, TypeVar

from daemon.client.engine_client import DEFAULT_TIMEOUT_S, EngineClient, EventCallback
from daemon.client.errors import CallTimeout, ConnectionLost
from schemas import rpc
from schemas.fingerprint import Fingerprint
from schemas.kvlayout import GroupSpec, MemoryNote, RegionSpec
from schemas.layout import Role

log = logging.getLogger(__name__)
_T = TypeVar("_T")


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
        descriptors: Sequence[int] = (),
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
                    descriptors=descriptors,
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
        fingerprint: Fingerprint | None = None,
        memory_note: MemoryNote | None = None,
        timeout: float | None = None,
    ) -> rpc.Ok:
        return self._run(
            self.client.register_engine(
                engine_id,
                groups,
                regions,
                offload,
                offload_slots,
                fingerprint=fingerprint,
                memory_note=memory_note,
                timeout=timeout,
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
        peer_address: str = "",
        content: str = "",
        answered: bool = False,
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
                peer_address=peer_address,
                content=content,
                answered=answered,
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

    def kv_mismatch(
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
        return self._run(
            self.client.kv_mismatch(
                request_id,
                layer=layer,
                position=position,
                difference=difference,
                tolerance=tolerance,
                detail=detail,
                incarnation=incarnation,
                timeout=timeout,
            )
        )

    def offload_grant(
        self, holder: str, n: int, *, timeout: float | None = None
    ) -> rpc.OffloadGranted:
        return self._run(self.client.offload_grant(holder, n, timeout=timeout))

    def offload_store(
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
        return self._run(
            self.client.offload_store(
                holder, namespace, slots, generations, keys, digests, timeout=timeout
            )
        )

    def offload_lease(
        self, holder: str, namespace: str, keys: Sequence[bytes], *, timeout: float | None = None
    ) -> rpc.OffloadLeased:
        return self._run(self.client.offload_lease(holder, namespace, keys, timeout=timeout))

    def offload_unlease(
        self,
        holder: str,
        slots: Sequence[int],
        generations: Sequence[int],
        *,
        timeout: float | None = None,
    ) -> rpc.Ok:
        return self._run(self.client.offload_unlease(holder, slots, generations, timeout=timeout))

    def offload_condemn(
        self,
        holder: str,
        slots: Sequence[int],
        generations: Sequence[int],
        *,
        timeout: float | None = None,
    ) -> None:
        self._run(self.client.offload_condemn(holder, slots, generations, timeout=timeout))

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
