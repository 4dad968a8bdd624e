"""Authenticated TCP peer link between two kvpushd daemons.

Wire: the framing of :mod:`daemon.framing` (4-byte big-endian length, msgpack
body) carrying the :data:`schemas.peer.PeerMessage` union.

Connection lifecycle, both directions:

1. Authentication (schemas/peer.py): the acceptor sends ``Challenge(node,
   nonce_a)``; the dialer answers ``Answer(node, nonce_b, mac)`` with
   ``mac = auth_mac(secret, b"dial", nonce_a, dialer, acceptor)``; the acceptor
   checks it and replies ``Welcome(auth_mac(secret, b"accept", nonce_b,
   acceptor, dialer))``, which the dialer checks. Nonces are 32 random bytes,
   fresh per connection, so a recorded Answer or Welcome is useless on another
   connection. The two labels differ, so one side's MAC can never be reflected
   back as the other's.
2. Both sides send ``Hello`` (built by the daemon's ``hello`` callback) and
   read the peer's; the whole of 1 and 2 must finish within
   ``handshake_timeout_s``.
3. ``on_up(node, hello, link)``: the daemon may refuse the peering by raising
   :class:`PeerRejected`; the link then says Goodbye and closes.
4. Up: every received frame refreshes ``last_heard``; each side sends a
   Heartbeat every ``heartbeat_s``; a link silent for ``peer_ttl_s`` (loop
   time, never wall time) is closed. Other messages go to ``on_message``.
5. Down: ``on_down(node, reason)`` exactly once for every link whose
   ``on_up`` returned normally.

Anything unexpected (a message out of order, a wrong MAC, a node name not
admitted, a protocol mismatch, a timeout, an oversized or undecodable frame,
an unknown tag) closes that one connection with ``Goodbye(reason, message)``
where the socket still allows it, and is logged; the manager keeps serving.

Before authentication frames are limited to PREAUTH_FRAME_BYTES and at most
MAX_PENDING_HANDSHAKES inbound connections may be authenticating at once, so
an anonymous client cannot make the daemon buffer much or hold many tasks.

One link per peer pair. Between configured peers (``[[peers]]``) only the
node whose name sorts lower dials; the other only accepts (and refuses a dial
from a configured peer that sorts higher than itself). That makes duplicate
links impossible without a tie-break protocol. A newer authenticated
connection from a peer replaces an older one (the old one is closed with
reason ``replaced``): the peer only dials when it has no link, so the older
one is a half-open leftover of a peer that restarted.

Peers on demand (README.md): with ``accept_unlisted`` the acceptor also admits
a dialer that is not configured, whatever its name sorts as; the MAC over the
cluster secret is what admits it (only its own name is refused). The side
that needs such a peer dials it with :meth:`PeerManager.connect`: one attempt
(concurrent callers share it), bounded by ``connect_timeout_s``, never retried
by the manager. A link dialed so is closed with reason ``idle`` once
``in_use(node)`` has been false and no message but heartbeats has passed for
``idle_close_s``; the acceptor leaves idle closing to the dialer. If both
sides of one peer process pair dial at once (same boot id, opposite
directions) each keeps the connection the lower name dialed and closes the
other (``duplicate``) before announcing it, or replaces its announced one.
"""

from __future__ import annotations

import asyncio
import random
import struct
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, Final

import msgspec
import structlog

from daemon import failpoints
from daemon.node.peerauth import (
    Direction,
    LinkAborted,
    LinkReason,
    PeerAuthError,
    PeerRejected,
    PeerUnreachable,
    Wire,
    accept_auth,
    dial_auth,
    expect,
    node_name,
    parse_host_port,
)
from schemas.config import PeerConfig
from schemas.peer import (
    Answer,
    Challenge,
    Goodbye,
    Heartbeat,
    Hello,
    PeerMessage,
    Welcome,
)

