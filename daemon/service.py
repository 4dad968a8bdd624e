"""``kvpushd run``: wire the node, peer link, engine server and systemd together."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from pathlib import Path
from typing import TYPE_CHECKING

import structlog

from daemon.affinity import pin
from daemon.dataplane.errors import DataPlaneError
from daemon.dataplane.pool import PoolError
from daemon.journal.format import JournalCorrupt, JournalFatal, JournalLocked
from daemon.journal.replay import ReplayError
from daemon.node.engine_server import EngineApp, EngineServer, Identity
from daemon.node.peerauth import SecretFileError, load_secret
from daemon.node.peerlink import PeerManager
from daemon.node.runtime import Node
from daemon.sdnotify import Notifier
from daemon.startup import StartupError, address_problem
from schemas.config import Config

if TYPE_CHECKING:
    from daemon.node.metrics import NodeMetrics

log = structlog.get_logger("kvpushd")

EXIT_OK = 0
EXIT_JOURNAL_FATAL = 3
FATAL_CLOSE_S = 5.0  # how long a journal-failure exit waits for the data plane to close


def _status_line(node: Node) -> str:
    status = node.status()
    peers = sum(1 for p in status.peers if p.up)
    return (
        f"{status.live} live requests, {len(status.engines)} engines, "
        f"{peers} peers up, journal at seq {status.journal.durable_seq}"
    )


async def _watchdog(notifier: Notifier, interval: float) -> None:
    # Pinged from the event loop itself: a wedged loop stops the pings and
    # systemd restarts the daemon.
    while True:
        notifier.watchdog()
        await asyncio.sleep(interval)


async def _status_updates(notifier: Notifier, node: Node) -> None:
    while True:
        await asyncio.sleep(5.0)
        notifier.status(_status_line(node))


# --- metrics hook-up (daemon/node/metrics.py) ---------------------------------


def _metrics(config: Config, node: Node) -> NodeMetrics | None:
    """The metrics, if configured; they observe the ledger from before begin() on."""
    if not config.metrics_port:
        return None
    from daemon.node.metrics import NodeMetrics  # only daemons with metrics need prometheus_client

    return NodeMetrics(status=node.status, live=lambda: node.registry.live.values())


async def _serve_metrics(metrics: NodeMetrics, node: Node, port: int) -> int:
    node.ledger.observers.append(metrics.observe)
    metrics.hook_group_commit(node.group)
    bound = await metrics.start(port)
    node.metrics_port = bound
    log.info("metrics endpoint", url=f"http://127.0.0.1:{bound}/metrics")
    return bound


# ---------------------------------------------------------------------------


def _secret(config: Config) -> bytes:
    """The peer link's secret, read before anything else is touched."""
    if not config.secret_file:
        return b""
    try:
        return load_secret(config.secret_file)
    except SecretFileError as exc:
        raise StartupError(
            f"{exc} (secret_file: a non-empty file only the daemon's user may read, mode 0600)"
        ) from exc


def _peer_manager(config: Config, node: Node, secret: bytes) -> PeerManager | None:
    """The peer links, wired straight to the node's parts (so built once the node is open)."""
    # A node that neither listens nor lists peers may still dial on demand.
    dials_on_demand = config.on_demand_peers and bool(config.secret_file)
    if not (config.listen or config.peers or dials_on_demand):
        why = "no secret_file configured" if not config.secret_file else "nothing to link to"
        log.info(
            f"peer link off: {why}",
            node=config.node,
            fix="set secret_file, and listen or peers, to link with other daemons",
        )
        return None
    return PeerManager(
        config.node,
        secret,
        config.listen,
        config.peers,
        hello=node.windows.hello,
        on_up=node.peers.on_up,
        on_message=node.peers.on_message,
        on_down=node.peers.on_down,
        heartbeat_s=config.heartbeat_s,
        peer_ttl_s=config.peer_ttl_s,
        max_frame_bytes=config.limits.max_frame_bytes,
        accept_unlisted=config.on_demand_peers,
        connect_timeout_s=config.peer_connect_timeout_s,
        idle_close_s=config.peer_idle_close_s,
        in_use=node.peers.in_use,
    )


async def _open_node(node: Node) -> None:
    """The journal (locked, replayed) and the data plane (the NIXL agent)."""
    where = node.config.journal.dir
    try:
        await node.open()
    except DataPlaneError as exc:
        raise StartupError(
            f"NIXL data plane (nixl.backend = {node.config.nixl.backend!r}): {exc}; "
            f"set nixl.backend to an installed plugin (UCX by default)"
        ) from exc
    except PoolError as exc:
        raise StartupError(
            f"offload pool: {exc}; fix [offload] (a smaller slots or slot_bytes, a path under "
            f"/dev/shm the daemon's user may write, or more room in /dev/shm)"
        ) from exc
    except JournalLocked as exc:
        raise StartupError(
            f"journal {where} is in use by another kvpushd; stop it, or give this daemon "
            f"its own journal.dir (and node name)"
        ) from exc
    except (JournalCorrupt, ReplayError) as exc:
        raise StartupError(
            f"journal {where} is damaged before its tail ({exc}); see kvpushd journal verify "
            f"{where} --salvage, then move the journal aside to start afresh"
        ) from exc
    except (JournalFatal, OSError) as exc:
        path = Path(where)
        is_file = path.exists() and not path.is_dir()
        problem = "a file is there, not a directory" if is_file else _cause(exc)
        raise StartupError(
            f"journal {where}: {problem}; journal.dir must be a directory the daemon's "
            f"user can create and write"
        ) from exc


