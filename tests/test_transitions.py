"""The transition table and ``statemachine.apply``, exhaustively.

Every (role, state, event type) triple is one test id: either the table lists
it (and, with the record's flags set so the guards pass, ``apply`` lands in the
table's target) or it does not (and ``apply`` refuses with ILLEGAL_TRANSITION,
leaving the record as it was).
"""

from __future__ import annotations

import copy
import typing

import msgspec
import pytest

import statemachine
from schemas import events as ev
from schemas.events import (
    Failed,
    KvReady,
    PeerRegistered,
    PeerSettled,
    Registered,
    Released,
    ReleaseDeferred,
    Trimmed,
    WriteDone,
    WriteStarted,
)
from schemas.layout import Role
from schemas.reasons import Reason
from schemas.state import Deadlines, RequestRecord, State
from statemachine import TRANSITIONS, IllegalTransition, is_quarantined, transitions

RID, INC = "req-1", 3
DEADLINES = Deadlines(registered=11.0, trimmed=13.0, writing=17.0, done=19.0, failed=23.0)
TS = 1000.0

# Every request event but Registered (which creates records rather than moving them).
EVENT_TYPES: tuple[type, ...] = tuple(
    t for t in typing.get_args(ev.RequestEvent) if t is not Registered
)


def make_event(kind: type, request_id: str = RID, incarnation: int = INC) -> ev.RequestEvent:
    """One instance of each request event type, for the given key."""
    args: dict[type, tuple] = {
        PeerRegistered: ("decode-node", "dec0", ((500, 501),), 1),
        KvReady: (),
        Trimmed: (((13, 14),), ((500, 501),), (5,), (2,)),
        WriteStarted: (2, 8192),
        WriteDone: (),
        Failed: (Reason.TRANSFER_ERROR, "boom"),
        PeerSettled: (),
        ReleaseDeferred: (),
        Released: (),
        ev.Refused: ("pre0", Reason.UNKNOWN_REQUEST, "late"),
        ev.IntegrityMismatch: (10, 1, ((0, 1, 500),)),
        # Before the record's deadline: a hold that lengthens nothing.
        ev.Held: (30.0,),
    }
    return kind(request_id, incarnation, *args[kind])


def make_record(role: Role, state: State, **flags: object) -> RequestRecord:
    base = RequestRecord(
        request_id=RID,
        incarnation=INC,
        role=role,
        engine_id="pre0" if role is Role.PUSHER else "dec0",
        peer="other-node",
        state=state,
        blocks=((10, 11, 12, 13, 14),) if role is Role.PUSHER else ((500, 501),),
        entered_at=5.0,
        deadline=5.0 + 42.0,
    )
    return msgspec.structs.replace(base, **flags)


def flags_passing_guards(role: Role, state: State, kind: type) -> dict[str, object]:
    """Record flags under which the guards accept ``kind`` (where that is possible)."""
    if kind in (PeerRegistered, ev.Held):
        return {"remote_blocks": None}
    if kind is KvReady:
        return {"kv_ready": False, "remote_blocks": ((500, 501),)}
    if kind is Trimmed:
        return {"remote_blocks": ((500, 501),), "remote_engine": "dec0"}
    if kind is WriteStarted:
        return {"kv_ready": True, "remote_blocks": ((500, 501),), "src": ((13, 14),)}
    if kind is Released:
        return {"settled": True}  # only receivers are quarantined by the flag
    if kind is ReleaseDeferred:
        return {"settled": False, "release_pending": False}
    return {}


TRIPLES = [(role, state, kind) for role in Role for state in State for kind in EVENT_TYPES]


def test_event_types_cover_the_request_union() -> None:
    names = {t.__name__ for t in EVENT_TYPES}
    assert names >= {
        "PeerRegistered",
        "KvReady",
        "Trimmed",
        "WriteStarted",
        "WriteDone",
        "Failed",
        "PeerSettled",
        "ReleaseDeferred",
        "Released",
    }
    # The table only mentions request event types this file enumerates.
    for row in TRANSITIONS.values():
        assert set(row) <= set(EVENT_TYPES)


