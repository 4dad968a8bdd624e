"""The node registry, scenario by scenario.

Each scenario drives a ``Registry`` only through its check_*/plan_* methods and
``apply`` (the way the shell does), and asserts outcomes: refusal codes, the
records, who owns which destination block, tombstones.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import msgspec
import pytest

from schemas.events import (
    Event,
    Failed,
    KvReady,
    PeerRegistered,
    PeerSettled,
    Registered,
    Released,
    ReleaseDeferred,
    RequestEvent,
    WriteDone,
    WriteStarted,
)
from schemas.layout import EngineLayout, GroupKind, GroupLayout, Role
from schemas.reasons import Reason
from schemas.state import Deadlines, PendingPeer, RegistrySnapshot, RequestRecord, State
from statemachine import Refusal, Registry, is_quarantined

ATT, SSM = GroupKind.ATTENTION, GroupKind.SSM
PUSHER, RECEIVER = Role.PUSHER, Role.RECEIVER

PRE = EngineLayout("pre0", (GroupLayout(ATT, 100),))
DEC = EngineLayout("dec0", (GroupLayout(ATT, 1000),))
# Two kernel blocks per logical block: logical L -> kernel 2L, 2L+1; 10 kernel blocks.
WIDE = EngineLayout("wide", (GroupLayout(ATT, 10, per_logical=2),))
TWO = EngineLayout("two", (GroupLayout(ATT, 50), GroupLayout(SSM, 8)))
PRE2 = EngineLayout("pre2", (GroupLayout(ATT, 100, per_logical=2),))


class Node:
    """A registry plus the shell's journal-then-apply loop, with a fake clock."""

    def __init__(self, *layouts: EngineLayout, **kwargs: object) -> None:
        self.reg = Registry(**kwargs)  # type: ignore[arg-type]
        self.now = 0.0
        for layout in layouts or (PRE, DEC, WIDE, TWO, PRE2):
            self.do(self.reg.check_attach(layout))

    def do(self, events: object) -> RequestRecord | None:
        """Apply one event or a list of them, then any follow-up they unlock."""
        batch = list(events) if isinstance(events, list | tuple) else [events]
        touched = None
        for event in batch:
            touched = self.reg.apply(event, self.now)
            if touched is not None and touched.state is not State.RELEASED:
                for extra in self.reg.follow_up(touched):
                    touched = self.reg.apply(extra, self.now)
        return touched

    def register(
        self,
        rid: str,
        role: Role,
        logical: Iterable[Iterable[int]],
        *,
        inc: int = 1,
        engine: str | None = None,
    ) -> RequestRecord:
        engine = engine or ("pre0" if role is PUSHER else "dec0")
        blocks = [list(ids) for ids in logical]
        rec = self.do(self.reg.check_register(rid, inc, role, engine, "peer", blocks))
        assert rec is not None
        return rec

    def release(self, rid: str, inc: int = 1) -> None:
        self.do(self.reg.plan_release(rid, inc))

    def pusher_ready(self, rid: str, dst: tuple, src_logical: list[int], inc: int = 1) -> None:
        """Pusher: receiver registration, local registration, kv ready, trim."""
        self.do(self.reg.check_peer_registration(rid, inc, "dnode", "dec0", dst, 1))
        self.register(rid, PUSHER, [src_logical], inc=inc)
        self.do(KvReady(rid, inc))
        self.do(self.reg.plan_trim(rid, inc))


def assert_gone(reg: Registry, rid: str, inc: int) -> None:
    assert rid not in reg.live
    assert rid not in reg.pending
    assert reg.tombstones.covers(rid, inc)
    for owners in reg.owned_blocks().values():
        assert rid not in owners.values()


# ------------------------------------------------------------- refusals

# Each scenario: (setup on a fresh Node, action that must be refused, reason).
Scenario = tuple[Callable[[Node], None], Callable[[Node], object], Reason]


def _nothing(n: Node) -> None:
    return None


def _live_receiver(n: Node) -> None:
    n.register("a", RECEIVER, [[1, 2, 3]])


def _released_receiver(n: Node) -> None:
    n.register("a", RECEIVER, [[1, 2, 3]], inc=2)
    n.do(WriteDone("a", 2))
    n.release("a", 2)
    assert "a" not in n.reg.live


def _aborted_receiver_while_writing(n: Node) -> None:
    n.register("a", RECEIVER, [[10, 11]])
    n.do(WriteStarted("a", 1, 2, 8192))
    n.do(n.reg.plan_abort("a", 1, Reason.ABORTED, "engine abort"))
    n.release("a", 1)
    assert n.reg.live["a"].release_pending


def _pusher_writing(n: Node) -> None:
    n.pusher_ready("p", ((500, 501),), [10, 11, 12, 13, 14])
    n.do(WriteStarted("p", 1, 2, 8192))


def _pending_peer(n: Node) -> None:
    n.do(n.reg.check_peer_registration("p", 1, "dnode", "dec0", ((1,),), 1))


def _reg(rid: str, role: Role, engine: str, logical: list, inc: int = 1):
    return lambda n: n.reg.check_register(rid, inc, role, engine, "peer", logical)


