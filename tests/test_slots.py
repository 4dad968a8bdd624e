"""The offload tier's slots (statemachine/slots.py): the table, the checks, replay, history.

Every (state, slot event) pair is one test id: the table lists it (and
``apply`` lands where it says) or the refusals table does (and ``apply``
refuses with that reason, changing nothing). Then the checks an engine's
calls go through: stores (a duplicate key keeps the first), leases, LRU
eviction, resets and generations, an abandoned holder, a restart, a pool
that did not survive; the bounds; replay through the registry and a real
journal; and a slot's history with its flags.
"""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from daemon.cli import main
from daemon.journal.replay import decode_snapshot, encode_snapshot, replay
from daemon.journal.writer import Journal
from schemas.events import (
    FORMAT_VERSION,
    Event,
    PoolOpened,
    Record,
    SlotsCommitted,
    SlotsCondemned,
    SlotsDiscarded,
    SlotsEvicted,
    SlotsGranted,
    SlotsLeased,
    SlotsReset,
    SlotsStored,
    SlotsUnleased,
    encode_record,
)
from schemas.reasons import REFUSAL_REASONS, Reason
from schemas.state import RegistrySnapshot, SlotRecord
from statemachine import Refusal, Registry, fold
from statemachine.slots import (
    MAX_BATCH,
    MAX_DIGEST_BYTES,
    MAX_KEY_BYTES,
    MAX_NAMESPACE,
    SLOT_EVENTS,
    SLOT_REFUSALS,
    SLOT_TRANSITIONS,
    SlotPool,
    SlotState,
    slot_history,
)

FREE, GRANTED, STORED = SlotState.FREE, SlotState.GRANTED, SlotState.STORED
COMMITTED, LEASED, EVICTED = SlotState.COMMITTED, SlotState.LEASED, SlotState.EVICTED
NS = "ns-llama"
W, R = "writer", "reader"

# A golden copy of the documented lifecycle (ARCHITECTURE.md, "Offload tier"):
# the exhaustive test checks that apply follows the tables; this catches an
# accidental edit of them.
DOCUMENTED = {
    FREE: {SlotsGranted: GRANTED},
    GRANTED: {SlotsStored: STORED, SlotsDiscarded: EVICTED},
    STORED: {SlotsCommitted: COMMITTED, SlotsDiscarded: EVICTED},
    COMMITTED: {SlotsLeased: LEASED, SlotsEvicted: EVICTED, SlotsCondemned: COMMITTED},
    LEASED: {SlotsLeased: LEASED, SlotsUnleased: LEASED, SlotsCondemned: LEASED},
    EVICTED: {SlotsReset: FREE},
}
_NOT_RESET = dict.fromkeys((GRANTED, STORED, COMMITTED, LEASED, EVICTED), Reason.SLOT_NOT_RESET)
REFUSED = {
    SlotsGranted: _NOT_RESET,
    SlotsStored: {
        FREE: Reason.SLOT_NOT_GRANTED,
        STORED: Reason.SLOT_NOT_GRANTED,
        EVICTED: Reason.SLOT_NOT_GRANTED,
        COMMITTED: Reason.SLOT_COMMITTED,
        LEASED: Reason.SLOT_COMMITTED,
    },
    SlotsCommitted: {
        FREE: Reason.SLOT_NOT_GRANTED,
        EVICTED: Reason.SLOT_NOT_GRANTED,
        GRANTED: Reason.ILLEGAL_TRANSITION,
        COMMITTED: Reason.SLOT_COMMITTED,
        LEASED: Reason.SLOT_COMMITTED,
    },
    SlotsDiscarded: {
        FREE: Reason.SLOT_NOT_GRANTED,
        EVICTED: Reason.SLOT_NOT_GRANTED,
        COMMITTED: Reason.SLOT_COMMITTED,
        LEASED: Reason.SLOT_COMMITTED,
    },
    SlotsLeased: {
        FREE: Reason.SLOT_NOT_COMMITTED,
        GRANTED: Reason.SLOT_NOT_COMMITTED,
        STORED: Reason.SLOT_NOT_COMMITTED,
        EVICTED: Reason.SLOT_EVICTED,
    },
    SlotsUnleased: dict.fromkeys(
        (FREE, GRANTED, STORED, COMMITTED, EVICTED), Reason.SLOT_NOT_LEASED
    ),
    SlotsEvicted: {
        FREE: Reason.SLOT_NOT_COMMITTED,
        GRANTED: Reason.SLOT_NOT_COMMITTED,
        STORED: Reason.SLOT_NOT_COMMITTED,
        LEASED: Reason.SLOT_LEASED,
        EVICTED: Reason.SLOT_EVICTED,
    },
    SlotsCondemned: {
        FREE: Reason.SLOT_NOT_COMMITTED,
        GRANTED: Reason.SLOT_NOT_COMMITTED,
        STORED: Reason.SLOT_NOT_COMMITTED,
        EVICTED: Reason.SLOT_EVICTED,
    },
    SlotsReset: {
        FREE: Reason.ILLEGAL_TRANSITION,
        GRANTED: Reason.ILLEGAL_TRANSITION,
        STORED: Reason.ILLEGAL_TRANSITION,
        COMMITTED: Reason.SLOT_COMMITTED,
        LEASED: Reason.SLOT_LEASED,
    },
}


def do(pool: SlotPool, log: list[Event], *events: Event | None) -> None:
    for event in events:
        if event is not None:
            pool.apply(event)
            log.append(event)


