"""Postmortem: several nodes' journals folded, merged and searched for anomalies.

``kvpushd journal replay|timeline|report`` sit on this module. It works in
four stages, each a plain function over plain data:

1. **Read and fold** (:func:`load`): each node's journal (a directory, or
   copied segment files, grouped by the node named in their records) is read
   with salvage and folded through the core by :func:`daemon.journal.replay.fold_contents`,
   exactly as the daemon does on start. What the core returns for every
   record is kept in compact columns (:class:`NodeFold`), not as objects:
   a million-event journal is a few arrays, cheap to hand back from a worker
   process. Nodes fold in parallel processes when the input is large.
2. **Clocks** (:func:`estimate_clocks`): nodes' wall clocks differ. Messages
   between daemons bound the difference from both sides (see the function),
   and the midpoint of the tightest consistent bounds is taken as the offset.
3. **Merge** (:func:`merge`): one table of requests keyed by (request id,
   incarnation), every step of every node in one array sorted by request,
   node and sequence number, times corrected to one reference clock.
4. **Analyse** (:func:`analyse`): final states, refusals, requests never
   released, sides that disagree, slow transitions, sequence gaps, torn tails,
   restarts, over the requests a :class:`Filters` selects.

Rendering (text and JSON here, HTML in :mod:`daemon.postmortem.html`) only reads the
:class:`Analysis`.
"""

from __future__ import annotations

import array
import contextlib
import dataclasses
import datetime as dt
import fnmatch
import gc
import math
import multiprocessing
import os
import re
import sys
import textwrap
import threading
import time
import typing
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, NamedTuple, TextIO

import msgspec
import numpy as np
import numpy.typing as npt

from daemon.journal.replay import ReplayError, decode_snapshot, fold_contents
from daemon.journal.store import (
    FRAME_OVERHEAD,
    HEADER_SIZE,
    JournalContents,
    JournalError,
    read_journal,
)
from daemon.ops import texttable
from schemas.events import (
    DaemonStarted,
    Event,
    Failed,
    KvReady,
    PeerRegistered,
    PeerSettled,
    Record,
    Refused,
    Registered,
    Released,
    ReleaseDeferred,
    Trimmed,
    WriteDone,
    WriteStarted,
    decode_record,
)
from schemas.layout import Role
from schemas.reasons import Reason
from schemas.state import State
from statemachine.transitions import TRANSITIONS

RequestKey = tuple[str, int]
FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

# ============================================================== vocabulary

# Event kinds as small ints (the columns store one byte per record), taken
# from the journal's event union so a kind added there is never a KeyError
# here; kinds that name no request (engine and daemon events) come first.
KINDS: Final[tuple[type, ...]] = tuple(
    sorted(typing.get_args(Event), key=lambda kind: "request_id" in kind.__struct_fields__)
)
KIND_NAMES: Final[tuple[str, ...]] = tuple(str(k.__struct_config__.tag) for k in KINDS)
_KIND_CODE: Final[dict[type, int]] = {kind: code for code, kind in enumerate(KINDS)}
K_DAEMON_STARTED: Final = _KIND_CODE[DaemonStarted]
K_REGISTERED: Final = _KIND_CODE[Registered]
K_PEER_REGISTERED: Final = _KIND_CODE[PeerRegistered]
K_WRITE_STARTED: Final = _KIND_CODE[WriteStarted]
K_WRITE_DONE: Final = _KIND_CODE[WriteDone]
K_FAILED: Final = _KIND_CODE[Failed]
K_REFUSED: Final = _KIND_CODE[Refused]
FIRST_REQUEST_KIND: Final = sum("request_id" not in k.__struct_fields__ for k in KINDS)

# States, ordered from least to most advanced: "the least advanced side"
# of a request is the one holding it up. ``pending`` is a pusher that heard
# of the request from its peer before its own engine registered it;
# ``refused`` is a side that only ever refused the request (never live).
STATES: Final = ("pending", "registered", "trimmed", "writing", "done", "failed", "released")
S_PENDING, S_REGISTERED, _, _, S_DONE, S_FAILED, S_RELEASED = range(7)
S_REFUSED: Final = 7
S_NONE: Final = -1  # the record changed no request state (a refusal, an engine event)
STATE_LABELS: Final = (*STATES, "refused")
_STATE_CODE: Final[dict[State, int]] = {
    State(name): code for code, name in enumerate(STATES[1:], 1)
}

ROLE_PUSHER, ROLE_RECEIVER = 1, 2  # 0: unknown (the node only refused the request)
ROLE_NAMES: Final = ("?", "pusher", "receiver")

# Parallel folding pays for its process start-up above about this much input.
PARALLEL_MIN_BYTES: Final = 8 * 1024 * 1024
PROGRESS_EVERY: Final = 1 << 16  # records between progress updates
PROGRESS_MIN_RECORDS: Final = 200_000  # shorter replays finish before a bar helps


def _state_after_kind() -> npt.NDArray[np.int8]:
    """The state a request is in after each kind of record (``S_NONE``: unchanged).

    Read off the core's transition table, so the two cannot drift apart: each
    kind leads to one state wherever the table lets it change the state. A
    peer registration parked as pending is the one exception, told apart by
    the fold (the core returns no record for it).
    """
    after = [S_NONE] * len(KINDS)
    after[K_REGISTERED] = S_REGISTERED
    for (_role, state), row in TRANSITIONS.items():
        for kind, following in row.items():
            if following is state:
                continue
            code = _STATE_CODE[following]
            if after[_KIND_CODE[kind]] not in (S_NONE, code):
                raise AssertionError(f"{kind.__name__} leads to more than one state")
            after[_KIND_CODE[kind]] = code
    return np.array(after, np.int8)


KIND_STATE: Final = _state_after_kind()

# Kinds whose record is kept for its details (block counts, bytes, reasons);
# the rest say all they have to say by their kind.
_KEEP: Final[tuple[bool, ...]] = tuple(
    kind not in (KvReady, WriteDone, ReleaseDeferred, Released) for kind in KINDS
)
# What the analysis reads of every request (roles, reasons, restarts): kept
# alone when no timeline will be drawn, which spares the fold a third of its
# bookkeeping.
_KEEP_FOR_ANALYSIS: Final[tuple[bool, ...]] = tuple(
    kind in (DaemonStarted, Registered, Failed, Refused) for kind in KINDS
)
_event_encoder = msgspec.msgpack.Encoder()
_event_decoder = msgspec.msgpack.Decoder(Event)


class PostmortemError(Exception):
    """The inputs cannot be analysed (missing, unreadable, ambiguous)."""


# ============================================================== inputs


@dataclass(frozen=True, slots=True)
class NodeSource:
    """One node's journal: a directory, or its segment files in sequence order."""

    node: str
    paths: tuple[Path, ...]

    @property
    def nbytes(self) -> int:
        return sum(_journal_bytes(p) for p in self.paths)


def _journal_bytes(path: Path) -> int:
    if path.is_dir():
        return sum(p.stat().st_size for p in path.glob("seg-*.kvj"))
    return path.stat().st_size


def _first_record(segment: Path) -> Record | None:
    """The first record of a segment file, read without validating the rest.

    Grouping inputs by node must not cost a full read: the full read (with
    CRCs and salvage) happens once, in the fold. None if the first frame is
    unreadable; the fold will say why.
    """
    try:
        with segment.open("rb") as f:
            head = f.read(HEADER_SIZE + FRAME_OVERHEAD)
            if len(head) < HEADER_SIZE + FRAME_OVERHEAD:
                return None
            length = int.from_bytes(head[HEADER_SIZE : HEADER_SIZE + 4], "big")
            return decode_record(f.read(length))
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        return None


def _peek(path: Path) -> tuple[str | None, int]:
    """(node name, first seq) of a journal directory or segment file."""
    if path.is_dir():
        segments = sorted(path.glob("seg-*.kvj"))
        if not segments:
            raise PostmortemError(f"{path}: no journal segments (seg-*.kvj) here")
        path = segments[0]
    elif not path.exists():
        raise PostmortemError(f"{path}: no such file or directory")
    first = _first_record(path)
    return (None, 0) if first is None else (first.node, first.seq)


def group_sources(paths: Sequence[Path]) -> list[NodeSource]:
    """Group inputs by the node their records name, in the order first given.

    Segment files copied out of one node's directory are folded together, in
    sequence order, through one registry: a later segment's records need the
    state the earlier ones built.
    """
    groups: dict[str, list[tuple[int, Path]]] = {}
    for path in paths:
        node, first_seq = _peek(path)
        name = node if node is not None else f"?{path}"
        members = groups.setdefault(name, [])
        if (path.is_dir() and members) or any(p.is_dir() for _, p in members):
            raise PostmortemError(
                f"{members[0][1]} and {path} both hold node {name}'s journal: give a node's "
                f"directory alone, or only segment files copied out of it"
            )
        if any(p.resolve() == path.resolve() for _, p in members):
            continue
        members.append((first_seq, path))
    return [
        NodeSource(name, tuple(p for _, p in sorted(members, key=lambda m: m[0])))
        for name, members in groups.items()
    ]


