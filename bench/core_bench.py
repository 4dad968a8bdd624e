"""Core benchmarks: event encode/decode, and journal replay through the core.

Run from the repository root: .venv/bin/python -m bench.core_bench [--events N]
Writes a section into bench/RESULTS.md (not with ``--no-write``).
``--breakdown`` adds what each stage of a replay costs per event, measured
alone: the CRC pass, walking and decoding the frames, applying the events.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import tempfile
import time
from pathlib import Path

import msgspec

from bench.results import write_section
from daemon.journal.reader import read_journal
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
    record_decoder,
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


def write_journal(path: Path, target_events: int, journal_format: int = 2, group: int = 1) -> int:
    """A journal of ``target_events`` pusher lifecycles, committed every ``group`` requests.

    A commit per request (8 records) is what a lone request's group commits
    come to at most; under load a commit holds more. In format 1 commits do
    not change the bytes; in format 2 each commit is one frame.
    """
    registry = Registry(tombstone_limit=10_000)
    with Journal.open(path, fsync=FsyncPolicy.NEVER, format=journal_format) as journal:
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
            if i % group == 0:
                journal.commit()
        return journal.next_seq - 1


def best_rate(path: Path, written: int, parallel: bool | None) -> float:
    best = 0.0
    for _ in range(3):
        t0 = time.perf_counter()
        result = replay(path, tombstone_limit=10_000, parallel=parallel)
        elapsed = time.perf_counter() - t0
        assert result.records == written and not result.registry.live
        best = max(best, written / elapsed)
    return best


def bench_replay(
    n_events: int, breakdown: bool, journal_format: int = 2, group: int = 1
) -> tuple[int, float, list[tuple[str, str]]]:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "journal"
        written = write_journal(path, n_events, journal_format, group)
        rate = best_rate(path, written, None)
        rows = stage_costs(path, written) if breakdown else []
        return written, rate, rows


def _best_ns(written: int, fn: object) -> float:
    assert callable(fn)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best / written * 1e9


def stage_costs(path: Path, written: int) -> list[tuple[str, str]]:
    """Each stage of a replay alone, in ns per event (best of 3), and the whole."""
    decode = record_decoder().decode
    decode_group = msgspec.msgpack.Decoder(list[Record]).decode
    contents = read_journal(path)

    def walk_and_decode() -> None:
        for _, payload, sizes in contents.records.units():
            if sizes is None:
                decode(payload)
            else:
                decode_group(payload)

    events = [(r.event, r.ts) for r in map(decode, (p for _, p in contents.records))]

    def apply_all() -> None:
        apply = Registry(tombstone_limit=10_000).apply
        for event, ts in events:
            apply(event, ts)

    gc.disable()
    try:
        crc = _best_ns(written, lambda: read_journal(path))
        walk = _best_ns(written, walk_and_decode)
        fold = _best_ns(written, apply_all)
    finally:
        gc.enable()
    serial = 1e9 / best_rate(path, written, False)
    parallel = 1e9 / best_rate(path, written, True)
    rest = serial - crc - walk - fold
    return [
        ("validate every frame (read_journal: CRC pass), ns/event", f"{crc:.0f}"),
        ("slice each frame out of its segment and decode it, ns/event", f"{walk:.0f}"),
        ("apply each event (Registry.apply, events decoded beforehand), ns/event", f"{fold:.0f}"),
        ("replay, one process (parallel=False), ns/event", f"{serial:.0f}"),
        ("  of which none of the above (loop, checks, first/last), ns/event", f"{rest:.0f}"),
        ("replay, CRCs checked in a forked child (parallel=True), ns/event", f"{parallel:.0f}"),
    ]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--breakdown", action="store_true", help="also time each stage alone")
    parser.add_argument(
        "--format", type=int, default=2, choices=(1, 2), help="journal format to write (default 2)"
    )
    parser.add_argument(
        "--group", type=int, default=1, metavar="N", help="requests (8 records each) per commit"
    )
    parser.add_argument("--no-write", action="store_true", help="print only; keep RESULTS.md")
    args = parser.parse_args()
    enc, dec = bench_codec()
    written, rate, stages = bench_replay(args.events, args.breakdown, args.format, args.group)
    rows = [
        ("encode one journal record (WriteStarted)", f"{enc / 1e6:.2f} M/s"),
        ("decode one journal record", f"{dec / 1e6:.2f} M/s"),
        (
            f"replay through the core ({written:,} events, format {args.format}, "
            f"a commit per {args.group * 8} records, best of 3)",
            f"{rate / 1e3:.0f} k events/s",
        ),
        *stages,
    ]
    lines = ["| measurement | result |", "|---|---|", *(f"| {a} | {b} |" for a, b in rows)]
    lines.append("")
    lines.append("Target: replay through the core >= 1 M events/s (issue 14).")
    print("\n".join(lines))
    if args.no_write:
        return
    write_section(
        "Core (codec and replay)",
        f"{time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores, Python {platform.python_version()}",
        "\n".join(lines),
    )


if __name__ == "__main__":
    main()
