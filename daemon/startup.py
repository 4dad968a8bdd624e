"""Why the daemon cannot start, said in one line an operator can act on.

Every failure before the daemon serves (a secret file, a port, the journal
directory, the engine socket) becomes a :class:`StartupError`; ``kvpushd
run`` prints it as ``kvpushd: cannot start: <what, where, how to fix>`` and
exits :data:`EXIT_STARTUP`, which the systemd unit does not restart on
(``RestartPreventExitStatus=2``): a restart would fail the same way.
"""

from __future__ import annotations

import errno
from typing import Final

EXIT_STARTUP: Final = 2


class StartupError(Exception):
    """The daemon cannot start; the message says what, where and how to fix it."""


def address_problem(what: str, address: str, exc: OSError, fix: str) -> StartupError:
    """A listener that could not bind, phrased for the operator."""
    if exc.errno == errno.EADDRINUSE:
        why = "the port is in use (another kvpushd, or another service)"
    elif exc.errno == errno.EADDRNOTAVAIL:
        why = "no interface of this host has that address"
    elif exc.errno == errno.EACCES:
        why = "permission denied (ports below 1024 need privileges)"
    else:
        why = exc.strerror or str(exc)
    return StartupError(f"{what} {address}: {why}; {fix}")
