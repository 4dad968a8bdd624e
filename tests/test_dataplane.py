"""Tests of the NIXL data plane (daemon/dataplane/): real NIXL, real /dev/shm, no mocks."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field

import msgspec
import numpy as np
import pytest

from daemon.dataplane import worker as worker_mod
from daemon.dataplane.geometry import EngineGeometry, build_indices
from daemon.dataplane.memory import SHM_ROOT, MappedRegion, create_shm_file, map_dram_region
from daemon.dataplane.plane import DataPlane, DataPlaneError, TransferError, WriteResult
from schemas.events import Blocks
from schemas.kvlayout import (
    EngineSpec,
    GroupSpec,
    LayerSpec,
    RegionSpec,
    RemoteEngine,
    RemoteGroup,
)
from schemas.layout import GroupKind

NUM_BLOCKS = 512
LAYERS = 3
# (block_bytes, first layer offset, gap between layers): group 1 has gaps, so
# a wrong offset computation would show up as bytes in the wrong place.
GROUPS = ((2048, 0, 0), (1024, 4096, 4096))
PARTIAL_SRC: Blocks = ((13, 14), (13, 14))
PARTIAL_DST: Blocks = ((500, 501), (500, 501))
NOTIF_TIMEOUT_S = 10.0


# --------------------------------------------------------------------------
# engines over real shared memory


@dataclass
class Engine:
    spec: EngineSpec
    regions: dict[str, MappedRegion]
    paths: list[str] = field(default_factory=list)

    def block(self, g: int, layer: int, b: int) -> np.ndarray:
        group = self.spec.groups[g]
        ls = group.layers[layer]
        start = ls.offset + b * group.block_bytes
        return self.regions[ls.region].view()[start : start + group.block_bytes]

    def snapshot(self) -> dict[str, np.ndarray]:
        return {name: r.view().copy() for name, r in self.regions.items()}

    def close(self) -> None:
        for region in self.regions.values():
            region.close()
        for path in self.paths:
            os.unlink(path)


def engine_spec(engine_id: str, groups: tuple[tuple[int, int, int], ...] = GROUPS) -> EngineSpec:
    """Spec with one shm file per group; files get created by ``make_engine``."""
    tag = uuid.uuid4().hex[:10]
    regions, gspecs = [], []
    for g, (bb, first, gap) in enumerate(groups):
        name = f"kvpushd-test-{engine_id}-{tag}-g{g}"
        span = NUM_BLOCKS * bb
        size = first + LAYERS * (span + gap)
        regions.append(RegionSpec(name, size, path=os.path.join(SHM_ROOT, name)))
        layers = tuple(LayerSpec(name, first + layer * (span + gap)) for layer in range(LAYERS))
        gspecs.append(GroupSpec(GroupKind.ATTENTION, NUM_BLOCKS, bb, layers))
    return EngineSpec(engine_id, tuple(gspecs), tuple(regions))


def make_engine(engine_id: str, groups: tuple[tuple[int, int, int], ...] = GROUPS) -> Engine:
    spec = engine_spec(engine_id, groups)
    for r in spec.regions:
        create_shm_file(r.path, r.size)
    regions = {r.name: map_dram_region(r, owner_uid=os.getuid()) for r in spec.regions}
    return Engine(spec, regions, [r.path for r in spec.regions])


def fill_pattern(engine: Engine) -> None:
    """Every (group, layer, block) gets its own byte pattern."""
    for g, group in enumerate(engine.spec.groups):
        nb, bb = group.num_blocks, group.block_bytes
        for layer in range(len(group.layers)):
            pattern = (
                np.arange(nb)[:, None] * 3 + np.arange(bb)[None, :] * 7 + g * 131 + layer * 17
            ) % 251
            ls = group.layers[layer]
            view = engine.regions[ls.region].view()
            view[ls.offset : ls.offset + nb * bb] = pattern.astype(np.uint8).ravel()


def fill_noise(engine: Engine, seed: int) -> None:
    rng = np.random.default_rng(seed)
    for region in engine.regions.values():
        region.view()[:] = rng.integers(0, 256, region.size, dtype=np.uint8)


def expected_after(
    src: Engine, dst: Engine, before: dict[str, np.ndarray], s: Blocks, d: Blocks
) -> dict[str, np.ndarray]:
    expected = {name: arr.copy() for name, arr in before.items()}
    for g, group in enumerate(dst.spec.groups):
        bb = group.block_bytes
        for layer, ls in enumerate(group.layers):
            for sb, db in zip(s[g], d[g], strict=True):
                start = ls.offset + db * bb
                expected[ls.region][start : start + bb] = src.block(g, layer, sb)
    return expected


def assert_regions_equal(dst: Engine, expected: dict[str, np.ndarray]) -> None:
    for name, region in dst.regions.items():
        diff = np.flatnonzero(region.view() != expected[name])
        assert diff.size == 0, f"region {name}: {diff.size} bytes differ, first at {diff[:4]}"


@pytest.fixture
def engines() -> Iterator[Callable[..., Engine]]:
    made: list[Engine] = []

    def make(engine_id: str, groups: tuple[tuple[int, int, int], ...] = GROUPS) -> Engine:
        engine = make_engine(engine_id, groups)
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.close()


# --------------------------------------------------------------------------
# data planes


@dataclass
class Pair:
    pusher: DataPlane
    receiver: DataPlane
    src: Engine
    dst: Engine
    notifs: asyncio.Queue[tuple[str, bytes, int]]


def _unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


async def connect_pair(
    engines: Callable[..., Engine], *, receiver_idle_progress_s: float | None = 0.1
) -> Pair:
    pusher = DataPlane(_unique("push"))
    receiver = DataPlane(_unique("recv"), idle_progress_s=receiver_idle_progress_s)
    await pusher.start()
    await receiver.start()
    src, dst = engines("pre"), engines("dec")
    notifs: asyncio.Queue[tuple[str, bytes, int]] = asyncio.Queue()
    receiver.set_notification_handler(
        lambda agent, msg: notifs.put_nowait((agent, msg, threading.get_ident()))
    )
    await pusher.add_local_engine(src.spec, src.regions)
    remote = await receiver.add_local_engine(dst.spec, dst.regions)
    # Metadata is taken after the engine registered: it carries the registration.
    name = await pusher.add_remote_agent(await receiver.metadata())
    assert name == receiver.agent_name
    await pusher.add_remote_engine(name, remote)
    return Pair(pusher, receiver, src, dst, notifs)


@pytest.fixture
async def pair_factory(
    engines: Callable[..., Engine],
) -> AsyncIterator[Callable[..., Awaitable[Pair]]]:
    pairs: list[Pair] = []

    async def make(**kwargs: float | None) -> Pair:
        p = await connect_pair(engines, **kwargs)
        pairs.append(p)
        return p

    yield make
    for p in pairs:
        await p.pusher.close()
        await p.receiver.close()


@pytest.fixture
async def pair(pair_factory: Callable[..., Awaitable[Pair]]) -> Pair:
    return await pair_factory()


async def push(p: Pair, src: Blocks, dst: Blocks, notif: bytes) -> WriteResult:
    return await p.pusher.write(
        p.src.spec.engine_id, p.receiver.agent_name, p.dst.spec.engine_id, src, dst, notif
    )


# --------------------------------------------------------------------------
# writes


async def test_partial_hit_write_lands_exactly_in_destination_blocks(pair: Pair) -> None:
    fill_pattern(pair.src)
    fill_noise(pair.dst, seed=1)
    src_before, before = pair.src.snapshot(), pair.dst.snapshot()
    pair.receiver.expect_notifications(True)

    result = await push(pair, PARTIAL_SRC, PARTIAL_DST, b"req-7:1")

    assert result.nbytes == LAYERS * 2 * (2048 + 1024)
    assert result.descriptors == 2 * LAYERS * 2
    assert_regions_equal(
        pair.dst, expected_after(pair.src, pair.dst, before, PARTIAL_SRC, PARTIAL_DST)
    )
    assert_regions_equal(pair.src, src_before)  # a WRITE leaves its source alone
    agent, msg, thread_id = await asyncio.wait_for(pair.notifs.get(), NOTIF_TIMEOUT_S)
    # Notifications are keyed by the sender's agent name (a str) and run on the loop thread.
    assert (agent, msg) == (pair.pusher.agent_name, b"req-7:1")
    assert thread_id == threading.get_ident()
    assert (pair.pusher.writes, pair.pusher.bytes_written) == (1, result.nbytes)
    assert pair.receiver.notifications == 1


async def test_write_with_one_group_fully_hit_writes_only_the_other(pair: Pair) -> None:
    fill_pattern(pair.src)
    fill_noise(pair.dst, seed=2)
    before = pair.dst.snapshot()
    pair.receiver.expect_notifications(True)
    src: Blocks = ((), (5, 6, 7, 40))
    dst: Blocks = ((), (0, 1, 2, 511))
    result = await push(pair, src, dst, b"r2")
    assert result.nbytes == LAYERS * 4 * 1024
    assert_regions_equal(pair.dst, expected_after(pair.src, pair.dst, before, src, dst))
    assert (await asyncio.wait_for(pair.notifs.get(), NOTIF_TIMEOUT_S))[1] == b"r2"


async def test_zero_block_write_posts_nothing(pair: Pair) -> None:
    fill_noise(pair.dst, seed=3)
    before = pair.dst.snapshot()
    pair.receiver.expect_notifications(True)
    result = await push(pair, ((), ()), ((), ()), b"full-hit")
    assert (result.nbytes, result.descriptors) == (0, 0)
    assert pair.pusher.writes == 0
    await asyncio.sleep(0.3)
    assert pair.notifs.empty()  # no WRITE, so no notification either
    assert_regions_equal(pair.dst, before)


async def test_concurrent_writes_each_land_and_notify(pair: Pair) -> None:
    fill_pattern(pair.src)
    fill_noise(pair.dst, seed=6)
    before = pair.dst.snapshot()
    pair.receiver.expect_notifications(True)
    # (src g0, dst g0, src g1, dst g1) per request; no destination shared.
    pairs = [((i,), (100 + i,), (200 + i, 250 + i), (300 + i, 400 + i)) for i in range(40)]
    results = await asyncio.gather(
        *(push(pair, (s0, s1), (d0, d1), b"c%d" % i) for i, (s0, d0, s1, d1) in enumerate(pairs))
    )
    assert all(r.nbytes == LAYERS * (2048 + 2 * 1024) for r in results)
    src: Blocks = (tuple(x[0][0] for x in pairs), tuple(b for x in pairs for b in x[2]))
    dst: Blocks = (tuple(x[1][0] for x in pairs), tuple(b for x in pairs for b in x[3]))
    assert_regions_equal(pair.dst, expected_after(pair.src, pair.dst, before, src, dst))
    seen = set()
    while len(seen) < len(pairs):
        seen.add((await asyncio.wait_for(pair.notifs.get(), NOTIF_TIMEOUT_S))[1])
    assert seen == {b"c%d" % i for i in range(len(pairs))}
    assert pair.pusher.writes == len(pairs)


async def test_results_finished_while_the_loop_is_busy_arrive_with_one_wake_up(
    pair: Pair,
) -> None:
    """The worker wakes the loop once for every result waiting in its outbox, in order."""
    fill_pattern(pair.src)
    fill_noise(pair.dst, seed=8)
    before = pair.dst.snapshot()
    pair.receiver.expect_notifications(True)
    worker = pair.pusher._worker
    assert worker is not None
    n = 16
    src: Blocks = (tuple(range(n)), ())
    dst: Blocks = (tuple(range(100, 100 + n)), ())
    tasks = [
        asyncio.ensure_future(push(pair, ((i,), ()), ((100 + i,), ()), b"b%d" % i))
        for i in range(n)
    ]
    await asyncio.sleep(0)  # each task posts its write and awaits it
    wakes, delivered = worker.loop_wakes, worker.delivered
    # Hold the loop thread until the worker has finished every write: its
    # first result schedules one wake-up, and the rest must ride on it.
    deadline = time.monotonic() + NOTIF_TIMEOUT_S
    while len(worker._outbox) < n and time.monotonic() < deadline:
        time.sleep(0.001)
    assert len(worker._outbox) == n
    finished = [entry[0] for entry in worker._outbox]  # the write futures, as the worker ended them
    settled: list[int] = []
    for i, fut in enumerate(finished):
        fut.add_done_callback(lambda _, i=i: settled.append(i))
    results = await asyncio.gather(*tasks)
    assert worker.loop_wakes - wakes <= 1
    assert worker.delivered - delivered == n
    assert settled == list(range(n))  # settled in the order the worker ended them
    assert all(r.nbytes == LAYERS * 2048 for r in results)
    assert_regions_equal(pair.dst, expected_after(pair.src, pair.dst, before, src, dst))


async def test_a_receiver_that_hears_nothing_polls_less_often_a_pusher_never_does(
    pair_factory: Callable[..., Awaitable[Pair]],
) -> None:
    p = await pair_factory(receiver_idle_progress_s=None)
    receiver, pusher = p.receiver._worker, p.pusher._worker
    assert receiver is not None and pusher is not None
    base = p.receiver.poll_interval_s
    assert receiver._wait_s() is None  # idle, and told never to progress when idle
    # A write to a receiver that does not progress stays in flight: the
    # pusher polls at the full rate however long nothing happens.
    task = asyncio.create_task(push(p, PARTIAL_SRC, PARTIAL_DST, b"slow"))
    await wait_for_state(lambda: bool(pusher.st.inflight), "the write is in flight")
    await wait_for_state(lambda: pusher._empty_rounds > 40, "the pusher polled a while")
    assert pusher._wait_s() == p.pusher.poll_interval_s
    # The receiver now expects data but hears nothing: it backs off to 4x.
    p.receiver.expect_notifications(True)
    await wait_for_state(lambda: receiver._empty_rounds > 40, "the receiver polled a while")
    assert receiver._wait_s() == base * 2**worker_mod.EXPECT_BACKOFF_STEPS
    # ... and still sees the write, which completes.
    assert (await task).nbytes > 0
    assert (await asyncio.wait_for(p.notifs.get(), NOTIF_TIMEOUT_S))[1] == b"slow"


async def wait_for_state(check: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + NOTIF_TIMEOUT_S
    while not check():
        assert time.monotonic() < deadline, f"never: {what}"
        await asyncio.sleep(0.005)


@pytest.mark.parametrize(
    ("src", "dst", "code"),
    [
        (((13, 14),), ((500, 501),), "mismatch"),  # one group instead of two
        (((13, 14), (1,)), ((500, 501), (2, 3)), "mismatch"),  # counts differ in a group
        (((13, 14), ()), ((500, 512), ()), "bad_blocks"),  # destination out of range
        (((13, -1), ()), ((500, 501), ()), "bad_blocks"),  # negative source
        (((13, 14), ()), ((500, 500), ()), "bad_blocks"),  # one destination twice
    ],
)
async def test_bad_writes_raise_before_posting(
    pair: Pair, src: Blocks, dst: Blocks, code: str
) -> None:
    fill_noise(pair.dst, seed=4)
    before = pair.dst.snapshot()
    pair.receiver.expect_notifications(True)
    with pytest.raises(DataPlaneError) as info:
        await push(pair, src, dst, b"bad")
    assert info.value.code == code
    await asyncio.sleep(0.1)
    assert pair.notifs.empty()
    assert_regions_equal(pair.dst, before)
    assert pair.pusher.writes == pair.pusher.write_errors == 0


async def test_unknown_targets_and_incompatible_layout_are_refused(
    pair: Pair, engines: Callable[..., Engine]
) -> None:
    p = pair
    src, dst = p.src.spec.engine_id, p.dst.spec.engine_id
    cases = [
        (("nope", p.receiver.agent_name, dst), "unknown_engine"),
        ((src, "nobody", dst), "unknown_agent"),
        ((src, p.receiver.agent_name, "nope"), "unknown_engine"),
    ]
    for args, code in cases:
        with pytest.raises(DataPlaneError) as info:
            await p.pusher.write(*args, PARTIAL_SRC, PARTIAL_DST, b"x")
        assert info.value.code == code
    # A receiver engine whose group 1 has another block size: refused per write.
    odd = engines("odd", ((2048, 0, 0), (512, 0, 0)))
    remote = await p.receiver.add_local_engine(odd.spec, odd.regions)
    await p.pusher.add_remote_agent(await p.receiver.metadata())
    await p.pusher.add_remote_engine(p.receiver.agent_name, remote)
    with pytest.raises(DataPlaneError) as info:
        await p.pusher.write(src, p.receiver.agent_name, "odd", PARTIAL_SRC, PARTIAL_DST, b"x")
    assert info.value.code == "mismatch"


async def test_add_local_engine_validates_layout(
    engines: Callable[..., Engine],
) -> None:
    dp = DataPlane(_unique("v"))
    await dp.start()
    try:
        eng = engines("e")
        group = eng.spec.groups[0]
        region = eng.spec.regions[0]
        too_far = LayerSpec(region.name, region.size - group.block_bytes * group.num_blocks + 1)
        bad_specs = [
            msgspec.structs.replace(
                eng.spec,
                groups=(msgspec.structs.replace(group, layers=(too_far,)), eng.spec.groups[1]),
            ),
            msgspec.structs.replace(
                eng.spec,
                groups=(
                    msgspec.structs.replace(group, layers=(LayerSpec("missing"),)),
                    eng.spec.groups[1],
                ),
            ),
            # Head slices: blocks that overlap, and a stride that runs past the region.
            msgspec.structs.replace(
                eng.spec,
                groups=(
                    msgspec.structs.replace(group, block_stride=group.block_bytes - 1),
                    eng.spec.groups[1],
                ),
            ),
            msgspec.structs.replace(
                eng.spec,
                groups=(
                    msgspec.structs.replace(group, block_stride=region.size),
                    eng.spec.groups[1],
                ),
            ),
        ]
        for spec in bad_specs:
            with pytest.raises(DataPlaneError) as info:
                await dp.add_local_engine(spec, eng.regions)
            assert info.value.code == "bad_layout"
        with pytest.raises(DataPlaneError):
            await dp.add_local_engine(eng.spec, {})  # regions not mapped
        await dp.add_local_engine(eng.spec, eng.regions)
        with pytest.raises(DataPlaneError) as info:
            await dp.add_local_engine(eng.spec, eng.regions)
        assert info.value.code == "duplicate"
        assert await dp.remove_local_engine("e") == 0
        with pytest.raises(DataPlaneError):
            await dp.remove_local_engine("e")
    finally:
        await dp.close()


async def test_remote_engine_needs_metadata_taken_after_its_registration(
    pair: Pair, engines: Callable[..., Engine]
) -> None:
    late = engines("late")
    remote = await pair.receiver.add_local_engine(late.spec, late.regions)
    # The pusher still holds the receiver's metadata from before "late" existed.
    with pytest.raises(DataPlaneError, match="metadata"):
        await pair.pusher.add_remote_engine(pair.receiver.agent_name, remote)
    # Loading newer metadata for a known agent updates it.
    await pair.pusher.add_remote_agent(await pair.receiver.metadata())
    await pair.pusher.add_remote_engine(pair.receiver.agent_name, remote)
    # The same engine again (a reconnect) is a no-op; another layout under its id is not.
    await pair.pusher.add_remote_engine(pair.receiver.agent_name, remote)
    changed = msgspec.structs.replace(remote, groups=remote.groups[:1])
    with pytest.raises(DataPlaneError) as info:
        await pair.pusher.add_remote_engine(pair.receiver.agent_name, changed)
    assert info.value.code == "duplicate"
    pair.receiver.expect_notifications(True)
    fill_pattern(pair.src)
    result = await pair.pusher.write(
        "pre", pair.receiver.agent_name, "late", PARTIAL_SRC, PARTIAL_DST, b"l"
    )
    assert result.nbytes > 0
    assert np.array_equal(late.block(1, 2, 501), pair.src.block(1, 2, 14))


# --------------------------------------------------------------------------
# writes in flight: a receiver that never progressed holds the pusher's first
# notified WRITE in PROC (the connection wire-up waits for its progress).


async def test_cancelling_a_write_aborts_it_before_the_cancel_completes(
    pair_factory: Callable[..., Awaitable[Pair]],
) -> None:
    p = await pair_factory(receiver_idle_progress_s=None)
    task = asyncio.create_task(push(p, PARTIAL_SRC, PARTIAL_DST, b"doomed"))
    await asyncio.sleep(0.3)
    assert not task.done(), "the write completed although the receiver never progressed"
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert p.pusher.writes_cancelled == 1
    assert p.pusher._worker is not None and not p.pusher._worker.st.inflight
    # The pair still works afterwards.
    p.receiver.expect_notifications(True)
    result = await push(p, PARTIAL_SRC, PARTIAL_DST, b"after")
    assert result.nbytes > 0 and p.pusher.writes == 1
    while (await asyncio.wait_for(p.notifs.get(), NOTIF_TIMEOUT_S))[1] != b"after":
        pass  # the cancelled write's notification is dropped; tolerate it arriving


async def test_a_posted_write_nobody_finishes_is_stopped_once_and_the_pair_works_on(
    pair_factory: Callable[..., Awaitable[Pair]],
) -> None:
    # Posted without a task (Transfers posts an unchecked request's WRITE in
    # kv_ready's own call): whoever gives up on it stops it, and a stop that
    # comes twice, or after its result, changes nothing.
    p = await pair_factory(receiver_idle_progress_s=None)
    ids = (p.src.spec.engine_id, p.receiver.agent_name, p.dst.spec.engine_id)
    posted = p.pusher.post(*ids, PARTIAL_SRC, PARTIAL_DST, b"doomed")
    await asyncio.sleep(0.3)
    assert posted.fut is not None and not posted.fut.done()
    await p.pusher.stop(posted)
    assert p.pusher.writes_cancelled == 1
    assert p.pusher._worker is not None and not p.pusher._worker.st.inflight
    await p.pusher.stop(posted)
    assert p.pusher.writes_cancelled == 1
    p.receiver.expect_notifications(True)
    after = p.pusher.post(*ids, PARTIAL_SRC, PARTIAL_DST, b"after")
    result = await p.pusher.finish(after)
    assert result.nbytes > 0 and p.pusher.writes == 1
    await p.pusher.stop(after)
    assert p.pusher.writes_cancelled == 1
    nothing = p.pusher.post(*ids, ((), ()), ((), ()), b"nothing")
    assert nothing.fut is None and (await p.pusher.finish(nothing)).nbytes == 0
    while (await asyncio.wait_for(p.notifs.get(), NOTIF_TIMEOUT_S))[1] != b"after":
        pass  # the stopped write's notification is dropped; tolerate it arriving


async def test_removing_the_remote_agent_fences_writes_in_flight(
    pair_factory: Callable[..., Awaitable[Pair]],
) -> None:
    p = await pair_factory(receiver_idle_progress_s=None)
    task = asyncio.create_task(push(p, PARTIAL_SRC, PARTIAL_DST, b"fenced"))
    await asyncio.sleep(0.3)
    assert not task.done()
    assert await p.pusher.remove_remote_agent(p.receiver.agent_name) == 1
    with pytest.raises(TransferError) as info:
        await task
    assert info.value.code == "fenced"
    assert p.pusher.write_errors == 1
    with pytest.raises(DataPlaneError) as info2:
        await push(p, PARTIAL_SRC, PARTIAL_DST, b"after")
    assert info2.value.code == "unknown_agent"


# --------------------------------------------------------------------------
# windows: each peer writes through its own mapping, revocable alone


async def test_a_revoked_window_sinks_stale_writes_and_spares_other_peers(
    engines: Callable[..., Engine],
) -> None:
    # Two pushers ("peers") hold descriptors for one receiver engine, each
    # through its own window. Revoking p1's windows (what fencing p1 does)
    # must keep p1's next write, posted with its stale descriptor list, from
    # changing a byte of the engine (it lands in the window's private sink),
    # while p2 keeps writing.
    src, dst = engines("pre"), engines("dec")
    fill_pattern(src)
    fill_noise(dst, seed=3)
    receiver = DataPlane(_unique("recv"))
    pushers = {peer: DataPlane(_unique(peer)) for peer in ("p1", "p2")}
    try:
        await receiver.start()
        own = await receiver.add_local_engine(dst.spec, dst.regions)
        views = {peer: await receiver.open_windows(peer, dst.spec, dst.regions) for peer in pushers}
        metadata = await receiver.metadata()
        for peer, pusher in pushers.items():
            assert views[peer].groups != own.groups  # never the engine's own addresses
            await pusher.start()
            await pusher.add_local_engine(src.spec, src.regions)
            await pusher.add_remote_agent(metadata)
            await pusher.add_remote_engine(receiver.agent_name, views[peer])

        async def write(peer: str, s: Blocks, d: Blocks) -> WriteResult:
            pusher = pushers[peer]
            return await pusher.write("pre", receiver.agent_name, "dec", s, d, b"")

        before = dst.snapshot()
        await write("p1", PARTIAL_SRC, PARTIAL_DST)
        expected = expected_after(src, dst, before, PARTIAL_SRC, PARTIAL_DST)
        assert_regions_equal(dst, expected)  # a window shows the engine's own pages

        assert await receiver.revoke_windows("p1") == len(dst.spec.regions)
        fill_noise(dst, seed=4)  # the blocks change hands: new contents
        after_revoke = dst.snapshot()
        await write("p1", PARTIAL_SRC, PARTIAL_DST)  # swallowed by the sink
        assert_regions_equal(dst, after_revoke)

        other: Blocks = ((20, 21), (20, 21))
        await write("p2", PARTIAL_SRC, other)
        assert_regions_equal(dst, expected_after(src, dst, after_revoke, PARTIAL_SRC, other))
        assert await receiver.drop_revoked("p1") == len(dst.spec.regions)
    finally:
        for pusher in pushers.values():
            await pusher.close()
        await receiver.close()


# --------------------------------------------------------------------------
# across processes: the receiver is its own process with its own mapping


async def _receiver_main(conn, spec_bytes: bytes) -> None:
    spec = msgspec.msgpack.decode(spec_bytes, type=EngineSpec)
    loop = asyncio.get_running_loop()
    regions = {r.name: map_dram_region(r, owner_uid=os.getuid()) for r in spec.regions}
    dp = DataPlane(f"recv-proc-{os.getpid()}")
    await dp.start()
    got: asyncio.Future[tuple[str, bytes]] = loop.create_future()
    dp.set_notification_handler(lambda a, m: got.done() or got.set_result((a, m)))
    remote = await dp.add_local_engine(spec, regions)
    dp.expect_notifications(True)
    conn.send_bytes(msgspec.msgpack.encode((await dp.metadata(), remote)))
    conn.send_bytes(msgspec.msgpack.encode(await asyncio.wait_for(got, 60)))
    # Stay up until the parent kills this process: it tests peer death.
    with contextlib.suppress(EOFError):
        await loop.run_in_executor(None, conn.recv_bytes)
    await dp.close()
    for region in regions.values():
        region.close()


def receiver_process(conn, spec_bytes: bytes) -> None:
    asyncio.run(_receiver_main(conn, spec_bytes))


async def test_cross_process_write_then_peer_death(engines: Callable[..., Engine]) -> None:
    src, dst = engines("pre"), engines("dec")  # this process owns both files
    fill_pattern(src)
    fill_noise(dst, seed=5)
    before = dst.snapshot()
    ctx = multiprocessing.get_context("spawn")
    parent_conn, child_conn = ctx.Pipe()
    proc = ctx.Process(target=receiver_process, args=(child_conn, msgspec.msgpack.encode(dst.spec)))
    proc.start()
    loop = asyncio.get_running_loop()
    pusher = DataPlane(_unique("push"))
    try:
        await pusher.start()
        await pusher.add_local_engine(src.spec, src.regions)
        raw = await asyncio.wait_for(loop.run_in_executor(None, parent_conn.recv_bytes), 60)
        metadata, remote = msgspec.msgpack.decode(raw, type=tuple[bytes, RemoteEngine])
        name = await pusher.add_remote_agent(metadata)
        await pusher.add_remote_engine(name, remote)
        result = await pusher.write("pre", name, "dec", PARTIAL_SRC, PARTIAL_DST, b"xproc")
        assert result.nbytes == LAYERS * 2 * (2048 + 1024)
        raw = await asyncio.wait_for(loop.run_in_executor(None, parent_conn.recv_bytes), 60)
        assert msgspec.msgpack.decode(raw, type=tuple[str, bytes]) == (pusher.agent_name, b"xproc")
        # This process's own mapping of the receiver's file shows the bytes.
        assert_regions_equal(dst, expected_after(src, dst, before, PARTIAL_SRC, PARTIAL_DST))
        # Peer death: the next write fails fast instead of hanging.
        proc.kill()
        await loop.run_in_executor(None, proc.join, 30)
        with pytest.raises(TransferError) as info:
            for _ in range(50):
                await pusher.write("pre", name, "dec", PARTIAL_SRC, PARTIAL_DST, b"dead")
                await asyncio.sleep(0.1)
        assert info.value.code == "peer_disconnected"
        assert await pusher.remove_remote_agent(name) == 0
    finally:
        await pusher.close()
        if proc.is_alive():
            proc.kill()
            proc.join()


# --------------------------------------------------------------------------
# lifecycle


async def test_idle_data_plane_uses_no_cpu() -> None:
    dp = DataPlane(_unique("idle"))
    await dp.start()
    try:
        await asyncio.sleep(0.2)  # let start-up settle
        cpu0, wall0 = time.process_time(), time.monotonic()
        await asyncio.sleep(2.0)
        cpu = time.process_time() - cpu0
        assert time.monotonic() - wall0 >= 2.0
        assert cpu < 0.2, f"idle data plane used {cpu:.3f} s CPU over 2 s"
    finally:
        await dp.close()


async def test_unknown_backend_fails_to_start() -> None:
    dp = DataPlane(_unique("nb"), backend="NO_SUCH_BACKEND")
    with pytest.raises(DataPlaneError, match="NO_SUCH_BACKEND") as info:
        await dp.start()
    assert info.value.code == "backend"


async def test_backend_that_cannot_start_fails_clearly(monkeypatch: pytest.MonkeyPatch) -> None:
    # Shared-memory-only UCX transports cannot start (NIXL-FACTS); UCX reads
    # the variable when the backend is created.
    monkeypatch.setenv("UCX_TLS", "shm")
    dp = DataPlane(_unique("shm"))
    with pytest.raises(DataPlaneError, match="UCX_TLS") as info:
        await dp.start()
    assert info.value.code == "backend"


async def test_close_is_idempotent_and_refuses_later_calls(engines: Callable[..., Engine]) -> None:
    dp = DataPlane(_unique("c"))
    await dp.start()
    eng = engines("e")
    await dp.add_local_engine(eng.spec, eng.regions)
    await dp.close()  # releases and deregisters what it still holds
    await dp.close()
    with pytest.raises(DataPlaneError) as info:
        await dp.metadata()
    assert info.value.code == "state"


async def test_expecting_notifications_on_a_closed_data_plane_is_a_no_op() -> None:
    # A fatal journal error closes the data plane while peer messages are
    # still handled; their "stop polling" hint must not raise there.
    dp = DataPlane(_unique("n"))
    await dp.start()
    dp.expect_notifications(True)
    await dp.close()
    dp.expect_notifications(False)
    with pytest.raises(DataPlaneError):
        await dp.metadata()  # the real calls are still refused


async def test_unmapping_a_still_registered_region_does_not_crash(
    engines: Callable[..., Engine],
) -> None:
    """Wrong order (unmap, then deregister) must not bring the daemon down."""
    dp = DataPlane(_unique("u"))
    await dp.start()
    eng = engines("e")
    await dp.add_local_engine(eng.spec, eng.regions)
    for region in eng.regions.values():
        region.close()
    assert await dp.remove_local_engine("e") == 0
    await dp.close()


def test_indices_follow_group_layer_block_order() -> None:
    groups = [RemoteGroup(GroupKind.ATTENTION, NUM_BLOCKS, bb, (0,) * LAYERS) for bb in (64, 32)]
    geom = EngineGeometry.of("geom", groups)
    lidx, ridx, nbytes = build_indices(geom, geom, ((1, 2), (3,)), ((7, 8), (9,)))
    per_group = LAYERS * NUM_BLOCKS  # group 1's descriptors start after group 0's
    expect_l = [layer * NUM_BLOCKS + b for layer in range(LAYERS) for b in (1, 2)]
    expect_l += [per_group + layer * NUM_BLOCKS + 3 for layer in range(LAYERS)]
    expect_r = [layer * NUM_BLOCKS + b for layer in range(LAYERS) for b in (7, 8)]
    expect_r += [per_group + layer * NUM_BLOCKS + 9 for layer in range(LAYERS)]
    assert lidx.dtype == np.int32 and lidx.tolist() == expect_l
    assert ridx.dtype == np.int32 and ridx.tolist() == expect_r
    assert nbytes == LAYERS * (2 * 64 + 32)


@pytest.mark.parametrize("seed", range(5))
def test_a_destination_named_twice_is_found_wherever_it_is(seed: int) -> None:
    from daemon.dataplane.geometry import _named_twice

    rng = np.random.default_rng(seed)
    ids = rng.permutation(1000)[:300]
    assert not _named_twice(ids, 1000)
    ids[rng.integers(1, 300)] = ids[0]
    assert _named_twice(ids, 1000)
