"""End-to-end integrity checks (issue 15): real daemons, real NIXL over DRAM.

Three ways to land wrong KV with every state looking right, each planted in
a real pair of daemons with simulated engines:

* ``flip``: a byte of a destination block changes after the NIXL
  notification and before the receiver's check (failpoint
  ``integrity.flip_dst`` on the decode daemon);
* ``source``: the prefill engine rewrites a source block while the write is
  held (the prefill daemon stops itself at ``nixl.post``, after its
  checksums, and the test writes the block before it resumes);
* ``front-trim``: the pusher hands NIXL the front of its blocks instead of
  the trimmed tail (failpoint ``integrity.shift_src``).

With ``verify = "all"`` each ends ``integrity_mismatch``: the decode engine
hears ``request_failed`` and never ``kv_arrived``, and the decode journal
names the blocks. With ``verify = "off"`` the same fault goes through: the
decode engine hears ``kv_arrived`` over bytes that are wrong (its own check
of the pattern says so), which is what the integrity check is there to
catch.

Offload pools: a slot written while free is caught when it is next granted
(the registration is refused ``integrity_mismatch`` and the slot zeroed);
with verification off the request gets the stray bytes.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import urllib.request
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Final

import numpy as np
import pytest

from daemon.client import EngineClient, RpcError
from daemon.dataplane.memory import create_shm_file
from daemon.sim.engine import Expectation, SimEngine, SimGroup, tail_pairs
from daemon.sim.launcher import Daemon, daemon_pair, free_port, start_daemons
from schemas import rpc
from schemas.events import Failed, IntegrityMismatch, Refused
from schemas.kvlayout import GroupSpec, LayerSpec
from schemas.layout import GroupKind, Role
from schemas.reasons import Reason
from tests.support.waiting import is_stopped, wait_until

LAYOUT: Final = [SimGroup(num_blocks=64, block_bytes=4096, layers=2)]
SRC: Final = [list(range(10, 16))]  # the pusher's 6 blocks
DST: Final = [list(range(40, 44))]  # the receiver's 4: a partial hit, the tail is written
OUTCOMES: Final = (rpc.KvArrived, rpc.RequestFailed)


class Pair:
    """A prefill and a decode daemon with an engine each, under one setting."""

    def __init__(self, daemons: list[Daemon], pe: SimEngine, de: SimEngine, port: int) -> None:
        self.prefill, self.decode = daemons
        self.pe, self.de = pe, de
        self.decode_metrics_port = port

    def decode_metric(self, name: str) -> float:
        url = f"http://127.0.0.1:{self.decode_metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            text = response.read().decode()
        (line,) = [x for x in text.splitlines() if x.startswith(f"{name} ")]
        return float(line.split()[1])


@pytest.fixture
async def pairs() -> AsyncIterator[list[Pair]]:
    made: list[Pair] = []
    yield made
    for pair in made:
        for daemon in (pair.prefill, pair.decode):
            if daemon.proc is not None and daemon.proc.poll() is None:
                os.kill(daemon.proc.pid, signal.SIGCONT)
        await pair.pe.close()
        await pair.de.close()
        for daemon in (pair.prefill, pair.decode):
            assert daemon.stop() == 0, daemon.logs()


async def start(
    tmp_path: Path, pairs: list[Pair], verify: str, env: dict[str, dict[str, str]]
) -> Pair:
    extra = f'[integrity]\nverify = "{verify}"'
    port = free_port()

    def make() -> list[Daemon]:
        prefill, decode = daemon_pair(tmp_path, extra=extra)
        decode.extra = f"metrics_port = {port}\n{extra}"
        prefill.env, decode.env = env.get("prefill", {}), env.get("decode", {})
        return [prefill, decode]

    daemons = await asyncio.to_thread(start_daemons, make)
    try:
        await asyncio.to_thread(daemons[1].wait_peer, "prefill")
        await asyncio.to_thread(daemons[0].wait_peer, "decode")
        pe = await SimEngine.create("pre", Role.PUSHER, LAYOUT, daemons[0].socket)
        de = await SimEngine.create("dec", Role.RECEIVER, LAYOUT, daemons[1].socket)
    except BaseException:
        for daemon in daemons:
            daemon.kill()
        raise
    pair = Pair(daemons, pe, de, port)
    pairs.append(pair)
    return pair


async def push(pair: Pair, rid: str, *, hold: bool = False, dst: Any = DST) -> rpc.Event:
    """Register both sides and let the write go; the decode engine's outcome."""
    pe, de = pair.pe, pair.de
    expect = Expectation(pe.engine_id, tail_pairs(pe.layout, SRC, de.layout, dst))
    await de.decode_register(rid, dst, "prefill", expect=expect)
    await pe.prefill(rid, SRC, kv_ready=not hold)
    if hold:
        # kv_ready starts the write; the prefill daemon stops itself at
        # nixl.post with its checksums taken and the WRITE not yet posted
        # (before it answers kv_ready). The engine now rewrites a source block
        # that the trim pairs (the last one), then the daemon resumes.
        ready = asyncio.ensure_future(pe.kv_ready(rid))
        proc = pair.prefill.proc
        assert proc is not None
        await wait_until("the prefill daemon holds its write", lambda: is_stopped(proc.pid))
        pe.view.block(0, 1, SRC[0][-1])[:64] ^= 0x5A
        os.kill(proc.pid, signal.SIGCONT)
        await ready
    outcome = await de.wait_event(rid, OUTCOMES, timeout=20)
    assert outcome is not None
    return outcome