@pytest.mark.parametrize(
    ("role", "state", "kind"),
    TRIPLES,
    ids=[f"{r.value}-{s.value}-{k.__name__}" for r, s, k in TRIPLES],
)
def test_table_is_exhaustive(role: Role, state: State, kind: type) -> None:
    record = make_record(role, state, **flags_passing_guards(role, state, kind))
    before = copy.deepcopy(record)
    event = make_event(kind)
    target = TRANSITIONS.get((role, state), {}).get(kind)
    if target is None:
        with pytest.raises(IllegalTransition) as info:
            statemachine.apply(record, event, TS, DEADLINES)
        assert info.value.reason is Reason.ILLEGAL_TRANSITION
        assert record == before
        return
    after = statemachine.apply(record, event, TS, DEADLINES)
    assert after.state is target
    assert record == before  # the input record is never modified
    if target is state:
        # A self-loop keeps the clock of the state it is in.
        assert (after.entered_at, after.deadline) == (before.entered_at, before.deadline)
    else:
        assert after.entered_at == TS


# ---------------------------------------------------------------- guards


def _refused(record: RequestRecord, event: ev.RequestEvent) -> None:
    before = copy.deepcopy(record)
    with pytest.raises(IllegalTransition) as info:
        statemachine.apply(record, event, TS, DEADLINES)
    assert info.value.reason is Reason.ILLEGAL_TRANSITION
    assert record == before


def test_write_started_needs_kv_ready_on_pusher() -> None:
    trimmed = make_record(Role.PUSHER, State.TRIMMED, remote_blocks=((500, 501),), kv_ready=False)
    _refused(trimmed, make_event(WriteStarted))
    ready = msgspec.structs.replace(trimmed, kv_ready=True)
    assert statemachine.apply(ready, make_event(WriteStarted), TS, DEADLINES).state is State.WRITING


def test_receiver_write_started_has_no_kv_ready_guard() -> None:
    rec = make_record(Role.RECEIVER, State.REGISTERED, kv_ready=False)
    assert statemachine.apply(rec, make_event(WriteStarted), TS, DEADLINES).state is State.WRITING


@pytest.mark.parametrize("role", list(Role))
def test_released_refused_while_quarantined(role: Role) -> None:
    if role is Role.RECEIVER:
        rec = make_record(role, State.FAILED, settled=False)
    else:
        # The pusher is quarantined only while writing, where Released is not in
        # the table at all; either way it is refused.
        rec = make_record(role, State.WRITING, kv_ready=True)
    assert is_quarantined(rec)
    _refused(rec, make_event(Released))


def test_receiver_released_after_settle() -> None:
    rec = make_record(Role.RECEIVER, State.FAILED, settled=False)
    settled = statemachine.apply(rec, make_event(PeerSettled), TS, DEADLINES)
    assert settled.settled and not is_quarantined(settled)
    assert statemachine.apply(settled, make_event(Released), TS, DEADLINES).state is State.RELEASED


def test_release_deferred_refused_when_not_quarantined() -> None:
    rec = make_record(Role.RECEIVER, State.FAILED, settled=True)
    assert not is_quarantined(rec)
    _refused(rec, make_event(ReleaseDeferred))


def test_release_deferred_refused_twice() -> None:
    rec = make_record(Role.PUSHER, State.WRITING, kv_ready=True)
    deferred = statemachine.apply(rec, make_event(ReleaseDeferred), TS, DEADLINES)
    assert deferred.release_pending and deferred.state is State.WRITING
    _refused(deferred, make_event(ReleaseDeferred))


def test_trimmed_refused_before_receiver_registration() -> None:
    rec = make_record(Role.PUSHER, State.REGISTERED, remote_blocks=None)
    _refused(rec, make_event(Trimmed))