# ============================================================== folding one node


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
    details: dict[int, Any]
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

    def event(self, i: int) -> Any:
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
        self.details: dict[int, Any] = {}
        self.index: dict[RequestKey, int] = {}
        self.keys: list[RequestKey] = []

    def key_index(self, key: RequestKey) -> int:
        idx = self.index.get(key)
        if idx is None:
            idx = self.index[key] = len(self.keys)
            self.keys.append(key)
        return idx

    def callback(self) -> Callable[[Record, object], None]:
        """The hot loop's callback: one call per record of a million-record journal.

        A closure over bound methods (local and cell lookups are the cheapest
        Python has), doing only what cannot wait: states, details and
        columns are derived from these lists afterwards, in bulk.
        """
        seq_append, ts_append = self.seq.append, self.ts.append
        kind_append, req_append = self.kind.append, self.req.append
        pending_append = self.pending.append
        details, index, keys, seqs = self.details, self.index, self.keys, self.seq
        kind_code, keep = _KIND_CODE, self.keep
        first_request_kind, peer_registered = FIRST_REQUEST_KIND, K_PEER_REGISTERED

        def on_record(record: Record, touched: object) -> None:
            event = record.event
            kind = kind_code[type(event)]
            if keep[kind]:
                details[len(seqs)] = event
            seq_append(record.seq)
            ts_append(record.ts)
            kind_append(kind)
            # Engine and daemon events, and refusals of nameless requests, are no request's.
            if kind < first_request_kind or not event.request_id:  # type: ignore[attr-defined]
                req_append(-1)
                return
            key = (event.request_id, event.incarnation)  # type: ignore[attr-defined]
            idx = index.get(key)
            if idx is None:
                idx = index[key] = len(keys)
                keys.append(key)
            req_append(idx)
            if touched is None and kind == peer_registered:
                pending_append(len(seqs) - 1)  # this record's step, appended above

        return on_record

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
        roles[req[registered]] = [
            ROLE_PUSHER if self.details[i].role is Role.PUSHER else ROLE_RECEIVER
            for i in registered.tolist()
        ]
        roles[req[(kind == K_PEER_REGISTERED) & (req >= 0)]] = ROLE_PUSHER
        return roles

    def reasons(self, kind: npt.NDArray[np.int8]) -> dict[int, str]:
        steps = np.flatnonzero((kind == K_FAILED) | (kind == K_REFUSED)).tolist()
        return {i: self.details[i].reason.value for i in steps}


def _int_array(values: list[int], code: str, dtype: type) -> Any:
    # Through array.array: numpy converts a list of Python ints element by
    # element, several times slower on a million-entry column.
    return np.frombuffer(array.array(code, values), dtype)


KeepDetails = Callable[[RequestKey], bool]


def no_request(key: RequestKey) -> bool:
    """A ``details`` policy for :func:`load` when no timeline will be drawn."""
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
            _STATE_CODE[r.state],
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
    on_record = columns.callback()
    if progress is not None:
        progress.set_total(len(contents.records))
        on_record = progress.wrap(on_record)
    # As in daemon.journal.replay.replay: the cyclic collector would rescan millions
    # of live, acyclic objects over and over for nothing.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        result = fold_contents(contents, salvage=True, on_record=on_record)
    finally:
        if gc_was_enabled:
            gc.enable()
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


def _fold_in_worker(source: NodeSource, progress: ProgressSlot | None) -> NodeFold:
    return fold_node(source, progress).pack()


def _unreleased(registry: Any) -> dict[RequestKey, int]:
    """Requests the registry still holds: live ones by state, pending ones as pending."""
    found = {(r.request_id, r.incarnation): _STATE_CODE[r.state] for r in registry.live.values()}
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
        rid = getattr(event, "request_id", "")
        key = (rid, event.incarnation) if rid else None  # type: ignore[attr-defined]
        message = messages[len(found)] if len(found) < len(messages) else "refused on replay"
        found.append(Rejected(node, record.seq, record.ts, _KIND_CODE[type(event)], key, message))
    return found


# ============================================================== loading, progress


class ProgressSlot:
    """One node's share of the progress bar: two integers in shared memory.

    Pickled into a worker as its slot number only; the worker finds the
    shared array in :data:`_worker_progress`, handed over when the pool
    started it (shared memory can only travel at process start).
    """

    def __init__(self, shared: Any, slot: int) -> None:
        self._shared = shared
        self._slot = slot
        self._count = 0

    def __reduce__(self) -> tuple[Callable[[int], ProgressSlot], tuple[int]]:
        return _worker_slot, (self._slot,)

    def set_total(self, total: int) -> None:
        self._shared[2 * self._slot + 1] = total

    def wrap(self, on_record: Callable[[Record, object], None]) -> Callable[[Record, object], None]:
        shared, index = self._shared, 2 * self._slot

        def ticking(record: Record, touched: object) -> None:
            on_record(record, touched)
            self._count += 1
            if not self._count & (PROGRESS_EVERY - 1):
                shared[index] = self._count

        return ticking

    def finish(self) -> None:
        self._shared[2 * self._slot] = self._shared[2 * self._slot + 1]


_worker_progress: Any = None


def _init_worker(shared: Any) -> None:
    global _worker_progress
    _worker_progress = shared


def _worker_slot(slot: int) -> ProgressSlot:
    return ProgressSlot(_worker_progress, slot)


class _ProgressBar:
    """Draws the folds' progress on a terminal's stderr from a thread of the parent.

    Workers only write two integers each into shared memory; the drawing
    stays here so several processes never interleave half-lines.
    """

    INTERVAL_S = 0.2  # between redraws

    def __init__(self, nodes: int, stream: TextIO) -> None:
        self.shared = _worker_context().Array("q", 2 * nodes, lock=False)
        self._stream = stream
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="progress", daemon=True)
        self._started = time.monotonic()
        self._drawn = False

    def slot(self, index: int) -> ProgressSlot:
        return ProgressSlot(self.shared, index)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        if self._drawn:
            self._stream.write("\r\x1b[2K")
            self._stream.flush()

    def _run(self) -> None:
        while not self._stop.wait(self.INTERVAL_S):
            done = sum(self.shared[0::2])
            total = sum(self.shared[1::2])
            if total < PROGRESS_MIN_RECORDS:
                continue
            self._draw(done, total)

    def _draw(self, done: int, total: int) -> None:
        width = 30
        filled = int(width * done / total) if total else 0
        elapsed = time.monotonic() - self._started
        rate = done / elapsed if elapsed > 0 else 0.0
        self._stream.write(
            f"\rreplaying [{'#' * filled}{'.' * (width - filled)}] "
            f"{done:,}/{total:,} records  {rate / 1e3:,.0f} k/s"
        )
        self._stream.flush()
        self._drawn = True


def _want_progress(stream: TextIO | None) -> TextIO | None:
    if stream is None:
        return None
    try:
        return stream if stream.isatty() else None
    except (AttributeError, ValueError):
        return None


def load(
    paths: Sequence[Path],
    *,
    jobs: int | None = None,
    progress: TextIO | None = None,
    details: KeepDetails | None = None,
) -> list[NodeFold]:
    """Group, read and fold the journals; one :class:`NodeFold` per node, in input order.

    ``jobs``: processes folding nodes at once, this one included (None: one
    per node up to the CPUs, when the input is large enough to pay for
    them). ``progress``: a stream for a progress bar, drawn only if it is a
    terminal. ``details``: which requests' records to keep for timelines
    (None: all); what the analysis needs of the others is kept regardless.
    """
    sources = group_sources(paths)
    if not sources:
        raise PostmortemError("no journals given")
    if jobs is None:
        big = sum(s.nbytes for s in sources) >= PARALLEL_MIN_BYTES
        jobs = min(len(sources), os.cpu_count() or 1) if big else 1
    stream = _want_progress(progress)
    bar = _ProgressBar(len(sources), stream) if stream is not None else None
    tasks = [
        _FoldTask(s, bar.slot(i) if bar is not None else None, details)
        for i, s in enumerate(sources)
    ]
    if jobs <= 1 or len(tasks) == 1:
        with _drawing(bar):
            return [task.run() for task in tasks]
    return _load_parallel(tasks, jobs, bar)


@dataclass(frozen=True, slots=True)
class _FoldTask:
    """One node to fold, picklable into a worker process."""

    source: NodeSource
    progress: ProgressSlot | None
    details: KeepDetails | None

    def run(self) -> NodeFold:
        fold = fold_node(self.source, self.progress, self.details)
        if self.details is not None and self.details is not no_request:
            fold.keep_details(self.details)
        return fold

    def run_in_worker(self) -> NodeFold:
        return self.run().pack()


@contextlib.contextmanager
def _drawing(bar: _ProgressBar | None) -> Iterator[None]:
    if bar is None:
        yield
        return
    bar.start()
    try:
        yield
    finally:
        bar.stop()


def _worker_context() -> Any:
    """fork where there is one: a worker starts in milliseconds with every module
    loaded, and re-imports nothing from ``__main__``. The parent forks before
    it starts any thread of its own (the progress bar starts after the pool).
    """
    methods = multiprocessing.get_all_start_methods()
    return multiprocessing.get_context("fork" if "fork" in methods else "spawn")


def _load_parallel(tasks: list[_FoldTask], jobs: int, bar: _ProgressBar | None) -> list[NodeFold]:
    """The largest journal folds here, the others in workers meanwhile.

    Folding one node in this process instead of waiting saves a process and,
    above all, shipping the largest result back (pickling costs about a
    tenth of the fold).
    """
    largest = max(range(len(tasks)), key=lambda i: tasks[i].source.nbytes)
    others = [i for i in range(len(tasks)) if i != largest]
    context = _worker_context()
    shared = bar.shared if bar is not None else None
    results: dict[int, NodeFold] = {}
    with ProcessPoolExecutor(
        max_workers=max(1, min(jobs - 1, len(others))),
        mp_context=context,
        initializer=_init_worker,
        initargs=(shared,),
    ) as pool:
        futures = {i: pool.submit(_FoldTask.run_in_worker, tasks[i]) for i in others}
        with _drawing(bar):
            results[largest] = tasks[largest].run()
            results.update((i, future.result()) for i, future in futures.items())
    return [results[i] for i in range(len(tasks))]


# ============================================================== clocks


