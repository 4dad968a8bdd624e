"""The node: one daemon's runtime, wiring its parts around the ledger.

One request takes this path (ARCHITECTURE.md, "One request"): the engine
server decodes a frame and calls the node, which hands it to
``engine_rpc``; that asks the core what the request calls for and commits
the events through the ledger, which applies them, journals them, waits for
durability and only then tells the engine and the peer what the core says
they are owed.

The parts, one module each, built here once the journal is replayed (the
ledger needs its registry) and given only what they use: ``engines``
(sessions, memory, offload pools), ``windows`` (per-peer memory windows),
``integrity`` (checksums), ``transfers`` (trim, NIXL write, arrival),
``peers`` (peer daemons, their messages, fences), ``deadlines``,
``engine_rpc`` (what each engine call does), ``offload`` (the KV offload
tier: its calls, holders and resets), ``peerport`` (the one way to a
peer), ``tasks``, ``counters``, ``status`` and ``ledger`` (the one commit
path). No part holds the node; where one must hear of another's commit it
observes the ledger. This module holds no rule of the lifecycle.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import uuid
from collections.abc import Callable

import structlog

from daemon.dataplane.plane import DataPlane
from daemon.dataplane.pool import Pool
from daemon.journal.format import JournalFatal
from daemon.journal.groupcommit import GroupCommit
from daemon.journal.replay import fold_contents
from daemon.journal.writer import Journal
from daemon.node.counters import RefusalCounter, merged
from daemon.node.deadlines import Deadlines
from daemon.node.engine_rpc import EngineRpc
from daemon.node.engine_state import EngineSession, EngineState
from daemon.node.engines import Engines
from daemon.node.integrity import Integrity
from daemon.node.ledger import Carriers, Ledger
from daemon.node.lifecycle import Lifecycle
from daemon.node.offload import OffloadTier
from daemon.node.peerlink import PeerManager
from daemon.node.peerport import PeerPort
from daemon.node.peers import Peers
from daemon.node.peerstate import PeerState
from daemon.node.status import status_document
from daemon.node.tasks import Tasks
from daemon.node.transfers import Transfers
from daemon.node.windows import Windows
from daemon.version import VERSION
from schemas.config import Config
from schemas.events import DaemonStarted, Released
from schemas.reasons import Reason
from schemas.status import StatusDocument
from statemachine import Registry
from statemachine.reactions import Cause, Stimulus, Why, react, react_pending

log = structlog.get_logger("kvpushd.node")


class Node:
    # The parts, built by open() (the ledger needs the replayed registry).
    journal: Journal
    group: GroupCommit
    ledger: Ledger
    engines: Engines
    windows: Windows
    integrity: Integrity
    transfers: Transfers
    peers: Peers
    deadlines: Deadlines
    calls: EngineRpc
    offload: OffloadTier

    def __init__(self, config: Config, *, clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self.clock = clock
        self.boot_id = uuid.uuid4().hex[:12]
        self.log = log.bind(node=config.node)
        self.dataplane = DataPlane(
            f"kvpushd-{config.node}-{self.boot_id}",
            backend=config.nixl.backend,
            poll_interval_s=config.nixl.poll_interval_s,
        )
        self.port = PeerPort(peer.node for peer in config.peers)
        self.life = Lifecycle()
        self.tasks = Tasks(self.log, life=self.life)
        self.refusals = RefusalCounter()
        self.started_at = clock()
        self.on_fatal: Callable[[BaseException], None] = lambda exc: None
        # The port the service serves metrics on, for status(); None without metrics.
        self.metrics_port: int | None = None

    @property
    def registry(self) -> Registry:
        return self.ledger.registry

    @property
    def writes(self) -> dict[str, asyncio.Task[None]]:
        return self.transfers.writes

    @property
    def fatal(self) -> BaseException | None:
        return self.life.fatal

    @property
    def stopping(self) -> bool:
        return self.life.stopping

    @property
    def closing(self) -> bool:
        return self.life.closing

    # ------------------------------------------------------------ start / stop

    async def start(self) -> None:
        await self.open()
        await self.begin()

    async def open(self) -> None:
        """Lock and replay the journal, build the parts, start the data plane; journal nothing.

        What can still fail after this (a port in use) must not leave a
        DaemonStarted record behind: postmortems would count restarts that
        never ran. The service calls :meth:`begin` once nothing can.
        """
        cfg = self.config
        self.journal = Journal.open(
            cfg.journal.dir,
            fsync=cfg.journal.fsync,
            segment_bytes=cfg.journal.segment_mb * 1024 * 1024,
            format=cfg.journal.format,
        )
        # The offload pool once the journal is ours (two daemons never share
        # its file), before anything is journaled: a pool that cannot be
        # made stops the start (daemon/service.py).
        pool = self._open_pool()
        replayed = fold_contents(
            self.journal.take_recovered(),
            deadlines=cfg.deadlines,
            tombstone_limit=cfg.limits.tombstones,
        )
        self.group = GroupCommit(
            self.journal,
            window_s=cfg.journal.commit_window_ms / 1000.0,
            on_fatal=self._journal_failed,
        )
        self.ledger = Ledger(
            self.journal,
            replayed.registry,
            node=cfg.node,
            clock=self.clock,
            group=self.group,
            snapshot_every=cfg.journal.snapshot_every,
            retain_segments=cfg.journal.retain_segments,
            debug=cfg.log_level == "debug",
            on_fatal=self._journal_failed,
        )
        self._build_parts(pool)
        self.log.info(
            "journal replayed",
            records=replayed.records,
            last_seq=replayed.last_seq,
            torn_bytes=replayed.torn_bytes,
            live=len(self.registry.live),
        )
        await self.dataplane.start()
        self.dataplane.set_notification_handler(self.transfers.on_notification)

    def _open_pool(self) -> Pool | None:
        offload = self.config.offload
        if not offload.enabled:
            return None
        try:
            return Pool.open(slots=offload.slots, slot_bytes=offload.slot_bytes, path=offload.path)
        except BaseException:
            self.journal.close()
            raise

    def _build_parts(self, pool: Pool | None = None) -> None:
        """Each part gets what it uses; the ledger tells the observers of every commit."""
        cfg, ledger, port, spawn = self.config, self.ledger, self.port, self.tasks.spawn
        engines: dict[str, EngineState] = {}
        agents: dict[str, PeerState] = {}
        self.windows = Windows(
            node=cfg.node,
            dataplane=self.dataplane,
            port=port,
            engines=engines,
            life=self.life,
            boot_id=self.boot_id,
        )
        self.engines = Engines(
            node=cfg.node,
            ledger=ledger,
            dataplane=self.dataplane,
            windows=self.windows,
            by_id=engines,
            spawn=spawn,
            life=self.life,
            tombstones=cfg.limits.tombstones,
        )
        self.integrity = Integrity(
            cfg.integrity,
            ledger=ledger,
            engines=engines,
            port=port,
            max_frame_bytes=cfg.limits.max_frame_bytes,
        )
        self.transfers = Transfers(
            ledger=ledger,
            dataplane=self.dataplane,
            engines=engines,
            agents=agents,
            port=port,
            integrity=self.integrity,
            spawn=spawn,
        )
        self.peers = Peers(
            ledger=ledger,
            dataplane=self.dataplane,
            port=port,
            windows=self.windows,
            transfers=self.transfers,
            integrity=self.integrity,
            engines=engines,
            states=agents,
            spawn=spawn,
            life=self.life,
        )
        self.deadlines = Deadlines(
            ledger=ledger,
            transfers=self.transfers,
            peers=self.peers,
            windows=self.windows,
            clock=self.clock,
        )
        self.offload = OffloadTier(
            cfg.offload, pool=pool, ledger=ledger, spawn=spawn, life=self.life
        )
        self.calls = EngineRpc(
            limits=cfg.limits,
            on_demand_peers=cfg.on_demand_peers,
            ledger=ledger,
            engines=self.engines,
            peers=self.peers,
            port=port,
            transfers=self.transfers,
            integrity=self.integrity,
            spawn=spawn,
            life=self.life,
            offload=self.offload,
        )
        ledger.courier = Carriers(self.engines.tell_engine, port.tell)
        ledger.observers.extend(
            (
                self.transfers.observe,
                self.refusals.observe,
                self.deadlines.observe,
            )
        )
        ledger.after_durable[Released] = [self.engines.after_durable]

    async def begin(self) -> None:
        """Journal the start, fail what the restart interrupted, start the deadlines."""
        ledger = self.ledger
        ledger.commit([DaemonStarted(os.getpid(), VERSION, self.boot_id)])
        # Requests caught mid-flight by a restart fail; their memory is gone.
        for record in list(self.registry.live.values()):
            ledger.commit(react(record, Stimulus.RESTART), Cause.RESTART)
        for pending in list(self.registry.pending.values()):
            ledger.commit(react_pending(pending, Stimulus.RESTART), Cause.RESTART)
        # Engines attached before the restart must register again (their memory
        # mappings died with the old process); until then they are unknown.
        for engine_id in list(self.registry.engines):
            if not any(r.engine_id == engine_id for r in self.registry.live.values()):
                ledger.commit([self.registry.check_detach(engine_id)])
        await self.group.durable(self.journal.next_seq - 1)
        # The offload pool as opened, and what the restart calls for in it.
        await self.offload.begin()
        self.tasks.spawn(self.deadlines.run())

    def disconnected(self, session: EngineSession) -> None:
        """An engine connection ended: its engines, and the offload holders it named."""
        self.engines.disconnected(session)
        self.offload.disconnected(session)

    def attach_peers(self, manager: PeerManager) -> None:
        self.port.attach(manager)

    async def drain(self) -> None:
        """SIGTERM: finish in-flight writes within ``drain_s``, fail the rest.

        New registrations are refused from here on; requests that are not
        writing stay as they are in the journal and fail as "daemon restart"
        on the next start, where their engines are told.
        """
        self.life.stop()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.drain_s
        while self.writes and loop.time() < deadline:
            await asyncio.sleep(0.01)
        why = Why(Reason.DAEMON_RESTART, "daemon stopped during the write")
        for rid in list(self.writes):
            await self.transfers.cancel_write(rid)
            record = self.registry.get(rid)
            if record is not None:
                # Still writing: it fails; if it ended meanwhile, the core calls for nothing.
                await self.ledger.react(record, Stimulus.FAILURE, why)

    async def close(self) -> None:
        """After drain and after the peer links closed: make durable, release memory."""
        self.life.stop()
        await self.tasks.cancel_all()
        opened = hasattr(self, "ledger")
        if opened:
            if self.fatal is None:
                with contextlib.suppress(JournalFatal):
                    self.group.commit_now()
            self.group.close()
            await self.engines.close()
        if hasattr(self, "offload"):
            self.offload.close()
        await self.dataplane.close()
        if opened and self.fatal is None:
            with contextlib.suppress(JournalFatal):
                self.journal.close()

    async def stop(self) -> None:
        await self.drain()
        await self.close()

    def _journal_failed(self, exc: JournalFatal) -> None:
        # ARCHITECTURE.md: an fsync failure is fatal; exit and replay, never retry.
        if self.fatal is not None:
            return  # reported once; later calls only see the journal refuse
        self.life.fail(exc)
        # One line per failure: on_fatal's owner (the service) says it as it
        # exits; this one only for a node run without such an owner.
        self.log.debug("journal write failed; stopping", error=str(exc))
        self.on_fatal(exc)

    # ------------------------------------------------ for the service's servers

    def status(self) -> StatusDocument:
        return status_document(
            node=self.config.node,
            version=VERSION,
            boot_id=self.boot_id,
            now=self.clock(),
            started_at=self.started_at,
            registry=self.registry,
            engines=self.engines.by_id,
            links=self.port.links(),
            journal_dir=str(self.config.journal.dir),
            journal=self.journal,
            counters=merged(self.transfers.counters, self.refusals, self.integrity.counters),
            peer_engines={peer: sorted(p.engines) for peer, p in self.peers.states.items()},
            dataplane=self.dataplane,
            writes_in_flight=len(self.writes),
            metrics_port=self.metrics_port,
            offload=self.offload.status(),
        )

    async def load_metadata(self) -> None:
        await self.windows.load_metadata()
