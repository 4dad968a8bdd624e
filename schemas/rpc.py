"""Engine RPC: what engines send their node's daemon, and what they hear back.

Frames are a 4-byte big-endian length and a msgpack body. Requests are one
tagged union (tag field ``op``); every request carries an ``id`` and gets
exactly one reply carrying the same ``id``. The daemon also pushes events,
unprompted, to the connection that registered the engine. Replies and events
share one tagged union (tag field ``kind``) so a client decodes every frame
with one decoder.
"""

from __future__ import annotations

from typing import Annotated, Final

import msgspec

from schemas.events import (
    MAX_BATCH,
    MAX_DIGEST_BYTES,
    MAX_KEY_BYTES,
    MAX_NAMESPACE,
    Detail,
    Difference,
    Incarnation,
    Layer,
    Position,
    ReportedId,
)
from schemas.fingerprint import Fingerprint
from schemas.kvlayout import GroupSpec, MemoryNote, RegionSpec
from schemas.layout import Role
from schemas.reasons import Reason
from schemas.state import Quarantined
from schemas.status import StatusDocument

# 2 adds Batch / BatchReply, and Events (a loop iteration's events in one
# frame). A daemon answers a Hello with the version it will speak on that
# connection: the client's, if it supports it.
PROTOCOL_VERSION: Final = 2
SUPPORTED_PROTOCOLS: Final = frozenset({1, 2})
BATCH_PROTOCOL: Final = 2
MAX_FRAME_BYTES: Final = 4 * 1024 * 1024
# Operations one Batch may carry (one engine step's registrations, kv_readys
# and releases; a connection's in-flight limit is of the same order).
MAX_BATCH_OPS: Final = 1024


class _Request(msgspec.Struct, frozen=True, tag_field="op", forbid_unknown_fields=True):
    id: int


# omit_defaults: a Hello that carries no descriptor is one an older daemon reads.
class Hello(_Request, frozen=True, tag="hello", omit_defaults=True):
    client: str = ""
    # A client that names no version speaks 1: single frames, as before 2.
    protocol: int = 1
    # How many descriptors (SCM_RIGHTS) the Hello's first bytes carried:
    # KV memory a RegionSpec names by index. The daemon checks the count,
    # so a descriptor lost on the way is a refusal, not a wrong region.
    descriptors: int = 0


# omit_defaults: a registration without a memory note is one an older daemon reads.
class RegisterEngine(_Request, frozen=True, tag="register_engine", omit_defaults=True):
    """Declare an engine's KV layout and share its memory with the daemon.

    ``offload`` optionally names a region of ``offload_slots`` equal slots the
    daemon hands out per request and zeroes on release. A request keeps its
    slots until it is released, across a daemon restart too: an engine that
    registers again while any are held must bring the same pool.
    """

    engine_id: str
    groups: tuple[GroupSpec, ...]
    regions: tuple[RegionSpec, ...]
    offload: RegionSpec | None = None
    offload_slots: int = 0
    # What produced this engine's KV; pushes pair only equal fingerprints.
    fingerprint: Fingerprint | None = None
    # Whose bytes the regions are and why (kvpushd status shows it).
    memory_note: MemoryNote | None = None


# omit_defaults: a registration that is not ``answered`` is one an older daemon reads.
class RegisterRequest(_Request, frozen=True, tag="register_request", omit_defaults=True):
    """Register one request; ``blocks`` are logical block ids per group.

    Receiver (decode side): the blocks still to fill, and ``peer`` names the
    prefill node. Pusher (prefill side): the full sequence's blocks.

    ``peer_address`` (receiver only, optional): the prefill daemon's peer
    listen address, ``host:port``, for a peer that is not in this daemon's
    ``[[peers]]``: the daemon dials it on demand (README.md, "Peers on
    demand"). Empty, or a configured peer: the static link is used, as before.
    """

    engine_id: str
    request_id: str
    role: Role
    blocks: tuple[tuple[int, ...], ...]
    incarnation: int = 1
    peer: str = ""
    offload_slots: int = 0
    peer_address: str = ""
    # What the blocks hold or are for (e.g. a digest of the prompt's token
    # ids), up to 128 characters: a push pairs only equal ones, where both
    # sides name one (``content_mismatch`` otherwise). "": not named.
    content: str = ""
    # Receiver only: registered from the prefill's answer, so the prefill
    # finished the request and its engine registers the push within a step
    # or two. The prefill daemon then waits ``[deadlines] answered`` for it
    # (a transfer it never had fails ``unknown_request`` that soon), not
    # ``registered``. False: a leg sent with the prefill's (it may not have
    # started). Ignored on a pusher.
    answered: bool = False