@dataclass(frozen=True, slots=True)
class ClockPair:
    """The estimated offset between a pusher node's clock and a receiver node's.

    ``offset`` is the receiver's clock minus the pusher's, in seconds, the
    midpoint of ``low`` and ``high``: the tightest lower and upper bounds
    left once ``trimmed`` (a fraction) of the most extreme bounds on each
    side were set aside to make them consistent (0 when they were already).
    ``contradicting`` counts the bounds the estimate still violates.
    """

    pusher: str
    receiver: str
    offset: float
    low: float
    high: float
    lower_bounds: int
    upper_bounds: int
    requests: int
    trimmed: float
    contradicting: int

    def describe(self) -> str:
        ahead = "ahead of" if self.offset >= 0 else "behind"
        width = self.high - self.low
        bounds = (
            f"between {_signed_ms(self.low)} and {_signed_ms(self.high)}"
            if math.isfinite(width)
            else f"one-sided bound {_signed_ms(self.low if math.isfinite(self.low) else self.high)}"
        )
        text = (
            f"{self.receiver}'s clock runs {_abs_ms(self.offset)} {ahead} {self.pusher}'s "
            f"({bounds}), estimated as the robust midpoint of causal bounds from "
            f"{self.requests} request pairs: {self.lower_bounds} lower bounds (the receiver "
            f"journals registered before the pusher's peer_registered) and {self.upper_bounds} "
            f"upper bounds (the pusher journals write_started before the receiver's "
            f"write_started or write_done)"
        )
        if self.trimmed:
            return text + (
                f"; the bounds contradict each other (clock step or drift?): the "
                f"{self.trimmed:.0%} most extreme on each side were set aside, "
                f"{self.contradicting} bounds still disagree with the estimate"
            )
        return text + "; the tightest bounds agree"


@dataclass(frozen=True, slots=True)
class Clocks:
    """Per-node clock offsets relative to ``reference`` (node clock minus reference clock)."""

    reference: str
    offsets: dict[str, float]
    pairs: tuple[ClockPair, ...]
    unpaired: tuple[str, ...]

    def describe(self) -> list[str]:
        lines = [f"times are {self.reference}'s clock"]
        lines += [pair.describe() for pair in self.pairs]
        if self.pairs:
            lines.append(
                "(the pusher's write_done bounds nothing: the receiver's write notification "
                "often arrives before the pusher's completion poll and group commit)"
            )
        lines += [
            f"{node}: no request links it to {self.reference}; its clock is taken as is"
            for node in self.unpaired
        ]
        return lines


def _signed_ms(seconds: float) -> str:
    return f"{seconds * 1e3:+.3f} ms"


def _abs_ms(seconds: float) -> str:
    return f"{abs(seconds) * 1e3:.3f} ms"


# Fractions of the most extreme bounds to set aside, in turn, until the
# remaining lower bounds all sit below the remaining upper bounds.
_TRIMS: Final = (0.0, 0.01, 0.05, 0.1, 0.25, 0.5)


def robust_midpoint(lower: FloatArray, upper: FloatArray) -> tuple[float, float, float, float]:
    """(estimate, low, high, trimmed) for bounds ``lower < x < upper``.

    Every bound comes from causality and holds exactly while both clocks run
    steady, so the tightest ones (max of the lower, min of the upper) are the
    best; trimming only helps when a clock stepped during the journal and
    some bounds became false. With bounds on one side only, that bound is the
    estimate.
    """
    low, high, trim = -math.inf, math.inf, 0.0
    for trim in _TRIMS:
        low = float(np.quantile(lower, 1 - trim, method="higher")) if lower.size else -math.inf
        high = float(np.quantile(upper, trim, method="lower")) if upper.size else math.inf
        if low <= high:
            break
    if not math.isfinite(low) and not math.isfinite(high):
        return 0.0, low, high, 0.0
    if not math.isfinite(high):
        return low, low, high, trim
    if not math.isfinite(low):
        return high, low, high, trim
    return (low + high) / 2, low, high, trim


def _times_of(node: NodeFold, to_global: IntArray, kind: int, n_requests: int) -> FloatArray:
    """Raw time of the (last) record of ``kind`` per global request, NaN where none."""
    out = np.full(n_requests, np.nan)
    mask = (node.kind == kind) & (node.req >= 0)
    out[to_global[node.req[mask]]] = node.ts[mask]
    return out


def _pair_bounds(
    pusher: NodeFold,
    receiver: NodeFold,
    p_map: IntArray,
    r_map: IntArray,
    paired: npt.NDArray[np.bool_],
) -> tuple[FloatArray, FloatArray]:
    """Causal bounds on (receiver clock - pusher clock) from the requests in ``paired``.

    Lower bounds: the receiver journals ``registered`` and only then forwards
    the registration, so the pusher's ``peer_registered`` comes later in true
    time: offset > recv.registered - push.peer_registered.
    Upper bounds: the pusher journals ``write_started`` and only then tells
    the receiver and posts the write; the receiver's ``write_started`` (from
    that message) and ``write_done`` (the write's notification, or the
    pusher's word) come later: offset < recv.write_* - push.write_started.
    The pusher's own ``write_done`` is no bound: the receiver's notification
    often beats the pusher's completion poll and group commit.
    """
    n = len(paired)
    registered = _times_of(receiver, r_map, K_REGISTERED, n)[paired]
    peer_registered = _times_of(pusher, p_map, K_PEER_REGISTERED, n)[paired]
    push_write = _times_of(pusher, p_map, K_WRITE_STARTED, n)[paired]
    recv_write = _times_of(receiver, r_map, K_WRITE_STARTED, n)[paired]
    recv_done = _times_of(receiver, r_map, K_WRITE_DONE, n)[paired]
    lower = registered - peer_registered
    upper = np.concatenate([recv_write - push_write, recv_done - push_write])
    return lower[~np.isnan(lower)], upper[~np.isnan(upper)]


def estimate_clocks(
    nodes: Sequence[NodeFold], to_global: Sequence[IntArray], roles: npt.NDArray[np.int8]
) -> Clocks:
    """Offsets of every node's clock from the first node's, through paired requests.

    ``roles[r, n]`` is the role of node ``n`` for global request ``r``.
    Node pairs are estimated directly, then chained from the reference.
    """
    names = [n.node for n in nodes]
    pairs: list[ClockPair] = []
    edges: dict[int, list[tuple[int, float]]] = defaultdict(list)
    for p, pusher in enumerate(nodes):
        for r, receiver in enumerate(nodes):
            if p == r:
                continue
            paired = (roles[:, p] == ROLE_PUSHER) & (roles[:, r] == ROLE_RECEIVER)
            if not paired.any():
                continue
            lower, upper = _pair_bounds(pusher, receiver, to_global[p], to_global[r], paired)
            if not lower.size and not upper.size:
                continue
            offset, low, high, trim = robust_midpoint(lower, upper)
            contradicting = int((lower > offset).sum() + (upper < offset).sum())
            pairs.append(
                ClockPair(
                    names[p],
                    names[r],
                    offset,
                    low,
                    high,
                    int(lower.size),
                    int(upper.size),
                    int(paired.sum()),
                    trim,
                    contradicting,
                )
            )
            edges[p].append((r, offset))
            edges[r].append((p, -offset))
    offsets = _chain_offsets(len(nodes), edges)
    unpaired = tuple(names[i] for i in range(len(nodes)) if i not in offsets)
    return Clocks(
        reference=names[0],
        offsets={names[i]: offsets.get(i, 0.0) for i in range(len(nodes))},
        pairs=tuple(pairs),
        unpaired=unpaired,
    )


def _chain_offsets(count: int, edges: dict[int, list[tuple[int, float]]]) -> dict[int, float]:
    """Breadth-first from node 0: a node's offset is its neighbour's plus the pair's."""
    offsets = {0: 0.0}
    queue = [0]
    while queue:
        current = queue.pop(0)
        for neighbour, offset in edges.get(current, ()):
            if neighbour not in offsets:
                offsets[neighbour] = offsets[current] + offset
                queue.append(neighbour)
    return offsets


# ============================================================== merging


@dataclass(slots=True)
class Merged:
    """Every node's steps in one table, requests keyed across nodes.

    Steps (request events only) are sorted by (request, node, seq), so one
    request's steps are ``steps[start[r]:start[r + 1]]`` and one side's
    (a request on one node) are contiguous inside that. Per-side arrays are
    ``[request, node]``; ``final``/``outcome`` hold state codes (``S_*``,
    ``S_REFUSED`` for a side that only refused, -1 where the node never saw
    the request). Times are corrected to the reference clock.
    """

    nodes: list[NodeFold]
    names: list[str]
    keys: list[RequestKey]
    to_global: list[IntArray]
    clocks: Clocks
    step_node: npt.NDArray[np.int8]
    step_local: IntArray
    step_req: IntArray
    step_ts: FloatArray
    step_kind: npt.NDArray[np.int8]
    step_state: npt.NDArray[np.int8]
    start: IntArray
    role: npt.NDArray[np.int8]
    final: npt.NDArray[np.int8]
    outcome: npt.NDArray[np.int8]
    first: FloatArray
    last: FloatArray
    req_final: npt.NDArray[np.int8]
    req_outcome: npt.NDArray[np.int8]
    req_first: FloatArray
    req_last: FloatArray
    req_until: FloatArray
    node_first: FloatArray
    node_last: FloatArray
    cache: dict[str, Any] = field(default_factory=dict)

    @property
    def requests(self) -> int:
        return len(self.keys)

    def corrected(self, node: int, ts: float | FloatArray) -> Any:
        return ts - self.clocks.offsets[self.names[node]]

    def label(self, r: int) -> str:
        return final_label(int(self.req_final[r]), int(self.req_outcome[r]))


def final_label(final: int, outcome: int) -> str:
    """How a request ended, in the words of ``kvpushd demo``'s summary."""
    if final == S_RELEASED:
        return "released" if outcome == S_RELEASED else f"released after {STATE_LABELS[outcome]}"
    if final == S_REFUSED:
        return "refused (never live)"
    return f"{STATE_LABELS[final]} (not released)"


def _global_index(nodes: Sequence[NodeFold]) -> tuple[list[RequestKey], list[IntArray]]:
    index: dict[RequestKey, int] = {}
    maps = []
    for node in nodes:
        setdefault = index.setdefault
        maps.append(
            np.fromiter((setdefault(k, len(index)) for k in node.keys), np.int64, len(node.keys))
        )
    return list(index), maps