NONCE_BYTES: Final = 32
DEFAULT_HANDSHAKE_TIMEOUT_S: Final = 5.0
DEFAULT_BACKOFF_S: Final = (0.1, 2.0)
# A link whose send buffer grows past this many frames' worth is a peer that
# stopped reading: better to drop it (the TTL would, later) than to grow memory.
_BUFFER_FRAMES: Final = 8
# After close, how long buffered bytes (the Goodbye) may take to drain before
# the socket is aborted; a peer that is not reading must not pin the fd.
_CLOSE_GRACE_S: Final = 1.0
_SHORT_SECRET_BYTES: Final = 16
# Before authentication only Challenge/Answer/Welcome travel, all tiny: an
# anonymous connection must not make us buffer max_frame_bytes.
PREAUTH_FRAME_BYTES: Final = 16 * 1024
# Inbound connections still authenticating; more are turned away at once, so
# a flood of idle connections costs little until the handshake timeout.
MAX_PENDING_HANDSHAKES: Final = 64

_log = structlog.get_logger("kvpushd.peer")
_DECODER: Final = msgspec.msgpack.Decoder(PeerMessage)
_FIELD_LENGTH: Final = struct.Struct(">I")

OnUp = Callable[[str, Hello, "PeerLink"], None]
OnMessage = Callable[[str, PeerMessage], None]
OnDown = Callable[[str, str], None]

# The handshake messages: seeing one of these on an authenticated link is a
# protocol error, never a message for the daemon.
_HANDSHAKE_TYPES: Final = (Challenge, Answer, Welcome, Hello)

# --------------------------------------------------------------------------
# an authenticated link


