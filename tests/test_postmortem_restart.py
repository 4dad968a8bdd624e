"""``kvpushd journal replay`` names a restart and exactly what it failed.

Real daemons, real NIXL, no journal surgery: a prefill and a decode daemon
are driven into a known state, the prefill daemon is killed with SIGKILL in
that state, started again, and the postmortem over both journals must report
the restart with the requests that were live in the dead process, each with
the state it was caught in, and nothing else.

The state is made deterministic by waiting, not by timing:

* ``done-1`` is pushed and released on both sides (gone before the kill);
* ``done-2`` is pushed but never released (``done``: a restart keeps it);
* ``trimmed-1`` is registered on both sides, never kv_ready (``trimmed``);
* ``registered-1`` is registered on the prefill side only (``registered``);
* ``pending-1`` is registered on the decode side only, so the prefill
  daemon holds its forwarded registration (``pending``);

and the prefill daemon's status must show exactly those states with nothing
left to make durable (journal lag 0). Then ``writing-1`` is pushed with the
``nixl.post`` failpoint armed to ``stop`` on the third write: the daemon
freezes after its ``writing`` record is durable and before the NIXL write is
posted. It is killed while frozen, so every record before the kill is on
disk and none after it exists.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from daemon import failpoints
from daemon.journal.replay import iter_records
from daemon.postmortem.analyse import analyse
from daemon.postmortem.filters import FilterSpec, resolve_filters
from daemon.postmortem.load import load
from daemon.postmortem.merge import merge
from daemon.postmortem.timeline import timeline
from daemon.sim.engine import SimEngine, SimGroup
from daemon.sim.launcher import Daemon, daemon_pair
from schemas import rpc
from schemas.events import DaemonStarted, Failed
from schemas.layout import Role
from schemas.reasons import Reason
from tests.support import REPO

LAYOUT = [SimGroup(num_blocks=64, block_bytes=1024, layers=2)]
# Nothing may expire while the test runs: every state stays until the kill.
LONG = "[deadlines]\n" + "\n".join(
    f"{state} = 600.0" for state in ("registered", "trimmed", "writing", "done", "failed")
)
CAUGHT = {
    "trimmed-1": "trimmed",
    "registered-1": "registered",
    "pending-1": "pending",
    "writing-1": "writing",
}
UTC = {**os.environ, "TZ": "UTC"}


def _src(n: int) -> list[list[int]]:
    return [list(range(4 * n, 4 * n + 4))]


def _dst(n: int) -> list[list[int]]:
    return [list(range(4 * n, 4 * n + 2))]


async def _push(pe: SimEngine, de: SimEngine, rid: str, n: int) -> None:
    await de.decode_register(rid, _dst(n), "prefill")
    await pe.prefill(rid, _src(n), peer="decode")
    freed = await pe.wait_event(rid, (rpc.BlocksFreeable, rpc.RequestFailed), timeout=20)
    arrived = await de.wait_event(rid, (rpc.KvArrived, rpc.RequestFailed), timeout=20)
    assert isinstance(freed, rpc.BlocksFreeable), freed
    assert isinstance(arrived, rpc.KvArrived), arrived


async def _settled(pe: SimEngine, want: dict[str, str], pending: int, timeout: float = 15.0):
    """Poll the prefill daemon until its live requests are ``want`` and all is durable."""
    deadline = time.monotonic() + timeout
    while True:
        status = await pe.status()
        states = {r["request_id"]: r["state"] for r in status["requests"]}
        if (
            states == want
            and status["pending_peer_registrations"] == pending
            and status["journal"]["lag"] == 0
        ):
            return status
        if time.monotonic() > deadline:
            raise TimeoutError(f"prefill never settled: {states}, {status['journal']}")
        await asyncio.sleep(0.05)


@pytest.fixture
def restarted(tmp_path: Path):
    """Both journals after the prefill daemon was killed in a known state and restarted."""
    prefill, decode = daemon_pair(tmp_path, extra=LONG)
    # The third NIXL write (done-1, done-2, then writing-1) is held for a
    # while on the worker thread, long after its write_started is durable.
    prefill.env = {failpoints.ENV: "nixl.post=sleep:10@3"}
    decode.env = {failpoints.ENV: ""}
    try:
        prefill.start()
        decode.start()
        decode.wait_peer("prefill")
        prefill.wait_peer("decode")
        asyncio.run(_drive(prefill, decode))
        first_pid = prefill.proc.pid  # type: ignore[union-attr]
        prefill.env = {failpoints.ENV: ""}
        prefill.start()
        boot = prefill.status()
        assert prefill.stop() == 0, prefill.logs()
        assert decode.stop() == 0, decode.logs()
    finally:
        prefill.kill()
        decode.kill()
    return {"prefill": prefill.journal, "decode": decode.journal, "boot": boot, "pid0": first_pid}


async def _drive(prefill: Daemon, decode: Daemon) -> None:
    pe = await SimEngine.create("rp", Role.PUSHER, LAYOUT, prefill.socket)
    de = await SimEngine.create("rd", Role.RECEIVER, LAYOUT, decode.socket)
    try:
        await _push(pe, de, "done-1", 0)
        await pe.release("done-1")
        await de.release("done-1")
        await _push(pe, de, "done-2", 1)
        await de.decode_register("trimmed-1", _dst(2), "prefill")
        await pe.prefill("trimmed-1", _src(2), peer="decode", kv_ready=False)
        await pe.prefill("registered-1", _src(3), peer="decode", kv_ready=False)
        await de.decode_register("pending-1", _dst(4), "prefill")
        await _settled(
            pe, {"done-2": "done", "trimmed-1": "trimmed", "registered-1": "registered"}, 1
        )
        await de.decode_register("writing-1", _dst(5), "prefill")
        # kv_ready's reply comes once kv_ready/trimmed/write_started are
        # durable; the write is still held (posting overlaps that fdatasync,
        # so only then is "writing" sure to be in the journal).
        await pe.prefill("writing-1", _src(5), peer="decode")
        prefill.kill()
    finally:
        await pe.close()
        await de.close()


def test_restart_reports_what_it_failed(restarted):
    boot = restarted["boot"]
    # The journal itself: right after the second DaemonStarted, one
    # daemon_restart failure per request caught live, and nothing else.
    _, records = iter_records(restarted["prefill"])
    records = list(records)
    starts = [i for i, r in enumerate(records) if isinstance(r.event, DaemonStarted)]
    assert len(starts) == 2
    second = records[starts[1]]
    assert (second.event.pid, second.event.boot_id) == (boot["pid"], boot["boot_id"])
    after = records[starts[1] + 1 : starts[1] + 1 + len(CAUGHT)]
    assert all(
        isinstance(r.event, Failed) and r.event.reason is Reason.DAEMON_RESTART for r in after
    )
    assert {r.event.request_id for r in after} == set(CAUGHT)

    # The analysis: one restart, with exactly those requests and their states.
    merged = merge(load([restarted["prefill"], restarted["decode"]]))
    analysis = analyse(merged, resolve_filters(FilterSpec(), merged))
    firsts = [r for r in analysis.restarts if not r.restart]
    assert sorted(r.node for r in firsts) == ["decode", "prefill"]
    (restart,) = [r for r in analysis.restarts if r.restart]
    assert (restart.node, restart.seq, restart.pid, restart.boot_id) == (
        "prefill", second.seq, boot["pid"], boot["boot_id"]
    )  # fmt: skip
    assert restart.pid != restarted["pid0"]
    assert dict((key, state) for key, state in restart.failed) == {
        (rid, 1): state for rid, state in CAUGHT.items()
    }
    for rid in CAUGHT:  # each failed request's timeline shows the restart, then the failure
        steps = timeline(merged, merged.keys.index((rid, 1))).steps
        events = [(s.node, s.event) for s in steps]
        at = events.index(("prefill", "daemon_started"))
        assert events[at + 1] == ("prefill", "failed")
        assert "daemon_restart" in steps[at + 1].detail

    # The command an operator runs: text and JSON say the same.
    paths = [str(restarted["prefill"]), str(restarted["decode"])]
    cli = [sys.executable, "-m", "daemon.cli", "journal", "replay", *paths]
    text = subprocess.run(cli, cwd=REPO, capture_output=True, text=True, timeout=60, env=UTC)
    assert text.returncode == 0, text.stderr
    section = text.stdout.split("\nrestarts\n", 1)[1].split("\n\n", 1)[0]
    assert boot["boot_id"] in section
    assert all(f"{rid}#1 ({state})" in section for rid, state in CAUGHT.items())
    assert "done-1" not in section and "done-2" not in section
    done = subprocess.run(
        [*cli, "--json"], cwd=REPO, capture_output=True, text=True, timeout=60, env=UTC
    )
    assert done.returncode == 0, done.stderr
    (listed,) = [r for r in json.loads(done.stdout)["restarts"] if r["restart"]]
    assert listed["boot_id"] == boot["boot_id"] and listed["pid"] == boot["pid"]
    assert {tuple(f[0]): f[1] for f in listed["failed"]} == {
        (rid, 1): state for rid, state in CAUGHT.items()
    }
