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
                             Failed:           FAILED},
    (RECEIVER, WRITING):    {WriteDone:        DONE,
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
    }
)


# What each event sets on the record besides state and deadline.
_CHANGES: Final[Mapping[type, Callable[[RequestRecord, Any], dict[str, Any]]]] = {
    KvReady: lambda record, event: {"kv_ready": True},
    PeerRegistered: lambda record, event: {
        # The prefill engine need not name its peer: the receiver's daemon did.
        "peer": event.peer,
        "remote_engine": event.engine_id,
        "remote_blocks": event.blocks,
        "remote_per_logical": event.per_logical,
    },
    Trimmed: lambda record, event: {"src": event.src, "dst": event.dst},
    WriteDone: lambda record, event: {"settled": True},
    Failed: lambda record, event: {
        "reason": event.reason,
        "message": event.message,
        "settled": record.settled or event.settled,
    },
    PeerSettled: lambda record, event: {"settled": True},
    ReleaseDeferred: lambda record, event: {"release_pending": True},
}

# The table flattened for the hot path: (role, state, event type) -> next state.
_NEXT: Final[dict[tuple[Role, State, type], State]] = {
    (role, state, kind): nxt
    for (role, state), row in TRANSITIONS.items()
    for kind, nxt in row.items()
}


_HOT_GUARDS: Final = dict(GUARDS)


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
    nxt = _NEXT.get((record.role, record.state, kind))
    if nxt is None:
        raise IllegalTransition(
            f"{record.role.value} request {record.request_id}#{record.incarnation}: "
            f"{kind.__name__} is not allowed in state {record.state.value}"
        )
    guard = _HOT_GUARDS.get(kind)
    if guard is not None:
        why = guard(record)
        if why is not None:
            raise IllegalTransition(
                f"{record.role.value} request {record.request_id}#{record.incarnation}: "
                f"{kind.__name__} refused in state {record.state.value}: {why}"
            )
    change = _CHANGES.get(kind)
    changes = change(record, event) if change is not None else {}
    if nxt is not record.state:
        changes["state"] = nxt
        changes["entered_at"] = ts
        if nxt in TERMINAL:
            changes["deadline"] = ts
        else:
            seconds = deadline_seconds(deadlines) if isinstance(deadlines, Deadlines) else deadlines
            changes["deadline"] = ts + seconds[nxt]
    return msgspec.structs.replace(record, **changes)
