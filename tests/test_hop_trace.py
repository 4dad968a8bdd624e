"""ARCHITECTURE.md's hop table, traced: one request through two real daemons, every hand-over seen.

Both daemons run under harness/hoptrace.py, which records each call into
a module of the package from another module, and each entry from outside
it (the event loop starting or resuming a task, a thread, a callback). One
request, checked for integrity so that every row of the table applies,
goes from the decode engine's registration to both releases with
recording on. Then, hop by hop, every module and function a row of the
table ("One request, both legs, hop by hop") names must have run on that
row's node while the request was in flight; no code of the runtime
(daemon/node/runtime.py) may have run at all; and every module of the
shell (daemon/) that the request entered must be named by some row: the
table is what the code does, not a drawing of it.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import pytest

from daemon.sim.engine import SimGroup
from daemon.sim.launcher import Daemon, free_port, new_secret, start_daemons
from tests.support import REPO
from tests.support.fixtures import stop_cleanly
from tests.support.pushes import engine_pair, push

TABLE_HEADER: Final = "| # | node | hop | modules |"
LAYOUT: Final = [SimGroup(num_blocks=64, block_bytes=4096, layers=2)]
# Entered on a request's path but no hand-over of it: a failpoint is a check
# that does nothing unless a test arms it.
NOT_HOPS: Final = frozenset({"daemon.failpoints"})
# Where the node's own periodic work starts, whatever the requests: the
# service's status line and watchdog (every few seconds; one may fall inside
# the traced request).
BACKGROUND: Final = frozenset({"daemon.service"})


@dataclass(frozen=True)
class Call:
    """One hand-over a daemon recorded (harness/hoptrace.py)."""

    ns: int
    thread: str
    # "call" from another module of the package, "resume" from outside it (both
    # hand-overs), "local" from its own module (none)
    kind: str
    caller: str
    callee: str
    qualname: str


@dataclass(frozen=True)
class Named:
    """What one item of a row's modules cell names: a module, a function, or both."""

    module: str | None  # dotted
    function: str | None

    def ran_in(self, calls: list[Call]) -> bool:
        return any(self._is(call) for call in calls)

    def _is(self, call: Call) -> bool:
        if self.module is not None and call.callee != self.module:
            return False
        if self.function is None:
            return True
        name, qualname = self.function, call.qualname
        return (
            qualname == name
            or qualname.endswith("." + name)
            or qualname.startswith(name + ".")
            or f".{name}." in qualname
        )


@dataclass(frozen=True)
class Hop:
    number: int
    nodes: tuple[str, ...]  # "P", "D": where its names run ("P -> D": either)
    names: tuple[Named, ...]


def _dotted(path: str) -> str:
    return path.removesuffix(".py").replace("/", ".")


def parse_cell(cell: str) -> tuple[Named, ...]:
    """Each comma-separated item: a module path, a function in it after it, or a function alone."""
    names = []
    for item in cell.split(","):
        tokens = re.findall(r"`([^`]+)`", item)
        paths = [t for t in tokens if t.endswith(".py")]
        functions = [t for t in tokens if not t.endswith(".py")]
        module = _dotted(paths[0]) if paths else None
        if module is not None and not functions:
            names.append(Named(module, None))
        names.extend(Named(module, f) for f in functions)
    return tuple(names)


def parse_table(text: str) -> list[Hop]:
    lines = text.splitlines()
    start = lines.index(TABLE_HEADER) + 2  # the header, then its rule
    hops = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        number, node, _, modules = (cell.strip() for cell in line.strip("|").split("|"))
        hops.append(Hop(int(number), tuple(re.findall(r"[PD]", node)), parse_cell(modules)))
    return hops


def unseen(hops: list[Hop], calls: dict[str, list[Call]]) -> list[str]:
    """Every name of a row that did not run on that row's nodes."""
    return [
        f"hop {hop.number}: {name.module or ''} {name.function or ''}".rstrip()
        for hop in hops
        for name in hop.names
        if not any(name.ran_in(calls[node]) for node in hop.nodes)
    ]


def unnamed(hops: list[Hop], calls: dict[str, list[Call]]) -> list[str]:
    """Modules of the shell the request entered that no row names."""
    named = {name.module for hop in hops for name in hop.names}
    entered = {call.callee for node in calls.values() for call in node if call.kind != "local"}
    return sorted(
        m for m in entered if m.startswith("daemon.") and m not in named and m not in NOT_HOPS
    )


def load(path: Path, start: int, end: int) -> list[Call]:
    """The hand-overs recorded between ``start`` and ``end``, the node's periodic work left out.

    Each thread's records run in order; a ``resume`` starts what follows on
    that thread (until the next one), so work the service started is known
    by where it began.
    """
    calls = [Call(*json.loads(line)) for line in path.read_text().splitlines()]
    return [call for call in foreground(calls) if start <= call.ns <= end]


