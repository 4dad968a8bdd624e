"""One node's journal read with salvage and folded through the core, kept as columns.

The fold is :func:`daemon.journal.replay.fold_contents`, exactly as the
daemon runs it on start. What the core returns for every record is kept in
compact columns (:class:`NodeFold`), not as objects: a million-event journal
is a few arrays, cheap to hand back from a worker process.
"""

from __future__ import annotations

import array
import dataclasses
import gc
import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Final, NamedTuple, TypeVar, cast

import msgspec
import numpy as np
import numpy.typing as npt

from daemon.journal.reader import JournalContents, Unit, read_journal
from daemon.journal.replay import decode_snapshot, fold_contents
from daemon.postmortem.progress import ProgressSlot
from daemon.postmortem.sources import NodeSource
from daemon.postmortem.vocab import (
    FIRST_REQUEST_KIND,
    K_FAILED,
    K_PEER_REGISTERED,
    K_REFUSED,
    K_REGISTERED,
    KIND_CODE,
    KIND_STATE,
    KINDS,
    ROLE_PUSHER,
    ROLE_RECEIVER,
    S_NONE,
    S_PENDING,
    STATE_CODE,
    FloatArray,
    IntArray,
    RequestKey,
)
from schemas.events import (
    DaemonStarted,
    Event,
    Failed,
    IntegrityMismatch,
    KvMismatch,
    KvReady,
    Record,
    Refused,
    Registered,
    Released,
    ReleaseDeferred,
    RequestEvent,
    WriteDone,
    decode_record,
)
from schemas.layout import Role
from statemachine.registry import Registry

# Kinds whose record is kept for its details (block counts, bytes, reasons);
# the rest say all they have to say by their kind.
_KEEP: Final[tuple[bool, ...]] = tuple(
    kind not in (KvReady, WriteDone, ReleaseDeferred, Released) for kind in KINDS
)
# What the analysis reads of every request (roles, reasons, restarts): kept
# alone when no timeline will be drawn, which spares the fold a third of its
# bookkeeping.
_KEEP_FOR_ANALYSIS: Final[tuple[bool, ...]] = tuple(
    kind in (DaemonStarted, Registered, Failed, Refused, IntegrityMismatch, KvMismatch)
    for kind in KINDS
)
_Int = TypeVar("_Int", bound=np.integer[Any])
_event_encoder = msgspec.msgpack.Encoder()
_event_decoder = msgspec.msgpack.Decoder(Event)


@dataclass(frozen=True, slots=True)
class TornTail:
    node: str
    path: str
    offset: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class Rejected:
    """A record the core refused on replay: the journal's history is illegal there."""

    node: str
    seq: int
    ts: float
    kind: int
    key: RequestKey | None
    message: str


@dataclass(slots=True)
class NodeFold:
    """One node's journal after the fold, as columns (one entry per applied record).

    ``req`` indexes ``keys`` (-1: not a request event); ``state`` is the
    request's state on this node after the record (``S_NONE``: unchanged).
    ``details`` keeps the records whose kind carries more (block counts,
    bytes, reasons), by record index; read them with :meth:`event`.
    ``roles`` (per key) and ``reasons`` (failures and refusals, by record
    index) are what the analysis needs of them for every request.
    ``unreleased``: requests still live (or pending) when the journal ends,
    as the core's registry says; ``at_snapshot``: those live at the snapshot
    the fold started from.
    """

    node: str
    sources: tuple[str, ...]
    seq: IntArray
    ts: FloatArray
    kind: npt.NDArray[np.int8]
    req: npt.NDArray[np.int32]
    state: npt.NDArray[np.int8]
    details: dict[int, Event | bytes]
    keys: list[RequestKey]
    roles: npt.NDArray[np.int8]
    reasons: dict[int, str]
    unreleased: dict[RequestKey, int]
    at_snapshot: dict[RequestKey, AtSnapshot]
    snapshot_seq: int
    records_read: int
    torn: list[TornTail]
    damage: list[str]
    rejected: list[Rejected]

    @property
    def records(self) -> int:
        return len(self.seq)

    def event(self, i: int) -> Event | None:
        """The event of record ``i``, if its kind is kept (else None)."""
        found = self.details.get(i)
        if isinstance(found, bytes):
            found = self.details[i] = _event_decoder.decode(found)
        return found

    def keep_details(self, keep: KeepDetails) -> None:
        """Forget the kept records of requests ``keep`` rejects (never the node's own)."""
        wanted = np.fromiter(map(keep, self.keys), bool, len(self.keys))
        has_request = self.req >= 0
        steps = ~has_request
        steps[has_request] = wanted[self.req[has_request]]
        details = self.details
        self.details = {i: details[i] for i in np.flatnonzero(steps).tolist() if i in details}

    def pack(self) -> NodeFold:
        """Ready to leave a worker process: kept events as msgpack, which pickles
        several times faster than Structs; :meth:`event` decodes the few read."""
        encode = _event_encoder.encode
        self.details = {i: encode(e) for i, e in self.details.items()}
        return self