REFUSALS: dict[str, Scenario] = {
    "unknown-engine": (_nothing, _reg("a", RECEIVER, "nope", [[1]]), Reason.UNKNOWN_ENGINE),
    "duplicate-live": (
        _live_receiver,
        _reg("a", RECEIVER, "dec0", [[7]]),
        Reason.DUPLICATE_REQUEST,
    ),
    "duplicate-live-new-incarnation": (
        _live_receiver,
        _reg("a", RECEIVER, "dec0", [[7]], inc=2),
        Reason.DUPLICATE_REQUEST,
    ),
    "stale-same-incarnation": (
        _released_receiver,
        _reg("a", RECEIVER, "dec0", [[7]], inc=2),
        Reason.STALE_INCARNATION,
    ),
    "stale-older-incarnation": (
        _released_receiver,
        _reg("a", PUSHER, "pre0", [[7]], inc=1),
        Reason.STALE_INCARNATION,
    ),
    "stale-peer-registration": (
        _released_receiver,
        lambda n: n.reg.check_peer_registration("a", 2, "d", "dec0", ((1,),), 1),
        Reason.STALE_INCARNATION,
    ),
    "stale-lookup-after-release": (
        _released_receiver,
        lambda n: n.reg.plan_release("a", 2),
        Reason.STALE_INCARNATION,
    ),
    "unknown-request": (_nothing, lambda n: n.reg.plan_release("x", 1), Reason.UNKNOWN_REQUEST),
    "blocks-owned": (
        _live_receiver,
        _reg("b", RECEIVER, "dec0", [[3, 4]]),
        Reason.BLOCKS_OWNED,
    ),
    "blocks-owned-quarantined": (
        _aborted_receiver_while_writing,
        _reg("b", RECEIVER, "dec0", [[11, 12]]),
        Reason.BLOCKS_OWNED,
    ),
    "blocks-owned-via-apply": (
        _live_receiver,
        lambda n: n.reg.apply(Registered("b", 1, RECEIVER, "dec0", "peer", ((2,),)), 0.0),
        Reason.BLOCKS_OWNED,
    ),
    "kernel-block-out-of-range": (
        _nothing,
        # logical 5 -> kernel 10, 11 on an engine with kernel blocks 0..9
        _reg("a", RECEIVER, "wide", [[4, 5]]),
        Reason.BLOCK_OUT_OF_RANGE,
    ),
    "block-out-of-range-flat": (
        _nothing,
        _reg("a", RECEIVER, "dec0", [[999, 1000]]),
        Reason.BLOCK_OUT_OF_RANGE,
    ),
    "negative-block": (_nothing, _reg("a", RECEIVER, "dec0", [[-1]]), Reason.BLOCK_OUT_OF_RANGE),
    "ssm-slot-out-of-range": (
        _nothing,
        _reg("a", RECEIVER, "two", [[1], [8]]),
        Reason.BLOCK_OUT_OF_RANGE,
    ),
    "out-of-range-via-apply": (
        _nothing,
        lambda n: n.reg.apply(Registered("a", 1, RECEIVER, "wide", "peer", ((10,),)), 0.0),
        Reason.BLOCK_OUT_OF_RANGE,
    ),
    "duplicate-block": (_nothing, _reg("a", RECEIVER, "dec0", [[3, 3]]), Reason.DUPLICATE_BLOCK),
    "duplicate-block-pusher": (
        _nothing,
        _reg("a", PUSHER, "pre0", [[1, 2, 1]]),
        Reason.DUPLICATE_BLOCK,
    ),
    "too-many-groups": (
        _nothing,
        _reg("a", RECEIVER, "dec0", [[1], [2]]),
        Reason.GROUP_COUNT_MISMATCH,
    ),
    "too-few-groups": (_nothing, _reg("a", RECEIVER, "two", [[1]]), Reason.GROUP_COUNT_MISMATCH),
    "release-pusher-while-writing-via-apply": (
        _pusher_writing,
        lambda n: n.reg.apply(Released("p", 1), 0.0),
        Reason.ILLEGAL_TRANSITION,
    ),
    "release-quarantined-receiver-via-apply": (
        _aborted_receiver_while_writing,
        lambda n: n.reg.apply(Released("a", 1), 0.0),
        Reason.ILLEGAL_TRANSITION,
    ),
    "peer-registration-already-pending": (
        _pending_peer,
        lambda n: n.reg.check_peer_registration("p", 1, "dnode", "dec0", ((2,),), 1),
        Reason.DUPLICATE_REQUEST,
    ),
    "peer-registration-on-receiver": (
        _live_receiver,
        lambda n: n.reg.check_peer_registration("a", 1, "dnode", "dec0", ((2,),), 1),
        Reason.ROLE_MISMATCH,
    ),
    "peer-registration-twice": (
        _pusher_writing,
        lambda n: n.reg.check_peer_registration("p", 1, "dnode", "dec0", ((2,),), 1),
        Reason.DUPLICATE_REQUEST,
    ),
    "peer-registration-bad-ratio": (
        _nothing,
        lambda n: n.reg.check_peer_registration("p", 1, "dnode", "dec0", ((2,),), 0),
        Reason.BLOCK_OUT_OF_RANGE,
    ),
    "detach-busy-engine": (
        _live_receiver,
        lambda n: n.reg.check_detach("dec0"),
        Reason.ENGINE_IN_USE,
    ),
    "relayout-busy-engine": (
        _live_receiver,
        lambda n: n.reg.check_attach(EngineLayout("dec0", (GroupLayout(ATT, 5),))),
        Reason.ENGINE_IN_USE,
    ),
    "detach-unknown-engine": (
        _nothing,
        lambda n: n.reg.check_detach("nope"),
        Reason.UNKNOWN_ENGINE,
    ),
    "trim-decode-longer": (
        lambda n: (
            n.do(n.reg.check_peer_registration("p", 1, "dnode", "dec0", ((1, 2, 3),), 1)),
            n.register("p", PUSHER, [[10, 11]]),
        ),
        lambda n: n.reg.plan_trim("p", 1),
        Reason.DECODE_LONGER_THAN_PREFILL,
    ),
    "trim-before-peer-registration": (
        lambda n: n.register("p", PUSHER, [[10, 11]]),
        lambda n: n.reg.plan_trim("p", 1),
        Reason.ILLEGAL_TRANSITION,
    ),
}


