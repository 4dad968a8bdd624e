"""Journal events: one tagged union, wrapped in an envelope per record.

Every journal record is an :class:`Record` envelope (format version, node,
sequence number, wall-clock time, all stamped by the shell) around one event
body. Bodies are facts about the node's registry; folding them in order
through ``statemachine.Registry.apply`` rebuilds the live state exactly.

Records are encoded ``array_like`` (positional msgpack arrays): the journal is
written and replayed millions of times, and positional encoding is both
smaller and about 40 % faster to decode. The price is that fields are only
ever appended, with defaults, which the format version makes explicit.
"""

from __future__ import annotations

from typing import Annotated, Final

import msgspec

from schemas.fingerprint import Fingerprint
from schemas.layout import EngineLayout, Role
from schemas.reasons import Reason

FORMAT_VERSION: Final = 1

Blocks = tuple[tuple[int, ...], ...]
"""Kernel block ids, one tuple per KV-cache group, in group order."""

# Bounds of what an engine (rpc.KvMismatch) or a peer (peer.KvMismatch)
# reports of a behavioural check, checked where the report is decoded.
MAX_REPORTED_ID: Final = 1024  # a request id, as long as any engine makes one
MAX_MISMATCH_DETAIL: Final = 256
MAX_LAYER: Final = 1 << 20
MAX_POSITION: Final = 1 << 40  # a token position
MAX_DIFFERENCE: Final = 1e300  # finite: NaN and inf are refused
ReportedId = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_REPORTED_ID)]
Incarnation = Annotated[int, msgspec.Meta(ge=1, le=(1 << 63) - 1)]
Layer = Annotated[int, msgspec.Meta(ge=0, le=MAX_LAYER)]
Position = Annotated[int, msgspec.Meta(ge=0, le=MAX_POSITION)]
Difference = Annotated[float, msgspec.Meta(ge=0.0, le=MAX_DIFFERENCE)]
Detail = Annotated[str, msgspec.Meta(max_length=MAX_MISMATCH_DETAIL)]

# Bounds of what an engine's offload tier names (statemachine/slots.py
# checks them; an RPC may decode with them): an offload key (vLLM's block
# hash with its group), a namespace (a digest of what makes KV comparable),
# a digest of a slot's bytes, and the items of one call. A batch the core
# makes itself (an eviction of every slot, a restart) is bounded by the
# pool instead, at most ``MAX_POOL_SLOTS``: its record fits the journal's.
MAX_KEY_BYTES: Final = 80
MAX_NAMESPACE: Final = 128
MAX_DIGEST_BYTES: Final = 64
MAX_BATCH: Final = 4096
MAX_POOL_SLOTS: Final = 1 << 20


class _Event(msgspec.Struct, frozen=True, array_like=True, tag_field="ev"):
    """Base of all event bodies (never encoded by itself)."""


class _RequestEvent(_Event, frozen=True):
    request_id: str
    incarnation: int


class DaemonStarted(_Event, frozen=True, tag="daemon_started"):
    """The daemon started and finished replaying its journal."""

    pid: int
    version: str
    boot_id: str


class EngineAttached(_Event, frozen=True, tag="engine_attached"):
    layout: EngineLayout


class EngineDetached(_Event, frozen=True, tag="engine_detached"):
    engine_id: str


class Registered(_RequestEvent, frozen=True, tag="registered"):
    """A local engine registered a request; ``blocks`` are kernel ids.

    ``offload_slots`` are the slots of the engine's offload pool granted to
    the request, held until it is released: journaled so that replay knows,
    after a crash, which slots live requests still hold.
    """

    role: Role
    engine_id: str
    peer: str
    blocks: Blocks
    offload_slots: tuple[int, ...] = ()
    # What the blocks hold, as the engine names it (e.g. a digest of the
    # prompt's token ids); "" when it names nothing.
    content: str = ""
    # Receiver only: registered from the prefill's answer (the prefill
    # finished the request), not with its leg (rpc.RegisterRequest.answered).
    answered: bool = False


class PeerRegistered(_RequestEvent, frozen=True, tag="peer_registered"):
    """Pusher side: the receiver's registration, forwarded by its daemon."""

    peer: str
    engine_id: str
    blocks: Blocks
    per_logical: int = 1
    # The receiver engine's fingerprint (statemachine/fingerprint.py).
    fingerprint: Fingerprint | None = None
    # What the receiver's engine said its blocks are for (Registered.content).
    content: str = ""
    # The receiver registered from the prefill's answer: pending, it waits
    # ``[deadlines] answered`` for the push, not ``registered``.
    answered: bool = False


class KvReady(_RequestEvent, frozen=True, tag="kv_ready"):
    """Pusher side: the prefill engine finished computing the KV."""


class Trimmed(_RequestEvent, frozen=True, tag="trimmed"):
    """Pusher side: blocks paired after prefix-cache trim, ready to write.

    ``src[g][i]`` is written into ``dst[g][i]``. The counts before trim are
    kept so a postmortem can see what each side asked for.
    """

    src: Blocks
    dst: Blocks
    src_before: tuple[int, ...]
    dst_before: tuple[int, ...]


