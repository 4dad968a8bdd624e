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

from collections.abc import Mapping
from types import MappingProxyType
from typing import Final

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

# fmt: off
TRANSITIONS: Final[Mapping[tuple[Role, State], Mapping[type, State]]] = MappingProxyType({
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


def _guard(record: RequestRecord, event: RequestEvent) -> str | None:
    """Return why a table-allowed event is still refused, or None."""
    kind = type(event)
    if kind is WriteStarted and record.role is PUSHER and not record.kv_ready:
        return "the prefill engine has not said the KV is ready"
    if kind is Released and is_quarantined(record):
        return "a write may still be in flight; the release must be deferred"
    if kind is ReleaseDeferred and not is_quarantined(record):
        return "nothing is in flight; the release must not be deferred"
    if kind is ReleaseDeferred and record.release_pending:
        return "a release is already deferred"
    if kind is Trimmed and record.remote_blocks is None:
        return "the receiver's registration has not arrived"
    if kind is PeerRegistered and record.remote_blocks is not None:
        return "the receiver's registration already arrived"
    if kind is KvReady and record.kv_ready:
        return "the KV was already reported ready"
    return None


def _changes(record: RequestRecord, event: RequestEvent) -> dict[str, object]:
    """Fields besides state/deadline that an event sets on the record."""
    match event:
        case KvReady():
            return {"kv_ready": True}
        case PeerRegistered(engine_id=engine, blocks=blocks, per_logical=ratio):
            return {"remote_engine": engine, "remote_blocks": blocks, "remote_per_logical": ratio}
        case Trimmed(src=src, dst=dst):
            return {"src": src, "dst": dst}
        case WriteDone():
            return {"settled": True}
        case Failed(reason=reason, message=message, settled=settled):
            return {"reason": reason, "message": message, "settled": record.settled or settled}
        case PeerSettled():
            return {"settled": True}
        case ReleaseDeferred():
            return {"release_pending": True}
        case _:
            return {}


def apply(
    record: RequestRecord, event: RequestEvent, ts: float, deadlines: Deadlines
) -> RequestRecord:
    """Return the record after ``event`` (journaled at ``ts``).

    Raises :class:`IllegalTransition` if the table or a guard refuses; the
    input record is immutable and therefore unchanged either way.
    """
    if (event.request_id, event.incarnation) != (record.request_id, record.incarnation):
        raise IllegalTransition(
            f"event for {event.request_id}#{event.incarnation} applied to "
            f"{record.request_id}#{record.incarnation}"
        )
    nxt = TRANSITIONS.get((record.role, record.state), {}).get(type(event))
    if nxt is None:
        raise IllegalTransition(
            f"{record.role.value} request {record.request_id}#{record.incarnation}: "
            f"{type(event).__name__} is not allowed in state {record.state.value}"
        )
    why = _guard(record, event)
    if why is not None:
        raise IllegalTransition(
            f"{record.role.value} request {record.request_id}#{record.incarnation}: "
            f"{type(event).__name__} refused in state {record.state.value}: {why}"
        )
    changes = _changes(record, event)
    if nxt is not record.state:
        changes["state"] = nxt
        changes["entered_at"] = ts
        changes["deadline"] = ts + deadlines.for_state(nxt) if nxt not in TERMINAL else ts
    return msgspec.structs.replace(record, **changes)