@pytest.mark.parametrize(("setup", "action", "reason"), REFUSALS.values(), ids=REFUSALS.keys())
def test_refusal_changes_nothing(
    setup: Callable[[Node], None], action: Callable[[Node], object], reason: Reason
) -> None:
    n = Node()
    setup(n)
    before = n.reg.snapshot(0)
    owned = n.reg.owned_blocks()
    with pytest.raises(Refusal) as info:
        action(n)
    assert info.value.reason is reason, info.value
    assert n.reg.snapshot(0) == before
    assert n.reg.owned_blocks() == owned


# ----------------------------------------------------- acceptances after


def test_newer_incarnation_accepted_after_release() -> None:
    n = Node()
    _released_receiver(n)
    rec = n.register("a", RECEIVER, [[1, 2, 3]], inc=3)
    assert (rec.incarnation, rec.state) == (3, State.REGISTERED)
    assert n.reg.owner_of("dec0", 0, 2) == "a"
    # The tombstone still covers the old one while the new one lives.
    with pytest.raises(Refusal) as info:
        n.reg.lookup("a", 2)
    assert info.value.reason is Reason.STALE_INCARNATION


def test_blocks_free_again_after_owner_released() -> None:
    n = Node()
    n.register("a", RECEIVER, [[1, 2, 3]])
    assert [n.reg.owner_of("dec0", 0, b) for b in (1, 2, 3, 4)] == ["a", "a", "a", None]
    with pytest.raises(Refusal):
        n.reg.check_register("b", 1, RECEIVER, "dec0", "peer", [[3, 4]])
    n.do(WriteDone("a", 1))
    n.release("a")
    assert_gone(n.reg, "a", 1)
    assert n.reg.owned_blocks() == {}
    n.register("b", RECEIVER, [[3, 4]])
    assert n.reg.owned_blocks() == {("dec0", 0): {3: "b", 4: "b"}}


def test_ownership_is_per_engine_and_group() -> None:
    n = Node()
    n.register("a", RECEIVER, [[3], [3]], engine="two")
    n.register("b", RECEIVER, [[4], [4]], engine="two")
    n.register("c", RECEIVER, [[3]])  # same id on another engine: no conflict
    assert n.reg.owned_blocks() == {
        ("two", 0): {3: "a", 4: "b"},
        ("two", 1): {3: "a", 4: "b"},
        ("dec0", 0): {3: "c"},
    }
    # Pushers never own destination blocks, even the same ids.
    n.register("p", PUSHER, [[3]])
    assert n.reg.owner_of("pre0", 0, 3) is None


def test_kernel_expansion_in_range_is_accepted() -> None:
    n = Node()
    rec = n.register("a", RECEIVER, [[0, 4]], engine="wide")
    assert rec.blocks == ((0, 1, 8, 9),)
    assert [n.reg.owner_of("wide", 0, b) for b in (0, 1, 8, 9, 2)] == ["a"] * 4 + [None]
    # Overlap at kernel granularity: logical 4 of another request is kernel 8, 9.
    with pytest.raises(Refusal) as info:
        n.reg.check_register("b", 1, RECEIVER, "wide", "peer", [[3, 4]])
    assert info.value.reason is Reason.BLOCKS_OWNED


# --------------------------------------------------- deferred releases


def test_pusher_release_while_writing_is_deferred_until_done() -> None:
    n = Node()
    _pusher_writing(n)
    plan = n.reg.plan_release("p", 1)
    assert plan == [ReleaseDeferred("p", 1)]
    n.reg.apply(plan[0], n.now)
    rec = n.reg.live["p"]
    assert (rec.state, rec.release_pending) == (State.WRITING, True)
    assert n.reg.plan_release("p", 1) == []  # already deferred
    assert n.reg.follow_up(rec) == []  # still quarantined
    done = n.reg.apply(WriteDone("p", 1), n.now)
    assert done is not None and done.state is State.DONE
    follow = n.reg.follow_up(done)
    assert follow == [Released("p", 1)]
    n.reg.apply(follow[0], n.now)
    assert_gone(n.reg, "p", 1)