async def finish(pair: Pair, rid: str) -> None:
    """Both engines release; nothing stays live on either daemon."""
    freed = await pair.pe.wait_event(rid, (rpc.BlocksFreeable, rpc.RequestFailed), timeout=20)
    assert isinstance(freed, rpc.BlocksFreeable), freed  # the pusher's side went as always
    await pair.pe.release(rid)
    await pair.de.release(rid)
    for daemon in (pair.prefill, pair.decode):
        await wait_until(f"{daemon.node} idle", lambda d=daemon: not d.status()["live"])


def postmortem(command: str, *args: object) -> str:
    """``kvpushd journal COMMAND ARGS``; its standard output."""
    done = subprocess.run(
        [sys.executable, "-m", "daemon.cli", "journal", command, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "TZ": "UTC"},
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


FAULTS: Final = {
    # name: (failpoints per daemon, hold the write, the blocks the decode journal names)
    "flip": ({"decode": {"KVPUSHD_FAILPOINTS": "integrity.flip_dst=corrupt"}}, False, [(0, 0, 40)]),
    "source": ({"prefill": {"KVPUSHD_FAILPOINTS": "nixl.post=stop@1"}}, True, [(0, 1, 43)]),
    "front-trim": (
        {"prefill": {"KVPUSHD_FAILPOINTS": "integrity.shift_src=corrupt"}},
        False,
        [(0, layer, b) for layer in range(2) for b in DST[0]],
    ),
}


@pytest.mark.parametrize("fault", list(FAULTS))
async def test_a_fault_with_verification_ends_integrity_mismatch_never_kv_arrived(
    tmp_path: Path, pairs: list[Pair], fault: str
) -> None:
    env, hold, blocks = FAULTS[fault]
    pair = await start(tmp_path, pairs, "all", env)
    outcome = await push(pair, "r1", hold=hold)
    assert isinstance(outcome, rpc.RequestFailed), outcome
    assert outcome.reason is Reason.INTEGRITY_MISMATCH
    assert not any(isinstance(e, rpc.KvArrived) for e in pair.de._live[("r1", 1)].events)
    events = pair.decode.journal_events("r1")
    (mismatch,) = [e for e in events if isinstance(e, IntegrityMismatch)]
    assert sorted(mismatch.blocks) == blocks
    assert (mismatch.checked, mismatch.mismatched) == (8, len(blocks))  # 4 blocks x 2 layers
    failed = [e for e in events if isinstance(e, Failed)]
    assert [f.reason for f in failed] == [Reason.INTEGRITY_MISMATCH]
    # The mismatch comes first, then the failure: nothing handed over as good.
    assert events.index(mismatch) == events.index(failed[0]) - 1
    await finish(pair, "r1")
    assert pair.decode.status()["counters"]["integrity_mismatches"] == 1
    assert await asyncio.to_thread(pair.decode_metric, "kvpushd_integrity_mismatches_total") == 1
    # The postmortem lists it as an anomaly, with its blocks, in text, JSON and HTML.
    journals = (pair.prefill.journal, pair.decode.journal)
    text = await asyncio.to_thread(postmortem, "replay", *journals)
    section = text.split("integrity mismatches")[1].split("\n\n")[0]
    g, layer, b = blocks[0]
    assert "r1#1" in section and f"{g}/{layer}/{b}" in section, text
    report = json.loads(await asyncio.to_thread(postmortem, "replay", *journals, "--json"))
    (row,) = report["integrity_mismatches"]
    assert (row["node"], row["mismatched"], row["checked"]) == ("decode", len(blocks), 8)
    assert sorted(map(tuple, row["blocks"])) == blocks
    html = tmp_path / "report.html"
    await asyncio.to_thread(postmortem, "report", *journals, "-o", html)
    assert 'id="anomaly-integrity"' in html.read_text()


@pytest.mark.parametrize("fault", list(FAULTS))
async def test_the_same_fault_without_verification_goes_through_unnoticed(
    tmp_path: Path, pairs: list[Pair], fault: str
) -> None:
    env, hold, _ = FAULTS[fault]
    pair = await start(tmp_path, pairs, "off", env)
    outcome = await push(pair, "r1", hold=hold)
    # The daemons see nothing wrong: the decode engine is told its KV arrived...
    assert isinstance(outcome, rpc.KvArrived), outcome
    # ...but the bytes are not the prefill engine's: only the check catches this.
    report = pair.de.reports[("r1", 1)]
    assert not report.ok
    events = pair.decode.journal_events("r1")
    assert not any(isinstance(e, IntegrityMismatch | Failed) for e in events)
    await finish(pair, "r1")
    assert pair.decode.status()["counters"]["integrity_checked"] == 0
    assert await asyncio.to_thread(pair.decode_metric, "kvpushd_integrity_mismatches_total") == 0


async def test_a_clean_push_is_verified_and_arrives(tmp_path: Path, pairs: list[Pair]) -> None:
    pair = await start(tmp_path, pairs, "all", {})
    for rid in ("a", "b", "c"):
        outcome = await push(pair, rid)
        assert isinstance(outcome, rpc.KvArrived), outcome
        assert pair.de.reports[(rid, 1)].ok, pair.de.reports[(rid, 1)].problems()
        await finish(pair, rid)
    # A full prefix hit writes nothing: its (empty) digests still come, and
    # nothing is compared, so the receiver never waits for a notification.
    outcome = await push(pair, "full", dst=[[]])
    assert isinstance(outcome, rpc.KvArrived), outcome
    await finish(pair, "full")
    counters = pair.decode.status()["counters"]
    assert counters["integrity_checked"] == 3
    assert counters["integrity_blocks_verified"] == 3 * 8
    assert counters["integrity_mismatches"] == 0
    assert pair.prefill.status()["counters"]["integrity_digests_sent"] == 4


# ------------------------------------------------------------- offload slots

POOL_SLOTS: Final = 4
SLOT_BYTES: Final = 4096


@pytest.mark.parametrize("verify", ["all", "off"])
async def test_an_offload_slot_not_zero_at_grant_is_caught_before_use(
    tmp_path: Path, verify: str
) -> None:
    # The nano-vllm class of bug: a slot that was not reset. Here the engine
    # writes into a free slot (one no request holds), and the next grant of
    # that slot must not hand its bytes to a request as if they were clean.
    tag = uuid.uuid4().hex[:8]
    data = create_shm_file(f"/dev/shm/kvpushd-test-ikv-{tag}", 16 * 4096)
    pool = create_shm_file(f"/dev/shm/kvpushd-test-ioff-{tag}", POOL_SLOTS * SLOT_BYTES)
    slots = np.memmap(pool.path, dtype=np.uint8, mode="r+")
    groups = (GroupSpec(GroupKind.ATTENTION, 16, 4096, (LayerSpec(data.name),)),)
    daemon = Daemon("solo", tmp_path, free_port(), extra=f'[integrity]\nverify = "{verify}"')
    await asyncio.to_thread(daemon.start)
    client = await EngineClient.connect(daemon.socket)
    try:
        await client.register_engine("eng", groups, (data,), offload=pool, offload_slots=POOL_SLOTS)
        first = await client.register_request("eng", "a", Role.PUSHER, [[1]], offload_slots=1)
        assert first.offload_slots == (0,)
        slots[SLOT_BYTES : 2 * SLOT_BYTES][100] = 0x77  # slot 1, free, written anyway
        if verify == "off":
            # Nothing looks: the request is granted the slot with the stray byte in it.
            dirty = await client.register_request("eng", "b", Role.PUSHER, [[2]], offload_slots=1)
            assert dirty.offload_slots == (1,)
            assert slots[SLOT_BYTES + 100] == 0x77
            assert daemon.status()["counters"]["integrity_slots_checked"] == 0
            return
        with pytest.raises(RpcError) as refused:
            await client.register_request("eng", "b", Role.PUSHER, [[2]], offload_slots=1)
        assert refused.value.code == "integrity_mismatch"
        assert "[1]" in str(refused.value)
        # The slot was zeroed on the spot: registering again gets it clean.
        clean = await client.register_request("eng", "b", Role.PUSHER, [[2]], offload_slots=1)
        assert clean.offload_slots == (1,)
        assert not slots[SLOT_BYTES : 2 * SLOT_BYTES].any()
        counters = daemon.status()["counters"]
        assert (counters["integrity_dirty_slots"], counters["integrity_slots_checked"]) == (1, 3)
        refusals = [e for e in daemon.journal_events("b") if isinstance(e, Refused)]
        assert [r.reason for r in refusals] == [Reason.INTEGRITY_MISMATCH]
    finally:
        await client.close()
        assert await asyncio.to_thread(daemon.stop) == 0, daemon.logs()
        del slots
        for spec in (data, pool):
            os.unlink(spec.path)
