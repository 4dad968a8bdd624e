"""``kvpushd run`` with every hand-over inside the package recorded, while a test asks for it.

    python -m harness.hoptrace OUT run --config CONFIG

The command line after OUT is ``kvpushd``'s. Recording starts off: SIGUSR1
turns it on, SIGUSR2 off again (as :mod:`harness.profiled`), so a test
records the request it sends and not the daemon's start-up. The records
are written to OUT (JSON lines) when the daemon exits normally (SIGTERM).

Every function of the package (``daemon``, ``statemachine``, ``schemas``)
entered is recorded, as one of:

- ``call``: a fresh call from another module of the package (a hand-over);
- ``resume``: entered from outside the package: the event loop starting or
  resuming a task, a thread's target, a callback (a hand-over; a coroutine
  resumed inside an await chain of the package is the same hand-over, not
  a new one, and is not recorded);
- ``local``: a fresh call from its own module (no hand-over: recorded so
  that a test sees every function that ran).

Every thread started after the daemon's modules are imported is hooked
(``threading.setprofile``): the NIXL worker's and the group commit's too.

A test tool (tests/test_hop_trace.py), not part of the daemon: the daemon
knows nothing of it and the unit never starts it.
"""

from __future__ import annotations

import dis
import json
import signal
import sys
import threading
import time
from types import CodeType, FrameType
from typing import Any, Final

PACKAGE: Final = ("daemon.", "statemachine.", "schemas.")

_recording = False
_records: list[tuple[int, str, str, str, str, str]] = []
_first_offsets: dict[CodeType, int] = {}


def _first_offset(code: CodeType) -> int:
    """Where a frame of ``code`` stands when it is first entered (after a coroutine's preamble)."""
    offset = _first_offsets.get(code)
    if offset is None:
        offset = next((i.offset for i in dis.get_instructions(code) if i.opname == "RESUME"), 0)
        _first_offsets[code] = offset
    return offset


def _hook(frame: FrameType, event: str, arg: Any) -> None:
    if not _recording or event != "call":
        return
    callee = frame.f_globals.get("__name__", "")
    if not callee.startswith(PACKAGE):
        return
    back = frame.f_back
    caller = back.f_globals.get("__name__", "") if back is not None else ""
    kind = "resume"
    if caller.startswith(PACKAGE):
        if frame.f_lasti > _first_offset(frame.f_code):
            return  # resumed inside an await chain of the package
        kind = "local" if caller == callee else "call"
    _records.append((
        time.monotonic_ns(),
        threading.current_thread().name,
        kind,
        caller,
        callee,
        frame.f_code.co_qualname,
    ))  # fmt: skip


def _record(on: bool) -> None:
    global _recording
    _recording = on


def main() -> int:
    if len(sys.argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    out, argv = sys.argv[1], sys.argv[2:]
    signal.signal(signal.SIGUSR1, lambda *_: _record(True))
    signal.signal(signal.SIGUSR2, lambda *_: _record(False))
    from daemon import cli

    threading.setprofile(_hook)
    sys.setprofile(_hook)
    try:
        return cli.main(argv)
    finally:
        sys.setprofile(None)
        _record(False)
        with open(out, "w") as f:
            for record in _records:
                f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    sys.exit(main())