def test_pusher_release_while_writing_then_failure_releases() -> None:
    n = Node()
    _pusher_writing(n)
    n.do(n.reg.plan_release("p", 1))
    assert n.reg.plan_abort("p", 1, Reason.ABORTED, "x") == []  # cannot recall the write
    n.do(Failed("p", 1, Reason.TRANSFER_ERROR, "nic"))  # follow_up releases
    assert_gone(n.reg, "p", 1)


def test_pusher_release_before_write_fails_and_releases_at_once() -> None:
    n = Node()
    n.pusher_ready("p", ((500, 501),), [10, 11, 12, 13, 14])
    plan = n.reg.plan_release("p", 1)
    assert [type(e) for e in plan] == [Failed, Released]
    assert plan[0].reason is Reason.ABORTED  # type: ignore[union-attr]
    n.do(plan)
    assert_gone(n.reg, "p", 1)


def test_receiver_abort_keeps_blocks_until_peer_settles() -> None:
    n = Node()
    _aborted_receiver_while_writing(n)
    rec = n.reg.live["a"]
    assert (rec.state, rec.settled, rec.release_pending) == (State.FAILED, False, True)
    assert is_quarantined(rec)
    assert n.reg.owner_of("dec0", 0, 10) == n.reg.owner_of("dec0", 0, 11) == "a"
    with pytest.raises(Refusal) as info:
        n.reg.check_register("b", 1, RECEIVER, "dec0", "peer", [[11]])
    assert info.value.reason is Reason.BLOCKS_OWNED
    assert n.reg.follow_up(rec) == []
    settled = n.reg.apply(PeerSettled("a", 1), n.now)
    assert settled is not None and settled.settled
    follow = n.reg.follow_up(settled)
    assert follow == [Released("a", 1)]
    n.reg.apply(follow[0], n.now)
    assert_gone(n.reg, "a", 1)
    assert n.reg.owner_of("dec0", 0, 11) is None
    n.register("b", RECEIVER, [[10, 11]])
    assert n.reg.owner_of("dec0", 0, 10) == "b"


def test_receiver_release_in_done_is_immediate() -> None:
    n = Node()
    n.register("a", RECEIVER, [[10, 11]])
    n.do([WriteStarted("a", 1, 2, 1), WriteDone("a", 1)])
    assert n.reg.plan_release("a", 1) == [Released("a", 1)]
    n.release("a")
    assert_gone(n.reg, "a", 1)


def test_receiver_cancelled_by_settled_peer_releases_at_once() -> None:
    n = Node()
    n.register("a", RECEIVER, [[10, 11]])
    n.do(Failed("a", 1, Reason.REFUSED_BY_PEER, "trim refused", settled=True))
    assert n.reg.plan_release("a", 1) == [Released("a", 1)]


# ------------------------------------------------- pending + trim


def test_peer_registration_before_local_is_pending_then_merged() -> None:
    n = Node()
    got = n.do(n.reg.check_peer_registration("p", 1, "dnode", "dec0", ((500, 501),), 1))
    assert got is None
    assert "p" not in n.reg.live
    assert n.reg.pending["p"].registration.blocks == ((500, 501),)
    n.now = 3.0
    rec = n.register("p", PUSHER, [[10, 11, 12, 13, 14]])
    assert n.reg.pending == {}
    assert rec.state is State.REGISTERED
    assert (rec.remote_engine, rec.remote_blocks, rec.remote_per_logical) == (
        "dec0",
        ((500, 501),),
        1,
    )
    assert rec.deadline == 3.0 + n.reg.deadlines.registered


def test_pending_for_other_incarnation_is_never_merged() -> None:
    n = Node()
    n.do(n.reg.check_peer_registration("p", 2, "dnode", "dec0", ((500,),), 1))
    try:
        rec = n.register("p", PUSHER, [[10]], inc=1)
    except Refusal as exc:  # refusing is fine (and what the fix proposed does)
        assert exc.reason in (Reason.DUPLICATE_REQUEST, Reason.STALE_INCARNATION)
        assert "p" not in n.reg.live and "p" in n.reg.pending
        return
    assert rec.remote_blocks is None


def test_plan_trim_partial_hit() -> None:
    n = Node()
    n.pusher_ready("p", ((500, 501),), [10, 11, 12, 13, 14])
    rec = n.reg.live["p"]
    assert rec.state is State.TRIMMED
    assert rec.src == ((13, 14),)
    assert rec.dst == ((500, 501),)


def test_plan_trim_partial_hit_event_fields() -> None:
    n = Node()
    n.do(n.reg.check_peer_registration("p", 1, "dnode", "dec0", ((500, 501),), 1))
    n.register("p", PUSHER, [[10, 11, 12, 13, 14]])
    trimmed = n.reg.plan_trim("p", 1)
    assert trimmed.src == ((13, 14),)
    assert trimmed.dst == ((500, 501),)
    assert (trimmed.src_before, trimmed.dst_before) == ((5,), (2,))