def test_peer_registered_refused_twice() -> None:
    rec = make_record(Role.PUSHER, State.REGISTERED)
    once = statemachine.apply(rec, make_event(PeerRegistered), TS, DEADLINES)
    assert once.remote_blocks == ((500, 501),)
    assert once.remote_engine == "dec0"
    _refused(once, make_event(PeerRegistered))


def test_kv_ready_refused_twice() -> None:
    rec = make_record(Role.PUSHER, State.REGISTERED)
    once = statemachine.apply(rec, make_event(KvReady), TS, DEADLINES)
    assert once.kv_ready
    _refused(once, make_event(KvReady))


@pytest.mark.parametrize(
    ("request_id", "incarnation"),
    [(RID, INC - 1), (RID, INC + 1), ("other", INC)],
    ids=["older-incarnation", "newer-incarnation", "other-id"],
)
def test_event_for_another_request_refused(request_id: str, incarnation: int) -> None:
    rec = make_record(Role.PUSHER, State.REGISTERED)
    # KvReady is legal for the record itself, so only the key can refuse it.
    statemachine.apply(rec, make_event(KvReady), TS, DEADLINES)
    _refused(rec, make_event(KvReady, request_id, incarnation))


def test_failed_keeps_settled_and_records_reason() -> None:
    rec = make_record(Role.RECEIVER, State.WRITING)
    failed = statemachine.apply(
        rec, Failed(RID, INC, Reason.CANCELLED_BY_PEER, "gone", settled=True), TS, DEADLINES
    )
    assert (failed.state, failed.reason, failed.message, failed.settled) == (
        State.FAILED,
        Reason.CANCELLED_BY_PEER,
        "gone",
        True,
    )
    unsettled = statemachine.apply(rec, make_event(Failed), TS, DEADLINES)
    assert not unsettled.settled and is_quarantined(unsettled)


# ------------------------------------------------------------- deadlines

ENTERING = [
    (role, state, kind, target)
    for (role, state), row in TRANSITIONS.items()
    for kind, target in row.items()
    if target is not state
]


@pytest.mark.parametrize(
    ("role", "state", "kind", "target"),
    ENTERING,
    ids=[f"{r.value}-{s.value}-{k.__name__}-{t.value}" for r, s, k, t in ENTERING],
)
@pytest.mark.parametrize("ts", [0.0, 12345.5])
def test_entering_a_state_sets_its_deadline_from_the_event_ts(
    role: Role, state: State, kind: type, target: State, ts: float
) -> None:
    rec = make_record(role, state, **flags_passing_guards(role, state, kind))
    after = statemachine.apply(rec, make_event(kind), ts, DEADLINES)
    assert after.state is target
    assert after.entered_at == ts
    if target is State.RELEASED:
        assert after.deadline == ts
    else:
        assert after.deadline == ts + DEADLINES.for_state(target)


@pytest.mark.parametrize(
    ("role", "state", "kind", "target"),
    ENTERING,
    ids=[f"{r.value}-{s.value}-{k.__name__}-{t.value}" for r, s, k, t in ENTERING],
)
def test_flattened_deadlines_give_the_same_record(
    role: Role, state: State, kind: type, target: State
) -> None:
    """The registry's hot path passes pre-flattened deadlines; same outcome."""
    flatten = getattr(transitions, "deadline_seconds", None)
    if flatten is None:
        pytest.skip("no flattened deadlines in this core")
    rec = make_record(role, state, **flags_passing_guards(role, state, kind))
    event = make_event(kind)
    assert statemachine.apply(rec, event, TS, flatten(DEADLINES)) == statemachine.apply(
        rec, event, TS, DEADLINES
    )


def test_deadlines_are_distinct_per_state() -> None:
    # Pins that for_state looks up the state's own field (the values are distinct).
    values = [DEADLINES.for_state(s) for s in State if s is not State.RELEASED]
    assert values == [11.0, 13.0, 17.0, 19.0, 23.0]
    assert len(set(values)) == len(values)


# --------------------------------------------------- the table is the source


def _edges(role: Role) -> dict[State, set[State]]:
    out: dict[State, set[State]] = {}
    for (r, state), row in TRANSITIONS.items():
        if r is role:
            out.setdefault(state, set()).update(row.values())
    return out


