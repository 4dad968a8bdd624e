"""Group commit: many appends, one fdatasync, and nobody told before it.

Handlers append records and then ``await durable(seq)`` before replying to
an engine or messaging a peer (ARCHITECTURE.md, Invariants: persist before
telling). A commit writes the buffered records on the event loop (a
page-cache copy) and runs the fdatasync in a dedicated thread, so the loop
keeps serving, and appending, while the disk works; whatever was appended
meanwhile rides the next sync. The slower the disk, the bigger the batches.
One sync is in flight at a time.

This is the daemon's one commit mechanism: the :class:`Journal` never
commits by itself but under policy ``always`` or when a segment fills.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from daemon import failpoints
from daemon.journal.format import JournalFatal
from daemon.journal.writer import Journal


class GroupCommit:
    """Commits ``journal`` on the running event loop, at most one sync in flight.

    ``window_s``: how long a commit waits after the first request that needs
    it, so that records appended meanwhile share its fsync (fewer, larger
    syncs for some latency); 0 commits at the next pass of the loop.
    """

    def __init__(
        self,
        journal: Journal,
        *,
        window_s: float = 0.0,
        on_fatal: Callable[[JournalFatal], None],
    ) -> None:
        if window_s < 0:
            raise ValueError("window_s must be >= 0")
        self._journal = journal
        self._window_s = window_s
        self._on_fatal = on_fatal
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []
        self._scheduled: asyncio.Handle | asyncio.TimerHandle | None = None
        self._syncing = False
        self._fatal: JournalFatal | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvpushd-fsync")
        self.commits = 0
        # Called after each commit with (durable seq, seconds the sync took).
        self.observers: list[Callable[[int, float], None]] = []

    @property
    def durable_seq(self) -> int:
        return self._journal.durable_seq

    def request(self) -> None:
        """Make sure a commit is coming."""
        if self._scheduled is not None or self._syncing or self._fatal is not None:
            return
        loop = asyncio.get_running_loop()
        if self._window_s > 0:
            self._scheduled = loop.call_later(self._window_s, self._commit)
        else:
            self._scheduled = loop.call_soon(self._commit)

    async def durable(self, seq: int) -> None:
        """Return once ``seq`` is durable; raises JournalFatal if it never will be."""
        future = self.when_durable(seq)
        if future is not None:
            await future

    def when_durable(self, seq: int) -> asyncio.Future[None] | None:
        """A future done once ``seq`` is durable (its exception: it never will be).

        None when ``seq`` is durable already; raises JournalFatal if the
        journal failed. For a caller that goes on from a callback, not a task.
        """
        if self._fatal is not None:
            raise self._fatal
        if self._journal.durable_seq >= seq:
            return None
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append((seq, future))
        self.request()
        return future

    def commit_now(self) -> int:
        """Commit synchronously, on this thread (shutdown, snapshots)."""
        if self._fatal is not None:
            raise self._fatal
        try:
            durable = self._journal.commit()
        except JournalFatal as exc:
            self._failed(exc)
            raise
        self._wake(durable)
        return durable

    def close(self) -> None:
        self._executor.shutdown(wait=True)

    def _commit(self) -> None:
        self._scheduled = None
        if self._fatal is not None or self._syncing:
            return
        try:
            written, fd = self._journal.write_pending()
        except JournalFatal as exc:
            self._failed(exc)
            return
        if fd is None:
            self._done(written, 0.0)
            return
        self._syncing = True
        started = time.perf_counter()
        future = asyncio.get_running_loop().run_in_executor(
            self._executor, self._journal.sync_fd, fd
        )
        future.add_done_callback(functools.partial(self._synced, written=written, started=started))

    def _synced(self, future: asyncio.Future[None], written: int, started: float) -> None:
        self._syncing = False
        exc = future.exception()
        if exc is not None:
            fatal = exc if isinstance(exc, JournalFatal) else JournalFatal(str(exc))
            self._failed(fatal)
            return
        failpoints.hit("groupcommit.synced")
        # perf_counter, not loop.time(): uvloop's clock moves once per loop
        # pass, in milliseconds, and a sync often takes less.
        try:
            self._journal.mark_durable(written)
        except JournalFatal as failed:
            # The journal failed on the loop's own synchronous path (a
            # snapshot, policy "always") while this sync was in flight.
            self._failed(failed)
            return
        self._done(written, time.perf_counter() - started)

    def _done(self, durable: int, seconds: float) -> None:
        self.commits += 1
        for observe in self.observers:
            observe(durable, seconds)
        self._wake(self._journal.durable_seq)

    def _wake(self, durable: int) -> None:
        still_waiting = []
        for seq, future in self._waiters:
            if seq <= durable:
                if not future.done():
                    future.set_result(None)
            else:
                still_waiting.append((seq, future))
        self._waiters = still_waiting
        # Records appended during the sync ride the next one even when nobody
        # waits for them yet, so the journal never lags behind the daemon.
        if still_waiting or self._journal.next_seq - 1 > durable:
            self.request()

    def _failed(self, exc: JournalFatal) -> None:
        # A failed fsync is fatal, never retried (ARCHITECTURE.md, Journal).
        self._fatal = exc
        for _, future in self._waiters:
            if not future.done():
                future.set_exception(exc)
        self._waiters.clear()
        self._on_fatal(exc)
