"""Each part of the node built alone, from what it is given: no Node anywhere.

The runtime (daemon/node/runtime.py) wires the parts; each receives only
what it uses (ARCHITECTURE.md, "The node's parts"). These tests build one
part at a time with a real ledger over a journal in tmp_path, a real NIXL
data plane (DRAM) where the part drives one, real shared-memory regions,
and a peer port with no links (every peer is down, as before the links
start). The one stand-in is the engine's connection, ``RecordingSession``:
three ids and a ``send_event`` that keeps what it is sent.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import structlog

from daemon.dataplane.memory import OffloadPool, map_dram_region
from daemon.dataplane.plane import DataPlane
from daemon.journal.format import JournalFatal
from daemon.journal.groupcommit import GroupCommit
from daemon.journal.writer import Journal
from daemon.node.counters import IntegrityCounters, RefusalCounter, WriteCounters, merged
from daemon.node.deadlines import Deadlines
from daemon.node.engine_rpc import EngineRpc
from daemon.node.engine_state import EngineState
from daemon.node.engines import Engines
from daemon.node.integrity import Integrity
from daemon.node.ledger import Carriers, Ledger
from daemon.node.lifecycle import Lifecycle
from daemon.node.peerlink import PeerManager
from daemon.node.peerport import PeerPort
from daemon.node.peers import Peers
from daemon.node.peerstate import PeerState
from daemon.node.tasks import Tasks
from daemon.node.transfers import Transfers
from daemon.node.windows import Windows
from daemon.sim.engine_layout import SimGroup
from daemon.sim.engine_shm import ShmRegion, allocate
from harness.lifecycle import PREFILL
from schemas import peer as pm
from schemas import rpc
from schemas.config import IntegrityConfig, LimitsConfig, PeerConfig, VerifyMode
from schemas.events import Failed, KvReady, Refused, Registered, Trimmed
from schemas.kvlayout import EngineSpec
from schemas.layout import Role
from schemas.reasons import Reason
from schemas.state import Deadlines as Timeouts
from schemas.state import State
from statemachine import Refusal, Registry
from statemachine.reactions import Cause
from tests.support.journals import read_records

PEER = "decode-node"  # the one configured peer


class RecordingSession:
    """The engine's connection (daemon/node/engine_server.py ``Session``), kept in a list."""

    def __init__(self) -> None:
        self.uid, self.gid, self.pid = os.getuid(), os.getgid(), os.getpid()
        self.descriptors: tuple[int, ...] = ()  # its memory comes by /dev/shm file
        self.events: list[Any] = []

    def send_event(self, event: Any) -> None:
        self.events.append(event)


class Parts:
    """What the runtime would hand the parts: a ledger, a data plane, a port, tasks."""

    def __init__(self, ledger: Ledger, dataplane: DataPlane) -> None:
        self.ledger = ledger
        self.dataplane = dataplane
        self.port = PeerPort([PEER])
        self.life = Lifecycle()
        self.tasks = Tasks(structlog.get_logger("test"), life=self.life)
        self.engines: dict[str, EngineState] = {}
        self.agents: dict[str, PeerState] = {}
        self.told: list[tuple[str, object]] = []
        ledger.courier = Carriers(lambda e, m: self.told.append((e, m)), self.port.tell)

    def windows(self) -> Windows:
        return Windows(
            node="prefill-node",
            dataplane=self.dataplane,
            port=self.port,
            engines=self.engines,
            life=self.life,
        )

    def engines_part(self, windows: Windows) -> Engines:
        return Engines(
            node="prefill-node",
            ledger=self.ledger,
            dataplane=self.dataplane,
            windows=windows,
            by_id=self.engines,
            spawn=self.tasks.spawn,
            life=self.life,
            tombstones=16,
        )

    def integrity(self, verify: VerifyMode = VerifyMode.OFF) -> Integrity:
        return Integrity(
            IntegrityConfig(verify=verify),
            ledger=self.ledger,
            engines=self.engines,
            port=self.port,
            max_frame_bytes=1 << 20,
        )

    def transfers(self, integrity: Integrity) -> Transfers:
        return Transfers(
            ledger=self.ledger,
            dataplane=self.dataplane,
            engines=self.engines,
            agents=self.agents,
            port=self.port,
            integrity=integrity,
            spawn=self.tasks.spawn,
        )

    def peers(self, windows: Windows, transfers: Transfers, integrity: Integrity) -> Peers:
        return Peers(
            ledger=self.ledger,
            dataplane=self.dataplane,
            port=self.port,
            windows=windows,
            transfers=transfers,
            integrity=integrity,
            engines=self.engines,
            states=self.agents,
            spawn=self.tasks.spawn,
            life=self.life,
        )

    async def settled(self) -> None:
        """Every task the parts spawned has ended."""
        for _ in range(500):
            if not len(self.tasks):
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"{len(self.tasks)} tasks still running")