class PeerLink:
    """One authenticated connection to a peer daemon, after Hello."""

    def __init__(
        self,
        wire: Wire,
        hello: Hello,
        direction: Direction,
        *,
        heartbeat_s: float,
        peer_ttl_s: float,
        on_message: OnMessage,
        on_closed: Callable[[PeerLink, str], None],
        on_demand_address: str = "",
        idle_close_s: float = 0.0,
        in_use: Callable[[], bool] | None = None,
    ) -> None:
        self._wire = wire
        self._hello = hello
        self._direction = direction
        self._heartbeat_s = heartbeat_s
        self._peer_ttl_s = peer_ttl_s
        self._on_message = on_message
        self._on_closed = on_closed
        self._loop = asyncio.get_running_loop()
        self._max_buffered = _BUFFER_FRAMES * wire.max_frame_bytes
        self._log = _log.bind(peer=hello.node, boot_id=hello.boot_id, direction=direction.value)
        self.last_heard = self._loop.time()
        self.opened_at = self.last_heard
        # The address this node dialed on demand ("" for a configured peer or
        # an accepted link); such a link closes itself once idle.
        self.on_demand_address = on_demand_address
        self._idle_close_s = idle_close_s if on_demand_address else 0.0
        self._in_use = in_use
        # Loop time a message other than a heartbeat last passed, either way,
        # or in_use() last said a request needs the peer.
        self.last_active = self.last_heard
        self.closed_at: float | None = None
        self.close_reason = ""
        # True between a normal return of on_up and on_down: on_down is owed.
        self.announced = False
        self._ticker: asyncio.Task[None] | None = None

    @property
    def node(self) -> str:
        return self._hello.node

    @property
    def boot_id(self) -> str:
        return self._hello.boot_id

    @property
    def hello(self) -> Hello:
        return self._hello

    @property
    def direction(self) -> Direction:
        return self._direction

    @property
    def peername(self) -> str:
        return self._wire.peername

    @property
    def closed(self) -> bool:
        return self.closed_at is not None

    @property
    def lifetime(self) -> float:
        end = self.closed_at if self.closed_at is not None else self._loop.time()
        return end - self.opened_at

    def send(self, message: PeerMessage) -> bool:
        """Queue ``message`` on the socket; False if the link is down.

        Never blocks. Raises FrameTooLarge for a message over max_frame_bytes.
        A peer that lets the buffer grow past a few frames' worth is dropped.
        """
        if self.closed:
            return False
        if not isinstance(message, Heartbeat):
            self.last_active = self._loop.time()
        if not self._wire.send(message):
            self.close(LinkReason.PEER_CLOSED, "socket closed", notify_peer=False)
            return False
        if self._wire.buffered > self._max_buffered:
            self.close(LinkReason.BACKPRESSURE, f"{self._wire.buffered} bytes unsent")
            return False
        return True

    def close(self, reason: str, message: str = "", *, notify_peer: bool = True) -> None:
        """Close the link (Goodbye first if ``notify_peer``); idempotent.

        ``on_down`` runs synchronously from here if the daemon saw ``on_up``.
        """
        if self.closed:
            return
        self.closed_at = self._loop.time()
        self.close_reason = reason
        self._wire.close(Goodbye(reason, message or reason) if notify_peer else None)
        if self._ticker is not None and self._ticker is not asyncio.current_task():
            self._ticker.cancel()
        self._log.info("peer_link_closed", reason=reason, detail=message, notified=notify_peer)
        self._on_closed(self, reason)

    def start_ticker(
        self, spawn: Callable[[Coroutine[Any, Any, None], str], asyncio.Task[None]]
    ) -> None:
        self._ticker = spawn(self._tick(), f"peer-tick-{self.node}")

    async def run(self) -> None:
        """Read and dispatch until the link closes; never raises but CancelledError."""
        try:
            while not self.closed:
                message = await self._wire.recv()
                if self.closed:
                    break
                self.last_heard = self._loop.time()
                self._dispatch(message)
        except LinkAborted as exc:
            self.close(exc.reason, exc.message, notify_peer=exc.notify_peer)
        except (asyncio.IncompleteReadError, OSError) as exc:
            self.close(LinkReason.PEER_CLOSED, type(exc).__name__, notify_peer=False)
        finally:
            # Cancelled (manager shutdown): make sure the socket does not outlive us.
            self.close(LinkReason.SHUTDOWN, "reader cancelled")

    def _dispatch(self, message: PeerMessage) -> None:
        if isinstance(message, Heartbeat):
            return  # last_heard is all it is for
        self.last_active = self.last_heard
        if isinstance(message, Goodbye):
            self._log.info("peer_goodbye", peer_reason=message.reason, detail=message.message)
            self.close(f"peer:{message.reason}", message.message, notify_peer=False)
            return
        if isinstance(message, _HANDSHAKE_TYPES):
            raise LinkAborted(
                LinkReason.PROTOCOL_ERROR, f"{type(message).__name__} after authentication"
            )
        try:
            self._on_message(self.node, message)
        except Exception:
            # A message the daemon failed to handle must not vanish silently:
            # dropping the link makes both sides run their peer-death path.
            self._log.exception("peer_on_message_failed", message_type=type(message).__name__)
            self.close(LinkReason.INTERNAL_ERROR, "the peer failed to handle a message")

    async def _tick(self) -> None:
        """Send heartbeats and enforce the TTL, on loop (monotonic) time."""
        next_beat = self._loop.time() + self._heartbeat_s
        yielded = False
        while not self.closed:
            now = self._loop.time()
            silent = now - self.last_heard
            if silent >= self._peer_ttl_s:
                if not yielded:
                    # After a stall of our own loop the peer's frames may sit
                    # unread in the socket: let the reader run once first.
                    yielded = True
                    await asyncio.sleep(0)
                    continue
                self.close(LinkReason.PEER_TTL, f"nothing heard for {silent:.3f}s")
                return
            yielded = False
            if self._idle_for(now) >= self._idle_close_s > 0:
                self.close(
                    LinkReason.IDLE, f"no request needed this link for {self._idle_close_s}s"
                )
                return
            if now >= next_beat:
                # ts is wall time for operators comparing clocks; TTL never reads it.
                self.send(Heartbeat(ts=time.time()))
                next_beat = now + self._heartbeat_s
            deadline = min(next_beat, self.last_heard + self._peer_ttl_s)
            await asyncio.sleep(max(deadline - now, 0.0))

    def _idle_for(self, now: float) -> float:
        """How long nothing has needed this on-demand link (0 for other links)."""
        if not self._idle_close_s:
            return 0.0
        try:
            needed = self._in_use is not None and self._in_use()
        except Exception:
            self._log.exception("peer_in_use_failed")
            needed = True  # keep the link rather than drop one a request may need
        if needed:
            self.last_active = now
        return now - self.last_active


