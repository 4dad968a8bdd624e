"""What native code prints, as the daemon's JSON log lines.

UCX logs to stdout, NIXL's Python logger to stdout and its C++ core to
stderr, each in its own plain-text format, and none of them knows the node.
journald must get one JSON object per line, so :func:`capture` points the
process's descriptors 1 and 2 at a pipe read by a small child process
(``python -m daemon.nativelog``) that turns each line into a JSON line with
the node, a level parsed from the line, and the source. Python's own
``sys.stderr`` (structlog, the CLI's messages) keeps the original stderr.

A child and not a thread: a thread needs the GIL to drain the pipe, and a
native call that holds the GIL while it fills the pipe would wait on it
forever; a child also still drains what the daemon wrote right before a
crash (a fatal error's last words), since it reads until every writer is gone.
It ignores SIGINT and SIGTERM (systemd signals the whole unit) and ends at
end of file, when the daemon has exited.

Lines below the daemon's log level are dropped: UCX's DEBUG lines under
``UCX_LOG_LEVEL=debug`` are silenced unless the daemon runs at debug too.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any, Final, TextIO

LEVELS: Final = ("debug", "info", "warning", "error", "critical")

# [1796149555.405500] [host:18515:0]   cpu.c:353  UCX  DEBUG measured tsc ...
_UCX: Final = re.compile(r"^\[[\d.]+\]\s+\[[^\]]*\]\s+(\S+)\s+UCX\s+(\w+)\s+(.*)$")
# 2026-12-01 18:25:03 NIXL INFO    _api.py:405 Backend UCX was instantiated
_NIXL_PY: Final = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d NIXL (\w+)\s+(\S+) (.*)$")
# I1201 18:25:50.900361   18481 nixl_log.cpp:80] NIXL version: 1.5.1
_ABSL: Final = re.compile(r"^([IWEF])\d{4} \d\d:\d\d:\d\d\.\d+\s+\d+ ([^\]\s]+)\] ?(.*)$")

_UCX_LEVELS: Final = {
    "FATAL": "critical",
    "ERROR": "error",
    "WARN": "warning",
    "DIAG": "info",
    "INFO": "info",
    "PRINT": "info",
}
_PY_LEVELS: Final = {
    "CRITICAL": "critical",
    "ERROR": "error",
    "WARNING": "warning",
    "INFO": "info",
}
_ABSL_LEVELS: Final = {"F": "critical", "E": "error", "W": "warning", "I": "info"}


# The libraries whose lines this module names. Their errors (a transfer to
# a peer that just died) are reports the daemon acts on, not the daemon's own.
LIBRARY_LOGGERS: Final = ("nixl", "ucx")


def from_library(line: str) -> bool:
    """Whether a rendered log line is NIXL's or UCX's, wrapped here."""
    return any(f'"logger": "{name}"' in line for name in LIBRARY_LOGGERS)


def parse(line: str) -> dict[str, Any]:
    """One line of native output as log fields: logger, level, source, event."""
    if m := _UCX.match(line):
        return _fields("ucx", _UCX_LEVELS.get(m[2], "debug"), m[1], m[3])
    if m := _NIXL_PY.match(line):
        return _fields("nixl", _PY_LEVELS.get(m[1], "debug"), m[2], m[3])
    if m := _ABSL.match(line):
        return _fields("nixl", _ABSL_LEVELS[m[1]], m[2], m[3])
    # Unknown text on stdout or stderr (a stray print, a crash message):
    # nobody meant it as routine, so it is not hidden below info.
    return _fields("native", "warning", "", line)


def _fields(logger: str, level: str, source: str, event: str) -> dict[str, Any]:
    fields: dict[str, Any] = {"logger": logger}
    if source:
        fields["source"] = source
    fields |= {"event": event.rstrip(), "level": level}
    return fields


def wrap(lines: Iterable[str], node: str, level: str, out: TextIO) -> None:
    """Write each line as a JSON line of ``node``, dropping those below ``level``."""
    floor = LEVELS.index(level)
    for raw in lines:
        line = raw.rstrip("\n")
        if not line.strip():
            continue
        fields = _passthrough(line) or parse(line)
        if LEVELS.index(fields.get("level", "warning")) < floor:
            continue
        stamp = datetime.fromtimestamp(time.time(), UTC).isoformat().replace("+00:00", "Z")
        fields = {"node": node, **fields}
        fields.setdefault("timestamp", stamp)
        out.write(json.dumps(fields) + "\n")
        out.flush()


def _passthrough(line: str) -> dict[str, Any] | None:
    """A line that is already a JSON object (the daemon's own, written to fd 2)."""
    if not line.startswith("{"):
        return None
    try:
        fields = json.loads(line)
    except ValueError:
        return None
    if not isinstance(fields, dict):
        return None
    if fields.get("level") not in LEVELS:
        fields["level"] = "warning"
    return fields


def capture(node: str, level: str) -> TextIO:
    """Route descriptors 1 and 2 through the wrapping child; returns the real stderr.

    The caller writes its own (already JSON) lines to the returned stream.
    """
    real_fd = os.dup(2)
    os.set_inheritable(real_fd, False)
    read_fd, write_fd = os.pipe()
    subprocess.Popen(
        [sys.executable, "-m", "daemon.nativelog", "--node", node, "--level", level],
        stdin=read_fd,
        stdout=real_fd,
        stderr=real_fd,
        close_fds=True,
    )
    os.close(read_fd)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(write_fd, 1)
    os.dup2(write_fd, 2)
    os.close(write_fd)
    real = open(real_fd, "w", buffering=1, encoding="utf-8", errors="backslashreplace")  # noqa: SIM115
    sys.stderr = real
    return real


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m daemon.nativelog")
    parser.add_argument("--node", required=True)
    parser.add_argument("--level", choices=LEVELS, default="info")
    args = parser.parse_args(argv)
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
    stdin = open(0, encoding="utf-8", errors="replace", closefd=False)  # noqa: SIM115
    wrap(stdin, args.node, args.level, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
