"""Counts and latencies gathered while a journal is folded.

Fed by ``replay(on_record=...)``: it sees each record with the request record
the registry returned, so it counts what the core decided, not a re-parse.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Final

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

    def reached_rows(self) -> list[tuple[str, int]]:
        """(state, requests that reached it), in lifecycle order."""
        return sorted(self.reached.items(), key=lambda item: _lifecycle_rank(item[0]))

    def latency_table(self) -> list[tuple[str, int, float, float, float]]:
        """(transition, count, p50, p99, max) in seconds, in lifecycle order."""
        rows = []
        for name, values in sorted(self.transitions.items(), key=_transition_rank):
            values.sort()
            rows.append(
                (name, len(values), percentile(values, 50), percentile(values, 99), values[-1])
            )
        return rows


# The order a request lives through its states (State's own order puts
# released before failed); operators read tables top to bottom in it.
LIFECYCLE: Final = (
    State.REGISTERED,
    State.TRIMMED,
    State.WRITING,
    State.DONE,
    State.FAILED,
    State.RELEASED,
)


def _lifecycle_rank(state: str) -> int:
    values = [s.value for s in LIFECYCLE]
    return values.index(state) if state in values else len(values)


def _transition_rank(item: tuple[str, object]) -> tuple[int, int]:
    before, _, after = item[0].partition("->")
    return _lifecycle_rank(before), _lifecycle_rank(after)
