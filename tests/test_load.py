"""Load: 16 simulated engines, 1,000 live requests, and no leaks across thousands more.

Two real daemons (prefill and decode) and a fleet (harness/loadfleet.py) of
8 prefill and 8 decode SimEngines, every transfer real NIXL over shared memory
and verified byte for byte by the receiving engine.

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
from collections.abc import Iterator
from typing import Final

import pytest

from daemon.sim.launcher import Daemon, mapped_files, start_pair
from harness.loadfleet import EnginePair, Fleet, Sample, wait_idle, wait_unmapped
from tests.support.fixtures import stop_cleanly

TOMBSTONES: Final = 2000
REQUESTS: Final = int(os.environ.get("KVPUSHD_LOAD_REQUESTS", "5000"))
KIB: Final = 1024


# ------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Daemon, Daemon]]:
    prefill, decode = start_pair(
        tmp_path_factory.mktemp("load"), extra=f"[limits]\ntombstones = {TOMBSTONES}"
    )
    try:
        yield prefill, decode
    finally:
        stop_cleanly(prefill, decode)


def live_states(daemon: Daemon) -> dict[str, int]:
    return daemon.status()["by_state"]


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
