"""What the daemon journals when something happens to a live request.

The transition table (:mod:`statemachine.transitions`) says which events are
legal; this module says which events a *stimulus* calls for: an engine's
abort or release, the data landing, a peer's word, a peer's death, a
deadline, a restart, a quarantine lifting. Read ``REACTIONS`` as a table: for
a stimulus and a request's role and state, the reaction to journal. A cell
that is not listed means "nothing to journal".

The stimulus also says who caused the events (:class:`Cause`), which
:mod:`statemachine.notices` needs to decide who must be told.

A receiver's registration that reached the pusher before the pusher's own
engine registered is a *pending* registration (``Registry.pending``): not yet a
request, it has no state. Its rules are the ``PENDING`` rows of
``PENDING_REACTIONS``: it is joined by the engine's registration, or failed
and tombstoned (cancelled, peer dead, deadline, restart). One registered
from the prefill's answer has a short deadline (``Registry.pending_due``),
and its failure says this prefill never had the transfer (:func:`never_had`).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Final, NamedTuple

from schemas.events import (
    Failed,
    IntegrityMismatch,
    PeerSettled,
    Released,
    ReleaseDeferred,
    RequestEvent,
    WriteDone,
    WriteStarted,
)
from schemas.layout import Role
from schemas.reasons import Reason
from schemas.state import Deadlines, PendingPeer, RequestRecord, State
from statemachine.integrity import MAX_LISTED
from statemachine.transitions import (
    DONE,
    FAILED,
    PUSHER,
    RECEIVER,
    REGISTERED,
    TRIMMED,
    WRITING,
    apply,
    deadline_seconds,
    is_quarantined,
)


class Cause(enum.Enum):
    """Who made a transition happen; decides who must be told of it."""

    ENGINE = "engine"  # the request's own engine asked (its reply says the outcome)
    PEER = "peer"  # the peer daemon said so
    PEER_DEAD = "peer_dead"  # the peer is dead and fenced: nothing can reach it
    DAEMON = "daemon"  # this daemon decided (trim, write, data landed, deadline, follow-up)
    RESTART = "restart"  # found mid-flight after a restart: told when engines and peers return

    # Members are singletons compared by identity: hash them as such, in C
    # (Enum's own __hash__ is Python code, and the tables are looked up per event).
    __hash__ = object.__hash__


class Stimulus(enum.Enum):
    ENGINE_ABORT = "engine_abort"
    ENGINE_RELEASE = "engine_release"
    DATA_LANDED = "data_landed"  # receiver: the NIXL notification of the write
    PEER_WRITE_DONE = "peer_write_done"  # receiver: the pusher's word that the write is done
    PEER_WRITING = "peer_writing"  # receiver: the pusher started the write
    PEER_WRITE_FAILED = "peer_write_failed"  # receiver: the write failed or will never start
    PEER_CANCEL = "peer_cancel"  # pusher: the receiver gave the request up
    PEER_DEAD = "peer_dead"
    DEADLINE = "deadline"
    RESTART = "restart"
    QUARANTINE_LIFTED = "quarantine_lifted"  # a deferred release may now be carried out
    WRITE_COMPLETED = "write_completed"  # pusher: NIXL reported the WRITE done
    FAILURE = "failure"  # this daemon gave up (trim refused, transfer error, engine gone, drain)
    # receiver: the blocks that landed differ from the pusher's digests
    INTEGRITY_MISMATCH = "integrity_mismatch"

    __hash__ = object.__hash__  # as Cause's

    @property
    def cause(self) -> Cause:
        return _CAUSES[self]


_CAUSES: Final = MappingProxyType(
    {
        Stimulus.ENGINE_ABORT: Cause.ENGINE,
        Stimulus.ENGINE_RELEASE: Cause.ENGINE,
        Stimulus.DATA_LANDED: Cause.DAEMON,
        Stimulus.PEER_WRITE_DONE: Cause.PEER,
        Stimulus.PEER_WRITING: Cause.PEER,
        Stimulus.PEER_WRITE_FAILED: Cause.PEER,
        Stimulus.PEER_CANCEL: Cause.PEER,
        Stimulus.PEER_DEAD: Cause.PEER_DEAD,
        Stimulus.DEADLINE: Cause.DAEMON,
        Stimulus.RESTART: Cause.RESTART,
        Stimulus.QUARANTINE_LIFTED: Cause.DAEMON,
        Stimulus.WRITE_COMPLETED: Cause.DAEMON,
        Stimulus.FAILURE: Cause.DAEMON,
        Stimulus.INTEGRITY_MISMATCH: Cause.DAEMON,
    }
)


class Why(NamedTuple):
    """The reason and words a ``Failed`` carries, and a peer's write figures.

    For an integrity mismatch, ``num_blocks`` is how many block digests were
    compared and ``blocks`` every (group, layer, block) that differed.
    """

    reason: Reason = Reason.ABORTED
    message: str = ""
    num_blocks: int = 0
    nbytes: int = 0
    blocks: tuple[tuple[int, int, int], ...] = ()


def awaiting_data(record: RequestRecord) -> bool:
    """A receiver whose KV has neither arrived nor been given up."""
    return record.role is RECEIVER and record.state in (REGISTERED, WRITING)


def release_may_be_due(record: RequestRecord) -> bool:
    """Whether a QUARANTINE_LIFTED reaction can call for anything: a release is deferred."""
    return record.release_pending


class Next(enum.Enum):
    """What a pusher's request needs from the daemon next."""

    TRIM = "trim"  # both registrations are known
    WRITE = "write"  # trimmed, and the engine said the KV is ready


