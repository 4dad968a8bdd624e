"""The peer daemons: their agents and engines, their messages, their deaths.

The peer manager (daemon/node/peerlink.py) calls back synchronously and in
arrival order. Handlers wait on the journal, so each runs as a task; tasks
are serialized per request id (and behind the peer's own up/down handling)
so that the order the peer sent in is the order they are applied in. What a
message does to a request is the core's decision (statemachine/reactions.py);
this module looks the request up and commits what the core says.

Peers on demand (README.md): a receiver registration may name its pusher's
daemon by address; :meth:`Peers.link_on_demand` dials it (through the peer
manager) and returns once the link is up, its Hello handled and this node's
windows for it opened and announced, so the peer hears ``Engines`` before the
registration's ``Forward``. Such a peer has windows only while it is linked
(:meth:`Peers.wants_windows`); its death is fenced like a configured peer's.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Awaitable, Callable, Hashable, Mapping
from typing import TYPE_CHECKING, Any

import structlog

from daemon.dataplane.plane import DataPlane, DataPlaneError
from daemon.node.integrity import Integrity
from daemon.node.ledger import Ledger
from daemon.node.lifecycle import Lifecycle
from daemon.node.peerauth import PeerRejected
from daemon.node.peerport import PeerPort
from daemon.node.peerstate import PeerState
from daemon.node.serializer import KeyedSerializer
from daemon.node.tasks import Spawn
from daemon.node.transfers import Transfers
from daemon.node.windows import Windows
from schemas import peer as pm
from schemas.kvlayout import RemoteEngine, model_signature
from schemas.layout import Role
from schemas.reasons import Reason
from statemachine import Refusal
from statemachine.notices import final_word, forward_known, no_write_here, on_peer_back
from statemachine.reactions import Cause, Stimulus, Why, react, react_pending

if TYPE_CHECKING:
    from daemon.node.engine_state import EngineState

log = structlog.get_logger("kvpushd.node")
PUSHER, RECEIVER = Role.PUSHER, Role.RECEIVER


class Peers:
    def __init__(
        self,
        *,
        ledger: Ledger,
        dataplane: DataPlane,
        port: PeerPort,
        windows: Windows,
        transfers: Transfers,
        integrity: Integrity,
        engines: Mapping[str, EngineState],
        states: dict[str, PeerState],
        spawn: Spawn,
        life: Lifecycle,
    ) -> None:
        self._ledger = ledger
        self._dataplane = dataplane
        self._port = port
        self._windows = windows
        self._transfers = transfers
        self._integrity = integrity
        self._engines = engines
        self._life = life
        # Shared, read-only, with the transfers (the agent a WRITE goes to).
        self.states = states
        self._order = KeyedSerializer(spawn)
        # Registrations waiting for an on-demand link: it counts as in use.
        self._linking: collections.Counter[str] = collections.Counter()

    # ------------------------------------------------------------- on demand

    def in_use(self, node: str) -> bool:
        """Whether a live request or a registration in progress still needs ``node``.

        The peer manager asks this before closing an on-demand link as idle.
        """
        registry = self._ledger.registry
        return (
            self._linking[node] > 0
            or any(record.peer == node for record in registry.live.values())
            or any(p.registration.peer == node for p in registry.pending.values())
        )

    async def link_on_demand(self, node: str, address: str) -> None:
        """A receiver's registration names ``node`` at ``address``: link to it.

        Returns once the link is up and this node's windows for ``node`` are
        open and announced to it; raises ``Refusal(peer_unreachable)`` if no
        authenticated link came up within ``peer_connect_timeout_s``.
        """
        self._linking[node] += 1
        try:
            await self._port.connect(node, address)
            # Behind the link's up handling (peer_up: its agent, our windows).
            await self._order.submit(_nothing(), ("peer", node))
            if self._windows.lacks(node):
                # An engine registered while the link came up: windows for it too.
                await self._windows.rewindow(node)
        finally:
            self._linking[node] -= 1
            if not self._linking[node]:
                del self._linking[node]

    # -------------------------------------------------- peer manager callbacks

    def on_up(self, node: str, hello: pm.Hello, link: Any) -> None:
        self.check_hello(node, hello)
        self._order.submit(self.peer_up(node, hello), ("peer", node))

    def on_down(self, node: str, reason: str) -> None:
        if self._life.stopping:
            # Shutting down: what is live stays in the journal and fails as
            # "daemon restart" on the next start; journaling now would race
            # the close of the journal.
            return
        self._order.submit(self.peer_down(node, reason), ("peer", node))

    def on_message(self, node: str, message: Any) -> None:
        request_id = getattr(message, "request_id", None)
        key: Hashable = ("request", request_id) if request_id is not None else ("peer", node)
        self._order.submit(self.peer_message(node, message), key, after=("peer", node))

    # ------------------------------------------------------------- up, down

    def check_hello(self, node: str, hello: pm.Hello) -> None:
        """Refuse a peering whose engines cannot exchange KV with ours."""
        local = {model_signature(e.spec.groups) for e in self._engines.values()}
        for engine in hello.engines:
            signature = model_signature(engine.groups)
            if local and signature not in local:
                raise PeerRejected(
                    "layout_mismatch",
                    f"engine {engine.engine_id} on {node} has layout {signature}, "
                    f"this node's engines have {sorted(local)}",
                )

    async def peer_up(self, node: str, hello: pm.Hello) -> None:
        dataplane = self._dataplane
        state = self.states.setdefault(node, PeerState())
        if state.agent_name and state.agent_name != hello.agent_name:
            with contextlib.suppress(Exception):
                await dataplane.remove_remote_agent(state.agent_name)
        if state.boot_id and state.boot_id != hello.boot_id:
            # A new process: the old one, which knew the revoked windows, is gone.
            await dataplane.drop_revoked(node)
        known_agent = state.agent_name
        state.agent_name = await dataplane.add_remote_agent(hello.agent_metadata)
        state.boot_id = hello.boot_id
        if state.agent_name != known_agent:
            state.engines = {}  # a new agent: none of its engines is registered yet
        # The same agent back on a new link keeps what is registered for it;
        # an engine whose windows changed meanwhile is replaced, not added
        # twice (found by the crash soak: "already added with another layout").
        await self._sync_engines(state, hello.engines)
        # The link's own "peer_up" line (peerlink) is the one an operator reads.
        log.debug("peer_engines", peer=node, engines=len(hello.engines))
        if not self._port.is_configured(node):
            # On demand: no windows until now. Open them and tell the peer
            # (Engines), before anything said about a request on this link.
            await self._windows.rewindow(node)
        self._reconcile(node)

    def _reconcile(self, node: str) -> None:
        """After (re)connecting, say again what the peer may have missed."""
        registry = self._ledger.registry
        for record in list(registry.live.values()):
            if record.peer != node:
                continue
            for message in on_peer_back(record, registry.engines.get(record.engine_id)):
                self._port.tell(node, message)

    async def peer_engines(
        self, node: str, engines: tuple[RemoteEngine, ...], metadata: bytes
    ) -> None:
        state = self.states.get(node)
        if state is None or not state.agent_name:
            return
        state.agent_name = await self._dataplane.add_remote_agent(metadata)
        await self._sync_engines(state, engines)

    async def _sync_engines(self, state: PeerState, engines: tuple[RemoteEngine, ...]) -> None:
        """Make the data plane's view of the peer's engines ``engines``, its whole list."""
        dataplane = self._dataplane
        for engine in engines:
            known = state.engines.get(engine.engine_id)
            if known == engine:
                continue
            if known is not None:
                await dataplane.remove_remote_engine(state.agent_name, engine.engine_id)
            await dataplane.add_remote_engine(state.agent_name, engine)
            state.engines[engine.engine_id] = engine
        # The list is the peer's whole view: an engine missing from it left.
        listed = {engine.engine_id for engine in engines}
        for engine_id in [e for e in state.engines if e not in listed]:
            del state.engines[engine_id]
            with contextlib.suppress(DataPlaneError):
                await dataplane.remove_remote_engine(state.agent_name, engine_id)

    async def fence(self, node: str, *, close_link: str = "") -> None:
        """Make sure nothing more moves between ``node`` and this daemon's memory.

        Closes its link first when ``close_link`` says why (a quarantine
        deadline: the link may still be up), forgets its agent (nothing more
        is posted to it) and revokes its windows (daemon/node/windows.py).
        Only after this may the blocks it could write be handed back;
        :meth:`Windows.rewindow` then gives it fresh windows.
        """
        if close_link:
            self._port.close(node, "fenced", close_link)
        state = self.states.get(node)
        if state is not None and state.agent_name:
            with contextlib.suppress(Exception):
                await self._dataplane.remove_remote_agent(state.agent_name)
            state.agent_name = ""
        await self._windows.revoke(node)

    async def fence_in_turn(self, node: str, *, close_link: str) -> None:
        """:meth:`fence`, in the peer's turn: after its up and down handling, never inside.

        For callers outside the peer's order (a quarantine deadline). A fence
        run between a ``peer_up``'s steps forgot the agent that ``peer_up``
        had just added, so the next ``peer_up`` took that agent's engines for
        unregistered and added one whose windows had changed over the old
        ("already added with another layout": found by the crash rounds, a
        decode restarted at a journal write, its replayed quarantine expiring
        while the prefill came back).
        """
        await self._order.submit(self.fence(node, close_link=close_link), ("peer", node))

    async def peer_down(self, node: str, reason: str) -> None:
        """A peer is dead (TTL, disconnect): fence it, fail what depended on it."""
        ledger = self._ledger
        registry = ledger.registry
        await self.fence(node)
        why = Why(Reason.PEER_DEAD, f"peer {node} is dead ({reason})")
        for listed in list(registry.live.values()):
            # Each await below lets other handlers (an engine's release, say)
            # move records on: act on the record as it is now, not as listed.
            record = registry.get(listed.request_id)
            if record is None or record.incarnation != listed.incarnation or record.peer != node:
                continue
            await ledger.react(record, Stimulus.PEER_DEAD, why)
        for pending in list(registry.pending.values()):
            reg = pending.registration
            if registry.pending.get(reg.request_id) is not pending or reg.peer != node:
                continue  # joined by its engine or failed meanwhile, or someone else's
            await ledger.commit(react_pending(pending, Stimulus.PEER_DEAD, why), Cause.PEER_DEAD)
        # A configured peer gets fresh windows for its next link; one on demand
        # gets them when (if) it links again.
        await self._windows.rewindow(node)

    # ------------------------------------------------------------- messages

    async def peer_message(self, node: str, message: Any) -> None:
        handler = _HANDLERS.get(type(message))
        if handler is None:
            log.warning("unexpected peer message", peer=node, type=type(message).__name__)
            return
        try:
            await handler(self, node, message)
        except Refusal as refusal:
            log.info(
                "peer message refused",
                peer=node,
                reason=refusal.reason.value,
                message=refusal.message,
            )

    async def _on_forward(self, node: str, msg: pm.Forward) -> None:
        ledger = self._ledger
        if forward_known(ledger.registry.get(msg.request_id), msg):
            return  # a re-sent forward after reconnecting: already known
        pending = ledger.registry.pending.get(msg.request_id)
        if pending is not None and pending.registration.blocks == msg.blocks:
            return
        try:
            event = ledger.registry.check_peer_registration(
                msg.request_id,
                msg.incarnation,
                node,
                msg.engine_id,
                msg.blocks,
                msg.per_logical,
                msg.fingerprint,
                msg.content,
                msg.answered,
            )
        except Refusal as refusal:
            refused = refusal.journaled(msg.request_id, msg.incarnation, msg.engine_id)
            await ledger.commit([refused], Cause.PEER, peer=node)
            return
        await ledger.commit([event], Cause.PEER)
        await self._transfers.advance(msg.request_id)

    async def _on_cancel(self, node: str, msg: pm.Cancel) -> None:
        ledger = self._ledger
        record = ledger.registry.get(msg.request_id)
        if record is None or record.incarnation != msg.incarnation:
            pending = ledger.registry.pending.get(msg.request_id)
            if pending is not None and pending.registration.incarnation == msg.incarnation:
                await ledger.commit(react_pending(pending, Stimulus.PEER_CANCEL), Cause.PEER)
            else:
                self._port.tell(node, no_write_here(msg))
            return
        # Invariant 2: never start a write the receiver has cancelled. Once
        # the request ended, the receiver gets the final word again.
        events = react(record, Stimulus.PEER_CANCEL)
        if events:
            await ledger.commit(events, Cause.PEER)
        else:
            for message in final_word(record):
                self._port.tell(node, message)

    async def _on_hold(self, node: str, msg: pm.Hold) -> None:
        # The decode side's queue holds the request: the push waits longer
        # for its receiver. A hold for a request not (or no longer) waiting
        # changes nothing: the decode side holds again while it queues.
        ledger = self._ledger
        record = ledger.registry.get(msg.request_id)
        if record is None or record.incarnation != msg.incarnation:
            return
        held = ledger.registry.check_hold(record, ledger.clock())
        if held is not None:
            await ledger.commit([held], Cause.PEER, peer=node)

    async def _on_writing(self, node: str, msg: pm.Writing) -> None:
        await self._receiver_hears(
            msg.request_id,
            msg.incarnation,
            Stimulus.PEER_WRITING,
            Why(num_blocks=msg.num_blocks, nbytes=msg.nbytes),
        )

    async def _on_write_done(self, node: str, msg: pm.WriteDone) -> None:
        record = self._ledger.current(msg.request_id, msg.incarnation)
        # An unchecked request never enters integrity; a checked one goes on
        # only once its blocks compared equal.
        if (
            record is not None
            and self._transfers.checked(record.request_id)
            and await self._integrity.landed(record, final=True) is None
        ):
            return
        await self._receiver_hears(msg.request_id, msg.incarnation, Stimulus.PEER_WRITE_DONE)

    async def _on_digests(self, node: str, msg: pm.Digests) -> None:
        await self._integrity.on_digests(msg)

    async def _on_write_failed(self, node: str, msg: pm.WriteFailed) -> None:
        # "Cancelled by peer" from the pusher means it refused our request.
        reason = (
            msg.reason if msg.reason is not Reason.CANCELLED_BY_PEER else Reason.REFUSED_BY_PEER
        )
        why = Why(reason, f"{node}: {msg.message}")
        await self._receiver_hears(msg.request_id, msg.incarnation, Stimulus.PEER_WRITE_FAILED, why)

    async def _receiver_hears(
        self, request_id: str, incarnation: int, stimulus: Stimulus, why: Why | None = None
    ) -> None:
        # The table has rows for receivers only: a pusher's record ignores these.
        record = self._ledger.current(request_id, incarnation)
        if record is not None:
            await self._ledger.react(record, stimulus, why)

    async def _on_kv_mismatch(self, node: str, msg: pm.KvMismatch) -> None:
        # The decode engine found what this node pushed is not its KV: the
        # pusher's record names both fingerprints, which quarantines the
        # pairing (statemachine/quarantine.py). An unknown one is refused
        # (logged by peer_message), nothing journaled.
        event = self._ledger.registry.check_peer_kv_mismatch(
            node,
            msg.request_id,
            msg.incarnation,
            msg.engine_id,
            layer=msg.layer,
            position=msg.position,
            difference=msg.difference,
            tolerance=msg.tolerance,
            detail=msg.detail,
        )
        await self._ledger.commit([event], Cause.PEER, peer=node)

    async def _on_engines(self, node: str, msg: pm.Engines) -> None:
        await self.peer_engines(node, msg.engines, msg.agent_metadata)


async def _nothing() -> None:
    pass


_HANDLERS: dict[type, Callable[[Peers, str, Any], Awaitable[None]]] = {
    pm.Forward: Peers._on_forward,
    pm.Cancel: Peers._on_cancel,
    pm.Hold: Peers._on_hold,
    pm.Writing: Peers._on_writing,
    pm.WriteDone: Peers._on_write_done,
    pm.WriteFailed: Peers._on_write_failed,
    pm.Engines: Peers._on_engines,
    pm.Digests: Peers._on_digests,
    pm.KvMismatch: Peers._on_kv_mismatch,
}
