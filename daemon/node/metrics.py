"""Prometheus metrics for one node, served as text on a local port.

Everything event-shaped is fed from the ledger's observers (``Ledger.observers``):
the callback runs right after an event is applied and appended, so the counters and histograms
here describe exactly what was journaled (a refusal that never reached the
journal is not counted). Everything state-shaped (live requests per state,
peers, journal position) is read from the node when scraped, by
:class:`_NodeCollector`, so those gauges can never drift from ``status()``.

The registry is private to the node (not prometheus_client's global one) so
two nodes in one process, as in tests, never share series.

The endpoint is an asyncio handler on the daemon's own loop rather than
prometheus_client's threaded server: the scrape-time collector walks the
node's registry dicts, which only the loop thread may read safely (a walk
from another thread can meet a dict changing size mid-iteration).
"""

from __future__ import annotations

import asyncio
import contextlib
import typing
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import structlog
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from daemon.journal.groupcommit import GroupCommit
from schemas.events import (
    DaemonStarted,
    Event,
    Failed,
    IntegrityMismatch,
    KvMismatch,
    QuarantineCleared,
    Refused,
    Released,
    WriteDone,
    WriteStarted,
)
from schemas.layout import Role
from schemas.reasons import FAILURE_REASONS, REFUSAL_REASONS, Reason
from schemas.state import RequestRecord, SlotState, State
from schemas.status import StatusDocument

log = structlog.get_logger("kvpushd.metrics")

NAMESPACE = "kvpushd"
LIVE_STATES: tuple[State, ...] = tuple(s for s in State if s is not State.RELEASED)

# Loopback transfers of a few blocks take ~100 us; a stuck one ends at the
# writing deadline (30 s by default).
TRANSFER_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip
# A group commit is one write plus one fdatasync: tens of microseconds on
# tmpfs, milliseconds on disks, longer when the device is in trouble.
FSYNC_BUCKETS = (
    0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025,
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
)  # fmt: skip
# States last from microseconds (trimmed, on the pusher) up to the done and
# failed deadlines (minutes), while the engine holds on to the request.
STATE_BUCKETS = (
    0.0001, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
)  # fmt: skip

HTTP_READ_TIMEOUT_S = 5.0
MAX_HEADER_LINES = 100


class _InState(NamedTuple):
    incarnation: int
    state: State
    entered_at: float


class _Write(NamedTuple):
    started_at: float
    nbytes: int


class _ByReason(dict[Reason, Any]):
    """Children per reason, made up front for the reasons the family can see.

    A reason outside that set still counts (its child is made on first use):
    the journal is the truth, the set only decides which zeros are exported.
    """

    def __init__(self, family: Counter, reasons: Iterable[Reason]) -> None:
        super().__init__({r: family.labels(r.value) for r in sorted(reasons)})
        self._family = family

    def __missing__(self, reason: Reason) -> Any:
        child = self[reason] = self._family.labels(reason.value)
        return child


def _event_tag(kind: type) -> str:
    return str(kind.__struct_config__.tag)  # type: ignore[attr-defined]