def refused(pool: SlotPool, reason: Reason, call, *args) -> Refusal:  # type: ignore[no-untyped-def]
    """``call(*args)`` is refused with ``reason`` and the pool is left exactly as it was."""
    before = pool.snapshot()
    with pytest.raises(Refusal) as info:
        call(*args)
    assert info.value.reason is reason, info.value
    assert pool.snapshot() == before
    return info.value


def in_state(state: SlotState, size: int = 4) -> SlotPool:
    """A pool whose slot 0 is in ``state`` at generation 0 (leased twice by R: one unlease
    keeps it leased)."""
    pool = SlotPool(size, 4096, "pool-1")
    steps: list[Event] = []
    if state is not FREE:
        steps.append(SlotsGranted(W, (0,), (0,)))
    if state not in (FREE, GRANTED):
        steps.append(SlotsStored(W, NS, (0,), (0,), (b"k0",), (b"d0",)))
    if state in (COMMITTED, LEASED, EVICTED):
        steps.append(SlotsCommitted((0,), (0,)))
    if state is LEASED:
        steps.append(SlotsLeased(R, (0, 0), (0, 0)))
    if state is EVICTED:
        steps.append(SlotsEvicted((0,), (0,), "lru"))
    do(pool, [], *steps)
    assert pool.state(0) is state
    return pool


def event_for(kind: type, slot: int = 0, generation: int = 0) -> Event:
    """One event of each slot kind naming ``slot``, with the holders in_state uses."""
    slots, gens = (slot,), (generation,)
    made: dict[type, Event] = {
        SlotsGranted: SlotsGranted(W, slots, gens),
        SlotsStored: SlotsStored(W, NS, slots, gens, (b"k0",), (b"d0",)),
        SlotsCommitted: SlotsCommitted(slots, gens),
        SlotsDiscarded: SlotsDiscarded(slots, gens, "abandoned"),
        SlotsLeased: SlotsLeased(R, slots, gens),
        SlotsUnleased: SlotsUnleased(R, slots, gens),
        SlotsEvicted: SlotsEvicted(slots, gens, "lru"),
        SlotsCondemned: SlotsCondemned(R, slots, gens, "bad_digest"),
        SlotsReset: SlotsReset(slots, gens),
    }
    return made[kind]


PAIRS = [(state, kind) for state in SlotState for kind in SLOT_EVENTS]


# ------------------------------------------------------------------ the table


def test_the_tables_are_the_documented_ones_and_cover_every_pair_once() -> None:
    assert {s: dict(row) for s, row in SLOT_TRANSITIONS.items()} == DOCUMENTED
    for state, kind in PAIRS:
        listed = kind in SLOT_TRANSITIONS[state]
        reason = SLOT_REFUSALS[state].get(kind)
        assert listed != (reason is not None), (state, kind)
        if reason is not None:
            assert reason is REFUSED[kind][state], (state, kind)
            assert reason in REFUSAL_REASONS


@pytest.mark.parametrize(
    ("state", "kind"), PAIRS, ids=[f"{s.value}-{k.__name__}" for s, k in PAIRS]
)
def test_each_pair_leads_where_the_table_says_or_is_refused_with_its_reason(
    state: SlotState, kind: type
) -> None:
    pool = in_state(state)
    event = event_for(kind)
    target = SLOT_TRANSITIONS[state].get(kind)
    if target is None:
        refused(pool, REFUSED[kind][state], pool.apply, event)
        return
    pool.apply(event)
    assert pool.state(0) is target
    assert pool.generation(0) == (1 if kind is SlotsReset else 0)
    assert pool.state(1) is FREE  # the other slots are untouched
    if kind is SlotsCondemned:  # out of the index, leases kept
        assert pool.is_condemned(0) and pool.where(NS, b"k0") is None
        assert dict(pool.leases(0)) == ({R: 2} if state is LEASED else {})


@pytest.mark.parametrize("kind", SLOT_EVENTS, ids=[k.__name__ for k in SLOT_EVENTS])
def test_a_stale_generation_is_refused_in_every_state_whatever_the_table_says(
    kind: type,
) -> None:
    for state in SlotState:
        pool = in_state(state)
        refused(pool, Reason.SLOT_STALE, pool.apply, event_for(kind, generation=1))


def test_a_batch_is_all_or_nothing() -> None:
    pool = in_state(COMMITTED)
    do(pool, [], SlotsGranted(W, (1,), (0,)))
    # Slot 1 may be stored; slot 0 may not: neither is.
    bad = SlotsStored(W, NS, (1, 0), (0, 0), (b"a", b"b"), (b"", b""))
    refused(pool, Reason.SLOT_COMMITTED, pool.apply, bad)
    assert pool.state(1) is GRANTED
    # Slot 2 may be granted, slot 0 not.
    refused(pool, Reason.SLOT_NOT_RESET, pool.apply, SlotsGranted(W, (2, 0), (0, 0)))
    refused(pool, Reason.BAD_OFFLOAD, pool.apply, SlotsGranted(W, (2, 2), (0, 0)))
    assert pool.free_count() == 2


def test_the_last_unlease_commits_the_slot_again() -> None:
    pool = in_state(LEASED)
    assert dict(pool.leases(0)) == {R: 2}
    do(pool, [], pool.check_unlease(R, [(0, 0)]))
    assert pool.state(0) is LEASED and dict(pool.leases(0)) == {R: 1}
    do(pool, [], pool.check_unlease(R, [(0, 0)]))
    assert pool.state(0) is COMMITTED and dict(pool.leases(0)) == {}
    assert pool.where(NS, b"k0") == 0  # still published


