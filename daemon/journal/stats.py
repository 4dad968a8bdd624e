"""Counts and latencies gathered while a journal is folded.

Fed by ``replay(on_record=...)``: it sees each record with the request record
the registry returned, so it counts what the core decided, not a re-parse.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field

from schemas.events import Failed, Record, Refused, Registered
from schemas.state import RequestRecord, State


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an already sorted, non-empty list."""
    rank = max(0, min(len(sorted_values) - 1, round(q / 100 * len(sorted_values) + 0.5) - 1))
    return sorted_values[rank]


@dataclass(slots=True)
class JournalStats:
    events: Counter[str] = field(default_factory=Counter)
    reached: Counter[str] = field(default_factory=Counter)
    refusals: Counter[str] = field(default_factory=Counter)
    failures: Counter[str] = field(default_factory=Counter)
    transitions: defaultdict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    # request id -> (state, ts entered); dropped once released.
    _last: dict[str, tuple[State, float]] = field(default_factory=dict)

    def on_record(self, record: Record, touched: object) -> None:
        event = record.event
        self.events[type(event).__name__] += 1
        if isinstance(event, Refused):
            self.refusals[event.reason.value] += 1
        elif isinstance(event, Failed):
            self.failures[event.reason.value] += 1
        if not isinstance(touched, RequestRecord):
            return
        rid = touched.request_id
        if isinstance(event, Registered):
            self._last[rid] = (touched.state, record.ts)
            self.reached[touched.state.value] += 1
            return
        previous = self._last.get(rid)
        if previous is None or previous[0] is touched.state:
            return
        self.reached[touched.state.value] += 1
        self.transitions[f"{previous[0].value}->{touched.state.value}"].append(
            record.ts - previous[1]
        )
        if touched.state is State.RELEASED:
            del self._last[rid]
        else:
            self._last[rid] = (touched.state, record.ts)

    def latency_table(self) -> list[tuple[str, int, float, float, float]]:
        """(transition, count, p50, p99, max) in seconds, sorted by transition."""
        rows = []
        for name, values in sorted(self.transitions.items()):
            values.sort()
            rows.append(
                (name, len(values), percentile(values, 50), percentile(values, 99), values[-1])
            )
        return rows