def pusher_next(record: RequestRecord) -> Next | None:
    if record.role is not PUSHER:
        return None
    if record.state is REGISTERED and record.remote_blocks is not None:
        return Next.TRIM
    if record.state is TRIMMED and record.kv_ready:
        return Next.WRITE
    return None


_NO_WHY: Final = Why()
# A release previews the failure it may journal first, only to see whether
# the record stays quarantined; the deadline that preview computes is unused.
_PREVIEW_SECONDS: Final = deadline_seconds(Deadlines())

# ------------------------------------------------------------------ reactions
# Each takes the record as it is now and the stimulus's details.

_Reaction = Callable[[RequestRecord, Why], list[RequestEvent]]


def fail(r: RequestRecord, why: Why) -> list[RequestEvent]:
    return [Failed(r.request_id, r.incarnation, why.reason, why.message)]


def fail_settled(r: RequestRecord, why: Why) -> list[RequestEvent]:
    """Fail, and record that the pusher's final word is in (or never can come)."""
    return [Failed(r.request_id, r.incarnation, why.reason, why.message, settled=True)]


def defer_release(r: RequestRecord, why: Why) -> list[RequestEvent]:
    """The write cannot be recalled: it ends as done or failed, then the release."""
    return [] if r.release_pending else [ReleaseDeferred(r.request_id, r.incarnation)]


def release(r: RequestRecord, why: Why) -> list[RequestEvent]:
    """Honour the release, or defer it while a write may still land."""
    events: list[RequestEvent] = []
    if r.state in (REGISTERED, TRIMMED) or (r.role is RECEIVER and r.state is WRITING):
        # Releasing before done gives the request up; preview the failure to
        # decide whether the release itself must wait.
        failed = Failed(r.request_id, r.incarnation, why.reason, why.message)
        events.append(failed)
        r = apply(r, failed, r.entered_at, _PREVIEW_SECONDS)
    if not is_quarantined(r):
        events.append(Released(r.request_id, r.incarnation))
    elif not r.release_pending:
        events.append(ReleaseDeferred(r.request_id, r.incarnation))
    return events


def write_started(r: RequestRecord, why: Why) -> list[RequestEvent]:
    return [WriteStarted(r.request_id, r.incarnation, why.num_blocks, why.nbytes)]


def write_done(r: RequestRecord, why: Why) -> list[RequestEvent]:
    return [WriteDone(r.request_id, r.incarnation)]


def settle(r: RequestRecord, why: Why) -> list[RequestEvent]:
    """The pusher's final word for a receiver that already failed."""
    return [] if r.settled else [PeerSettled(r.request_id, r.incarnation)]


def settle_fenced(r: RequestRecord, why: Why) -> list[RequestEvent]:
    """No word will come from a dead, fenced pusher: the quarantine lifts without it."""
    return [] if r.settled else [PeerSettled(r.request_id, r.incarnation, fenced=True)]


