"""``kvpushd run``: wire the node, peer link, engine server and systemd together."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from typing import TYPE_CHECKING

import structlog

from daemon.node.engine_server import EngineServer
from daemon.node.peerauth import load_secret
from daemon.node.peerlink import PeerManager
from daemon.node.runtime import Node
from daemon.sdnotify import Notifier
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


def _attach_metrics(config: Config, node: Node) -> NodeMetrics | None:
    """Observe the node from before start(), so replay-time events count too."""
    if not config.metrics_port:
        return None
    from daemon.node.metrics import NodeMetrics  # only daemons with metrics need prometheus_client

    return NodeMetrics(node)


async def _serve_metrics(metrics: NodeMetrics, node: Node, port: int) -> int:
    metrics.hook_group_commit()
    bound = await metrics.start(port)
    node.metrics_port = bound
    log.info("metrics endpoint", url=f"http://127.0.0.1:{bound}/metrics")
    return bound


# ---------------------------------------------------------------------------


async def serve(config: Config, notifier: Notifier | None = None) -> int:
    notifier = notifier or Notifier()
    stop = asyncio.Event()
    node = Node(config)
    node.on_fatal = lambda exc: stop.set()
    metrics = _attach_metrics(config, node)
    await node.start()
    await node.load_metadata()

    peers: PeerManager | None = None
    # A node that neither listens nor lists peers may still dial on demand.
    dials_on_demand = config.on_demand_peers and bool(config.secret_file)
    if config.listen or config.peers or dials_on_demand:
        secret = load_secret(config.secret_file) if config.secret_file else b""
        peers = PeerManager(
            config.node,
            secret,
            config.listen,
            config.peers,
            hello=node.hello,
            on_up=node.on_peer_up,
            on_message=node.on_peer_message,
            on_down=node.on_peer_down,
            heartbeat_s=config.heartbeat_s,
            peer_ttl_s=config.peer_ttl_s,
            max_frame_bytes=config.limits.max_frame_bytes,
            accept_unlisted=config.on_demand_peers,
            connect_timeout_s=config.peer_connect_timeout_s,
            idle_close_s=config.peer_idle_close_s,
            in_use=node.peers.in_use,
        )
        node.attach_peers(peers)
        await peers.start()

    if metrics is not None:
        # Before the engine socket opens, so every status reply has the port.
        await _serve_metrics(metrics, node, config.metrics_port)

    server = EngineServer(
        config.socket,
        node,
        max_frame_bytes=config.limits.max_frame_bytes,
        allowed_uids=config.allowed_uids,
        allowed_gids=config.allowed_gids,
    )
    await server.start()

    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    background = [asyncio.ensure_future(_status_updates(notifier, node))]
    if notifier.watchdog_interval_s:
        background.append(asyncio.ensure_future(_watchdog(notifier, notifier.watchdog_interval_s)))
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
        # the next start replay to the last durable record.
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
    if peers is not None:
        await peers.close()
    await node.close()
    await server.close()
    if metrics is not None:
        await metrics.close()
    for task in background:
        task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.gather(*background, return_exceptions=True)
    notifier.close()
    log.info("stopped")
    return EXIT_OK


def run(config: Config) -> int:
    import uvloop

    return uvloop.run(serve(config))