def _roles(nodes: Sequence[NodeFold], maps: Sequence[IntArray], n: int) -> npt.NDArray[np.int8]:
    roles = np.zeros((n, len(nodes)), dtype=np.int8)
    for i, node in enumerate(nodes):
        roles[maps[i], i] = node.roles
    return roles


def _step_table(
    nodes: Sequence[NodeFold], maps: Sequence[IntArray], clocks: Clocks
) -> tuple[Any, ...]:
    """Every request step of every node as (node, local index, request, corrected time,
    kind, state) arrays, sorted by request, then node, then the node's sequence number."""
    picks = [np.flatnonzero(node.req >= 0) for node in nodes]

    def joined(column: Callable[[int, NodeFold, IntArray], Any]) -> Any:
        return np.concatenate(
            [column(i, n, p) for i, (n, p) in enumerate(zip(nodes, picks, strict=True))]
        )

    node_of = joined(lambda i, n, p: np.full(len(p), i, np.int8))
    local = joined(lambda i, n, p: p)
    req = joined(lambda i, n, p: maps[i][n.req[p]])
    ts = joined(lambda i, n, p: n.ts[p] - clocks.offsets[n.node])
    seq = joined(lambda i, n, p: n.seq[p])
    kind = joined(lambda i, n, p: n.kind[p])
    state = joined(lambda i, n, p: n.state[p])
    order = np.lexsort((seq, node_of, req))
    return tuple(a[order] for a in (node_of, local, req, ts, kind, state))


def _span(nodes: Sequence[NodeFold], clocks: Clocks) -> tuple[FloatArray, FloatArray]:
    """Each node's first and last record time, corrected (NaN for an empty journal)."""
    first = [n.ts.min() - clocks.offsets[n.node] if n.records else np.nan for n in nodes]
    last = [n.ts.max() - clocks.offsets[n.node] if n.records else np.nan for n in nodes]
    return np.array(first, np.float64), np.array(last, np.float64)


def merge(nodes: list[NodeFold]) -> Merged:
    """Key requests across nodes, correct clocks, sort every step, classify every request."""
    keys, maps = _global_index(nodes)
    roles = _roles(nodes, maps, len(keys))
    clocks = estimate_clocks(nodes, maps, roles)
    step_node, step_local, step_req, step_ts, step_kind, step_state = _step_table(
        nodes, maps, clocks
    )
    node_first, node_last = _span(nodes, clocks)
    final, outcome, first, last = _sides(
        nodes, maps, len(keys), step_node, step_req, step_ts, step_state
    )
    # A side never released stays alive until its journal ends.
    until = np.where((final >= 0) & (final < S_RELEASED), node_last[None, :], last)
    return Merged(
        nodes=nodes,
        names=[node.node for node in nodes],
        keys=keys,
        to_global=maps,
        clocks=clocks,
        step_node=step_node,
        step_local=step_local,
        step_req=step_req,
        step_ts=step_ts,
        step_kind=step_kind,
        step_state=step_state,
        start=np.searchsorted(step_req, np.arange(len(keys) + 1)).astype(np.int64),
        role=roles,
        final=final,
        outcome=outcome,
        first=first,
        last=last,
        req_final=_merge_final(final),
        req_outcome=_merge_outcome(outcome),
        req_first=_nan_reduce(np.fmin, first, node_first),
        req_last=_nan_reduce(np.fmax, last, node_last),
        req_until=_nan_reduce(np.fmax, until, node_last),
        node_first=node_first,
        node_last=node_last,
    )


def _nan_reduce(ufunc: np.ufunc, values: FloatArray, fallback: FloatArray) -> FloatArray:
    """Per request over nodes, ignoring NaN; a request with no timed step gets the journal span.

    Such a request was live at a snapshot and never moved after it: it was
    alive the whole time the journal covers.
    """
    reduced = ufunc.reduce(values, axis=1) if values.shape[1] else np.full(len(values), np.nan)
    span = ufunc.reduce(fallback) if len(fallback) else np.nan
    return np.where(np.isnan(reduced), span, reduced)


def _sides(
    nodes: Sequence[NodeFold],
    maps: Sequence[IntArray],
    n: int,
    step_node: npt.NDArray[np.int8],
    step_req: IntArray,
    step_ts: FloatArray,
    step_state: npt.NDArray[np.int8],
) -> tuple[npt.NDArray[np.int8], npt.NDArray[np.int8], FloatArray, FloatArray]:
    """Final state, outcome, first and last time of every (request, node) side."""
    width = len(nodes)
    shape = (n, width)
    present = np.zeros(shape, bool)
    for i, to_global in enumerate(maps):
        present[to_global, i] = True
    first = np.full(shape, np.nan)
    last = np.full(shape, np.nan)
    ever_done = np.zeros(shape, bool)
    ever_failed = np.zeros(shape, bool)
    ever_live = np.zeros(shape, bool)
    if len(step_req):
        side = step_req * width + step_node
        bounds = np.flatnonzero(np.r_[True, side[1:] != side[:-1]])
        rows, cols = step_req[bounds], step_node[bounds]
        first[rows, cols] = np.minimum.reduceat(step_ts, bounds)
        last[rows, cols] = np.maximum.reduceat(step_ts, bounds)
        ever_done[rows, cols] = np.logical_or.reduceat(step_state == S_DONE, bounds)
        ever_failed[rows, cols] = np.logical_or.reduceat(step_state == S_FAILED, bounds)
        ever_live[rows, cols] = np.logical_or.reduceat(step_state >= 0, bounds)
    unreleased = np.full(shape, -1, np.int8)
    for i, node in enumerate(nodes):
        if not node.at_snapshot and not node.unreleased:
            continue
        index = {k: j for j, k in enumerate(node.keys)}
        # Live at the snapshot: the side was live, and may have been done or failed.
        snapshot_states = {k: v.state for k, v in node.at_snapshot.items()}
        rows, codes = _keyed_codes(snapshot_states, index, maps[i])
        ever_live[rows, i] = True
        ever_done[rows, i] |= codes == S_DONE
        ever_failed[rows, i] |= codes == S_FAILED
        rows, codes = _keyed_codes(node.unreleased, index, maps[i])
        unreleased[rows, i] = codes
    final = np.where(present, np.where(ever_live, S_RELEASED, S_REFUSED), -1).astype(np.int8)
    final = np.where(unreleased >= 0, unreleased, final).astype(np.int8)
    outcome = np.where(ever_done, S_DONE, final)
    outcome = np.where(ever_failed, S_FAILED, outcome).astype(np.int8)
    return final, outcome, first, last


def _keyed_codes(
    states: dict[RequestKey, int], index: dict[RequestKey, int], to_global: IntArray
) -> tuple[IntArray, npt.NDArray[np.int8]]:
    local = np.fromiter((index[k] for k in states), np.int64, len(states))
    return to_global[local], np.fromiter(states.values(), np.int8, len(states))


def _merge_final(final: npt.NDArray[np.int8]) -> npt.NDArray[np.int8]:
    """Least advanced unreleased side, else released, else refused."""
    stuck = np.where((final >= 0) & (final < S_RELEASED), final, 127).min(axis=1, initial=127)
    released = (final == S_RELEASED).any(axis=1)
    merged = np.where(released, S_RELEASED, S_REFUSED)
    return np.where(stuck < 127, stuck, merged).astype(np.int8)


def _merge_outcome(outcome: npt.NDArray[np.int8]) -> npt.NDArray[np.int8]:
    """Failed if any side failed; done if every live side is done; else the least advanced."""
    live = (outcome >= 0) & (outcome != S_REFUSED)
    failed = (outcome == S_FAILED).any(axis=1)
    all_done = np.where(live, outcome == S_DONE, True).all(axis=1) & live.any(axis=1)
    least = np.where(live, outcome, 127).min(axis=1, initial=127)
    merged = np.where(least < 127, least, S_REFUSED)
    merged = np.where(all_done, S_DONE, merged)
    return np.where(failed, S_FAILED, merged).astype(np.int8)


# ============================================================== filters


@dataclass(frozen=True, slots=True)
class FilterSpec:
    """Filters as the operator typed them; times are resolved against the journals."""

    requests: tuple[str, ...] = ()
    since: str | None = None
    until: str | None = None
    states: tuple[str, ...] = ()
    reasons: tuple[str, ...] = ()
    nodes: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Filters:
    """Resolved filters. Values of one filter are OR-ed, different filters AND-ed."""

    requests: tuple[str, ...] = ()
    since: float | None = None
    until: float | None = None
    states: tuple[str, ...] = ()
    reasons: tuple[str, ...] = ()
    nodes: tuple[str, ...] = ()

    @property
    def on_requests(self) -> bool:
        """True when a filter only requests can pass (not engine-level records)."""
        return bool(self.requests or self.states)

    def describe(self) -> str:
        parts = [f"request {' or '.join(self.requests)}"] if self.requests else []
        if self.since is not None:
            parts.append(f"since {format_time(self.since, date=True)}")
        if self.until is not None:
            parts.append(f"until {format_time(self.until, date=True)}")
        for name, values in (
            ("state", self.states),
            ("reason", self.reasons),
            ("node", self.nodes),
        ):
            if values:
                parts.append(f"{name} {' or '.join(values)}")
        return ", ".join(parts)


FILTER_STATES: Final = STATE_LABELS
_RELATIVE = re.compile(r"^([+-])(\d+(?:\.\d*)?)(ms|s|m|min|h|d)$")
_CLOCK = re.compile(r"^(\d{1,2}):(\d{2})(?::(\d{2})(\.\d+)?)?$")
_UNIT_SECONDS: Final = {"ms": 1e-3, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0}


