"""``kvpushd journal verify|show|stats``: an operator's look at one node's journal.

``verify`` replays the journal through the core and says, by its exit code,
whether it is clean, cut at the tail, or corrupt; ``show`` prints its
records; ``stats`` counts them by state and reason and times the
transitions. Several nodes' journals together are the postmortem's business
(:mod:`daemon.postmortem.commands`).
"""

from __future__ import annotations

import argparse
import sys
from datetime import UTC, datetime
from pathlib import Path

import msgspec

from daemon.journal.format import JournalCorrupt, JournalError
from daemon.journal.reader import require_journal
from daemon.journal.replay import ReplayError, decode_snapshot, iter_records, replay
from daemon.journal.stats import JournalStats
from daemon.ops.texttable import table
from schemas.events import Record
from statemachine.slots import SlotLine, SlotPool, slot_history

# `journal verify` exit codes: scripts and operators branch on them.
EXIT_CLEAN = 0
EXIT_TORN_TAIL = 1
EXIT_CORRUPT = 2  # also: no journal at the path, or it cannot be read


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f}"


def _not_a_journal(path: Path) -> bool:
    """Say so (one line) when ``path`` holds no journal: "0 records, OK" would mislead."""
    try:
        require_journal(path)
    except (JournalError, OSError) as exc:
        print(f"ERROR: {exc}", file=sys.stderr)
        return True
    return False


def cmd_verify(args: argparse.Namespace) -> int:
    if _not_a_journal(args.path):
        return EXIT_CORRUPT
    try:
        result = replay(args.path, salvage=args.salvage)
    except JournalCorrupt as exc:
        print(f"CORRUPT: {exc}", file=sys.stderr)
        return EXIT_CORRUPT
    except ReplayError as exc:
        print(f"CORRUPT: the journal decodes but cannot be replayed: {exc}", file=sys.stderr)
        return EXIT_CORRUPT
    except (JournalError, OSError) as exc:
        print(f"ERROR: {exc}", file=sys.stderr)
        return EXIT_CORRUPT
    live = len(result.registry.live)
    summary = (
        f"{result.records} records replayed, last seq {result.last_seq}"
        f" (snapshot at seq {result.snapshot_seq}), {live} live requests"
    )
    if result.damage:
        print(f"SALVAGED with damage: {summary}")
        for line in result.damage:
            print(f"  damage: {line}")
        return EXIT_CORRUPT
    if result.torn_bytes:
        where = f" in {result.torn_at[0]} at offset {result.torn_at[1]}" if result.torn_at else ""
        print(f"TORN TAIL: {result.torn_bytes} bytes cut{where}; {summary}")
        return EXIT_TORN_TAIL
    print(f"OK: {summary}")
    return EXIT_CLEAN


def iso_utc(ts: float) -> str:
    """``2026-11-30T02:20:53.884737Z``: what an operator compares with other logs."""
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


def _value(value: object) -> str:
    # Enums as their values and nested structs as JSON, never Python reprs.
    return value if isinstance(value, str) else msgspec.json.encode(value).decode()


def _show_line(record: Record) -> str:
    body = msgspec.to_builtins(msgspec.structs.asdict(record.event))
    fields = " ".join(f"{k}={_value(v)}" for k, v in body.items())
    return (
        f"{record.seq:>10}  {iso_utc(record.ts)}  {record.node}  "
        f"{type(record.event).__name__}  {fields}"
    )


def _slot_lines(args: argparse.Namespace) -> list[str]:
    """``--slot N``: the slot's history (statemachine/slots.py ``slot_history``), each record
    with the slot's state and generation after it, and the flag of one replay would refuse
    (a read of a generation the slot no longer had, above all)."""
    contents, records = iter_records(args.path, salvage=True)
    pool = None
    if contents.snapshot is not None:
        snap = decode_snapshot(contents.snapshot[1]).slots
        pool = SlotPool.from_snapshot(snap) if snap is not None else None
    return [_slot_line(line, args.json) for line in slot_history(records, args.slot, pool)]


def _slot_line(line: SlotLine, as_json: bool) -> str:
    record = line.record
    state = line.state.value if line.state is not None else None
    if as_json:
        return msgspec.json.encode(
            {
                "seq": record.seq,
                "ts": record.ts,
                "time": iso_utc(record.ts),
                "node": record.node,
                "event": type(record.event).__name__,
                **msgspec.structs.asdict(record.event),
                "slot_state": state,
                "generation": line.generation,
                "flag": line.flag,
            }
        ).decode()
    text = f"{_show_line(record)}  => {state or 'none'} gen {line.generation}"
    return f"{text}  FLAGGED: {line.flag}" if line.flag else text


