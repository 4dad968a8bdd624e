"""Offload slot grants in the core: who holds which slot, journaled and replayed.

The core grants an engine's offload slots (``Registry.check_register``),
lowest free index first, never one a live request holds; the grant rides in
the journaled ``Registered``, so folding the journal (or a snapshot) after a
crash restores it. The process-level test of the same rule is
tests/test_offload_restart.py.
"""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from daemon.journal.replay import decode_snapshot, encode_snapshot
from schemas.events import FORMAT_VERSION, Event, Record, Registered, decode_record
from schemas.layout import EngineLayout, GroupKind, GroupLayout, Role
from schemas.reasons import Reason
from statemachine import Refusal, Registry, fold
from statemachine.reactions import Stimulus, react

POOL = EngineLayout("eng", (GroupLayout(GroupKind.ATTENTION, 64),), offload_slots=8)
PLAIN = EngineLayout("plain", (GroupLayout(GroupKind.ATTENTION, 64),))
PUSHER = Role.PUSHER


class Shell:
    """The registry and its journal: every applied event is logged, as the ledger does."""

    def __init__(self, *layouts: EngineLayout) -> None:
        self.reg = Registry()
        self.log: list[tuple[Event, float]] = []
        for layout in layouts or (POOL, PLAIN):
            self.apply(self.reg.check_attach(layout))

    def apply(self, event: Event) -> None:
        self.reg.apply(event, 0.0)
        self.log.append((event, 0.0))

    def register(
        self,
        rid: str,
        slots: int,
        *,
        engine: str = "eng",
        unavailable: frozenset[int] = frozenset(),
    ) -> tuple[int, ...]:
        event = self.reg.check_register(rid, 1, PUSHER, engine, "", [[1]], slots, unavailable)
        self.apply(event)
        return event.offload_slots

    def end(self, rid: str) -> None:
        """Abort then release: the request is gone, its slots are free."""
        record = self.reg.live[rid]
        for event in react(record, Stimulus.ENGINE_ABORT):
            self.apply(event)
        for event in react(self.reg.live[rid], Stimulus.ENGINE_RELEASE):
            self.apply(event)
        assert rid not in self.reg.live

    def replayed(self) -> Registry:
        return fold(self.log, Registry())


def test_grants_are_lowest_free_first_and_never_a_held_slot() -> None:
    shell = Shell()
    assert shell.register("a", 3) == (0, 1, 2)
    assert shell.register("b", 2) == (3, 4)
    shell.end("a")
    assert shell.register("c", 4) == (0, 1, 2, 5)
    assert shell.reg.slots_held("eng") == {0: "c", 1: "c", 2: "c", 3: "b", 4: "b", 5: "c"}
    assert shell.reg.offload_slots("b") == (3, 4)
    assert shell.register("d", 0) == ()


def test_slots_the_shell_has_not_zeroed_yet_are_not_granted() -> None:
    shell = Shell()
    assert shell.register("a", 2, unavailable=frozenset({0, 2})) == (1, 3)


def test_too_few_free_slots_is_refused_and_changes_nothing() -> None:
    shell = Shell()
    shell.register("a", 5)
    before = shell.reg.snapshot(0)
    with pytest.raises(Refusal) as exhausted:
        shell.reg.check_register("b", 1, PUSHER, "eng", "", [[1]], 4)
    assert exhausted.value.reason is Reason.OFFLOAD_EXHAUSTED
    assert "3 free of 8" in exhausted.value.message
    with pytest.raises(Refusal) as busy:
        shell.reg.check_register("b", 1, PUSHER, "eng", "", [[1]], 3, frozenset({7}))
    assert busy.value.reason is Reason.OFFLOAD_EXHAUSTED
    with pytest.raises(Refusal) as none:
        shell.reg.check_register("b", 1, PUSHER, "plain", "", [[1]], 1)
    assert none.value.reason is Reason.OFFLOAD_EXHAUSTED
    assert "no offload pool" in none.value.message
    with pytest.raises(Refusal) as negative:
        shell.reg.check_register("b", 1, PUSHER, "eng", "", [[1]], -1)
    assert negative.value.reason is Reason.BAD_SLOT
    assert shell.reg.snapshot(0) == before


def test_replay_and_snapshots_restore_who_holds_which_slot() -> None:
    shell = Shell()
    shell.register("a", 5)
    shell.register("b", 1)
    shell.end("b")
    shell.register("c", 2)
    replayed = shell.replayed()
    assert replayed.slots_held("eng") == shell.reg.slots_held("eng")
    assert replayed.snapshot(0) == shell.reg.snapshot(0)
    snap = decode_snapshot(encode_snapshot(shell.reg.snapshot(9)))
    assert snap.offload == (("a", (0, 1, 2, 3, 4)), ("c", (5, 6)))
    restored = Registry.from_snapshot(snap)
    assert restored.slots_held("eng") == shell.reg.slots_held("eng")
    # The restored registry grants as the live one would: never a held slot.
    event = restored.check_register("d", 1, PUSHER, "eng", "", [[1]], 1)
    assert event.offload_slots == (7,)
    with pytest.raises(Refusal) as full:
        restored.check_register("d", 1, PUSHER, "eng", "", [[1]], 2)
    assert full.value.reason is Reason.OFFLOAD_EXHAUSTED


