"""Which requests an operator asked about: ``--request``, ``--since``, ``--state``, ...

Filters are typed as strings (:class:`FilterSpec`), checked and resolved
against the merged journals (:class:`Filters`), and applied as a mask over
the merged requests (:func:`select`).
"""

from __future__ import annotations

import datetime as dt
import fnmatch
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Final

import numpy as np
import numpy.typing as npt

from daemon.postmortem.formatting import format_time
from daemon.postmortem.merge import Merged
from daemon.postmortem.vocab import K_FAILED, K_REFUSED, STATE_LABELS, PostmortemError, RequestKey
from schemas.reasons import Reason
from statemachine.ranks import transfer_of


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
    """Which request keys ``--request`` names: an exact id (which also names
    the TP ranks' shares of that transfer, ``ID@tp<r>``, statemachine/ranks.py),
    ``ID#N`` for one incarnation, or a glob (``*?[``). Picklable, for worker
    processes."""

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
        # An exact transfer id also names its TP ranks' shares (T@tp0, T@tp1...).
        return (
            key[0] in self.exact
            or transfer_of(key[0]) in self.exact
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
