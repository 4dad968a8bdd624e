"""The shape of the core's state: request records, deadlines, snapshots.

Only data lives here; the rules that move it are in ``statemachine``.
"""

from __future__ import annotations

import enum

import msgspec

from schemas.events import Blocks, PeerRegistered
from schemas.fingerprint import Fingerprint
from schemas.layout import EngineLayout, Role
from schemas.reasons import Reason


class State(enum.StrEnum):
    REGISTERED = "registered"
    TRIMMED = "trimmed"
    WRITING = "writing"
    DONE = "done"
    RELEASED = "released"
    FAILED = "failed"


class Deadlines(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Seconds a request may spend in each state before the shell acts.

    Every live state has one, so every request ends (ARCHITECTURE.md, invariant 7).
    """

    registered: float = 30.0
    trimmed: float = 30.0
    writing: float = 30.0
    done: float = 120.0
    failed: float = 60.0
    # The longest a pusher waits for its receiver, from its registration,
    # while the decode side holds it (its request queued for blocks).
    held: float = 120.0
    # The longest a pusher waits for its receiver, from its registration,
    # while nobody holds it (at most ``registered``): a decode that is
    # down, or a router that never sends the decode leg, pins the prefill's
    # blocks this long, not a whole ``registered`` deadline. A decode
    # request queued for blocks holds the push (``held`` bounds that).
    unclaimed: float = 5.0
    # The longest a receiver's registration made from a prefill's answer
    # (``PeerRegistered.answered``: the prefill finished the request, so its
    # engine registers the push within a step or two) waits here for that
    # push (at most ``registered``): a transfer id this prefill never had
    # (a stale or forged answer) fails ``unknown_request`` this soon, not at
    # ``registered``. A receiver sent with the prefill's leg keeps ``registered``.
    answered: float = 2.0

    def for_state(self, state: State) -> float:
        return getattr(self, state.value)


class RequestRecord(msgspec.Struct, frozen=True):
    """Everything a node knows about one live request.

    Records are immutable; a transition produces a new record.
    """

    request_id: str
    incarnation: int
    role: Role
    engine_id: str
    peer: str
    state: State
    blocks: Blocks
    entered_at: float
    deadline: float
    # Pusher side: the receiver's registration, then the trimmed pairing.
    remote_engine: str = ""
    remote_blocks: Blocks | None = None
    remote_per_logical: int = 1
    remote_fingerprint: Fingerprint | None = None
    src: Blocks | None = None
    dst: Blocks | None = None
    kv_ready: bool = False
    # Receiver side: the pusher has given its final word for this request.
    settled: bool = False
    release_pending: bool = False
    reason: Reason | None = None
    message: str = ""
    # What the blocks hold (Registered.content), and, on a pusher, what the
    # receiver's are for: a push pairs only equal ones where both are named.
    content: str = ""
    remote_content: str = ""
    # Receiver side: registered from the prefill's answer (Registered.answered),
    # said again in every forward.
    answered: bool = False


class PendingPeer(msgspec.Struct, frozen=True):
    """A receiver's registration that reached the pusher before its engine did."""

    registration: PeerRegistered
    received_at: float


class Quarantined(msgspec.Struct, frozen=True, omit_defaults=True):
    """A quarantined pairing: a prefill and a decode fingerprint whose KV disagreed.

    Folded from the pusher's ``KvMismatch`` records (statemachine/quarantine.py):
    ``id`` names it for ``kvpushd quarantine clear``; the fingerprints are
    the pairing's (placement left out: every rank's share of that pairing);
    the rest is the first mismatch that quarantined it (``since``, journal
    time), and ``mismatches`` counts every one since.
    """

    id: str
    prefill_fingerprint: Fingerprint | None
    decode_fingerprint: Fingerprint | None
    since: float
    request_id: str
    engine_id: str
    peer: str
    peer_engine: str
    layer: int
    position: int
    difference: float
    tolerance: float
    mismatches: int = 1


class SlotState(enum.StrEnum):
    """Where one slot of the node's offload pool is (statemachine/slots.py ``SLOT_TRANSITIONS``).

    FREE means reset: zeroed, grantable. EVICTED waits for its reset.
    """

    FREE = "free"
    GRANTED = "granted"
    STORED = "stored"
    COMMITTED = "committed"
    LEASED = "leased"
    EVICTED = "evicted"


class SlotRecord(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True):
    """One slot of the offload pool as data (snapshots list those not free at generation 0).

    ``holder`` is its writer, from its grant to its reset; ``namespace``,
    ``key`` and ``digest`` what it stored, kept until its reset (in the
    index only while committed or leased, and not condemned); ``leases``
    each reader's count; ``condemned``: a reader condemned it
    (``SlotsCondemned``), from then until its reset (last, so that a
    record written before it existed decodes as not condemned).
    """

    slot: int
    state: SlotState
    generation: int
    holder: str = ""
    namespace: str = ""
    key: bytes = b""
    digest: bytes = b""
    leases: tuple[tuple[str, int], ...] = ()
    condemned: bool = False


class SlotPoolSnapshot(msgspec.Struct, frozen=True, omit_defaults=True):
    """The offload pool as data (statemachine/slots.py ``SlotPool.snapshot``).

    ``records`` lists every slot that is not free at generation 0, by
    number; ``recency`` the committed and leased slots (condemned ones
    too), least recently used first; ``evicted`` the evicted ones in the
    order they were evicted (the order they are reset in);
    ``retired_generation`` the highest
    generation of a slot a smaller pool dropped (a slot that comes back
    starts above it).
    """

    size: int
    slot_bytes: int
    pool_id: str
    records: tuple[SlotRecord, ...] = ()
    recency: tuple[int, ...] = ()
    evicted: tuple[int, ...] = ()
    retired_generation: int = 0


class RegistrySnapshot(msgspec.Struct, frozen=True, omit_defaults=True):
    """The whole registry as data: written to snapshots, compared in tests.

    ``offload`` lists the offload slots each live request holds (request id,
    slots), in grant order; omitted when none is held, so a registry without
    grants encodes as it did before grants were journaled. ``quarantine``:
    the quarantined pairings (none: omitted, as before there were any).
    ``slots``: the node's offload pool and its content index (none opened:
    omitted, as before there was one).
    """

    last_seq: int
    engines: tuple[EngineLayout, ...]
    live: tuple[RequestRecord, ...]
    pending: tuple[PendingPeer, ...]
    tombstones: tuple[tuple[str, int], ...]
    offload: tuple[tuple[str, tuple[int, ...]], ...] = ()
    quarantine: tuple[Quarantined, ...] = ()
    slots: SlotPoolSnapshot | None = None