def cmd_show(args: argparse.Namespace) -> int:
    if _not_a_journal(args.path):
        return EXIT_CORRUPT
    try:
        if args.slot is not None:
            for text in _slot_lines(args):
                print(text)
            return EXIT_CLEAN
        _, records = iter_records(args.path, salvage=True)
        for record in records:
            if args.request and getattr(record.event, "request_id", None) != args.request:
                continue
            if args.json:
                line = msgspec.json.encode(
                    {
                        "seq": record.seq,
                        "ts": record.ts,
                        "time": iso_utc(record.ts),
                        "node": record.node,
                        "event": type(record.event).__name__,
                        **msgspec.structs.asdict(record.event),
                    }
                ).decode()
            else:
                line = _show_line(record)
            print(line)
    except (JournalError, ReplayError) as exc:
        print(f"ERROR: {exc}", file=sys.stderr)
        return EXIT_CORRUPT
    except BrokenPipeError:
        sys.stderr.close()
    except OSError as exc:
        print(f"ERROR: {exc}", file=sys.stderr)
        return EXIT_CORRUPT
    return EXIT_CLEAN


def cmd_stats(args: argparse.Namespace) -> int:
    if _not_a_journal(args.path):
        return EXIT_CORRUPT
    stats = JournalStats()
    try:
        result = replay(args.path, salvage=args.salvage, on_record=stats.on_record)
    except (JournalError, ReplayError, OSError) as exc:
        print(f"ERROR: {exc}", file=sys.stderr)
        return EXIT_CORRUPT
    if args.json:
        print(
            msgspec.json.encode(
                {
                    "records": result.records,
                    "last_seq": result.last_seq,
                    "live": len(result.registry.live),
                    "events": dict(stats.events),
                    "reached": dict(stats.reached),
                    "refusals": dict(stats.refusals),
                    "failures": dict(stats.failures),
                    "latency_s": {
                        name: {"count": n, "p50": p50, "p99": p99, "max": mx}
                        for name, n, p50, p99, mx in stats.latency_table()
                    },
                }
            ).decode()
        )
        return EXIT_CLEAN
    print(
        f"{result.records} records, last seq {result.last_seq}, "
        f"{len(result.registry.live)} live requests\n"
    )
    print(table(["state reached", "requests"], stats.reached_rows()))
    print()
    print(table(["refusal reason", "count"], sorted(stats.refusals.items()) or [("-", 0)]))
    print()
    print(table(["failure reason", "count"], sorted(stats.failures.items()) or [("-", 0)]))
    print()
    rows = [(n, c, _ms(p50), _ms(p99), _ms(mx)) for n, c, p50, p99, mx in stats.latency_table()]
    print(table(["transition", "count", "p50 ms", "p99 ms", "max ms"], rows or [("-",) * 5]))
    return EXIT_CLEAN


_PATH_HELP = "the node's journal directory (journal.dir) or one segment file"


def add_parsers(jsub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``verify``, ``show`` and ``stats`` under ``kvpushd journal``."""
    verify = jsub.add_parser(
        "verify", help="check a journal: exit 0 clean, 1 torn tail only, 2 corrupt"
    )
    verify.add_argument("path", type=Path, help=_PATH_HELP)
    verify.add_argument(
        "--salvage", action="store_true", help="read past damage and list it instead of stopping"
    )
    verify.set_defaults(func=cmd_verify)

    show = jsub.add_parser("show", help="print events, optionally of one request")
    show.add_argument("path", type=Path, help=_PATH_HELP)
    show.add_argument("--request", help="only events of this request id")
    show.add_argument(
        "--slot",
        type=int,
        help="the history of this offload slot; a record replay would refuse (a read of "
        "a generation the slot no longer had) is FLAGGED",
    )
    show.add_argument("--json", action="store_true", help="one JSON object per line")
    show.set_defaults(func=cmd_show)

    stats = jsub.add_parser("stats", help="counts per state and reason, transition latencies")
    stats.add_argument("path", type=Path, help=_PATH_HELP)
    stats.add_argument("--json", action="store_true", help="print the counts as one JSON object")
    stats.add_argument(
        "--salvage", action="store_true", help="read past damage instead of stopping at it"
    )
    stats.set_defaults(func=cmd_stats)
