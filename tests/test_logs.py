"""What journald gets from a daemon: JSON lines only, each naming the node, one per event.

The daemons run as real processes with their stdout and stderr on pipes (as
under systemd), through start, a pushed request, and shutdown; NIXL's and
UCX's own loggers are turned up so that native output is sure to appear.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from daemon.nativelog import wrap
from daemon.sim.engine import SimEngine, SimGroup
from daemon.sim.launcher import Daemon, daemon_pair
from schemas import rpc
from schemas.layout import Role
from tests.support import REPO

LAYOUT = [SimGroup(num_blocks=16, block_bytes=4096, layers=2)]

# Native loggers at their loudest that still prints on a plain start:
# UCX's DEBUG lines on stdout, NIXL's C++ INFO lines on stderr.
NATIVE_ENV = {"UCX_LOG_LEVEL": "debug", "NIXL_LOG_LEVEL": "INFO"}


class Captured:
    """A daemon process with stdout and stderr each read into a list of lines."""

    def __init__(self, daemon: Daemon, level: str) -> None:
        log_level = ("--log-level", level)
        config = daemon.write_config()
        self.daemon = daemon
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "daemon.cli", "run", "--config", str(config), *log_level],
            cwd=REPO,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={**os.environ, **NATIVE_ENV},
        )
        daemon.proc = self.proc
        self.out: dict[str, list[str]] = {"stdout": [], "stderr": []}
        self._readers = [
            threading.Thread(target=self._read, args=(name, pipe), daemon=True)
            for name, pipe in (("stdout", self.proc.stdout), ("stderr", self.proc.stderr))
        ]
        for reader in self._readers:
            reader.start()

    def _read(self, name: str, pipe: io.BufferedReader | None) -> None:
        assert pipe is not None
        for line in pipe:
            self.out[name].append(line.decode(errors="replace"))

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(30)
        # Until every writer is gone: the daemon and the child that wraps
        # its native output (it drains the pipe after the daemon exits).
        for reader in self._readers:
            reader.join(30)
            assert not reader.is_alive()
        return code

    def lines(self) -> list[str]:
        return self.out["stdout"] + self.out["stderr"]


@pytest.fixture
def captured(tmp_path: Path) -> Iterator[tuple[Captured, Captured]]:
    prefill, decode = daemon_pair(tmp_path)
    started: list[Captured] = []
    try:
        # The prefill daemon at info: UCX's DEBUG lines must be dropped; the
        # decode daemon at debug: they must come through as JSON.
        started.append(Captured(prefill, "info"))
        started.append(Captured(decode, "debug"))
        for c in started:
            c.daemon.wait_ready()
        decode.wait_peer("prefill")
        prefill.wait_peer("decode")
        yield started[0], started[1]
    finally:
        for c in started:
            c.daemon.kill()


async def _one_request(prefill: Daemon, decode: Daemon) -> None:
    pe = await SimEngine.create("log-p", Role.PUSHER, LAYOUT, prefill.socket)
    de = await SimEngine.create("log-d", Role.RECEIVER, LAYOUT, decode.socket)
    try:
        await de.decode_register("r1", [[3, 4]], "prefill")
        await pe.prefill("r1", [[1, 2]])
        assert isinstance(
            await de.wait_event("r1", (rpc.KvArrived, rpc.RequestFailed)), rpc.KvArrived
        )
        await pe.wait_event("r1", rpc.BlocksFreeable)
        await de.release("r1")
        await pe.release("r1")
    finally:
        await pe.close()
        await de.close()


def test_journald_gets_json_lines_naming_the_node_one_per_event(captured):
    prefill, decode = captured
    asyncio.run(_one_request(prefill.daemon, decode.daemon))
    assert prefill.stop() == 0
    assert decode.stop() == 0
    for c in (prefill, decode):
        node = c.daemon.node
        parsed = []
        for line in c.lines():
            fields = json.loads(line)  # every line, stdout and stderr alike
            assert isinstance(fields, dict), line
            assert fields.get("node") == node, line
            parsed.append(fields)
        events = [f["event"] for f in parsed]
        for said in ("ready", "draining", "stopped"):
            assert events.count(said) == 1, (node, said)
        # NIXL's own lines are captured, named as NIXL's.
        assert any(f.get("logger") == "nixl" for f in parsed), node
        # One line per event: the link's peer_up, not a second "peer up".
        assert events.count("peer_up") == 1, node
        assert "peer up" not in events and "peer down" not in events
    decode_ucx = [line for line in decode.lines() if '"logger": "ucx"' in line]
    assert any('"level": "debug"' in line for line in decode_ucx)
    # Below the prefill daemon's level: silenced.
    assert not [line for line in prefill.lines() if '"level": "debug"' in line]


def test_native_lines_are_parsed_for_level_and_source():
    lines = [
        "[1796149555.405500] [vm:18515:0]   cpu.c:353  UCX  DEBUG measured tsc frequency\n",
        "[1796149555.405500] [vm:18515:0]   ib_iface.c:9  UCX  ERROR no device\n",
        "2026-12-01 18:25:03 NIXL INFO    _api.py:405 Backend UCX was instantiated\n",
        "W1201 18:25:50.900361   18481 nixl_agent.cpp:80] no plugin dir\n",
        "something else entirely\n",
        '{"event": "failpoint", "level": "critical"}\n',
        "\n",
    ]
    out = io.StringIO()
    wrap(lines, "n1", "info", out)
    got = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [(g.get("logger", "-"), g["level"]) for g in got] == [
        ("ucx", "error"),
        ("nixl", "info"),
        ("nixl", "warning"),
        ("native", "warning"),
        ("-", "critical"),
    ]
    assert all(g["node"] == "n1" and g["timestamp"] for g in got)
    assert got[0]["source"] == "ib_iface.c:9" and got[0]["event"] == "no device"
    assert got[1]["event"] == "Backend UCX was instantiated"
