"""A decode request queued for blocks holds the prefill's push (issue 21, item 6).

Real daemons on loopback, simulated engines over real NIXL writes. The
prefill daemon's ``registered`` deadline is 1 s: without a word from the
decode side, a push whose receiver has not come within 1 s fails. A decode
engine whose request waits in its queue says ``hold`` every 0.3 s (through
its own daemon, which tells the prefill's): the push waits, each hold
journaled as ``Held`` on the prefill side, and the KV still moves when the
receiver registers 2 s later. The operator's bound (``held``, 4 s from
the registration) ends a push held for longer, as its deadline would.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Iterator

import pytest

from daemon.client.errors import RpcError
from daemon.sim.engine import Expectation, SimEngine, SimGroup, tail_pairs
from daemon.sim.launcher import Daemon, start_pair, wait_idle
from schemas import rpc
from schemas.events import Failed, Held, WriteDone
from schemas.reasons import Reason
from tests.support.fixtures import stop_cleanly
from tests.support.pushes import engine_pair

LAYOUT = [SimGroup(num_blocks=32, block_bytes=2048, layers=2)]
SHORT = "[deadlines]\nregistered = 1.0\nheld = 4.0"
HOLD_EVERY_S = 0.3


@pytest.fixture(scope="module")
def short_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Daemon, Daemon]]:
    pair = start_pair(tmp_path_factory.mktemp("hold"), extra=SHORT)
    yield pair
    stop_cleanly(*pair)


async def _queue_for(de: SimEngine, request_id: str, seconds: float) -> None:
    """The decode request waits ``seconds`` for blocks, holding the push meanwhile."""
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        assert isinstance(await de.client.hold(request_id, "prefill"), rpc.Ok)
        await asyncio.sleep(HOLD_EVERY_S)


async def test_a_held_push_outlives_its_registered_deadline_and_the_kv_still_moves(
    short_pair,
) -> None:
    prefill, decode = short_pair
    pe, de = await engine_pair(short_pair, LAYOUT)
    rid = "queued"
    try:
        src, dst = [[3, 4, 5]], [[20, 21, 22]]
        await pe.prefill(rid, src)
        await _queue_for(de, rid, 2.0)  # two registered deadlines
        expect = Expectation(pe.engine_id, tail_pairs(pe.layout, src, de.layout, dst))
        await de.decode_register(rid, dst, "prefill", expect=expect)
        arrived = await de.wait_event(rid, (rpc.KvArrived, rpc.RequestFailed))
        assert isinstance(arrived, rpc.KvArrived), arrived
        assert de.reports[(rid, 1)].ok, de.reports[(rid, 1)].problems()
        await de.release(rid)
        await pe.release(rid)
    finally:
        await pe.close()
        await de.close()
    wait_idle(prefill, decode)
    events = prefill.journal_events(rid)
    held = [e for e in events if isinstance(e, Held)]
    assert len(held) >= 3, events
    # Each journaled hold moved the deadline on.
    assert all(a.until < b.until for a, b in itertools.pairwise(held)), held
    assert WriteDone in {type(e) for e in events}
    assert not [e for e in events if isinstance(e, Failed)], events


async def test_without_a_hold_the_push_ends_at_its_registered_deadline(short_pair) -> None:
    prefill, decode = short_pair
    pe, de = await engine_pair(short_pair, LAYOUT)
    rid = "unheld"
    try:
        await pe.prefill(rid, [[3, 4, 5]])
        failed = await pe.wait_event(rid, (rpc.BlocksFreeable, rpc.RequestFailed), timeout=10)
        assert isinstance(failed, rpc.RequestFailed), failed
        assert failed.reason == Reason.DEADLINE_EXCEEDED
        await pe.release(rid)
    finally:
        await pe.close()
        await de.close()
    wait_idle(prefill, decode)
    assert not [e for e in prefill.journal_events(rid) if isinstance(e, Held)]


async def test_holds_end_at_the_operators_bound(short_pair) -> None:
    prefill, decode = short_pair
    pe, de = await engine_pair(short_pair, LAYOUT)
    rid = "held-too-long"
    try:
        started = time.monotonic()
        await pe.prefill(rid, [[3, 4, 5]])
        holding = asyncio.ensure_future(_queue_for(de, rid, 6.0))
        failed = await pe.wait_event(rid, (rpc.BlocksFreeable, rpc.RequestFailed), timeout=10)
        ended_after = time.monotonic() - started
        holding.cancel()
        assert isinstance(failed, rpc.RequestFailed), failed
        assert failed.reason == Reason.DEADLINE_EXCEEDED
        # Held past two registered deadlines (1 s each), ended by the bound (4 s).
        assert ended_after > 2.5, ended_after
        await pe.release(rid)
    finally:
        await pe.close()
        await de.close()
    wait_idle(prefill, decode)
    events = prefill.journal_events(rid)
    assert len([e for e in events if isinstance(e, Held)]) >= 2, events
    (failed,) = [e for e in events if isinstance(e, Failed)]
    assert failed.reason is Reason.DEADLINE_EXCEEDED


async def test_a_hold_naming_an_unknown_peer_is_refused_and_changes_nothing(short_pair) -> None:
    _, decode = short_pair
    pe, de = await engine_pair(short_pair, LAYOUT)
    try:
        before = decode.status()["live"]
        with pytest.raises(RpcError) as refused:
            await de.client.hold("anything", "nobody")
        assert refused.value.reason is Reason.PEER_DEAD
        assert decode.status()["live"] == before
    finally:
        await pe.close()
        await de.close()


UNCLAIMED = "[deadlines]\nregistered = 30.0\nunclaimed = 1.0\nheld = 10.0"


@pytest.fixture(scope="module")
def unclaimed_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Daemon, Daemon]]:
    pair = start_pair(tmp_path_factory.mktemp("unclaimed"), extra=UNCLAIMED)
    yield pair
    stop_cleanly(*pair)


async def test_a_push_nobody_claims_ends_at_unclaimed_not_at_registered(unclaimed_pair) -> None:
    """A decode that is down never registers nor holds: the prefill's blocks go back in 1 s.

    (Before ``unclaimed`` they stayed held for the whole 30 s ``registered``.)
    """
    prefill, decode = unclaimed_pair
    pe, de = await engine_pair(unclaimed_pair, LAYOUT)
    rid = "unclaimed"
    try:
        started = time.monotonic()
        await pe.prefill(rid, [[3, 4, 5]])
        failed = await pe.wait_event(rid, (rpc.BlocksFreeable, rpc.RequestFailed), timeout=10)
        ended_after = time.monotonic() - started
        assert isinstance(failed, rpc.RequestFailed), failed
        assert failed.reason == Reason.DEADLINE_EXCEEDED
        assert 0.9 < ended_after < 5, ended_after
        await pe.release(rid)
    finally:
        await pe.close()
        await de.close()
    wait_idle(prefill, decode)


async def test_a_held_push_outlives_unclaimed_and_the_kv_still_moves(unclaimed_pair) -> None:
    prefill, decode = unclaimed_pair
    pe, de = await engine_pair(unclaimed_pair, LAYOUT)
    rid = "claimed-late"
    try:
        src, dst = [[3, 4, 5]], [[20, 21, 22]]
        await pe.prefill(rid, src)
        await _queue_for(de, rid, 2.5)  # past two unclaimed deadlines, held
        expect = Expectation(pe.engine_id, tail_pairs(pe.layout, src, de.layout, dst))
        await de.decode_register(rid, dst, "prefill", expect=expect)
        arrived = await de.wait_event(rid, (rpc.KvArrived, rpc.RequestFailed))
        assert isinstance(arrived, rpc.KvArrived), arrived
        await de.release(rid)
        await pe.release(rid)
    finally:
        await pe.close()
        await de.close()
    wait_idle(prefill, decode)
    assert WriteDone in {type(e) for e in prefill.journal_events(rid)}
