"""``kvpushd run`` under cProfile, collecting only while a bench asks for it.

    python -m harness.profiled [--wall] OUT run --config CONFIG

The command line after OUT is ``kvpushd``'s. Profiling starts off: SIGUSR1
turns it on, SIGUSR2 off again, so a bench profiles the requests it sends
and not the daemon's start-up (imports, NIXL, replay) or its drain. The
profile is written to OUT (pstats format) when the daemon exits normally
(SIGTERM); a killed daemon writes none.

Only the main thread, the one running the event loop, is profiled
(cProfile hooks one thread), by its CPU clock (``time.thread_time``;
``--wall``: the wall clock): the
NIXL worker and the group commit's fsync thread are not; their CPU shows in
:func:`daemon.sim.launcher.thread_cpu`.

A bench tool (``Daemon.profile_to`` in the launcher; bench/profile_lifecycle.py),
not part of the daemon: the daemon itself knows nothing of it and the unit
never starts it.
"""

from __future__ import annotations

import cProfile
import signal
import sys
import time


def main() -> int:
    if len(sys.argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    out, argv = sys.argv[1], sys.argv[2:]
    # By default the thread's CPU clock, not the wall clock: time spent
    # waiting (for the GIL, say, while the NIXL worker runs) is no CPU of the
    # loop's. ``--wall`` first: the wall clock, cheaper per call, waits included.
    timer = time.thread_time
    if out == "--wall":
        out, argv, timer = argv[0], argv[1:], time.perf_counter
    profile = cProfile.Profile(timer)
    # Python-level handlers: they run on the main thread, between bytecodes,
    # which is the thread cProfile.enable hooks.
    signal.signal(signal.SIGUSR1, lambda *_: profile.enable())
    signal.signal(signal.SIGUSR2, lambda *_: profile.disable())
    from daemon import cli

    try:
        return cli.main(argv)
    finally:
        profile.disable()
        profile.dump_stats(out)


if __name__ == "__main__":
    sys.exit(main())