class KvReady(_Request, frozen=True, tag="kv_ready"):
    request_id: str
    incarnation: int = 1


class Release(_Request, frozen=True, tag="release"):
    request_id: str
    incarnation: int = 1


class Abort(_Request, frozen=True, tag="abort"):
    request_id: str
    incarnation: int = 1


class Hold(_Request, frozen=True, tag="hold"):
    """Decode side: this engine will load ``request_id`` from ``peer`` once it has blocks.

    Sent while the decode engine's request waits in its queue, before it
    can register a receiver: the decode daemon tells the prefill daemon
    (dialled at ``peer_address`` if no link is up, as a receiver's), which
    keeps the push waiting for the receiver a ``registered`` deadline more,
    up to its ``[deadlines] held`` bound. Nothing is journaled here.
    """

    request_id: str
    peer: str
    peer_address: str = ""
    incarnation: int = 1


class Status(_Request, frozen=True, tag="status"):
    pass


class KvMismatch(_Request, frozen=True, tag="kv_mismatch"):
    """Decode side: a load's KV is not this engine's (identity by behaviour).

    The engine recomputed the prompt's token at ``position`` and its own K/V
    of ``layer`` there differed from what the prefill pushed by
    ``difference`` (the largest absolute difference), more than
    ``tolerance``. ``request_id`` and ``incarnation`` are the receiver's, as
    registered; it may be released already. The daemon journals
    ``kv_mismatch``, tells the prefill daemon (which quarantines the pairing
    of the two engines' fingerprints) and answers ``Ok``; an id this daemon
    never had a receiver for (or forgot: it keeps the last few thousand
    released) is refused, nothing changed.
    """

    request_id: ReportedId
    layer: Layer
    position: Position
    difference: Difference
    tolerance: Difference
    detail: Detail = ""
    incarnation: Incarnation = 1


class QuarantineList(_Request, frozen=True, tag="quarantine_list"):
    """Operator: the pairings this daemon quarantined (``kvpushd quarantine list``)."""


MAX_CLEARED: Final = 1024


class QuarantineClear(_Request, frozen=True, tag="quarantine_clear"):
    """Operator: end the quarantine of the pairings ``ids`` names, or of all (``every``)."""

    ids: Annotated[
        tuple[Annotated[str, msgspec.Meta(max_length=64)], ...],
        msgspec.Meta(max_length=MAX_CLEARED),
    ] = ()
    every: bool = False


# ------------------------------------------------------ the offload tier

# Bounds of every offload call (README.md, "Offload tier"): what one call
# may name, so that no frame, journal record or reply grows without bound;
# the core's own (schemas/events.py), checked here as the frame is decoded.
MAX_OFFLOAD_BATCH: Final = MAX_BATCH  # slots or keys in one call
MAX_HOLDER: Final = 128  # characters of a holder's name
MAX_SLOT: Final = (1 << 31) - 1
MAX_GENERATION: Final = (1 << 63) - 1

Holder = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_HOLDER)]
# "" in a store or a lease: the namespace the holder's attach bound (OffloadAttach).
Namespace = Annotated[str, msgspec.Meta(max_length=MAX_NAMESPACE)]
Slot = Annotated[int, msgspec.Meta(ge=0, le=MAX_SLOT)]
Generation = Annotated[int, msgspec.Meta(ge=0, le=MAX_GENERATION)]
OffloadKey = Annotated[bytes, msgspec.Meta(min_length=1, max_length=MAX_KEY_BYTES)]
Digest = Annotated[bytes, msgspec.Meta(max_length=MAX_DIGEST_BYTES)]
Slots = Annotated[tuple[Slot, ...], msgspec.Meta(max_length=MAX_OFFLOAD_BATCH)]
Generations = Annotated[tuple[Generation, ...], msgspec.Meta(max_length=MAX_OFFLOAD_BATCH)]
OffloadKeys = Annotated[tuple[OffloadKey, ...], msgspec.Meta(max_length=MAX_OFFLOAD_BATCH)]
Digests = Annotated[tuple[Digest, ...], msgspec.Meta(max_length=MAX_OFFLOAD_BATCH)]