def foreground(calls: list[Call]) -> list[Call]:
    began: dict[str, str] = {}  # thread -> the module its current run of work began in
    kept = []
    for call in sorted(calls, key=lambda c: c.ns):
        if call.kind == "resume":
            began[call.thread] = call.callee
        if began.get(call.thread) not in BACKGROUND:
            kept.append(call)
    return kept


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, list[Call]]]:
    """The hand-overs each node ("P", "D") made for one request, start to release."""
    workdir = tmp_path_factory.mktemp("hop-trace")

    secret = new_secret()

    def traced_daemon(node: str) -> Daemon:
        return Daemon(
            node,
            workdir,
            free_port(),
            extra='[integrity]\nverify = "all"',
            secret=secret,
            trace_to=workdir / f"{node}.trace",
            # The wrapper lives in the checkout (harness/ is not installed).
            env={"PYTHONPATH": str(REPO)},
        )

    # No configured peers: the decode daemon dials the prefill's on demand
    # (hop 2 says so), as it does for a peer vLLM's router names.
    pair = start_daemons(lambda: [traced_daemon("prefill"), traced_daemon("decode")])
    window: list[int] = []

    async def run() -> None:
        pe, de = await engine_pair(pair, LAYOUT)
        # A first push opens the windows and the peer link: the traced one
        # is a request like every later one.
        await push(pe, de, pair[0], "warm", [[1, 2, 3]], [[4, 5, 6]], on_demand=True)
        for daemon in pair:
            daemon.profile(True)
        await asyncio.sleep(0.2)
        window.append(time.monotonic_ns())
        await push(pe, de, pair[0], "traced", [[7, 8, 9]], [[10, 11, 12]], on_demand=True)
        window.append(time.monotonic_ns())
        for daemon in pair:
            daemon.profile(False)

    try:
        asyncio.run(run())
    finally:
        stop_cleanly(*pair)
    prefill, decode = pair
    assert prefill.trace_to is not None and decode.trace_to is not None
    yield {"P": load(prefill.trace_to, *window), "D": load(decode.trace_to, *window)}


def test_every_hop_of_the_table_ran_on_its_node(traced: dict[str, list[Call]]) -> None:
    hops = parse_table((REPO / "ARCHITECTURE.md").read_text())
    assert [hop.number for hop in hops] == list(range(1, len(hops) + 1))
    assert all(hop.names for hop in hops)
    assert unseen(hops, traced) == []


def test_no_code_of_the_runtime_runs_on_a_request(traced: dict[str, list[Call]]) -> None:
    ran = [
        call for node in traced.values() for call in node if call.callee == "daemon.node.runtime"
    ]
    assert ran == []
    # The trace is of the request: both nodes recorded its hand-overs.
    assert all(len(calls) > 50 for calls in traced.values())


def test_every_module_of_the_shell_on_a_request_is_in_the_table(
    traced: dict[str, list[Call]],
) -> None:
    hops = parse_table((REPO / "ARCHITECTURE.md").read_text())
    assert unnamed(hops, traced) == []


# ------------------------------------------------- the checks, on planted tables

PLANTED = """\
| # | node | hop | modules |
|---|---|---|---|
| 1 | P | read | `daemon/node/engine_rpc.py` `EngineRpc.kv_ready`, `Registry.check_kv_ready` |
| 2 | P -> D | sent | `daemon/node/peerport.py` (`PeerPort.tell`), ledger |
"""


def _call(callee: str, qualname: str) -> Call:
    return Call(0, "MainThread", "call", "x", callee, qualname)


def test_the_services_periodic_work_is_not_the_requests() -> None:
    status_tick = [
        Call(1, "MainThread", "resume", "asyncio.runners", "daemon.service", "_status_updates"),
        Call(2, "MainThread", "call", "daemon.service", "daemon.node.runtime", "Node.status"),
        Call(3, "MainThread", "resume", "asyncio.runners", "daemon.node.tasks", "Tasks._done"),
        Call(4, "fs", "resume", "concurrent.futures.thread", "daemon.journal.writer", "sync_fd"),
    ]
    assert [c.ns for c in foreground(status_tick)] == [3, 4]


def test_a_stale_or_missing_name_in_the_table_is_reported() -> None:
    hops = parse_table(PLANTED)
    assert [(h.number, h.nodes) for h in hops] == [(1, ("P",)), (2, ("P", "D"))]
    ran = {
        "P": [
            _call("daemon.node.engine_rpc", "EngineRpc.kv_ready"),
            _call("statemachine.registry", "Registry.check_kv_ready"),
            _call("daemon.node.transfers", "Transfers.step"),
        ],
        "D": [_call("daemon.node.peerport", "PeerPort.tell")],
    }
    assert unseen(hops, ran) == []
    assert unnamed(hops, ran) == ["daemon.node.transfers"]
    stale = PLANTED.replace("EngineRpc.kv_ready", "EngineRpc.advance")
    assert unseen(parse_table(stale), ran) == ["hop 1: daemon.node.engine_rpc EngineRpc.advance"]
    tell = ran["D"].pop()
    assert unseen(hops, ran) == ["hop 2: daemon.node.peerport PeerPort.tell"]
    ran["P"].append(tell)
    assert unseen(hops, ran) == []  # hop 2 ran on P, one of its nodes
    ran["P"] = ran["P"][1:]
    assert unseen(hops, ran) == ["hop 1: daemon.node.engine_rpc EngineRpc.kv_ready"]
