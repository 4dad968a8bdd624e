"""Core benchmarks: event encode/decode, and journal replay through the core.

Run from the repository root: .venv/bin/python -m bench.core_bench [--events N]
Writes a section into bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time
from pathlib import Path

from bench.results import write_section
from daemon.journal.replay import replay
from daemon.journal.writer import FsyncPolicy, Journal
from daemon.node.ledger import Ledger
from schemas.events import (
    FORMAT_VERSION,
    KvReady,
    Record,
    WriteDone,
    WriteStarted,
    decode_record,
    encode_record,
)
from schemas.layout import EngineLayout, GroupKind, GroupLayout, Role
from statemachine import Registry

LAYOUT = EngineLayout("prefill-0", (GroupLayout(GroupKind.ATTENTION, 1 << 20),))


def bench_codec(n: int = 200_000) -> tuple[float, float]:
    record = Record(
        FORMAT_VERSION, "prefill-a", 123456, time.time(), WriteStarted("req-1234", 1, 4, 262144)
    )
    t0 = time.perf_counter()
    for _ in range(n):
        payload = encode_record(record)
    t1 = time.perf_counter()
    for _ in range(n):
        decode_record(payload)
    t2 = time.perf_counter()
    return n / (t1 - t0), n / (t2 - t1)


def write_journal(path: Path, target_events: int) -> int:
    registry = Registry(tombstone_limit=10_000)
    with Journal.open(path, fsync=FsyncPolicy.NEVER) as journal:
        rec = Ledger(journal, registry, node="prefill-a")
        rec.append(registry.check_attach(LAYOUT))
        i = 0
        while journal.next_seq <= target_events:
            rid = f"req-{i}"
            base = (i * 4) % ((1 << 20) - 8)
            rec.append(
                registry.check_register(
                    rid, 1, Role.PUSHER, "prefill-0", "decode-a", [list(range(base, base + 4))]
                )
            )
            rec.append(
                registry.check_peer_registration(rid, 1, "decode-a", "decode-0", ((7, 8),), 1)
            )
            rec.append(KvReady(rid, 1))
            rec.append(registry.plan_trim(rid, 1))
            rec.append(WriteStarted(rid, 1, 2, 2 * 65536))
            rec.append(WriteDone(rid, 1))
            for event in registry.plan_release(rid, 1):
                rec.append(event)
            i += 1
        return journal.next_seq - 1


def bench_replay(n_events: int) -> tuple[int, float]:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "journal"
        written = write_journal(path, n_events)
        best = 0.0
        for _ in range(3):
            t0 = time.perf_counter()
            result = replay(path, tombstone_limit=10_000)
            elapsed = time.perf_counter() - t0
            assert result.records == written and not result.registry.live
            best = max(best, written / elapsed)
        return written, best


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--events", type=int, default=1_000_000)
    args = parser.parse_args()
    enc, dec = bench_codec()
    written, rate = bench_replay(args.events)
    rows = [
        ("encode one journal record (WriteStarted)", f"{enc / 1e6:.2f} M/s"),
        ("decode one journal record", f"{dec / 1e6:.2f} M/s"),
        (
            f"replay through the core ({written:,} events, best of 3)",
            f"{rate / 1e3:.0f} k events/s",
        ),
    ]
    lines = ["| measurement | result |", "|---|---|", *(f"| {a} | {b} |" for a, b in rows)]
    lines.append("")
    lines.append("Target: replay through the core >= 500 k events/s.")
    print("\n".join(lines))
    write_section(
        "Core (codec and replay)",
        f"{time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores, Python {platform.python_version()}",
        "\n".join(lines),
    )


if __name__ == "__main__":
    main()