class NodeMetrics:
    """The node's metrics: observe the ledger from before ``Node.begin()``, serve after it.

    ``status`` is the node's status document, read at scrape time for the
    gauges; ``live`` its live records, read once the restart is journaled.
    The owner adds :meth:`observe` to the node's observers.
    """

    def __init__(
        self,
        *,
        status: Callable[[], StatusDocument],
        live: Callable[[], Iterable[RequestRecord]],
    ) -> None:
        self._live = live
        self.registry = CollectorRegistry()
        self._in_state: dict[str, _InState] = {}
        self._writes: dict[str, _Write] = {}
        self._server: asyncio.Server | None = None
        # `_created` series would double the exposition for no use here. The
        # switch is process-wide, which is fine: the daemon owns its process.
        disable_created_metrics()
        self._build()
        self.registry.register(_NodeCollector(status))
        # Unprefixed: dashboards and alerts expect the standard process_* names,
        # and its process_start_time_seconds is the one start-time metric.
        ProcessCollector(registry=self.registry)

    # ---------------------------------------------------------- instruments

    def _counter(self, name: str, doc: str, labels: Iterable[str] = ()) -> Counter:
        return Counter(name, doc, list(labels), namespace=NAMESPACE, registry=self.registry)

    def _histogram(
        self, name: str, doc: str, buckets: tuple[float, ...], labels: Iterable[str] = ()
    ) -> Histogram:
        return Histogram(
            name, doc, list(labels), namespace=NAMESPACE, registry=self.registry, buckets=buckets
        )

    def _build(self) -> None:
        c, h = self._counter, self._histogram
        self.transfers_started = c("transfers_started", "Pushes started (WriteStarted, pusher).")
        self.transfers_completed = c("transfers_completed", "Pushes done (WriteDone, pusher).")
        self.transfers_failed = c("transfers_failed", "Pushes that failed while writing.")
        self.written_bytes = c("written_bytes", "Bytes pushed by completed NIXL WRITEs.")
        self.kv_arrived = c("kv_arrived", "Receiver requests whose KV arrived (WriteDone).")
        self.integrity_mismatches = c(
            "integrity_mismatches",
            "Receiver requests whose landed blocks differ from the pusher's checksums "
            "(IntegrityMismatch; each fails integrity_mismatch).",
        )
        kv_mismatches = c(
            "kv_mismatches",
            "Loads whose KV a decode engine found not its own by recomputing a token "
            "(KvMismatch; receiver: reported here; pusher: pushed from here, pairing quarantined).",
            ["role"],
        )
        self._kv_mismatches = {role: kv_mismatches.labels(role.value) for role in Role}
        self.quarantines_cleared = c(
            "quarantines_cleared", "Quarantined pairings an operator cleared (QuarantineCleared)."
        )
        refusals = c("refusals", "Journaled refusals (Refused events).", ["reason"])
        failures = c("failures", "Requests failed (Failed events).", ["reason"])
        appends = c("journal_appends", "Journal records appended, by event.", ["event"])
        self.errors = c("metrics_errors", "Observer errors (metrics may be incomplete).")
        self.transfer_seconds = h(
            "transfer_seconds", "Pusher WriteStarted to WriteDone.", TRANSFER_BUCKETS
        )
        states = h("state_seconds", "Time requests spent in a state.", STATE_BUCKETS, ["state"])
        self.fsync_seconds = h("fsync_seconds", "Group commit write+sync time.", FSYNC_BUCKETS)
        # Children resolved once: labels() costs microseconds per call, and
        # the observer runs for every journal record. Creating them up front
        # also exports zeros, so rate() works from the first scrape.
        self._refusals = _ByReason(refusals, REFUSAL_REASONS)
        self._failures = _ByReason(failures, FAILURE_REASONS)
        self._appends = {k: appends.labels(_event_tag(k)) for k in typing.get_args(Event)}
        self._state_seconds = {s: states.labels(s.value) for s in LIVE_STATES}

    # ------------------------------------------------------------ feeding

    def observe(self, event: Event, touched: object, ts: float) -> None:
        """A ``Ledger.observers`` callback: one journaled event."""
        # The record is already journaled and applied: a bug here must not
        # turn into a failed engine call, so it is logged and counted.
        try:
            self._observe(event, touched, ts)
        except Exception:
            self.errors.inc()
            log.exception("metrics observer failed", event=type(event).__name__)

    def _observe(self, event: Event, touched: object, ts: float) -> None:
        self._appends[type(event)].inc()
        if isinstance(event, DaemonStarted):
            # Recorded right after replay, before any request event: the
            # registry now holds exactly what the journal restored.
            self._seed(self._live())
        elif isinstance(event, Refused):
            self._refusals[event.reason].inc()
        if isinstance(event, Failed):
            self._failures[event.reason].inc()
        elif isinstance(event, IntegrityMismatch):
            self.integrity_mismatches.inc()
        elif isinstance(event, KvMismatch):
            self._kv_mismatches[event.role].inc()
        elif isinstance(event, QuarantineCleared):
            self.quarantines_cleared.inc()
        if isinstance(touched, RequestRecord):
            self._track(event, touched, ts)

    def _seed(self, records: Iterable[RequestRecord]) -> None:
        self._in_state = {
            r.request_id: _InState(r.incarnation, r.state, r.entered_at) for r in records
        }
        self._writes.clear()

    def _track(self, event: Event, record: RequestRecord, ts: float) -> None:
        rid = record.request_id
        before = self._in_state.get(rid)
        if before is not None and before.incarnation != record.incarnation:
            before = None  # an older incarnation we never saw end
        if before is not None and before.state is not record.state:
            self._state_seconds[before.state].observe(max(0.0, ts - before.entered_at))
        if record.role is Role.PUSHER:
            self._track_push(event, record, ts, before)
        elif isinstance(event, WriteDone):
            self.kv_arrived.inc()
        if isinstance(event, Released) or record.state is State.RELEASED:
            self._in_state.pop(rid, None)
            self._writes.pop(rid, None)
        elif before is None or before.state is not record.state:
            self._in_state[rid] = _InState(record.incarnation, record.state, record.entered_at)

    def _track_push(
        self, event: Event, record: RequestRecord, ts: float, before: _InState | None
    ) -> None:
        rid = record.request_id
        if isinstance(event, WriteStarted):
            self.transfers_started.inc()
            self._writes[rid] = _Write(ts, event.nbytes)
        elif isinstance(event, WriteDone):
            self.transfers_completed.inc()
            write = self._writes.pop(rid, None)
            if write is not None:
                self.transfer_seconds.observe(max(0.0, ts - write.started_at))
                self.written_bytes.inc(write.nbytes)
        elif isinstance(event, Failed) and before is not None and before.state is State.WRITING:
            self.transfers_failed.inc()
            self._writes.pop(rid, None)

    def on_commit(self, durable_seq: int, seconds: float) -> None:
        """``GroupCommit`` hook: one commit (write + fdatasync per policy)."""
        self.fsync_seconds.observe(seconds)

    def hook_group_commit(self, group: GroupCommit) -> None:
        """Observe the node's group commit (it exists once the node is open)."""
        group.observers.append(self.on_commit)

    # ------------------------------------------------------------- serving

    def render(self) -> bytes:
        return generate_latest(self.registry)

    async def start(self, port: int, host: str = "127.0.0.1") -> int:
        """Serve ``GET /metrics`` on ``host:port`` (0: any free port); returns the port."""
        self._server = await asyncio.start_server(self._serve, host, port)
        return int(self._server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2.0)
            self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            # Bounded: a client that never finishes its request holds nothing.
            method, path = await asyncio.wait_for(_read_request(reader), HTTP_READ_TIMEOUT_S)
            writer.write(self._respond(method, path))
            await writer.drain()
        except (TimeoutError, ValueError, ConnectionError, asyncio.IncompleteReadError):
            pass  # malformed or abandoned request: just hang up
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    def _respond(self, method: str, path: str) -> bytes:
        if path.split("?", 1)[0] not in ("/metrics", "/"):
            return _http(404, "Not Found", b"try /metrics\n")
        if method not in ("GET", "HEAD"):
            return _http(405, "Method Not Allowed", b"GET only\n")
        body = self.render()
        return _http(200, "OK", body, CONTENT_TYPE_LATEST, head=method == "HEAD")


