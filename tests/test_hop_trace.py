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
from schemas import rpc
from schemas.config import VerifyMode
from statemachine.integrity import sampled
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


LEG_HEADER: Final = "| # | node | into | entered | what runs there |"
BESIDE_LINE: Final = "Beside the leg (entered on the loop meanwhile, not on its path):"
LOOP: Final = "MainThread"  # the daemon's event loop runs on its main thread


@dataclass(frozen=True)
class HandOver:
    """One row of the kv_ready -> kv_arrived leg: where control went next."""

    number: int
    node: str  # where its function runs ("P -> D": D)
    thread: bool  # into a thread of the daemon's own; else the loop (a task or a callback)
    entered: Named

    def is_entry(self, call: Call) -> bool:
        if not self.entered._is(call) or (call.thread != LOOP) != self.thread:
            return False
        # On the loop only an entry from outside the package (a task's step,
        # a callback) is a hand-over; a thread's loop calls its own functions.
        return self.thread or call.kind == "resume"


def parse_leg(text: str) -> tuple[list[HandOver], list[Named]]:
    """The leg's rows and the functions named beside it."""
    lines = text.splitlines()
    start = lines.index(LEG_HEADER) + 2
    leg = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        number, node, into, entered, _ = (cell.strip() for cell in line.strip("|").split("|"))
        (name,) = parse_cell(entered)
        leg.append(HandOver(int(number), re.findall(r"[PD]", node)[-1], "thread" in into, name))
    beside: list[Named] = []
    for line in lines[lines.index(BESIDE_LINE) + 2 :]:
        if not line.startswith("- "):
            break
        beside.extend(parse_cell(line[2:].split(":")[0]))
    return leg, beside


def follow(leg: list[HandOver], calls: dict[str, list[Call]]) -> list[int | None]:
    """When each hand-over's function was entered, each after the one before (None: never)."""
    after, times = 0, []
    for hand_over in leg:
        entered = next(
            (c.ns for c in calls[hand_over.node] if c.ns > after and hand_over.is_entry(c)), None
        )
        times.append(entered)
        after = entered if entered is not None else after
    return times


def strays(
    leg: list[HandOver], beside: list[Named], calls: dict[str, list[Call]], times: list[int | None]
) -> list[str]:
    """Hand-overs the loop took on a node between its first and last row that are no row and
    not beside the leg: a task or callback on the path that the table does not show."""
    allowed = [hand_over.entered for hand_over in leg] + beside
    found: list[str] = []
    for node, node_calls in calls.items():
        at = [t for h, t in zip(leg, times, strict=True) if h.node == node and t is not None]
        if not at:
            continue
        first, last = min(at), max(at)
        found.extend(
            f"{node}: {call.callee} {call.qualname}"
            for call in node_calls
            if first <= call.ns <= last
            and call.thread == LOOP
            and call.kind == "resume"
            and not any(name._is(call) for name in allowed)
        )
    return found


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


# Half the requests are checked for integrity (statemachine/integrity.py
# ``sampled``: by the request id): "traced" is, "unchecked" is not.
SAMPLED: Final = '[integrity]\nverify = "sample"\nsample_rate = 0.5'
CHECKED, UNCHECKED = "traced", "unchecked"


@dataclass
class Traces:
    """What each node ("P", "D") recorded for the two requests."""

    # The checked request, from the decode engine's registration to both releases.
    request: dict[str, list[Call]]
    # The unchecked one, from the prefill engine's kv_ready to the decode engine's kv_arrived.
    leg: dict[str, list[Call]]


@pytest.fixture(scope="module")
def traces(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Traces]:
    workdir = tmp_path_factory.mktemp("hop-trace")

    secret = new_secret()

    def traced_daemon(node: str) -> Daemon:
        return Daemon(
            node,
            workdir,
            free_port(),
            extra=SAMPLED,
            secret=secret,
            trace_to=workdir / f"{node}.trace",
            # The wrapper lives in the checkout (harness/ is not installed).
            env={"PYTHONPATH": str(REPO)},
        )

    # No configured peers: the decode daemon dials the prefill's on demand
    # (hop 2 says so), as it does for a peer vLLM's router names.
    pair = start_daemons(lambda: [traced_daemon("prefill"), traced_daemon("decode")])
    prefill = pair[0]
    request: list[int] = []
    leg: list[int] = []

    async def run() -> None:
        pe, de = await engine_pair(pair, LAYOUT)
        # A first push opens the windows and the peer link: the traced ones
        # are requests like every later one.
        await push(pe, de, prefill, "warm", [[1, 2, 3]], [[4, 5, 6]], on_demand=True)
        for daemon in pair:
            daemon.profile(True)
        await asyncio.sleep(0.2)
        request.append(time.monotonic_ns())
        await push(pe, de, prefill, CHECKED, [[7, 8, 9]], [[10, 11, 12]], on_demand=True)
        request.append(time.monotonic_ns())
        # The leg alone: both registered and trimmed first, then kv_ready.
        await de.decode_register(
            UNCHECKED, [[13, 14, 15]], prefill.node, peer_address=prefill.address
        )
        await pe.prefill(UNCHECKED, [[16, 17, 18]], kv_ready=False)
        await asyncio.sleep(0.2)
        leg.append(time.monotonic_ns())
        await pe.kv_ready(UNCHECKED)
        await de.wait_event(UNCHECKED, rpc.KvArrived, timeout=30.0)
        leg.append(time.monotonic_ns())
        await pe.wait_event(UNCHECKED, rpc.BlocksFreeable, timeout=30.0)
        for daemon in pair:
            daemon.profile(False)
        await de.release(UNCHECKED)
        await pe.release(UNCHECKED)

    try:
        asyncio.run(run())
    finally:
        stop_cleanly(*pair)
    decode = pair[1]
    assert prefill.trace_to is not None and decode.trace_to is not None
    paths = {"P": prefill.trace_to, "D": decode.trace_to}
    yield Traces(
        {node: load(path, *request) for node, path in paths.items()},
        {node: load(path, *leg) for node, path in paths.items()},
    )


