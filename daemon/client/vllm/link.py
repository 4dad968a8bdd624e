"""The worker's link to its daemon: its own event loop thread, the connection, reconnection.

vLLM's thread never waits for the daemon: it hands calls to the loop
(``spawn``: a lock-guarded list the loop takes whole, so one engine step's
calls leave as one Batch frame) and the loop hands back what the daemon
said through the session's queue. The link owns the loop, the connection
and its generation (a transfer belongs to the connection it was posted
under), and supervises it: a lost connection is noticed at once and
reconnected with backoff. What a connection means for transfers is the
``Session``'s (daemon/client/vllm/calls.py): the link tells it when a new
connection needs the engine registered, when the daemon that held the
last one lived, and when it is known gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Coroutine
from typing import Any, Final, Protocol

from daemon.client.engine_client import EngineClient
from daemon.client.errors import ClientError, DaemonUnreachable, RpcError
from schemas import rpc

# Under vLLM's logger tree: vLLM prints only that tree (its "vllm" logger
# does not propagate), so the connector's lines reach vLLM's log this way.
log = logging.getLogger(f"vllm.{__name__}")

# Reconnecting to a daemon that went away: first try soon, then back off.
RECONNECT_FIRST_S: Final = 0.2
RECONNECT_MAX_S: Final = 2.0
# The daemon's reply to a registration waits for its fsync: bounded, not short.
CALL_TIMEOUT_S: Final = 30.0


class Session(Protocol):
    """What the link's connections mean for the transfers (all on the loop thread)."""

    # The memory the engine shares by descriptor, passed with every Hello
    # (set by vLLM's thread before the link starts; read-only afterwards).
    descriptors: tuple[int, ...]

    async def register(self, client: EngineClient) -> None:
        """Register the engine (and its slices) on a new connection."""

    def on_event(self, event: rpc.Event, client: EngineClient) -> None:
        """An event from the daemon, on the connection it came on."""

    def lived(self, client: EngineClient) -> None:
        """The daemon of the lost connection answered the new one: it lived."""

    def gone(self, generation: int) -> None:
        """The daemon of connection ``generation`` is gone, and its transfers with it."""