# ----------------------------------------------------------------- the checks


def stored_pool(keys: list[bytes], size: int = 8) -> tuple[SlotPool, list[Event]]:
    """A pool with ``keys`` committed by W in slots 0.., in order."""
    pool, log = SlotPool(size, 4096, "pool-1"), []
    do(pool, log, PoolOpened(size, 4096, "pool-1", True))
    if keys:
        granted = pool.check_grant(W, len(keys))
        assert granted is not None
        do(pool, log, granted)
        items = [(s, 0, key, b"d" + key) for s, key in zip(granted.slots, keys, strict=True)]
        do(pool, log, *pool.check_store(W, NS, items))
    return pool, log


def test_grants_are_lowest_free_first_and_none_when_none_is_free() -> None:
    pool, log = stored_pool([b"a", b"b"], size=4)
    granted = pool.check_grant("other", 5)
    assert granted == SlotsGranted("other", (2, 3), (0, 0))
    do(pool, log, granted)
    assert pool.check_grant("other", 1) is None
    assert pool.holder(2) == "other" and pool.free_count() == 0
    # An evicted slot is not free: it waits for its reset.
    do(pool, log, pool.check_evict(1))
    assert pool.check_grant(W, 1) is None
    do(pool, log, pool.check_reset(pool.evicted()))
    assert pool.check_grant(W, 1) == SlotsGranted(W, (0,), (1,))


def test_a_store_commits_new_keys_and_a_duplicate_keeps_the_first() -> None:
    pool, log = stored_pool([b"a"])
    first = pool.where(NS, b"a")
    granted = pool.check_grant("second", 3)
    assert granted is not None and granted.slots == (1, 2, 3)
    do(pool, log, granted)
    # "a" is committed already; "b" is asked twice in the batch: the first wins.
    items = [(1, 0, b"a", b"x"), (2, 0, b"b", b"y"), (3, 0, b"b", b"z")]
    events = pool.check_store("second", NS, items)
    assert events == [
        SlotsStored("second", NS, (1, 2, 3), (0, 0, 0), (b"a", b"b", b"b"), (b"x", b"y", b"z")),
        SlotsCommitted((2,), (0,)),
        SlotsDiscarded((1, 3), (0, 0), "duplicate_key"),
    ]
    do(pool, log, *events)
    assert pool.where(NS, b"a") == first == 0 and pool.digest(0) == b"da"
    assert pool.where(NS, b"b") == 2 and pool.digest(2) == b"y"
    assert pool.state(1) is EVICTED and pool.state(3) is EVICTED
    assert pool.evicted() == [1, 3]
    # Another namespace is another key.
    granted = pool.check_grant(W, 1)
    assert granted is not None
    do(pool, log, granted)
    events = pool.check_store(W, "other-ns", [(4, 0, b"a", b"")])
    assert [type(e) for e in events] == [SlotsStored, SlotsCommitted]


def test_a_store_is_refused_whole_for_any_item_and_names_why() -> None:
    pool, _ = stored_pool([b"a"])
    do(pool, [], pool.check_grant(W, 2))
    do(pool, [], pool.check_grant("thief", 1))
    good = (1, 0, b"b", b"")
    for items, reason in [
        ([good, (3, 0, b"c", b"")], Reason.SLOT_NOT_GRANTED),  # granted to another
        ([good, (4, 0, b"c", b"")], Reason.SLOT_NOT_GRANTED),  # free
        ([good, (0, 0, b"c", b"")], Reason.SLOT_COMMITTED),  # committed
        ([good, (2, 1, b"c", b"")], Reason.SLOT_STALE),  # another generation
        ([good, (1, 0, b"c", b"")], Reason.BAD_OFFLOAD),  # a slot twice
        ([good, (9, 0, b"c", b"")], Reason.BAD_OFFLOAD),  # outside the pool
    ]:
        refused(pool, reason, pool.check_store, W, NS, items)
    assert pool.check_store(W, NS, []) == []


def test_a_lease_answers_every_key_and_counts_per_holder() -> None:
    pool, log = stored_pool([b"a", b"b"])
    event, answers = pool.check_lease(R, NS, [b"a", b"missing", b"b", b"a"])
    assert answers == [(0, 0, b"da"), None, (1, 0, b"db"), (0, 0, b"da")]
    assert event == SlotsLeased(R, (0, 1, 0), (0, 0, 0))
    do(pool, log, event)
    assert dict(pool.leases(0)) == {R: 2} and dict(pool.leases(1)) == {R: 1}
    do(pool, log, pool.check_lease("r2", NS, [b"b"])[0])
    assert dict(pool.leases(1)) == {R: 1, "r2": 1}
    assert pool.check_lease(R, "other-ns", [b"a"]) == (None, [None])
    assert pool.check_lease(R, NS, []) == (None, [])
    # Giving back more than one holds, or what another holds, is refused.
    refused(pool, Reason.SLOT_NOT_LEASED, pool.check_unlease, "r2", [(0, 0)])
    refused(pool, Reason.SLOT_NOT_LEASED, pool.check_unlease, R, [(1, 0), (1, 0)])
    refused(pool, Reason.SLOT_NOT_LEASED, pool.check_unlease, R, [(2, 0)])  # free
    refused(pool, Reason.SLOT_STALE, pool.check_unlease, R, [(0, 1)])
    do(pool, log, pool.check_unlease(R, [(0, 0), (0, 0), (1, 0)]))
    assert pool.state(0) is COMMITTED and pool.state(1) is LEASED


