"""Tests of the engine client library and the simulated engine against fake daemons.

The real daemon never replies out of order on purpose, sends a wrong reply
kind, or writes KV into the wrong blocks, so the client's and the simulated
engine's handling of those cannot be tested against it. These tests use a
small asyncio Unix-socket server that speaks the schemas (:class:`FakeDaemon`,
``..._with_fake_daemon``): real frames on a real socket, with replies, order
and timing under each test's control; and :class:`LoopbackDaemon`
(``..._with_loopback_fake_daemon``), which copies KV bytes between engines'
shared memory as a push would, optionally with injected faults such as the
front-trim bug, which the simulated engine must catch. The client and the
simulated engine against the real daemons are tested in test_e2e.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest

from daemon.client import (
    BlockingEngineClient,
    CallTimeout,
    ConnectionLost,
    EngineClient,
    ProtocolError,
    RequestTooLarge,
    RpcError,
)
from daemon.framing import FrameEncoder, frame_bytes, read_frame
from daemon.sim.engine import (
    Expectation,
    KvCorruption,
    SimEngine,
    SimError,
    SimGroup,
    expand,
    tail_pairs,
)
from schemas import rpc
from schemas.kvlayout import GroupSpec, LayerSpec, RegionSpec
from schemas.layout import GroupKind, Role
from schemas.reasons import Reason
from schemas.status import StatusDocument

ROOT = Path(__file__).resolve().parents[1]
SHM = Path("/dev/shm")

# ----------------------------------------------------------- fake daemon


class Conn:
    """One accepted engine connection, as the fake daemon sees it."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self.inbox: asyncio.Queue[rpc.Request] = asyncio.Queue()
        self._encoder = FrameEncoder()

    async def send(self, message: Any) -> None:
        self.writer.write(self._encoder.encode(message))
        await self.writer.drain()

    async def send_raw(self, body: bytes) -> None:
        self.writer.write(frame_bytes(body))
        await self.writer.drain()

    def drop(self) -> None:
        self.writer.transport.abort()


