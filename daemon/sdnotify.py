"""The systemd notify protocol, spoken directly (no libsystemd).

``READY=1``, ``STATUS=...``, ``STOPPING=1`` and ``WATCHDOG=1`` are datagrams
sent to the socket named by ``NOTIFY_SOCKET``; an address starting with ``@``
is in the abstract namespace. Outside systemd every call is a no-op.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Mapping


class Notifier:
    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        address = env.get("NOTIFY_SOCKET", "")
        self._address = "\0" + address[1:] if address.startswith("@") else address
        self._sock: socket.socket | None = None
        if self._address:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        usec = env.get("WATCHDOG_USEC", "")
        pid = env.get("WATCHDOG_PID", "")
        watched = usec.isdigit() and (not pid or pid == str(os.getpid()))
        # systemd's advice: ping at half the watchdog timeout.
        self.watchdog_interval_s: float | None = int(usec) / 2e6 if watched else None

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def notify(self, *assignments: str) -> None:
        if self._sock is None:
            return
        # The manager may have gone away (e.g. daemon-reexec): nothing to tell.
        with contextlib.suppress(OSError):
            self._sock.sendto("\n".join(assignments).encode(), self._address)

    def ready(self, status: str) -> None:
        self.notify("READY=1", f"STATUS={status}", f"MAINPID={os.getpid()}")

    def status(self, status: str) -> None:
        self.notify(f"STATUS={status}")

    def watchdog(self) -> None:
        self.notify("WATCHDOG=1")

    def stopping(self, status: str = "draining") -> None:
        self.notify("STOPPING=1", f"STATUS={status}")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
