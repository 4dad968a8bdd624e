"""Identity by behaviour, the daemons' side: kv_mismatch and the quarantine, on real daemons.

Two real daemons, simulated engines declaring fingerprints, real NIXL. A
push lands and is released; the decode engine then reports that its own
K/V of the recomputed token differed (``rpc.KvMismatch``). Both journals
hold ``kv_mismatch``, both daemons count it, and the prefill daemon
quarantines the pairing: the next push between the same fingerprints is
refused ``quarantined`` before any byte is written, on both journals. The
quarantine survives a kill and restart (replay), `kvpushd quarantine clear`
ends it (the next push lands), and the clear survives a restart too. A
report the decode daemon cannot place is refused, nothing changed.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator

import pytest

from daemon.cli import main
from daemon.client.errors import RpcError
from daemon.sim.engine import Expectation, SimEngine, SimGroup, tail_pairs
from daemon.sim.kvpattern import changed_blocks, snapshot
from schemas import rpc
from schemas.events import Failed, KvMismatch, Trimmed, WriteStarted
from schemas.fingerprint import Fingerprint
from schemas.layout import Role
from schemas.reasons import Reason
from tests.support.metrics import MetricsDaemon, delta, metrics_pair

TINY = Fingerprint("/models/tiny", dtype="float32", block_size=32, num_layers=2, num_kv_heads=2)
LAYOUT = [SimGroup(num_blocks=64, block_bytes=2048, layers=2)]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[MetricsDaemon, ...]]:
    yield from metrics_pair(tmp_path_factory.mktemp("kvmismatch"))


async def _engine(daemon: MetricsDaemon, role: Role) -> SimEngine:
    tag = uuid.uuid4().hex[:8]
    return await SimEngine.create(
        f"{role.value[0]}-{tag}", role, LAYOUT, daemon.socket, fingerprint=TINY
    )


async def _lands(pe: SimEngine, de: SimEngine, rid: str, src: list, dst: list) -> None:
    expect = Expectation(pe.engine_id, tail_pairs(pe.layout, src, de.layout, dst))
    await de.decode_register(rid, dst, "prefill", expect=expect)
    await pe.prefill(rid, src)
    arrived = await de.wait_event(rid, (rpc.KvArrived, rpc.RequestFailed))
    assert isinstance(arrived, rpc.KvArrived), arrived
    assert de.reports[(rid, 1)].ok, de.reports[(rid, 1)].problems()
    assert isinstance(await pe.wait_event(rid, (rpc.BlocksFreeable,)), rpc.BlocksFreeable)
    await de.release(rid)
    await pe.release(rid)


async def _refused_quarantined(pe: SimEngine, de: SimEngine, rid: str) -> None:
    before = snapshot(de.view)
    await de.decode_register(rid, [[20, 21]], "prefill")
    await pe.prefill(rid, [[1, 2, 3]], kv_ready=False)
    for engine in (pe, de):
        failed = await engine.wait_event(
            rid, (rpc.KvArrived, rpc.BlocksFreeable, rpc.RequestFailed)
        )
        assert isinstance(failed, rpc.RequestFailed), failed
        assert failed.reason == Reason.QUARANTINED, failed
        assert "quarantined" in failed.message
    assert changed_blocks(before, de.view) == []  # nothing written
    await de.release(rid)
    await pe.release(rid)


def _journal_says_quarantined(prefill: MetricsDaemon, decode: MetricsDaemon, rid: str) -> None:
    for daemon in (prefill, decode):
        events = daemon.journal_events(rid)
        (failed,) = [e for e in events if isinstance(e, Failed)]
        assert failed.reason is Reason.QUARANTINED, events
        assert not [e for e in events if isinstance(e, Trimmed | WriteStarted)], events


def _until(check, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while True:
        found = check()
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def _quarantine(daemon: MetricsDaemon, capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    capsys.readouterr()
    assert main(["quarantine", *args, "--socket", daemon.socket, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _restart(daemon: MetricsDaemon, other: MetricsDaemon) -> None:
    daemon.kill()  # SIGKILL: the quarantine must come back from the journal alone
    daemon.start()
    daemon.wait_peer(other.node)
    other.wait_peer(daemon.node)


async def test_a_mismatch_is_journaled_on_both_nodes_and_quarantines_the_pairing(
    pair, capsys: pytest.CaptureFixture[str]
) -> None:
    prefill, decode = pair
    p0, d0 = prefill.scrape(), decode.scrape()
    pe, de = await _engine(prefill, Role.PUSHER), await _engine(decode, Role.RECEIVER)
    try:
        await _lands(pe, de, "mm-1", [[3, 4, 5]], [[40, 41, 42]])
        # The load landed and was released; the decode's forward then ran.
        reply = await de.client.kv_mismatch(
            "mm-1", layer=1, position=95, difference=0.5, tolerance=0.01, detail="rope"
        )
        assert isinstance(reply, rpc.Ok)
        found = _until(
            lambda: [e for e in prefill.journal_events("mm-1") if isinstance(e, KvMismatch)]
        )
        assert found, prefill.logs()
        (pushed,) = found
        (received,) = [e for e in decode.journal_events("mm-1") if isinstance(e, KvMismatch)]
        assert (received.role, received.engine_id, received.peer) == (
            Role.RECEIVER, de.engine_id, "prefill",
        )  # fmt: skip
        assert (pushed.role, pushed.engine_id, pushed.peer, pushed.peer_engine) == (
            Role.PUSHER, pe.engine_id, "decode", de.engine_id,
        )  # fmt: skip
        for event in (pushed, received):
            assert (event.layer, event.position, event.difference, event.tolerance) == (
                1, 95, 0.5, 0.01,
            )  # fmt: skip
            assert event.detail == "rope"
        assert (pushed.prefill_fingerprint, pushed.decode_fingerprint) == (TINY, TINY)
        p1, d1 = prefill.scrape(), decode.scrape()
        assert delta(p0, p1, "kvpushd_kv_mismatches_total", role="pusher") == 1
        assert delta(d0, d1, "kvpushd_kv_mismatches_total", role="receiver") == 1
        assert '"kv mismatch"' in decode.logs() and '"kv mismatch"' in prefill.logs()

        # The same pairing is refused before any byte moves; both journals say why.
        await _refused_quarantined(pe, de, "mm-2")
        _journal_says_quarantined(prefill, decode, "mm-2")
        (listed,) = _quarantine(prefill, capsys, "list")["quarantined"]
        assert listed["request_id"] == "mm-1" and listed["peer_engine"] == de.engine_id
        assert _quarantine(decode, capsys, "list")["quarantined"] == []  # decided on the prefill
        qid = listed["id"]
    finally:
        await pe.close()
        await de.close()

    # A kill and restart replays the quarantine from the journal.
    _restart(prefill, decode)
    assert [q["id"] for q in _quarantine(prefill, capsys, "list")["quarantined"]] == [qid]
    pe, de = await _engine(prefill, Role.PUSHER), await _engine(decode, Role.RECEIVER)
    try:
        await _refused_quarantined(pe, de, "mm-3")
        # The operator clears it: the next push between the same fingerprints lands.
        cleared = _quarantine(prefill, capsys, "clear", qid)
        assert cleared == {"quarantined": [], "cleared": [qid]}
        await _lands(pe, de, "mm-4", [[6, 7]], [[50, 51]])
    finally:
        await pe.close()
        await de.close()
    # The clear is journaled: a restarted daemon keeps it.
    _restart(prefill, decode)
    assert _quarantine(prefill, capsys, "list")["quarantined"] == []
    assert main(["quarantine", "clear", qid, "--socket", prefill.socket]) == 4  # gone: refused
    # The journal tools read the new records.
    capsys.readouterr()
    assert main(["journal", "show", str(prefill.journal)]) == 0
    shown = capsys.readouterr().out
    assert "KvMismatch  request_id=mm-1" in shown and f"quarantine_id={qid}" in shown
    assert main(["journal", "replay", str(prefill.journal), str(decode.journal)]) == 0
    replayed = capsys.readouterr().out
    assert "kv mismatches" in replayed and "mm-1" in replayed


async def test_a_report_the_daemon_cannot_place_is_refused_and_it_keeps_serving(pair) -> None:
    prefill, decode = pair
    pe, de = await _engine(prefill, Role.PUSHER), await _engine(decode, Role.RECEIVER)
    try:
        await _lands(pe, de, "place-1", [[8, 9]], [[30, 31]])
        with pytest.raises(RpcError) as unknown:
            await de.client.kv_mismatch(
                "never-registered", layer=0, position=1, difference=1.0, tolerance=0.1
            )
        assert unknown.value.reason is Reason.UNKNOWN_REQUEST
        assert "no receiver of that id" in unknown.value.message
        # A pusher is not a receiver: the prefill engine has nothing to report.
        with pytest.raises(RpcError) as pusher:
            await pe.client.kv_mismatch(
                "place-1", layer=0, position=1, difference=1.0, tolerance=0.1
            )
        assert pusher.value.reason is Reason.ROLE_MISMATCH
        # Out of range: refused as a bad request when decoded.
        for bad in ({"difference": float("nan")}, {"layer": -1}, {"position": 1 << 41}):
            fields = {"layer": 0, "position": 1, "difference": 1.0, "tolerance": 0.1} | bad
            with pytest.raises(RpcError) as malformed:
                await de.client.kv_mismatch("place-1", **fields)
            assert malformed.value.code == rpc.BAD_REQUEST, bad
        # Nothing changed: no record, no quarantine; the daemons serve on.
        for daemon in (prefill, decode):
            assert not [e for e in daemon.journal_events("place-1") if isinstance(e, KvMismatch)]
        assert prefill.status()["node"] == "prefill"
        await _lands(pe, de, "place-2", [[10, 11]], [[32, 33]])
    finally:
        await pe.close()
        await de.close()