@pytest.fixture
async def parts(tmp_path: Path) -> AsyncIterator[Parts]:
    journal = Journal.open(tmp_path / "journal")
    group = GroupCommit(journal, on_fatal=lambda exc: None)
    registry = Registry(deadlines=Timeouts(registered=0.2))
    ledger = Ledger(journal, registry, node="prefill-node", group=group)
    dataplane = DataPlane(f"parts-{uuid.uuid4().hex[:8]}")
    await dataplane.start()
    made = Parts(ledger, dataplane)
    try:
        yield made
    finally:
        await made.tasks.cancel_all()
        group.commit_now()
        group.close()
        await dataplane.close()
        journal.close()


@pytest.fixture
def shm() -> Iterator[tuple[Any, list[ShmRegion]]]:
    groups, regions = allocate((SimGroup(8, 256),), f"kvp-parts-{uuid.uuid4().hex[:8]}")
    try:
        yield groups, regions
    finally:
        for region in regions:
            region.close()


def _events(parts: Parts) -> list[Any]:
    parts.ledger.journal.commit()
    return [r.event for r in read_records(parts.ledger.journal.directory)]


def _journaled(parts: Parts) -> list[type]:
    return [type(event) for event in _events(parts)]


# ----------------------------------------------------------- the peer port


async def test_peer_port_without_links_reaches_nobody() -> None:
    port = PeerPort([PEER])
    assert port.tell(PEER, pm.Cancel("r", 1)) is False
    assert not port.is_up(PEER)
    assert port.wants_windows(PEER) and not port.wants_windows("elsewhere")
    assert port.window_peers() == [PEER]
    assert port.links() == ()
    port.close(PEER, "fenced", "nothing to close")  # no link: nothing happens
    with pytest.raises(Refusal) as refused:
        await port.connect("elsewhere", "127.0.0.1:1")
    assert refused.value.reason is Reason.PEER_UNREACHABLE


# ---------------------------------------------------------------- the tasks


async def test_tasks_are_tracked_logged_once_and_cancelled_together() -> None:
    tasks = Tasks(structlog.get_logger("test"))

    async def fails() -> None:
        raise ValueError("boom")

    forever = tasks.spawn(asyncio.sleep(3600))
    with structlog.testing.capture_logs() as logs:
        failing = tasks.spawn(fails())
        await asyncio.wait([failing])
        await asyncio.sleep(0)
    assert [entry["event"] for entry in logs] == ["task failed"]
    assert len(tasks) == 1
    await tasks.cancel_all()
    assert forever.cancelled() and len(tasks) == 0


# ------------------------------------------------------- engines and windows


async def test_engines_alone_register_window_and_detach(parts: Parts, shm: Any) -> None:
    groups, regions = shm
    windows = parts.windows()
    engines = parts.engines_part(windows)
    session = RecordingSession()
    specs = tuple(r.spec() for r in regions)
    reply = await engines.register(session, rpc.RegisterEngine(1, "prefill-0", groups, specs))
    assert isinstance(reply, rpc.Ok)
    assert "prefill-0" in parts.ledger.registry.engines  # the attach is journaled
    (window,) = windows.view(PEER)  # the configured peer got its own window
    assert window.engine_id == "prefill-0"
    assert window != parts.engines["prefill-0"].remote  # never the engine's own mapping
    assert windows.view("elsewhere") == ()

    # A connection that closes with nothing live: forgotten on every side.
    engines.disconnected(session)
    assert parts.engines == {} and windows.view(PEER) == ()
    assert "prefill-0" not in parts.ledger.registry.engines
    await parts.settled()


