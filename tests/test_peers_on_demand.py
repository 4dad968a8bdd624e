"""Peers on demand: daemons with no [[peers]] link when a receiver names its pusher by address.

Real daemon processes on loopback, simulated engines, real NIXL over DRAM.
Neither daemon lists the other; they share the secret file of their work
folder. The decode engine registers each receiver with the prefill daemon's
node name and ``127.0.0.1:<port>`` (what it would read from the prefill's
kv_transfer_params); the decode daemon dials, authenticates, opens its
windows for the prefill daemon, and the push goes as with a configured peer.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from daemon.client import RpcError
from daemon.journal.replay import replay
from daemon.sim.engine import SimEngine, SimGroup
from daemon.sim.kvpattern import changed_blocks, snapshot
from daemon.sim.launcher import Daemon, free_port, start_daemons, write_secret
from schemas import rpc
from schemas.events import Failed, Refused, Registered
from schemas.layout import Role
from tests.support.fixtures import stop_cleanly
from tests.support.pushes import push

LAYOUT = [
    SimGroup(num_blocks=256, block_bytes=4096, layers=2),
    SimGroup(num_blocks=256, block_bytes=2048, layers=3),
]
IDLE_S = 1.5
CONNECT_S = 1.0
ON_DEMAND = f"peer_connect_timeout_s = {CONNECT_S}\npeer_idle_close_s = {IDLE_S}"


def _uid() -> str:
    return uuid.uuid4().hex[:8]


def _start(workdir: Path, *names: str) -> list[Daemon]:
    """Daemons of one work folder (one secret), none listing another."""
    return start_daemons(lambda: [Daemon(n, workdir, free_port(), extra=ON_DEMAND) for n in names])


def _address(daemon: Daemon) -> str:
    return f"127.0.0.1:{daemon.port}"


def _peers(daemon: Daemon) -> dict[str, dict]:
    return {p["node"]: p for p in daemon.status()["peers"]}


def _events(daemon: Daemon, request_id: str) -> list:
    out: list = []

    def collect(record, touched) -> None:
        if getattr(record.event, "request_id", None) == request_id:
            out.append(record.event)

    replay(daemon.journal, on_record=collect)
    return out


def _log_lines(daemon: Daemon, event: str) -> list[dict]:
    lines = [json.loads(line) for line in daemon.logs().splitlines() if line.startswith("{")]
    return [line for line in lines if line.get("event") == event]


async def _until(predicate, timeout: float = 20.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Daemon, Daemon]]:
    """A prefill and a decode daemon with no [[peers]]: not linked until a registration needs it."""
    daemons = _start(tmp_path_factory.mktemp("on-demand"), "prefill", "decode")
    yield daemons[0], daemons[1]
    stop_cleanly(*daemons)


async def test_push_to_a_peer_named_by_address_then_idle_close_and_redial(pair) -> None:
    prefill, decode = pair
    assert prefill.status()["peers"] == [] and decode.status()["peers"] == []
    tag = _uid()
    pe = await SimEngine.create(f"p-{tag}", Role.PUSHER, LAYOUT, prefill.socket)
    de = await SimEngine.create(f"d-{tag}", Role.RECEIVER, LAYOUT, decode.socket)
    try:
        await push(
            pe, de, prefill, f"od1-{tag}", [[1, 2, 3, 4], [5, 6]], [[40, 41], [42]], on_demand=True
        )
        # Both daemons list the other, as on demand; the decode side dialed.
        seen_by_prefill = _peers(prefill)["decode"]
        assert seen_by_prefill["up"] and seen_by_prefill["on_demand"]
        assert seen_by_prefill["direction"] == "accepted"
        seen_by_decode = _peers(decode)["prefill"]
        assert seen_by_decode["up"] and seen_by_decode["on_demand"]
        assert seen_by_decode["direction"] == "dialed"
        assert seen_by_decode["address"] == _address(prefill)
        boot = seen_by_decode["boot_id"]

        # A second request reuses the link: nobody dialed again.
        await push(pe, de, prefill, f"od2-{tag}", [[7, 8], [9]], [[50, 51], [52]], on_demand=True)
        assert len(_log_lines(decode, "peer_up")) == 1

        # Nothing needs the link any more: it closes after the idle period,
        # on both sides, and stays closed (no dial loop).
        await _until(lambda: not decode.status()["peers"], 10 + IDLE_S, "the idle close")
        await _until(lambda: not prefill.status()["peers"], 10, "the prefill to see it")
        time.sleep(2 * IDLE_S)
        assert decode.status()["peers"] == [] and prefill.status()["peers"] == []
        assert len(_log_lines(decode, "peer_up")) == 1
        closed = _log_lines(decode, "peer_link_closed")
        assert [line["reason"] for line in closed] == ["idle"]

        # The next registration dials again, and the push is as good.
        await push(
            pe, de, prefill, f"od3-{tag}", [[10, 11, 12], [13]], [[60, 61], [62]], on_demand=True
        )
        assert _peers(decode)["prefill"]["boot_id"] == boot
        assert len(_log_lines(decode, "peer_up")) == 2
    finally:
        await pe.close()
        await de.close()
    for daemon in (prefill, decode):
        assert daemon.status()["live"] == 0


async def test_unreachable_peer_refused_within_the_connect_timeout(pair) -> None:
    _, decode = pair
    tag = _uid()
    de = await SimEngine.create(f"d-{tag}", Role.RECEIVER, LAYOUT, decode.socket)
    # Something accepts TCP there but never speaks: the handshake cannot finish.
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    closed_port = free_port()
    before = decode.status()["journal"]["next_seq"]
    try:
        for rid, address in (
            (f"nobody-{tag}", f"127.0.0.1:{closed_port}"),
            (f"silent-{tag}", f"127.0.0.1:{silent.getsockname()[1]}"),
            (f"garbled-{tag}", "no-port-here"),
        ):
            started = time.monotonic()
            with pytest.raises(RpcError) as refused:
                await de.decode_register(rid, [[1, 2], [3]], "prefill-x", peer_address=address)
            took = time.monotonic() - started
            assert refused.value.code == "peer_unreachable", refused.value
            assert took < CONNECT_S + 3.0, took
            events = _events(decode, rid)
            assert [type(e) for e in events] == [Refused], events
            assert events[0].reason == "peer_unreachable"
    finally:
        silent.close()
        await de.close()
    status = decode.status()
    assert status["live"] == 0 and status["pending_peer_registrations"] == 0
    assert not any(p["node"] == "prefill-x" for p in status["peers"])
    assert status["journal"]["next_seq"] >= before + 3


async def test_wrong_secret_refused_and_nothing_live(pair, tmp_path: Path) -> None:
    prefill, _ = pair
    write_secret(tmp_path / "secret", b"a-different-secret-0123456789")
    (stranger,) = start_daemons(
        lambda: [Daemon("stranger", tmp_path, free_port(), extra=ON_DEMAND)]
    )
    try:
        de = await SimEngine.create(f"s-{_uid()}", Role.RECEIVER, LAYOUT, stranger.socket)
        try:
            with pytest.raises(RpcError) as refused:
                await de.decode_register(
                    "wrong-secret", [[1], [2]], "prefill", peer_address=_address(prefill)
                )
        finally:
            await de.close()
        assert refused.value.code == "peer_unreachable"
        assert "auth_failed" in refused.value.message, refused.value.message
        status = stranger.status()
        assert status["live"] == 0 and status["peers"] == []
        assert [type(e) for e in _events(stranger, "wrong-secret")] == [Refused]
        assert not any(p["node"] == "stranger" for p in prefill.status()["peers"])
    finally:
        stop_cleanly(stranger)


async def test_kill_9_prefill_mid_request_fails_peer_dead_and_fences(tmp_path: Path) -> None:
    prefill, decode = _start(tmp_path, "prefill", "decode")
    try:
        pe = await SimEngine.create("kp", Role.PUSHER, LAYOUT, prefill.socket)
        de = await SimEngine.create("kd", Role.RECEIVER, LAYOUT, decode.socket)
        try:
            before = snapshot(de.view)
            await de.decode_register("k1", [[5, 6], [7]], "prefill", peer_address=_address(prefill))
            await pe.prefill("k1", [[1, 2, 3], [4]], kv_ready=False)
            assert _peers(decode)["prefill"]["up"]
            prefill.kill()
            failed = await de.wait_event("k1", rpc.RequestFailed, timeout=20)
            assert failed.reason == "peer_dead"
            # Fenced: the prefill daemon's windows here were revoked before the
            # failure was journaled, and the blocks are free at once.
            fenced = [
                line for line in _log_lines(decode, "peer fenced") if line["peer"] == "prefill"
            ]
            assert fenced and fenced[0]["windows_revoked"] > 0, decode.logs()[-3000:]
            assert isinstance(await de.client.release("k1"), rpc.Ok)
            assert changed_blocks(before, de.view) == []
        finally:
            await pe.close()
            await de.close()
        events = _events(decode, "k1")
        assert [type(e) for e in events][:1] == [Registered]
        assert any(isinstance(e, Failed) and e.reason == "peer_dead" and e.settled for e in events)
        status = decode.status()
        assert status["live"] == 0 and status["peers"] == []
        # No dial loop towards the dead address.
        time.sleep(1.0)
        assert not _log_lines(decode, "peer_on_demand_failed")
    finally:
        prefill.kill()
        stop_cleanly(decode)
