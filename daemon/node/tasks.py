"""The node's background tasks: spawned, tracked, and cancelled together on close.

A task that fails is logged once; failures that are already reported
elsewhere (a journal failure, the data plane closed under a task by it)
are not logged again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from daemon.dataplane.plane import DataPlaneError
from daemon.journal.format import JournalFatal
from daemon.node.lifecycle import Lifecycle

Spawn = Callable[[Awaitable[Any]], "asyncio.Task[Any]"]


class Tasks:
    def __init__(self, log: Any, *, life: Lifecycle | None = None) -> None:
        self._log = log
        self._life = life or Lifecycle()  # failed: data plane errors follow from it
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Awaitable[Any]) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    async def cancel_all(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def __len__(self) -> int:
        return len(self._tasks)

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if isinstance(exc, JournalFatal):
            return  # reported by the journal's on_fatal
        if isinstance(exc, DataPlaneError) and exc.code == "state" and self._life.failed:
            return  # the journal failure closed the data plane under it; reported once
        if exc is not None:
            self._log.error("task failed", error=repr(exc), exc_info=exc)