def expire(r: RequestRecord, why: Why) -> list[RequestEvent]:
    """A deadline in a final state: fence a quarantined receiver's peer, else release.

    The shell must make the event true before journaling it: fence the peer
    (revoke its windows) before ``PeerSettled(fenced=True)``.
    """
    if is_quarantined(r):
        return [PeerSettled(r.request_id, r.incarnation, fenced=True)]
    return [Released(r.request_id, r.incarnation)]


def release_if_due(r: RequestRecord, why: Why) -> list[RequestEvent]:
    """A deferred release becomes due once the quarantine lifts."""
    if r.release_pending and not is_quarantined(r):
        return [Released(r.request_id, r.incarnation)]
    return []


def integrity_failed(r: RequestRecord, why: Why) -> list[RequestEvent]:
    """The mismatching blocks on record, then the failure they cause."""
    rid, inc = r.request_id, r.incarnation
    listed = why.blocks[:MAX_LISTED]
    return [
        IntegrityMismatch(rid, inc, why.num_blocks, len(why.blocks), listed),
        Failed(rid, inc, Reason.INTEGRITY_MISMATCH, why.message),
    ]


def fail_naming_state(r: RequestRecord, why: Why) -> list[RequestEvent]:
    return fail(r, why._replace(message=f"{why.message} in state {r.state.value}"))


# fmt: off
REACTIONS: Final[Mapping[Stimulus, Mapping[tuple[Role, State], _Reaction]]] = MappingProxyType({
    # stimulus                  role      state          -> reaction
    Stimulus.ENGINE_ABORT: {
                               (PUSHER,   REGISTERED):   fail,
                               (PUSHER,   TRIMMED):      fail,
                               (PUSHER,   WRITING):      defer_release,
                               (RECEIVER, REGISTERED):   fail,
                               (RECEIVER, WRITING):      fail},
    Stimulus.ENGINE_RELEASE: {
                               (PUSHER,   REGISTERED):   release,
                               (PUSHER,   TRIMMED):      release,
                               (PUSHER,   WRITING):      release,
                               (PUSHER,   DONE):         release,
                               (PUSHER,   FAILED):       release,
                               (RECEIVER, REGISTERED):   release,
                               (RECEIVER, WRITING):      release,
                               (RECEIVER, DONE):         release,
                               (RECEIVER, FAILED):       release},
    # Only the pusher's word settles a receiver that gave up: a notification
    # alone does not prove that no other write for it is still in flight.
    Stimulus.DATA_LANDED: {
                               (RECEIVER, REGISTERED):   write_done,
                               (RECEIVER, WRITING):      write_done},
    Stimulus.PEER_WRITE_DONE: {
                               (RECEIVER, REGISTERED):   write_done,
                               (RECEIVER, WRITING):      write_done,
                               (RECEIVER, FAILED):       settle},
    Stimulus.PEER_WRITING: {
                               (RECEIVER, REGISTERED):   write_started},
    Stimulus.PEER_WRITE_FAILED: {
                               (RECEIVER, REGISTERED):   fail_settled,
                               (RECEIVER, WRITING):      fail_settled,
                               (RECEIVER, FAILED):       settle},
    Stimulus.PEER_CANCEL: {
                               (PUSHER,   REGISTERED):   fail,
                               (PUSHER,   TRIMMED):      fail},
    Stimulus.PEER_DEAD: {
                               (PUSHER,   REGISTERED):   fail,
                               (PUSHER,   TRIMMED):      fail,
                               (RECEIVER, REGISTERED):   fail_settled,
                               (RECEIVER, WRITING):      fail_settled,
                               (RECEIVER, FAILED):       settle_fenced},
    Stimulus.DEADLINE: {
                               (PUSHER,   REGISTERED):   fail_naming_state,
                               (PUSHER,   TRIMMED):      fail_naming_state,
                               (PUSHER,   WRITING):      fail_naming_state,
                               (PUSHER,   DONE):         expire,
                               (PUSHER,   FAILED):       expire,
                               (RECEIVER, REGISTERED):   fail_naming_state,
                               (RECEIVER, WRITING):      fail_naming_state,
                               (RECEIVER, DONE):         expire,
                               (RECEIVER, FAILED):       expire},
    # A pusher's write died with the old process (the copy ran in its
    # threads), so nothing is in flight from this side after a restart.
    Stimulus.RESTART: {
                               (PUSHER,   REGISTERED):   fail_naming_state,
                               (PUSHER,   TRIMMED):      fail_naming_state,
                               (PUSHER,   WRITING):      fail_naming_state,
                               (RECEIVER, REGISTERED):   fail_naming_state,
                               (RECEIVER, WRITING):      fail_naming_state},
    Stimulus.WRITE_COMPLETED: {
                               (PUSHER,   WRITING):      write_done},
    Stimulus.FAILURE: {
                               (PUSHER,   REGISTERED):   fail,
                               (PUSHER,   TRIMMED):      fail,
                               (PUSHER,   WRITING):      fail,
                               (RECEIVER, REGISTERED):   fail,
                               (RECEIVER, WRITING):      fail},
    # Checked before the decode engine hears of the data: never kv_arrived.
    Stimulus.INTEGRITY_MISMATCH: {
                               (RECEIVER, REGISTERED):   integrity_failed,
                               (RECEIVER, WRITING):      integrity_failed},
    Stimulus.QUARANTINE_LIFTED: {
                               (PUSHER,   DONE):         release_if_due,
                               (PUSHER,   FAILED):       release_if_due,
                               (RECEIVER, DONE):         release_if_due,
                               (RECEIVER, FAILED):       release_if_due},
})