async def test_windows_alone_revoke_and_reopen_per_peer(parts: Parts, shm: Any) -> None:
    groups, regions = shm
    spec = EngineSpec("prefill-0", groups, tuple(r.spec() for r in regions))
    mapped = {r.name: map_dram_region(r.spec(), owner_uid=None) for r in regions}
    remote = await parts.dataplane.add_local_engine(spec, mapped)
    engine = EngineState(spec, mapped, remote, None)
    parts.engines["prefill-0"] = engine
    windows = parts.windows()
    try:
        await windows.open_for_all_peers(engine)
        assert len(windows.view(PEER)) == 1 and not windows.lacks(PEER)
        await windows.revoke(PEER)
        assert windows.view(PEER) == () and windows.lacks(PEER)
        await windows.rewindow(PEER)  # configured: fresh windows at once
        assert len(windows.view(PEER)) == 1
        await windows.rewindow("elsewhere")  # neither configured nor linked: none
        assert windows.view("elsewhere") == ()
    finally:
        await parts.dataplane.remove_local_engine("prefill-0")
        for region in mapped.values():
            region.close()


# --------------------------------------------------------------- integrity


async def test_integrity_alone_refuses_and_zeroes_a_dirty_offload_slot(
    parts: Parts, shm: Any
) -> None:
    groups, regions = shm
    spec = EngineSpec("prefill-0", groups, tuple(r.spec() for r in regions))
    region = map_dram_region(regions[0].spec(), owner_uid=None)
    engine = EngineState(spec, {}, None, None)  # type: ignore[arg-type]
    engine.offload = OffloadPool(region, 4)
    integrity = parts.integrity(VerifyMode.ALL)
    try:
        grant = Registered("r1", 1, Role.PUSHER, "prefill-0", "", ((1,),), offload_slots=(2,))
        integrity.check_slots(engine, grant)  # zero, as the pool left it: granted
        engine.offload.slot_view(2)[:] = 7  # written after its release
        with pytest.raises(Refusal) as refused:
            integrity.check_slots(engine, grant)
        assert refused.value.reason is Reason.INTEGRITY_MISMATCH
        assert not engine.offload.slot_view(2).any()  # zeroed there and then
        assert integrity.counters == IntegrityCounters(
            integrity_slots_checked=2, integrity_dirty_slots=1
        )
    finally:
        region.close()


# --------------------------------------------------------------- transfers


def _pusher_ready(parts: Parts, rid: str) -> None:
    """The receiver's registration, then the pusher's, then its KV is ready."""
    ledger, registry = parts.ledger, parts.ledger.registry
    ledger.commit([registry.check_attach(PREFILL)])
    ledger.commit(
        [registry.check_peer_registration(rid, 1, PEER, "dec", ((5, 6), ()), 1)], Cause.PEER
    )
    ledger.commit([registry.check_register(rid, 1, Role.PUSHER, "prefill-0", PEER, [[1, 2], []])])
    ledger.commit([KvReady(rid, 1)])


async def test_transfers_alone_trim_then_fail_a_write_whose_engine_went(parts: Parts) -> None:
    transfers = parts.transfers(parts.integrity())
    _pusher_ready(parts, "r1")
    # The engine is in the registry (journaled) but not mapped here: the
    # trim is the core's, the write cannot start.
    await transfers.advance("r1")
    await parts.settled()
    record = parts.ledger.registry.get("r1")
    assert record is not None and record.state is State.FAILED
    (failed,) = [e for e in _events(parts) if isinstance(e, Failed)]
    assert failed.reason is Reason.UNKNOWN_ENGINE
    assert Trimmed in _journaled(parts)
    assert transfers.counters == WriteCounters()  # no write started