class FakeDaemon:
    """A real Unix-socket server speaking the engine RPC schemas.

    Requests whose ``op`` is in ``manual`` are queued on the connection's
    ``inbox`` for the test to answer (in any order, or never); the others get
    the usual reply from :meth:`reply`.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.manual: set[str] = set()
        # What it answers a Hello with. 1 by default: a daemon without
        # batches, so the client sends each call as its own frame, as most
        # of these tests read them; the batch tests set 2.
        self.protocol = 1
        self.max_protocol: int | None = None  # set: refuse a Hello above it, as an old daemon
        self.received: list[tuple[type, int]] = []  # each frame's request type and body size
        self.refuse = False  # answer every connection with Error(0) and hang up
        self.conns: list[Conn] = []
        self._tasks: set[asyncio.Task[Any]] = set()
        self._server: asyncio.AbstractServer | None = None
        self._decoder = msgspec.msgpack.Decoder(rpc.Request)

    async def start(self) -> None:
        self._server = await asyncio.start_unix_server(self._serve, self.path)

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        for conn in self.conns:
            conn.drop()
        # Let the handlers see EOF and end, rather than be cancelled at loop close.
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = Conn(writer)
        self.conns.append(conn)
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        if self.refuse:
            # As the daemon does: the refusal, EOF, and what the client sends left unread.
            await conn.send(rpc.Error(0, code=rpc.NOT_ALLOWED, message="uid 1 may not"))
            writer.write_eof()
            with contextlib.suppress(ConnectionError):
                while await reader.read(65536):
                    pass
            writer.close()
            return
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                body = await read_frame(reader, rpc.MAX_FRAME_BYTES)
                request = self._decoder.decode(body)
                self.received.append((type(request), len(body)))
                tag = type(request).__struct_config__.tag
                if tag in self.manual:
                    conn.inbox.put_nowait(request)
                else:
                    await self.handle(conn, request)

    async def handle(self, conn: Conn, request: rpc.Request) -> None:
        await conn.send(self.reply(request))

    def reply(self, request: rpc.Request) -> rpc.Reply:
        match request:
            case rpc.Hello() if (
                self.max_protocol is not None and request.protocol > self.max_protocol
            ):
                text = f"protocol {request.protocol} not supported, this daemon speaks 1"
                return rpc.Error(request.id, rpc.BAD_REQUEST, text)
            case rpc.Hello():
                return rpc.HelloOk(request.id, node="fake", protocol=self.protocol, version="t")
            case rpc.Batch():
                replies = tuple(self.reply(op) for op in request.ops)
                return rpc.BatchReply(request.id, replies)  # type: ignore[arg-type]
            case rpc.RegisterRequest():
                return rpc.RequestAccepted(request.id, state=f"registered:{request.request_id}")
            case rpc.Status():
                # The fake puts its connection count where a daemon counts live requests.
                return rpc.StatusReply(
                    request.id, status=StatusDocument(node="fake", live=len(self.conns))
                )
            case _:
                return rpc.Ok(request.id)


@pytest.fixture
def sock_dir() -> Any:
    # Short path: a Unix socket path must fit in 108 bytes.
    path = tempfile.mkdtemp(prefix="kvc-", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
async def daemon(sock_dir: str) -> AsyncIterator[FakeDaemon]:
    server = FakeDaemon(os.path.join(sock_dir, "d.sock"))
    await server.start()
    yield server
    await server.stop()


@pytest.fixture
async def client(daemon: FakeDaemon) -> AsyncIterator[EngineClient]:
    c = await EngineClient.connect(daemon.path, client_name="test", timeout=5)
    yield c
    await c.close()


def _node_and_conns(status: dict[str, Any]) -> tuple[str, int]:
    return status["node"], status["live"]


GROUPS = (GroupSpec(GroupKind.ATTENTION, 8, 64, (LayerSpec("r", 0),)),)
REGIONS = (RegionSpec("r", 512, path="/dev/shm/none"),)


# ------------------------------------------------------------ client: basics


async def test_connect_says_hello_and_calls_get_their_replies_with_fake_daemon(
    daemon: FakeDaemon, client: EngineClient
) -> None:
    assert (client.node, client.server_version, client.protocol) == ("fake", "t", 1)
    assert isinstance(await client.register_engine("e", GROUPS, REGIONS), rpc.Ok)
    accepted = await client.register_request("e", "r1", Role.RECEIVER, [[1, 2]], peer="P")
    assert accepted.state == "registered:r1"
    assert isinstance(await client.kv_ready("r1"), rpc.Ok)
    assert _node_and_conns(await client.status()) == ("fake", 1)


async def test_out_of_order_replies_reach_their_own_callers_with_fake_daemon(
    daemon: FakeDaemon, client: EngineClient
) -> None:
    daemon.manual.add("register_request")
    calls = [
        asyncio.create_task(client.register_request("e", f"r{i}", "pusher", [[i]]))
        for i in range(5)
    ]
    conn = daemon.conns[0]
    requests = [await conn.inbox.get() for _ in calls]
    assert len({r.id for r in requests}) == 5  # fresh id per call
    for request in reversed(requests):
        await conn.send(rpc.RequestAccepted(request.id, state=f"got:{request.request_id}"))
    results = await asyncio.gather(*calls)
    assert [r.state for r in results] == [f"got:r{i}" for i in range(5)]


async def test_events_are_delivered_while_a_call_is_pending_with_fake_daemon(
    daemon: FakeDaemon, client: EngineClient
) -> None:
    daemon.manual.add("release")
    release = asyncio.create_task(client.release("r1"))
    request = await daemon.conns[0].inbox.get()
    await daemon.conns[0].send(rpc.KvArrived("r1", 1))
    assert await client.next_event(timeout=2) == rpc.KvArrived("r1", 1)
    assert not release.done()
    await daemon.conns[0].send(rpc.Deferred(request.id, message="write in flight"))
    assert isinstance(await release, rpc.Deferred)
    await daemon.conns[0].send(rpc.Released("r1", 1))
    assert await client.next_event(timeout=2) == rpc.Released("r1", 1)


async def test_error_reply_raises_rpc_error_with_its_code_with_fake_daemon(
    daemon: FakeDaemon, client: EngineClient
) -> None:
    daemon.manual.update({"register_request", "kv_ready"})
    call = asyncio.create_task(client.register_request("e", "r1", "receiver", [[1]]))
    request = await daemon.conns[0].inbox.get()
    await daemon.conns[0].send(rpc.Error(request.id, code="blocks_owned", message="block 1"))
    with pytest.raises(RpcError) as info:
        await call
    assert info.value.code == "blocks_owned"
    assert info.value.reason is Reason.BLOCKS_OWNED
    assert info.value.message == "block 1"

    call = asyncio.create_task(client.kv_ready("r1"))
    request = await daemon.conns[0].inbox.get()
    await daemon.conns[0].send(rpc.Error(request.id, code=rpc.BAD_REQUEST, message="?"))
    with pytest.raises(RpcError) as info:
        await call
    assert info.value.code == "bad_request" and info.value.reason is None


async def test_wrong_reply_kind_and_undecodable_reply_fail_only_that_call_with_fake_daemon(
    daemon: FakeDaemon, client: EngineClient
) -> None:
    daemon.manual.update({"kv_ready", "abort"})
    conn = daemon.conns[0]
    call = asyncio.create_task(client.kv_ready("r1"))
    request = await conn.inbox.get()
    await conn.send(rpc.StatusReply(request.id, status=StatusDocument()))
    with pytest.raises(ProtocolError, match="StatusReply"):
        await call

    call = asyncio.create_task(client.abort("r1"))
    request = await conn.inbox.get()
    await conn.send_raw(msgspec.msgpack.encode({"kind": "ok", "id": request.id, "extra": {1: 2}}))
    await conn.send_raw(msgspec.msgpack.encode({"kind": "ok", "id": request.id}))
    # The first frame decodes fine (unknown fields are ignored); the id is then spent.
    assert isinstance(await call, rpc.Ok)

    call = asyncio.create_task(client.abort("r2"))
    request = await conn.inbox.get()
    await conn.send_raw(msgspec.msgpack.encode({"kind": "no_such_kind", "id": request.id}))
    with pytest.raises(ProtocolError, match="undecodable"):
        await call
    await conn.send_raw(msgspec.msgpack.encode({"kind": "future_event", "x": 1}))  # dropped
    assert _node_and_conns(await client.status()) == ("fake", 1)


async def test_call_timeout_then_late_reply_is_dropped_with_fake_daemon(
    daemon: FakeDaemon, client: EngineClient
) -> None:
    daemon.manual.add("kv_ready")
    with pytest.raises(CallTimeout):
        await client.kv_ready("r1", timeout=0.05)
    with pytest.raises(TimeoutError):  # CallTimeout is a TimeoutError
        await client.kv_ready("r2", timeout=0.05)
    late = await daemon.conns[0].inbox.get()
    await daemon.conns[0].send(rpc.Ok(late.id))
    assert _node_and_conns(await client.status()) == ("fake", 1)
    with pytest.raises(CallTimeout):
        await client.next_event(timeout=0.01)


async def test_connection_loss_fails_pending_calls_and_ends_events_with_fake_daemon(
    daemon: FakeDaemon, client: EngineClient
) -> None:
    daemon.manual.update({"kv_ready", "release"})
    pending = [
        asyncio.create_task(client.kv_ready("r1")),
        asyncio.create_task(client.release("r1")),
    ]
    conn = daemon.conns[0]
    for _ in pending:
        await conn.inbox.get()
    await conn.send(rpc.BlocksFreeable("r1", 1))
    collected: list[rpc.Event] = []

    async def consume() -> None:
        async for event in client.events():
            collected.append(event)

    consumer = asyncio.create_task(consume())
    watcher = asyncio.create_task(client.wait_closed())
    await asyncio.sleep(0)
    assert not watcher.done()  # waits while the connection lives
    conn.drop()
    lost = await asyncio.wait_for(watcher, 2)  # and says why it ended
    assert isinstance(lost, ConnectionLost) and "closed the connection" in str(lost)
    for task in pending:
        with pytest.raises(ConnectionLost):
            await task
    await asyncio.wait_for(consumer, 2)  # the iterator ends
    assert collected == [rpc.BlocksFreeable("r1", 1)]
    assert client.closed
    with pytest.raises(ConnectionLost):
        await client.status()
    with pytest.raises(ConnectionLost):
        await client.next_event(timeout=1)


async def test_close_fails_pending_calls_with_fake_daemon(
    daemon: FakeDaemon, client: EngineClient
) -> None:
    daemon.manual.add("status")
    call = asyncio.create_task(client.status())
    await daemon.conns[0].inbox.get()
    await client.close()
    with pytest.raises(ConnectionLost):
        await call
    await client.close()  # idempotent


async def test_connect_failures_with_fake_daemon(daemon: FakeDaemon, sock_dir: str) -> None:
    with pytest.raises(ConnectionLost, match="cannot connect"):
        await EngineClient.connect(os.path.join(sock_dir, "absent.sock"))
    daemon.protocol = 99
    with pytest.raises(ProtocolError, match="protocol 99"):
        await EngineClient.connect(daemon.path)
    daemon.protocol = 1
    daemon.manual.add("hello")
    connecting = asyncio.create_task(EngineClient.connect(daemon.path))
    assert await _connected(daemon, len(daemon.conns) + 1)
    hello = await daemon.conns[-1].inbox.get()
    assert isinstance(hello, rpc.Hello)
    await daemon.conns[-1].send(rpc.Error(hello.id, code=rpc.SHUTTING_DOWN, message="draining"))
    with pytest.raises(RpcError, match="shutting_down"):
        await connecting


async def test_refused_connection_says_why_with_fake_daemon(daemon: FakeDaemon) -> None:
    daemon.refuse = True
    with pytest.raises(RpcError, match="not_allowed") as info:
        await EngineClient.connect(daemon.path)
    assert info.value.code == rpc.NOT_ALLOWED and info.value.message == "uid 1 may not"


async def _connected(daemon: FakeDaemon, n: int) -> bool:
    for _ in range(200):
        if len(daemon.conns) >= n:
            return True
        await asyncio.sleep(0.01)
    return False


async def test_request_over_the_frame_limit_is_not_sent_with_fake_daemon(
    daemon: FakeDaemon,
) -> None:
    async with await EngineClient.connect(daemon.path, max_frame_bytes=1024) as c:
        with pytest.raises(RequestTooLarge):
            await c.register_request("e", "r", "pusher", [list(range(2000))])
        assert daemon.conns[0].inbox.empty()
        assert _node_and_conns(await c.status()) == ("fake", 1)


async def test_oversized_frame_from_the_daemon_ends_the_connection_with_fake_daemon(
    daemon: FakeDaemon,
) -> None:
    async with await EngineClient.connect(daemon.path, max_frame_bytes=1024) as c:
        await daemon.conns[0].send_raw(b"x" * 2048)
        with pytest.raises(ConnectionLost, match="exceeds"):
            await c.next_event(timeout=2)


async def test_event_callback_and_queue_switch_with_fake_daemon(daemon: FakeDaemon) -> None:
    seen: list[rpc.Event] = []
    async with await EngineClient.connect(
        daemon.path, on_event=seen.append, queue_events=False
    ) as c:
        await daemon.conns[0].send(rpc.RequestFailed("r", 2, Reason.PEER_DEAD, "gone"))
        await c.status()  # the event frame was read before this reply
        assert seen == [rpc.RequestFailed("r", 2, Reason.PEER_DEAD, "gone")]
        with pytest.raises(CallTimeout):
            await c.next_event(timeout=0.01)


# --------------------------------------------------------- blocking wrapper


async def test_blocking_client_from_plain_threads_with_fake_daemon(daemon: FakeDaemon) -> None:
    daemon.manual.add("kv_ready")

    async def answer_kv_ready() -> None:
        """Answer the four kv_ready calls in reverse order, with an event first."""
        await _connected(daemon, 1)
        conn = daemon.conns[0]
        requests = [await conn.inbox.get() for _ in range(4)]
        await conn.send(rpc.KvArrived("ev", 1))
        for request in reversed(requests):
            await conn.send(rpc.Ok(request.id))

    answering = asyncio.create_task(answer_kv_ready())

    def engine_side() -> list[Any]:
        with BlockingEngineClient.connect(daemon.path, client_name="sync", timeout=5) as c:
            results: list[Any] = [None] * 4
            errors: list[BaseException] = []

            def worker(i: int) -> None:
                try:
                    results[i] = c.kv_ready(f"r{i}")
                except BaseException as exc:
                    errors.append(exc)

            threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(5)
            event = c.next_event(timeout=5)
            accepted = c.register_request("e", "r9", Role.PUSHER, [[1]])
            with pytest.raises(RpcError):
                c.release("boom")
            return [results, errors, event, accepted, c.status(), list(c.events(timeout=0.05))]

    daemon.handle = _error_on_release(daemon.handle)  # type: ignore[method-assign]
    results, errors, event, accepted, status, idle = await asyncio.to_thread(engine_side)
    await answering
    assert errors == []
    assert all(isinstance(r, rpc.Ok) for r in results)
    assert event == rpc.KvArrived("ev", 1)
    assert accepted.state == "registered:r9"
    assert status["node"] == "fake"
    assert idle == []


def _error_on_release(
    handle: Callable[[Conn, rpc.Request], Awaitable[None]],
) -> Callable[[Conn, rpc.Request], Awaitable[None]]:
    async def wrapped(conn: Conn, request: rpc.Request) -> None:
        if isinstance(request, rpc.Release):
            await conn.send(rpc.Error(request.id, code="unknown_request", message="boom"))
        else:
            await handle(conn, request)

    return wrapped


async def test_blocking_client_sees_connection_loss_with_fake_daemon(daemon: FakeDaemon) -> None:
    def engine_side() -> tuple[list[rpc.Event], type[BaseException] | None]:
        c = BlockingEngineClient.connect(daemon.path)
        try:
            asyncio.run_coroutine_threadsafe(_drop_all(daemon), daemon_loop).result(5)
            events = list(c.events(timeout=5))  # ends at the loss, not at the timeout
            try:
                c.status()
            except ConnectionLost as exc:
                return events, type(exc)
            return events, None
        finally:
            c.close()
            c.close()

    daemon_loop = asyncio.get_running_loop()
    events, raised = await asyncio.to_thread(engine_side)
    assert events == [rpc.Released("x", 1)]
    assert raised is ConnectionLost


async def _drop_all(daemon: FakeDaemon) -> None:
    for conn in daemon.conns:
        await conn.send(rpc.Released("x", 1))
        conn.drop()


# ------------------------------------------------- simulated engine, in-process


class LoopbackDaemon(FakeDaemon):
    """A fake daemon that also moves the bytes: on kv_ready it copies the
    prefill engine's blocks into the decode engine's, tail-aligned (or, with
    ``front_trim``, the classic bug), then says BlocksFreeable / KvArrived.

    ``stray_write`` additionally corrupts one block outside the request.
    """

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.front_trim = False
        self.stray_write: tuple[int, int] | None = None  # (group, block) of the receiver
        self.write_source = False  # the transfer also writes the pusher's memory
        self.engines: dict[str, tuple[Conn, tuple[GroupSpec, ...], dict[str, np.ndarray]]] = {}
        self.requests: dict[tuple[str, Role], tuple[str, tuple[tuple[int, ...], ...]]] = {}

    async def handle(self, conn: Conn, request: rpc.Request) -> None:
        if isinstance(request, rpc.RegisterEngine):
            regions = {
                r.name: np.memmap(r.path, dtype=np.uint8, mode="r+", shape=(r.size,))
                for r in request.regions
            }
            self.engines[request.engine_id] = (conn, request.groups, regions)
        elif isinstance(request, rpc.RegisterRequest):
            self.requests[(request.request_id, request.role)] = (request.engine_id, request.blocks)
        await conn.send(self.reply(request))
        if isinstance(request, rpc.KvReady):
            await self._push(request.request_id, request.incarnation)

    async def _push(self, request_id: str, incarnation: int) -> None:
        src_id, src_logical = self.requests[(request_id, Role.PUSHER)]
        dst_id, dst_logical = self.requests[(request_id, Role.RECEIVER)]
        src_conn, src_groups, src_mem = self.engines[src_id]
        dst_conn, dst_groups, dst_mem = self.engines[dst_id]
        layout = tuple(
            SimGroup(g.num_blocks, g.block_bytes, g.kind, len(g.layers), g.per_logical)
            for g in src_groups
        )
        pairs = tail_pairs(layout, src_logical, layout, dst_logical)
        if self.front_trim:
            src_kernel = expand(layout, src_logical)
            pairs = tuple(
                tuple(zip([d for d, _ in group], src_kernel[g][: len(group)], strict=True))
                for g, group in enumerate(pairs)
            )
        for g, group in enumerate(pairs):
            for src_layer, dst_layer in zip(
                src_groups[g].layers, dst_groups[g].layers, strict=True
            ):
                size = src_groups[g].block_bytes
                for d, s in group:
                    so, do = src_layer.offset + s * size, dst_layer.offset + d * size
                    dst_mem[dst_layer.region][do : do + size] = src_mem[src_layer.region][
                        so : so + size
                    ]
        if self.stray_write is not None:
            g, b = self.stray_write
            layer = dst_groups[g].layers[0]
            dst_mem[layer.region][layer.offset + b * dst_groups[g].block_bytes] ^= 0xFF
        if self.write_source:
            layer = src_groups[0].layers[0]
            src_mem[layer.region][layer.offset] ^= 0xFF
        await src_conn.send(rpc.BlocksFreeable(request_id, incarnation))
        await dst_conn.send(rpc.KvArrived(request_id, incarnation))


LAYOUT = (
    SimGroup(num_blocks=16, block_bytes=4096 + 64, layers=2),
    SimGroup(num_blocks=8, block_bytes=1024, layers=3, per_logical=2),
)


@pytest.fixture
async def loopback(sock_dir: str) -> AsyncIterator[LoopbackDaemon]:
    server = LoopbackDaemon(os.path.join(sock_dir, "d.sock"))
    await server.start()
    yield server
    await server.stop()


def _prefix(name: str) -> str:
    return f"kvpushd-test-{name}-{os.getpid()}"


async def _engines(loopback: LoopbackDaemon, name: str) -> tuple[SimEngine, SimEngine]:
    p = await SimEngine.create("P", "pusher", LAYOUT, loopback.path, shm_prefix=_prefix(name + "P"))
    d = await SimEngine.create(
        "D", Role.RECEIVER, LAYOUT, loopback.path, shm_prefix=_prefix(name + "D")
    )
    return p, d


async def test_sim_engines_push_verify_and_clean_up_with_loopback_fake_daemon(
    loopback: LoopbackDaemon,
) -> None:
    p, d = await _engines(loopback, "ok")
    paths = p.shm_paths + d.shm_paths
    assert paths == tuple(
        str(SHM / f"{_prefix(side)}-g{g}") for side in ("okP", "okD") for g in range(2)
    )
    assert all(os.path.exists(path) for path in paths)
    src_blocks, dst_blocks = [[0, 1, 2, 3, 4], [0, 1, 2]], [[9, 10], [3]]
    expected = tail_pairs(LAYOUT, src_blocks, LAYOUT, dst_blocks)
    assert expected == (((9, 3), (10, 4)), ((6, 4), (7, 5)))
    await d.decode_register("r1", dst_blocks, "nodeP", expect=Expectation("P", expected))
    await p.prefill("r1", src_blocks, peer="nodeD")
    await p.wait_event("r1", rpc.BlocksFreeable, timeout=5)
    await d.wait_event("r1", rpc.KvArrived, timeout=5)
    report = d.reports[("r1", 1)]
    assert report.ok, str(report)
    assert report.blocks_checked == 4
    assert p.reports[("r1", 1)].ok and p.reports[("r1", 1)].blocks_checked == 11
    assert isinstance(await d.release("r1"), rpc.Ok)
    assert isinstance(await p.release("r1"), rpc.Ok)
    await p.close()
    await d.close()
    assert not any(os.path.exists(path) for path in paths)


async def test_sim_engine_catches_a_front_trim_with_loopback_fake_daemon(
    loopback: LoopbackDaemon,
) -> None:
    loopback.front_trim = True
    p, d = await _engines(loopback, "ft")
    async with p, d:
        src_blocks, dst_blocks = [[0, 1, 2, 3], [0, 1]], [[5, 6], [2]]
        expected = tail_pairs(LAYOUT, src_blocks, LAYOUT, dst_blocks)
        await d.decode_register("r1", dst_blocks, "nodeP")
        await p.prefill("r1", src_blocks)
        await d.wait_event("r1", rpc.KvArrived, timeout=5)
        report = d.verify("r1", expected, source_engine="P")
        assert not report.ok and not report.changes
        assert {(m.group, m.dst_block, m.holds.split(" layer")[0]) for m in report.mismatches} == {
            (0, 5, "source block 0"),
            (0, 6, "source block 1"),
            (1, 4, "source block 0"),
            (1, 5, "source block 1"),
        }
        with pytest.raises(KvCorruption):
            report.raise_if_bad()


async def test_sim_engine_catches_a_write_into_another_block_with_loopback_fake_daemon(
    loopback: LoopbackDaemon,
) -> None:
    loopback.stray_write = (0, 12)
    p, d = await _engines(loopback, "sw")
    async with p, d:
        src_blocks, dst_blocks = [[0, 1], []], [[3], []]
        expect = Expectation("P", tail_pairs(LAYOUT, src_blocks, LAYOUT, dst_blocks))
        await d.decode_register("r1", dst_blocks, "nodeP", expect=expect)
        await p.prefill("r1", src_blocks)
        await d.wait_event("r1", rpc.KvArrived, timeout=5)
        report = d.reports[("r1", 1)]
        assert not report.mismatches
        assert [(c.group, c.layer, c.block) for c in report.changes] == [(0, 0, 12)]


async def test_sim_engine_catches_a_write_into_the_source_with_loopback_fake_daemon(
    loopback: LoopbackDaemon,
) -> None:
    loopback.write_source = True
    p, d = await _engines(loopback, "ws")
    async with p, d:
        await d.decode_register("r1", [[3], []], "nodeP")
        await p.prefill("r1", [[5], []])
        await p.wait_event("r1", rpc.BlocksFreeable, timeout=5)
        report = p.reports[("r1", 1)]
        assert [(c.group, c.layer, c.block) for c in report.changes] == [(0, 0, 0)]
        with pytest.raises(SimError, match="pusher"):
            d.verify_source("r1")


async def test_sim_engine_tolerates_other_requests_in_flight_with_loopback_fake_daemon(
    loopback: LoopbackDaemon,
) -> None:
    """Blocks of a request still waiting for its KV may change under another's check."""
    p, d = await _engines(loopback, "mf")
    async with p, d:
        pairs_a = tail_pairs(LAYOUT, [[0, 1], [0]], LAYOUT, [[4], [1]])
        pairs_b = tail_pairs(LAYOUT, [[2, 3], [1]], LAYOUT, [[5, 6], [2]])
        await d.decode_register("a", [[4], [1]], "nodeP", expect=Expectation("P", pairs_a))
        await d.decode_register("b", [[5, 6], [2]], "nodeP")
        await p.prefill("b", [[2, 3], [1]])  # b's KV lands before a's check
        await p.prefill("a", [[0, 1], [0]])
        await d.wait_event("a", rpc.KvArrived, timeout=5)
        assert d.reports[("a", 1)].ok, str(d.reports[("a", 1)])
        assert d.verify("b", pairs_b, source_engine="P").ok
        with pytest.raises(SimError, match="receiver"):
            await d.prefill("c", [[0], []])