# A pending registration (no state yet): the stimuli that end it. Its Failed
# is always settled: no engine on this side, no write from this side.
PENDING_REACTIONS: Final[frozenset[Stimulus]] = frozenset({
    Stimulus.PEER_CANCEL, Stimulus.PEER_DEAD, Stimulus.DEADLINE, Stimulus.RESTART,
})
# fmt: on

# The words of each stimulus's Failed, where the stimulus does not bring its own.
DEFAULT_WHY: Final[Mapping[Stimulus, Why]] = MappingProxyType(
    {
        Stimulus.ENGINE_ABORT: Why(Reason.ABORTED, "aborted by its engine"),
        Stimulus.ENGINE_RELEASE: Why(Reason.ABORTED, "released before done"),
        Stimulus.PEER_CANCEL: Why(
            Reason.CANCELLED_BY_PEER, "the decode side cancelled the request"
        ),
        Stimulus.DEADLINE: Why(Reason.DEADLINE_EXCEEDED, "deadline passed"),
        Stimulus.RESTART: Why(Reason.DAEMON_RESTART, "daemon restarted"),
        Stimulus.INTEGRITY_MISMATCH: Why(
            Reason.INTEGRITY_MISMATCH, "the blocks that landed differ from the pusher's"
        ),
    }
)

_PENDING_WHY: Final[Mapping[Stimulus, Why]] = MappingProxyType(
    {
        Stimulus.PEER_CANCEL: Why(Reason.CANCELLED_BY_PEER, "cancelled"),
        Stimulus.DEADLINE: Why(
            Reason.DEADLINE_EXCEEDED, "the prefill engine never registered the request"
        ),
        Stimulus.RESTART: Why(
            Reason.DAEMON_RESTART, "daemon restarted before the prefill engine registered"
        ),
    }
)


def react(record: RequestRecord, stimulus: Stimulus, why: Why | None = None) -> list[RequestEvent]:
    """The events ``stimulus`` calls for on ``record`` (empty: nothing to journal)."""
    reaction = REACTIONS[stimulus].get((record.role, record.state))
    if reaction is None:
        return []
    return reaction(record, DEFAULT_WHY.get(stimulus, _NO_WHY) if why is None else why)


def react_pending(
    pending: PendingPeer, stimulus: Stimulus, why: Why | None = None
) -> list[RequestEvent]:
    """The events that end a pending registration (empty: it stays pending)."""
    if stimulus not in PENDING_REACTIONS:
        return []
    reg = pending.registration
    if why is None and stimulus is Stimulus.DEADLINE and reg.answered:
        why = never_had(reg.request_id)
    why = why or _PENDING_WHY.get(stimulus, Why())
    return [Failed(reg.request_id, reg.incarnation, why.reason, why.message, settled=True)]


def never_had(request_id: str) -> Why:
    """Why a receiver registered from the prefill's answer failed pending: no such push here.

    The prefill engine finished the request before it answered, so it
    registers its push within a step or two; one that has not within
    ``[deadlines] answered`` was never this prefill's (a stale or forged
    answer, another prefill's transfer id).
    """
    return Why(
        Reason.UNKNOWN_REQUEST,
        f"the answer names transfer {request_id}, which this prefill never had "
        f"(no engine here registered its push)",
    )