class OffloadAttach(_Request, frozen=True, tag="offload_attach", omit_defaults=True):
    """Map the node's offload pool: answered by :class:`OffloadPool`, its descriptor attached.

    The reply's first bytes carry the pool's descriptor (SCM_RIGHTS), so a
    client reads it with ``recvmsg`` (daemon/client/pool.py ``attach_pool``,
    a connection of its own). ``holder`` names the tier client; the daemon
    keeps what a holder was granted and leased while any connection that
    named it lives, and gives it all up (``abandon``) when the last closes.

    ``namespace`` binds the holder to the namespace its chunks live in (an
    engine's worker knows it: its weights digest is part of it); a store or
    a lease of the holder that names the empty namespace means this one,
    so an engine's scheduler, which cannot compute it, names only the
    holder. A holder bound elsewhere by a connection that lives is refused.
    """

    holder: Holder
    namespace: Namespace = ""


class OffloadGrant(_Request, frozen=True, tag="offload_grant"):
    """Up to ``n`` reset, zero slots for ``holder`` to write (fewer, even none, when short)."""

    holder: Holder
    n: Annotated[int, msgspec.Meta(ge=1, le=MAX_OFFLOAD_BATCH)]


class OffloadStore(_Request, frozen=True, tag="offload_store"):
    """Publish written slots: ``keys[i]`` is in ``slots[i]`` (granted at ``generations[i]``).

    ``digests[i]`` is the writer's digest of the slot's bytes, handed to
    every reader. Answered once durable; a key already committed in
    ``namespace`` keeps the first slot (its entry False) and this one is reset.
    """

    holder: Holder
    namespace: Namespace
    slots: Slots
    generations: Generations
    keys: OffloadKeys
    digests: Digests


class OffloadLease(_Request, frozen=True, tag="offload_lease"):
    """Look ``keys`` up in ``namespace`` and lease each hit to ``holder`` until unleased."""

    holder: Holder
    namespace: Namespace
    keys: OffloadKeys


class OffloadUnlease(_Request, frozen=True, tag="offload_unlease"):
    """End ``holder``'s leases of ``slots`` (at ``generations``)."""

    holder: Holder
    slots: Slots
    generations: Generations


class OffloadCondemn(_Request, frozen=True, tag="offload_condemn"):
    """``holder`` says leased (or committed) ``slots`` (at ``generations``) are bad: the
    bytes it loaded differ from the committed digest.

    Each leaves the content index at once (never leased again; its key may
    be stored anew) and is evicted and reset once no lease holds it; the
    holder still gives its own leases back. Answered :class:`Ok` once
    durable; a slot condemned already is no refusal.
    """

    holder: Holder
    slots: Slots
    generations: Generations


OffloadRequest = (
    OffloadAttach | OffloadGrant | OffloadStore | OffloadLease | OffloadUnlease | OffloadCondemn
)


# What a Batch may carry: the calls about one request each, which an engine
# step produces many of. Hello, RegisterEngine and Status stay single.
BatchOp = RegisterRequest | KvReady | Release | Abort | Hold


class Batch(_Request, frozen=True, tag="batch"):
    """Several calls in one frame (protocol 2); answered by one :class:`BatchReply`.

    Each op keeps its own ``id`` and gets its own reply (a refusal is that
    op's ``Error``, the others go on). The daemon runs the batch after
    whatever came before about any of its requests and admits the ops in
    order, in one pass, so their records share one group commit; the
    BatchReply leaves once they are durable, replies in the ops' order.
    """

    ops: Annotated[tuple[BatchOp, ...], msgspec.Meta(min_length=1, max_length=MAX_BATCH_OPS)]


Request = (
    Hello
    | RegisterEngine
    | RegisterRequest
    | KvReady
    | Release
    | Abort
    | Hold
    | Status
    | Batch
    | KvMismatch
    | QuarantineList
    | QuarantineClear
    | OffloadAttach
    | OffloadGrant
    | OffloadStore
    | OffloadLease
    | OffloadUnlease
    | OffloadCondemn
)


# ---------------------------------------------------------------- replies


class _Reply(msgspec.Struct, frozen=True, tag_field="kind"):
    id: int


class Ok(_Reply, frozen=True, tag="ok"):
    pass


class HelloOk(_Reply, frozen=True, tag="hello_ok"):
    node: str
    protocol: int
    version: str
    # This daemon process's boot id: a client that reconnects tells by it
    # whether the daemon that held its requests lived (same id) or not.
    boot_id: str = ""


