"""The reactions table (statemachine/reactions.py), row by row, as a table.

Each row: a stimulus, a record's role, state and flags, and the event kinds
the core must call for. A row that is not in REACTIONS must call for nothing;
a test below checks that every (stimulus, role, state) is covered here, so a
new cell in the table cannot go unpinned.
"""

from __future__ import annotations

import itertools

import pytest

from schemas.events import (
    Failed,
    IntegrityMismatch,
    PeerRegistered,
    PeerSettled,
    Released,
    ReleaseDeferred,
    WriteDone,
    WriteStarted,
)
from schemas.layout import Role
from schemas.reasons import Reason
from schemas.state import Deadlines, PendingPeer, State
from statemachine.reactions import (
    REACTIONS,
    Cause,
    Next,
    Stimulus,
    Why,
    awaiting_data,
    pusher_next,
    react,
    react_pending,
    release_may_be_due,
)
from statemachine.transitions import apply, deadline_seconds
from tests.support.records import record

P, R = Role.PUSHER, Role.RECEIVER
REG, TRIM, WRI, DONE, FAIL = (
    State.REGISTERED,
    State.TRIMMED,
    State.WRITING,
    State.DONE,
    State.FAILED,
)
S = Stimulus


# fmt: off
ROWS = [
    # stimulus            role state flags                         -> event kinds
    (S.ENGINE_ABORT,      P, REG,  {},                            [Failed]),
    (S.ENGINE_ABORT,      P, TRIM, {},                            [Failed]),
    (S.ENGINE_ABORT,      P, WRI,  {},                            [ReleaseDeferred]),
    (S.ENGINE_ABORT,      P, WRI,  {"release_pending": True},     []),
    (S.ENGINE_ABORT,      P, DONE, {},                            []),
    (S.ENGINE_ABORT,      R, REG,  {},                            [Failed]),
    (S.ENGINE_ABORT,      R, WRI,  {},                            [Failed]),
    (S.ENGINE_ABORT,      R, FAIL, {},                            []),
    (S.ENGINE_RELEASE,    P, REG,  {},                            [Failed, Released]),
    (S.ENGINE_RELEASE,    P, TRIM, {},                            [Failed, Released]),
    (S.ENGINE_RELEASE,    P, WRI,  {},                            [ReleaseDeferred]),
    (S.ENGINE_RELEASE,    P, WRI,  {"release_pending": True},     []),
    (S.ENGINE_RELEASE,    P, DONE, {},                            [Released]),
    (S.ENGINE_RELEASE,    P, FAIL, {},                            [Released]),
    (S.ENGINE_RELEASE,    R, REG,  {},                            [Failed, ReleaseDeferred]),
    (S.ENGINE_RELEASE,    R, WRI,  {},                            [Failed, ReleaseDeferred]),
    (S.ENGINE_RELEASE,    R, DONE, {"settled": True},             [Released]),
    (S.ENGINE_RELEASE,    R, FAIL, {},                            [ReleaseDeferred]),
    (S.ENGINE_RELEASE,    R, FAIL, {"settled": True},             [Released]),
    (S.DATA_LANDED,       R, REG,  {},                            [WriteDone]),
    (S.DATA_LANDED,       R, WRI,  {},                            [WriteDone]),
    (S.DATA_LANDED,       R, FAIL, {},                            []),
    (S.DATA_LANDED,       P, WRI,  {},                            []),
    (S.PEER_WRITE_DONE,   R, REG,  {},                            [WriteDone]),
    (S.PEER_WRITE_DONE,   R, WRI,  {},                            [WriteDone]),
    (S.PEER_WRITE_DONE,   R, FAIL, {},                            [PeerSettled]),
    (S.PEER_WRITE_DONE,   R, FAIL, {"settled": True},             []),
    (S.PEER_WRITING,      R, REG,  {},                            [WriteStarted]),
    (S.PEER_WRITING,      R, WRI,  {},                            []),
    (S.PEER_WRITE_FAILED, R, REG,  {},                            [Failed]),
    (S.PEER_WRITE_FAILED, R, WRI,  {},                            [Failed]),
    (S.PEER_WRITE_FAILED, R, FAIL, {},                            [PeerSettled]),
    (S.PEER_CANCEL,       P, REG,  {},                            [Failed]),
    (S.PEER_CANCEL,       P, TRIM, {},                            [Failed]),
    (S.PEER_CANCEL,       P, WRI,  {},                            []),
    (S.PEER_CANCEL,       P, DONE, {},                            []),
    (S.PEER_DEAD,         P, REG,  {},                            [Failed]),
    (S.PEER_DEAD,         P, TRIM, {},                            [Failed]),
    (S.PEER_DEAD,         P, WRI,  {},                            []),
    (S.PEER_DEAD,         R, REG,  {},                            [Failed]),
    (S.PEER_DEAD,         R, WRI,  {},                            [Failed]),
    (S.PEER_DEAD,         R, FAIL, {},                            [PeerSettled]),
    (S.PEER_DEAD,         R, FAIL, {"settled": True},             []),
    (S.DEADLINE,          P, REG,  {},                            [Failed]),
    (S.DEADLINE,          P, TRIM, {},                            [Failed]),
    (S.DEADLINE,          P, WRI,  {},                            [Failed]),
    (S.DEADLINE,          P, DONE, {},                            [Released]),
    (S.DEADLINE,          P, FAIL, {},                            [Released]),
    (S.DEADLINE,          R, REG,  {},                            [Failed]),
    (S.DEADLINE,          R, WRI,  {},                            [Failed]),
    (S.DEADLINE,          R, DONE, {"settled": True},             [Released]),
    (S.DEADLINE,          R, FAIL, {},                            [PeerSettled]),
    (S.DEADLINE,          R, FAIL, {"settled": True},             [Released]),
    (S.RESTART,           P, REG,  {},                            [Failed]),
    (S.RESTART,           P, TRIM, {},                            [Failed]),
    (S.RESTART,           P, WRI,  {},                            [Failed]),
    (S.RESTART,           P, DONE, {},                            []),
    (S.RESTART,           R, REG,  {},                            [Failed]),
    (S.RESTART,           R, WRI,  {},                            [Failed]),
    (S.RESTART,           R, FAIL, {},                            []),
    (S.QUARANTINE_LIFTED, P, DONE, {"release_pending": True},     [Released]),
    (S.QUARANTINE_LIFTED, P, DONE, {},                            []),
    (S.QUARANTINE_LIFTED, P, FAIL, {"release_pending": True},     [Released]),
    (S.QUARANTINE_LIFTED, R, FAIL, {"release_pending": True},     []),
    (S.QUARANTINE_LIFTED, R, FAIL, {"release_pending": True,
                                    "settled": True},             [Released]),
    (S.QUARANTINE_LIFTED, R, DONE, {"release_pending": True,
                                    "settled": True},             [Released]),
    (S.WRITE_COMPLETED,   P, WRI,  {},                            [WriteDone]),
    (S.WRITE_COMPLETED,   P, FAIL, {},                            []),
    (S.FAILURE,           P, REG,  {},                            [Failed]),
    (S.FAILURE,           P, TRIM, {},                            [Failed]),
    (S.FAILURE,           P, WRI,  {},                            [Failed]),
    (S.FAILURE,           P, DONE, {},                            []),
    (S.FAILURE,           R, REG,  {},                            [Failed]),
    (S.FAILURE,           R, WRI,  {},                            [Failed]),
    (S.INTEGRITY_MISMATCH, R, REG, {},                            [IntegrityMismatch, Failed]),
    (S.INTEGRITY_MISMATCH, R, WRI, {},                            [IntegrityMismatch, Failed]),
    (S.INTEGRITY_MISMATCH, R, DONE, {"settled": True},            []),
    (S.INTEGRITY_MISMATCH, R, FAIL, {},                           []),
    (S.INTEGRITY_MISMATCH, P, DONE, {},                           []),
]
# fmt: on