def test_eviction_takes_the_least_recently_used_unleased_committed_slots() -> None:
    pool, log = stored_pool([b"a", b"b", b"c", b"d"])  # committed in order 0, 1, 2, 3
    # A lease is a use: slot 0 becomes the most recent, and stays so once given back.
    do(pool, log, pool.check_lease(R, NS, [b"a"])[0])
    do(pool, log, pool.check_unlease(R, [(0, 0)]))
    assert pool.check_evict(2) == SlotsEvicted((1, 2), (0, 0), "lru")
    # A leased slot is never chosen, however old.
    do(pool, log, pool.check_lease(R, NS, [b"b"])[0])
    assert pool.check_evict(2) == SlotsEvicted((2, 3), (0, 0), "lru")
    assert pool.check_evict_all("reset_cache") == SlotsEvicted((2, 3, 0), (0, 0, 0), "reset_cache")
    do(pool, log, pool.check_evict_all("operator"))
    assert pool.where(NS, b"a") is None and pool.where(NS, b"b") == 1
    assert pool.check_evict(1) is None and pool.check_evict_all("operator") is None
    # An eviction of the leased slot is refused, and a reset of it too.
    refused(pool, Reason.SLOT_LEASED, pool.apply, SlotsEvicted((1,), (0,), "lru"))
    refused(pool, Reason.SLOT_LEASED, pool.check_reset, [1])
    refused(pool, Reason.BAD_OFFLOAD, pool.check_evict, 1, "whim")


def test_a_reset_bumps_the_generation_and_the_old_one_is_refused_everywhere() -> None:
    pool, log = stored_pool([b"a"])
    do(pool, log, pool.check_lease(R, NS, [b"a"])[0])
    refused(pool, Reason.SLOT_LEASED, pool.check_reset, [0])
    do(pool, log, pool.check_unlease(R, [(0, 0)]))
    do(pool, log, pool.check_evict(1))
    refused(pool, Reason.SLOT_EVICTED, pool.apply, SlotsLeased(R, (0,), (0,)))
    assert pool.evicted() == [0]
    do(pool, log, pool.check_reset([0]))
    assert (pool.state(0), pool.generation(0), pool.holder(0), pool.digest(0)) == (
        FREE,
        1,
        None,
        None,
    )
    assert pool.evicted() == []
    # Every word about generation 0 is over.
    refused(pool, Reason.SLOT_STALE, pool.apply, SlotsGranted(W, (0,), (0,)))
    do(pool, log, pool.check_grant(W, 1))
    refused(pool, Reason.SLOT_STALE, pool.check_store, W, NS, [(0, 0, b"a", b"")])
    refused(pool, Reason.ILLEGAL_TRANSITION, pool.check_reset, [0])  # granted, in use
    refused(pool, Reason.BAD_OFFLOAD, pool.check_reset, [])
    refused(pool, Reason.BAD_OFFLOAD, pool.check_reset, [1, 1])


def test_an_abandoned_holder_gives_back_its_leases_and_its_unpublished_slots() -> None:
    pool, log = stored_pool([b"a", b"b"])
    do(pool, log, pool.check_lease(W, NS, [b"a", b"a"])[0], pool.check_lease(R, NS, [b"a"])[0])
    do(pool, log, pool.check_grant(W, 2))  # 2, 3
    do(pool, log, pool.check_grant(R, 1))  # 4
    # W is killed mid-store: slot 2 is stored (not yet committed), slot 3 only granted.
    do(pool, log, SlotsStored(W, NS, (2,), (0,), (b"c",), (b"",)))
    events = pool.abandon(W)
    assert events == [
        SlotsUnleased(W, (0, 0), (0, 0)),
        SlotsDiscarded((2, 3), (0, 0), "abandoned"),
    ]
    do(pool, log, *events)
    assert dict(pool.leases(0)) == {R: 1} and pool.state(4) is GRANTED
    assert pool.where(NS, b"c") is None  # nothing it did not finish is published
    assert pool.state(1) is COMMITTED  # what it did finish stays
    assert pool.abandon(W) == []


def test_a_restart_drops_every_lease_and_discards_every_unpublished_slot() -> None:
    pool, log = stored_pool([b"a", b"b"])
    do(pool, log, pool.check_lease(R, NS, [b"a", b"b"])[0], pool.check_lease("r2", NS, [b"a"])[0])
    do(pool, log, pool.check_grant(W, 2))
    do(pool, log, SlotsStored(W, NS, (3,), (0,), (b"c",), (b"",)))
    events = pool.on_restart()
    assert events == [
        SlotsUnleased("r2", (0,), (0,)),
        SlotsUnleased(R, (0, 1), (0, 0)),
        SlotsDiscarded((2, 3), (0, 0), "restart"),
    ]
    do(pool, log, *events)
    assert pool.counts() == {FREE: 4, GRANTED: 0, STORED: 0, COMMITTED: 2, LEASED: 0, EVICTED: 2}
    assert pool.on_restart() == []


def test_a_pool_that_survived_keeps_its_content_and_a_lost_one_evicts_it_first() -> None:
    pool, log = stored_pool([b"a", b"b"])
    assert pool.check_pool_opened(8, 4096, "pool-1", True) == [PoolOpened(8, 4096, "pool-1", True)]
    do(pool, log, pool.check_lease(R, NS, [b"a"])[0])
    refused(pool, Reason.SLOT_LEASED, pool.check_pool_opened, 8, 4096, "pool-1", False)
    do(pool, log, *pool.on_restart())
    events = pool.check_pool_opened(8, 4096, "pool-1", False)
    assert events == [
        SlotsEvicted((1, 0), (0, 0), "pool_lost"),
        PoolOpened(8, 4096, "pool-1", False),
    ]
    # Applied out of order, the PoolOpened is refused: the content is not gone yet.
    refused(pool, Reason.SLOT_COMMITTED, pool.apply, events[1])
    do(pool, log, *events)
    assert pool.where(NS, b"a") is None and pool.evicted() == [1, 0]


