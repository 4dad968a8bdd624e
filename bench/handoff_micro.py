"""Thread hand-offs between a uvloop event loop and a worker thread, measured alone.

The options weighed for the NIXL worker (issue 14, item 2), without NIXL:

- worker -> loop, one result: ``call_soon_threadsafe`` (what the worker
  does) against an eventfd the loop watches with ``add_reader``; latency
  from the worker's hand-off to the callback running on the loop;
- worker -> loop, a burst of 16 results: one ``call_soon_threadsafe`` each
  against one per burst (the worker's outbox); loop CPU per result;
- loop -> worker: ``SimpleQueue.put`` to a worker blocked in ``get(timeout)``
  (what the data plane does) against an eventfd the worker waits on with
  ``select``; latency from the put to the worker running;
- the worker's CPU per timed 50 us wait that ends empty (a busy worker's
  wait between poll rounds): ``SimpleQueue.get(timeout)`` (the worker
  before), ``select`` on an eventfd, ``time.sleep`` (tried for the worker and dropped).

    .venv/bin/python -m bench.handoff_micro [--n 2000]

Prints medians and p90s in microseconds; nothing is recorded.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import os
import queue
import select
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable

import uvloop


def _slack() -> None:
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(29, 1000, 0, 0, 0)  # as the NIXL worker


def _q(values: list[float]) -> str:
    values = sorted(values)
    p90 = values[int(len(values) * 0.9)]
    return f"p50 {statistics.median(values) * 1e6:7.1f} us  p90 {p90 * 1e6:7.1f} us"


async def to_loop(n: int, how: str) -> list[float]:
    """Latency of one result from the worker thread to a callback on the loop."""
    loop = asyncio.get_running_loop()
    out: list[float] = []
    got = asyncio.Event()
    stamp = [0.0]
    efd = os.eventfd(0, os.EFD_NONBLOCK)

    def arrived() -> None:
        out.append(time.perf_counter() - stamp[0])
        got.set()

    def on_efd() -> None:
        os.eventfd_read(efd)
        arrived()

    if how == "eventfd":
        loop.add_reader(efd, on_efd)
    go = threading.Semaphore(0)

    def worker() -> None:
        _slack()
        for _ in range(n):
            go.acquire()
            time.sleep(0.0002)  # let the loop fall asleep in epoll
            stamp[0] = time.perf_counter()
            if how == "eventfd":
                os.eventfd_write(efd, 1)
            else:
                loop.call_soon_threadsafe(arrived)

    thread = threading.Thread(target=worker)
    thread.start()
    for _ in range(n):
        got.clear()
        go.release()
        await got.wait()  # the loop sleeps in epoll with nothing else to do
    thread.join()
    if how == "eventfd":
        loop.remove_reader(efd)
    os.close(efd)
    return out


async def burst_cpu(bursts: int, size: int, batched: bool) -> float:
    """Loop-thread CPU per result when the worker hands over bursts of ``size`` results."""
    loop = asyncio.get_running_loop()
    outbox: deque[tuple[asyncio.Future[int], int]] = deque()
    pending = [False]
    work: queue.SimpleQueue[list[asyncio.Future[int]] | None] = queue.SimpleQueue()

    def deliver() -> None:
        pending[0] = False
        while outbox:
            fut, value = outbox.popleft()
            fut.set_result(value)

    def worker() -> None:
        while (futs := work.get()) is not None:
            for i, fut in enumerate(futs):
                if batched:
                    outbox.append((fut, i))
                else:
                    loop.call_soon_threadsafe(fut.set_result, i)
            if batched and not pending[0]:
                pending[0] = True
                loop.call_soon_threadsafe(deliver)

    thread = threading.Thread(target=worker)
    thread.start()
    cpu = 0.0
    for _ in range(bursts):
        futs = [loop.create_future() for _ in range(size)]
        c0 = time.thread_time()
        work.put(futs)
        await asyncio.gather(*futs)
        cpu += time.thread_time() - c0
    work.put(None)
    thread.join()
    return cpu / (bursts * size)


def to_worker(n: int, how: str) -> tuple[list[float], float]:
    """Latency of a command from the loop thread to the worker; worker CPU per empty wait."""
    q: queue.SimpleQueue[float] = queue.SimpleQueue()
    efd = os.eventfd(0, os.EFD_NONBLOCK)
    box: deque[float] = deque()
    lat: list[float] = []
    ready = threading.Event()
    empty_cpu = [0.0]

    def worker() -> None:
        _slack()
        c0 = time.thread_time()
        for _ in range(200):  # empty timed waits, as a busy worker's poll rounds
            if how == "queue":
                with contextlib.suppress(queue.Empty):
                    q.get(timeout=5e-5)
            else:
                select.select([efd], [], [], 5e-5)
        empty_cpu[0] = (time.thread_time() - c0) / 200
        ready.set()
        while len(lat) < n:
            if how == "queue":
                sent = q.get()
                lat.append(time.perf_counter() - sent)
                continue
            select.select([efd], [], [])
            os.eventfd_read(efd)
            now = time.perf_counter()
            while box:  # two writes may have come before this read
                lat.append(now - box.popleft())

    thread = threading.Thread(target=worker)
    thread.start()
    ready.wait()
    for _ in range(n):
        time.sleep(0.0002)  # the worker is asleep again
        if how == "queue":
            q.put(time.perf_counter())
        else:
            box.append(time.perf_counter())
            os.eventfd_write(efd, 1)
    thread.join()
    os.close(efd)
    return lat, empty_cpu[0]


def empty_wait_cpu(how: str, rounds: int = 2000) -> float:
    """CPU of one 50 us wait that ends with nothing to do, on a thread with 1 us timer slack."""
    q: queue.SimpleQueue[int] = queue.SimpleQueue()
    efd = os.eventfd(0, os.EFD_NONBLOCK)
    out = [0.0]

    def run() -> None:
        _slack()
        c0 = time.thread_time()
        for _ in range(rounds):
            if how == "SimpleQueue.get(timeout)":
                with contextlib.suppress(queue.Empty):
                    q.get(timeout=5e-5)
            elif how == "select on an eventfd":
                select.select([efd], [], [], 5e-5)
            else:
                time.sleep(5e-5)
        out[0] = (time.thread_time() - c0) / rounds

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    os.close(efd)
    return out[0]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=2000)
    args = parser.parse_args(argv)
    n = args.n

    async def loop_side() -> dict[str, Callable[[], str]]:
        results = {}
        for how in ("call_soon_threadsafe", "eventfd"):
            results[f"worker -> loop, {how}"] = _q(await to_loop(n, how))
        for batched in (False, True):
            cpu = await burst_cpu(max(n // 16, 20), 16, batched)
            name = "one wake-up per burst" if batched else "call_soon_threadsafe each"
            results[f"worker -> loop, bursts of 16, {name}: loop CPU per result"] = (
                f"{cpu * 1e6:7.2f} us"
            )
        return results  # type: ignore[return-value]

    for what, line in uvloop.run(loop_side()).items():
        print(f"{what}: {line}")
    for how in ("queue", "eventfd"):
        lat, cpu = to_worker(n, how)
        print(
            f"loop -> worker, {how}: {_q(lat)}; worker CPU per empty 50 us wait {cpu * 1e6:.2f} us"
        )
    for how in ("SimpleQueue.get(timeout)", "select on an eventfd", "time.sleep"):
        cpu = statistics.median(empty_wait_cpu(how) for _ in range(5))
        print(f"worker, one empty 50 us wait, {how}: {cpu * 1e6:.2f} us CPU (median of 5)")
    print(f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