@pytest.mark.parametrize(("stimulus", "role", "state", "flags", "kinds"), ROWS)
def test_each_row_calls_for_exactly_its_events(stimulus, role, state, flags, kinds):
    events = react(record(role, state, **flags), stimulus)
    assert [type(e) for e in events] == kinds


@pytest.mark.parametrize(("stimulus", "role", "state", "flags", "kinds"), ROWS)
def test_every_event_called_for_is_legal_in_turn(stimulus, role, state, flags, kinds):
    # The reactions never ask the transition table for something it refuses.
    r = record(role, state, **flags)
    seconds = deadline_seconds(Deadlines())
    for event in react(r, stimulus):
        r = apply(r, event, 1.0, seconds)


def test_every_cell_of_the_table_is_pinned_by_a_row():
    pinned = {(s, role, state) for s, role, state, _, _ in ROWS}
    cells = {(s, role, state) for s, row in REACTIONS.items() for role, state in row}
    assert cells <= pinned, sorted(map(str, cells - pinned))


def test_cells_outside_the_table_call_for_nothing():
    for stimulus, role, state in itertools.product(Stimulus, Role, State):
        if (role, state) in REACTIONS[stimulus] or state is State.RELEASED:
            continue
        assert react(record(role, state), stimulus) == [], (stimulus, role, state)


