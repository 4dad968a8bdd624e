"""What each engine RPC does: checks by the core, commits through the ledger.

The engine server (daemon/node/engine_server.py) decodes a frame and calls
the handler for its type here; the handler asks the core what the request
calls for (a ``check_*`` of the registry or a reaction of
statemachine/reactions.py) and commits the events through the ledger, which
applies them, journals them, waits for durability and only then tells the
engine and the peer what the core says they are owed. A ``Refusal`` raised
here is journaled by :meth:`EngineRpc.record_refusal` before the engine
hears of it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import structlog

from daemon.journal.format import MAX_RECORD_BYTES, JournalFatal
from daemon.node.engine_state import EngineSession
from daemon.node.engines import Engines
from daemon.node.integrity import Integrity
from daemon.node.ledger import Commit, Ledger
from daemon.node.lifecycle import Lifecycle
from daemon.node.offload import OffloadTier
from daemon.node.peerport import PeerPort
from daemon.node.peers import Peers
from daemon.node.tasks import Spawn
from daemon.node.transfers import Transfers
from schemas import peer as pm
from schemas import rpc
from schemas.config import LimitsConfig
from schemas.events import Registered, Released
from schemas.layout import Role
from schemas.reasons import Reason
from schemas.state import State
from statemachine import Refusal
from statemachine.reactions import Cause, Stimulus, react

log = structlog.get_logger("kvpushd.node")
PUSHER, RECEIVER = Role.PUSHER, Role.RECEIVER
# An engine call's handler: the engine server calls it with the connection it came on.
Handler = Callable[[EngineSession, Any], Awaitable[rpc.Reply]]
# Room for a record's envelope (version, node, seq, time) or a Forward's other
# fields around a registration's blocks.
_RECORD_HEADROOM = 4096
_size_encoder = msgspec.msgpack.Encoder()


@dataclass(frozen=True, slots=True)
class Admitted:
    """A call checked and its records appended: its reply, once they are durable."""

    reply: rpc.Reply
    commits: tuple[Commit, ...]
    then: Callable[[], None] | None = None  # run once durable, before the reply

    async def finish(self) -> rpc.Reply:
        for committed in self.commits:
            await committed  # durable, then the notices it owes go out
        if self.then is not None:
            self.then()
        return self.reply


class EngineRpc:
    def __init__(
        self,
        *,
        limits: LimitsConfig,
        on_demand_peers: bool,
        ledger: Ledger,
        engines: Engines,
        peers: Peers,
        port: PeerPort,
        transfers: Transfers,
        integrity: Integrity,
        spawn: Spawn,
        life: Lifecycle,
        offload: OffloadTier | None = None,
    ) -> None:
        self._limits = limits
        self._on_demand = on_demand_peers
        self._ledger = ledger
        self._engines = engines
        self._peers = peers
        self._port = port
        self._transfers = transfers
        self._integrity = integrity
        self._spawn = spawn
        self._life = life  # failed: the journal failed, nothing more is journaled
        self._offload = offload  # the offload tier's calls (daemon/node/offload.py)

    def handlers(self) -> dict[type, Handler]:
        """The engine server's table: each request type and the call that serves it."""
        return {
            rpc.RegisterEngine: self.register_engine,
            rpc.RegisterRequest: self.register_request,
            rpc.KvReady: self.kv_ready,
            rpc.Release: self.release,
            rpc.Abort: self.abort,
            rpc.Hold: self.hold,
            rpc.KvMismatch: self.kv_mismatch,
            rpc.QuarantineList: self.quarantine_list,
            rpc.QuarantineClear: self.quarantine_clear,
            **(self._offload.handlers() if self._offload is not None else {}),
        }

    async def register_engine(self, session: EngineSession, req: rpc.RegisterEngine) -> rpc.Reply:
        return await self._engines.register(session, req)

    # Each call is admitted at once (checked by the core, its records
    # appended, no await in between) and answered once those records are
    # durable (Admitted.finish). A batch admits all its ops in one pass, so
    # their records share one group commit, then finishes them.

    def waits_first(self, op: rpc.BatchOp) -> bool:
        """Whether ``op`` must wait before it is admitted (it dials a peer on demand)."""
        if type(op) is rpc.RegisterRequest:
            return op.role is RECEIVER and self._dials(op.peer, op.peer_address)
        if type(op) is rpc.Hold:
            return self._dials(op.peer, op.peer_address)
        return False

    def admit(self, session: EngineSession, op: rpc.BatchOp) -> Admitted:
        """Check and append ``op`` now (``Refusal``: nothing appended); see :meth:`waits_first`."""
        if isinstance(op, rpc.KvReady):
            return self._admit_kv_ready(session, op)
        if isinstance(op, rpc.Release):
            return self._admit_release(session, op)
        if isinstance(op, rpc.Abort):
            return self._admit_abort(session, op)
        if isinstance(op, rpc.RegisterRequest):
            return self._admit_register(session, op)
        return self._admit_hold(op)

    async def register_request(self, session: EngineSession, req: rpc.RegisterRequest) -> rpc.Reply:
        if req.role is RECEIVER and self._dials(req.peer, req.peer_address):
            if self._life.stopping:
                raise Refusal(Reason.DAEMON_RESTART, "the daemon is draining")
            self._engines.own(session, req.engine_id)
            # Dial the pusher's daemon (README.md, "Peers on demand"); the
            # admission then checks again what the wait may have changed.
            await self._peers.link_on_demand(req.peer, req.peer_address)
        return await self._admit_register(session, req).finish()

    def _admit_register(self, session: EngineSession, req: rpc.RegisterRequest) -> Admitted:
        if self._life.stopping:
            raise Refusal(Reason.DAEMON_RESTART, "the daemon is draining")
        engines = self._engines
        engine = engines.own(session, req.engine_id)
        limit = self._limits.max_live_per_engine
        if engine.live >= limit:
            raise Refusal(
                Reason.ENGINE_IN_USE,
                f"engine {req.engine_id} has {engine.live} live requests, the limit is {limit}",
            )
        if req.role is RECEIVER:
            if not req.peer:
                raise Refusal(Reason.UNKNOWN_REQUEST, "a receiver registration must name its peer")
            if not self._port.is_up(req.peer):
                raise Refusal(Reason.PEER_DEAD, f"peer {req.peer!r} is not connected")
        # The core grants the offload slots (never one a live request holds,
        # nor one the pool has not zeroed yet); the grant is journaled with
        # the registration, so it survives a crash.
        event = self._ledger.registry.check_register(
            req.request_id,
            req.incarnation,
            req.role,
            req.engine_id,
            req.peer,
            req.blocks,
            req.offload_slots,
            engines.unavailable_slots(engine),
            req.content,
            req.answered,
        )
        self._check_fits(event)
        self._integrity.check_slots(engine, event)
        engines.take_offload(engine, event)
        try:
            registered = self._ledger.commit([event], Cause.ENGINE)
        except BaseException:
            engines.give_back_offload(engine, event)
            raise
        engines.granted(event)
        engine.live += 1
        accepted = rpc.RequestAccepted(
            req.id, state=State.REGISTERED.value, offload_slots=event.offload_slots
        )
        # A receiver's registration is forwarded to its peer once durable; a
        # pusher's advances (trims, if its receiver is known) once durable.
        then = self._advance_later(req.request_id) if req.role is PUSHER else None
        return Admitted(accepted, (registered,), then)

    def _advance_later(self, request_id: str) -> Callable[[], None]:
        def advance() -> None:
            self._spawn(self._transfers.advance(request_id))

        return advance

    def _dials(self, peer: str, address: str) -> bool:
        """A peer named by address that is not configured (and may be linked now)."""
        return (
            bool(peer) and bool(address) and self._on_demand and not self._port.is_configured(peer)
        )

    def _check_fits(self, event: Registered) -> None:
        """Refuse a registration too big for one journal record or one peer frame.

        The core expands logical blocks to kernel blocks, so a request frame
        within the limit can become a record (and a Forward) many times its
        size. Without this check (found by tests/test_fuzz.py) an oversized
        record failed to append after the registry had applied it, leaving
        live state the journal did not have, and an oversized Forward was
        journaled but never reached the peer; both replied "internal".
        """
        n_blocks = sum(len(ids) for ids in event.blocks)
        strings = (
            len(event.request_id) + len(event.engine_id) + len(event.peer) + len(event.content)
        )
        limit = min(self._limits.max_frame_bytes, MAX_RECORD_BYTES) - _RECORD_HEADROOM
        # 9 bytes is the largest msgpack int and 4 bytes per character the
        # largest UTF-8 one: most registrations pass without being encoded.
        if 9 * n_blocks + 4 * strings <= limit:
            return
        size = len(_size_encoder.encode(event))
        if size > limit:
            raise Refusal(
                Reason.BLOCK_OUT_OF_RANGE,
                f"request {event.request_id}: {n_blocks} kernel blocks encode to {size} bytes, "
                f"over the {limit}-byte limit of one journal record and one peer frame",
            )

    async def kv_ready(self, session: EngineSession, req: rpc.KvReady) -> rpc.Reply:
        return await self._admit_kv_ready(session, req).finish()

    def _admit_kv_ready(self, session: EngineSession, req: rpc.KvReady) -> Admitted:
        record = self._engines.own_request(session, req.request_id, req.incarnation)
        ready = self._ledger.commit([self._ledger.registry.check_kv_ready(record)], Cause.ENGINE)
        # Trim and start the write now: their records join kv_ready's group
        # commit (one fdatasync), and the WRITE is posted while it runs.
        moved = self._transfers.step(req.request_id)
        commits = (ready,) if moved is None else (ready, moved)
        return Admitted(rpc.Ok(req.id), commits)

    async def release(self, session: EngineSession, req: rpc.Release) -> rpc.Reply:
        return await self._admit_release(session, req).finish()

    def _admit_release(self, session: EngineSession, req: rpc.Release) -> Admitted:
        record = self._engines.own_request(session, req.request_id, req.incarnation)
        events = react(record, Stimulus.ENGINE_RELEASE)
        committed = self._ledger.commit(events, Cause.ENGINE)
        if any(isinstance(e, Released) for e in events):
            return Admitted(rpc.Ok(req.id), (committed,))
        waiting = rpc.Deferred(req.id, "a write may still be in flight; released once it ends")
        return Admitted(waiting, (committed,))

    async def abort(self, session: EngineSession, req: rpc.Abort) -> rpc.Reply:
        return await self._admit_abort(session, req).finish()

    def _admit_abort(self, session: EngineSession, req: rpc.Abort) -> Admitted:
        record = self._engines.own_request(session, req.request_id, req.incarnation)
        committed = self._ledger.commit(react(record, Stimulus.ENGINE_ABORT), Cause.ENGINE)
        return Admitted(rpc.Ok(req.id), (committed,))

    async def hold(self, session: EngineSession, req: rpc.Hold) -> rpc.Reply:
        """Tell the prefill daemon a queued decode request will register (rpc.Hold)."""
        if req.peer and self._dials(req.peer, req.peer_address):
            await self._peers.link_on_demand(req.peer, req.peer_address)
        return await self._admit_hold(req).finish()

    def _admit_hold(self, req: rpc.Hold) -> Admitted:
        if not req.peer:
            raise Refusal(Reason.UNKNOWN_REQUEST, "a hold must name the prefill node")
        if not self._port.tell(req.peer, pm.Hold(req.request_id, req.incarnation)):
            raise Refusal(Reason.PEER_DEAD, f"peer {req.peer!r} is not connected")
        return Admitted(rpc.Ok(req.id), ())

    async def kv_mismatch(self, session: EngineSession, req: rpc.KvMismatch) -> rpc.Reply:
        """A decode engine found a load's KV is not its own: journal it, tell the prefill daemon.

        The receiver may be released already; the core remembers the last
        released ones (``Registry.find_landed``). Journaled here first, then
        the prefill daemon hears of it (``peer.KvMismatch``) and quarantines
        the pairing there (statemachine/quarantine.py).
        """
        event, found = self._ledger.registry.check_kv_mismatch(
            req.request_id,
            req.incarnation,
            layer=req.layer,
            position=req.position,
            difference=req.difference,
            tolerance=req.tolerance,
            detail=req.detail,
        )
        self._engines.own(session, found.engine_id)
        await self._ledger.commit([event], Cause.ENGINE)
        told = self._port.tell(
            found.peer,
            pm.KvMismatch(
                req.request_id, req.incarnation, found.engine_id, req.layer, req.position,
                req.difference, req.tolerance, req.detail,
            ),
        )  # fmt: skip
        if not told:
            # Journaled here; the prefill daemon cannot quarantine what it
            # never hears of: say so where an operator looks.
            log.warning(
                "kv mismatch not told to its prefill daemon: no link",
                request_id=req.request_id,
                peer=found.peer,
            )
        return rpc.Ok(req.id)

    async def quarantine_list(self, session: EngineSession, req: rpc.QuarantineList) -> rpc.Reply:
        return rpc.QuarantineReply(req.id, tuple(self._ledger.registry.quarantine.values()))

    async def quarantine_clear(self, session: EngineSession, req: rpc.QuarantineClear) -> rpc.Reply:
        """An operator ends quarantines (``kvpushd quarantine clear``), journaled for replay."""
        registry = self._ledger.registry
        cleared = registry.check_clear(req.ids, req.every)
        if cleared:
            await self._ledger.commit(cleared, Cause.ENGINE)
        ids = tuple(event.quarantine_id for event in cleared)
        if ids:
            log.warning("quarantine cleared", ids=list(ids))
        return rpc.QuarantineReply(req.id, tuple(registry.quarantine.values()), ids)

    def refuse(self, request: Any, refusal: Refusal) -> Commit | None:
        """Append a refused engine request's ``Refused``; None if the journal failed."""
        if self._life.failed:
            return None
        event = refusal.journaled(
            getattr(request, "request_id", ""),
            getattr(request, "incarnation", 0),
            getattr(request, "engine_id", ""),
        )
        try:
            return self._ledger.commit([event], Cause.ENGINE)
        except JournalFatal:
            return None

    async def record_refusal(self, request: Any, refusal: Refusal) -> bool:
        """Journal a refused engine request; the registry itself is unchanged.

        False when the refusal is not durable (the journal failed): then the
        engine must not be told of it either (persist before telling).
        """
        committed = self.refuse(request, refusal)
        if committed is None:
            return False
        try:
            await committed
        except JournalFatal:
            return False
        return True