def test_plan_trim_at_kernel_granularity() -> None:
    n = Node()
    # Prefill: 2 kernel blocks per logical; logical 10..14 -> kernel 20..29.
    n.do(n.reg.check_peer_registration("p", 1, "dnode", "dec0", ((700, 701, 702),), 1))
    n.register("p", PUSHER, [[10, 11, 12, 13, 14]], engine="pre2")
    trimmed = n.reg.plan_trim("p", 1)
    assert trimmed.src == ((27, 28, 29),)
    assert trimmed.dst == ((700, 701, 702),)


def test_plan_trim_full_hit_writes_nothing() -> None:
    n = Node()
    # Receiver side: a full hit registers zero blocks and owns nothing.
    n.register("r", RECEIVER, [[]])
    assert n.reg.owned_blocks() == {}
    # Pusher side.
    n.pusher_ready("p", ((),), [10, 11, 12])
    rec = n.reg.live["p"]
    assert (rec.src, rec.dst) == (((),), ((),))


# -------------------------------------------------------- deadlines


def _drive_deadlines(n: Node, rid: str, inc: int, max_rounds: int = 6) -> list[type]:
    """Expire everything due, round after round, until ``rid`` is gone."""
    seen: list[type] = []
    for _ in range(max_rounds):
        if rid not in n.reg.live and rid not in n.reg.pending:
            return seen
        n.now += 1000.0
        for due in n.reg.expired(n.now):
            event = n.reg.on_deadline(due)
            seen.append(type(event))
            n.do(event)
    assert rid not in n.reg.live and rid not in n.reg.pending, seen
    return seen


def _pusher_in(state: State, deferred: bool = False) -> Callable[[Node], None]:
    def setup(n: Node) -> None:
        if state is State.REGISTERED:
            n.register("x", PUSHER, [[1, 2]])
            return
        n.pusher_ready("x", ((500,),), [1, 2])
        if state is State.TRIMMED:
            return
        n.do(WriteStarted("x", 1, 1, 1))
        if deferred:
            n.release("x")
        if state is State.DONE:
            n.do(WriteDone("x", 1))
        elif state is State.FAILED:
            n.do(Failed("x", 1, Reason.TRANSFER_ERROR, "e"))

    return setup


def _receiver_in(state: State, settled: bool = False, deferred: bool = False):
    def setup(n: Node) -> None:
        n.register("x", RECEIVER, [[5, 6]])
        if state in (State.WRITING, State.DONE):
            n.do(WriteStarted("x", 1, 2, 1))
        if state is State.DONE:
            n.do(WriteDone("x", 1))
        if state is State.FAILED:
            n.do(Failed("x", 1, Reason.PEER_DEAD, "p", settled=settled))
            if deferred:
                n.release("x")

    return setup


DEADLINE_CASES = {
    "pending": lambda n: n.do(n.reg.check_peer_registration("x", 1, "d", "dec0", ((1,),), 1)),
    "pusher-registered": _pusher_in(State.REGISTERED),
    "pusher-trimmed": _pusher_in(State.TRIMMED),
    "pusher-writing": _pusher_in(State.WRITING),
    "pusher-writing-deferred": _pusher_in(State.WRITING, deferred=True),
    "pusher-done": _pusher_in(State.DONE),
    "pusher-failed": _pusher_in(State.FAILED),
    "receiver-registered": _receiver_in(State.REGISTERED),
    "receiver-writing": _receiver_in(State.WRITING),
    "receiver-done": _receiver_in(State.DONE),
    "receiver-failed-unsettled": _receiver_in(State.FAILED),
    "receiver-failed-unsettled-deferred": _receiver_in(State.FAILED, deferred=True),
    "receiver-failed-settled": _receiver_in(State.FAILED, settled=True),
}


@pytest.mark.parametrize("setup", DEADLINE_CASES.values(), ids=DEADLINE_CASES.keys())
def test_deadlines_lead_every_request_to_released(setup: Callable[[Node], None]) -> None:
    n = Node()
    setup(n)
    assert "x" in n.reg.live or "x" in n.reg.pending
    assert n.reg.expired(n.now) == []  # nothing is due before its deadline
    kinds = _drive_deadlines(n, "x", 1)
    assert kinds, "no deadline fired"
    assert_gone(n.reg, "x", 1)
    assert n.reg.owned_blocks() == {}


def test_receiver_deadline_fences_before_release() -> None:
    n = Node()
    _receiver_in(State.WRITING)(n)
    kinds = _drive_deadlines(n, "x", 1)
    assert kinds == [Failed, PeerSettled, Released]


def test_deadline_not_due_early() -> None:
    n = Node(deadlines=Deadlines(registered=10.0))
    n.now = 5.0
    n.register("x", RECEIVER, [[1]])
    assert n.reg.expired(14.999) == []
    assert [r.request_id for r in n.reg.expired(15.0)] == ["x"]  # type: ignore[union-attr]


def test_next_deadline_is_the_earliest_of_live_and_pending() -> None:
    # The daemon's deadline loop sleeps until it (daemon/node/runtime.py).
    n = Node(deadlines=Deadlines(registered=10.0))
    assert n.reg.next_deadline() is None
    n.now = 5.0
    n.register("x", RECEIVER, [[1]])
    assert n.reg.next_deadline() == 15.0
    n.now = 2.0  # a pending registration, received earlier on the clock
    n.do(n.reg.check_peer_registration("p", 1, "dnode", "dec0", ((5,),), 1))
    assert n.reg.next_deadline() == 12.0
    assert n.reg.expired(12.0) != [] and n.reg.expired(11.999) == []