class RequestAccepted(_Reply, frozen=True, tag="request_accepted"):
    """Reply to register_request; ``state`` is where the request now is."""

    state: str
    offload_slots: tuple[int, ...] = ()


class Deferred(_Reply, frozen=True, tag="deferred"):
    """A release was deferred: a write may still be in flight."""

    message: str


class StatusReply(_Reply, frozen=True, tag="status_reply"):
    status: StatusDocument


class QuarantineReply(_Reply, frozen=True, tag="quarantine_reply"):
    """The quarantined pairings (after a clear: those left), and the ids a clear ended."""

    entries: tuple[Quarantined, ...]
    cleared: tuple[str, ...] = ()


class OffloadPool(_Reply, frozen=True, tag="offload_pool"):
    """Reply to :class:`OffloadAttach`; its frame carries the pool's descriptor.

    Slot ``s`` is ``slot_bytes`` bytes at offset ``header_bytes + s * slot_bytes``.
    """

    slots: int
    slot_bytes: int
    header_bytes: int
    pool_id: str


class OffloadGranted(_Reply, frozen=True, tag="offload_granted"):
    """The granted slots and their generations, in parallel (possibly none)."""

    slots: tuple[int, ...]
    generations: tuple[int, ...]


class OffloadStored(_Reply, frozen=True, tag="offload_stored"):
    """Per stored slot: True committed, False a duplicate key (the first kept)."""

    committed: tuple[bool, ...]


class OffloadLeased(_Reply, frozen=True, tag="offload_leased"):
    """Per key: its slot (-1: a miss), generation and digest (empty on a miss)."""

    slots: tuple[int, ...]
    generations: tuple[int, ...]
    digests: tuple[bytes, ...]


class Error(_Reply, frozen=True, tag="error"):
    """A refusal or a malformed request; ``code`` is stable, ``message`` is for people.

    ``code`` is a :class:`Reason` value, or one of the protocol codes below.
    """

    code: str
    message: str


# Protocol error codes (besides Reason values).
BAD_FRAME: Final = "bad_frame"
BAD_REQUEST: Final = "bad_request"
FRAME_TOO_LARGE: Final = "frame_too_large"
NOT_REGISTERED: Final = "not_registered"
BAD_REGION: Final = "bad_region"
INTERNAL: Final = "internal"
SHUTTING_DOWN: Final = "shutting_down"
# The connecting process's uid and groups are not allowed (allowed_uids,
# allowed_groups): sent with id 0 before the daemon closes the connection.
NOT_ALLOWED: Final = "not_allowed"
# An offload call to a daemon whose [offload] tier is off (offload.slots = 0).
NO_OFFLOAD_TIER: Final = "no_offload_tier"


# ----------------------------------------------------------------- events


class KvArrived(msgspec.Struct, frozen=True, tag_field="kind", tag="kv_arrived"):
    """Decode side: the request's KV is in its blocks."""

    request_id: str
    incarnation: int


class BlocksFreeable(msgspec.Struct, frozen=True, tag_field="kind", tag="blocks_freeable"):
    """Prefill side: the write is over; the source blocks may be freed."""

    request_id: str
    incarnation: int


class RequestFailed(msgspec.Struct, frozen=True, tag_field="kind", tag="request_failed"):
    request_id: str
    incarnation: int
    reason: Reason
    message: str


class Released(msgspec.Struct, frozen=True, tag_field="kind", tag="released"):
    """A deferred release was carried out; the blocks are the engine's again."""

    request_id: str
    incarnation: int


OpReply = Ok | RequestAccepted | Deferred | Error


class BatchReply(_Reply, frozen=True, tag="batch_reply"):
    """The replies to a :class:`Batch`'s ops, in the ops' order (``id``: the batch's)."""

    replies: tuple[OpReply, ...]


Reply = (
    Ok
    | HelloOk
    | RequestAccepted
    | Deferred
    | StatusReply
    | Error
    | BatchReply
    | QuarantineReply
    | OffloadPool
    | OffloadGranted
    | OffloadStored
    | OffloadLeased
)
Event = KvArrived | BlocksFreeable | RequestFailed | Released


class Events(msgspec.Struct, frozen=True, tag_field="kind", tag="events"):
    """Protocol 2: the events one loop iteration produced for a connection, in order."""

    events: tuple[Event, ...]


ServerMessage = Reply | Event | Events