class _Columns:
    """The columns of one node, filled by the fold's per-record callback."""

    def __init__(self, keep: tuple[bool, ...] = _KEEP) -> None:
        self.keep = keep
        self.seq: list[int] = []
        self.ts: list[float] = []
        self.kind: list[int] = []
        self.req: list[int] = []
        self.pending: list[int] = []  # records that parked a peer registration
        # Events until NodeFold.pack encodes them for the trip out of a worker.
        self.details: dict[int, Event | bytes] = {}
        self.index: dict[RequestKey, int] = {}
        self.keys: list[RequestKey] = []

    def key_index(self, key: RequestKey) -> int:
        idx = self.index.get(key)
        if idx is None:
            idx = self.index[key] = len(self.keys)
            self.keys.append(key)
        return idx

    def batch_callback(self) -> Callable[[list[Record], list[object]], None]:
        """The fold's ``on_batch``: columns extended a batch (about a thousand records) at a time.

        No call per record: each column is one comprehension over the batch,
        and only what cannot wait is done here; states, details and roles
        are derived from these lists afterwards, in bulk. Request keys get
        their index on first sight (``setdefault`` on the insertion-ordered
        ``index``); :meth:`fold_done` lists them in ``keys`` once, in that order.
        """
        seqs, stamps, kinds, reqs = self.seq, self.ts, self.kind, self.req
        pending, details, index = self.pending, self.details, self.index
        kind_code, keep = KIND_CODE, self.keep
        first_request_kind, peer_registered = FIRST_REQUEST_KIND, K_PEER_REGISTERED
        setdefault = index.setdefault

        def on_batch(records: list[Record], touched: list[object]) -> None:
            base = len(seqs)
            events = [record.event for record in records]
            codes = [kind_code[type(event)] for event in events]
            seqs.extend([record.seq for record in records])
            stamps.extend([record.ts for record in records])
            kinds.extend(codes)
            for i, code in enumerate(codes):
                if keep[code]:
                    details[base + i] = events[i]
            # Engine and daemon events, and refusals of nameless requests, are no request's.
            reqs.extend(
                [
                    setdefault((event.request_id, event.incarnation), len(index))  # type: ignore[union-attr]
                    if code >= first_request_kind and event.request_id  # type: ignore[union-attr]
                    else -1
                    for event, code in zip(events, codes, strict=True)
                ]
            )
            pending.extend(
                [
                    base + i
                    for i, code in enumerate(codes)
                    if code == peer_registered and touched[i] is None
                ]
            )

        return on_batch

    def fold_done(self) -> None:
        """After the fold: ``keys`` in the order the batches indexed them."""
        self.keys.extend(itertools.islice(self.index, len(self.keys), None))

    def states(
        self, kind: npt.NDArray[np.int8], req: npt.NDArray[np.int32]
    ) -> npt.NDArray[np.int8]:
        state = KIND_STATE[kind]
        state[np.array(self.pending, np.int64)] = S_PENDING
        state[req < 0] = S_NONE
        return state

    def roles(self, kind: npt.NDArray[np.int8], req: npt.NDArray[np.int32]) -> npt.NDArray[np.int8]:
        """Per key: pusher (registered as one, or heard of from its peer) or receiver."""
        roles = np.zeros(len(self.keys), np.int8)
        registered = np.flatnonzero((kind == K_REGISTERED) & (req >= 0))
        # Registered records are always kept (both _KEEP lists hold them).
        roles[req[registered]] = [
            ROLE_PUSHER if cast(Registered, self.details[i]).role is Role.PUSHER else ROLE_RECEIVER
            for i in registered.tolist()
        ]
        roles[req[(kind == K_PEER_REGISTERED) & (req >= 0)]] = ROLE_PUSHER
        return roles

    def reasons(self, kind: npt.NDArray[np.int8]) -> dict[int, str]:
        steps = np.flatnonzero((kind == K_FAILED) | (kind == K_REFUSED)).tolist()
        # Failed and Refused records are always kept (both _KEEP lists hold them).
        return {i: cast("Failed | Refused", self.details[i]).reason.value for i in steps}