class WriteStarted(_RequestEvent, frozen=True, tag="write_started"):
    num_blocks: int
    nbytes: int


class WriteDone(_RequestEvent, frozen=True, tag="write_done"):
    pass


class Failed(_RequestEvent, frozen=True, tag="failed"):
    """The request failed.

    ``settled`` (receiver side) says the failure comes with the pusher's
    final word: no write into the destination blocks can still happen.
    """

    reason: Reason
    message: str
    settled: bool = False


class PeerSettled(_RequestEvent, frozen=True, tag="peer_settled"):
    """Receiver side: the pusher confirmed no write is or will be in flight.

    ``fenced`` means the confirmation came from fencing a dead peer rather
    than from the peer itself.
    """

    fenced: bool = False


class Held(_RequestEvent, frozen=True, tag="held"):
    """Pusher side: the decode side will load this request, but waits for blocks.

    The pusher keeps waiting for its receiver until ``until`` (journal time):
    the decode daemon said so for an engine whose request is queued
    (``rpc.Hold``), bounded by this daemon's ``[deadlines] held``.
    """

    until: float


class ReleaseDeferred(_RequestEvent, frozen=True, tag="release_deferred"):
    """The engine asked to release while a write may be in flight."""


class Released(_RequestEvent, frozen=True, tag="released"):
    pass


class IntegrityMismatch(_RequestEvent, frozen=True, tag="integrity_mismatch"):
    """Receiver side: bytes that landed differ from the pusher's checksums.

    Journaled with the ``Failed(integrity_mismatch)`` it explains, before the
    decode engine hears of the data. ``checked`` block checksums were
    compared and ``mismatched`` of them differed; ``blocks`` names the first
    of those (statemachine/integrity.py ``MAX_LISTED``) as (group, layer,
    destination kernel block).
    """

    checked: int
    mismatched: int
    blocks: tuple[tuple[int, int, int], ...]


class Refused(_RequestEvent, frozen=True, tag="refused"):
    """A message about a request was refused; no state changed.

    Journaled so that the postmortem sees every refusal, in order.
    """

    engine_id: str
    reason: Reason
    message: str


class KvMismatch(_Event, frozen=True, tag="kv_mismatch"):
    """A decode recomputed a loaded prompt's token and its K/V differed from the pushed K/V.

    Not a transition: the request may be released already (the load landed,
    ``kv_arrived`` went out, the engine released it, then its forward ran).
    Journaled on both nodes: ``role`` receiver on the decode's (the decode
    engine's report, ``rpc.KvMismatch``; ``peer`` the prefill node, whose
    pushing engine it does not know: ``peer_engine`` ""), role pusher on the
    prefill's (the decode daemon's ``peer.KvMismatch``; ``peer`` the decode
    node, ``peer_engine`` its engine). ``layer`` and ``position`` say where,
    ``difference`` the largest absolute difference and ``tolerance`` the
    bound the engine compared it with. A pusher's record carries both
    engines' fingerprints, the pairing it quarantines
    (statemachine/quarantine.py); replay rebuilds the quarantine from it.
    """

    request_id: str
    incarnation: int
    role: Role
    engine_id: str
    peer: str
    peer_engine: str
    layer: int
    position: int
    difference: float
    tolerance: float
    detail: str = ""
    prefill_fingerprint: Fingerprint | None = None
    decode_fingerprint: Fingerprint | None = None


class QuarantineCleared(_Event, frozen=True, tag="quarantine_cleared"):
    """An operator cleared the quarantine of one pairing (``kvpushd quarantine clear``)."""

    prefill_fingerprint: Fingerprint | None
    decode_fingerprint: Fingerprint | None
    # Which quarantine it was (statemachine/quarantine.py quarantine_id).
    quarantine_id: str = ""


# The node's KV offload tier (statemachine/slots.py, its table
# SLOT_TRANSITIONS): a pool of equal slots the daemon owns, each walking
# free -> granted -> stored -> committed -> leased ... -> evicted -> free.
# One record names a batch of slots; ``slots`` and ``generations`` are
# parallel, each slot named with the generation it has when the record is
# applied (a reset bumps it), so a late word about an older use is refused.


class SlotsGranted(_Event, frozen=True, tag="slots_granted"):
    """Free (zeroed) slots granted to one writer, ``holder``: an engine's offload tier."""

    holder: str
    slots: tuple[int, ...]
    generations: tuple[int, ...]


class SlotsStored(_Event, frozen=True, tag="slots_stored"):
    """The writer says its bytes are in: each slot holds the KV of ``keys[i]`` in ``namespace``.

    ``digests[i]`` is the digest of the slot's bytes as written, handed to
    every reader with the slot.
    """

    holder: str
    namespace: str
    slots: tuple[int, ...]
    generations: tuple[int, ...]
    keys: tuple[bytes, ...]
    digests: tuple[bytes, ...]


