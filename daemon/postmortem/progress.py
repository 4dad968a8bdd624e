"""The progress bar of a long fold, fed by worker processes through shared memory.

Each node's fold counts its records into a :class:`ProgressSlot` (two
integers in a shared array); one thread of the parent reads them all and
draws the bar (:class:`ProgressBar`). :func:`worker_context` is the process
start method both the shared array and the pool of workers use.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import threading
import time
from collections.abc import Callable, Iterator
from multiprocessing.context import BaseContext
from typing import Final, Protocol, TextIO, overload

from schemas.events import Record

PROGRESS_EVERY: Final = 1 << 16  # records between progress updates
PROGRESS_MIN_RECORDS: Final = 200_000  # shorter replays finish before a bar helps


class SharedCounts(Protocol):
    """The shared array (ctypes int64, no lock): per slot, records done then records in all."""

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> list[int]: ...
    def __setitem__(self, index: int, value: int) -> None: ...


class ProgressSlot:
    """One node's share of the progress bar: two integers in shared memory.

    Pickled into a worker as its slot number only; the worker finds the
    shared array in :data:`_worker_progress`, handed over when the pool
    started it (shared memory can only travel at process start).
    """

    def __init__(self, shared: SharedCounts, slot: int) -> None:
        self._shared = shared
        self._slot = slot
        self._count = 0

    def __reduce__(self) -> tuple[Callable[[int], ProgressSlot], tuple[int]]:
        return _worker_slot, (self._slot,)

    def set_total(self, total: int) -> None:
        self._shared[2 * self._slot + 1] = total

    def wrap(self, on_record: Callable[[Record, object], None]) -> Callable[[Record, object], None]:
        shared, index = self._shared, 2 * self._slot

        def ticking(record: Record, touched: object) -> None:
            on_record(record, touched)
            self._count += 1
            if not self._count & (PROGRESS_EVERY - 1):
                shared[index] = self._count

        return ticking

    def wrap_batch(
        self, on_batch: Callable[[list[Record], list[object]], None]
    ) -> Callable[[list[Record], list[object]], None]:
        """:meth:`wrap` for a fold's ``on_batch``: the count moves a batch at a time."""
        shared, index = self._shared, 2 * self._slot

        def ticking(records: list[Record], touched: list[object]) -> None:
            on_batch(records, touched)
            self._count += len(records)
            shared[index] = self._count

        return ticking

    def finish(self) -> None:
        self._shared[2 * self._slot] = self._shared[2 * self._slot + 1]


_worker_progress: SharedCounts | None = None


def init_worker(shared: SharedCounts | None) -> None:
    """A worker process's initializer: the shared array its slots point into."""
    global _worker_progress
    _worker_progress = shared


def _worker_slot(slot: int) -> ProgressSlot:
    # A slot is only pickled where a bar exists, so its worker got the shared array.
    if _worker_progress is None:
        raise RuntimeError("a progress slot reached a worker started without the shared array")
    return ProgressSlot(_worker_progress, slot)


class ProgressBar:
    """Draws the folds' progress on a terminal's stderr from a thread of the parent.

    Workers only write two integers each into shared memory; the drawing
    stays here so several processes never interleave half-lines.
    """

    INTERVAL_S = 0.2  # between redraws

    def __init__(self, nodes: int, stream: TextIO) -> None:
        self.shared: SharedCounts = worker_context().Array("q", 2 * nodes, lock=False)
        self._stream = stream
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="progress", daemon=True)
        self._started = time.monotonic()
        self._drawn = False

    def slot(self, index: int) -> ProgressSlot:
        return ProgressSlot(self.shared, index)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        if self._drawn:
            self._stream.write("\r\x1b[2K")
            self._stream.flush()

    def _run(self) -> None:
        while not self._stop.wait(self.INTERVAL_S):
            done = sum(self.shared[0::2])
            total = sum(self.shared[1::2])
            if total < PROGRESS_MIN_RECORDS:
                continue
            self._draw(done, total)

    def _draw(self, done: int, total: int) -> None:
        width = 30
        filled = int(width * done / total) if total else 0
        elapsed = time.monotonic() - self._started
        rate = done / elapsed if elapsed > 0 else 0.0
        self._stream.write(
            f"\rreplaying [{'#' * filled}{'.' * (width - filled)}] "
            f"{done:,}/{total:,} records  {rate / 1e3:,.0f} k/s"
        )
        self._stream.flush()
        self._drawn = True


def on_terminal(stream: TextIO | None) -> TextIO | None:
    """``stream`` if it is a terminal (the only place a bar is drawn), else None."""
    if stream is None:
        return None
    try:
        return stream if stream.isatty() else None
    except (AttributeError, ValueError):
        return None


@contextlib.contextmanager
def drawing(bar: ProgressBar | None) -> Iterator[None]:
    """The bar drawn while the block runs (nothing if there is no bar)."""
    if bar is None:
        yield
        return
    bar.start()
    try:
        yield
    finally:
        bar.stop()


def worker_context() -> BaseContext:
    """fork where there is one: a worker starts in milliseconds with every module
    loaded, and re-imports nothing from ``__main__``. The parent forks before
    it starts any thread of its own (the progress bar starts after the pool).
    """
    methods = multiprocessing.get_all_start_methods()
    return multiprocessing.get_context("fork" if "fork" in methods else "spawn")