def test_a_pool_of_another_size_is_resized_and_a_slot_that_comes_back_is_a_new_generation() -> None:
    pool, log = stored_pool([b"a"], size=4)
    do(pool, log, pool.check_evict(1))
    do(pool, log, pool.check_reset([0]))  # slot 0 at generation 1
    do(pool, log, *pool.check_pool_opened(2, 4096, "pool-2", True))
    assert pool.size == 2 and pool.pool_id == "pool-2" and pool.free_count() == 2
    refused(pool, Reason.BAD_OFFLOAD, pool.apply, SlotsGranted(W, (3,), (0,)))
    do(pool, log, *pool.check_pool_opened(6, 8192, "pool-3", True))
    assert (pool.size, pool.slot_bytes, pool.free_count()) == (6, 8192, 6)
    assert [pool.generation(s) for s in range(6)] == [1, 0, 2, 2, 2, 2]
    refused(pool, Reason.BAD_OFFLOAD, pool.check_pool_opened, -1, 0, "x", True)
    refused(pool, Reason.BAD_OFFLOAD, pool.check_pool_opened, 2 << 20, 0, "x", True)


@pytest.mark.parametrize(
    ("call", "args"),
    [
        ("check_grant", ("", 1)),
        ("check_grant", (W, 0)),
        ("check_grant", (W, MAX_BATCH + 1)),
        ("check_store", (W, NS, [(0, 0, b"k" * (MAX_KEY_BYTES + 1), b"")])),
        ("check_store", (W, NS, [(0, 0, b"", b"")])),
        ("check_store", (W, NS, [(0, 0, b"k", b"d" * (MAX_DIGEST_BYTES + 1))])),
        ("check_store", (W, "n" * (MAX_NAMESPACE + 1), [(0, 0, b"k", b"")])),
        ("check_store", (W, "", [(0, 0, b"k", b"")])),
        ("check_store", (W, NS, [(0, 0, b"k", b"")] * (MAX_BATCH + 1))),
        ("check_store", (W, NS, [(-1, 0, b"k", b"")])),
        ("check_lease", (R, NS, [b"k" * (MAX_KEY_BYTES + 1)])),
        ("check_lease", (R, NS, [b"k"] * (MAX_BATCH + 1))),
        ("check_lease", (R, "n" * (MAX_NAMESPACE + 1), [b"k"])),
        ("check_lease", ("", NS, [b"k"])),
        ("check_unlease", (R, [])),
        ("check_unlease", (R, [(8, 0)])),
        ("check_unlease", (R, [(0, 0)] * (MAX_BATCH + 1))),
        ("check_evict", (0,)),
        ("check_evict_all", ("lru-ish",)),
        ("check_discard", ([0], "bored")),
        ("check_reset", ([8],)),
        ("check_condemn", ("", [(0, 0)])),
        ("check_condemn", (R, [])),
        ("check_condemn", (R, [(8, 0)])),
        ("check_condemn", (R, [(0, 0)] * (MAX_BATCH + 1))),
        ("check_condemn", (R, [(0, 0)], "whim")),
    ],
)
def test_malformed_input_is_bad_offload_and_changes_nothing(call: str, args: tuple) -> None:
    pool, _ = stored_pool([])
    do(pool, [], pool.check_grant(W, 1))
    refused(pool, Reason.BAD_OFFLOAD, getattr(pool, call), *args)


@pytest.mark.parametrize(
    "event",
    [
        SlotsGranted(W, (1, 2), (0,)),
        SlotsGranted(W, (), ()),
        SlotsGranted("", (1,), (0,)),
        SlotsStored(W, NS, (0,), (0,), (b"k", b"j"), (b"",)),
        SlotsLeased(R, (1 << 40,), (0,)),
        SlotsReset((-1,), (0,)),
        SlotsCondemned("", (0,), (0,), "bad_digest"),
        SlotsCondemned(R, (0, 0), (0, 0), "bad_digest"),
        PoolOpened(1 << 40, 4096, "huge", True),
    ],
    ids=lambda e: type(e).__name__,
)
def test_a_malformed_record_is_refused_on_replay(event: Event) -> None:
    pool, _ = stored_pool([])
    do(pool, [], pool.check_grant(W, 1))
    refused(pool, Reason.BAD_OFFLOAD, pool.apply, event)


def test_a_slot_not_zeroed_at_grant_is_discarded_and_granted_again_only_after_its_reset() -> None:
    pool, log = stored_pool([])
    do(pool, log, pool.check_grant(W, 1))
    do(pool, log, pool.check_discard([0], "not_zero"))
    refused(pool, Reason.SLOT_NOT_GRANTED, pool.check_discard, [0], "not_zero")
    assert pool.check_grant(W, 1) == SlotsGranted(W, (1,), (0,))
    do(pool, log, pool.check_reset([0]))
    assert pool.check_grant(W, 1) == SlotsGranted(W, (0,), (1,))


# ------------------------------------------------------------ condemned slots


