"""The demo's two daemons: started detached, waited on until peered, stopped with SIGTERM.

Also the demo's errors: :class:`DemoError` (it could not run),
:class:`UsageError` (nothing was started) and :class:`Interrupted` (a signal).
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time
from collections.abc import Sequence
from typing import Final

from daemon.client import ClientError, EngineClient
from daemon.sim.launcher import Daemon, Timing

START_TIMEOUT_S: Final = 60.0
STOP_TIMEOUT_S: Final = 20.0


class DemoError(Exception):
    """The demo could not run (a daemon did not start, an engine could not attach)."""


class UsageError(DemoError):
    """The options or the work folder cannot be used; nothing was started."""


class Interrupted(DemoError):
    """A signal asked the demo to stop; the daemons were stopped and the memory freed."""


# Heartbeats every 0.5 s and a 5 s TTL: a busy 2-core machine must not
# make a daemon declare its peer dead in the middle of the demo.
DEMO_TIMING: Final = Timing(heartbeat_s=0.5, peer_ttl_s=5.0, drain_s=5.0)


class DaemonProc(Daemon):
    """A launcher daemon as the demo runs it, and how the demo reports its trouble.

    Built ``detached`` (a session of its own, so that Ctrl-C reaches only the
    demo, which lets the requests in flight finish and then stops the daemons
    in order; the death signal covers a demo that is killed outright).
    """

    @property
    def peer(self) -> str:
        return (self.peers or self.peer_addresses)[0][0]

    def check_alive(self) -> None:
        code = self.exited()
        if code is not None:
            raise DemoError(f"the {self.node} daemon exited with status {code}\n{self.log_tail()}")

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return f"(no log at {self.log_path})"
        return "\n".join(f"  {self.node}| {line}" for line in text)

    def stop_or_kill(self) -> int:
        """SIGTERM, wait for the drain; a daemon that hangs is killed and reported."""
        try:
            return self.stop(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return -signal.SIGKILL


async def wait_ready(daemon: DaemonProc, deadline: float, stop: asyncio.Event) -> None:
    """Poll the daemon's status over its engine socket until it sees its peer up."""
    last = "no answer on the engine socket"
    while time.monotonic() < deadline:
        if stop.is_set():
            raise Interrupted("stopped by a signal while the daemons were starting")
        daemon.check_alive()
        try:
            async with await EngineClient.connect(
                daemon.socket, client_name="kvpushd-demo", timeout=2.0
            ) as client:
                status = await client.status(timeout=2.0)
            if any(p.get("node") == daemon.peer and p.get("up") for p in status["peers"]):
                return
            last = f"answers, but does not see {daemon.peer} up yet"
        except (ClientError, OSError, TimeoutError) as exc:
            last = str(exc)
        await asyncio.sleep(0.1)
    raise DemoError(
        f"the {daemon.node} daemon was not ready within {START_TIMEOUT_S:.0f} s: {last}\n"
        f"{daemon.log_tail()}"
    )


def stop_daemons(daemons: Sequence[DaemonProc]) -> tuple[dict[str, int], list[str]]:
    """Stop every daemon; node -> exit status, and a problem for each that did not exit 0."""
    codes = {d.node: d.stop_or_kill() for d in daemons}
    problems = [
        f"the {d.node} daemon exited {codes[d.node]} after SIGTERM, not 0\n{d.log_tail()}"
        for d in daemons
        if codes[d.node] != 0
    ]
    return codes, problems