def _int_array(values: list[int], code: str, dtype: type[_Int]) -> npt.NDArray[_Int]:
    # Through array.array: numpy converts a list of Python ints element by
    # element, several times slower on a million-entry column.
    return np.frombuffer(array.array(code, values), dtype)


KeepDetails = Callable[[RequestKey], bool]


def no_request(key: RequestKey) -> bool:
    """A ``details`` policy for :func:`daemon.postmortem.load.load` when no timeline is drawn."""
    return False


class _ChainedRecords:
    """The records of several segment files of one node, in order, as one stream."""

    def __init__(self, parts: Sequence[JournalContents]) -> None:
        self._parts = parts

    def __len__(self) -> int:
        return sum(len(p.records) for p in self._parts)

    def __iter__(self) -> Iterator[tuple[int, bytes]]:
        for part in self._parts:
            yield from part.records

    def units(self) -> Iterator[Unit]:
        """As :meth:`Records.units`: the fold decodes a format-2 group in one call."""
        for part in self._parts:
            yield from part.records.units()


def _read_source(source: NodeSource) -> tuple[JournalContents, list[TornTail]]:
    """Read every file of a node with salvage; one contents to fold, and the torn tails.

    Salvage, because a postmortem reads journals after an incident: damage is
    listed, never a reason to show nothing. Envelope sequence numbers are
    trusted over the reader's numbering (``seqs_exact=False``), so records
    dropped from a rewritten copy show up as a gap instead of stopping the fold.
    """
    parts = [read_journal(path, salvage=True) for path in source.paths]
    torn = [
        TornTail(source.node, str(c.torn_at[0]), c.torn_at[1], c.torn_bytes)
        for c in parts
        if c.torn_at is not None
    ]
    if len(parts) == 1:
        return dataclasses.replace(parts[0], seqs_exact=False), torn
    combined = JournalContents(
        snapshot=None,
        records=_ChainedRecords(parts),  # type: ignore[arg-type]
        torn_bytes=sum(c.torn_bytes for c in parts),
        torn_at=parts[-1].torn_at,
        damage=tuple(d for c in parts for d in c.damage),
        segments=tuple(s for c in parts for s in c.segments),
        last_seq=max(c.last_seq for c in parts),
        seqs_exact=False,
    )
    return combined, torn


class AtSnapshot(NamedTuple):
    """A request live at the snapshot a fold started from: what the records before said."""

    state: int
    role: int
    entered: float  # when it entered that state (the node's clock)


def _states_at_snapshot(contents: JournalContents) -> dict[RequestKey, AtSnapshot]:
    if contents.snapshot is None:
        return {}
    snap = decode_snapshot(contents.snapshot.payload)
    states = {
        (r.request_id, r.incarnation): AtSnapshot(
            STATE_CODE[r.state],
            ROLE_PUSHER if r.role is Role.PUSHER else ROLE_RECEIVER,
            r.entered_at,
        )
        for r in snap.live
    }
    for pending in snap.pending:
        reg = pending.registration
        states[(reg.request_id, reg.incarnation)] = AtSnapshot(
            S_PENDING, ROLE_PUSHER, pending.received_at
        )
    return states


