"""The recorder: the one way the shell changes state.

It stamps an event with the envelope (format version, node, sequence number,
wall-clock time), folds it into the registry with the same ``apply`` replay
uses, and appends it to the journal. Nothing may be told to an engine or a
peer until the journal's durable sequence number covers the record (DESIGN
invariant 6); callers wait for that through the group commit.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from daemon.journal.replay import encode_snapshot
from daemon.journal.store import Journal, check_payload
from schemas.events import FORMAT_VERSION, Event, Record, encode_record
from statemachine import Registry


class Recorder:
    def __init__(
        self,
        journal: Journal,
        registry: Registry,
        *,
        node: str,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.journal = journal
        self.registry = registry
        self.node = node
        self._clock = clock

    def record(self, event: Event) -> tuple[Record, object]:
        """Apply then append ``event``; returns the record and what it touched.

        The core validates first: an event it refuses raises ``Refusal`` and
        is neither applied nor journaled; so is one too large to journal
        (``ValueError``).
        """
        record = Record(FORMAT_VERSION, self.node, self.journal.next_seq, self._clock(), event)
        payload = encode_record(record)
        # Refuse what the journal would refuse before the registry moves: a
        # change in memory without its record would be lost on replay. (An
        # append that then fails on I/O is fatal: the daemon stops and
        # replays.)
        check_payload(payload)
        touched = self.registry.apply(event, record.ts)
        seq = self.journal.append(payload)
        if seq != record.seq:
            # The journal is the only source of sequence numbers; a mismatch
            # means two writers, which would break replay order.
            raise RuntimeError(f"journal assigned seq {seq}, record was stamped {record.seq}")
        return record, touched

    def snapshot(self, *, retain_segments: int = 1) -> int:
        """Make everything durable, write a registry snapshot, prune old segments."""
        seq = self.journal.commit()
        self.journal.write_snapshot(seq, encode_snapshot(self.registry.snapshot(seq)))
        self.journal.prune(retain_segments=retain_segments)
        return seq
