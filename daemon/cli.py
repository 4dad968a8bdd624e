"""The ``kvpushd`` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Final

import msgspec

from daemon.journal.format import JournalCorrupt, JournalError
from daemon.journal.replay import ReplayError, iter_records, replay
from daemon.journal.stats import JournalStats
from daemon.ops.texttable import table
from schemas.events import Record

# `journal verify` exit codes: scripts and operators branch on them.
EXIT_CLEAN = 0
EXIT_TORN_TAIL = 1
EXIT_CORRUPT = 2
EXIT_CONFIG = 2  # `run`: the configuration is unusable


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f}"


def cmd_verify(args: argparse.Namespace) -> int:
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


def _show_line(record: Record) -> str:
    body = msgspec.structs.asdict(record.event)
    fields = " ".join(f"{k}={v}" for k, v in body.items())
    return (
        f"{record.seq:>10}  {record.ts:.6f}  {record.node}  {type(record.event).__name__}  {fields}"
    )


def cmd_show(args: argparse.Namespace) -> int:
    try:
        _, records = iter_records(args.path, salvage=True)
        for record in records:
            if args.request and getattr(record.event, "request_id", None) != args.request:
                continue
            if args.json:
                line = msgspec.json.encode(
                    {
                        "seq": record.seq,
                        "ts": record.ts,
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
    print(table(["state reached", "requests"], sorted(stats.reached.items())))
    print()
    print(table(["refusal reason", "count"], sorted(stats.refusals.items()) or [("-", 0)]))
    print()
    print(table(["failure reason", "count"], sorted(stats.failures.items()) or [("-", 0)]))
    print()
    rows = [(n, c, _ms(p50), _ms(p99), _ms(mx)) for n, c, p50, p99, mx in stats.latency_table()]
    print(table(["transition", "count", "p50 ms", "p99 ms", "max ms"], rows or [("-",) * 5]))
    return EXIT_CLEAN


# --- `kvpushd journal replay|timeline|report` (daemon/postmortem/commands.py) -------
# Imported lazily: the postmortem loads numpy, which no other command needs.


def cmd_replay(args: argparse.Namespace) -> int:
    from daemon.postmortem.commands import run_replay

    return run_replay(args)


def cmd_timeline(args: argparse.Namespace) -> int:
    from daemon.postmortem.commands import run_timeline

    return run_timeline(args)


def cmd_report(args: argparse.Namespace) -> int:
    from daemon.postmortem.commands import run_report

    return run_report(args)


POSTMORTEM_HELP = """\
JOURNAL: a node's journal directory, or segment files copied out of one
(grouped by the node their records name). Give every node's journal to merge
the prefill and decode sides of each request; clock offsets between nodes are
estimated from the messages they exchanged.

filters (repeat one to OR its values; different filters AND):
  --request ID     exact id, ID#INCARNATION, or a glob (r00*)
  --since/--until  ISO (2026-11-29T02:10, local time unless a zone is given),
                   a time of day on the journals' day (02:10), relative to
                   the journals' end or start (-15m, +90s), or epoch seconds
  --state STATE    final state or outcome on some node: pending, registered,
                   trimmed, writing, done, failed, released, refused
  --reason REASON  a refusal or failure reason (blocks_owned, daemon_restart, ...)
  --node NODE      requests this node saw

exit codes: 0 done, 1 no request matched (timeline), 2 unreadable input or bad filter
"""


def _add_postmortem_arguments(parser: argparse.ArgumentParser, *, request_required: bool) -> None:
    parser.add_argument("journals", type=Path, nargs="+", metavar="JOURNAL")
    parser.add_argument(
        "--request", action="append", required=request_required, metavar="ID", help="request id"
    )
    parser.add_argument("--since", metavar="TIME", help="requests alive at or after TIME")
    parser.add_argument("--until", metavar="TIME", help="requests alive at or before TIME")
    parser.add_argument("--state", action="append", metavar="STATE", help="final state/outcome")
    parser.add_argument("--reason", action="append", metavar="REASON", help="refusal/failure")
    parser.add_argument("--node", action="append", metavar="NODE", help="seen by this node")
    parser.add_argument(
        "--jobs", type=int, metavar="N", help="processes folding nodes in parallel (default: auto)"
    )


def add_postmortem_parsers(jsub: argparse._SubParsersAction) -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    replay_cmd = jsub.add_parser(
        "replay",
        help="fold and merge nodes' journals; final states, refusals and anomalies",
        epilog=POSTMORTEM_HELP,
        formatter_class=formatter,
    )
    _add_postmortem_arguments(replay_cmd, request_required=False)
    replay_cmd.add_argument("--json", action="store_true", help="everything, as one JSON object")
    replay_cmd.add_argument("--top", type=int, default=10, metavar="N", help="slowest transitions")
    replay_cmd.add_argument(
        "--limit", type=int, default=20, metavar="N", help="rows per anomaly list (0: all)"
    )
    replay_cmd.set_defaults(func=cmd_replay)

    timeline = jsub.add_parser(
        "timeline",
        help="one request's life across nodes, step by step",
        epilog=POSTMORTEM_HELP,
        formatter_class=formatter,
    )
    _add_postmortem_arguments(timeline, request_required=True)
    timeline.add_argument("--json", action="store_true", help="the steps as JSON")
    timeline.set_defaults(func=cmd_timeline)

    report = jsub.add_parser(
        "report",
        help="a self-contained HTML report: timeline chart, latency histograms, anomalies",
        epilog=POSTMORTEM_HELP,
        formatter_class=formatter,
    )
    _add_postmortem_arguments(report, request_required=False)
    report.add_argument(
        "-o", "--output", type=Path, required=True, metavar="FILE", help="the HTML file to write"
    )
    report.add_argument("--top", type=int, default=20, metavar="N", help="slowest transitions")
    report.add_argument(
        "--max-timelines",
        type=int,
        default=200,
        metavar="N",
        help="request timelines written out in full (anomalies first; default 200)",
    )
    report.set_defaults(func=cmd_report)


def cmd_run(args: argparse.Namespace) -> int:
    from daemon.config import ConfigError, load_config
    from daemon.logs import configure

    overrides = {
        "node": args.node,
        "socket": args.socket,
        "listen": args.listen,
        "log_level": args.log_level,
    }
    try:
        config = load_config(args.config, overrides)
    except ConfigError as exc:
        print(f"kvpushd: invalid configuration: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    if args.journal_dir:
        config = msgspec.structs.replace(
            config, journal=msgspec.structs.replace(config.journal, dir=args.journal_dir)
        )
    configure(config.log_level)
    from daemon.service import run

    return run(config)


# --- `kvpushd status` (daemon/ops/status.py) --------------------------------

STATUS_EXIT_CODES = """\
exit codes:
  0  the daemon answered
  2  bad arguments, or the --config file is unusable
  3  no daemon is running (the socket is missing or refuses connections)
  4  the daemon could not be asked (permission denied, timeout, bad reply)