# ------------------------------------------------------- tombstones


def test_tombstone_bound_evicts_oldest() -> None:
    n = Node(tombstone_limit=2)
    for rid in ("a", "b", "c"):
        n.register(rid, PUSHER, [[1]])
        n.release(rid)
    assert len(n.reg.tombstones) == 2
    assert n.reg.tombstones.get("a") is None
    assert n.reg.tombstones.covers("b", 1) and n.reg.tombstones.covers("c", 1)
    for rid in ("b", "c"):
        with pytest.raises(Refusal) as info:
            n.reg.check_register(rid, 1, PUSHER, "pre0", "peer", [[1]])
        assert info.value.reason is Reason.STALE_INCARNATION
    # The evicted one is forgotten (the bound is a trade-off, by design).
    n.register("a", PUSHER, [[1]])


def test_tombstone_keeps_highest_incarnation() -> None:
    n = Node()
    n.register("a", PUSHER, [[1]], inc=5)
    n.release("a", 5)
    for inc in (1, 5):
        with pytest.raises(Refusal):
            n.reg.check_register("a", inc, PUSHER, "pre0", "peer", [[1]])
    n.register("a", PUSHER, [[1]], inc=6)


# -------------------------------------------------------- snapshots


def _busy_node() -> Node:
    n = Node(tombstone_limit=50)
    n.register("r1", RECEIVER, [[1, 2]])
    n.register("r2", RECEIVER, [[0], [1]], engine="two")
    n.register("r3", RECEIVER, [[4]], engine="wide")
    _aborted_receiver_while_writing(n)
    _pusher_writing(n)
    n.do(n.reg.check_peer_registration("q", 1, "d", "dec0", ((9,),), 1))
    _receiver_in(State.DONE)(n)
    n.release("x")
    n.now = 77.5
    n.register("p2", PUSHER, [[1, 2, 3]], engine="pre2", inc=4)
    n.do(KvReady("p2", 4))
    return n


def test_snapshot_round_trip() -> None:
    n = _busy_node()
    snap = n.reg.snapshot(42)
    assert snap.last_seq == 42
    assert len(snap.live) == 6 and len(snap.pending) == 1 and len(snap.tombstones) == 1
    restored = Registry.from_snapshot(snap, tombstone_limit=50)
    assert restored.snapshot(42) == snap
    assert restored.owned_blocks() == n.reg.owned_blocks()
    # Through the wire format too.
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(snap), type=RegistrySnapshot)
    assert wire == snap
    again = Registry.from_snapshot(wire, tombstone_limit=50)
    assert again.snapshot(42) == snap
    # And the restored registry behaves the same.
    with pytest.raises(Refusal) as info:
        again.check_register("z", 1, RECEIVER, "dec0", "peer", [[2]])
    assert info.value.reason is Reason.BLOCKS_OWNED
    with pytest.raises(Refusal) as info:
        again.check_register("x", 1, RECEIVER, "dec0", "peer", [[900]])
    assert info.value.reason is Reason.STALE_INCARNATION


def test_pending_snapshot_keeps_received_at() -> None:
    n = Node()
    n.now = 12.0
    n.do(n.reg.check_peer_registration("q", 1, "d", "dec0", ((9,),), 1))
    restored = Registry.from_snapshot(n.reg.snapshot(0))
    assert restored.pending["q"] == PendingPeer(
        PeerRegistered("q", 1, "d", "dec0", ((9,),), 1), 12.0
    )


# ------------------------------------------ answered receivers (issue 47)
#
# A receiver registered from the prefill's answer (the prefill finished the
# request, so its engine registers the push within a step or two) waits
# pending on the prefill side for ``answered``, not ``registered``: an answer
# naming a transfer this prefill never had fails that soon.

SHORT = Deadlines(registered=30.0, answered=2.0)


def _forward(n: Node, rid: str, *, answered: bool, inc: int = 1) -> None:
    event = n.reg.check_peer_registration(
        rid, inc, "dnode", "dec0", ((500, 501),), 1, answered=answered
    )
    assert event.answered is answered
    assert n.do(event) is None  # pending: this node has no such request


def _expire(n: Node, now: float) -> list[RequestEvent]:
    """The deadline loop's round at ``now``: each due item's event, journaled and applied."""
    n.now = now
    events = [n.reg.on_deadline(due) for due in n.reg.expired(now)]
    n.do(events)
    return events


def test_an_answered_receiver_whose_push_never_comes_fails_at_the_short_deadline() -> None:
    n = Node(deadlines=SHORT)
    n.now = 100.0
    _forward(n, "stale", answered=True)
    assert n.reg.next_deadline() == 102.0
    assert n.reg.expired(101.999) == []
    (failed,) = _expire(n, 102.0)
    assert isinstance(failed, Failed) and failed.settled
    assert failed.reason is Reason.UNKNOWN_REQUEST
    assert "the answer names transfer stale, which this prefill never had" in failed.message
    assert_gone(n.reg, "stale", 1)
    # A push registered after that is stale: its engine hears at once, nothing waits.
    with pytest.raises(Refusal) as info:
        n.register("stale", PUSHER, [[10, 11]])
    assert info.value.reason is Reason.STALE_INCARNATION