def condemned_while_leased() -> tuple[SlotPool, list[Event]]:
    """Keys a, b committed in slots 0, 1; R leases a and condemns slot 0 (its digest differed)."""
    pool, log = stored_pool([b"a", b"b"])
    do(pool, log, pool.check_lease(R, NS, [b"a"])[0])
    event = pool.check_condemn(R, [(0, 0)])
    assert event == SlotsCondemned(R, (0,), (0,), "bad_digest")
    do(pool, log, event)
    return pool, log


def test_a_condemned_slot_leaves_the_index_at_once_and_keeps_its_leases() -> None:
    pool, log = condemned_while_leased()
    assert pool.where(NS, b"a") is None and pool.is_condemned(0)
    assert pool.state(0) is LEASED and dict(pool.leases(0)) == {R: 1}
    assert pool.key(0) == (NS, b"a") and pool.digest(0) == b"da"  # kept until its reset
    # Nobody is handed it again: the reporter, nor another reader.
    assert pool.check_lease(R, NS, [b"a", b"b"])[1] == [None, (1, 0, b"db")]
    assert pool.check_lease("r2", NS, [b"a"]) == (None, [None])
    # Still leased: never evicted, never reset, whatever asks.
    assert pool.check_evict_condemned() is None
    assert pool.check_evict(8) == SlotsEvicted((1,), (0,), "lru")
    assert pool.check_evict_all("operator") == SlotsEvicted((1,), (0,), "operator")
    refused(pool, Reason.SLOT_LEASED, pool.apply, SlotsEvicted((0,), (0,), "condemned"))
    refused(pool, Reason.SLOT_LEASED, pool.check_reset, [0])
    # The reporter gives its lease back: committed, still condemned, evicted next.
    do(pool, log, pool.check_unlease(R, [(0, 0)]))
    assert pool.state(0) is COMMITTED and pool.is_condemned(0)
    assert pool.where(NS, b"a") is None
    evicted = pool.check_evict_condemned()
    assert evicted == SlotsEvicted((0,), (0,), "condemned")
    do(pool, log, evicted)
    assert pool.check_evict_condemned() is None
    assert pool.is_condemned(0)  # until its reset
    do(pool, log, pool.check_reset([0]))
    assert not pool.is_condemned(0) and pool.condemned() == []
    assert (pool.state(0), pool.generation(0), pool.digest(0)) == (FREE, 1, None)
    assert pool.where(NS, b"b") == 1  # the other key never moved


def test_a_new_store_of_a_condemned_key_commits_elsewhere_and_the_old_slots_eviction_keeps_it() -> (
    None
):
    pool, log = condemned_while_leased()
    granted = pool.check_grant("w2", 1)
    assert granted == SlotsGranted("w2", (2,), (0,))
    do(pool, log, granted)
    events = pool.check_store("w2", NS, [(2, 0, b"a", b"fresh")])
    assert [type(e) for e in events] == [SlotsStored, SlotsCommitted]  # not a duplicate
    do(pool, log, *events)
    assert pool.where(NS, b"a") == 2
    assert pool.check_lease("r2", NS, [b"a"])[1] == [(2, 0, b"fresh")]
    # A condemn said again of the old slot changes nothing (the new entry stays)...
    do(pool, log, SlotsCondemned(R, (0,), (0,), "bad_digest"))
    assert pool.where(NS, b"a") == 2
    # ...and neither does its eviction nor its reset: the index names slot 2.
    do(pool, log, pool.check_unlease(R, [(0, 0)]))
    do(pool, log, pool.check_evict_condemned())
    assert pool.state(0) is EVICTED and pool.where(NS, b"a") == 2
    do(pool, log, pool.check_reset([0]))
    assert pool.where(NS, b"a") == 2 and pool.index_size() == 2
    # The replayed pool agrees.
    replayed = SlotPool()
    for event in log:
        replayed.apply(event)
    assert replayed.snapshot() == pool.snapshot()


def test_condemn_is_idempotent_and_refused_for_a_slot_not_committed_evicted_or_stale() -> None:
    pool, log = condemned_while_leased()
    assert pool.check_condemn(R, [(0, 0)]) is None
    assert pool.check_condemn("r2", [(0, 0), (0, 0)]) is None  # anyone may say it again
    # Of several, only those not condemned yet; an item twice counts once.
    assert pool.check_condemn(R, [(0, 0), (1, 0), (1, 0)]) == SlotsCondemned(
        R, (1,), (0,), "bad_digest"
    )
    # A committed slot nobody leases may be condemned too.
    do(pool, log, pool.check_condemn("r2", [(1, 0)]))
    assert pool.state(1) is COMMITTED and pool.where(NS, b"b") is None
    do(pool, log, pool.check_grant(W, 2))  # slots 2, 3
    do(pool, log, SlotsStored(W, NS, (3,), (0,), (b"c",), (b"",)))
    do(pool, log, pool.check_evict_condemned())  # slot 1: evicted
    refused(pool, Reason.SLOT_NOT_COMMITTED, pool.check_condemn, R, [(2, 0)])  # granted
    refused(pool, Reason.SLOT_NOT_COMMITTED, pool.check_condemn, R, [(3, 0)])  # stored
    refused(pool, Reason.SLOT_NOT_COMMITTED, pool.check_condemn, R, [(4, 0)])  # free
    refused(pool, Reason.SLOT_EVICTED, pool.check_condemn, R, [(1, 0)])
    refused(pool, Reason.SLOT_STALE, pool.check_condemn, R, [(0, 1)])
    # All or nothing: a bad item refuses the good ones beside it.
    do(pool, log, pool.check_unlease(R, [(0, 0)]))
    refused(pool, Reason.BAD_OFFLOAD, pool.check_condemn, R, [(0, 0), (0, 1)])  # a slot twice
    refused(
        pool, Reason.SLOT_NOT_COMMITTED, pool.apply, SlotsCondemned(R, (0, 2), (0, 0), "bad_digest")
    )