@pytest.fixture(scope="module")
def traced(traces: Traces) -> dict[str, list[Call]]:
    """The hand-overs each node made for one checked request, start to release."""
    return traces.request


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


def test_the_kv_ready_leg_of_an_unchecked_request_is_the_tables_hand_overs(
    traces: Traces,
) -> None:
    leg, beside = parse_leg((REPO / "ARCHITECTURE.md").read_text())
    assert [h.number for h in leg] == list(range(1, len(leg) + 1))
    # The table's ten, and the last one's frame into the decode engine's socket.
    assert len(leg) + 1 <= 12
    times = follow(leg, traces.leg)
    missing = [f"hand-over {h.number}" for h, t in zip(leg, times, strict=True) if t is None]
    assert missing == []
    assert strays(leg, beside, traces.leg, times) == []


def test_an_unchecked_request_never_enters_integrity(traces: Traces) -> None:
    assert sampled(CHECKED, VerifyMode.SAMPLE, 0.5)
    assert not sampled(UNCHECKED, VerifyMode.SAMPLE, 0.5)
    entered = {
        node: {c.qualname for c in calls if c.callee == "daemon.node.integrity"}
        for node, calls in traces.leg.items()
    }
    assert entered == {"P": set(), "D": set()}
    # The checked one did, on both sides: the assertion above can fail.
    checked = {
        node: {c.qualname for c in calls if c.callee == "daemon.node.integrity"}
        for node, calls in traces.request.items()
    }
    assert "Integrity.before_write" in checked["P"]
    assert "Integrity.landed" in checked["D"]


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


PLANTED_LEG = """\
| # | node | into | entered | what runs there |
|---|---|---|---|---|
| 1 | P | task | `daemon/node/serializer.py` `_after` | kv_ready |
| 2 | P -> D | socket, thread | `daemon/dataplane/worker.py` `Worker._progress` | the wire |
| 3 | D | callback | `daemon/dataplane/worker.py` `Worker._deliver` | the landing |
| 4 | D | callback | `daemon/node/engine_server.py` `Session._send_events` | kv_arrived |

Beside the leg (entered on the loop meanwhile, not on its path):

- `daemon/node/tasks.py` `Tasks._done`: bookkeeping
"""


def _at(ns: int, thread: str, kind: str, callee: str, qualname: str) -> Call:
    return Call(ns, thread, kind, "asyncio.events", callee, qualname)


def test_a_hand_over_missing_out_of_order_or_not_in_the_table_is_reported() -> None:
    leg, beside = parse_leg(PLANTED_LEG)
    assert [(h.number, h.node, h.thread) for h in leg] == [
        (1, "P", False),
        (2, "D", True),
        (3, "D", False),
        (4, "D", False),
    ]
    assert beside == [Named("daemon.node.tasks", "Tasks._done")]
    ran = {
        "P": [_at(1, LOOP, "resume", "daemon.node.serializer", "_after")],
        "D": [
            _at(2, "nixl-worker", "local", "daemon.dataplane.worker", "Worker._progress"),
            _at(3, LOOP, "resume", "daemon.dataplane.worker", "Worker._deliver"),
            _at(4, LOOP, "resume", "daemon.node.tasks", "Tasks._done"),
            _at(5, LOOP, "resume", "daemon.node.engine_server", "Session._send_events"),
        ],
    }
    times = follow(leg, ran)
    assert times == [1, 2, 3, 5]
    assert strays(leg, beside, ran, times) == []
    # A task added on the path: seen between the node's first and last row.
    ran["D"].insert(2, _at(3, LOOP, "resume", "daemon.node.transfers", "Transfers._arrived"))
    assert strays(leg, beside, ran, follow(leg, ran)) == [
        "D: daemon.node.transfers Transfers._arrived"
    ]
    del ran["D"][2]
    # Entered by a call, not a hand-over: the row is not seen.
    ran["D"][1] = Call(
        3, LOOP, "call", "daemon.node.x", "daemon.dataplane.worker", "Worker._deliver"
    )
    assert follow(leg, ran) == [1, 2, None, 5]
    # Out of order: the landing before the wire.
    ran["D"][1] = _at(1, LOOP, "resume", "daemon.dataplane.worker", "Worker._deliver")
    assert follow(leg, ran) == [1, 2, None, 5]
    # On the wrong thread.
    ran["D"][0] = _at(2, LOOP, "resume", "daemon.dataplane.worker", "Worker._progress")
    assert follow(leg, ran)[1] is None
