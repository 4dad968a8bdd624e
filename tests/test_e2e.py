"""End to end: two real daemon processes, simulated engines, real NIXL over DRAM.

Every test drives engines through the client library against a prefill and a
decode daemon started as subprocesses on loopback, and checks the bytes in
the engines' shared memory and the daemons' journals.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import struct
import time
import uuid

import msgspec
import numpy as np
import pytest

from daemon.client import EngineClient, RpcError
from daemon.dataplane.memory import create_shm_file
from daemon.framing import FrameEncoder, frame_bytes
from daemon.journal.replay import replay
from daemon.sim.engine import Expectation, SimEngine, SimGroup, tail_pairs
from daemon.sim.kvpattern import changed_blocks, snapshot
from daemon.sim.launcher import Daemon, cpu_seconds, daemon_pair
from schemas import rpc
from schemas.events import Failed, Refused, WriteStarted
from schemas.fingerprint import Fingerprint
from schemas.kvlayout import GroupSpec, LayerSpec
from schemas.layout import GroupKind, Role
from statemachine.ranks import head_sources, head_targets, share_id, stage_layers, stage_sources

LAYOUT = [
    SimGroup(num_blocks=640, block_bytes=4096, layers=2),
    SimGroup(num_blocks=640, block_bytes=2048, layers=3),
]


@pytest.fixture(scope="module")
def pair(peered_pair: tuple[Daemon, Daemon]) -> tuple[Daemon, Daemon]:
    """This module's two daemons, shared by its tests (both must exit 0 at the end)."""
    return peered_pair


def _uid() -> str:
    return uuid.uuid4().hex[:8]


async def _engines(pair, layout=LAYOUT) -> tuple[SimEngine, SimEngine]:
    prefill, decode = pair
    tag = _uid()
    pe = await SimEngine.create(f"p-{tag}", Role.PUSHER, layout, prefill.socket)
    de = await SimEngine.create(f"d-{tag}", Role.RECEIVER, layout, decode.socket)
    return pe, de


async def _push(pe: SimEngine, de: SimEngine, rid: str, src, dst, *, pairs=None):
    pairs = pairs if pairs is not None else tail_pairs(pe.layout, src, de.layout, dst)
    await de.decode_register(rid, dst, "prefill", expect=Expectation(pe.engine_id, pairs))
    await pe.prefill(rid, src)
    arrived = await de.wait_event(rid, (rpc.KvArrived, rpc.RequestFailed), timeout=20)
    freed = await pe.wait_event(rid, (rpc.BlocksFreeable, rpc.RequestFailed), timeout=20)
    assert isinstance(arrived, rpc.KvArrived), arrived
    assert isinstance(freed, rpc.BlocksFreeable), freed
    report = de.reports[(rid, 1)]
    assert report.ok, report.problems()
    assert pe.reports[(rid, 1)].ok, pe.reports[(rid, 1)].problems()
    return report


def _events(daemon: Daemon, request_id: str) -> list:
    out = []

    def collect(record, touched) -> None:
        if getattr(record.event, "request_id", None) == request_id:
            out.append(record.event)

    replay(daemon.journal, on_record=collect)
    return out


async def test_partial_hit_writes_exactly_the_tail(pair):
    pe, de = await _engines(pair)
    try:
        src = [list(range(10, 15)), list(range(10, 15))]
        dst = [[500, 501], [502, 503]]
        report = await _push(pe, de, "partial", src, dst)
        # Decode blocks 500/501 hold prefill blocks 13/14, in every layer; the
        # simulated engine also checked that no other decode byte changed.
        assert report.blocks_checked == 4
        pairs = tail_pairs(pe.layout, src, de.layout, dst)
        assert pairs[0] == ((500, 13), (501, 14))
        await de.release("partial")
        await pe.release("partial")
    finally:
        await pe.close()
        await de.close()
    kinds = [type(e).__name__ for e in _events(pair[0], "partial")]
    assert kinds[:7] == [
        "Registered",
        "PeerRegistered",
        "Trimmed",
        "KvReady",
        "WriteStarted",
        "WriteDone",
        "Released",
    ] or kinds[:7] == [
        "PeerRegistered",
        "Registered",
        "Trimmed",
        "KvReady",
        "WriteStarted",
        "WriteDone",
        "Released",
    ]