def test_the_failure_carries_the_stimulus_words_or_the_callers():
    (failed,) = react(record(P, REG), S.DEADLINE)
    assert failed.reason is Reason.DEADLINE_EXCEEDED
    assert failed.message == "deadline passed in state registered"
    (failed,) = react(record(R, WRI), S.PEER_WRITE_FAILED, Why(Reason.TRANSFER_ERROR, "x"))
    assert (failed.reason, failed.message, failed.settled) == (Reason.TRANSFER_ERROR, "x", True)
    (settled,) = react(record(R, FAIL), S.PEER_DEAD)
    assert settled.fenced is True
    (settled,) = react(record(R, FAIL), S.PEER_WRITE_DONE)
    assert settled.fenced is False


def test_a_pending_registration_ends_only_by_cancel_death_deadline_or_restart():
    pending = PendingPeer(PeerRegistered("r", 1, "peer", "d", ((1,),), 1), 0.0)
    for stimulus in Stimulus:
        events = react_pending(pending, stimulus)
        if stimulus in (S.PEER_CANCEL, S.PEER_DEAD, S.DEADLINE, S.RESTART):
            assert [type(e) for e in events] == [Failed]
            assert events[0].settled
        else:
            assert events == []


def test_an_answered_pending_registration_at_its_deadline_names_a_transfer_never_had():
    """Registered from the prefill's answer: past its deadline no push here ever had the id."""
    answered = PendingPeer(PeerRegistered("T", 1, "dnode", "d", ((1,),), 1, answered=True), 0.0)
    (failed,) = react_pending(answered, S.DEADLINE)
    assert (failed.reason, failed.settled) == (Reason.UNKNOWN_REQUEST, True)
    assert "the answer names transfer T, which this prefill never had" in failed.message
    # Every other end of it is worded as for any pending registration.
    (restart,) = react_pending(answered, S.RESTART)
    assert restart.reason is Reason.DAEMON_RESTART
    # A receiver sent with the prefill's leg: the prefill may not have started.
    concurrent = PendingPeer(PeerRegistered("T", 1, "dnode", "d", ((1,),), 1), 0.0)
    (failed,) = react_pending(concurrent, S.DEADLINE)
    assert failed.reason is Reason.DEADLINE_EXCEEDED


def test_each_stimulus_has_a_cause():
    assert {s.cause for s in Stimulus} == set(Cause)


def test_awaiting_data_is_a_receiver_before_its_data():
    assert awaiting_data(record(R, REG)) and awaiting_data(record(R, WRI))
    assert not awaiting_data(record(R, DONE)) and not awaiting_data(record(R, FAIL))
    assert not awaiting_data(record(P, REG))


# fmt: off
NEXT = [
    # role  state  flags                                        -> next step
    (P,     REG,   {},                                          None),
    (P,     REG,   {"remote_blocks": ((1,),)},                  Next.TRIM),
    (P,     REG,   {"remote_blocks": ((1,),), "kv_ready": True}, Next.TRIM),
    (P,     TRIM,  {},                                          None),
    (P,     TRIM,  {"kv_ready": True},                          Next.WRITE),
    (P,     WRI,   {"kv_ready": True},                          None),
    (R,     REG,   {"remote_blocks": ((1,),)},                  None),
    (R,     WRI,   {"kv_ready": True},                          None),
]
# fmt: on


@pytest.mark.parametrize(("role", "state", "flags", "step"), NEXT)
def test_a_pusher_trims_once_both_sides_are_known_and_writes_once_ready(role, state, flags, step):
    assert pusher_next(record(role, state, **flags)) is step


def test_a_lifted_quarantine_calls_for_nothing_unless_a_release_was_deferred():
    # The shell skips the QUARANTINE_LIFTED reaction when release_may_be_due
    # says no: that must never skip a release the table would call for.
    for role, state in itertools.product(Role, State):
        if state is State.RELEASED:
            continue
        for flags in ({}, {"settled": True}):
            r = record(role, state, **flags)
            assert not release_may_be_due(r)
            assert react(r, S.QUARANTINE_LIFTED) == []


def test_an_integrity_mismatch_names_its_blocks_and_fails_the_request():
    blocks = tuple((0, layer, 100 + b) for layer in range(2) for b in range(40))
    why = Why(Reason.INTEGRITY_MISMATCH, "differs", num_blocks=200, blocks=blocks)
    mismatch, failed = react(record(R, WRI), S.INTEGRITY_MISMATCH, why)
    assert isinstance(mismatch, IntegrityMismatch) and isinstance(failed, Failed)
    assert (mismatch.checked, mismatch.mismatched) == (200, 80)
    assert mismatch.blocks == blocks[:64]  # listed up to MAX_LISTED, all counted
    assert (failed.reason, failed.message) == (Reason.INTEGRITY_MISMATCH, "differs")
    assert not failed.settled  # the pusher's final word still lifts the quarantine