class Link:
    def __init__(self, socket_path: str, engine_id: str, session: Session) -> None:
        self.socket = socket_path
        self._engine_id = engine_id
        self._session = session
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="kvpushd-connector", daemon=True
        )
        self._thread.start()
        # Calls vLLM's thread hands the loop between two of the loop's turns
        # start in one turn, so the client sends them as one Batch frame
        # (schemas/rpc.py): one engine step's registrations, kv_readys and
        # releases, one frame (spawn).
        self._spawn_lock = threading.Lock()
        self._to_spawn: list[Coroutine[Any, Any, None]] = []
        self._running: set[asyncio.Task[None]] = set()
        self._closing = False
        # The connection to the daemon and its generation (loop thread).
        self._client: EngineClient | None = None
        self._generation = 0

    @property
    def generation(self) -> int:
        """The current connection's generation (read on vLLM's thread when it posts)."""
        return self._generation

    def client(self, generation: int | None = None) -> EngineClient:
        """The live connection (the one ``generation`` was posted under, if given)."""
        client = self._client
        if client is None or client.closed:
            raise RuntimeError("KvpushdConnector: not connected to kvpushd")
        if generation is not None and generation != self._generation:
            raise RuntimeError("KvpushdConnector: the daemon connection was replaced")
        return client

    def start(self) -> None:
        """Connect now if the daemon is up (vLLM's thread waits), and supervise from then on."""
        try:
            self.run(self._connect())
        except (ClientError, OSError) as exc:
            # vLLM serves without remote KV until its daemon is up (pushes
            # and loads end at once, as with a daemon that went away).
            log.warning(
                "kvpushd: no daemon at %s (%s): serving without remote KV until it is up",
                self.socket,
                exc,
            )
        self.spawn(self._supervise())

    async def _connect(self, lost: tuple[int, str] | None = None) -> None:
        """Connect and register the engine; ``lost``: (generation, boot id) of the connection
        that ended, whose daemon's fate this connection tells."""
        # The connection an event came on (resent outcomes come before the
        # registration's reply, while this connection is not yet the current one).
        came_on: list[EngineClient] = []
        client = await EngineClient.connect(
            self.socket,
            client_name=f"vllm:{self._engine_id}",
            on_event=lambda event: self._session.on_event(event, came_on[0]),
            queue_events=False,  # the callback is the only consumer
            # The KV memory, if shared by descriptor: a new daemon maps it anew.
            descriptors=self._session.descriptors,
        )
        came_on.append(client)
        lived = lost is not None and bool(lost[1]) and client.boot_id == lost[1]
        if lost is not None and not lived:
            # Another daemon process: the one that held those transfers is
            # gone, and with it every NIXL operation it could still post.
            self._session.gone(lost[0])
        try:
            await self._session.register(client)
        except BaseException:
            await client.close()
            raise
        self._generation += 1
        self._client = client
        log.info("kvpushd: engine %s registered with %s", self._engine_id, self.socket)
        if lived:
            log.warning("kvpushd: the daemon at %s lived; its transfers go on", self.socket)
            self._session.lived(client)

    async def _supervise(self) -> None:
        """Notice the daemon going away at once (not at the next step) and reconnect.

        What the lost connection held ends first (``DaemonLost``, in order
        before any event of the next connection); a restarted daemon then
        gets the engine registered again and serves new transfers.
        """
        lost: tuple[int, str] | None = None
        while not self._closing:
            client = self._client
            if client is not None:
                why = await client.wait_closed()
                if self._closing:
                    return
                log.warning("kvpushd: lost the daemon at %s: %s", self.socket, why)
                self._client = None
                # Not an answer: the daemon may live and still write (a
                # connection it closed, a reset). Its transfers end only once
                # it is known gone: nobody listens, or another process answers.
                lost = (self._generation, client.boot_id)
            delay = RECONNECT_FIRST_S
            while not self._closing:
                try:
                    await self._connect(lost)
                    lost = None
                    break
                except DaemonUnreachable as exc:
                    if lost is not None:
                        self._session.gone(lost[0])
                        lost = None
                    log.debug("kvpushd: reconnect to %s failed: %s", self.socket, exc)
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, RECONNECT_MAX_S)
                except (ClientError, OSError) as exc:
                    # A daemon that answers and refuses is worth an operator's look;
                    # one that is not back yet is not.
                    report = log.warning if isinstance(exc, RpcError) else log.debug
                    report("kvpushd: reconnect to %s failed: %s", self.socket, exc)
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, RECONNECT_MAX_S)

    # the thread bridge -----------------------------------------------------

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Start ``coro`` on the loop (from either thread), with the others of this turn."""
        with self._spawn_lock:
            self._to_spawn.append(coro)
            if len(self._to_spawn) > 1:
                return  # the loop has yet to start the ones before: it starts this too
        self._loop.call_soon_threadsafe(self._start_spawned)

    def _start_spawned(self) -> None:
        """On the loop: start every call handed over since the last turn, together."""
        with self._spawn_lock:
            coros, self._to_spawn = self._to_spawn, []
        for coro in coros:
            task = self._loop.create_task(coro)
            self._running.add(task)
            task.add_done_callback(self._running.discard)
            task.add_done_callback(_log_failure)

    def run(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run ``coro`` on the loop and wait for it (vLLM's thread; bounded)."""
        asyncio.run_coroutine_threadsafe(coro, self._loop).result(CALL_TIMEOUT_S)

    def close(self) -> None:
        self._closing = True
        if self._client is not None:
            with contextlib.suppress(Exception):
                self.run(self._client.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)


def _log_failure(future: Any) -> None:
    if future.cancelled():
        return  # the loop stopped (close)
    exc = future.exception()
    if exc is not None:
        log.error("kvpushd: a daemon call failed: %r", exc)