def parse_time(text: str, start: float, end: float) -> float:
    """An operator's time, as epoch seconds of the reference clock.

    Accepted: ISO 8601 (``2026-11-29T02:10``, ``2026-11-29 02:10:30+01:00``;
    without a zone: local time, as the operator reads a wall clock), a time
    of day (``02:10``, ``02:10:30.5``) on the journals' day, relative to the
    journals' end (``-15m``) or start (``+90s``) with units ms, s, m, h, d,
    and plain epoch seconds. Raises ValueError with what was expected.
    """
    text = text.strip()
    relative = _RELATIVE.match(text)
    if relative:
        amount = float(relative[2]) * _UNIT_SECONDS[relative[3]]
        return end - amount if relative[1] == "-" else start + amount
    clock = _CLOCK.match(text)
    if clock:
        return _time_of_day(clock, start, end)
    try:
        return float(text)
    except ValueError:
        pass
    try:
        moment = dt.datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(
            f"{text!r} is not a time: use ISO (2026-11-29T02:10), a time of day (02:10), "
            f"relative to the journals' end or start (-15m, +90s), or epoch seconds"
        ) from None
    if moment.tzinfo is None:
        moment = moment.astimezone()  # naive: local time
    return moment.timestamp()


def _time_of_day(match: re.Match[str], start: float, end: float) -> float:
    """A time of day on the journals' day: the first day of their span where it falls inside."""
    hour, minute = int(match[1]), int(match[2])
    second = int(match[3] or 0)
    micro = round(float(match[4] or 0) * 1e6)
    if hour > 23 or minute > 59 or second > 59:
        raise ValueError(f"{match[0]!r} is not a time of day")
    day = dt.datetime.fromtimestamp(start).astimezone().date()
    last_day = dt.datetime.fromtimestamp(end).astimezone().date()
    candidates = []
    while day <= last_day:
        wall = dt.datetime.combine(day, dt.time(hour, minute, second, micro))
        candidates.append(wall.astimezone().timestamp())
        day += dt.timedelta(days=1)
    inside = [c for c in candidates if start - 60 <= c <= end + 60]
    return (inside or candidates)[0]


def resolve_filters(spec: FilterSpec, merged: Merged) -> Filters:
    """Check names against the journals and resolve times against their span."""
    unknown = sorted(set(spec.nodes) - set(merged.names))
    if unknown:
        raise PostmortemError(
            f"no node {', '.join(unknown)} in these journals (nodes: {', '.join(merged.names)})"
        )
    bad_states = sorted(set(spec.states) - set(FILTER_STATES))
    if bad_states:
        raise PostmortemError(
            f"unknown state {', '.join(bad_states)} (one of {', '.join(FILTER_STATES)})"
        )
    known_reasons = {r.value for r in Reason}
    bad_reasons = sorted(set(spec.reasons) - known_reasons)
    if bad_reasons:
        raise PostmortemError(f"unknown reason {', '.join(bad_reasons)}")
    start = float(np.nanmin(merged.node_first)) if merged.nodes else 0.0
    end = float(np.nanmax(merged.node_last)) if merged.nodes else 0.0
    try:
        since = None if spec.since is None else parse_time(spec.since, start, end)
        until = None if spec.until is None else parse_time(spec.until, start, end)
    except ValueError as exc:
        raise PostmortemError(str(exc)) from None
    return Filters(spec.requests, since, until, spec.states, spec.reasons, spec.nodes)


class RequestMatcher:
    """Which request keys ``--request`` names: an exact id, ``ID#N`` for one
    incarnation, or a glob (``*?[``). Picklable, for worker processes."""

    def __init__(self, patterns: Sequence[str]) -> None:
        self.exact: set[str] = set()
        self.incarnations: set[RequestKey] = set()
        self.globs: list[re.Pattern[str]] = []
        for pattern in patterns:
            rid, sep, inc = pattern.rpartition("#")
            if sep and inc.isdigit():
                self.incarnations.add((rid, int(inc)))
            elif any(c in pattern for c in "*?["):
                self.globs.append(re.compile(fnmatch.translate(pattern)))
            else:
                self.exact.add(pattern)

    def __call__(self, key: RequestKey) -> bool:
        return (
            key[0] in self.exact
            or key in self.incarnations
            or any(g.match(key[0]) for g in self.globs)
        )


def select(merged: Merged, filters: Filters) -> npt.NDArray[np.bool_]:
    """Mask over global requests: those every given filter lets through."""
    mask = np.ones(merged.requests, bool)
    if filters.requests:
        matches = RequestMatcher(filters.requests)
        mask &= np.fromiter((matches(k) for k in merged.keys), bool, merged.requests)
    if filters.since is not None:
        mask &= merged.req_until >= filters.since
    if filters.until is not None:
        mask &= merged.req_first <= filters.until
    if filters.states:
        codes = [STATE_LABELS.index(s) for s in filters.states]
        mask &= (np.isin(merged.final, codes) | np.isin(merged.outcome, codes)).any(axis=1)
    if filters.reasons:
        wanted = set(filters.reasons)
        hits = [r for r, reason in _request_reasons(merged) if reason in wanted]
        has_reason = np.zeros(merged.requests, bool)
        has_reason[hits] = True
        mask &= has_reason
    if filters.nodes:
        columns = [merged.names.index(n) for n in filters.nodes]
        mask &= (merged.final[:, columns] >= 0).any(axis=1)
    return mask


def _request_reasons(merged: Merged) -> Iterator[tuple[int, str]]:
    """(global request, reason) of every refusal and failure."""
    picks = np.flatnonzero((merged.step_kind == K_FAILED) | (merged.step_kind == K_REFUSED))
    for j in picks:
        node = merged.nodes[merged.step_node[j]]
        yield int(merged.step_req[j]), node.reasons[int(merged.step_local[j])]


def in_window(filters: Filters, ts: float) -> bool:
    return (filters.since is None or ts >= filters.since) and (
        filters.until is None or ts <= filters.until
    )


# ============================================================== analysis


@dataclass(frozen=True, slots=True)
class Occurrence:
    ts: float
    node: str
    key: RequestKey | None


@dataclass(frozen=True, slots=True)
class RefusalSummary:
    reason: str
    count: int
    first: Occurrence
    last: Occurrence


@dataclass(frozen=True, slots=True)
class Side:
    """One node's part in a request."""

    node: str
    role: str
    final: str
    outcome: str
    reason: str


@dataclass(frozen=True, slots=True)
class RequestSummary:
    key: RequestKey
    label: str
    final: str
    outcome: str
    first: float
    last: float
    sides: tuple[Side, ...]


@dataclass(frozen=True, slots=True)
class Stuck:
    """A side that never reached ``released``."""

    key: RequestKey
    node: str
    state: str
    since: float
    age: float
    last_event: str


@dataclass(frozen=True, slots=True)
class Disagreement:
    key: RequestKey
    sides: tuple[Side, ...]


@dataclass(frozen=True, slots=True)
class Transition:
    key: RequestKey
    node: str
    name: str
    seconds: float
    at: float


@dataclass(frozen=True, slots=True)
class LatencyRow:
    node: str
    name: str
    count: int
    p50: float
    p99: float
    max: float
    histogram: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class SeqGap:
    """Missing envelope sequence numbers (``repeated``: the numbering went backwards)."""

    node: str
    first_missing: int
    last_missing: int
    after_ts: float
    repeated: bool = False

    @property
    def count(self) -> int:
        return self.last_missing - self.first_missing + 1


@dataclass(frozen=True, slots=True)
class Restart:
    """A DaemonStarted record, and the requests failed right after it."""

    node: str
    seq: int
    ts: float
    pid: int
    version: str
    boot_id: str
    restart: bool  # False: the first start of a fresh journal
    failed: tuple[tuple[RequestKey, str], ...]  # (request, state it was caught in)


# Latency histogram bins: 4 per decade from 10 us to 1000 s; the ends catch the rest.
HIST_EDGES: Final = np.logspace(-5, 3, 33)


@dataclass(slots=True)
class _TransitionTable:
    """Every change of state on every side, in step order."""

    req: IntArray
    node: npt.NDArray[np.int8]
    frm: npt.NDArray[np.int8]
    to: npt.NDArray[np.int8]
    seconds: FloatArray
    at: FloatArray
    entered: FloatArray  # [request, node]: when the side entered its last state
    last_kind: npt.NDArray[np.int8]  # [request, node]: kind of the side's last step


def _entered_at_snapshot(merged: Merged, entered: FloatArray) -> None:
    """Requests live at a snapshot entered their state before it: the snapshot says when."""
    for i, node in enumerate(merged.nodes):
        if not node.at_snapshot:
            continue
        index = {k: j for j, k in enumerate(node.keys)}
        for key, known in node.at_snapshot.items():
            entered[merged.to_global[i][index[key]], i] = merged.corrected(i, known.entered)


def _transitions(merged: Merged) -> _TransitionTable:
    width = len(merged.nodes)
    shape = (merged.requests, width)
    entered = np.full(shape, np.nan)
    last_kind = np.full(shape, -1, np.int8)
    side = merged.step_req * width + merged.step_node
    if len(side):
        ends = np.flatnonzero(np.r_[side[1:] != side[:-1], True])
        last_kind[merged.step_req[ends], merged.step_node[ends]] = merged.step_kind[ends]
    live = np.flatnonzero(merged.step_state >= 0)
    states = merged.step_state[live]
    live_side = side[live]
    changed = np.r_[True, (live_side[1:] != live_side[:-1]) | (states[1:] != states[:-1])][
        : len(live)
    ]
    steps = live[changed]
    c_side, c_state, c_ts = live_side[changed], states[changed], merged.step_ts[steps]
    _entered_at_snapshot(merged, entered)
    if len(steps):
        last = np.r_[c_side[1:] != c_side[:-1], True]
        entered[merged.step_req[steps[last]], merged.step_node[steps[last]]] = c_ts[last]
    same = c_side[1:] == c_side[:-1]
    later = steps[1:][same]
    return _TransitionTable(
        req=merged.step_req[later],
        node=merged.step_node[later],
        frm=c_state[:-1][same],
        to=c_state[1:][same],
        seconds=(c_ts[1:] - c_ts[:-1])[same],
        at=c_ts[1:][same],
        entered=entered,
        last_kind=last_kind,
    )


