"""The notices table (statemachine/notices.py): who is told of what, as a table.

Each row: the role, the event journaled and its cause, and the messages the
engine and the peer are owed. Every row of NOTICES is pinned here, and every
combination not in the table must owe nothing (the engine that caused a
transition hears its reply, a peer that caused it already knows, a dead peer
cannot hear, a restart tells on return).
"""

from __future__ import annotations

import itertools

import pytest

from schemas import peer as pm
from schemas import rpc
from schemas.events import (
    Failed,
    IntegrityMismatch,
    KvReady,
    PeerSettled,
    Refused,
    Registered,
    Released,
    ReleaseDeferred,
    Trimmed,
    WriteDone,
    WriteStarted,
)
from schemas.fingerprint import Fingerprint
from schemas.layout import EngineLayout, GroupKind, GroupLayout, Role
from schemas.reasons import Reason
from schemas.state import State
from statemachine.notices import (
    NOTICES,
    PENDING,
    final_word,
    notices,
    on_engine_back,
    on_peer_back,
)
from statemachine.reactions import Cause
from tests.support.records import record

P, R = Role.PUSHER, Role.RECEIVER
C = Cause
FAILED = Failed("r", 1, Reason.TRANSFER_ERROR, "boom")
REFUSED = Refused("r", 1, "e", Reason.BLOCKS_OWNED, "owned")
WRITE_DONE = WriteDone("r", 1)
RELEASED = Released("r", 1)
STARTED = WriteStarted("r", 1, 2, 128)
REGISTERED = Registered("r", 1, Role.RECEIVER, "e", "peer", ((4, 5),))
PRINT = Fingerprint("/models/tiny", dtype="float32", block_size=32)


# fmt: off
ROWS = [
    # role   event             cause        -> engine gets          peer gets
    (R,       REGISTERED,      C.ENGINE,    [],                   [pm.Forward]),
    (R,       WRITE_DONE,      C.DAEMON,    [rpc.KvArrived],      []),
    (R,       WRITE_DONE,      C.PEER,      [rpc.KvArrived],      []),
    (R,       FAILED,          C.ENGINE,    [],                   [pm.Cancel]),
    (R,       FAILED,          C.PEER,      [rpc.RequestFailed],  []),
    (R,       FAILED,          C.PEER_DEAD, [rpc.RequestFailed],  []),
    (R,       FAILED,          C.DAEMON,    [rpc.RequestFailed],  [pm.Cancel]),
    (R,       RELEASED,        C.DAEMON,    [rpc.Released],       []),
    (P,       STARTED,         C.DAEMON,    [],                   [pm.Writing]),
    (P,       WRITE_DONE,      C.DAEMON,    [rpc.BlocksFreeable], [pm.WriteDone]),
    (P,       FAILED,          C.ENGINE,    [],                   [pm.WriteFailed]),
    (P,       FAILED,          C.PEER,      [rpc.RequestFailed],  [pm.WriteFailed]),
    (P,       FAILED,          C.PEER_DEAD, [rpc.RequestFailed],  []),
    (P,       FAILED,          C.DAEMON,    [rpc.RequestFailed],  [pm.WriteFailed]),
    (P,       RELEASED,        C.DAEMON,    [rpc.Released],       []),
    (P,       REFUSED,         C.PEER,      [],                   [pm.WriteFailed]),
    (PENDING, FAILED,          C.PEER,      [],                   [pm.WriteFailed]),
    (PENDING, FAILED,          C.DAEMON,    [],                   [pm.WriteFailed]),
]
# fmt: on


@pytest.mark.parametrize(("role", "event", "cause", "engine", "peer"), ROWS)
def test_each_row_owes_exactly_its_messages(role, event, cause, engine, peer):
    rec = None if role == PENDING or isinstance(event, Refused) else record(role)
    owed = notices(rec, event, cause, peer="asker")
    assert [type(n.message) for n in owed if n.to_engine] == engine
    assert [type(n.message) for n in owed if not n.to_engine] == peer
    for notice in owed:
        assert notice.to == ("e" if notice.to_engine else "peer" if rec else "asker")
        assert (notice.message.request_id, notice.message.incarnation) == ("r", 1)