async def test_transfers_alone_poll_for_notifications_only_while_a_receiver_waits(
    parts: Parts,
) -> None:
    transfers = parts.transfers(parts.integrity())
    parts.ledger.observers.append(transfers.observe)
    ledger, registry = parts.ledger, parts.ledger.registry
    ledger.commit([registry.check_attach(PREFILL)])
    ledger.commit([registry.check_register("r1", 1, Role.RECEIVER, "prefill-0", PEER, [[1], []])])
    assert transfers.awaiting == {"r1"}
    ledger.commit([Failed("r1", 1, Reason.ABORTED, "test")])
    assert transfers.awaiting == set()


# ------------------------------------------------------------------ peers


async def test_peers_alone_hold_a_forward_and_fence_a_dead_peer(parts: Parts) -> None:
    integrity = parts.integrity()
    peers = parts.peers(parts.windows(), parts.transfers(integrity), integrity)
    forward = pm.Forward("r1", 1, "dec", ((5, 6),), 1)
    await peers.peer_message(PEER, forward)
    assert "r1" in parts.ledger.registry.pending  # no engine of ours registered it yet
    assert peers.in_use(PEER) and not peers.in_use("elsewhere")

    await peers.peer_down(PEER, "test")
    assert parts.ledger.registry.pending == {}
    assert not peers.in_use(PEER)
    journaled = _journaled(parts)
    assert journaled[-1] is Failed


# --------------------------------------------------------------- deadlines


async def test_deadlines_alone_fail_a_registration_that_waited_too_long(parts: Parts) -> None:
    integrity = parts.integrity()
    windows = parts.windows()
    transfers = parts.transfers(integrity)
    deadlines = Deadlines(
        ledger=parts.ledger,
        transfers=transfers,
        peers=parts.peers(windows, transfers, integrity),
        windows=windows,
        clock=parts.ledger.clock,
    )
    parts.ledger.observers.append(deadlines.observe)
    parts.tasks.spawn(deadlines.run())
    await asyncio.sleep(0.1)  # the loop sleeps its idle second
    event = parts.ledger.registry.check_peer_registration("r1", 1, PEER, "dec", ((5,),), 1)
    parts.ledger.commit([event], Cause.PEER)
    # The 0.2 s deadline wakes the loop early (the observer), well before 1 s.
    for _ in range(100):
        if not parts.ledger.registry.pending:
            break
        await asyncio.sleep(0.01)
    assert parts.ledger.registry.pending == {}
    assert _journaled(parts)[-1] is Failed


# -------------------------------------------------------------- engine rpc


async def test_engine_rpc_alone_refuses_while_draining_and_journals_refusals(
    parts: Parts,
) -> None:
    integrity = parts.integrity()
    windows = parts.windows()
    transfers = parts.transfers(integrity)
    engines = parts.engines_part(windows)
    life = Lifecycle()
    life.stop()
    calls = EngineRpc(
        limits=LimitsConfig(),
        on_demand_peers=False,
        ledger=parts.ledger,
        engines=engines,
        peers=parts.peers(windows, transfers, integrity),
        port=parts.port,
        transfers=transfers,
        integrity=integrity,
        spawn=parts.tasks.spawn,
        life=life,
    )
    refusals = RefusalCounter()
    parts.ledger.observers.append(refusals.observe)
    request = rpc.RegisterRequest(1, "e", "r1", Role.PUSHER, [[1]])
    with pytest.raises(Refusal) as draining:
        await calls.register_request(RecordingSession(), request)
    assert draining.value.reason is Reason.DAEMON_RESTART
    assert await calls.record_refusal(request, draining.value) is True
    assert refusals.refusals == 1 and _journaled(parts)[-1] is Refused

    life.stopping = False  # a node that never stopped (only the test turns it back)
    with pytest.raises(Refusal) as unknown:
        await calls.register_request(RecordingSession(), request)
    assert unknown.value.reason is Reason.UNKNOWN_ENGINE

    life.fail(JournalFatal("disk gone"))  # the journal failed: the engine is told nothing
    assert await calls.record_refusal(request, unknown.value) is False
    assert refusals.refusals == 1


