"""The ``kvpushd`` command line: the argument parser, and dispatch to each command.

The commands live with what they work on: ``run`` in :mod:`daemon.service`,
``status`` in :mod:`daemon.ops.status`, ``journal verify|show|stats`` in
:mod:`daemon.ops.journal`, ``journal replay|timeline|report`` in
:mod:`daemon.postmortem.commands`, ``demo`` in :mod:`daemon.sim.demo`.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import msgspec

from daemon.ops import journal as ops_journal
from daemon.postmortem import commands as postmortem_commands

EXIT_CONFIG = 2  # `run`: the configuration is unusable (daemon.startup.EXIT_STARTUP)


RUN_DEFAULTS = """\
without --config (or with keys left out), the defaults start on a laptop:
  node      kvpushd
  socket    $RUNTIME_DIRECTORY/NODE.sock, else /tmp/kvpushd-UID/NODE.sock
  journal   $STATE_DIRECTORY/NODE, else ~/.local/state/kvpushd/NODE
  peers     none; no peer listener until secret_file is set (then listen
            defaults to 127.0.0.1:7700), and one log line says so
  engines   the daemon's uid, root, and members of the daemon's own group
  metrics   off (metrics_port = 0)
every key: systemd/kvpushd.toml and README.md ("Configuration").

A daemon that cannot start (an unusable config or secret file, a port in
use, a journal or engine socket another daemon holds) prints one line,
"kvpushd: cannot start: ...", and exits 2; systemd does not restart it.
"""


def cmd_run(args: argparse.Namespace) -> int:
    from daemon.config import ConfigError, load_config
    from daemon.logs import configure
    from daemon.startup import EXIT_STARTUP, StartupError

    overrides = {
        "node": args.node,
        "socket": args.socket,
        "listen": args.listen,
        "log_level": args.log_level,
    }
    try:
        config = load_config(args.config, overrides)
    except ConfigError as exc:
        where = f" in {args.config}" if args.config else ""
        print(f"kvpushd: cannot start: invalid configuration{where}: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    if args.journal_dir:
        config = msgspec.structs.replace(
            config, journal=msgspec.structs.replace(config.journal, dir=args.journal_dir)
        )
    configure(config.log_level, node=config.node, capture_native=True)
    from daemon.service import run

    try:
        return run(config)
    except StartupError as exc:
        print(f"kvpushd: cannot start: {exc}", file=sys.stderr)
        return EXIT_STARTUP


RUN_EXIT_CODES = """\
exit codes:
  0  stopped on SIGTERM or SIGINT, in-flight writes drained, the journal durable
  2  cannot start: the configuration or what it names is unusable (one line says why)
  3  a journal write or fdatasync failed; the next start replays to the last durable record
"""


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


def add_status_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    status = sub.add_parser(
        "status",
        help="show a running daemon's requests, engines, peers and journal",
        epilog=STATUS_EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_daemon_socket(status)
    status.add_argument("--json", action="store_true", help="print the raw status as JSON")
    status.add_argument("--limit", type=int, default=10, metavar="N", help="oldest requests shown")
    status.set_defaults(func=cmd_status)


def _add_daemon_socket(command: argparse.ArgumentParser) -> None:
    """Where a command that asks a running daemon finds it, and how long it waits."""
    where = command.add_mutually_exclusive_group()
    where.add_argument("--socket", help="the daemon's engine socket")
    where.add_argument("--config", type=Path, help="the daemon's TOML config (names the socket)")
    command.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for a reply")


# --- `kvpushd quarantine` (daemon/ops/quarantine.py) ------------------------


def cmd_quarantine(args: argparse.Namespace) -> int:
    from daemon.ops.quarantine import run as quarantine_run  # keeps `kvpushd run` imports lean

    return quarantine_run(args)


def add_quarantine_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    quarantine = sub.add_parser(
        "quarantine",
        help="list or clear the engine pairings a running daemon quarantined (kv_mismatch)",
        epilog=STATUS_EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    qsub = quarantine.add_subparsers(dest="quarantine_command", required=True, metavar="ACTION")
    listing = qsub.add_parser(
        "list", help="the quarantined pairings, with the mismatch that began each"
    )
    clear = qsub.add_parser("clear", help="end quarantines (journaled: a restart keeps the clear)")
    clear.add_argument("ids", nargs="*", help="the ids `kvpushd quarantine list` shows")
    clear.add_argument("--all", action="store_true", help="clear every quarantined pairing")
    for action in (listing, clear):
        _add_daemon_socket(action)
        action.add_argument("--json", action="store_true", help="print the reply as JSON")
        action.set_defaults(func=cmd_quarantine)


def cmd_demo(args: argparse.Namespace) -> int:
    # Imported here so that other commands never load the simulated engine (numpy).
    from daemon.sim.demo import main as demo_main

    return demo_main(args)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvpushd")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvpushd",
        description="Push KV-cache blocks from prefill to decode engines with NIXL WRITEs.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = sub.add_parser(
        "run",
        help="run the daemon",
        epilog=RUN_DEFAULTS + "\n" + RUN_EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run.add_argument("--config", type=Path, help="TOML config file (defaults work without one)")
    run.add_argument("--node", help="override the node name")
    run.add_argument("--socket", help="override the engine socket path")
    run.add_argument("--journal-dir", help="override the journal directory")
    run.add_argument("--listen", help="override the peer listen address (host:port, '' for none)")
    run.add_argument(
        "--log-level",
        choices=["debug", "info", "warning", "error"],
        help="override log_level (debug logs every transition)",
    )
    run.set_defaults(func=cmd_run)
    add_status_parser(sub)
    add_quarantine_parser(sub)

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
    demo.add_argument(
        "--hosts",
        action="store_true",
        help="run each daemon on a host of its own: a network namespace with its own address, "
        "UCX over TCP between them (root)",
    )
    demo.set_defaults(func=cmd_demo)

    journal = sub.add_parser("journal", help="inspect a journal (directory or segment file)")
    jsub = journal.add_subparsers(dest="journal_command", required=True, metavar="ACTION")
    ops_journal.add_parsers(jsub)
    postmortem_commands.add_parsers(jsub)
    return parser


def _attach_dash_values(argv: Sequence[str]) -> list[str]:
    """``--since -15m`` -> ``--since=-15m``, so argparse reads it as a value."""
    out: list[str] = []
    items = iter(argv)
    for arg in items:
        if arg in postmortem_commands.DASH_VALUED and (value := next(items, None)) is not None:
            out.append(f"{arg}={value}")
        else:
            out.append(arg)
    return out


def _stdout_gone(code: int | None) -> int:
    """The reader of stdout went away (``| head``): end quietly, as other CLI tools do.

    stdout is pointed at /dev/null so that the interpreter's last flush at
    exit does not fail again and print a traceback.
    """
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 0 if code is None else code


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    code: int | None = None
    try:
        try:
            args = build_parser().parse_args(_attach_dash_values(argv))
            command: Callable[[argparse.Namespace], int] = args.func  # set_defaults(func=...)
            code = command(args)
        finally:
            # Inside the try, also on argparse's SystemExit (--help prints to stdout).
            sys.stdout.flush()
    except BrokenPipeError:
        # A command that finished keeps its verdict (verify's exit code is its answer).
        return _stdout_gone(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