@dataclass(slots=True)
class Analysis:
    """What ``journal replay`` reports, over the requests the filters selected."""

    merged: Merged
    filters: Filters
    selected: IntArray
    by_final: list[tuple[str, int]]
    refusals: list[RefusalSummary]
    never_released: list[Stuck]
    disagreements: list[Disagreement]
    slowest: list[Transition]
    latency: list[LatencyRow]
    gaps: list[SeqGap]
    torn: list[TornTail]
    restarts: list[Restart]
    rejected: list[Rejected]
    damage: list[tuple[str, str]]

    def summaries(self) -> Iterator[RequestSummary]:
        for r in self.selected:
            yield summarize(self.merged, int(r))


def analyse(merged: Merged, filters: Filters | None = None, *, top: int = 10) -> Analysis:
    """Everything ``journal replay`` reports; ``top`` bounds the slowest-transition list."""
    filters = filters or Filters()
    mask = select(merged, filters)
    selected = np.flatnonzero(mask)
    table = _transitions(merged)
    node_ok = [not filters.nodes or name in filters.nodes for name in merged.names]
    return Analysis(
        merged=merged,
        filters=filters,
        selected=selected,
        by_final=_by_final(merged, selected),
        refusals=_refusals(merged, mask, filters),
        never_released=_never_released(merged, selected, table),
        disagreements=_disagreements(merged, selected),
        slowest=_slowest(merged, table, mask, top),
        latency=_latency(merged, table, mask),
        gaps=[
            g
            for g in _gaps(merged)
            if node_ok[merged.names.index(g.node)] and in_window(filters, g.after_ts)
        ],
        torn=[t for n, ok in zip(merged.nodes, node_ok, strict=True) if ok for t in n.torn],
        restarts=[
            r
            for r in _restarts(merged)
            if node_ok[merged.names.index(r.node)] and in_window(filters, r.ts)
        ],
        rejected=[
            r
            for n, ok in zip(merged.nodes, node_ok, strict=True)
            if ok
            for r in n.rejected
            if in_window(filters, merged.corrected(merged.names.index(r.node), r.ts))
        ],
        damage=[
            (n.node, d) for n, ok in zip(merged.nodes, node_ok, strict=True) if ok for d in n.damage
        ],
    )