async def test_no_hit_several_groups_and_layers(pair):
    pe, de = await _engines(pair)
    try:
        src = [list(range(100, 108)), list(range(200, 204))]
        dst = [list(range(300, 308)), list(range(400, 404))]
        report = await _push(pe, de, "nohit", src, dst)
        assert report.blocks_checked == 12
    finally:
        await pe.close()
        await de.close()


async def test_full_hit_writes_nothing_and_completes(pair):
    pe, de = await _engines(pair)
    try:
        before = snapshot(de.view)
        await _push(pe, de, "fullhit", [[1, 2, 3], [4, 5]], [[], []])
        assert changed_blocks(before, de.view) == []
        started = [e for e in _events(pair[0], "fullhit") if isinstance(e, WriteStarted)]
        assert started and started[0].num_blocks == 0 and started[0].nbytes == 0
    finally:
        await pe.close()
        await de.close()


async def test_block_count_mismatch_refused_before_any_write(pair):
    pe, de = await _engines(pair)
    try:
        before = snapshot(de.view)
        await de.decode_register("mismatch", [[1, 2, 3, 4], [5]], "prefill")
        await pe.prefill("mismatch", [[7, 8], [9, 10]], kv_ready=False)
        d_ev = await de.wait_event("mismatch", rpc.RequestFailed, timeout=20)
        p_ev = await pe.wait_event("mismatch", rpc.RequestFailed, timeout=20)
        assert d_ev.reason == "decode_longer_than_prefill"
        assert p_ev.reason == "decode_longer_than_prefill"
        assert changed_blocks(before, de.view) == []
        await de.release("mismatch")
        await pe.release("mismatch")
    finally:
        await pe.close()
        await de.close()
    events = _events(pair[0], "mismatch")
    assert any(isinstance(e, Refused) and e.reason == "decode_longer_than_prefill" for e in events)
    assert not any(isinstance(e, WriteStarted) for e in events)


async def test_duplicate_stale_and_overlap_refused(pair):
    pe, de = await _engines(pair)
    try:
        await _push(pe, de, "first", [[1, 2], [3]], [[20, 21], [22]])
        with pytest.raises(RpcError) as dup:
            await de.client.register_request(
                de.engine_id, "first", Role.RECEIVER, [[30], [31]], peer="prefill"
            )
        assert dup.value.code == "duplicate_request"
        # Blocks 20/21 belong to live request "first": a new claim is refused.
        with pytest.raises(RpcError) as owned:
            await de.client.register_request(
                de.engine_id, "second", Role.RECEIVER, [[21], [40]], peer="prefill"
            )
        assert owned.value.code == "blocks_owned"
        await de.release("first")
        await pe.release("first")
        # A late message for the released incarnation is stale.
        with pytest.raises(RpcError) as stale:
            await pe.client.kv_ready("first", 1)
        assert stale.value.code == "stale_incarnation"
        with pytest.raises(RpcError) as stale_reg:
            await de.client.register_request(
                de.engine_id, "first", Role.RECEIVER, [[50], [51]], peer="prefill", incarnation=1
            )
        assert stale_reg.value.code == "stale_incarnation"
        # After the release the blocks are free again, and a new incarnation is fine.
        await _push(pe, de, "second", [[5, 6], [7]], [[20, 21], [40]])
    finally:
        await pe.close()
        await de.close()