def test_every_row_of_the_table_is_pinned():
    pinned = {(role, type(event), cause) for role, event, cause, _, _ in ROWS}
    assert set(NOTICES) == pinned


EVENTS = [
    Registered("r", 1, P, "e", "peer", ((4, 5),)),
    KvReady("r", 1),
    Trimmed("r", 1, ((4,),), ((5,),), (2,), (1,)),
    WriteStarted("r", 1, 1, 64),
    WriteDone("r", 1),
    FAILED,
    PeerSettled("r", 1),
    ReleaseDeferred("r", 1),
    Released("r", 1),
    REFUSED,
    IntegrityMismatch("r", 1, 4, 1, ((0, 0, 5),)),
]


def test_what_the_table_does_not_list_owes_nothing():
    for role, event, cause in itertools.product((P, R), EVENTS, Cause):
        if (role if not isinstance(event, Refused) else P, type(event), cause) in NOTICES:
            continue
        assert notices(record(role), event, cause) == [], (role, event, cause)


def test_nobody_is_told_anything_after_a_restart():
    for role, event in itertools.product((P, R, PENDING), EVENTS):
        rec = None if role == PENDING else record(role)
        assert notices(rec, event, Cause.RESTART, peer="x") == []


def test_failures_carry_the_events_reason_and_words():
    (to_engine, to_peer) = notices(record(P), FAILED, Cause.DAEMON)
    assert (to_engine.message.reason, to_engine.message.message) == (Reason.TRANSFER_ERROR, "boom")
    assert (to_peer.message.reason, to_peer.message.message) == (Reason.TRANSFER_ERROR, "boom")


def test_a_forward_carries_the_receiver_engines_ratio_and_fingerprint():
    layout = EngineLayout(
        "e", (GroupLayout(GroupKind.ATTENTION, 64, per_logical=4),), fingerprint=PRINT
    )
    event = Registered("r", 1, R, "e", "peer", ((4, 5),))
    (forward,) = notices(record(R, State.REGISTERED), event, Cause.ENGINE, layouts={"e": layout})
    assert forward.message == pm.Forward("r", 1, "e", ((4, 5),), 4, PRINT)


def test_an_engine_back_hears_the_outcome_of_its_finished_requests():
    assert on_engine_back(record(R, State.DONE)) == [rpc.KvArrived("r", 1)]
    assert on_engine_back(record(P, State.DONE)) == [rpc.BlocksFreeable("r", 1)]
    failed = record(P, State.FAILED, reason=Reason.PEER_DEAD, message="gone")
    assert on_engine_back(failed) == [rpc.RequestFailed("r", 1, Reason.PEER_DEAD, "gone")]
    assert on_engine_back(record(R, State.WRITING)) == []


def test_a_peer_back_hears_what_it_may_have_missed():
    two = EngineLayout("e", (GroupLayout(GroupKind.ATTENTION, 16, 2),), fingerprint=PRINT)
    assert on_peer_back(record(R, State.REGISTERED), two) == [
        pm.Forward("r", 1, "e", ((4, 5),), 2, PRINT)
    ]
    assert on_peer_back(record(R, State.REGISTERED), None) == [
        pm.Forward("r", 1, "e", ((4, 5),), 1, None)
    ]
    # A receiver registered from the prefill's answer says so again.
    assert on_peer_back(record(R, State.REGISTERED, answered=True), None) == [
        pm.Forward("r", 1, "e", ((4, 5),), 1, None, answered=True)
    ]
    assert on_peer_back(record(R, State.FAILED), None) == [pm.Cancel("r", 1)]
    assert on_peer_back(record(R, State.FAILED, settled=True), None) == []
    assert on_peer_back(record(P, State.DONE), None) == [pm.WriteDone("r", 1)]
    assert on_peer_back(record(P, State.WRITING), None) == []
    assert final_word(record(P, State.TRIMMED)) == []