def test_an_answered_receiver_whose_push_registers_inside_the_short_deadline_pairs() -> None:
    """The usual race: the receiver's forward lands a few milliseconds before the push."""
    n = Node(deadlines=SHORT)
    _forward(n, "raced", answered=True)
    n.now = 1.999
    rec = n.register("raced", PUSHER, [[10, 11, 12]])
    assert n.reg.pending == {}
    assert rec.remote_blocks == ((500, 501),)
    assert rec.deadline == 1.999 + SHORT.registered  # the pairing's wait, as before
    assert _expire(n, 2.5) == []
    n.do(KvReady("raced", 1))
    trimmed = n.reg.plan_trim("raced", 1)
    assert trimmed.dst == ((500, 501),)


def test_a_receiver_sent_with_the_prefills_leg_keeps_the_registered_deadline() -> None:
    """Both legs at once: the prefill may not have started, so it waits the whole ``registered``."""
    n = Node(deadlines=SHORT)
    _forward(n, "concurrent", answered=False)
    assert n.reg.next_deadline() == 30.0
    assert _expire(n, 29.9) == []
    (failed,) = _expire(n, 30.0)
    assert isinstance(failed, Failed) and failed.reason is Reason.DEADLINE_EXCEEDED
    assert_gone(n.reg, "concurrent", 1)


def test_the_answered_deadline_is_never_longer_than_registered() -> None:
    n = Node(deadlines=Deadlines(registered=1.0, answered=2.0))
    _forward(n, "a", answered=True)
    assert n.reg.next_deadline() == 1.0


def test_an_answer_naming_a_push_that_already_ended_is_refused_at_once() -> None:
    """A stale id this prefill had: its tombstone (released) or its end (failed) refuses it."""
    n = Node(deadlines=SHORT)
    n.register("released", PUSHER, [[10]])
    n.do(Failed("released", 1, Reason.DEADLINE_EXCEEDED, "unclaimed"))
    n.release("released")
    assert "released" not in n.reg.live
    with pytest.raises(Refusal) as info:
        n.reg.check_peer_registration("released", 1, "d", "dec0", ((5,),), 1, answered=True)
    assert info.value.reason is Reason.STALE_INCARNATION
    n.register("ended", PUSHER, [[11]])
    n.do(Failed("ended", 1, Reason.DEADLINE_EXCEEDED, "unclaimed"))
    with pytest.raises(Refusal) as info:
        n.reg.check_peer_registration("ended", 1, "d", "dec0", ((6,),), 1, answered=True)
    assert info.value.reason is Reason.ILLEGAL_TRANSITION
    assert n.reg.pending == {}


def test_a_receiver_registration_keeps_answered_and_a_pushers_drops_it() -> None:
    n = Node()
    receiver = n.reg.check_register("r", 1, RECEIVER, "dec0", "p", [[1]], answered=True)
    pusher = n.reg.check_register("q", 1, PUSHER, "pre0", "p", [[1]], answered=True)
    assert (receiver.answered, pusher.answered) == (True, False)
    rec = n.do(receiver)
    assert rec is not None and rec.answered
    assert rec.deadline == n.reg.deadlines.registered  # the receiver's own wait is unchanged


def test_answered_registrations_replay_and_old_records_read_as_not_answered() -> None:
    """The journal holds the flag: a fold of the records rebuilds the same registry."""
    n = Node(deadlines=SHORT)
    log: list[tuple[object, float]] = []

    def do(event: object) -> None:
        log.append((event, n.now))
        n.do(event)

    do(n.reg.check_register("r", 1, RECEIVER, "dec0", "p", [[1]], answered=True))
    do(n.reg.check_peer_registration("a", 1, "d", "dec0", ((5,),), 1, answered=True))
    do(n.reg.check_peer_registration("b", 1, "d", "dec0", ((6,),), 1))
    n.now = 2.0
    for due in n.reg.expired(n.now):
        do(n.reg.on_deadline(due))
    assert set(n.reg.pending) == {"b"}
    codec = msgspec.msgpack.Decoder(Event)
    replayed = Node(deadlines=SHORT)
    for event, ts in log:
        replayed.reg.apply(codec.decode(msgspec.msgpack.encode(event)), ts)
    assert replayed.reg.snapshot(0) == n.reg.snapshot(0)
    assert replayed.reg.live["r"].answered
    # Records written before the field existed: positional, without its last element.
    for event in (log[0][0], log[1][0]):
        fields = msgspec.msgpack.decode(msgspec.msgpack.encode(event))
        old = codec.decode(msgspec.msgpack.encode(fields[:-1]))
        assert old == msgspec.structs.replace(event, answered=False)  # type: ignore[type-var]


# ------------------------------------- plan/check results must apply
#
# The shell journals what a check_/plan_ method returns and then applies it;
# an event the core hands out but then refuses to apply is a poison record
# (replay of that journal would fail). These pin the contract.


