"""The node's counters, typed and owned: each part counts only its own.

``kvpushd status`` shows them merged, under the names they always had
(:func:`merged`); the Prometheus metrics count the same facts from the
journal instead (daemon/node/metrics.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from schemas.events import Event, Refused


@dataclass
class WriteCounters:
    """The pusher's NIXL writes (daemon/node/transfers.py)."""

    writes_started: int = 0
    writes_done: int = 0
    writes_failed: int = 0
    bytes_written: int = 0


@dataclass
class RefusalCounter:
    """Refusals journaled, whoever refused (an engine call, a trim, a peer's forward)."""

    refusals: int = 0

    def observe(self, event: Event, touched: object, ts: float) -> None:
        """Ledger observer: a refusal counts once it is journaled, not before."""
        if type(event) is Refused:
            self.refusals += 1


@dataclass
class IntegrityCounters:
    """End-to-end checks (daemon/node/integrity.py)."""

    integrity_checked: int = 0
    integrity_blocks_verified: int = 0
    integrity_mismatches: int = 0
    integrity_unchecked: int = 0
    integrity_digests_sent: int = 0
    integrity_slots_checked: int = 0
    integrity_dirty_slots: int = 0


def merged(*parts: WriteCounters | RefusalCounter | IntegrityCounters) -> dict[str, int]:
    """One flat name -> count mapping, in the order the parts are given."""
    out: dict[str, int] = {}
    for part in parts:
        out.update(dataclasses.asdict(part))
    return out
