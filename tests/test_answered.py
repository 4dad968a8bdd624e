"""A prefill answer naming a transfer its prefill never had is refused at once (issue 47).

Real daemons on loopback with the default deadlines, simulated engines over
real NIXL writes. A decode engine that registers its receiver from the
prefill's answer says so (``answered``): the prefill finished the request,
so its engine registers the push within a step or two. The prefill daemon
keeps such a receiver pending only ``[deadlines] answered`` (2 s), not
``registered`` (30 s): a transfer id it never had fails ``unknown_request``
in both journals and the decode engine hears it then. Before, such a load
waited the whole 30 s (tests_vllm/test_pd_never_wrong.py's stale legs).
A push that registers inside those 2 s pairs as always; a leg sent with the
prefill's (both at once) still waits ``registered``; a push that ended here
is refused at once by its tombstone.
"""

from __future__ import annotations

import asyncio
import time

from daemon.sim.engine import Expectation, SimEngine, SimGroup, tail_pairs
from daemon.sim.launcher import Daemon, wait_idle
from schemas import rpc
from schemas.events import Failed, PeerRegistered, Refused, Registered, WriteDone
from schemas.reasons import Reason
from schemas.state import Deadlines
from tests.support.pushes import engine_pair

LAYOUT = [SimGroup(num_blocks=32, block_bytes=2048, layers=2)]
DEFAULTS = Deadlines()


async def _arrives(pe: SimEngine, de: SimEngine, rid: str, src, dst, *, answered: bool, gap: float):
    """The receiver registers, the push ``gap`` seconds later: the KV lands and checks out."""
    expect = Expectation(pe.engine_id, tail_pairs(pe.layout, src, de.layout, dst))
    await de.decode_register(rid, dst, "prefill", expect=expect, answered=answered)
    await asyncio.sleep(gap)
    await pe.prefill(rid, src)
    arrived = await de.wait_event(rid, (rpc.KvArrived, rpc.RequestFailed))
    assert isinstance(arrived, rpc.KvArrived), arrived
    assert de.reports[(rid, 1)].ok
    await de.release(rid)
    await pe.release(rid)


async def _arrives_after_push(pe: SimEngine, de: SimEngine, rid: str, src, dst) -> None:
    """The push registered first, the answered receiver after: the KV lands."""
    expect = Expectation(pe.engine_id, tail_pairs(pe.layout, src, de.layout, dst))
    await de.decode_register(rid, dst, "prefill", expect=expect, answered=True)
    arrived = await de.wait_event(rid, (rpc.KvArrived, rpc.RequestFailed))
    assert isinstance(arrived, rpc.KvArrived), arrived
    await de.release(rid)
    await pe.release(rid)


async def test_an_answer_naming_a_transfer_the_prefill_never_had_fails_at_answered(
    peered_pair: tuple[Daemon, Daemon],
) -> None:
    prefill, decode = peered_pair
    pe, de = await engine_pair(peered_pair, LAYOUT)
    rid = "never-had"
    try:
        started = time.monotonic()
        await de.decode_register(rid, [[7, 8]], "prefill", answered=True)
        failed = await de.wait_event(rid, rpc.RequestFailed)
        waited = time.monotonic() - started
        assert failed.reason == Reason.UNKNOWN_REQUEST, failed
        assert f"the answer names transfer {rid}, which this prefill never had" in failed.message
        # The short deadline ended it, not the registered one (30 s).
        assert DEFAULTS.answered <= waited < DEFAULTS.registered, waited
        await de.release(rid)
    finally:
        await pe.close()
        await de.close()
    wait_idle(prefill, decode)
    # Both journals say it: the prefill's pending registration (answered) and its
    # failure; the decode's answered receiver, failed with the prefill's words.
    on_prefill = prefill.journal_events(rid)
    assert [type(e) for e in on_prefill] == [PeerRegistered, Failed], on_prefill
    assert on_prefill[0].answered
    assert on_prefill[1].reason is Reason.UNKNOWN_REQUEST
    on_decode = decode.journal_events(rid)
    registered = next(e for e in on_decode if isinstance(e, Registered))
    assert registered.answered
    (failure,) = [e for e in on_decode if isinstance(e, Failed)]
    assert failure.reason is Reason.UNKNOWN_REQUEST
    assert failure.message.startswith("prefill: the answer names transfer never-had")


async def test_a_push_registered_inside_the_answered_deadline_pairs(
    peered_pair: tuple[Daemon, Daemon],
) -> None:
    """The usual race: the answered receiver's forward first, the push a moment later."""
    prefill, decode = peered_pair
    pe, de = await engine_pair(peered_pair, LAYOUT)
    try:
        await _arrives(pe, de, "raced", [[3, 4, 5]], [[20, 21]], answered=True, gap=0.5)
        # The push first, the answered receiver after: as always.
        await pe.prefill("push-first", [[6, 7]])
        await _arrives_after_push(pe, de, "push-first", [[6, 7]], [[22, 23]])
    finally:
        await pe.close()
        await de.close()
    wait_idle(prefill, decode)
    assert WriteDone in {type(e) for e in prefill.journal_events("raced")}


async def test_a_leg_sent_with_the_prefills_still_waits_past_answered(
    peered_pair: tuple[Daemon, Daemon],
) -> None:
    """Both legs at once: the prefill may not have started; its push comes after 2 s and pairs."""
    prefill, decode = peered_pair
    pe, de = await engine_pair(peered_pair, LAYOUT)
    try:
        gap = DEFAULTS.answered + 0.5
        await _arrives(pe, de, "concurrent", [[3, 4]], [[24, 25]], answered=False, gap=gap)
    finally:
        await pe.close()
        await de.close()
    wait_idle(prefill, decode)
    (forwarded,) = [
        e for e in prefill.journal_events("concurrent") if isinstance(e, PeerRegistered)
    ]
    assert not forwarded.answered


async def test_an_answer_naming_a_push_released_here_is_refused_at_once(
    peered_pair: tuple[Daemon, Daemon],
) -> None:
    """A stale id this prefill had: its tombstone refuses the receiver, no deadline waited."""
    prefill, decode = peered_pair
    pe, de = await engine_pair(peered_pair, LAYOUT)
    rid = "had-once"
    try:
        # The prefill engine pushed nothing and gave the request up: released, tombstoned.
        await pe.prefill(rid, [[1, 2]], kv_ready=False)
        await pe.client.abort(rid)
        await pe.release(rid)
        # Its answer reaches a decode afterwards (a retried or replayed client).
        await de.decode_register(rid, [[26, 27]], "prefill", answered=True)
        failed = await de.wait_event(rid, rpc.RequestFailed)
        assert failed.reason == Reason.STALE_INCARNATION, failed
        await de.release(rid)
    finally:
        await pe.close()
        await de.close()
    wait_idle(prefill, decode)
    refused = [e for e in prefill.journal_events(rid) if isinstance(e, Refused)]
    assert [e.reason for e in refused] == [Reason.STALE_INCARNATION], refused
    # Refused on its arrival: never pending, so no deadline of any length was waited.
    assert not [e for e in prefill.journal_events(rid) if isinstance(e, PeerRegistered)]