def _returned_events_apply(n: Node, events: RequestEvent | list[RequestEvent] | None) -> None:
    if events is None:
        return
    before = n.reg.snapshot(0)
    try:
        n.do(events)
    except Refusal as exc:  # pragma: no cover - reports a core bug
        assert n.reg.snapshot(0) == before
        pytest.fail(f"core returned {events!r} and then refused to apply it: {exc}")


def test_plan_trim_refuses_once_trimmed() -> None:
    n = Node()
    n.pusher_ready("p", ((500, 501),), [10, 11, 12, 13, 14])
    try:
        again = n.reg.plan_trim("p", 1)
    except Refusal as exc:
        assert exc.reason is Reason.ILLEGAL_TRANSITION
        return
    _returned_events_apply(n, again)


def test_plan_trim_refuses_failed_pusher() -> None:
    n = Node()
    n.do(n.reg.check_peer_registration("p", 1, "dnode", "dec0", ((500,),), 1))
    n.register("p", PUSHER, [[10]])
    n.do(Failed("p", 1, Reason.PEER_DEAD, "gone"))
    try:
        trimmed = n.reg.plan_trim("p", 1)
    except Refusal as exc:
        assert exc.reason is Reason.ILLEGAL_TRANSITION
        return
    _returned_events_apply(n, trimmed)


def test_late_peer_registration_for_failed_pusher_is_refused_by_check() -> None:
    n = Node()
    n.register("p", PUSHER, [[10]])
    n.do(Failed("p", 1, Reason.DEADLINE_EXCEEDED, "late receiver"))
    try:
        event = n.reg.check_peer_registration("p", 1, "dnode", "dec0", ((500,),), 1)
    except Refusal:
        return
    _returned_events_apply(n, event)


def test_receiver_registration_refused_while_same_id_pending_as_pusher() -> None:
    """A pending peer registration makes this node the pusher for that id.

    If a local engine may then register the same id as a *receiver*, the
    pending registration's deadline Failed(settled=True) is applied to the
    receiver record and marks it settled: its blocks could be released while
    the real pusher may still write into them (invariant 2).
    """
    n = Node()
    n.do(n.reg.check_peer_registration("z", 1, "dnode", "dec0", ((5,),), 1))
    n.now = 10.0
    try:
        n.register("z", RECEIVER, [[7]])
    except Refusal as exc:
        assert exc.reason in (Reason.ROLE_MISMATCH, Reason.DUPLICATE_REQUEST)
        return
    # Accepted: show the consequence. The pending registration expires first.
    due = [d for d in n.reg.expired(35.0) if isinstance(d, PendingPeer)]
    assert due
    n.now = 35.0
    n.do(n.reg.on_deadline(due[0]))
    rec = n.reg.live.get("z")
    assert rec is None or is_quarantined(rec), (
        "the receiver was marked settled by the pusher-side pending deadline"
    )


def test_pending_deadline_applies_while_other_incarnation_is_live() -> None:
    n = Node()
    n.do(n.reg.check_peer_registration("w", 2, "dnode", "dec0", ((5,),), 1))
    try:
        n.register("w", PUSHER, [[7]], inc=1)
    except Refusal:
        return  # the two incarnations cannot coexist: nothing to get stuck
    n.now = 1000.0
    pend = [d for d in n.reg.expired(n.now) if isinstance(d, PendingPeer)]
    assert len(pend) == 1
    _returned_events_apply(n, n.reg.on_deadline(pend[0]))
    assert "w" not in n.reg.pending


# ------------------------------------------------------------------ holds


def test_a_hold_extends_a_waiting_pusher_by_one_registered_deadline_up_to_the_bound() -> None:
    n = Node(deadlines=Deadlines(registered=10.0, held=25.0, unclaimed=10.0))
    rec = n.register("p", PUSHER, [[1, 2]])
    assert rec.deadline == 10.0
    n.now = 6.0
    held = n.reg.check_hold(rec, n.now)
    assert held is not None and held.until == 16.0
    rec = n.do(held)
    assert rec is not None and rec.deadline == 16.0
    n.now = 20.0  # the bound (registration + 25) caps the next one
    held = n.reg.check_hold(rec, n.now)
    assert held is not None and held.until == 25.0
    rec = n.do(held)
    assert rec is not None
    # At the bound a hold lengthens nothing: nothing to journal.
    assert n.reg.check_hold(rec, 24.0) is None
    assert [r.request_id for r in n.reg.expired(25.0)] == ["p"]


def test_a_hold_is_refused_for_a_receiver_and_a_pusher_already_paired() -> None:
    n = Node()
    receiver = n.register("r", RECEIVER, [[1]])
    with pytest.raises(Refusal) as refused:
        n.reg.check_hold(receiver, 1.0)
    assert refused.value.reason is Reason.ROLE_MISMATCH
    n.do(n.reg.check_peer_registration("p", 1, "dnode", "dec0", ((500,),), 1))
    paired = n.register("p", PUSHER, [[10]])
    with pytest.raises(Refusal) as refused:
        n.reg.check_hold(paired, 1.0)
    assert refused.value.reason is Reason.ILLEGAL_TRANSITION