# ---------------------------------------------------------------- counters


def test_counters_merge_under_the_status_names() -> None:
    counted = merged(WriteCounters(writes_done=2), RefusalCounter(1), IntegrityCounters())
    assert list(counted)[:5] == [
        "writes_started",
        "writes_done",
        "writes_failed",
        "bytes_written",
        "refusals",
    ]
    assert counted["writes_done"] == 2 and counted["refusals"] == 1
    assert all(name.startswith("integrity_") for name in list(counted)[5:])
    assert len(counted) == 12


@dataclass
class PeerEngine:
    """A peer daemon's data plane with one engine ("dec") whose windows this node is given."""

    plane: DataPlane
    spec: EngineSpec
    mapped: dict[str, Any]

    async def hello(self) -> pm.Hello:
        """The peer's Hello with fresh windows for this node (its old ones revoked)."""
        await self.plane.revoke_windows("prefill-node")
        windows = await self.plane.open_windows("prefill-node", self.spec, self.mapped)
        metadata = await self.plane.metadata()
        return pm.Hello("decode-node", "boot-1", self.plane.agent_name, metadata, (windows,))


@pytest.fixture
async def peer_engine(shm: Any) -> AsyncIterator[PeerEngine]:
    groups, regions = shm
    plane = DataPlane(f"parts-peer-{uuid.uuid4().hex[:8]}")
    await plane.start()
    spec = EngineSpec("dec", groups, tuple(r.spec() for r in regions))
    mapped = {r.name: map_dram_region(r.spec(), owner_uid=None) for r in regions}
    try:
        await plane.add_local_engine(spec, mapped)
        yield PeerEngine(plane, spec, mapped)
    finally:
        await plane.close()
        for region in mapped.values():
            region.close()


async def test_peers_alone_replace_an_engine_whose_windows_changed_on_the_same_agent(
    parts: Parts, peer_engine: PeerEngine
) -> None:
    # Found by the crash soak: the same peer agent back on a new link, with
    # windows reopened meanwhile, was added the new engine over the old one
    # ("already added with another layout"); the Hello's list now replaces it.
    integrity = parts.integrity()
    peers = parts.peers(parts.windows(), parts.transfers(integrity), integrity)
    first = await peer_engine.hello()
    await peers.peer_up("decode-node", first)
    second = await peer_engine.hello()
    assert first.engines != second.engines
    await peers.peer_up("decode-node", second)
    assert peers.states["decode-node"].engines == {"dec": second.engines[0]}


async def test_peers_fence_a_peer_in_its_turn_never_inside_its_peer_up(
    parts: Parts, peer_engine: PeerEngine
) -> None:
    # Found by the crash rounds: a quarantine deadline fenced the peer while
    # its peer_up was adding its engines; the next peer_up then added an
    # engine whose windows had changed over the old one ("already added with
    # another layout"). The deadline's fence now waits for the peer's turn.
    integrity = parts.integrity()
    peers = parts.peers(parts.windows(), parts.transfers(integrity), integrity)
    peers.on_up("decode-node", await peer_engine.hello(), None)
    state = None
    until = time.monotonic() + 10
    while time.monotonic() < until:  # until peer_up has its agent, and adds its engines
        state = peers.states.get("decode-node")
        if state is not None and state.agent_name:
            break
        await asyncio.sleep(0)
    assert state is not None and state.agent_name
    await peers.fence_in_turn("decode-node", close_link="a quarantine deadline passed")
    # The fence came after the whole peer_up: the agent and its engines are gone together.
    assert state.agent_name == ""
    assert not [k for k in parts.dataplane._remote_specs if k[1] == "dec"]

    second = await peer_engine.hello()
    peers.on_up("decode-node", second, None)
    await peers.fence_in_turn("decode-node", close_link="")  # waits for that peer_up
    # That peer_up registered the new windows (none left over to collide with)
    # before this second fence forgot them again.
    assert state.engines == {"dec": second.engines[0]}