async def test_sim_engine_refused_duplicate_keeps_the_original_with_loopback_fake_daemon(
    loopback: LoopbackDaemon,
) -> None:
    p, d = await _engines(loopback, "dup")
    loopback.manual.add("register_request")
    async with p, d:
        task = asyncio.create_task(d.decode_register("r", [[1], []], "nodeP"))
        request = await loopback.conns[1].inbox.get()
        await loopback.conns[1].send(rpc.RequestAccepted(request.id, state="registered"))
        await task
        task = asyncio.create_task(d.decode_register("r", [[2], []], "nodeP"))
        request = await loopback.conns[1].inbox.get()
        await loopback.conns[1].send(rpc.Error(request.id, code="duplicate_request", message=""))
        with pytest.raises(RpcError):
            await task
        loopback.manual.clear()
        d.view.block(0, 0, 1)[:] = 7  # the original's block may change, not block 2
        assert d.verify("r", [[(1, 1)], []], source_engine="P").changes == ()


# ------------------------------------------------ simulated engine, processes


class SimProcess:
    """A ``python -m harness.engine_process`` child driven over JSON lines."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        """Wrap a started child (see :meth:`start`)."""
        self.proc = proc
        self.lines: list[dict[str, Any]] = []

    @classmethod
    async def start(
        cls, engine_id: str, role: str, socket: str, prefix: str, *extra: str
    ) -> SimProcess:
        layout = json.dumps([msgspec.to_builtins(g) for g in LAYOUT])
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "harness.engine_process",
            "--engine-id", engine_id, "--role", role, "--layout", layout,
            "--socket", socket, "--shm-prefix", prefix, *extra,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, cwd=ROOT,
        )  # fmt: skip
        return cls(proc)

    async def next_line(self, key: str, value: str) -> dict[str, Any]:
        assert self.proc.stdout is not None
        while True:
            raw = await asyncio.wait_for(self.proc.stdout.readline(), 10)
            assert raw, "sim engine exited early"
            line = json.loads(raw)
            self.lines.append(line)
            if line.get(key) == value:
                return line

    async def call(self, cmd: str, **fields: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps({"cmd": cmd, "tag": cmd, **fields}) + "\n").encode())
        await self.proc.stdin.drain()
        return await self.next_line("reply", cmd)


async def test_sim_engine_processes_push_and_verify_with_loopback_fake_daemon(
    loopback: LoopbackDaemon,
) -> None:
    p = await SimProcess.start("P", "pusher", loopback.path, _prefix("procP"))
    d = await SimProcess.start("D", "receiver", loopback.path, _prefix("procD"))
    ready = [await p.next_line("event", "ready"), await d.next_line("event", "ready")]
    paths = [r["path"] for info in ready for r in info["regions"]]
    assert len(paths) == 4 and all(os.path.exists(path) for path in paths)
    src_blocks, dst_blocks = [[0, 1, 2], [0, 1]], [[7, 8], [3]]
    reply = await d.call(
        "decode_register", request_id="r", blocks=dst_blocks, peer="n", source="P",
        source_blocks=src_blocks,
    )  # fmt: skip
    assert reply["ok"], reply
    assert (await p.call("prefill", request_id="r", blocks=src_blocks))["ok"]
    waited = await d.call("wait", request_id="r", event="kv_arrived", timeout=5)
    assert waited["ok"] and waited["verified"]["ok"], waited
    assert waited["verified"]["blocks_checked"] == 4
    refused = await d.call("release", request_id="nope")
    assert refused["ok"] is True  # the loopback accepts any release
    bad = await d.call("verify", request_id="nope", source="P", pairs=[[], []])
    assert not bad["ok"] and "nope" in bad["error"]
    await p.call("close")
    assert d.proc.stdin is not None
    d.proc.stdin.write(b'{"cmd": "wait", "request_id": "never", "event": "released"}\n')
    await d.proc.stdin.drain()
    await asyncio.sleep(0.1)
    d.proc.send_signal(signal.SIGTERM)  # interrupts the 30 s wait
    assert await asyncio.wait_for(p.proc.wait(), 10) == 0
    assert await asyncio.wait_for(d.proc.wait(), 10) == 0
    assert not any(os.path.exists(path) for path in paths)


async def test_sim_engine_process_exits_2_without_a_daemon(sock_dir: str) -> None:
    proc = await SimProcess.start("P", "pusher", os.path.join(sock_dir, "x.sock"), _prefix("nod"))
    line = await proc.next_line("event", "error")
    assert "cannot connect" in line["error"]
    assert await asyncio.wait_for(proc.proc.wait(), 10) == 2
    assert not list(SHM.glob(f"{_prefix('nod')}-*"))


async def test_blocking_close_releases_threads_blocked_in_calls_with_fake_daemon(
    daemon: FakeDaemon, sock_dir: str
) -> None:
    daemon.manual.add("status")

    def engine_side() -> list[str]:
        with pytest.raises(ConnectionLost):
            BlockingEngineClient.connect(os.path.join(sock_dir, "absent.sock"))
        c = BlockingEngineClient.connect(daemon.path)
        outcomes: list[str] = []

        def blocked(call: Callable[[], object]) -> None:
            try:
                call()
                outcomes.append("returned")
            except ConnectionLost:
                outcomes.append("lost")

        threads = [
            threading.Thread(target=blocked, args=(c.status,)),
            threading.Thread(target=blocked, args=(lambda: c.next_event(timeout=None),)),
        ]
        for t in threads:
            t.start()
        while daemon.conns[0].inbox.empty():  # the status call reached the daemon
            threading.Event().wait(0.01)
        c.close()
        for t in threads:
            t.join(5)
        with pytest.raises(ConnectionLost):
            c.status()
        return outcomes

    assert await asyncio.to_thread(engine_side) == ["lost", "lost"]


async def test_sim_engine_process_scripted_mode_with_loopback_fake_daemon(
    loopback: LoopbackDaemon, sock_dir: str
) -> None:
    script = Path(sock_dir) / "commands.jsonl"
    script.write_text('{"cmd": "status", "tag": 1}\n\nnot json\n{"cmd": "bogus"}\n')
    proc = await SimProcess.start(
        "S", "pusher", loopback.path, _prefix("scr"), "--commands", str(script)
    )
    assert await asyncio.wait_for(proc.proc.wait(), 10) == 0  # end of input: close, exit 0
    assert proc.proc.stdout is not None
    lines = [json.loads(x) for x in (await proc.proc.stdout.read()).splitlines()]
    assert [line.get("event") or line.get("reply") for line in lines] == [
        "ready", "status", None, "bogus", "closed",
    ]  # fmt: skip
    assert lines[1]["ok"] and lines[1]["tag"] == 1 and lines[1]["status"]["node"] == "fake"
    assert not lines[2]["ok"] and not lines[3]["ok"]
    assert not list(SHM.glob(f"{_prefix('scr')}-*"))


async def test_a_failed_send_leaves_no_unretrieved_exception_with_fake_daemon(
    daemon: FakeDaemon,
) -> None:
    # The client's own socket can no longer send (shut down for writing):
    # the call raises ConnectionLost, and the call's reply future, failed by
    # the same loss, must not be left for asyncio to report as "Future
    # exception was never retrieved" whenever it is collected (it used to be,
    # once per lost connection). The futures the call creates are watched
    # for asyncio's own "not retrieved" flag, which is what that report reads.
    client = await EngineClient.connect(daemon.path, client_name="test", timeout=5)
    loop = asyncio.get_running_loop()
    made: list[asyncio.Future[Any]] = []
    create_future = loop.create_future

    def watched() -> asyncio.Future[Any]:
        made.append(create_future())
        return made[-1]

    client._writer.transport.get_extra_info("socket").shutdown(socket.SHUT_WR)
    loop.create_future = watched  # type: ignore[method-assign]
    try:
        with pytest.raises(ConnectionLost):
            await client.status()
    finally:
        del loop.create_future
    failed = [f for f in made if f.done() and not f.cancelled()]
    assert failed, "the call made no reply future"
    assert [f for f in failed if f._log_traceback] == []  # type: ignore[attr-defined]
    await client.close()


# ------------------------------------------------------------ client: batches


def _kinds(daemon: FakeDaemon) -> list[type]:
    return [kind for kind, _ in daemon.received]


async def test_calls_of_one_iteration_leave_as_one_batch_with_fake_daemon(
    daemon: FakeDaemon,
) -> None:
    daemon.protocol = 2
    client = await EngineClient.connect(daemon.path, timeout=5)
    try:
        assert client.protocol == 2
        replies = await asyncio.gather(*(client.kv_ready(f"r{i}") for i in range(5)))
        # Each call got its own reply (the fake answers with the op's id).
        assert all(isinstance(r, rpc.Ok) for r in replies)
        assert _kinds(daemon) == [rpc.Hello, rpc.Batch]
        assert (client.batches_sent, client.calls_batched) == (1, 5)
        # A lone call is no batch.
        await client.release("r0")
        assert _kinds(daemon)[-1] is rpc.Release
    finally:
        await client.close()


async def test_a_protocol_1_daemon_gets_one_frame_per_call_with_fake_daemon(
    daemon: FakeDaemon,
) -> None:
    client = await EngineClient.connect(daemon.path, timeout=5)
    try:
        await asyncio.gather(*(client.kv_ready(f"r{i}") for i in range(3)))
        assert _kinds(daemon) == [rpc.Hello] + [rpc.KvReady] * 3
        assert client.batches_sent == 0
    finally:
        await client.close()


async def test_a_daemon_that_refuses_protocol_2_is_spoken_to_in_1_with_fake_daemon(
    daemon: FakeDaemon,
) -> None:
    daemon.max_protocol = 1
    client = await EngineClient.connect(daemon.path, timeout=5)
    try:
        assert client.protocol == 1
        await asyncio.gather(client.kv_ready("a"), client.kv_ready("b"))
        assert _kinds(daemon) == [rpc.Hello, rpc.Hello, rpc.KvReady, rpc.KvReady]
    finally:
        await client.close()


async def test_a_batch_splits_at_the_frame_limit_and_keeps_the_order_with_fake_daemon(
    daemon: FakeDaemon,
) -> None:
    daemon.protocol = 2
    limit = 2048
    client = await EngineClient.connect(daemon.path, timeout=5, max_frame_bytes=limit)
    try:
        blocks = [list(range(100, 200))]  # about 200 bytes a registration
        calls = [client.register_request("e", f"r{i:02d}", Role.PUSHER, blocks) for i in range(30)]
        accepted = await asyncio.gather(*calls)
        assert [a.state for a in accepted] == [f"registered:r{i:02d}" for i in range(30)]
        batches = [size for kind, size in daemon.received if kind is rpc.Batch]
        assert len(batches) >= 3 and max(batches) <= limit
        assert client.calls_batched == 30
    finally:
        await client.close()


async def test_a_single_call_after_batched_ones_leaves_after_them_with_fake_daemon(
    daemon: FakeDaemon,
) -> None:
    daemon.protocol = 2
    client = await EngineClient.connect(daemon.path, timeout=5)
    try:
        await asyncio.gather(client.kv_ready("a"), client.kv_ready("b"), client.status())
        assert _kinds(daemon) == [rpc.Hello, rpc.Batch, rpc.Status]
    finally:
        await client.close()


async def test_a_frame_of_events_is_delivered_one_by_one_in_order_with_fake_daemon(
    daemon: FakeDaemon, client: EngineClient
) -> None:
    await daemon.conns[0].send(
        rpc.Events((rpc.KvArrived("a", 1), rpc.RequestFailed("b", 2, Reason.ABORTED, "x")))
    )
    first, second = await client.next_event(timeout=5), await client.next_event(timeout=5)
    assert first == rpc.KvArrived("a", 1)
    assert isinstance(second, rpc.RequestFailed) and second.request_id == "b"