def _reachable(edges: dict[State, set[State]], start: State) -> set[State]:
    seen, todo = {start}, [start]
    while todo:
        for nxt in edges.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


R, T, W, D, X, F = (
    State.REGISTERED,
    State.TRIMMED,
    State.WRITING,
    State.DONE,
    State.RELEASED,
    State.FAILED,
)
# A golden copy of the documented lifecycle (README, ARCHITECTURE.md): the exhaustive
# test above checks that apply() follows TRANSITIONS; this one catches an accidental
# edit of the table.
DOCUMENTED = {
    (Role.PUSHER, R): {PeerRegistered: R, KvReady: R, ev.Held: R, Trimmed: T, Failed: F},
    (Role.PUSHER, T): {KvReady: T, WriteStarted: W, Failed: F},
    (Role.PUSHER, W): {WriteDone: D, Failed: F, ReleaseDeferred: W},
    (Role.PUSHER, D): {Released: X},
    (Role.PUSHER, F): {Released: X},
    (Role.RECEIVER, R): {WriteStarted: W, WriteDone: D, ev.IntegrityMismatch: R, Failed: F},
    (Role.RECEIVER, W): {WriteDone: D, ev.IntegrityMismatch: W, Failed: F},
    (Role.RECEIVER, D): {Released: X},
    (Role.RECEIVER, F): {PeerSettled: F, ReleaseDeferred: F, Released: X},
}


def test_table_matches_the_documented_lifecycle() -> None:
    actual = {key: dict(row) for key, row in TRANSITIONS.items() if row}
    assert actual == DOCUMENTED


def test_released_has_no_outgoing_transitions() -> None:
    for role in Role:
        assert (role, State.RELEASED) not in TRANSITIONS or not TRANSITIONS[(role, State.RELEASED)]


def test_only_released_event_enters_released() -> None:
    for row in TRANSITIONS.values():
        for kind, target in row.items():
            assert (target is State.RELEASED) == (kind is Released)


@pytest.mark.parametrize(
    ("role", "expected"),
    [
        (Role.PUSHER, set(State)),
        (
            Role.RECEIVER,
            {State.REGISTERED, State.WRITING, State.DONE, State.FAILED, State.RELEASED},
        ),
    ],
)
def test_lifecycle_walks_the_documented_states(role: Role, expected: set[State]) -> None:
    assert _reachable(_edges(role), State.REGISTERED) == expected


@pytest.mark.parametrize("role", list(Role))
def test_every_live_state_reaches_released(role: Role) -> None:
    """Invariant 7, structurally: no state of the table is a dead end."""
    edges = _edges(role)
    for state in _reachable(edges, State.REGISTERED) - {State.RELEASED}:
        assert State.RELEASED in _reachable(edges, state), (role, state)
        # Every live state also has a deadline, so the shell can force it on.
        assert DEADLINES.for_state(state) > 0
        # And every state can fail or is one step from release.
        row = TRANSITIONS[(role, state)]
        assert Failed in row or Released in row, (role, state)


def test_a_hold_lengthens_a_waiting_pushers_deadline_and_never_shortens_it() -> None:
    record = make_record(Role.PUSHER, State.REGISTERED, remote_blocks=None)
    later = statemachine.apply(record, ev.Held(RID, INC, 90.0), TS, DEADLINES)
    assert (later.state, later.entered_at, later.deadline) == (State.REGISTERED, 5.0, 90.0)
    sooner = statemachine.apply(later, ev.Held(RID, INC, 60.0), TS, DEADLINES)
    assert sooner.deadline == 90.0
    # Once the receiver's registration arrived there is nothing to hold.
    paired = make_record(Role.PUSHER, State.REGISTERED, remote_blocks=((500, 501),))
    with pytest.raises(IllegalTransition, match="already arrived"):
        statemachine.apply(paired, ev.Held(RID, INC, 90.0), TS, DEADLINES)