def _cause(exc: BaseException) -> str:
    """The innermost OSError's words, else the exception's."""
    while not isinstance(exc, OSError) and exc.__cause__ is not None:
        exc = exc.__cause__
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc)


async def _startup(
    config: Config, node: Node, stack: contextlib.AsyncExitStack
) -> tuple[PeerManager | None, EngineServer, NodeMetrics | None]:
    """Everything that can fail, in an order that journals nothing until none can.

    Each step that takes something (a lock, a port, the NIXL agent) leaves
    its undoing on ``stack``; the caller unwinds it if a later step fails.
    """
    secret = _secret(config)
    server = EngineServer(
        config.socket,
        Identity(config.node, node.boot_id),
        max_frame_bytes=config.limits.max_frame_bytes,
        allowed_uids=config.allowed_uids,
        allowed_gids=tuple(int(g) for g in config.allowed_groups or ()),
    )
    await server.bind()
    stack.callback(server.release)
    metrics = _metrics(config, node)
    stack.push_async_callback(node.close)
    await _open_node(node)
    peers = _peer_manager(config, node, secret)
    if peers is not None:
        try:
            await peers.bind()
        except OSError as exc:
            raise address_problem(
                "peer listen address", config.listen, exc, "free it, or set listen"
            ) from exc
        stack.push_async_callback(peers.close)
    if metrics is not None:
        try:
            # Before the engine socket opens, so every status reply has the port.
            await _serve_metrics(metrics, node, config.metrics_port)
        except OSError as exc:
            raise address_problem(
                "metrics port", f"127.0.0.1:{config.metrics_port}", exc, "set metrics_port"
            ) from exc
        stack.push_async_callback(metrics.close)
    return peers, server, metrics


async def serve(config: Config, notifier: Notifier | None = None) -> int:
    """Run the daemon until SIGTERM; raises StartupError if it cannot start."""
    notifier = notifier or Notifier()
    stop = asyncio.Event()
    node = Node(config)
    node.on_fatal = lambda exc: stop.set()
    async with contextlib.AsyncExitStack() as undo:
        peers, server, metrics = await _startup(config, node, undo)
        undo.pop_all()
    background: list[asyncio.Future[None]] = []
    async with contextlib.AsyncExitStack() as shutdown:
        _shutdown_steps(shutdown, peers, node, server, metrics, background, notifier)
        await node.begin()
        await node.load_metadata()
        if peers is not None:
            node.attach_peers(peers)
            await peers.start()
        await server.start(
            EngineApp(
                calls=node.calls,
                status=node.status,
                disconnected=node.disconnected,
                life=node.life,
            )
        )

        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        background.append(asyncio.ensure_future(_status_updates(notifier, node)))
        if notifier.watchdog_interval_s:
            watchdog = _watchdog(notifier, notifier.watchdog_interval_s)
            background.append(asyncio.ensure_future(watchdog))
        log.info(
            "ready",
            node=config.node,
            socket=config.socket,
            listen=getattr(peers, "listen_port", None),
            journal=config.journal.dir,
        )
        notifier.ready(_status_line(node))

        await stop.wait()

        if node.fatal is not None:
            # Never continue and never retry after a failed fsync: exit and let
            # the next start replay to the last durable record. None of the
            # shutdown steps runs (they would commit and talk to peers).
            shutdown.pop_all()
            log.critical("exiting after a journal failure", error=str(node.fatal))
            notifier.stopping("journal failure")
            # Stop the NIXL worker first: left running, its agent was destroyed
            # during interpreter teardown, maybe mid-call on the worker thread,
            # and the process aborted (SIGABRT) instead of exiting 3. Bounded: a
            # wedged worker must not keep the daemon from exiting.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(node.dataplane.close(), FATAL_CLOSE_S)
            return EXIT_JOURNAL_FATAL
        notifier.stopping("draining")
        log.info("draining", live=len(node.registry.live), writes=len(node.writes))
        server.stop_accepting()
        await node.drain()
    log.info("stopped")
    return EXIT_OK


def _shutdown_steps(
    stack: contextlib.AsyncExitStack,
    peers: PeerManager | None,
    node: Node,
    server: EngineServer,
    metrics: NodeMetrics | None,
    background: list[asyncio.Future[None]],
    notifier: Notifier,
) -> None:
    """Shutdown as steps on ``stack``, run in reverse of this list whatever raises.

    They run in this order: the peer links close (no peer message reaches
    the node any more), the node makes the journal durable and frees the
    memory, the engine socket closes, then the metrics endpoint, the
    background tasks and the notifier. Whatever step raises (a drain that
    fails, a link that does not close), the ones after it still run, as
    start-up's undoing does.
    """
    stack.callback(notifier.close)
    stack.push_async_callback(_cancelled, background)
    if metrics is not None:
        stack.push_async_callback(metrics.close)
    stack.push_async_callback(server.close)
    stack.push_async_callback(node.close)
    if peers is not None:
        stack.push_async_callback(peers.close)


async def _cancelled(tasks: list[asyncio.Future[None]]) -> None:
    for task in tasks:
        task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.gather(*tasks, return_exceptions=True)


def run(config: Config) -> int:
    import uvloop

    # Before the loop and the data plane exist: the threads they start inherit it.
    pin(config.cpu_affinity)
    return uvloop.run(serve(config))
