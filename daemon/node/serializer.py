"""Per-key ordering of concurrent handlers: one serializer for engines and peers.

Handlers wait on the journal, so running them one at a time would cap a
connection at one fdatasync per message. The serializer runs them
concurrently, except that those sharing a key (a request id) run in the order
they were submitted, and a *barrier* (a handler with no key: an engine's
hello, register_engine or status) waits for everything submitted before it,
and everything submitted after waits for it.

A handler waits for its predecessors whatever their outcome. A task cancelled
while it waits (shutdown, a closed connection) closes its coroutine unrun:
it must not be dispatched once the daemon decided to stop it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Collection, Coroutine, Hashable
from typing import Any

Spawn = Callable[[Coroutine[Any, Any, Any]], "asyncio.Task[Any]"]


class KeyedSerializer:
    def __init__(self, spawn: Spawn = asyncio.ensure_future) -> None:
        self._spawn = spawn
        self._last: dict[Hashable, asyncio.Task[Any]] = {}
        self._barrier: asyncio.Task[Any] | None = None
        # Keyed tasks submitted since the last barrier: the next barrier waits
        # for these and that barrier only (it waited for all before it), so a
        # flood of barriers costs one wait each, not one per task in flight.
        self._since_barrier: set[asyncio.Task[Any]] = set()
        self.inflight: set[asyncio.Task[Any]] = set()

    def submit(
        self,
        coro: Coroutine[Any, Any, Any],
        key: Hashable | None,
        *,
        after: Hashable | None = None,
    ) -> asyncio.Task[Any]:
        """Run ``coro`` after the last task with ``key`` (and with ``after``).

        ``key=None`` makes it a barrier.
        """
        if key is None:
            before = (self._barrier, *self._since_barrier)
            waits = [t for t in before if t is not None and not t.done()]
        else:
            candidates = (self._barrier, self._last.get(key), self._last.get(after))
            waits = [t for t in candidates if t is not None and not t.done()]
        task = self._spawn(_after(waits, coro))
        self.inflight.add(task)
        if key is None:
            self._barrier = task
            self._since_barrier = set()
        else:
            self._last[key] = task
            self._since_barrier.add(task)
        task.add_done_callback(lambda t: self._done(t, key))
        return task

    def submit_many(
        self, coro: Coroutine[Any, Any, Any], keys: Collection[Hashable]
    ) -> asyncio.Task[Any]:
        """Run ``coro`` after the last task of every key in ``keys`` (a batch's requests).

        Until it ends, a task submitted with any of those keys runs after it.
        """
        candidates = (self._barrier, *(self._last.get(key) for key in keys))
        waits = [t for t in candidates if t is not None and not t.done()]
        task = self._spawn(_after(list(dict.fromkeys(waits)), coro))
        self.inflight.add(task)
        for key in keys:
            self._last[key] = task
        self._since_barrier.add(task)
        task.add_done_callback(lambda t: self._done_many(t, keys))
        return task

    def _done_many(self, task: asyncio.Task[Any], keys: Collection[Hashable]) -> None:
        self.inflight.discard(task)
        self._since_barrier.discard(task)
        for key in keys:
            if self._last.get(key) is task:
                del self._last[key]

    def _done(self, task: asyncio.Task[Any], key: Hashable | None) -> None:
        self.inflight.discard(task)
        self._since_barrier.discard(task)
        if key is None:
            if self._barrier is task:
                self._barrier = None
        elif self._last.get(key) is task:
            del self._last[key]


async def _after(waits: list[asyncio.Task[Any]], coro: Coroutine[Any, Any, Any]) -> Any:
    try:
        if waits:
            # asyncio.wait neither raises a predecessor's error nor cancels the
            # predecessors when this task is cancelled (which shield() around a
            # suppressed BaseException got wrong: it swallowed this task's own
            # cancellation, and the handler then ran anyway).
            await asyncio.wait(waits)
    except asyncio.CancelledError:
        coro.close()
        raise
    return await coro