async def test_receiver_abort_keeps_blocks_owned_until_pusher_confirms(pair):
    prefill, decode = pair
    pe, de = await _engines(pair)
    try:
        before = snapshot(de.view)
        await de.decode_register("abort", [[60, 61], [62]], "prefill")
        await pe.prefill("abort", [[1, 2, 3], [4]], kv_ready=False)
        # Freeze the prefill daemon (well within its peer TTL): the decode side
        # cannot get the pusher's word, so its blocks must stay quarantined.
        os.kill(prefill.proc.pid, signal.SIGSTOP)
        try:
            await de.abort("abort")
            reply = await de.client.release("abort", 1)
            assert isinstance(reply, rpc.Deferred)
            with pytest.raises(RpcError) as owned:
                await de.client.register_request(
                    de.engine_id, "thief", Role.RECEIVER, [[61], [70]], peer="prefill"
                )
            assert owned.value.code == "blocks_owned"
        finally:
            os.kill(prefill.proc.pid, signal.SIGCONT)
        released = await de.wait_event("abort", rpc.Released, timeout=20)
        assert isinstance(released, rpc.Released)
        failed = await pe.wait_event("abort", rpc.RequestFailed, timeout=20)
        assert failed.reason == "cancelled_by_peer"
        # The pusher never writes for a cancelled request.
        with pytest.raises(RpcError):
            await pe.kv_ready("abort")
        await asyncio.sleep(0.2)
        assert changed_blocks(before, de.view) == []
        # Once settled and released, the blocks can be claimed again.
        await _push(pe, de, "after-abort", [[8, 9], [10]], [[60, 61], [62]])
    finally:
        await pe.close()
        await de.close()
    events = _events(decode, "abort")
    kinds = [type(e).__name__ for e in events]
    assert kinds.index("ReleaseDeferred") < kinds.index("PeerSettled") < kinds.index("Released")


async def test_prefill_release_during_write_is_deferred(pair):
    prefill, decode = pair
    pe, de = await _engines(pair)
    try:
        await de.decode_register("defer", [[80], [81]], "prefill")
        await pe.prefill("defer", [[1], [2]], kv_ready=False)
        # With the decode daemon frozen, the write's completion (which carries
        # a notification) cannot be confirmed: the pusher stays in writing.
        os.kill(decode.proc.pid, signal.SIGSTOP)
        try:
            await pe.kv_ready("defer")
            for _ in range(100):
                if prefill.status()["by_state"].get("writing"):
                    break
                await asyncio.sleep(0.01)
            assert prefill.status()["by_state"].get("writing") == 1
            reply = await pe.client.release("defer", 1)
            assert isinstance(reply, rpc.Deferred)
        finally:
            os.kill(decode.proc.pid, signal.SIGCONT)
        released = await pe.wait_event("defer", rpc.Released, timeout=20)
        assert isinstance(released, rpc.Released)
        assert isinstance(await de.wait_event("defer", rpc.KvArrived, timeout=20), rpc.KvArrived)
        await de.release("defer")
    finally:
        await pe.close()
        await de.close()
    kinds = [type(e).__name__ for e in _events(prefill, "defer")]
    assert kinds.index("ReleaseDeferred") < kinds.index("WriteDone") < kinds.index("Released")


async def test_offload_slots_are_zeroed_on_release(pair):
    prefill, _ = pair
    tag = _uid()
    data = create_shm_file(f"/dev/shm/kvpushd-test-kv-{tag}", 64 * 4096)
    pool = create_shm_file(f"/dev/shm/kvpushd-test-off-{tag}", 8 * 4096)
    client = await EngineClient.connect(prefill.socket)
    try:
        groups = (GroupSpec(GroupKind.ATTENTION, 64, 4096, (LayerSpec(data.name),)),)
        await client.register_engine(f"off-{tag}", groups, (data,), offload=pool, offload_slots=8)
        slots_file = np.memmap(pool.path, dtype=np.uint8, mode="r+")
        first = await client.register_request(
            f"off-{tag}", "o1", Role.PUSHER, [[1]], offload_slots=3
        )
        assert len(first.offload_slots) == 3
        for slot in first.offload_slots:
            slots_file[slot * 4096 : (slot + 1) * 4096] = 0xEE  # the request's residue
        await client.abort("o1")
        await client.release("o1")
        for slot in first.offload_slots:
            assert not slots_file[slot * 4096 : (slot + 1) * 4096].any(), "slot not zeroed"
        second = await client.register_request(
            f"off-{tag}", "o2", Role.PUSHER, [[2]], offload_slots=8
        )
        assert not any(slots_file[s * 4096 : (s + 1) * 4096].any() for s in second.offload_slots)
        with pytest.raises(RpcError) as exhausted:
            await client.register_request(f"off-{tag}", "o3", Role.PUSHER, [[3]], offload_slots=1)
        assert exhausted.value.code == "offload_exhausted"
        await client.abort("o2")
        await client.release("o2")
    finally:
        await client.close()
        for path in (data.path, pool.path):
            os.unlink(path)