class LinkInfo(msgspec.Struct, frozen=True):
    """One configured peer, or one linked on demand, for ``kvpushd status``."""

    node: str
    address: str
    up: bool
    direction: str = ""  # "dialed" / "accepted" when up
    boot_id: str = ""
    last_heard_age_s: float | None = None
    peername: str = ""
    on_demand: bool = False  # not configured: linked because a registration needed it


# --------------------------------------------------------------------------
# the manager


class PeerManager:
    """Listens, dials and keeps one authenticated link per configured peer.

    ``hello(node)`` builds the Hello for that peer (each peer is told its own
    memory windows). Callbacks run on the event loop and must not block: ``on_up(node, hello,
    link)`` (may raise PeerRejected), ``on_message(node, message)`` in arrival
    order per link, ``on_down(node, reason)`` once per link whose ``on_up``
    returned normally (also on :meth:`close`, with reason ``shutdown``).

    Peers on demand: ``accept_unlisted`` admits authenticated dialers that
    are not configured; :meth:`connect` dials one, within
    ``connect_timeout_s``; a link it dialed closes after ``idle_close_s``
    (0: never) during which ``in_use(node)`` was false and no message passed.
    """

    def __init__(
        self,
        node: str,
        secret: bytes,
        listen: str,
        peers: Sequence[PeerConfig],
        *,
        hello: Callable[[str], Hello],
        on_up: OnUp,
        on_message: OnMessage,
        on_down: OnDown,
        heartbeat_s: float = 1.0,
        peer_ttl_s: float = 5.0,
        max_frame_bytes: int = 4 * 1024 * 1024,
        handshake_timeout_s: float = DEFAULT_HANDSHAKE_TIMEOUT_S,
        backoff_s: tuple[float, float] = DEFAULT_BACKOFF_S,
        accept_unlisted: bool = False,
        connect_timeout_s: float = DEFAULT_HANDSHAKE_TIMEOUT_S,
        idle_close_s: float = 0.0,
        in_use: Callable[[str], bool] | None = None,
    ) -> None:
        _validate(node, secret, peers, heartbeat_s, peer_ttl_s, backoff_s)
        if connect_timeout_s <= 0 or idle_close_s < 0:
            raise ValueError(
                f"need connect_timeout_s > 0 ({connect_timeout_s}) and "
                f"idle_close_s >= 0 ({idle_close_s})"
            )
        self.node = node
        self._secret = secret
        self._listen = listen
        self._peers = {p.node: p for p in peers}
        self._hello = hello
        self._on_up = on_up
        self._on_message = on_message
        self._on_down = on_down
        self._heartbeat_s = heartbeat_s
        self._peer_ttl_s = peer_ttl_s
        self._max_frame_bytes = max_frame_bytes
        self._handshake_timeout_s = handshake_timeout_s
        self._backoff_s = backoff_s
        self._accept_unlisted = accept_unlisted
        self._connect_timeout_s = connect_timeout_s
        self._idle_close_s = idle_close_s
        self._in_use = in_use
        # On-demand dials in progress: callers for the same peer share one.
        self._dialing: dict[str, asyncio.Future[PeerLink]] = {}
        self._links: dict[str, PeerLink] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._server: asyncio.Server | None = None
        self._closing = False
        self._started = False
        self._pending_handshakes = 0
        self._log = _log.bind(node=node)
        self.listen_port: int | None = None

    # ---- public API

    async def bind(self) -> None:
        """Take the listen address (unless ``listen`` is empty) without accepting yet.

        Separate from :meth:`start` so that the daemon learns the port is taken
        before it journals that it started (an OSError: EADDRINUSE and the like).
        """
        if self._listen and self._server is None:
            host, port = parse_host_port(self._listen)
            self._server = await asyncio.start_server(
                self._serve_accepted, host, port, start_serving=False
            )
            self.listen_port = self._server.sockets[0].getsockname()[1]

    async def start(self) -> None:
        """Listen (unless ``listen`` is empty) and start dialing higher-named peers."""
        if self._started:
            raise RuntimeError("PeerManager.start() called twice")
        self._started = True
        await self.bind()
        if self._server is not None:
            await self._server.start_serving()
            host, _ = parse_host_port(self._listen)
            self._log.info("peer_listening", host=host, port=self.listen_port)
        for peer in self._peers.values():
            if self._dials(peer.node):
                self._spawn(self._dial_loop(peer), f"peer-dial-{peer.node}")
            elif not self._listen:
                self._log.error(
                    "peer_unreachable",
                    peer=peer.node,
                    detail="that peer sorts lower, so it dials us, but we do not listen",
                )

    def is_configured(self, node: str) -> bool:
        return node in self._peers

    async def connect(self, node: str, address: str) -> PeerLink:
        """A live link to ``node``, dialing ``address`` (``host:port``) if there is none.

        For a peer that is not configured (a configured one has its own dial
        loop, or dials us). One attempt, shared by concurrent callers, within
        ``connect_timeout_s``; raises :class:`PeerUnreachable` if it does not
        give an authenticated link the daemon accepted. Nothing redials once
        that link closes: the next caller dials again.
        """
        if self._closing:
            raise PeerUnreachable(node, address, LinkReason.SHUTDOWN, "daemon shutting down")
        link = self.link(node)
        if link is not None:
            return link
        if node in self._peers:
            raise ValueError(f"{node!r} is a configured peer: its static link is not up")
        if node == self.node:
            raise PeerUnreachable(node, address, LinkReason.UNKNOWN_NODE, "that is this node")
        try:
            parse_host_port(address)
        except ValueError as exc:
            raise PeerUnreachable(node, address, "bad_address", str(exc)) from None
        future = self._dialing.get(node)
        if future is None:
            future = asyncio.get_running_loop().create_future()
            # A caller cancelled meanwhile must not leave the outcome unread.
            future.add_done_callback(lambda f: f.cancelled() or f.exception())
            self._dialing[node] = future
            self._spawn(self._dial_on_demand(node, address, future), f"peer-on-demand-{node}")
        return await asyncio.shield(future)

    def send(self, node: str, message: PeerMessage) -> bool:
        """Queue ``message`` to ``node``; False if there is no live link to it."""
        failpoints.hit("peer.send")
        link = self._links.get(node)
        return link is not None and link.send(message)

    def is_up(self, node: str) -> bool:
        link = self._links.get(node)
        return link is not None and not link.closed

    def link(self, node: str) -> PeerLink | None:
        link = self._links.get(node)
        return link if link is not None and not link.closed else None

    @property
    def links(self) -> tuple[LinkInfo, ...]:
        """Every configured peer, then every peer linked on demand, by name."""
        now = asyncio.get_running_loop().time()
        configured = [self._info(peer, now) for peer in sorted(self._peers.values(), key=_by_node)]
        on_demand = [
            _link_info(link, link.on_demand_address, now, on_demand=True)
            for node, link in sorted(self._links.items())
            if node not in self._peers and not link.closed
        ]
        return (*configured, *on_demand)

    async def close(self) -> None:
        """Stop listening, close every link (on_down: shutdown), end every task."""
        if self._closing:
            return
        self._closing = True
        if self._server is not None:
            self._server.close()
        for link in list(self._links.values()):
            link.close(LinkReason.SHUTDOWN, "daemon shutting down")
        # Let connection handlers the server already created start, see
        # _closing and leave, so none outlives close().
        await asyncio.sleep(0)
        current = asyncio.current_task()
        while pending := [t for t in self._tasks if t is not current]:
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            self._tasks.difference_update(pending)
        if self._server is not None:
            await self._server.wait_closed()
        self._log.info("peer_manager_closed")

    # ---- internals

    def _dials(self, peer: str) -> bool:
        return self.node < peer

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _info(self, peer: PeerConfig, now: float) -> LinkInfo:
        link = self.link(peer.node)
        if link is None:
            return LinkInfo(node=peer.node, address=peer.address, up=False)
        return _link_info(link, peer.address, now)

    def _check_dialer(self, node: str) -> None:
        """Before the MAC is checked: may a dialer of this name link at all?"""
        if node in self._peers:
            if not node < self.node:
                raise PeerAuthError(
                    LinkReason.WRONG_DIRECTION,
                    f"{node!r} sorts after {self.node!r}: {self.node!r} dials, {node!r} accepts",
                )
            return
        if self._accept_unlisted and node != self.node:
            return  # a peer on demand: the MAC checked next is what admits it
        raise PeerAuthError(LinkReason.UNKNOWN_NODE, f"{node_name(node)} is not a configured peer")

    async def _serve_accepted(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """start_server's handler: one inbound connection, start to end."""
        task = asyncio.current_task()
        assert task is not None
        wire = Wire(reader, writer, self._max_frame_bytes)
        if self._closing:
            wire.close(Goodbye(LinkReason.SHUTDOWN, "daemon shutting down"))
            return
        if self._pending_handshakes >= MAX_PENDING_HANDSHAKES:
            self._log.warning("peer_busy", remote=wire.peername, pending=self._pending_handshakes)
            wire.close(Goodbye(LinkReason.BUSY, "too many connections authenticating"))
            return
        self._tasks.add(task)
        try:
            self._pending_handshakes += 1
            try:
                link = await self._establish(wire, Direction.ACCEPTED, None)
            finally:
                self._pending_handshakes -= 1
            if link is not None:
                await link.run()
        except asyncio.CancelledError:
            # Only close() cancels us. Ending normally rather than cancelled
            # matters on 3.11: start_server's done-callback calls
            # task.exception() on a cancelled task and logs a spurious error.
            pass
        except Exception:
            self._log.exception("peer_connection_failed", remote=wire.peername)
        finally:
            self._tasks.discard(task)
            wire.close(self._shutdown_goodbye())

    async def _dial_loop(self, peer: PeerConfig) -> None:
        """Keep a link to ``peer``: redial with capped exponential backoff.

        The delay only resets after a link that stayed up at least as long as
        the cap, so a peer that refuses us right after Hello (PeerRejected) or
        a dead address is retried a few times a second at first, then every
        ``backoff_s[1]``, never in a hot loop.
        """
        low, high = self._backoff_s
        delay = low
        failures = 0
        while not self._closing:
            try:
                lived = await self._dial_once(peer, quiet=failures > 0)
            except Exception:
                self._log.exception("peer_dial_failed", peer=peer.node)
                lived = 0.0
            if lived >= high:
                delay, failures = low, 0
            else:
                failures += 1
            await asyncio.sleep(delay * random.uniform(0.8, 1.2))  # jitter: no lockstep
            delay = min(delay * 2, high)

    async def _dial_once(self, peer: PeerConfig, *, quiet: bool) -> float:
        """One connection to ``peer``; returns how long the link was up (0 if never)."""
        host, port = parse_host_port(peer.address)
        try:
            async with asyncio.timeout(self._handshake_timeout_s):
                reader, writer = await asyncio.open_connection(host, port)
        except OSError as exc:  # TimeoutError is an OSError
            log = self._log.debug if quiet else self._log.warning
            log("peer_connect_failed", peer=peer.node, address=peer.address, error=repr(exc))
            return 0.0
        wire = Wire(reader, writer, self._max_frame_bytes)
        try:
            link = await self._establish(wire, Direction.DIALED, peer.node)
            if link is None:
                return 0.0
            await link.run()
            return link.lifetime
        finally:
            # Cancelled mid-handshake by close(): the socket must not outlive us.
            wire.close(self._shutdown_goodbye())

    async def _dial_on_demand(
        self, node: str, address: str, future: asyncio.Future[PeerLink]
    ) -> None:
        """:meth:`connect`'s one attempt; then, if it linked, read the link until it closes."""
        host, port = parse_host_port(address)
        wire: Wire | None = None
        outcome: PeerLink | tuple[str, str]
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                try:
                    reader, writer = await asyncio.open_connection(host, port)
                except OSError as exc:
                    outcome = (LinkReason.CONNECT_FAILED, repr(exc))
                else:
                    wire = Wire(reader, writer, self._max_frame_bytes)
                    outcome = await self._try_establish(
                        wire, Direction.DIALED, node, on_demand_address=address
                    )
        except TimeoutError:
            outcome = (
                LinkReason.HANDSHAKE_TIMEOUT,
                f"no authenticated link within {self._connect_timeout_s}s",
            )
        except BaseException:
            # Cancelled by close(): the socket must not outlive us.
            if wire is not None:
                wire.close(self._shutdown_goodbye())
            if not future.done():
                future.set_exception(
                    PeerUnreachable(node, address, LinkReason.SHUTDOWN, "daemon shutting down")
                )
            raise
        finally:
            if self._dialing.get(node) is future:
                del self._dialing[node]
        if isinstance(outcome, tuple):
            if wire is not None:
                wire.close(None)
            self._log.warning(
                "peer_on_demand_failed",
                peer=node,
                address=address,
                reason=outcome[0],
                detail=outcome[1],
            )
            future.set_exception(PeerUnreachable(node, address, *outcome))
            return
        link = outcome
        if link.closed:
            # Refused by the daemon, or the duplicate of a link that came up
            # from the other side meanwhile (which serves just as well).
            live = self.link(node)
            if live is not None:
                future.set_result(live)
            else:
                future.set_exception(
                    PeerUnreachable(node, address, link.close_reason, "the peering was refused")
                )
            return
        future.set_result(link)
        try:
            await link.run()
        finally:
            assert wire is not None
            wire.close(self._shutdown_goodbye())

    def _shutdown_goodbye(self) -> Goodbye | None:
        if not self._closing:
            return None
        return Goodbye(LinkReason.SHUTDOWN, "daemon shutting down")

    async def _establish(
        self, wire: Wire, direction: Direction, expected: str | None
    ) -> PeerLink | None:
        """Authenticate, exchange Hello, hand the link to the daemon; None if refused."""
        outcome = await self._try_establish(wire, direction, expected)
        return outcome if isinstance(outcome, PeerLink) else None

    async def _try_establish(
        self,
        wire: Wire,
        direction: Direction,
        expected: str | None,
        *,
        on_demand_address: str = "",
    ) -> PeerLink | tuple[str, str]:
        """As :meth:`_establish`, but a failure is (reason, detail).

        The link returned may already be closed: the daemon refused it in
        ``on_up``, or it lost to a duplicate (see :meth:`_adopt`).
        """
        try:
            hello = await self._handshake(wire, direction, expected)
        except LinkAborted as exc:
            self._log.warning(
                "peer_refused",
                direction=direction.value,
                remote=wire.peername,
                expected=expected,
                reason=exc.reason,
                detail=exc.message,
            )
            wire.close(Goodbye(exc.reason, exc.message) if exc.notify_peer else None)
            return exc.reason, exc.message
        except (asyncio.IncompleteReadError, OSError) as exc:
            self._log.info(
                "peer_handshake_closed",
                direction=direction.value,
                remote=wire.peername,
                error=type(exc).__name__,
            )
            wire.close(None)
            return LinkReason.PEER_CLOSED, f"closed during the handshake ({type(exc).__name__})"
        in_use = self._in_use
        node = hello.node
        link = PeerLink(
            wire,
            hello,
            direction,
            heartbeat_s=self._heartbeat_s,
            peer_ttl_s=self._peer_ttl_s,
            on_message=self._on_message,
            on_closed=self._link_closed,
            on_demand_address=on_demand_address,
            idle_close_s=self._idle_close_s,
            in_use=(lambda: in_use(node)) if in_use is not None else None,
        )
        self._adopt(link)
        return link

    async def _handshake(self, wire: Wire, direction: Direction, expected: str | None) -> Hello:
        try:
            async with asyncio.timeout(self._handshake_timeout_s):
                if expected is None:
                    node = await accept_auth(wire, self.node, self._secret, self._check_dialer)
                else:
                    await dial_auth(wire, self.node, self._secret, expected)
                    node = expected
                wire.recv_limit = wire.max_frame_bytes  # authenticated: Hello may be large
                wire.send(self._own_hello(node))
                hello = await expect(wire, Hello)
        except TimeoutError as exc:
            raise LinkAborted(
                LinkReason.HANDSHAKE_TIMEOUT,
                f"handshake not done within {self._handshake_timeout_s}s",
            ) from exc
        if hello.node != node:
            raise LinkAborted(
                LinkReason.PROTOCOL_ERROR,
                f"authenticated as {node!r} but Hello says {node_name(hello.node)}",
            )
        return hello

    def _own_hello(self, peer: str) -> Hello:
        try:
            hello = self._hello(peer)
        except Exception as exc:
            self._log.exception("peer_hello_failed")
            raise LinkAborted(LinkReason.INTERNAL_ERROR, "cannot build Hello") from exc
        if hello.node != self.node:
            raise LinkAborted(
                LinkReason.INTERNAL_ERROR, f"Hello names {hello.node!r}, not {self.node!r}"
            )
        return hello

    def _adopt(self, link: PeerLink) -> None:
        """Make ``link`` the peer's link and tell the daemon (which may refuse it)."""
        if self._closing:
            link.close(LinkReason.SHUTDOWN, "daemon shutting down")
            return
        old = self._links.get(link.node)
        if (
            old is not None
            and old.direction is not link.direction
            and old.boot_id == link.boot_id
            and (link.direction is Direction.DIALED) != (self.node < link.node)
        ):
            # Both sides dialed the same peer process at once: the peer does
            # the same sums and keeps the connection the lower name dialed.
            link.close(LinkReason.DUPLICATE, "the peer's own connection to us is kept")
            return
        if old is not None:
            old.close(LinkReason.REPLACED, "a newer connection from this peer took over")
        self._links[link.node] = link
        # Announced before the call: if the daemon closes the link from inside
        # on_up, it still gets the matching on_down.
        link.announced = True
        try:
            self._on_up(link.node, link.hello, link)
        except PeerRejected as exc:
            link.announced = False
            self._log.warning(
                "peer_rejected", peer=link.node, reason=exc.reason, detail=exc.message
            )
            link.close(exc.reason, exc.message)
            return
        except Exception:
            link.announced = False
            self._log.exception("peer_on_up_failed", peer=link.node)
            link.close(LinkReason.INTERNAL_ERROR, "the peer failed to accept the link")
            return
        if not link.closed:
            link.start_ticker(self._spawn)
            self._log.info(
                "peer_up",
                peer=link.node,
                boot_id=link.boot_id,
                direction=link.direction.value,
                remote=link.peername,
            )

    def _link_closed(self, link: PeerLink, reason: str) -> None:
        if self._links.get(link.node) is link:
            del self._links[link.node]
        if not link.announced:
            return
        link.announced = False
        # One line per link that goes down (peers.py logs none): quiet when the
        # link was meant to end, a warning when the peer was lost.
        quiet = reason.removeprefix("peer:") in (LinkReason.IDLE, LinkReason.SHUTDOWN)
        (self._log.info if quiet else self._log.warning)(
            "peer_down", peer=link.node, boot_id=link.boot_id, reason=reason
        )
        try:
            self._on_down(link.node, reason)
        except Exception:
            self._log.exception("peer_on_down_failed", peer=link.node)


def _by_node(peer: PeerConfig) -> str:
    return peer.node


def _link_info(link: PeerLink, address: str, now: float, *, on_demand: bool = False) -> LinkInfo:
    return LinkInfo(
        node=link.node,
        address=address,
        up=True,
        direction=link.direction.value,
        boot_id=link.boot_id,
        last_heard_age_s=round(now - link.last_heard, 6),
        peername=link.peername,
        on_demand=on_demand,
    )


def _validate(
    node: str,
    secret: bytes,
    peers: Sequence[PeerConfig],
    heartbeat_s: float,
    peer_ttl_s: float,
    backoff_s: tuple[float, float],
) -> None:
    if not node:
        raise ValueError("node name is empty")
    if not secret:
        raise ValueError("peer secret is empty")
    names = [p.node for p in peers]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate peer node names in {names}")
    if node in names:
        raise ValueError(f"node {node!r} lists itself as a peer")
    if not 0 < heartbeat_s < peer_ttl_s:
        raise ValueError(f"need 0 < heartbeat_s ({heartbeat_s}) < peer_ttl_s ({peer_ttl_s})")
    if not 0 < backoff_s[0] <= backoff_s[1]:
        raise ValueError(f"need 0 < backoff_s[0] <= backoff_s[1], got {backoff_s}")
    for peer in peers:
        parse_host_port(peer.address)
