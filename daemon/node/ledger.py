"""The ledger: the one path by which the shell changes a request and speaks of it.

``ledger.commit(events, cause)`` stamps each event with the journal envelope
(format version, node, sequence number, wall-clock time), applies it through
the core (``Registry.apply``, the same code replay runs), appends it to the
journal, logs it, shows it to the observers (metrics), takes a snapshot on
cadence, and works out from the core (:mod:`statemachine.notices`) whom the
transition must be told to. Awaiting the returned :class:`Commit` waits until
the group commit has made the records durable, and only then delivers those
notices to the engine and the peer (ARCHITECTURE.md, invariant 6: persist
before telling).

Appending happens when ``commit`` is called, not when it is awaited, so a
caller may append, start other work whose records join the same fdatasync,
and then await.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import structlog

from daemon import failpoints
from daemon.journal.format import JournalFatal, check_payload
from daemon.journal.groupcommit import GroupCommit
from daemon.journal.replay import encode_snapshot
from daemon.journal.writer import Journal
from schemas import peer as pm
from schemas import rpc
from schemas.events import (
    FORMAT_VERSION,
    Event,
    Failed,
    KvMismatch,
    Record,
    Refused,
    RequestEvent,
    encode_record,
)
from schemas.state import RequestRecord
from statemachine import Registry
from statemachine.notices import TOLD_OF, Notice, notices
from statemachine.reactions import Cause, Stimulus, Why, react, release_may_be_due

log = structlog.get_logger("kvpushd.node")
# Events logged at info or above whatever the level (the rest only at debug).
_LOGGED = frozenset({Failed, Refused, KvMismatch})


class Courier(Protocol):
    """Who carries notices: the engine sessions and the peer links."""

    def tell_engine(self, engine_id: str, message: rpc.Event) -> None: ...

    def tell_peer(self, node: str, message: pm.PeerMessage) -> bool: ...


@dataclass(frozen=True)
class Carriers:
    """A courier made of the two parts that carry: the engines and the peer port."""

    tell_engine: Callable[[str, rpc.Event], None]
    tell_peer: Callable[[str, pm.PeerMessage], bool]


Observer = Callable[[Event, object, float], None]
AfterDurable = Callable[[Event, RequestRecord], None]


class Commit:
    """Records appended; awaiting it waits for durability, then tells."""

    __slots__ = ("_ledger", "failpoint", "notices", "records", "seq")

    def __init__(
        self,
        ledger: Ledger,
        seq: int,
        owed: list[Notice],
        records: list[tuple[Event, Any]],
        failpoint: str | None,
    ) -> None:
        self._ledger = ledger
        self.seq = seq
        self.notices = owed
        self.records = records
        self.failpoint = failpoint

    def __await__(self) -> Generator[Any, None, None]:
        return self._ledger._finish(self).__await__()

    def tell_when_durable(self) -> None:
        """Tell once durable, with nobody awaiting: the group commit's wake-up tells.

        For a caller with nothing to do after the commit (no task to keep). A
        journal that fails first tells nobody (the node stops and replays).
        """
        self._ledger._tell_when_durable(self)


class Ledger:
    def __init__(
        self,
        journal: Journal,
        registry: Registry,
        *,
        node: str,
        clock: Callable[[], float] = time.time,
        group: GroupCommit | None = None,
        courier: Courier | None = None,
        snapshot_every: int = 0,
        retain_segments: int = 1,
        debug: bool = False,
        on_fatal: Callable[[JournalFatal], None] = lambda exc: None,
    ) -> None:
        self.journal = journal
        self.registry = registry
        self.node = node
        self.group = group
        self.courier = courier
        self.observers: list[Observer] = []
        # Per event type, run once such a record is durable, before its notices
        # go out (released offload slots go back to the pool only then).
        self.after_durable: dict[type, list[AfterDurable]] = {}
        self.clock = clock
        self._snapshot_every = snapshot_every
        self._retain = retain_segments
        self._since_snapshot = 0
        # Checked before building a debug line: this is the journal's hot path.
        self._debug = debug
        self._on_fatal = on_fatal
        self._log = log.bind(node=node)

    # ------------------------------------------------------------- reading

    def current(self, request_id: str, incarnation: int) -> RequestRecord | None:
        """The live record of exactly this incarnation, if any (after an await, say)."""
        record = self.registry.get(request_id)
        if record is None or record.incarnation != incarnation:
            return None
        return record

    # ------------------------------------------------------------- reacting

    async def react(
        self,
        record: RequestRecord,
        stimulus: Stimulus,
        why: Why | None = None,
        *,
        failpoint: str | None = None,
    ) -> list[RequestEvent]:
        """Commit what the core says ``stimulus`` calls for (and what follows it).

        Returns the events the stimulus called for (none: nothing to journal).
        """
        events = react(record, stimulus, why)
        if events:
            await self.commit(events, stimulus.cause, failpoint=failpoint)
        return events

    def react_and_tell(
        self,
        record: RequestRecord,
        stimulus: Stimulus,
        why: Why | None = None,
        *,
        failpoint: str | None = None,
    ) -> list[RequestEvent]:
        """:meth:`react` for a caller that does not wait: committed now, told once durable."""
        events = react(record, stimulus, why)
        if events:
            self.commit(events, stimulus.cause, failpoint=failpoint).tell_when_durable()
        return events

    # ------------------------------------------------------------ appending

    def append(self, event: Event) -> tuple[Record, object]:
        """Apply then append ``event``; returns the record and what it touched.

        The core validates first: an event it refuses raises ``Refusal`` and
        is neither applied nor journaled; so is one too large to journal
        (``ValueError``).
        """
        record = Record(FORMAT_VERSION, self.node, self.journal.next_seq, self.clock(), event)
        payload = encode_record(record)
        # Refuse what the journal would refuse before the registry moves: a
        # change in memory without its record would be lost on replay. (An
        # append that then fails on I/O is fatal: the daemon stops and replays.)
        check_payload(payload)
        touched = self.registry.apply(event, record.ts)
        seq = self.journal.append(payload)
        if seq != record.seq:
            # The journal is the only source of sequence numbers; a mismatch
            # means two writers, which would break replay order.
            raise RuntimeError(f"journal assigned seq {seq}, record was stamped {record.seq}")
        return record, touched

    def commit(
        self,
        events: Iterable[Event],
        cause: Cause = Cause.DAEMON,
        *,
        peer: str = "",
        failpoint: str | None = None,
    ) -> Commit:
        """Append ``events`` in order; await the result to make them durable and tell.

        ``cause`` decides who is told (:data:`statemachine.notices.NOTICES`);
        ``peer`` names the peer daemon to answer when the event has no record
        here to name it (a refused forward). ``failpoint`` is hit once the
        records are durable, before anyone is told (daemon/failpoints.py).
        """
        owed: list[Notice] = []
        records: list[tuple[Event, Any]] = []
        seq = 0
        # What each applied event makes due at once (a deferred release whose
        # quarantine it lifted) joins this commit, right after it.
        queue = [(event, cause) for event in events]
        queue.reverse()
        while queue:
            event, cause = queue.pop()
            kind = type(event)
            told = kind in TOLD_OF
            # A pending registration has no record to name its peer; the
            # failure that ends it must still reach that peer (read before
            # the event removes it).
            answer = peer
            if told and kind is Failed and self.registry.pending:
                pending = self.registry.pending.get(event.request_id)  # type: ignore[union-attr]
                if pending is not None:
                    answer = pending.registration.peer
            record, touched = self._append_logged(event)
            seq = record.seq
            records.append((event, touched))
            if type(touched) is RequestRecord and release_may_be_due(touched):
                follows = self.registry.follow_up(touched)
                queue.extend((due, Cause.DAEMON) for due in reversed(follows))
            if told:
                owed.extend(
                    notices(
                        touched if type(touched) is RequestRecord else None,
                        event,  # type: ignore[arg-type]
                        cause,
                        peer=answer,
                        layouts=self.registry.engines,
                    )
                )
        return Commit(self, seq, owed, records, failpoint)

    def _append_logged(self, event: Event) -> tuple[Record, object]:
        try:
            record, touched = self.append(event)
        except JournalFatal as exc:
            # A synchronous commit (policy "always", a full segment) failed, or
            # the journal failed before: as fatal as a failed group commit.
            self._on_fatal(exc)
            raise
        if type(event) in _LOGGED or self._debug:
            self._log_event(event, record.seq)
        for observe in self.observers:
            observe(event, touched, record.ts)
        if self._snapshot_every:
            self._since_snapshot += 1
            if self._since_snapshot >= self._snapshot_every:
                self._since_snapshot = 0
                try:
                    self.snapshot()
                except JournalFatal as exc:
                    self._on_fatal(exc)  # the snapshot's commit or file write failed
                    raise
        return record, touched

    def _log_event(self, event: Event, seq: int) -> None:
        request_id = getattr(event, "request_id", None)
        if request_id is None:
            return
        if isinstance(event, KvMismatch):
            # One line per node: the decode's (its engine's report) and the
            # prefill's (the pairing it quarantines).
            self._log.warning(
                "kv mismatch",
                request_id=request_id,
                incarnation=event.incarnation,
                role=event.role.value,
                engine=event.engine_id,
                peer=event.peer,
                peer_engine=event.peer_engine,
                layer=event.layer,
                position=event.position,
                difference=event.difference,
                tolerance=event.tolerance,
                detail=event.detail,
                seq=seq,
            )
        elif isinstance(event, Failed | Refused):
            self._log.warning(
                "request failed" if isinstance(event, Failed) else "request refused",
                request_id=request_id,
                incarnation=event.incarnation,
                reason=event.reason.value,
                detail=event.message,
                seq=seq,
            )
        elif self._debug:
            self._log.debug(
                "transition",
                request_id=request_id,
                incarnation=event.incarnation,  # type: ignore[union-attr]
                kind=type(event).__name__,
                seq=seq,
            )

    def snapshot(self, *, retain_segments: int | None = None) -> int:
        """Make everything durable, write a registry snapshot, prune old segments."""
        seq = self.journal.commit()
        self.journal.write_snapshot(seq, encode_snapshot(self.registry.snapshot(seq)))
        retain = self._retain if retain_segments is None else retain_segments
        self.journal.prune(retain_segments=retain)
        return seq

    # ------------------------------------------------------------ durability

    async def durable(self, seq: int) -> None:
        assert self.group is not None, "a ledger without a group commit never waits"
        await self.group.durable(seq)

    async def _finish(self, commit: Commit) -> None:
        if commit.seq:
            assert self.group is not None, "a ledger without a group commit never waits"
            await self.group.durable(commit.seq)
        self._tell(commit)

    def _tell_when_durable(self, commit: Commit) -> None:
        waiting = None
        if commit.seq:
            assert self.group is not None, "a ledger without a group commit never waits"
            waiting = self.group.when_durable(commit.seq)
        if waiting is None:
            self._tell(commit)
        else:
            waiting.add_done_callback(functools.partial(self._tell_if_durable, commit=commit))

    def _tell_if_durable(self, done: asyncio.Future[None], commit: Commit) -> None:
        if done.cancelled() or done.exception() is not None:
            return  # the journal failed: the group commit reported it, nobody is told
        try:
            self._tell(commit)
        except Exception:
            # Awaited, this would end the awaiting task; here it ends this
            # delivery, logged as a task's failure is.
            self._log.exception("telling a durable commit failed", seq=commit.seq)

    def _tell(self, commit: Commit) -> None:
        """What a durable commit owes: its failpoint, the hooks, then the notices."""
        if commit.failpoint is not None:
            failpoints.hit(commit.failpoint)
        hooks = self.after_durable
        for event, touched in commit.records:
            hooked = hooks.get(type(event))
            if hooked is not None and type(touched) is RequestRecord:
                for after in hooked:
                    after(event, touched)
        courier = self.courier
        if courier is None:
            return
        for notice in commit.notices:
            if notice.to_engine:
                courier.tell_engine(notice.to, notice.message)  # type: ignore[arg-type]
            else:
                courier.tell_peer(notice.to, notice.message)  # type: ignore[arg-type]