def test_lru_eviction_takes_unleased_condemned_slots_before_any_other() -> None:
    pool, log = stored_pool([b"a", b"b", b"c", b"d"])  # committed in order 0, 1, 2, 3
    do(pool, log, pool.check_condemn(R, [(3, 0)]), pool.check_condemn(R, [(2, 0)]))
    assert pool.check_evict(1) == SlotsEvicted((2,), (0,), "lru")
    assert pool.check_evict(3) == SlotsEvicted((2, 3, 0), (0, 0, 0), "lru")
    # A leased condemned slot is not taken: the next is the least recently used.
    do(pool, log, SlotsLeased(R, (2,), (0,)))
    assert pool.check_evict(2) == SlotsEvicted((3, 0), (0, 0), "lru")
    assert pool.check_evict_condemned() == SlotsEvicted((3,), (0,), "condemned")


def test_a_snapshot_keeps_a_condemned_slot_out_of_the_index_and_old_records_decode() -> None:
    pool, log = condemned_while_leased()
    do(pool, log, pool.check_grant("w2", 1))
    do(pool, log, *pool.check_store("w2", NS, [(2, 0, b"a", b"fresh")]))
    registry = Registry()
    for event in log:
        registry.apply(event, 1.0)
    snap = decode_snapshot(encode_snapshot(registry.snapshot(len(log))))
    assert snap.slots is not None
    (record,) = [r for r in snap.slots.records if r.slot == 0]
    assert record.condemned and record.state is LEASED
    assert set(snap.slots.recency) == {0, 1, 2}  # a condemned slot keeps its place
    back = Registry.from_snapshot(snap).slots
    assert back.snapshot() == pool.snapshot()
    assert back.where(NS, b"a") == 2 and back.is_condemned(0) and not back.is_condemned(2)
    assert back.check_lease("r2", NS, [b"a"])[1] == [(2, 0, b"fresh")]
    do(back, [], back.check_unlease(R, [(0, 0)]))
    assert back.check_evict_condemned() == SlotsEvicted((0,), (0,), "condemned")
    # A record written before the flag existed decodes as a slot not condemned.
    old = msgspec.msgpack.encode([1, "committed", 0, W, NS, b"b", b"db", []])
    plain = msgspec.msgpack.decode(old, type=SlotRecord)
    assert plain == SlotRecord(1, COMMITTED, 0, W, NS, b"b", b"db") and not plain.condemned
    # A damaged snapshot: a condemned free slot, or two indexed slots with one key.
    slots = snap.slots
    bad = [
        msgspec.structs.replace(
            slots, records=(*slots.records, SlotRecord(5, FREE, 1, condemned=True))
        ),
        msgspec.structs.replace(
            slots,
            records=tuple(msgspec.structs.replace(r, condemned=False) for r in slots.records),
        ),
    ]
    for damaged in bad:
        with pytest.raises(Refusal) as info:
            SlotPool.from_snapshot(damaged)
        assert info.value.reason is Reason.BAD_OFFLOAD


# --------------------------------------------------------------------- replay


def busy_journal() -> tuple[Registry, list[Event]]:
    """A registry whose pool saw every kind of slot record."""
    registry, log = Registry(), []

    def commit(*events: Event | None) -> None:
        for event in events:
            if event is not None:
                registry.apply(event, 100.0 + len(log))
                log.append(event)

    pool = registry.slots
    commit(*pool.check_pool_opened(6, 4096, "pool-1", True))
    commit(pool.check_grant(W, 4))
    commit(*pool.check_store(W, NS, [(0, 0, b"a", b"1"), (1, 0, b"b", b"2"), (2, 0, b"a", b"")]))
    commit(pool.check_lease(R, NS, [b"a", b"b", b"a"])[0])
    commit(pool.check_unlease(R, [(1, 0)]))
    commit(pool.check_evict(1))
    commit(pool.check_reset(pool.evicted()))
    commit(pool.check_grant("w2", 2))
    commit(*pool.abandon("w2"))
    # Slot 3 (W's last grant) committed, leased by r2 and condemned: leased, out of the index.
    commit(*pool.check_store(W, NS, [(3, 0, b"c", b"3")]))
    commit(pool.check_lease("r2", NS, [b"c"])[0])
    commit(pool.check_condemn("r2", [(3, 0)]))
    return registry, log


def test_replay_of_the_records_and_a_snapshot_rebuild_the_same_pool() -> None:
    registry, log = busy_journal()
    assert registry.slots.counts()[LEASED] == 2 and registry.slots.evicted()
    assert registry.slots.condemned() == [3]
    replayed = fold((event, 1.0) for event in log)
    assert replayed.snapshot(0) == registry.snapshot(0)
    snap = decode_snapshot(encode_snapshot(registry.snapshot(len(log))))
    assert snap.slots is not None
    back = Registry.from_snapshot(snap)
    assert back.snapshot(len(log)) == snap
    # The index and the free heap work after the round trip as before it.
    assert back.slots.where(NS, b"a") == registry.slots.where(NS, b"a") == 0
    assert back.slots.check_grant("x", 6) == registry.slots.check_grant("x", 6)
    assert back.slots.check_evict(6) == registry.slots.check_evict(6)
    assert back.slots.where(NS, b"c") is None and back.slots.condemned() == [3]
    assert dict(back.slots.leases(3)) == {"r2": 1}