def fold_node(
    source: NodeSource,
    progress: ProgressSlot | None = None,
    details: KeepDetails | None = None,
) -> NodeFold:
    """Read and fold one node's journal through the core, and column what it did.

    ``details``: the requests whose records are kept for timelines (None: all).
    """
    contents, torn = _read_source(source)
    columns = _Columns(_KEEP_FOR_ANALYSIS if details is no_request else _KEEP)
    on_batch = columns.batch_callback()
    if progress is not None:
        progress.set_total(len(contents.records))
        on_batch = progress.wrap_batch(on_batch)
    # As in daemon.journal.replay.replay: the cyclic collector would rescan millions
    # of live, acyclic objects over and over for nothing.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        result = fold_contents(contents, salvage=True, on_batch=on_batch)
    finally:
        if gc_was_enabled:
            gc.enable()
    columns.fold_done()
    if progress is not None:
        progress.finish()
    journal_damage = len(contents.damage)
    rejected = _find_rejected(source.node, contents, columns, result.damage[journal_damage:])
    unreleased = _unreleased(result.registry)
    at_snapshot = _states_at_snapshot(contents)
    for key in (*(r.key for r in rejected if r.key is not None), *unreleased, *at_snapshot):
        columns.key_index(key)
    kind = _int_array(columns.kind, "b", np.int8)
    req = _int_array(columns.req, "i", np.int32)
    roles = columns.roles(kind, req)
    for key, known in at_snapshot.items():
        roles[columns.index[key]] = roles[columns.index[key]] or known.role
    return NodeFold(
        node=source.node,
        sources=tuple(str(p) for p in source.paths),
        seq=_int_array(columns.seq, "q", np.int64),
        ts=np.frombuffer(array.array("d", columns.ts), np.float64),
        kind=kind,
        req=req,
        state=columns.states(kind, req),
        details=columns.details,
        keys=columns.keys,
        roles=roles,
        reasons=columns.reasons(kind),
        unreleased=unreleased,
        at_snapshot=at_snapshot,
        snapshot_seq=result.snapshot_seq,
        records_read=len(contents.records),
        torn=torn,
        damage=result.damage[:journal_damage],
        rejected=rejected,
    )


def _unreleased(registry: Registry) -> dict[RequestKey, int]:
    """Requests the registry still holds: live ones by state, pending ones as pending."""
    found = {(r.request_id, r.incarnation): STATE_CODE[r.state] for r in registry.live.values()}
    for pending in registry.pending.values():
        reg = pending.registration
        found[(reg.request_id, reg.incarnation)] = S_PENDING
    return found


def _find_rejected(
    node: str, contents: JournalContents, columns: _Columns, messages: Sequence[str]
) -> list[Rejected]:
    """The records the core refused during a salvage fold, with the core's messages.

    The fold skips them without a callback; they are found by walking the
    journal again beside the applied ones (a second pass, paid only when
    the core refused something). The fold lists its messages in record
    order, so the n-th rejected record goes with the n-th message.
    """
    if not messages:
        return []
    applied = columns.seq
    found: list[Rejected] = []
    position = 0
    for _, payload in contents.records:
        try:
            record = decode_record(payload)
        except (msgspec.DecodeError, msgspec.ValidationError):
            continue  # the fold would have stopped on it; never reached
        if position < len(applied) and applied[position] == record.seq:
            position += 1
            continue
        event = record.event
        key: RequestKey | None = None
        if isinstance(event, RequestEvent) and event.request_id:
            key = (event.request_id, event.incarnation)
        message = messages[len(found)] if len(found) < len(messages) else "refused on replay"
        found.append(Rejected(node, record.seq, record.ts, KIND_CODE[type(event)], key, message))
    return found