def test_a_restart_failure_keeps_the_slots_until_the_release() -> None:
    # After a crash the request is failed but live: its engine may still use its slots.
    shell = Shell()
    shell.register("a", 5)
    for event in react(shell.reg.live["a"], Stimulus.RESTART):
        shell.apply(event)
    assert shell.reg.offload_slots("a") == (0, 1, 2, 3, 4)
    assert shell.register("b", 3) == (5, 6, 7)
    for event in react(shell.reg.live["a"], Stimulus.ENGINE_RELEASE):
        shell.apply(event)
    assert shell.reg.offload_slots("a") == ()
    assert shell.register("c", 5) == (0, 1, 2, 3, 4)


def test_an_engine_holding_slots_cannot_change_its_pool_size() -> None:
    shell = Shell()
    shell.register("a", 1)
    smaller = msgspec.structs.replace(POOL, offload_slots=4)
    with pytest.raises(Refusal) as busy:
        shell.reg.check_attach(smaller)
    assert busy.value.reason is Reason.ENGINE_IN_USE
    assert shell.reg.check_attach(POOL) is not None  # the same pool comes back
    with pytest.raises(Refusal) as negative:
        shell.reg.check_attach(msgspec.structs.replace(PLAIN, offload_slots=-1))
    assert negative.value.reason is Reason.BAD_SLOT
    shell.end("a")
    shell.apply(shell.reg.check_attach(smaller))
    assert shell.reg.engines["eng"].offload_slots == 4


@pytest.mark.parametrize(
    ("slots", "why"),
    [
        ((2,), "held by live request a"),
        ((8,), "not all in engine eng's pool of 8"),
        ((-1,), "not all in engine eng's pool of 8"),
        ((5, 5), "listed twice"),
    ],
)
def test_replay_refuses_a_journaled_grant_that_would_double_book(
    slots: tuple[int, ...], why: str
) -> None:
    # The core never grants these; a journal that says so is damaged, and
    # replay refuses it rather than give two live requests one slot.
    shell = Shell()
    shell.register("a", 3)
    before = shell.reg.snapshot(0)
    damaged = Registered("b", 1, PUSHER, "eng", "", ((1,),), slots)
    with pytest.raises(Refusal) as refused:
        shell.reg.apply(damaged, 0.0)
    assert refused.value.reason is Reason.BAD_SLOT
    assert why in refused.value.message
    assert shell.reg.snapshot(0) == before


def test_a_registered_record_from_before_grants_decodes_with_no_slots() -> None:
    # Journals written before grants were journaled hold a five-field body;
    # array_like decoding fills the appended field with its default.
    old_body = ["registered", "r", 1, "pusher", "eng", "", [[1, 2]]]
    payload = msgspec.msgpack.encode([FORMAT_VERSION, "node", 7, 1.5, old_body])
    record = decode_record(payload)
    assert record == Record(
        FORMAT_VERSION, "node", 7, 1.5, Registered("r", 1, PUSHER, "eng", "", ((1, 2),))
    )
    assert record.event.offload_slots == ()  # type: ignore[union-attr]


def test_layouts_and_snapshots_without_pools_encode_as_before() -> None:
    # tests/test_old_journals.py compares snapshot bytes with the old code's;
    # a pool size of 0 and an empty grant list must not add keys.
    assert b"offload" not in msgspec.msgpack.encode(PLAIN)
    assert b"offload" not in encode_snapshot(Registry().snapshot(0))
    assert b"offload_slots" in msgspec.msgpack.encode(POOL)


# ------------------------------------------------------------- property

step_st = st.one_of(
    st.tuples(st.just("register"), st.integers(0, 5), st.frozensets(st.integers(0, 7))),
    st.tuples(st.just("end"), st.integers(0, 20), st.just(frozenset())),
    st.tuples(st.just("restart"), st.just(0), st.just(frozenset())),
)


@settings(max_examples=300, deadline=None)
@given(steps=st.lists(step_st, max_size=40))
def test_no_slot_is_ever_held_by_two_live_requests(
    steps: list[tuple[str, int, frozenset[int]]],
) -> None:
    """Random grants, releases and crashes (replay into a new registry): one holder per slot."""
    shell = Shell(POOL)
    n = 0
    for kind, count, unavailable in steps:
        if kind == "register":
            n += 1
            held = shell.reg.slots_held("eng")
            free = [s for s in range(8) if s not in held and s not in unavailable]
            try:
                granted = shell.register(f"r{n}", count, unavailable=unavailable)
            except Refusal as exc:
                assert exc.reason is Reason.OFFLOAD_EXHAUSTED
                assert len(free) < count
                continue
            assert granted == tuple(free[:count])
        elif kind == "end" and shell.reg.live:
            live = sorted(shell.reg.live)
            shell.end(live[count % len(live)])
        elif kind == "restart":
            # A crash: everything comes back from the journal alone, and the
            # requests caught by it fail (but stay live) as the daemon's do.
            shell.reg = shell.replayed()
            for record in list(shell.reg.live.values()):
                for event in react(record, Stimulus.RESTART):
                    shell.apply(event)
        holders: dict[int, str] = {}
        for rid in shell.reg.live:
            for slot in shell.reg.offload_slots(rid):
                assert slot not in holders, f"slot {slot} held by {holders[slot]} and {rid}"
                holders[slot] = rid
        assert shell.reg.slots_held("eng") == holders
        assert shell.replayed().snapshot(0) == shell.reg.snapshot(0)
