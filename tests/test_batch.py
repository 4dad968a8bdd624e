"""One engine step's calls in one frame (issue 25, item 1), against real daemons.

The engine client sends the calls one loop iteration makes (registrations,
kv_readys, releases, aborts, holds) as one ``Batch`` frame to a daemon of
protocol 2. The daemon runs each op as it runs a single call (in order per
request id, concurrently otherwise, a refusal journaled and answered for
that op alone) and answers with one ``BatchReply``. Real daemons on
loopback, simulated engines over real NIXL writes, bytes verified.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import uuid
from collections.abc import Iterator

import msgspec
import pytest

from daemon.client.errors import RpcError
from daemon.node.engine_server import Session
from daemon.sim.engine import Expectation, SimEngine, SimGroup, tail_pairs
from daemon.sim.launcher import wait_idle
from schemas import rpc
from schemas.events import Failed, KvReady, Refused, Registered, WriteDone
from schemas.layout import Role
from schemas.reasons import Reason
from tests.support.metrics import MetricsDaemon, delta, metrics_pair
from tests.support.pushes import engine_pair

LAYOUT = [SimGroup(num_blocks=64, block_bytes=1024, layers=2)]
N = 8


async def test_a_step_of_pushes_in_batches_moves_every_request_exactly(peered_pair) -> None:
    prefill, decode = peered_pair
    pe, de = await engine_pair(peered_pair, LAYOUT)
    rids = [f"step-{uuid.uuid4().hex[:6]}-{i}" for i in range(N)]
    try:
        srcs = [[[2 * i, 2 * i + 1]] for i in range(N)]
        dsts = [[[40 + 2 * i, 41 + 2 * i]] for i in range(N)]
        await asyncio.gather(
            *(
                de.decode_register(
                    rid,
                    dst,
                    "prefill",
                    expect=Expectation(pe.engine_id, tail_pairs(pe.layout, src, de.layout, dst)),
                )
                for rid, src, dst in zip(rids, srcs, dsts, strict=True)
            )
        )
        await asyncio.gather(*(pe.prefill(rid, src) for rid, src in zip(rids, srcs, strict=True)))
        for rid in rids:
            arrived = await de.wait_event(rid, (rpc.KvArrived, rpc.RequestFailed))
            assert isinstance(arrived, rpc.KvArrived), arrived
            assert de.reports[(rid, 1)].ok, de.reports[(rid, 1)].problems()
            await pe.wait_event(rid, (rpc.BlocksFreeable,))
        await asyncio.gather(*(de.release(rid) for rid in rids), *(pe.release(rid) for rid in rids))
        # The calls left in batches on both connections.
        assert de.client.batches_sent >= 2 and pe.client.batches_sent >= 2
        assert pe.client.calls_batched >= 2 * N
    finally:
        await pe.close()
        await de.close()
    wait_idle(prefill, decode)
    for rid in rids:
        assert WriteDone in {type(e) for e in prefill.journal_events(rid)}


async def test_a_refused_op_fails_alone_and_is_journaled(peered_pair) -> None:
    prefill, _ = peered_pair
    pe, de = await engine_pair(peered_pair, LAYOUT)
    rid, ghost = f"kept-{uuid.uuid4().hex[:6]}", f"ghost-{uuid.uuid4().hex[:6]}"
    client = pe.client
    sent = client.batches_sent
    try:
        replies = await asyncio.gather(
            client.register_request(pe.engine_id, rid, Role.PUSHER, [[1, 2]], peer="decode"),
            client.kv_ready(ghost),
            client.release(ghost, 3),
            return_exceptions=True,
        )
        assert isinstance(replies[0], rpc.RequestAccepted), replies
        for refused in replies[1:]:
            assert isinstance(refused, RpcError), replies
            assert refused.code == Reason.UNKNOWN_REQUEST.value
        assert client.batches_sent == sent + 1
        await client.abort(rid)
        await client.release(rid)
    finally:
        await pe.close()
        await de.close()
    wait_idle(*peered_pair)
    refusals = [e for e in prefill.journal_events(ghost) if isinstance(e, Refused)]
    assert [(e.incarnation, e.reason) for e in refusals] == [
        (1, Reason.UNKNOWN_REQUEST),
        (3, Reason.UNKNOWN_REQUEST),
    ]


async def test_ops_about_one_request_keep_their_order_in_a_batch(peered_pair) -> None:
    pe, de = await engine_pair(peered_pair, LAYOUT)
    rid = f"ordered-{uuid.uuid4().hex[:6]}"
    client = pe.client
    try:
        # kv_ready before the registration would be refused unknown_request;
        # in one batch they run in the order sent.
        register = client.register_request(pe.engine_id, rid, Role.PUSHER, [[5]], peer="decode")
        accepted, ready, aborted = await asyncio.gather(
            register, client.kv_ready(rid), client.abort(rid)
        )
        assert isinstance(accepted, rpc.RequestAccepted)
        assert isinstance(ready, rpc.Ok) and isinstance(aborted, rpc.Ok | rpc.Deferred)
        await client.release(rid)
    finally:
        await pe.close()
        await de.close()
    wait_idle(*peered_pair)
    kinds = [type(e) for e in peered_pair[0].journal_events(rid)]
    assert kinds[:2] == [Registered, KvReady], kinds
    assert Failed in kinds and kinds.index(Failed) > 1


async def _raw_call(socket: str, *requests: msgspec.Struct) -> list[rpc.ServerMessage]:
    """Send frames on a bare connection; read one reply per frame."""
    reader, writer = await asyncio.open_unix_connection(socket)
    decoder = msgspec.msgpack.Decoder(rpc.ServerMessage)
    try:
        for request in requests:
            body = msgspec.msgpack.encode(request)
            writer.write(struct.pack(">I", len(body)) + body)
        replies = []
        for _ in requests:
            (length,) = struct.unpack(">I", await reader.readexactly(4))
            replies.append(decoder.decode(await reader.readexactly(length)))
        return replies
    finally:
        writer.close()


@pytest.mark.parametrize("protocol", [1, 2])
async def test_the_daemon_speaks_each_protocol_it_supports(peered_pair, protocol: int) -> None:
    (hello,) = await _raw_call(peered_pair[0].socket, rpc.Hello(1, "raw", protocol))
    assert isinstance(hello, rpc.HelloOk) and hello.protocol == protocol


async def test_the_daemon_refuses_a_protocol_it_does_not_speak(peered_pair) -> None:
    (refused,) = await _raw_call(peered_pair[0].socket, rpc.Hello(1, "raw", 3))
    assert isinstance(refused, rpc.Error) and refused.code == rpc.BAD_REQUEST


async def test_a_batch_answers_each_op_with_its_own_id_in_order(peered_pair) -> None:
    ops = (rpc.KvReady(11, "nobody"), rpc.Release(12, "nobody"), rpc.Abort(13, "nobody"))
    hello, batch = await _raw_call(peered_pair[0].socket, rpc.Hello(1, "raw"), rpc.Batch(2, ops))
    assert isinstance(hello, rpc.HelloOk)
    assert isinstance(batch, rpc.BatchReply) and batch.id == 2
    assert [r.id for r in batch.replies] == [11, 12, 13]
    assert all(isinstance(r, rpc.Error) for r in batch.replies)


async def test_an_empty_batch_is_a_bad_request_and_the_connection_lives_on(peered_pair) -> None:
    body = {"op": "batch", "id": 5, "ops": []}
    reader, writer = await asyncio.open_unix_connection(peered_pair[0].socket)
    decoder = msgspec.msgpack.Decoder(rpc.ServerMessage)
    try:
        for message in (body, {"op": "status", "id": 6}):
            raw = msgspec.msgpack.encode(message)
            writer.write(struct.pack(">I", len(raw)) + raw)
        replies = []
        for _ in range(2):
            (length,) = struct.unpack(">I", await reader.readexactly(4))
            replies.append(decoder.decode(await reader.readexactly(length)))
    finally:
        writer.close()
    assert isinstance(replies[0], rpc.Error) and replies[0].code == rpc.BAD_REQUEST
    assert replies[0].id == 5
    assert isinstance(replies[1], rpc.StatusReply)


@pytest.fixture(scope="module")
def counted_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[MetricsDaemon, ...]]:
    yield from metrics_pair(tmp_path_factory.mktemp("batch-metrics"))


async def test_a_batchs_records_share_one_group_commit(counted_pair) -> None:
    # The group commits are the daemon's fsync count (kvpushd_fsync_seconds):
    # sixteen releases one after the other take sixteen, in one batch one
    # (two if the loop's turn splits them; never one each).
    prefill, _ = counted_pair
    pe = await SimEngine.create(f"p-{uuid.uuid4().hex[:6]}", Role.PUSHER, LAYOUT, prefill.socket)
    client = pe.client
    tag = uuid.uuid4().hex[:6]
    one_by_one = [f"seq-{tag}-{i}" for i in range(16)]
    together = [f"bat-{tag}-{i}" for i in range(16)]
    try:
        await asyncio.gather(
            *(
                client.register_request(pe.engine_id, rid, Role.PUSHER, [[i]], peer="decode")
                for i, rid in enumerate(one_by_one + together)
            )
        )
        before = prefill.scrape()
        for rid in one_by_one:
            await client.release(rid)
        middle = prefill.scrape()
        sent = client.batches_sent
        await asyncio.gather(*(client.release(rid) for rid in together))
        after = prefill.scrape()
    finally:
        await pe.close()
    assert client.batches_sent == sent + 1
    assert delta(before, middle, "kvpushd_fsync_seconds_count") >= 16
    assert delta(middle, after, "kvpushd_fsync_seconds_count") <= 2


async def _session_frames(protocol: int) -> list[rpc.ServerMessage]:
    """Events and a reply sent on a real socket in one loop iteration, as the client reads them."""
    ours, theirs = socket.socketpair()
    _, writer = await asyncio.open_connection(sock=ours)
    reader, other = await asyncio.open_connection(sock=theirs)
    session = Session(writer, 0, 0, 0)
    session.protocol = protocol
    decoder = msgspec.msgpack.Decoder(rpc.ServerMessage)
    try:
        session.send_event(rpc.KvArrived("a", 1))
        session.send_event(rpc.BlocksFreeable("b", 1))
        session.send(rpc.Ok(5))  # the two events above leave before it
        session.send_event(rpc.Released("c", 1))
        await asyncio.sleep(0.05)
        session.close()
        frames = []
        while header := await reader.read(4):
            (length,) = struct.unpack(">I", header)
            frames.append(decoder.decode(await reader.readexactly(length)))
        return frames
    finally:
        other.close()


async def test_a_sessions_events_of_one_iteration_leave_as_one_frame_in_order() -> None:
    frames = await _session_frames(protocol=2)
    assert frames == [
        rpc.Events((rpc.KvArrived("a", 1), rpc.BlocksFreeable("b", 1))),
        rpc.Ok(5),
        rpc.Released("c", 1),  # alone: no frame of one
    ]


async def test_a_protocol_1_session_sends_each_event_alone() -> None:
    frames = await _session_frames(protocol=1)
    assert frames == [
        rpc.KvArrived("a", 1),
        rpc.BlocksFreeable("b", 1),
        rpc.Ok(5),
        rpc.Released("c", 1),
    ]
