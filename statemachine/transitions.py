"""The transition table of a request, and the pure function that applies it.

This module is the one place the lifecycle is declared. Read ``TRANSITIONS``
as a table: for a role and a state, the events allowed and the state each one
leads to. Anything not listed is refused with :class:`IllegalTransition` and
the record is left as it was.

Two guards sit beside the table, because they depend on a record's flags
rather than its state:

* a pusher may only start writing once its engine said the KV is ready;
* a release is refused while the record is *quarantined* (a write into its
  blocks may still be in flight); the shell journals ``ReleaseDeferred``
  instead, and only a quarantined record may be deferred.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, Final

import msgspec

from schemas.events import (
    Failed,
    Held,
    IntegrityMismatch,
    KvReady,
    PeerRegistered,
    PeerSettled,
    Released,
    ReleaseDeferred,
    RequestEvent,
    Trimmed,
    WriteDone,
    WriteStarted,
)
from schemas.layout import Role
from schemas.state import Deadlines, RequestRecord, State
from statemachine.errors import IllegalTransition

PUSHER, RECEIVER = Role.PUSHER, Role.RECEIVER
REGISTERED, TRIMMED, WRITING = State.REGISTERED, State.TRIMMED, State.WRITING
DONE, RELEASED, FAILED = State.DONE, State.RELEASED, State.FAILED


def _frozen(
    table: dict[tuple[Role, State], dict[type, State]],
) -> Mapping[tuple[Role, State], Mapping[type, State]]:
    return MappingProxyType({key: MappingProxyType(row) for key, row in table.items()})


# fmt: off
TRANSITIONS: Final = _frozen({
    # role      state          event             -> next state
    (PUSHER,   REGISTERED): {PeerRegistered:   REGISTERED,
                             KvReady:          REGISTERED,
                             Held:             REGISTERED,
                             Trimmed:          TRIMMED,
                             Failed:           FAILED},
    (PUSHER,   TRIMMED):    {KvReady:          TRIMMED,
                             WriteStarted:     WRITING,
                             Failed:           FAILED},
    (PUSHER,   WRITING):    {WriteDone:        DONE,
                             Failed:           FAILED,
                             ReleaseDeferred:  WRITING},
    (PUSHER,   DONE):       {Released:         RELEASED},
    (PUSHER,   FAILED):     {Released:         RELEASED},

    (RECEIVER, REGISTERED): {WriteStarted:     WRITING,
                             WriteDone:        DONE,
                             IntegrityMismatch: REGISTERED,
                             Failed:           FAILED},
    (RECEIVER, WRITING):    {WriteDone:        DONE,
                             IntegrityMismatch: WRITING,
                             Failed:           FAILED},
    (RECEIVER, DONE):       {Released:         RELEASED},
    (RECEIVER, FAILED):     {PeerSettled:      FAILED,
                             ReleaseDeferred:  FAILED,
                             Released:         RELEASED},
})
# fmt: on

TERMINAL: Final = frozenset({RELEASED})


def is_quarantined(record: RequestRecord) -> bool:
    """True while a write into (or out of) the record's blocks may happen.

    Pusher: only while writing. Receiver: until the pusher's final word (the
    write is done, failed, or will never start), or until the peer is fenced.
    """
    if record.role is PUSHER:
        return record.state is WRITING
    return not record.settled


def allowed_events(role: Role, state: State) -> frozenset[type]:
    return frozenset(TRANSITIONS.get((role, state), {}))


def _release_guard(record: RequestRecord) -> str | None:
    if is_quarantined(record):
        return "a write may still be in flight; the release must be deferred"
    return None


def _defer_guard(record: RequestRecord) -> str | None:
    if not is_quarantined(record):
        return "nothing is in flight; the release must not be deferred"
    if record.release_pending:
        return "a release is already deferred"
    return None


# Conditions on a record's flags that refuse an event the table allows:
# event type -> (record -> why it is refused, or None).
GUARDS: Final[Mapping[type, Callable[[RequestRecord], str | None]]] = MappingProxyType(
    {
        WriteStarted: lambda r: (
            "the prefill engine has not said the KV is ready"
            if r.role is PUSHER and not r.kv_ready
            else None
        ),
        Released: _release_guard,
        ReleaseDeferred: _defer_guard,
        Trimmed: lambda r: (
            "the receiver's registration has not arrived" if r.remote_blocks is None else None
        ),
        PeerRegistered: lambda r: (
            "the receiver's registration already arrived" if r.remote_blocks is not None else None
        ),
        KvReady: lambda r: "the KV was already reported ready" if r.kv_ready else None,
        Held: lambda r: (
            "the receiver's registration already arrived" if r.remote_blocks is not None else None
        ),
    }
)


# What each event sets on the record besides state and deadline. Each setter
# makes the whole new record in one ``replace`` call, with the state, the time
# it was entered and its deadline passed in (unchanged ones when the event
# keeps the state): replay runs one per journaled event, and building a dict
# of changes to unpack into ``replace`` cost more than the ``replace`` itself.
_replace = msgspec.structs.replace


def _set_nothing(r: RequestRecord, e: Any, state: State, at: float, due: float) -> RequestRecord:
    return _replace(r, state=state, entered_at=at, deadline=due)


def _set_kv_ready(r: RequestRecord, e: Any, state: State, at: float, due: float) -> RequestRecord:
    return _replace(r, state=state, entered_at=at, deadline=due, kv_ready=True)


def _set_peer_registered(
    r: RequestRecord, e: PeerRegistered, state: State, at: float, due: float
) -> RequestRecord:
    # The prefill engine need not name its peer: the receiver's daemon did.
    return _replace(
        r,
        state=state,
        entered_at=at,
        deadline=due,
        peer=e.peer,
        remote_engine=e.engine_id,
        remote_blocks=e.blocks,
        remote_per_logical=e.per_logical,
        remote_fingerprint=e.fingerprint,
        remote_content=e.content,
    )


def _set_trimmed(
    r: RequestRecord, e: Trimmed, state: State, at: float, due: float
) -> RequestRecord:
    return _replace(r, state=state, entered_at=at, deadline=due, src=e.src, dst=e.dst)


def _set_settled(r: RequestRecord, e: Any, state: State, at: float, due: float) -> RequestRecord:
    return _replace(r, state=state, entered_at=at, deadline=due, settled=True)


def _set_failed(r: RequestRecord, e: Failed, state: State, at: float, due: float) -> RequestRecord:
    return _replace(
        r,
        state=state,
        entered_at=at,
        deadline=due,
        reason=e.reason,
        message=e.message,
        settled=r.settled or e.settled,
    )


def _set_held(r: RequestRecord, e: Held, state: State, at: float, due: float) -> RequestRecord:
    # A hold only ever lengthens the wait (a late, shorter one changes nothing).
    return _replace(r, state=state, entered_at=at, deadline=max(due, e.until))


def _set_release_pending(
    r: RequestRecord, e: Any, state: State, at: float, due: float
) -> RequestRecord:
    return _replace(r, state=state, entered_at=at, deadline=due, release_pending=True)


_Setter = Callable[[RequestRecord, Any, State, float, float], RequestRecord]

SETTERS: Final[Mapping[type, _Setter]] = MappingProxyType(
    {
        KvReady: _set_kv_ready,
        PeerRegistered: _set_peer_registered,
        Trimmed: _set_trimmed,
        WriteStarted: _set_nothing,
        WriteDone: _set_settled,
        Failed: _set_failed,
        PeerSettled: _set_settled,
        ReleaseDeferred: _set_release_pending,
        Released: _set_nothing,
        IntegrityMismatch: _set_nothing,
        Held: _set_held,
    }
)

# The table flattened for the hot path, one lookup per event:
# (role, state, event type) -> (next state, guard or None, setter, next is terminal).
STEPS: Final[dict[tuple[Role, State, type], tuple[State, Any, _Setter, bool]]] = {
    (role, state, kind): (nxt, GUARDS.get(kind), SETTERS[kind], nxt in TERMINAL)
    for (role, state), row in TRANSITIONS.items()
    for kind, nxt in row.items()
}


def deadline_seconds(deadlines: Deadlines) -> dict[State, float]:
    """Per-state deadline lengths as a plain dict, for the hot path."""
    return {state: deadlines.for_state(state) for state in State if state not in TERMINAL}


def apply(
    record: RequestRecord,
    event: RequestEvent,
    ts: float,
    deadlines: Deadlines | Mapping[State, float],
) -> RequestRecord:
    """Return the record after ``event`` (journaled at ``ts``).

    Raises :class:`IllegalTransition` if the table or a guard refuses; the
    input record is immutable and therefore unchanged either way.
    ``deadlines`` may be given pre-flattened by :func:`deadline_seconds`.
    """
    if event.request_id != record.request_id or event.incarnation != record.incarnation:
        raise IllegalTransition(
            f"event for {event.request_id}#{event.incarnation} applied to "
            f"{record.request_id}#{record.incarnation}"
        )
    kind = type(event)
    state = record.state
    step = STEPS.get((record.role, state, kind))
    if step is None:
        raise IllegalTransition(
            f"{record.role.value} request {record.request_id}#{record.incarnation}: "
            f"{kind.__name__} is not allowed in state {state.value}"
        )
    nxt, guard, setter, terminal = step
    if guard is not None:
        why = guard(record)
        if why is not None:
            raise IllegalTransition(
                f"{record.role.value} request {record.request_id}#{record.incarnation}: "
                f"{kind.__name__} refused in state {state.value}: {why}"
            )
    if nxt is state:
        return setter(record, event, state, record.entered_at, record.deadline)
    if terminal:
        return setter(record, event, nxt, ts, ts)
    seconds = deadline_seconds(deadlines) if isinstance(deadlines, Deadlines) else deadlines
    return setter(record, event, nxt, ts, ts + seconds[nxt])
