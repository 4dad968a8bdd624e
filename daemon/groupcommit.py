"""Group commit: many appends, one fdatasync, and nobody told before it.

Handlers append records and then ``await durable(seq)`` before replying to
an engine or messaging a peer (DESIGN invariant 6). The commit runs on the
event loop as soon as the loop has finished its current batch of callbacks
(or after ``window_s``), so every record appended meanwhile by any handler
rides the same fdatasync: the costlier the sync, the bigger the batch.

Committing on the loop thread blocks it for one write + fdatasync (a few
hundred microseconds here); running it in a thread would race appends
against the journal's buffer, which is not shared-state safe.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from daemon.journal import Journal, JournalFatal


class GroupCommit:
    def __init__(
        self,
        journal: Journal,
        *,
        window_s: float = 0.0,
        on_fatal: Callable[[JournalFatal], None],
        on_commit: Callable[[int, float], None] | None = None,
    ) -> None:
        self._journal = journal
        self._window_s = window_s
        self._on_fatal = on_fatal
        self._on_commit = on_commit
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []
        self._scheduled: asyncio.Handle | asyncio.TimerHandle | None = None
        self._fatal: JournalFatal | None = None
        self.commits = 0

    @property
    def durable_seq(self) -> int:
        return self._journal.durable_seq

    def request(self) -> None:
        """Make sure a commit is coming."""
        if self._scheduled is not None or self._fatal is not None:
            return
        loop = asyncio.get_running_loop()
        if self._window_s > 0:
            self._scheduled = loop.call_later(self._window_s, self._commit)
        else:
            self._scheduled = loop.call_soon(self._commit)

    async def durable(self, seq: int) -> None:
        """Return once ``seq`` is durable; raises JournalFatal if it never will be."""
        if self._fatal is not None:
            raise self._fatal
        if self._journal.durable_seq >= seq:
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append((seq, future))
        self.request()
        await future

    def commit_now(self) -> int:
        """Commit synchronously (shutdown, snapshots)."""
        self._commit()
        return self._journal.durable_seq

    def _commit(self) -> None:
        self._scheduled = None
        if self._fatal is not None:
            return
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            durable = self._journal.commit()
        except JournalFatal as exc:
            self._fatal = exc
            for _, future in self._waiters:
                if not future.done():
                    future.set_exception(exc)
            self._waiters.clear()
            self._on_fatal(exc)
            return
        self.commits += 1
        if self._on_commit is not None:
            self._on_commit(durable, loop.time() - started)
        still_waiting = []
        for seq, future in self._waiters:
            if seq <= durable:
                if not future.done():
                    future.set_result(None)
            else:
                still_waiting.append((seq, future))
        self._waiters = still_waiting
        if still_waiting:
            self.request()