async def _read_request(reader: asyncio.StreamReader) -> tuple[str, str]:
    """The method and path of one HTTP/1.x request; its headers are skipped."""
    parts = (await reader.readline()).decode("latin-1").split()
    if len(parts) != 3 or not parts[2].startswith("HTTP/"):
        raise ValueError("not an HTTP request line")
    for _ in range(MAX_HEADER_LINES):
        if (await reader.readline()) in (b"\r\n", b"\n", b""):
            return parts[0], parts[1]
    raise ValueError("too many header lines")


def _http(
    code: int,
    reason: str,
    body: bytes,
    content_type: str = "text/plain; charset=utf-8",
    *,
    head: bool = False,
) -> bytes:
    header = (
        f"HTTP/1.1 {code} {reason}\r\nContent-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return header.encode() + (b"" if head else body)


class _NodeCollector(Collector):
    """Gauges read from the status document at scrape time: never apart from ``status``."""

    def __init__(self, status: Callable[[], StatusDocument]) -> None:
        self._status = status

    def collect(self) -> Iterable[Metric]:
        doc = self._status()
        yield from self._identity(doc)
        yield from self._requests(doc)
        yield from self._peers(doc)
        yield from self._journal(doc)
        yield from self._engines(doc)
        yield from self._offload(doc)

    def _gauge(self, name: str, doc: str, value: float | None = None) -> GaugeMetricFamily:
        return GaugeMetricFamily(f"{NAMESPACE}_{name}", doc, value=value)

    def _identity(self, doc: StatusDocument) -> Iterable[Metric]:
        info = GaugeMetricFamily(
            f"{NAMESPACE}_node_info",
            "Always 1; the labels say which daemon.",
            labels=["node", "version", "boot_id"],
        )
        info.add_metric([doc.node, doc.version, doc.boot_id], 1)
        yield info

    def _requests(self, doc: StatusDocument) -> Iterable[Metric]:
        live = GaugeMetricFamily(
            f"{NAMESPACE}_live_requests", "Live requests by state.", labels=["state"]
        )
        for state in LIVE_STATES:
            live.add_metric([state.value], doc.by_state.get(state.value, 0))
        yield live
        age = 0.0 if doc.oldest is None else max(0.0, doc.oldest.age_s)
        yield self._gauge(
            "oldest_live_request_age_seconds", "Time the oldest live request is in its state.", age
        )
        yield self._gauge(
            "pending_peer_registrations",
            "Receiver registrations waiting for the prefill engine.",
            doc.pending_peer_registrations,
        )
        yield self._gauge("writes_in_flight", "NIXL writes in flight.", doc.writes_in_flight)

    def _peers(self, doc: StatusDocument) -> Iterable[Metric]:
        links = doc.peers
        configured = sum(not i.on_demand for i in links)
        yield self._gauge("peers_configured", "Configured peers.", configured)
        yield self._gauge("peers_up", "Peers with an authenticated link.", sum(i.up for i in links))
        up = GaugeMetricFamily(f"{NAMESPACE}_peer_up", "1 if the peer is up.", labels=["peer"])
        heard = GaugeMetricFamily(
            f"{NAMESPACE}_peer_last_heard_seconds",
            "Seconds since anything (a heartbeat at least) came from the peer.",
            labels=["peer"],
        )
        for info in links:
            up.add_metric([info.node], float(info.up))
            if info.last_heard_age_s is not None:
                heard.add_metric([info.node], info.last_heard_age_s)
        yield up
        yield heard

    def _journal(self, doc: StatusDocument) -> Iterable[Metric]:
        journal = doc.journal
        yield self._gauge("journal_next_seq", "Seq the next journal record gets.", journal.next_seq)
        yield self._gauge("journal_durable_seq", "Last durable journal seq.", journal.durable_seq)
        yield self._gauge(
            "journal_lag_records", "Records appended but not yet durable.", max(0, journal.lag)
        )

    def _engines(self, doc: StatusDocument) -> Iterable[Metric]:
        engines = doc.engines.values()
        yield self._gauge("engines_registered", "Engines registered.", len(engines))
        yield self._gauge(
            "engines_connected",
            "Registered engines with a live connection.",
            sum(e.connected for e in engines),
        )

    def _offload(self, doc: StatusDocument) -> Iterable[Metric]:
        """The offload tier (README.md, "Offload tier"): nothing when it is off."""
        tier = doc.offload
        if tier is None:
            return
        slots = GaugeMetricFamily(
            f"{NAMESPACE}_offload_slots", "Offload pool slots by state.", labels=["state"]
        )
        for state in SlotState:
            slots.add_metric([state.value], tier.by_state.get(state.value, 0))
        yield slots
        lookups = CounterMetricFamily(
            f"{NAMESPACE}_offload_lookups",
            "Offload keys looked up (leased on a hit).",
            labels=["result"],
        )
        lookups.add_metric(["hit"], tier.hits)
        lookups.add_metric(["miss"], tier.misses)
        yield lookups
        stores = CounterMetricFamily(
            f"{NAMESPACE}_offload_stores",
            "Offload slots stored: committed, or a duplicate key (the first kept, this one reset).",
            labels=["result"],
        )
        stores.add_metric(["committed"], tier.committed)
        stores.add_metric(["duplicate"], tier.duplicates)
        yield stores
        yield CounterMetricFamily(
            f"{NAMESPACE}_offload_resets",
            "Offload slots zeroed, checked and journaled reset.",
            value=tier.resets,
        )
        yield CounterMetricFamily(
            f"{NAMESPACE}_offload_not_zero",
            "Offload slots found not zero when granted (discarded and reset, never granted).",
            value=tier.not_zero,
        )
        yield CounterMetricFamily(
            f"{NAMESPACE}_offload_condemned",
            "Offload slots readers condemned (their bytes differed from the committed digest: "
            "never leased again, evicted and reset once unleased).",
            value=tier.condemned,
        )