def test_a_registry_without_a_pool_snapshots_as_before() -> None:
    registry = Registry()
    encoded = encode_snapshot(registry.snapshot(0))
    assert b"slots" not in encoded
    assert decode_snapshot(encoded) == RegistrySnapshot(0, (), (), (), ())


def write_journal(path: Path, log: list[Event], snapshot_after: int | None = None) -> Registry:
    """The records in a real journal (format 2), with a snapshot after the first n."""
    registry = Registry()
    with Journal.open(path) as journal:
        for n, event in enumerate(log, 1):
            registry.apply(event, float(n))
            seq = journal.next_seq
            journal.append(encode_record(Record(FORMAT_VERSION, "node-a", seq, float(n), event)))
            journal.commit()
            if n == snapshot_after:
                journal.write_snapshot(seq, encode_snapshot(registry.snapshot(seq)))
    return registry


@pytest.mark.parametrize("snapshot_after", [None, 4])
def test_a_journal_replays_to_the_same_pool(tmp_path: Path, snapshot_after: int | None) -> None:
    live, log = busy_journal()
    written = write_journal(tmp_path / "journal", log, snapshot_after)
    result = replay(tmp_path / "journal")
    assert result.snapshot_seq == (snapshot_after or 0)
    assert result.registry.slots.snapshot() == live.slots.snapshot() == written.slots.snapshot()


# -------------------------------------------------------------------- history


def planted_journal() -> list[Event]:
    """Slot 0 used twice; then a read naming its first generation (replay refuses it)."""
    pool, log = stored_pool([b"a"], size=2)
    do(pool, log, pool.check_lease(R, NS, [b"a"])[0])
    do(pool, log, pool.check_unlease(R, [(0, 0)]))
    do(pool, log, pool.check_evict(1))
    do(pool, log, pool.check_reset([0]))
    do(pool, log, pool.check_grant("w2", 1))
    do(pool, log, *pool.check_store("w2", NS, [(0, 1, b"z", b"")]))
    log.append(SlotsLeased(R, (0,), (0,)))  # planted: a read of the old generation
    do(pool, [], pool.check_lease(R, NS, [b"z"])[0])
    log.append(SlotsLeased(R, (0,), (1,)))
    return log


def test_a_slots_history_lists_its_records_in_order_and_flags_a_read_of_an_old_generation() -> None:
    log = planted_journal()
    records = [Record(FORMAT_VERSION, "n", seq, float(seq), e) for seq, e in enumerate(log, 1)]
    lines = slot_history(records, 0)
    kinds = [type(line.record.event).__name__ for line in lines]
    assert kinds == [
        "PoolOpened", "SlotsGranted", "SlotsStored", "SlotsCommitted", "SlotsLeased",
        "SlotsUnleased", "SlotsEvicted", "SlotsReset", "SlotsGranted", "SlotsStored",
        "SlotsCommitted", "SlotsLeased", "SlotsLeased",
    ]  # fmt: skip
    flagged = [line for line in lines if line.flag]
    assert len(flagged) == 1
    (bad,) = flagged
    assert bad.record.seq == len(log) - 1
    assert "generation 0" in bad.flag and "at generation 1" in bad.flag
    assert "slot_stale" in bad.flag  # replay refuses it: it changed nothing
    assert (lines[-1].state, lines[-1].generation, lines[-1].flag) == (LEASED, 1, "")
    assert [line.generation for line in lines[:8]] == [0] * 7 + [1]
    # Slot 1 was never used: only the pool's opening names it.
    assert [type(line.record.event) for line in slot_history(records, 1)] == [PoolOpened]


def test_journal_show_slot_prints_its_history_with_the_flag(tmp_path: Path, capsys) -> None:
    log = planted_journal()
    path = tmp_path / "journal"
    with Journal.open(path) as journal:
        for n, event in enumerate(log, 1):
            journal.append(encode_record(Record(FORMAT_VERSION, "node-a", n, float(n), event)))
        journal.commit()
    assert main(["journal", "show", str(path), "--slot", "0"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 13
    assert "SlotsGranted" in out[1] and "granted gen 0" in out[1]
    assert "FLAGGED" in out[-2] and "generation 0" in out[-2]
    assert "FLAGGED" not in "".join(out[:-2] + out[-1:])
    assert main(["journal", "show", str(path), "--slot", "0", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [bool(row["flag"]) for row in rows].count(True) == 1
    assert rows[1]["slot_state"] == "granted" and rows[1]["generation"] == 0


def test_a_slots_history_shows_its_condemn_and_the_eviction_that_follows() -> None:
    pool, log = condemned_while_leased()
    do(pool, log, pool.check_unlease(R, [(0, 0)]))
    do(pool, log, pool.check_evict_condemned())
    do(pool, log, pool.check_reset([0]))
    records = [Record(FORMAT_VERSION, "n", seq, float(seq), e) for seq, e in enumerate(log, 1)]
    lines = slot_history(records, 0)
    tail = [(type(line.record.event).__name__, line.state, line.flag) for line in lines[-4:]]
    assert tail == [
        ("SlotsCondemned", LEASED, ""),
        ("SlotsUnleased", COMMITTED, ""),
        ("SlotsEvicted", EVICTED, ""),
        ("SlotsReset", FREE, ""),
    ]
    assert [line.record.event for line in lines if isinstance(line.record.event, SlotsEvicted)] == [
        SlotsEvicted((0,), (0,), "condemned")
    ]
