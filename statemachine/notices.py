"""Who must be told of a journaled transition, and what.

Nothing here sends anything: the ledger (daemon/node/ledger.py) delivers the
notices only once the events behind them are durable (invariant 6). Read
``NOTICES`` as a table: for a request's role, the event journaled and who
caused it (:class:`~statemachine.reactions.Cause`), what the request's own
engine and its peer daemon are owed. A missing row means nobody is told: the
engine that caused a transition learns it from its reply, a peer that caused
one already knows, a dead peer cannot hear, and after a restart engines and
peers are told when they come back (:func:`on_engine_back`, :func:`on_peer_back`).

A ``PENDING`` row is a receiver's registration waiting for the pusher's
engine: it has no engine on this side yet, only a peer to answer.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from types import MappingProxyType
from typing import Final, NamedTuple

from schemas import peer as pm
from schemas import rpc
from schemas.events import (
    Failed,
    Refused,
    Registered,
    Released,
    RequestEvent,
    WriteDone,
    WriteStarted,
)
from schemas.layout import EngineLayout, Role
from schemas.reasons import Reason
from schemas.state import RequestRecord, State
from statemachine.reactions import Cause, awaiting_data
from statemachine.registry import attention_ratio

PUSHER, RECEIVER = Role.PUSHER, Role.RECEIVER
DONE, FAILED = State.DONE, State.FAILED
ENGINE, PEER, PEER_DEAD, DAEMON = Cause.ENGINE, Cause.PEER, Cause.PEER_DEAD, Cause.DAEMON


class Tell(enum.Enum):
    """What a notice says; the message is built from the record and the event."""

    # to the request's engine
    KV_ARRIVED = "kv_arrived"
    BLOCKS_FREEABLE = "blocks_freeable"
    REQUEST_FAILED = "request_failed"
    RELEASED = "released"
    # to the peer daemon
    FORWARD = "forward"
    WRITING = "writing"
    WRITE_DONE = "write_done"
    WRITE_FAILED = "write_failed"
    CANCEL = "cancel"


class Owed(NamedTuple):
    engine: Tell | None
    peer: Tell | None


PENDING: Final = "pending"

# fmt: off
NOTICES: Final[Mapping[tuple[Role | str, type, Cause], Owed]] = MappingProxyType({
    # role       event          cause         -> engine told            peer told
    (RECEIVER, Registered,    ENGINE):    Owed(None,                 Tell.FORWARD),
    (RECEIVER, WriteDone,     DAEMON):    Owed(Tell.KV_ARRIVED,      None),
    (RECEIVER, WriteDone,     PEER):      Owed(Tell.KV_ARRIVED,      None),
    (RECEIVER, Failed,        ENGINE):    Owed(None,                 Tell.CANCEL),
    (RECEIVER, Failed,        PEER):      Owed(Tell.REQUEST_FAILED,  None),
    (RECEIVER, Failed,        PEER_DEAD): Owed(Tell.REQUEST_FAILED,  None),
    (RECEIVER, Failed,        DAEMON):    Owed(Tell.REQUEST_FAILED,  Tell.CANCEL),
    (RECEIVER, Released,      DAEMON):    Owed(Tell.RELEASED,        None),

    (PUSHER,   WriteStarted,  DAEMON):    Owed(None,                 Tell.WRITING),
    (PUSHER,   WriteDone,     DAEMON):    Owed(Tell.BLOCKS_FREEABLE, Tell.WRITE_DONE),
    (PUSHER,   Failed,        ENGINE):    Owed(None,                 Tell.WRITE_FAILED),
    (PUSHER,   Failed,        PEER):      Owed(Tell.REQUEST_FAILED,  Tell.WRITE_FAILED),
    (PUSHER,   Failed,        PEER_DEAD): Owed(Tell.REQUEST_FAILED,  None),
    (PUSHER,   Failed,        DAEMON):    Owed(Tell.REQUEST_FAILED,  Tell.WRITE_FAILED),
    (PUSHER,   Released,      DAEMON):    Owed(Tell.RELEASED,        None),
    # A receiver's forwarded registration refused here: its daemon must hear.
    (PUSHER,   Refused,       PEER):      Owed(None,                 Tell.WRITE_FAILED),

    (PENDING,  Failed,        PEER):      Owed(None,                 Tell.WRITE_FAILED),
    (PENDING,  Failed,        DAEMON):    Owed(None,                 Tell.WRITE_FAILED),
})
# fmt: on

NOBODY: Final = Owed(None, None)
# The event types some row tells of: any other event owes nothing, whoever caused it.
TOLD_OF: Final = frozenset(kind for _, kind, _ in NOTICES)

Message = rpc.Event | pm.PeerMessage


class Notice(NamedTuple):
    """One message owed: to the engine ``to`` (``to_engine``) or the peer daemon ``to``."""

    to_engine: bool
    to: str
    message: Message


def owed(role: Role | str, event: RequestEvent | Refused, cause: Cause) -> Owed:
    return NOTICES.get((role, type(event), cause), NOBODY)


def notices(
    record: RequestRecord | None,
    event: RequestEvent | Refused,
    cause: Cause,
    *,
    peer: str = "",
    layouts: Mapping[str, EngineLayout] | None = None,
) -> list[Notice]:
    """The messages owed for ``event`` on ``record`` (the record after the event).

    ``record`` is None for a pending registration or a refused forward: then
    ``peer`` names whom to answer. ``layouts`` (the registry's engines) give
    the receiver engine's kernel blocks per logical block, which a Forward
    carries.
    """
    role: Role | str = PENDING if record is None else record.role
    if isinstance(event, Refused):
        role = PUSHER
    engine_tell, peer_tell = owed(role, event, cause)
    out: list[Notice] = []
    if engine_tell is not None and record is not None:
        out.append(Notice(True, record.engine_id, _engine_message(engine_tell, record, event)))
    if peer_tell is not None:
        node = record.peer if record is not None else peer
        layout = None
        if peer_tell is Tell.FORWARD and record is not None and layouts:
            layout = layouts.get(record.engine_id)
        out.append(Notice(False, node, _peer_message(peer_tell, record, event, layout)))
    return out


def _failure(event: RequestEvent | Refused, record: RequestRecord | None) -> tuple[Reason, str]:
    if isinstance(event, Failed | Refused):
        return event.reason, event.message
    assert record is not None
    return record.reason or Reason.ABORTED, record.message


def _engine_message(tell: Tell, record: RequestRecord, event: RequestEvent) -> rpc.Event:
    rid, inc = record.request_id, record.incarnation
    if tell is Tell.KV_ARRIVED:
        return rpc.KvArrived(rid, inc)
    if tell is Tell.BLOCKS_FREEABLE:
        return rpc.BlocksFreeable(rid, inc)
    if tell is Tell.RELEASED:
        return rpc.Released(rid, inc)
    reason, message = _failure(event, record)
    return rpc.RequestFailed(rid, inc, reason, message)


def _peer_message(
    tell: Tell,
    record: RequestRecord | None,
    event: RequestEvent | Refused,
    layout: EngineLayout | None,
) -> pm.PeerMessage:
    rid, inc = event.request_id, event.incarnation
    if tell is Tell.FORWARD:
        assert record is not None
        return forward(record, layout)
    if tell is Tell.WRITING:
        assert isinstance(event, WriteStarted)
        return pm.Writing(rid, inc, event.num_blocks, event.nbytes)
    if tell is Tell.WRITE_DONE:
        return pm.WriteDone(rid, inc)
    if tell is Tell.CANCEL:
        return pm.Cancel(rid, inc)
    reason, message = _failure(event, record)
    return pm.WriteFailed(rid, inc, reason, message)


# ------------------------------------------------- what to say again, on return


def on_engine_back(record: RequestRecord) -> list[rpc.Event]:
    """What an engine that (re)registers may have missed about its live request."""
    rid, inc = record.request_id, record.incarnation
    if record.state is DONE:
        arrived = record.role is RECEIVER
        return [rpc.KvArrived(rid, inc) if arrived else rpc.BlocksFreeable(rid, inc)]
    if record.state is FAILED:
        return [rpc.RequestFailed(rid, inc, record.reason or Reason.ABORTED, record.message)]
    return []


def forward(record: RequestRecord, layout: EngineLayout | None) -> pm.Forward:
    """A receiver's registration as its pusher's daemon gets it.

    ``layout`` is the receiver engine's: its kernel blocks per logical block
    and its fingerprint travel with the blocks.
    """
    per_logical = attention_ratio(layout) if layout is not None else 1
    fingerprint = layout.fingerprint if layout is not None else None
    return pm.Forward(
        record.request_id,
        record.incarnation,
        record.engine_id,
        record.blocks,
        per_logical,
        fingerprint,
        record.content,
        record.answered,
    )


def on_peer_back(record: RequestRecord, layout: EngineLayout | None) -> list[pm.PeerMessage]:
    """What a peer that reconnects may have missed about a request it shares."""
    rid, inc = record.request_id, record.incarnation
    if record.role is RECEIVER:
        if awaiting_data(record):
            return [forward(record, layout)]
        if record.state is FAILED and not record.settled:
            return [pm.Cancel(rid, inc)]
        return []
    return final_word(record)


def final_word(record: RequestRecord) -> list[pm.PeerMessage]:
    """A pusher's final word to a receiver that cancelled or reconnected.

    While writing there is none yet: the write ends as done or failed and the
    receiver hears which then. A receiver has no final word to give.
    """
    if record.role is not PUSHER:
        return []
    rid, inc = record.request_id, record.incarnation
    if record.state is DONE:
        return [pm.WriteDone(rid, inc)]
    if record.state is FAILED:
        return [pm.WriteFailed(rid, inc, record.reason or Reason.ABORTED, record.message)]
    return []


def no_write_here(cancel: pm.Cancel) -> pm.WriteFailed:
    """The answer to a cancel for a request unknown here: no write can be in flight."""
    return pm.WriteFailed(
        cancel.request_id, cancel.incarnation, Reason.CANCELLED_BY_PEER, "no write in flight"
    )


def forward_known(record: RequestRecord | None, forward: pm.Forward) -> bool:
    """A forward re-sent after a reconnect for a registration already known here."""
    return (
        record is not None
        and record.incarnation == forward.incarnation
        and record.remote_blocks == forward.blocks
    )