"""


def cmd_status(args: argparse.Namespace) -> int:
    from daemon.ops.status import run as status_run  # keeps `kvpushd run` imports lean

    return status_run(args)


def add_status_parser(sub: argparse._SubParsersAction) -> None:
    status = sub.add_parser(
        "status",
        help="show a running daemon's requests, engines, peers and journal",
        epilog=STATUS_EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    where = status.add_mutually_exclusive_group()
    where.add_argument("--socket", help="the daemon's engine socket")
    where.add_argument("--config", type=Path, help="the daemon's TOML config (names the socket)")
    status.add_argument("--json", action="store_true", help="print the raw status as JSON")
    status.add_argument("--limit", type=int, default=10, metavar="N", help="oldest requests shown")
    status.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for a reply")
    status.set_defaults(func=cmd_status)


# ----------------------------------------------------------------------------


def cmd_demo(args: argparse.Namespace) -> int:
    # Imported here so that other commands never load the simulated engine (numpy).
    from daemon.sim.demo import main as demo_main

    return demo_main(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvpushd",
        description="Push KV-cache blocks from prefill to decode engines with NIXL WRITEs.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = sub.add_parser("run", help="run the daemon")
    run.add_argument("--config", type=Path, help="TOML config file (defaults work without one)")
    run.add_argument("--node", help="override the node name")
    run.add_argument("--socket", help="override the engine socket path")
    run.add_argument("--journal-dir", help="override the journal directory")
    run.add_argument("--listen", help="override the peer listen address (host:port, '' for none)")
    run.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    run.set_defaults(func=cmd_run)
    add_status_parser(sub)

    demo = sub.add_parser(
        "demo", help="run a prefill and a decode daemon on this machine and push real bytes"
    )
    demo.add_argument(
        "--requests", type=int, default=200, metavar="N", help="requests to push (default 200)"
    )
    demo.add_argument(
        "--block-size",
        type=int,
        default=16384,
        metavar="BYTES",
        help="bytes per KV block and layer (default 16384)",
    )
    demo.add_argument(
        "--workdir",
        type=Path,
        metavar="DIR",
        help="folder for configs, logs and journals (default: a new temp dir)",
    )
    demo.add_argument(
        "--keep", action="store_true", help="keep the work folder and its journals afterwards"
    )
    demo.add_argument("--seed", type=int, default=0, help="seed of the request mix (default 0)")
    demo.set_defaults(func=cmd_demo)

    journal = sub.add_parser("journal", help="inspect a journal (directory or segment file)")
    jsub = journal.add_subparsers(dest="journal_command", required=True, metavar="ACTION")

    verify = jsub.add_parser(
        "verify", help="check a journal: exit 0 clean, 1 torn tail only, 2 corrupt"
    )
    verify.add_argument("path", type=Path)
    verify.add_argument(
        "--salvage", action="store_true", help="read past damage and list it instead of stopping"
    )
    verify.set_defaults(func=cmd_verify)

    show = jsub.add_parser("show", help="print events, optionally of one request")
    show.add_argument("path", type=Path)
    show.add_argument("--request", help="only events of this request id")
    show.add_argument("--json", action="store_true", help="one JSON object per line")
    show.set_defaults(func=cmd_show)

    stats = jsub.add_parser("stats", help="counts per state and reason, transition latencies")
    stats.add_argument("path", type=Path)
    stats.add_argument("--json", action="store_true")
    stats.add_argument("--salvage", action="store_true")
    stats.set_defaults(func=cmd_stats)
    add_postmortem_parsers(jsub)
    return parser


# Options whose values may start with "-" (a time relative to the journals'
# end: --since -15m), which argparse would otherwise take for an option.
_DASH_VALUED: Final = ("--since", "--until")


def _attach_dash_values(argv: Sequence[str]) -> list[str]:
    """``--since -15m`` -> ``--since=-15m``, so argparse reads it as a value."""
    out: list[str] = []
    items = iter(argv)
    for arg in items:
        if arg in _DASH_VALUED and (value := next(items, None)) is not None:
            out.append(f"{arg}={value}")
        else:
            out.append(arg)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(_attach_dash_values(argv))
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
