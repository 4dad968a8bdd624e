"""Load: 16 simulated engines, 1,000 live requests, and no leaks across thousands more.

Two real daemons (prefill and decode) and a fleet of 8 prefill and 8 decode
SimEngines, every transfer real NIXL over shared memory and verified byte for
byte by the receiving engine.

* 1,000 requests live at once: registered on both sides without kv_ready,
  held (peers stay up, nothing expires, status and the journal agree), then
  completed.
* Thousands of completed requests after a warm-up: each daemon's RSS
  (VmRSS) stays within a bound and its file descriptors come back to where
  they were. The daemons keep 2,000 tombstones here (the default 100,000
  would legitimately grow for 100,000 requests), so any growth is a leak.
* Closed engines leave nothing behind: their /dev/shm files are unlinked and
  neither daemon maps them any more (/proc/PID/maps), and the descriptors
  are back to the count before the engines came.

``tools/load_soak.py`` runs the same fleet for 100,000+ requests.
``KVPUSHD_LOAD_REQUESTS`` changes the CI count (default 5,000).
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Final

import pytest

from daemon.sim.engine import Expectation, SimEngine, SimGroup, tail_pairs
from schemas import rpc
from schemas.layout import Role
from tests.daemons import Daemon
from tests.test_fuzz import fd_count, mapped_files, rss_kib, start_pair

LAYOUT: Final = (SimGroup(num_blocks=512, block_bytes=512, layers=1),)
ENGINES_PER_SIDE: Final = 8
SRC_BLOCKS, DST_BLOCKS = 4, 2  # per request: a partial prefix-cache hit
TOMBSTONES: Final = 2000
REQUESTS: Final = int(os.environ.get("KVPUSHD_LOAD_REQUESTS", "5000"))
KIB: Final = 1024


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


# ------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Daemon, Daemon]]:
    prefill, decode = start_pair(
        tmp_path_factory.mktemp("load"), extra=f"[limits]\ntombstones = {TOMBSTONES}"
    )
    try:
        yield prefill, decode
    finally:
        assert prefill.stop() == 0, prefill.logs()
        assert decode.stop() == 0, decode.logs()


def live_states(daemon: Daemon) -> dict[str, int]:
    return daemon.status()["by_state"]


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
        still = {d.node: sorted(set(paths) & mapped_files(d.proc.pid)) for d in daemons}
        if not any(still.values()) or time.monotonic() > deadline:
            return {node: files for node, files in still.items() if files}
        await asyncio.sleep(0.05)


# --------------------------------------------------------------------- tests


async def test_a_thousand_live_requests_held_then_completed(pair: tuple[Daemon, Daemon]) -> None:
    from daemon.journal.replay import replay

    prefill, decode = pair
    fleet = await Fleet.create(prefill, decode)
    try:
        t0 = time.monotonic()
        gate = asyncio.Semaphore(64)

        async def register(pair_: EnginePair, rid: str):
            async with gate:
                return pair_, rid, await fleet.register(pair_, rid)

        held = await asyncio.gather(*(register(*fleet.next_request()) for _ in range(1000)))
        registered_s = time.monotonic() - t0
        for daemon in pair:
            assert daemon.status()["live"] == 1000
        # Held: peers stay up, nothing expires, the journal says the same.
        for _ in range(6):
            await asyncio.sleep(0.5)
            for daemon, peer in ((prefill, "decode"), (decode, "prefill")):
                status = daemon.status()
                assert status["live"] == 1000, status["by_state"]
                assert all(p["up"] for p in status["peers"] if p["node"] == peer)
        for daemon in pair:
            replayed = replay(daemon.journal).registry.live.values()
            by_state: dict[str, int] = {}
            for record in replayed:
                by_state[record.state.value] = by_state.get(record.state.value, 0) + 1
            assert by_state == live_states(daemon)
        assert live_states(decode) == {"registered": 1000}
        assert set(live_states(prefill)) <= {"registered", "trimmed"}
        t1 = time.monotonic()
        await asyncio.gather(*(fleet.complete(p, rid, blocks) for p, rid, blocks in held))
        completed_s = time.monotonic() - t1
        for daemon in pair:
            assert daemon.status()["live"] == 0
        print(f"\n1,000 live: registered in {registered_s:.1f} s, completed in {completed_s:.1f} s")
    finally:
        await fleet.close()
    await wait_idle(pair)


async def test_rss_and_fds_flat_over_completed_requests(pair: tuple[Daemon, Daemon]) -> None:
    fleet = await Fleet.create(*pair)
    try:
        # Warm-up: pools, NIXL descriptor caches and the tombstones fill up.
        await fleet.run(max(TOMBSTONES, 1000), concurrency=64)
        samples = [Sample.take(pair, fleet.completed)]
        step = max(REQUESTS // 5, 1)
        t0 = time.monotonic()
        for _ in range(5):
            await fleet.run(step, concurrency=64)
            samples.append(Sample.take(pair, fleet.completed))
        elapsed = time.monotonic() - t0
    finally:
        await fleet.close()
    report = "\n".join(f"{s.completed:>7} done  rss {s.rss}  fds {s.fds}" for s in samples)
    print(f"\n{step * 5} requests in {elapsed:.1f} s ({step * 5 / elapsed:.0f}/s)\n{report}")
    for node in samples[0].rss:
        rss = [s.rss[node] for s in samples]
        assert max(rss) - rss[0] < 12 * KIB, f"{node} RSS grew:\n{report}"
        fds = {s.fds[node] for s in samples}
        assert len(fds) == 1, f"{node} descriptors changed while busy:\n{report}"


async def test_closed_engines_leave_no_shared_memory_behind(pair: tuple[Daemon, Daemon]) -> None:
    await wait_idle(pair)
    before = Sample.take(pair, 0)
    fleet = await Fleet.create(*pair)
    paths = fleet.shm_paths
    try:
        await fleet.run(200, concurrency=32)
        for daemon in pair:
            assert set(paths) & mapped_files(daemon.proc.pid), "engines were never mapped?"
    finally:
        await fleet.close()
    assert not [p for p in paths if os.path.exists(p)], "an engine left its /dev/shm file"
    await wait_idle(pair)  # the daemons detached every engine
    still = await wait_unmapped(pair, paths)
    assert not still, f"closed engines' files still mapped: {still}"
    after = Sample.take(pair, 0)
    assert after.fds == before.fds, (before, after)
    # Each daemon tells its peer its engines left: neither keeps them.
    deadline = time.monotonic() + 10.0
    while kept := {
        d.node: d.status()["peer_engines"] for d in pair if any(d.status()["peer_engines"].values())
    }:
        assert time.monotonic() < deadline, f"peers' departed engines still known: {kept}"
        await asyncio.sleep(0.05)
