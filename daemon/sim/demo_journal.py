"""The demo's journal checks: each daemon's journal replayed, every request's path checked.

:func:`read_journal` folds a stopped daemon's journal through the core as a
restart would; :func:`check_journal` says where a planned request did not
take the path it should have: a delivered one ends done then released (on
the prefill side with the bytes the engines saw written), a too-long one
failed then released (the prefill side journaling the refusal), and a
``blocks_owned`` probe never becomes a request.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from daemon.journal.format import JournalError
from daemon.journal.replay import ReplayError, replay
from daemon.journal.stats import JournalStats
from daemon.sim.demo_plan import PREFILL, Kind, Plan, Transfer
from daemon.sim.demo_push import Outcome
from schemas.events import Record, Refused, WriteStarted
from schemas.reasons import Reason
from schemas.state import RequestRecord, State


@dataclass
class JournalView:
    """What one daemon's journal says, folded through the core as on replay."""

    node: str
    path: Path
    stats: JournalStats
    records: int = 0
    live: int = 0
    states: dict[str, list[State]] = field(default_factory=dict)  # request -> states entered
    failures: dict[str, Reason] = field(default_factory=dict)
    refused: dict[str, list[Reason]] = field(default_factory=dict)
    write_bytes: dict[str, int] = field(default_factory=dict)
    error: str = ""

    def on_record(self, record: Record, touched: object) -> None:
        self.stats.on_record(record, touched)
        event = record.event
        rid = getattr(event, "request_id", None)
        if rid is None:
            return
        if isinstance(event, Refused):
            self.refused.setdefault(rid, []).append(event.reason)
        elif isinstance(event, WriteStarted):
            self.write_bytes[rid] = event.nbytes
        if isinstance(touched, RequestRecord):
            states = self.states.setdefault(rid, [])
            if not states or states[-1] is not touched.state:
                states.append(touched.state)
            if touched.state is State.FAILED and touched.reason is not None:
                self.failures[rid] = touched.reason


def read_journal(node: str, path: Path) -> JournalView:
    view = JournalView(node, path, JournalStats())
    try:
        result = replay(path, on_record=view.on_record)
    except (JournalError, ReplayError) as exc:
        view.error = f"{type(exc).__name__}: {exc}"
        return view
    view.records, view.live = result.records, len(result.registry.live)
    if result.torn_bytes:
        view.error = f"torn tail of {result.torn_bytes} bytes after a clean stop"
    return view


def check_journal(view: JournalView, plan: Plan, outcomes: dict[str, Outcome]) -> list[str]:
    """Every planned request took the path it should have through this journal."""
    problems: list[str] = []
    if view.error:
        return [f"{view.node} journal: {view.error}"]
    if view.live:
        problems.append(f"{view.node} journal: {view.live} requests still live after the stop")
    for t in plan.transfers:
        problems += _check_transfer(view, t, outcomes.get(t.request_id))
    for probe in plan.probes:
        if probe.kind is Kind.BLOCKS_OWNED and probe.request_id in view.states:
            problems.append(
                f"{view.node} journal: refused probe {probe.request_id} became a request"
            )
    return problems


def _check_transfer(view: JournalView, t: Transfer, outcome: Outcome | None) -> list[str]:
    where = f"{view.node} journal, {t.request_id} ({t.kind.value})"
    states = view.states.get(t.request_id, [])
    path = " -> ".join(s.value for s in states) or "nothing"
    if not states or states[-1] is not State.RELEASED:
        return [f"{where}: does not end released: {path}"]
    if t.kind is Kind.TOO_LONG:
        reason = view.failures.get(t.request_id)
        if State.FAILED not in states or reason is not Reason.DECODE_LONGER_THAN_PREFILL:
            return [f"{where}: expected failed ({t.kind.value}), got {path} ({reason})"]
        if view.node == PREFILL and Reason.DECODE_LONGER_THAN_PREFILL not in view.refused.get(
            t.request_id, []
        ):
            return [f"{where}: the trim refusal was not journaled"]
        return []
    if State.DONE not in states or State.FAILED in states:
        return [f"{where}: expected done -> released, got {path}"]
    if view.node == PREFILL and outcome is not None and outcome.actual == "delivered":
        journaled = view.write_bytes.get(t.request_id)
        if journaled != outcome.nbytes:
            return [
                f"{where}: journal says {journaled} bytes written, the engines {outcome.nbytes}"
            ]
    return []