async def test_two_hundred_concurrent_requests_byte_exact(pair):
    layout = [SimGroup(num_blocks=1024, block_bytes=2048, layers=2)]
    engines = [await _engines(pair, layout) for _ in range(2)]
    try:

        async def one(i: int) -> None:
            pe, de = engines[i % 2]
            base = (i // 2) * 5
            src = [list(range(base, base + 5))]
            dst = [list(range(base, base + 2 + i % 3))]
            await _push(pe, de, f"c{i}", src, dst)
            await de.release(f"c{i}")
            await pe.release(f"c{i}")

        await asyncio.gather(*(one(i) for i in range(200)))
        for _, de in engines:
            assert len(de.reports) == 100
            assert all(r.ok for r in de.reports.values())
    finally:
        for pe, de in engines:
            await pe.close()
            await de.close()


def _raw(sock_path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(sock_path)
    return s


def _reply(s: socket.socket):
    header = s.recv(4, socket.MSG_WAITALL)
    if len(header) < 4:
        return None
    body = s.recv(struct.unpack(">I", header)[0], socket.MSG_WAITALL)
    return msgspec.msgpack.decode(body, type=rpc.ServerMessage)


def test_bad_frames_get_errors_and_the_daemon_keeps_serving(pair):
    prefill, _ = pair
    before = prefill.status()
    with _raw(prefill.socket) as s:
        s.sendall(frame_bytes(b"\xc1\xc1garbage"))
        assert _reply(s).code == "bad_frame"
        s.sendall(frame_bytes(msgspec.msgpack.encode({"op": "launch_missiles", "id": 7})))
        err = _reply(s)
        assert err.code == "bad_request" and err.id == 7
        s.sendall(
            frame_bytes(
                msgspec.msgpack.encode(
                    {
                        "op": "register_request",
                        "id": 8,
                        "engine_id": 5,
                        "request_id": [],
                        "role": "pusher",
                        "blocks": "x",
                    }
                )
            )
        )
        err = _reply(s)
        assert err.code == "bad_request" and err.id == 8
        s.sendall(FrameEncoder().encode(rpc.KvReady(id=9, request_id="nobody")))
        assert _reply(s).code == "unknown_request"
    with _raw(prefill.socket) as s:
        s.sendall(struct.pack(">I", 1 << 30))  # a 1 GiB frame: refused, connection closed
        assert _reply(s).code == "frame_too_large"
        assert s.recv(1) == b""
    after = prefill.status()
    assert after["live"] == before["live"]
    # Undecodable input leaves no trace; the one refusal the core made (the
    # unknown request) is journaled, and nothing else.
    assert after["journal"]["next_seq"] == before["journal"]["next_seq"] + 1
    assert any(
        isinstance(e, Refused) and e.reason == "unknown_request" for e in _events(prefill, "nobody")
    )


def test_idle_daemon_uses_almost_no_cpu(pair):
    prefill, decode = pair

    before = {d.node: cpu_seconds(d.proc.pid) for d in (prefill, decode)}
    time.sleep(3.0)
    used = {d.node: cpu_seconds(d.proc.pid) - before[d.node] for d in (prefill, decode)}
    # Heartbeats and deadline checks only: far below a spinning progress thread
    # (which alone would burn ~3 s of CPU here).
    assert all(u < 0.3 for u in used.values()), used


async def test_kill_9_prefill_mid_flight_then_restart(tmp_path):
    prefill, decode = daemon_pair(tmp_path)
    prefill.start()
    decode.start()
    decode.wait_peer("prefill")
    try:
        pe = await SimEngine.create("kp", Role.PUSHER, LAYOUT, prefill.socket)
        de = await SimEngine.create("kd", Role.RECEIVER, LAYOUT, decode.socket)
        before = snapshot(de.view)
        await de.decode_register("k1", [[5, 6], [7]], "prefill")
        await pe.prefill("k1", [[1, 2, 3], [4]], kv_ready=False)
        prefill.kill()
        # The decode side hears its peer die and fails the request, settled:
        # the pusher's process (and any copy it ran) is gone.
        failed = await de.wait_event("k1", rpc.RequestFailed, timeout=20)
        assert failed.reason == "peer_dead"
        await pe.close()
        prefill.start()
        decode.wait_peer("prefill")
        # Replay restored the registry; the in-flight request is failed and
        # the prefill engine is told when it registers again.
        pe = await SimEngine.create("kp", Role.PUSHER, LAYOUT, prefill.socket)
        restarted = await pe.wait_event("k1", rpc.RequestFailed, timeout=20)
        assert restarted.reason == "daemon_restart"
        await pe.release("k1")
        await de.release("k1")
        assert changed_blocks(before, de.view) == []
        for daemon in (prefill, decode):
            st = daemon.status()
            assert st["live"] == 0, st
        # And it still pushes.
        await _push(pe, de, "k2", [[1, 2], [3]], [[5, 6], [7]])
        await de.release("k2")
        await pe.release("k2")
        await pe.close()
        await de.close()
    finally:
        prefill.stop()
        decode.stop()
    events = _events(prefill, "k1")
    assert any(isinstance(e, Failed) and e.reason == "daemon_restart" for e in events)
    result = replay(prefill.journal)
    assert not result.registry.live and not result.registry.owned_blocks()


async def test_a_release_made_while_the_engine_was_away_is_told_when_it_is_back(tmp_path):
    # The prefill engine registers a request the decode side never matches,
    # then loses its connection. The request's deadlines fail and release it
    # meanwhile; nothing about it is live any more, so only a remembered
    # announcement can tell the engine, when it registers again, that its
    # blocks are free.
    from harness.crashrounds import CrashEngine

    fast = "deadlines = { registered = 0.5, failed = 0.5 }"
    prefill, decode = daemon_pair(tmp_path, extra=fast)
    prefill.start()
    decode.start()
    engine = None
    try:
        prefill.wait_peer("decode")
        engine = await CrashEngine.launch(f"p-{_uid()}", Role.PUSHER, prefill.socket)
        await engine.prefill("away", [[1, 2], [1, 2]], peer="decode", kv_ready=False)
        assert engine._client is not None
        await engine._client.close()
        deadline = time.monotonic() + 20
        while prefill.status()["live"] or prefill.status()["engines"]:
            assert time.monotonic() < deadline, prefill.status()
            await asyncio.sleep(0.05)
        names = [type(e).__name__ for e in _events(prefill, "away")]
        assert names[-2:] == ["Failed", "Released"], names

        await engine.reconnect(prefill.socket)
        told = await engine.outcome("away", (rpc.Released,), 10.0)
        assert told == rpc.Released("away", 1), told
    finally:
        if engine is not None:
            await engine.close()
        prefill.stop()
        decode.stop()


async def _next(client: EngineClient, request_id: str) -> rpc.Event:
    while True:
        event = await client.next_event(timeout=20)
        if getattr(event, "request_id", None) == request_id:
            return event


async def _pushed_or_refused(pre: EngineClient, share: str, refused_by: str | None) -> None:
    """Say kv_ready; the push is written, or (``refused_by``) refused naming that field."""
    try:
        await pre.kv_ready(share)
    except RpcError as refused:
        # The pairing was refused before kv_ready came: the push failed already.
        assert refused_by and refused.code == "illegal_transition", refused
    outcome = await _next(pre, share)
    if refused_by:
        assert isinstance(outcome, rpc.RequestFailed), outcome
        assert outcome.reason == "fingerprint_mismatch"
        assert f"field {refused_by!r} differs" in outcome.message, outcome.message
    else:
        assert isinstance(outcome, rpc.BlocksFreeable), outcome


async def _every_load_ended(dec: EngineClient, count: int, *, landed: bool) -> None:
    """The decode engine hears of ``count`` loads: all arrived, or (not ``landed``) all failed."""
    ended = {(await dec.next_event(timeout=20)) for _ in range(count)}
    expected = rpc.KvArrived if landed else rpc.RequestFailed
    assert {type(e) for e in ended} == {expected}, ended


@pytest.mark.parametrize("mis_mapped", [False, True], ids=["mapped", "mis-mapped"])
async def test_two_prefill_ranks_fill_the_two_head_slices_of_one_decode_rank(pair, mis_mapped):
    """P TP 2 -> D TP 1 at the daemon level, through real daemons and NIXL writes.

    Each prefill rank's block holds one KV head (half a decode block); the
    decode rank registers two head-slice engines over its one buffer
    (block_stride = its block size, offsets 0 and half a block), and each
    prefill rank's push pairs with its slice (statemachine/ranks.head_sources).
    Every engine's fingerprint names the heads it holds. The decode buffer
    must end as the two heads side by side in every written block, and the
    bytes outside the written blocks untouched. Mis-mapped (each rank's
    share on the other rank's slice), the prefill daemon refuses both
    pairings by the heads they name, and not one decode byte changes.
    """
    prefill, decode = pair
    tag, nblocks, half = _uid(), 16, 2048
    paths: list[str] = []
    model = Fingerprint("/models/tiny", num_kv_heads=2, tp_size=2, protocol=2)

    def shm(name: str, size: int):
        spec = create_shm_file(f"/dev/shm/kvpushd-test-{name}-{tag}", size)
        paths.append(spec.path)
        return spec, np.memmap(spec.path, dtype=np.uint8, mode="r+")

    d_region, d_bytes = shm("dec", nblocks * 2 * half)
    d_bytes[:] = 0x5A
    clients: list[EngineClient] = []
    try:
        dec = await EngineClient.connect(decode.socket)
        clients.append(dec)
        for source in head_sources(0, 1, 2, 2):
            offset = source.slice_index * half
            slice_group = GroupSpec(
                GroupKind.ATTENTION, nblocks, half, (LayerSpec(d_region.name, offset),),
                block_stride=2 * half,
            )  # fmt: skip
            heads = (source.slice_index, source.slice_index + 1)
            slice_print = msgspec.structs.replace(model, tp_size=1, kv_head_range=heads)
            await dec.register_engine(
                f"d-{tag}-h{source.slice_index}", (slice_group,), (d_region,),
                fingerprint=slice_print,
            )  # fmt: skip
        src, dst = [3, 4, 5], [9, 2, 12]
        for rank in range(2):
            p_region, p_bytes = shm(f"p{rank}", nblocks * half)
            p_bytes[:] = np.arange(nblocks * half, dtype=np.uint32).astype(np.uint8) ^ (rank + 1)
            pre = await EngineClient.connect(prefill.socket)
            clients.append(pre)
            group = GroupSpec(GroupKind.ATTENTION, nblocks, half, (LayerSpec(p_region.name),))
            rank_print = msgspec.structs.replace(model, kv_head_range=(rank, rank + 1))
            engine = f"p-{tag}-tp{rank}"
            await pre.register_engine(engine, (group,), (p_region,), fingerprint=rank_print)
            share = share_id(f"x-{tag}", rank, 2)
            await pre.register_request(engine, share, Role.PUSHER, [src])
            into = 1 - rank if mis_mapped else rank
            await dec.register_request(
                f"d-{tag}-h{into}", share, Role.RECEIVER, [dst], peer="prefill"
            )
            await _pushed_or_refused(pre, share, "kv_head_range" if mis_mapped else None)
        await _every_load_ended(dec, 2, landed=not mis_mapped)
        blocks = np.asarray(d_bytes).reshape(nblocks, 2, half)
        if mis_mapped:
            assert (blocks == 0x5A).all()
            return
        for rank in range(2):
            sent = np.memmap(paths[1 + rank], dtype=np.uint8, mode="r").reshape(nblocks, half)
            for s, d in zip(src, dst, strict=True):
                assert (blocks[d, rank] == sent[s]).all(), (rank, s, d)
        untouched = [b for b in range(nblocks) if b not in dst]
        assert (blocks[untouched] == 0x5A).all()
    finally:
        for client in clients:
            await client.close()
        for path in paths:
            os.unlink(path)


@pytest.mark.parametrize("mis_mapped", [False, True], ids=["mapped", "mis-mapped"])
async def test_one_prefill_rank_split_for_two_decode_ranks_fills_each_from_its_head_slice(
    pair, mis_mapped
):
    """P TP 1 -> D TP 2 at the daemon level, through real daemons and NIXL writes.

    The prefill rank's block holds both KV heads; told the decode's TP, it
    registers two head-slice engines over its one buffer (block_stride = its
    block size, offsets 0 and half a block) and pushes one share per decode
    rank from the slice holding that rank's head (statemachine/ranks.
    head_targets). Each decode rank's buffer must end as its head of the
    written blocks, the rest untouched, and the prefill's buffer unchanged.
    Mis-mapped (each slice pushed as the other rank's share), the prefill
    daemon refuses both pairings by the heads they name, and not one decode
    byte changes.
    """
    prefill, decode = pair
    tag, nblocks, half = _uid(), 16, 2048
    paths: list[str] = []
    model = Fingerprint("/models/tiny", num_kv_heads=2, tp_size=1, protocol=2)

    def shm(name: str, size: int):
        spec = create_shm_file(f"/dev/shm/kvpushd-test-{name}-{tag}", size)
        paths.append(spec.path)
        return spec, np.memmap(spec.path, dtype=np.uint8, mode="r+")

    p_region, p_bytes = shm("pre", nblocks * 2 * half)
    p_bytes[:] = np.arange(nblocks * 2 * half, dtype=np.uint32).astype(np.uint8)
    sent = np.array(p_bytes).reshape(nblocks, 2, half)
    clients: list[EngineClient] = []
    try:
        dec = await EngineClient.connect(decode.socket)
        pre = await EngineClient.connect(prefill.socket)
        clients += [dec, pre]
        src, dst = [3, 4, 5], [9, 2, 12]
        received = []
        for rank in range(2):
            d_region, d_bytes = shm(f"d{rank}", nblocks * half)
            d_bytes[:] = 0x5A
            received.append(d_bytes)
            group = GroupSpec(GroupKind.ATTENTION, nblocks, half, (LayerSpec(d_region.name),))
            rank_print = msgspec.structs.replace(model, tp_size=2, kv_head_range=(rank, rank + 1))
            await dec.register_engine(
                f"d-{tag}-tp{rank}", (group,), (d_region,), fingerprint=rank_print
            )
        for target in head_targets(0, 1, 2, 2):
            slice_group = GroupSpec(
                GroupKind.ATTENTION, nblocks, half,
                (LayerSpec(p_region.name, target.slice_index * half),), block_stride=2 * half,
            )  # fmt: skip
            heads = (target.slice_index, target.slice_index + 1)
            slice_print = msgspec.structs.replace(model, kv_head_range=heads)
            engine = f"p-{tag}-kvh{target.slice_index}"
            await pre.register_engine(engine, (slice_group,), (p_region,), fingerprint=slice_print)
            rank = 1 - target.share_rank if mis_mapped else target.share_rank
            share = share_id(f"x-{tag}", rank, 2)
            await dec.register_request(
                f"d-{tag}-tp{rank}", share, Role.RECEIVER, [dst], peer="prefill"
            )
            await pre.register_request(engine, share, Role.PUSHER, [src])
            await _pushed_or_refused(pre, share, "kv_head_range" if mis_mapped else None)
        await _every_load_ended(dec, 2, landed=not mis_mapped)
        assert (np.asarray(p_bytes).reshape(nblocks, 2, half) == sent).all()
        for rank in range(2):
            blocks = np.asarray(received[rank]).reshape(nblocks, half)
            if mis_mapped:
                assert (blocks == 0x5A).all()
                continue
            for s_block, d_block in zip(src, dst, strict=True):
                assert (blocks[d_block] == sent[s_block, rank]).all(), (rank, s_block, d_block)
            untouched = [b for b in range(nblocks) if b not in dst]
            assert (blocks[untouched] == 0x5A).all()
    finally:
        for client in clients:
            await client.close()
        for path in paths:
            os.unlink(path)


@pytest.mark.parametrize("mis_mapped", [False, True], ids=["mapped", "mis-mapped"])
async def test_two_prefill_stages_fill_the_layers_of_one_decode_stage(pair, mis_mapped):
    """P PP 2 -> D PP 1 at the daemon level, through real daemons and NIXL writes.

    Each prefill stage's engine holds one layer; the decode's engine holds
    both, and it registers one layer-slice engine per prefill stage (the
    group's layers cut to that stage's, statemachine/ranks.stage_sources).
    Every engine's fingerprint names the layers it holds. Each decode layer
    must end as its stage's blocks, the blocks not written untouched.
    Mis-mapped (each stage's share on the other stage's layer), the prefill
    daemon refuses both pairings by the layers they name, and not one
    decode byte changes.
    """
    prefill, decode = pair
    tag, nblocks, nbytes = _uid(), 16, 4096
    paths: list[str] = []
    model = Fingerprint("/models/tiny", num_layers=2, pp_size=2, protocol=3, kv_head_range=(0, 2))

    def shm(name: str, size: int):
        spec = create_shm_file(f"/dev/shm/kvpushd-test-{name}-{tag}", size)
        paths.append(spec.path)
        return spec, np.memmap(spec.path, dtype=np.uint8, mode="r+")

    layer_span = nblocks * nbytes
    d_region, d_bytes = shm("dec", 2 * layer_span)
    d_bytes[:] = 0x5A
    clients: list[EngineClient] = []
    try:
        dec = await EngineClient.connect(decode.socket)
        clients.append(dec)
        for stage in stage_sources(0, 1, 2, 2):
            layer = GroupSpec(
                GroupKind.ATTENTION,
                nblocks,
                nbytes,
                (LayerSpec(d_region.name, stage * layer_span),),
            )
            layer_print = msgspec.structs.replace(
                model, pp_size=1, layer_range=stage_layers(stage, 2, 2)
            )
            await dec.register_engine(
                f"d-{tag}-L{stage}", (layer,), (d_region,), fingerprint=layer_print
            )
        src, dst = [3, 4, 5], [9, 2, 12]
        for stage in range(2):
            p_region, p_bytes = shm(f"p{stage}", layer_span)
            p_bytes[:] = np.arange(layer_span, dtype=np.uint32).astype(np.uint8) ^ (stage + 7)
            pre = await EngineClient.connect(prefill.socket)
            clients.append(pre)
            group = GroupSpec(GroupKind.ATTENTION, nblocks, nbytes, (LayerSpec(p_region.name),))
            stage_print = msgspec.structs.replace(model, layer_range=stage_layers(stage, 2, 2))
            engine = f"p-{tag}-pp{stage}"
            await pre.register_engine(engine, (group,), (p_region,), fingerprint=stage_print)
            share = share_id(f"x-{tag}", 0, 1, stage, 2)
            await pre.register_request(engine, share, Role.PUSHER, [src])
            into = 1 - stage if mis_mapped else stage
            await dec.register_request(
                f"d-{tag}-L{into}", share, Role.RECEIVER, [dst], peer="prefill"
            )
            await _pushed_or_refused(pre, share, "layer_range" if mis_mapped else None)
        await _every_load_ended(dec, 2, landed=not mis_mapped)
        layers = np.asarray(d_bytes).reshape(2, nblocks, nbytes)
        if mis_mapped:
            assert (layers == 0x5A).all()
            return
        for stage in range(2):
            sent = np.memmap(paths[1 + stage], dtype=np.uint8, mode="r").reshape(nblocks, nbytes)
            for s, d in zip(src, dst, strict=True):
                assert (layers[stage, d] == sent[s]).all(), (stage, s, d)
        untouched = [b for b in range(nblocks) if b not in dst]
        assert (layers[:, untouched] == 0x5A).all()
    finally:
        for client in clients:
            await client.close()
        for path in paths:
            os.unlink(path)