class SlotsCommitted(_Event, frozen=True, tag="slots_committed"):
    """Stored slots published in the content index: readable from now on."""

    slots: tuple[int, ...]
    generations: tuple[int, ...]


class SlotsDiscarded(_Event, frozen=True, tag="slots_discarded"):
    """Granted or stored slots given up unpublished; each waits for its reset.

    ``why``: ``duplicate_key`` (a second commit of a committed key: the
    first stays), ``abandoned`` (its writer is gone), ``restart`` (found
    granted or stored at a daemon restart), ``not_zero`` (not zeroed at grant).
    """

    slots: tuple[int, ...]
    generations: tuple[int, ...]
    why: str


class SlotsLeased(_Event, frozen=True, tag="slots_leased"):
    """A reader, ``holder``, leases committed slots: a slot listed twice is two leases."""

    holder: str
    slots: tuple[int, ...]
    generations: tuple[int, ...]


class SlotsUnleased(_Event, frozen=True, tag="slots_unleased"):
    """``holder`` gives leases back; a slot without a lease left is committed again."""

    holder: str
    slots: tuple[int, ...]
    generations: tuple[int, ...]


class SlotsEvicted(_Event, frozen=True, tag="slots_evicted"):
    """Committed slots without a lease taken out of the index; each waits for its reset.

    ``why``: ``lru``, ``pool_lost`` (the pool's memory did not survive a
    restart), ``reset_cache`` (an engine's cache reset), ``operator``,
    ``condemned`` (a reader condemned it, :class:`SlotsCondemned`, and its
    last lease went).
    """

    slots: tuple[int, ...]
    generations: tuple[int, ...]
    why: str


class SlotsCondemned(_Event, frozen=True, tag="slots_condemned"):
    """A reader, ``holder``, says committed (or leased) slots are bad: never handed out again.

    Each slot leaves the content index at once (no lookup finds it; its key
    may be committed again, in another slot) and is marked condemned until
    its reset; it keeps its leases, and is evicted (``condemned``) once no
    lease holds it. ``why``: ``bad_digest`` (the bytes the reader loaded
    differ from the committed digest: a write after the commit, a reset
    skipped, damage).
    """

    holder: str
    slots: tuple[int, ...]
    generations: tuple[int, ...]
    why: str


class SlotsReset(_Event, frozen=True, tag="slots_reset"):
    """Evicted slots zeroed by the shell (before this is journaled): free, generation + 1."""

    slots: tuple[int, ...]
    generations: tuple[int, ...]


class PoolOpened(_Event, frozen=True, tag="pool_opened"):
    """The offload pool as the daemon opened it at start.

    ``survived``: the pool's memory is the one the journal's slots were
    written in (it outlived the daemon). A pool of another size or id than
    the journal's, or one that did not survive, holds none of the
    journal's content: the core evicts every committed slot first
    (``SlotPool.check_pool_opened``).
    """

    slots: int
    slot_bytes: int
    pool_id: str
    survived: bool


Event = (
    DaemonStarted
    | EngineAttached
    | EngineDetached
    | Registered
    | PeerRegistered
    | KvReady
    | Trimmed
    | WriteStarted
    | WriteDone
    | Failed
    | PeerSettled
    | ReleaseDeferred
    | Released
    | Refused
    | IntegrityMismatch
    | Held
    | KvMismatch
    | QuarantineCleared
    | PoolOpened
    | SlotsGranted
    | SlotsStored
    | SlotsCommitted
    | SlotsDiscarded
    | SlotsLeased
    | SlotsUnleased
    | SlotsEvicted
    | SlotsCondemned
    | SlotsReset
)

SlotEvent = (
    SlotsGranted
    | SlotsStored
    | SlotsCommitted
    | SlotsDiscarded
    | SlotsLeased
    | SlotsUnleased
    | SlotsEvicted
    | SlotsCondemned
    | SlotsReset
)

RequestEvent = (
    Registered
    | PeerRegistered
    | KvReady
    | Trimmed
    | WriteStarted
    | WriteDone
    | Failed
    | PeerSettled
    | ReleaseDeferred
    | Released
    | Refused
    | IntegrityMismatch
    | Held
)


class Record(msgspec.Struct, frozen=True, array_like=True):
    """One journal record: the envelope the shell stamps around an event."""

    v: int
    node: str
    seq: int
    ts: float
    event: Event


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Record)


def encode_record(record: Record) -> bytes:
    return _encoder.encode(record)


def record_decoder() -> msgspec.msgpack.Decoder[Record]:
    """A decoder of records, for loops that decode millions of them."""
    return msgspec.msgpack.Decoder(Record)


def decode_record(payload: bytes | memoryview) -> Record:
    """Decode one record; raises ``msgspec.DecodeError`` or ``ValidationError``."""
    return _decoder.decode(payload)