async def _linked(port: PeerPort) -> list[PeerManager]:
    """A real peer link between this node and ``PEER`` on loopback, ``port`` attached to it."""
    secret = os.urandom(32)

    def hello(node: str) -> Any:
        return lambda peer: pm.Hello(node, "boot-1", f"agent-{node}", b"md", ())

    def manager(node: str, peers: list[PeerConfig]) -> PeerManager:
        return PeerManager(
            node,
            secret,
            "127.0.0.1:0",
            peers,
            hello=hello(node),
            on_up=lambda *_: None,
            on_message=lambda *_: None,
            on_down=lambda *_: None,
        )

    # The name that sorts first dials: the decode node, here.
    prefill = manager("prefill-node", [PeerConfig(PEER, "127.0.0.1:1")])
    await prefill.start()
    decode = manager(PEER, [PeerConfig("prefill-node", f"127.0.0.1:{prefill.listen_port}")])
    await decode.start()
    port.attach(prefill)
    for _ in range(500):
        if port.is_up(PEER):
            break
        await asyncio.sleep(0.01)
    assert port.is_up(PEER)
    return [prefill, decode]


async def test_transfers_stop_a_write_whose_task_was_cancelled_before_it_ever_ran(
    parts: Parts, shm: Any
) -> None:
    # An unchecked request's WRITE is posted in kv_ready's own call, before
    # its task runs; a cancel in that same loop pass (a deadline) reaches a
    # task that never starts, so never runs its own clean-up. cancel_write
    # must still return only once NIXL let the WRITE go.
    groups, regions = shm
    # The decode side: its own data plane, which never progresses while it
    # expects nothing (so the WRITE stays in flight), and its own memory.
    dgroups, dregions = allocate((SimGroup(8, 256),), f"kvp-parts-d-{uuid.uuid4().hex[:8]}")
    receiver = DataPlane(f"parts-recv-{uuid.uuid4().hex[:8]}", idle_progress_s=None)
    await receiver.start()
    dspec = EngineSpec("dec", dgroups, tuple(r.spec() for r in dregions))
    dmapped = {r.name: map_dram_region(r.spec(), owner_uid=None) for r in dregions}
    managers = await _linked(parts.port)
    try:
        await receiver.add_local_engine(dspec, dmapped)
        windows = await receiver.open_windows("prefill-node", dspec, dmapped)
        hello = pm.Hello(PEER, "boot-1", receiver.agent_name, await receiver.metadata(), (windows,))
        integrity = parts.integrity()  # verify off: unchecked
        transfers = parts.transfers(integrity)
        engines = parts.engines_part(parts.windows())
        await parts.peers(parts.windows(), transfers, integrity).peer_up(PEER, hello)
        specs = tuple(r.spec() for r in regions)
        registered = await engines.register(
            RecordingSession(), rpc.RegisterEngine(1, "prefill-0", groups, specs)
        )
        assert isinstance(registered, rpc.Ok)
        ledger, registry = parts.ledger, parts.ledger.registry
        ledger.commit(
            [registry.check_peer_registration("r1", 1, PEER, "dec", ((5, 6),), 1)], Cause.PEER
        )
        ledger.commit([registry.check_register("r1", 1, Role.PUSHER, "prefill-0", PEER, [[1, 2]])])
        ledger.commit([KvReady("r1", 1)])

        assert transfers.step("r1") is None  # trimmed, WriteStarted, the WRITE posted
        worker = parts.dataplane._worker
        assert worker is not None
        await transfers.cancel_write("r1")  # no await in between: the task never ran
        assert parts.dataplane.writes_cancelled == 1
        assert not worker.st.inflight
        assert "r1" not in transfers.writes
    finally:
        for manager in managers:
            await manager.close()
        await parts.tasks.cancel_all()
        await receiver.close()
        for region in dmapped.values():
            region.close()
        for shared in dregions:
            shared.close()
