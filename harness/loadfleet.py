"""A load fleet: simulated engines in pairs pushing verified requests through two daemons.

Shared by tests/test_load.py and ``tools/load_soak.py``. A :class:`Fleet`
holds 8 prefill and 8 decode SimEngines (by default), paired; every request
registers on both sides, pushes real bytes (NIXL over shared memory), is
verified byte for byte by the receiving engine, and is released on both
sides. :class:`Sample` reads both daemons' RSS and open descriptors; the
waits tell when the daemons are idle and no longer map departed engines.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from typing import Final

from daemon.sim.engine import Expectation, SimEngine, SimGroup, tail_pairs
from daemon.sim.launcher import Daemon, fd_count, mapped_files, rss_kib
from schemas import rpc
from schemas.layout import Role

LAYOUT: Final = (SimGroup(num_blocks=512, block_bytes=512, layers=1),)
ENGINES_PER_SIDE: Final = 8
SRC_BLOCKS, DST_BLOCKS = 4, 2  # per request: a partial prefix-cache hit

# ------------------------------------------------------------------ samples


@dataclass(frozen=True)
class Sample:
    """One look at both daemons."""

    at: float
    completed: int
    rss: dict[str, int]
    fds: dict[str, int]

    @classmethod
    def take(cls, daemons: tuple[Daemon, ...], completed: int) -> Sample:
        pids = {d.node: d.proc.pid for d in daemons if d.proc is not None}
        return cls(
            time.monotonic(),
            completed,
            {n: rss_kib(p) for n, p in pids.items()},
            {n: fd_count(p) for n, p in pids.items()},
        )


# --------------------------------------------------------------------- fleet


class Blocks:
    """Free block ids of one engine: a request takes some and gives them back."""

    def __init__(self, n: int) -> None:
        self._free = list(range(n))

    def take(self, n: int) -> list[int]:
        if len(self._free) < n:
            raise AssertionError("engine out of blocks: too many requests in flight")
        taken, self._free = self._free[:n], self._free[n:]
        return taken

    def give(self, ids: list[int]) -> None:
        self._free.extend(ids)


@dataclass
class EnginePair:
    pusher: SimEngine
    receiver: SimEngine
    src: Blocks = field(default_factory=lambda: Blocks(LAYOUT[0].num_blocks))
    dst: Blocks = field(default_factory=lambda: Blocks(LAYOUT[0].num_blocks))


class Fleet:
    """8 prefill and 8 decode engines, paired; runs verified requests through them."""

    def __init__(self, pairs: list[EnginePair]) -> None:
        self.pairs = pairs
        self.completed = 0
        self._serial = 0
        self._tag = uuid.uuid4().hex[:6]  # request ids never repeat across fleets

    @classmethod
    async def create(cls, prefill: Daemon, decode: Daemon, n: int = ENGINES_PER_SIDE) -> Fleet:
        tag = uuid.uuid4().hex[:6]
        created: list[SimEngine] = []
        try:
            for k in range(n):
                for role, daemon in ((Role.PUSHER, prefill), (Role.RECEIVER, decode)):
                    name = f"l{role.value[0]}{k}-{tag}"
                    created.append(await SimEngine.create(name, role, LAYOUT, daemon.socket))
        except BaseException:
            for engine in created:
                await engine.close()
            raise
        return cls([EnginePair(p, r) for p, r in zip(created[::2], created[1::2], strict=True)])

    @property
    def engines(self) -> list[SimEngine]:
        return [e for p in self.pairs for e in (p.pusher, p.receiver)]

    @property
    def shm_paths(self) -> list[str]:
        return [path for e in self.engines for path in e.shm_paths]

    def next_request(self) -> tuple[EnginePair, str]:
        self._serial += 1
        return self.pairs[self._serial % len(self.pairs)], f"{self._tag}-{self._serial}"

    async def register(self, pair: EnginePair, rid: str) -> tuple[list[int], list[int]]:
        """Both sides registered, no kv_ready yet; returns the blocks it holds."""
        src, dst = pair.src.take(SRC_BLOCKS), pair.dst.take(DST_BLOCKS)
        pairs = tail_pairs(pair.pusher.layout, [src], pair.receiver.layout, [dst])
        expect = Expectation(pair.pusher.engine_id, pairs)
        await pair.receiver.decode_register(rid, [dst], "prefill", expect=expect)
        await pair.pusher.prefill(rid, [src], kv_ready=False)
        return src, dst

    async def complete(self, pair: EnginePair, rid: str, blocks: tuple[list[int], list[int]]):
        """kv_ready, both outcomes verified, both sides released, blocks given back."""
        await pair.pusher.kv_ready(rid)
        arrived = await pair.receiver.wait_event(rid, (rpc.KvArrived, rpc.RequestFailed))
        freed = await pair.pusher.wait_event(rid, (rpc.BlocksFreeable, rpc.RequestFailed))
        assert isinstance(arrived, rpc.KvArrived), arrived
        assert isinstance(freed, rpc.BlocksFreeable), freed
        for engine in (pair.receiver, pair.pusher):
            report = engine.reports[(rid, 1)]
            assert report.ok, report.problems()
        await pair.receiver.release(rid)
        await pair.pusher.release(rid)
        # The engines' own bookkeeping would otherwise grow with every request.
        for engine in (pair.receiver, pair.pusher):
            engine._live.pop((rid, 1), None)
            engine.reports.pop((rid, 1), None)
        pair.src.give(blocks[0])
        pair.dst.give(blocks[1])
        self.completed += 1

    async def run(self, n: int, concurrency: int) -> None:
        """``n`` requests start to end, ``concurrency`` at a time."""
        gate = asyncio.Semaphore(concurrency)

        async def one() -> None:
            async with gate:
                pair, rid = self.next_request()
                await self.complete(pair, rid, await self.register(pair, rid))

        await asyncio.gather(*(one() for _ in range(n)))

    async def close(self) -> None:
        for engine in self.engines:
            await engine.close()


# ---------------------------------------------------------------------- waits


async def wait_idle(daemons: tuple[Daemon, ...], timeout: float = 30.0) -> None:
    """Until no request is live, no engine is attached and the journal is synced, on both.

    A sync in flight holds a duplicate of the segment's descriptor: waiting
    for it keeps descriptor counts comparable.
    """
    deadline = time.monotonic() + timeout
    while True:
        statuses = [d.status() for d in daemons]
        if all(s["live"] == 0 and not s["engines"] and not s["journal"]["lag"] for s in statuses):
            return
        if time.monotonic() > deadline:
            raise AssertionError([(s["live"], sorted(s["engines"])) for s in statuses])
        await asyncio.sleep(0.05)


async def wait_unmapped(
    daemons: tuple[Daemon, ...], paths: list[str], timeout: float = 20.0
) -> dict[str, list[str]]:
    """Until no daemon maps any of ``paths``; returns what is still mapped at the timeout.

    A detached engine leaves status at once; its memory is unmapped right
    after, once the data plane has deregistered it (on its own thread).
    """
    deadline = time.monotonic() + timeout
    while True:
        still = {d.node: sorted(set(paths) & mapped_files(_pid(d))) for d in daemons}
        if not any(still.values()) or time.monotonic() > deadline:
            return {node: files for node, files in still.items() if files}
        await asyncio.sleep(0.05)


def _pid(daemon: Daemon) -> int:
    assert daemon.proc is not None, f"{daemon.node} was never started"
    return daemon.proc.pid