def _by_final(merged: Merged, selected: IntArray) -> list[tuple[str, int]]:
    if not len(selected):
        return []
    pairs = merged.req_final[selected].astype(np.int64) * 16 + merged.req_outcome[selected]
    codes, counts = np.unique(pairs, return_counts=True)
    rows = [
        (final_label(int(c) // 16, int(c) % 16), int(n)) for c, n in zip(codes, counts, strict=True)
    ]
    return sorted(rows, key=lambda row: (-row[1], row[0]))


def _side_reason(merged: Merged, r: int, node: int) -> str:
    """Why a side failed (its last failure) or was refused; '' for any other outcome."""
    wanted = {S_FAILED: K_FAILED, S_REFUSED: K_REFUSED}.get(int(merged.outcome[r, node]))
    found = ""
    for j in range(int(merged.start[r]), int(merged.start[r + 1])):
        if merged.step_node[j] == node and merged.step_kind[j] == wanted:
            found = merged.nodes[node].reasons[int(merged.step_local[j])]
    return found


def summarize(merged: Merged, r: int) -> RequestSummary:
    sides = tuple(
        Side(
            node=merged.names[i],
            role=ROLE_NAMES[merged.role[r, i]],
            final=STATE_LABELS[merged.final[r, i]],
            outcome=STATE_LABELS[merged.outcome[r, i]],
            reason=_side_reason(merged, r, i),
        )
        for i in range(len(merged.nodes))
        if merged.final[r, i] >= 0
    )
    return RequestSummary(
        key=merged.keys[r],
        label=merged.label(r),
        final=STATE_LABELS[merged.req_final[r]],
        outcome=STATE_LABELS[merged.req_outcome[r]],
        first=float(merged.req_first[r]),
        last=float(merged.req_last[r]),
        sides=sides,
    )


def _refusals(
    merged: Merged, mask: npt.NDArray[np.bool_], filters: Filters
) -> list[RefusalSummary]:
    """Refusals by reason, with their first and last occurrence (corrected times)."""
    seen: dict[str, list[Occurrence]] = defaultdict(list)
    picks = np.flatnonzero((merged.step_kind == K_REFUSED) & mask[merged.step_req])
    for j in picks:
        node = int(merged.step_node[j])
        reason = merged.nodes[node].reasons[int(merged.step_local[j])]
        key = merged.keys[int(merged.step_req[j])]
        seen[reason].append(Occurrence(float(merged.step_ts[j]), merged.names[node], key))
    # Refusals that name no request (an engine's malformed call) pass only
    # the filters that are not about requests.
    if not filters.on_requests:
        for i, node in enumerate(merged.nodes):
            if filters.nodes and node.node not in filters.nodes:
                continue
            for j in np.flatnonzero((node.kind == K_REFUSED) & (node.req < 0)):
                ts = float(merged.corrected(i, node.ts[j]))
                reason = node.reasons[int(j)]
                if in_window(filters, ts) and (not filters.reasons or reason in filters.reasons):
                    seen[reason].append(Occurrence(ts, node.node, None))
    rows = []
    for reason, items in sorted(seen.items()):
        items.sort(key=lambda o: o.ts)
        rows.append(RefusalSummary(reason, len(items), items[0], items[-1]))
    return rows


def _never_released(merged: Merged, selected: IntArray, table: _TransitionTable) -> list[Stuck]:
    rows = []
    final = merged.final[selected]
    for r_pos, node in zip(*np.nonzero((final >= 0) & (final < S_RELEASED)), strict=True):
        r = int(selected[r_pos])
        since = float(table.entered[r, node])
        kind = int(table.last_kind[r, node])
        rows.append(
            Stuck(
                key=merged.keys[r],
                node=merged.names[node],
                state=STATE_LABELS[merged.final[r, node]],
                since=since,
                age=float(merged.node_last[node]) - since if math.isfinite(since) else math.nan,
                last_event=KIND_NAMES[kind] if kind >= 0 else "(before the snapshot)",
            )
        )
    rows.sort(key=lambda s: (-(s.age if math.isfinite(s.age) else math.inf), s.key, s.node))
    return rows


def _disagreements(merged: Merged, selected: IntArray) -> list[Disagreement]:
    outcome = merged.outcome[selected]
    split = (outcome == S_DONE).any(axis=1) & (outcome == S_FAILED).any(axis=1)
    return [
        Disagreement(merged.keys[int(r)], summarize(merged, int(r)).sides) for r in selected[split]
    ]


def _transition_name(frm: int, to: int) -> str:
    return f"{STATE_LABELS[frm]}->{STATE_LABELS[to]}"


def _slowest(
    merged: Merged, table: _TransitionTable, mask: npt.NDArray[np.bool_], top: int
) -> list[Transition]:
    picks = np.flatnonzero(mask[table.req])
    if not len(picks) or top <= 0:
        return []
    seconds = table.seconds[picks]
    if len(picks) > top:
        best = np.argpartition(-seconds, top - 1)[:top]
        picks, seconds = picks[best], seconds[best]
    order = np.argsort(-seconds, kind="stable")
    return [
        Transition(
            key=merged.keys[int(table.req[j])],
            node=merged.names[int(table.node[j])],
            name=_transition_name(int(table.frm[j]), int(table.to[j])),
            seconds=float(table.seconds[j]),
            at=float(table.at[j]),
        )
        for j in picks[order]
    ]


def _latency(
    merged: Merged, table: _TransitionTable, mask: npt.NDArray[np.bool_]
) -> list[LatencyRow]:
    picks = np.flatnonzero(mask[table.req])
    group = (
        table.node[picks].astype(np.int64) * 256
        + table.frm[picks].astype(np.int64) * 16
        + table.to[picks]
    )
    rows = []
    for code in np.unique(group):
        values = np.sort(table.seconds[picks[group == code]])
        node, frm, to = int(code) // 256, (int(code) // 16) % 16, int(code) % 16
        clipped = np.clip(values, HIST_EDGES[0], HIST_EDGES[-1])
        histogram, _ = np.histogram(clipped, bins=HIST_EDGES)
        rows.append(
            LatencyRow(
                node=merged.names[node],
                name=_transition_name(frm, to),
                count=len(values),
                p50=float(np.quantile(values, 0.5, method="inverted_cdf")),
                p99=float(np.quantile(values, 0.99, method="inverted_cdf")),
                max=float(values[-1]),
                histogram=tuple(int(c) for c in histogram),
            )
        )
    return rows


def _gaps(merged: Merged) -> list[SeqGap]:
    gaps = []
    for i, node in enumerate(merged.nodes):
        seqs = np.concatenate([node.seq, np.array([r.seq for r in node.rejected], np.int64)])
        times = np.concatenate([node.ts, np.array([r.ts for r in node.rejected], np.float64)])
        if not len(seqs):
            continue
        order = np.argsort(seqs, kind="stable")
        seqs, times = seqs[order], merged.corrected(i, times[order])
        if node.snapshot_seq and seqs[0] > node.snapshot_seq + 1:
            gaps.append(SeqGap(node.node, node.snapshot_seq + 1, int(seqs[0]) - 1, math.nan))
        steps = np.diff(seqs)
        for j in np.flatnonzero(steps > 1):
            gaps.append(SeqGap(node.node, int(seqs[j]) + 1, int(seqs[j + 1]) - 1, float(times[j])))
        for j in np.flatnonzero(np.diff(node.seq) <= 0):
            # A number seen again or out of order: the journal was rewritten or merged wrongly.
            seq = int(node.seq[j + 1])
            gaps.append(SeqGap(node.node, seq, seq, float(merged.corrected(i, node.ts[j])), True))
    return gaps


def _restarts(merged: Merged) -> list[Restart]:
    cached: list[Restart] | None = merged.cache.get("restarts")
    if cached is None:
        cached = merged.cache["restarts"] = _find_restarts(merged)
    return cached


def _find_restarts(merged: Merged) -> list[Restart]:
    found = []
    for i, node in enumerate(merged.nodes):
        starts = np.flatnonzero(node.kind == K_DAEMON_STARTED)
        if not len(starts):
            continue
        position = _sorted_positions(merged, i)
        for s in starts:
            started = node.event(int(s))
            failed = []
            j = int(s) + 1
            while j < len(node.kind) and node.kind[j] == K_FAILED:
                if node.req[j] < 0 or node.reasons[j] != Reason.DAEMON_RESTART.value:
                    break
                key = node.keys[int(node.req[j])]
                failed.append((key, _state_before(merged, int(position[j]))))
                j += 1
            found.append(
                Restart(
                    node=node.node,
                    seq=int(node.seq[s]),
                    ts=float(merged.corrected(i, node.ts[s])),
                    pid=started.pid,
                    version=started.version,
                    boot_id=started.boot_id,
                    restart=int(node.seq[s]) > 1,
                    failed=tuple(failed),
                )
            )
    return found


def _sorted_positions(merged: Merged, node: int) -> IntArray:
    """For one node: local record index -> position in the merged step table (-1: none)."""
    positions = np.full(len(merged.nodes[node].seq), -1, np.int64)
    mine = np.flatnonzero(merged.step_node == node)
    positions[merged.step_local[mine]] = mine
    return positions


def _state_before(merged: Merged, j: int) -> str:
    """The state a side was in before step ``j`` (merged position)."""
    side = (merged.step_req[j], merged.step_node[j])
    k = j - 1
    while k >= 0 and (merged.step_req[k], merged.step_node[k]) == side:
        if merged.step_state[k] >= 0:
            return STATE_LABELS[merged.step_state[k]]
        k -= 1
    return "unknown (before the journal)"


# ============================================================== timelines


@dataclass(frozen=True, slots=True)
class Step:
    """One line of a request's merged timeline."""

    ts: float  # reference clock
    raw_ts: float  # the node's own clock
    node: str
    seq: int
    event: str
    before: str  # state on this node before the step ('' if none yet)
    after: str  # state after ('' when the step changed none)
    blocks: str
    nbytes: int | None
    detail: str
    since_previous: float | None = None


@dataclass(frozen=True, slots=True)
class Timeline:
    summary: RequestSummary
    steps: tuple[Step, ...]


def _join(counts: Iterable[int]) -> str:
    return "+".join(map(str, counts))


def _describe(event: Any) -> tuple[str, int | None, str]:
    """(blocks, bytes, detail text) of a step, from its record's event."""
    kind = type(event)
    if kind is Registered:
        text = f"{event.role.value} on engine {event.engine_id}"
        return (
            _join(map(len, event.blocks)),
            None,
            text + (f", peer {event.peer}" if event.peer else ""),
        )
    if kind is PeerRegistered:
        counts = _join(map(len, event.blocks))
        return f"recv {counts}", None, f"receiver engine {event.engine_id} on {event.peer}"
    if kind is Trimmed:
        src, dst = _join(map(len, event.src)), _join(map(len, event.dst))
        before = f"src {_join(event.src_before)} -> {src}, dst {_join(event.dst_before)} -> {dst}"
        return before, None, ""
    if kind is WriteStarted:
        return str(event.num_blocks), event.nbytes, ""
    if kind is Failed:
        settled = " [settled]" if event.settled else ""
        return "", None, f"{event.reason.value}: {event.message}{settled}"
    if kind is Refused:
        return "", None, f"refused {event.reason.value}: {event.message}"
    if kind is PeerSettled:
        return (
            "",
            None,
            "fenced: the peer was declared dead" if event.fenced else "pusher's final word",
        )
    return "", None, ""


def timeline(merged: Merged, r: int) -> Timeline:
    """Every step of request ``r`` on every node, in corrected time order."""
    key = merged.keys[r]
    steps = list(_recorded_steps(merged, r))
    steps += _rejected_steps(merged, key)
    steps += _restart_steps(merged, key)
    order = {name: i for i, name in enumerate(merged.names)}
    steps.sort(key=lambda s: (s.ts, order[s.node], s.seq))
    timed = []
    previous: float | None = None
    for step in steps:
        gap = None if previous is None else step.ts - previous
        timed.append(dataclasses.replace(step, since_previous=gap))
        previous = step.ts
    return Timeline(summarize(merged, r), tuple(timed))


def _recorded_steps(merged: Merged, r: int) -> Iterator[Step]:
    key = merged.keys[r]
    state: dict[int, str] = {}
    for i, node in enumerate(merged.nodes):
        if key in node.at_snapshot:
            state[i] = STATE_LABELS[node.at_snapshot[key].state]
    for j in range(int(merged.start[r]), int(merged.start[r + 1])):
        i = int(merged.step_node[j])
        node = merged.nodes[i]
        local = int(merged.step_local[j])
        kind = int(merged.step_kind[j])
        code = int(merged.step_state[j])
        before = state.get(i, "")
        after = STATE_LABELS[code] if code >= 0 else ""
        if after:
            state[i] = after
        blocks, nbytes, detail = _describe(node.event(local))
        yield Step(
            ts=float(merged.step_ts[j]),
            raw_ts=float(node.ts[local]),
            node=node.node,
            seq=int(node.seq[local]),
            event=KIND_NAMES[kind],
            before=before,
            after="" if after == before and kind != K_REGISTERED else after,
            blocks=blocks,
            nbytes=nbytes,
            detail=detail,
        )


def _rejected_steps(merged: Merged, key: RequestKey) -> list[Step]:
    return [
        Step(
            ts=float(merged.corrected(i, item.ts)),
            raw_ts=item.ts,
            node=item.node,
            seq=item.seq,
            event=KIND_NAMES[item.kind],
            before="",
            after="",
            blocks="",
            nbytes=None,
            detail=f"REJECTED by the core on replay: {item.message}",
        )
        for i, node in enumerate(merged.nodes)
        for item in node.rejected
        if item.key == key
    ]


def _restart_steps(merged: Merged, key: RequestKey) -> list[Step]:
    return [
        Step(
            ts=restart.ts,
            raw_ts=restart.ts + merged.clocks.offsets[restart.node],
            node=restart.node,
            seq=restart.seq,
            event=KIND_NAMES[K_DAEMON_STARTED],
            before="",
            after="",
            blocks="",
            nbytes=None,
            detail=f"daemon restarted (pid {restart.pid}, boot {restart.boot_id})",
        )
        for restart in _restarts(merged)
        if any(k == key for k, _ in restart.failed)
    ]


# ============================================================== text output


def format_time(ts: float, *, date: bool = False) -> str:
    """Local wall-clock time with microseconds, as operators read logs."""
    if not math.isfinite(ts):
        return "-"
    moment = dt.datetime.fromtimestamp(ts).astimezone()
    return moment.strftime("%Y-%m-%d %H:%M:%S.%f" if date else "%H:%M:%S.%f")


def key_text(key: RequestKey | None) -> str:
    return "-" if key is None else f"{key[0]}#{key[1]}"


def seconds(value: float) -> str:
    return f"{value:.3f}" if math.isfinite(value) else "-"


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None or not math.isfinite(seconds) else f"{seconds * 1e3:.3f}"


def table(header: Sequence[str], rows: Sequence[Sequence[object]], indent: str = "  ") -> str:
    return texttable.table(header, rows, indent=indent)


def _limited(rows: list[Any], limit: int) -> tuple[list[Any], str]:
    if limit <= 0 or len(rows) <= limit:
        return rows, ""
    return rows[:limit], f"  ... and {len(rows) - limit} more (--limit, or --json for all)"


def render_replay(analysis: Analysis, out: TextIO, *, limit: int = 20) -> None:
    """The human report of ``journal replay``."""
    merged = analysis.merged
    w = out.write
    w("journals\n")
    header = ["node", "records", "seq", "starts", "first", "last", "journal"]
    w(table(header, _journal_rows(merged)) + "\n")
    w("\nclocks\n")
    for line in merged.clocks.describe():
        w(textwrap.fill(line, 100, initial_indent="  ", subsequent_indent="    ") + "\n")
    scope = analysis.filters.describe()
    w(
        f"\n{len(analysis.selected)} of {merged.requests} requests"
        + (f" ({scope})" if scope else "")
        + "\n"
    )
    _section(w, "requests by final state", ["final state", "requests"], analysis.by_final)
    _section(
        w,
        "refusals by reason",
        ["reason", "count", "first (time node request)", "last"],
        [(r.reason, r.count, _occurrence(r.first), _occurrence(r.last)) for r in analysis.refusals],
    )
    stuck, more = _limited(analysis.never_released, limit)
    _section(
        w,
        "never released",
        ["request", "node", "state", "since", "age s", "last event"],
        [
            (key_text(s.key), s.node, s.state, format_time(s.since), seconds(s.age), s.last_event)
            for s in stuck
        ],
        more,
    )
    split, more = _limited(analysis.disagreements, limit)
    _section(
        w,
        "sides that disagree (one done, another failed)",
        ["request", "sides"],
        [(key_text(d.key), "; ".join(_side_text(s) for s in d.sides)) for d in split],
        more,
    )
    _section(
        w,
        "slowest transitions",
        ["ms", "node", "transition", "request", "at"],
        [
            (_ms(t.seconds), t.node, t.name, key_text(t.key), format_time(t.at))
            for t in analysis.slowest
        ],
    )
    _section(
        w,
        "transition latency",
        ["node", "transition", "count", "p50 ms", "p99 ms", "max ms"],
        [
            (row.node, row.name, row.count, _ms(row.p50), _ms(row.p99), _ms(row.max))
            for row in analysis.latency
        ],
    )
    _section(
        w,
        "restarts",
        ["node", "seq", "at", "pid", "boot", "requests failed right after (state caught in)"],
        [
            (
                r.node,
                r.seq,
                format_time(r.ts, date=True),
                r.pid,
                r.boot_id,
                ", ".join(f"{key_text(k)} ({s})" for k, s in r.failed) or "-",
            )
            for r in analysis.restarts
            if r.restart
        ],
    )
    _section(
        w,
        "sequence gaps",
        ["node", "missing", "count", "after"],
        [
            (
                g.node,
                f"{g.first_missing}"
                + ("" if g.count == 1 else f"..{g.last_missing}")
                + (" (seen again / out of order)" if g.repeated else ""),
                g.count,
                format_time(g.after_ts),
            )
            for g in analysis.gaps
        ],
    )
    _section(
        w,
        "torn tails",
        ["node", "file", "offset", "bytes cut"],
        [(t.node, t.path, t.offset, t.nbytes) for t in analysis.torn],
    )
    _section(w, "damage (read past with salvage)", ["node", "damage"], analysis.damage)
    _section(
        w,
        "records the core rejected on replay",
        ["node", "seq", "at", "event", "request", "why"],
        [
            (r.node, r.seq, format_time(r.ts), KIND_NAMES[r.kind], key_text(r.key), r.message)
            for r in analysis.rejected
        ],
    )


def _occurrence(item: Occurrence) -> str:
    return f"{format_time(item.ts)} {item.node} {key_text(item.key)}"


def _journal_rows(merged: Merged) -> list[tuple[object, ...]]:
    rows: list[tuple[object, ...]] = []
    for i, node in enumerate(merged.nodes):
        seqs = f"{int(node.seq.min())}..{int(node.seq.max())}" if node.records else "-"
        starts = int((node.kind == K_DAEMON_STARTED).sum())
        rows.append(
            (
                node.node,
                node.records,
                seqs,
                starts,
                format_time(float(merged.node_first[i]), date=True),
                format_time(float(merged.node_last[i]), date=True),
                ", ".join(node.sources),
            )
        )
    return rows


def _side_text(side: Side) -> str:
    reason = f" ({side.reason})" if side.reason else ""
    return f"{side.node} {side.role}: {side.outcome}{reason}, {side.final}"


def _section(
    w: Callable[[str], int],
    title: str,
    header: Sequence[str],
    rows: Sequence[Sequence[object]],
    more: str = "",
) -> None:
    if not rows:
        w(f"\n{title}: none\n")
        return
    w(f"\n{title}\n{table(header, rows)}\n")
    if more:
        w(more + "\n")


def render_timeline(item: Timeline, merged: Merged, out: TextIO) -> None:
    """One request's life as a table, every node interleaved."""
    summary = item.summary
    w = out.write
    sides = "; ".join(_side_text(s) for s in summary.sides) or "-"
    w(f"{key_text(summary.key)}: {summary.label}  [{sides}]\n")
    if item.steps:
        day = format_time(item.steps[0].ts, date=True).split(" ")[0]
        zone = dt.datetime.fromtimestamp(item.steps[0].ts).astimezone().strftime("%Z")
        w(f"times: {day} {zone}, {merged.clocks.reference}'s clock")
        shifted = [f"{n} {_signed_ms(-o)}" for n, o in merged.clocks.offsets.items() if o]
        w(f" (corrected: {', '.join(shifted)})\n" if shifted else "\n")
    rows = [
        (
            format_time(s.ts),
            _ms(s.since_previous),
            s.node,
            s.event,
            f"{s.before} -> {s.after}".lstrip() if s.after else "",
            s.blocks,
            "" if s.nbytes is None else f"{s.nbytes:,}",
            s.detail,
        )
        for s in item.steps
    ]
    header = ["time", "+ms", "node", "event", "state", "blocks", "bytes", "detail"]
    w(table(header, rows, indent="") + "\n")


# ============================================================== JSON


def _jsonable(item: Any) -> Any:
    """A dataclass as plain data; a request key becomes request_id and incarnation."""
    data = dataclasses.asdict(item)
    return _split_keys(data)


def _split_keys(data: Any) -> Any:
    if isinstance(data, dict):
        out = {}
        for name, value in data.items():
            if name == "key":
                out["request_id"], out["incarnation"] = (None, None) if value is None else value
            else:
                out[name] = _split_keys(value)
        return out
    if isinstance(data, list | tuple):
        return [_split_keys(v) for v in data]
    if isinstance(data, float) and not math.isfinite(data):
        return None
    return data


def replay_json(analysis: Analysis) -> dict[str, Any]:
    merged = analysis.merged
    filters = analysis.filters
    return {
        "journals": [
            {
                "node": node.node,
                "sources": list(node.sources),
                "records": node.records,
                "records_read": node.records_read,
                "first_seq": int(node.seq.min()) if node.records else None,
                "last_seq": int(node.seq.max()) if node.records else None,
                "snapshot_seq": node.snapshot_seq,
                "first_ts": _split_keys(float(merged.node_first[i])),
                "last_ts": _split_keys(float(merged.node_last[i])),
            }
            for i, node in enumerate(merged.nodes)
        ],
        "clocks": {
            "reference": merged.clocks.reference,
            "offsets_s": merged.clocks.offsets,
            "pairs": [_jsonable(p) for p in merged.clocks.pairs],
            "unpaired": list(merged.clocks.unpaired),
            "description": merged.clocks.describe(),
        },
        "filters": _split_keys(dataclasses.asdict(filters)),
        "requests_total": merged.requests,
        "requests_selected": len(analysis.selected),
        "by_final_state": dict(analysis.by_final),
        "refusals": [_jsonable(r) for r in analysis.refusals],
        "never_released": [_jsonable(s) for s in analysis.never_released],
        "disagreements": [_jsonable(d) for d in analysis.disagreements],
        "slowest_transitions": [_jsonable(t) for t in analysis.slowest],
        "latency": [_jsonable(row) for row in analysis.latency],
        "latency_histogram_edges_s": [float(e) for e in HIST_EDGES],
        "restarts": [_jsonable(r) for r in analysis.restarts],
        "sequence_gaps": [_jsonable(g) for g in analysis.gaps],
        "torn_tails": [_jsonable(t) for t in analysis.torn],
        "damage": [{"node": n, "damage": d} for n, d in analysis.damage],
        "rejected": [_jsonable(r) | {"event": KIND_NAMES[r.kind]} for r in analysis.rejected],
        "requests": [_jsonable(s) for s in analysis.summaries()],
    }


def timeline_json(item: Timeline) -> dict[str, Any]:
    return {"request": _jsonable(item.summary), "steps": [_jsonable(s) for s in item.steps]}


# ============================================================== commands


EXIT_OK: Final = 0
EXIT_NOT_FOUND: Final = 1
EXIT_ERROR: Final = 2


def spec_from_args(args: Any) -> FilterSpec:
    return FilterSpec(
        requests=tuple(getattr(args, "request", None) or ()),
        since=getattr(args, "since", None),
        until=getattr(args, "until", None),
        states=tuple(getattr(args, "state", None) or ()),
        reasons=tuple(getattr(args, "reason", None) or ()),
        nodes=tuple(getattr(args, "node", None) or ()),
    )


def _prepare(args: Any, details: KeepDetails | None) -> tuple[Merged, Filters]:
    """Load, merge and resolve the filters; raises PostmortemError for what the user can fix."""
    # A command runs once and exits, holding millions of acyclic objects: the
    # cyclic collector would only rescan them, for seconds, finding nothing.
    gc.disable()
    try:
        merged = merge(load(args.journals, jobs=args.jobs, progress=sys.stderr, details=details))
    except (JournalError, ReplayError, OSError) as exc:
        raise PostmortemError(str(exc)) from exc
    return merged, resolve_filters(spec_from_args(args), merged)


def _quiet_broken_pipe() -> int:
    """The reader went away (``| head``): stop quietly, as other CLI tools do."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return EXIT_OK


def _write_json(data: Any, out: TextIO) -> None:
    out.write(msgspec.json.encode(data).decode())
    out.write("\n")


def run_replay(args: Any, out: TextIO | None = None) -> int:
    out = out or sys.stdout
    try:
        merged, filters = _prepare(args, no_request)
    except PostmortemError as exc:
        print(f"ERROR: {exc}", file=sys.stderr)
        return EXIT_ERROR
    analysis = analyse(merged, filters, top=args.top)
    try:
        if args.json:
            _write_json(replay_json(analysis), out)
        else:
            render_replay(analysis, out, limit=args.limit)
        out.flush()
    except BrokenPipeError:
        return _quiet_broken_pipe()
    return EXIT_OK


def run_timeline(args: Any, out: TextIO | None = None) -> int:
    out = out or sys.stdout
    try:
        merged, filters = _prepare(args, RequestMatcher(args.request))
    except PostmortemError as exc:
        print(f"ERROR: {exc}", file=sys.stderr)
        return EXIT_ERROR
    found = np.flatnonzero(select(merged, filters))
    if not len(found):
        wanted = " or ".join(args.request)
        print(f"no request {wanted} in these journals", file=sys.stderr)
        return EXIT_NOT_FOUND
    items = [timeline(merged, int(r)) for r in found]
    try:
        if args.json:
            _write_json([timeline_json(item) for item in items], out)
        else:
            for n, item in enumerate(items):
                out.write("\n" if n else "")
                render_timeline(item, merged, out)
        out.flush()
    except BrokenPipeError:
        return _quiet_broken_pipe()
    return EXIT_OK


def run_report(args: Any) -> int:
    from daemon.postmortem.html import write_report

    try:
        merged, filters = _prepare(args, None)
    except PostmortemError as exc:
        print(f"ERROR: {exc}", file=sys.stderr)
        return EXIT_ERROR
    analysis = analyse(merged, filters, top=args.top)
    try:
        write_report(analysis, args.output, max_timelines=args.max_timelines)
    except OSError as exc:
        print(f"ERROR: cannot write {args.output}: {exc}", file=sys.stderr)
        return EXIT_ERROR
    print(f"wrote {args.output} ({len(analysis.selected)} requests)", file=sys.stderr)
    return EXIT_OK
