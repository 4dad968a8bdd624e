"""Daemons on separate hosts: network namespaces, UCX over TCP, partitions and a lost host.

Each daemon runs in a network namespace of its own (daemon/sim/hosts.py),
with one address on a bridge, UCX limited to its TCP transport on that
interface, and ``verify = "all"``: every write's bytes are checked end to
end by the daemons, and again by the simulated engines. The engines run in
this test process and reach their daemons by Unix socket, in each host's
own folder. The hosts:

- ``prefill``: pushes to all; lists ``decode2`` as a static peer;
- ``decode1``: no ``[[peers]]``: it dials the prefill on demand, by the
  address a receiver names;
- ``decode2``: lists ``prefill`` as a static peer;
- ``gone``: a decode host that is lost whole in the last test.

The faults are the cluster's: a link down mid-write past and within the
peer TTL, loss in one direction, a host that vanishes. What each ends as is
asserted on both sides' events and journals.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from daemon.client import RpcError
from daemon.journal.replay import replay
from daemon.sim.engine import Expectation, SimEngine, SimGroup, tail_pairs
from daemon.sim.hosts import (
    PREFIX,
    UCX_OVER_THE_NETWORK,
    Hosts,
    entered,
    remote_writes,
    sweep_stale,
)
from daemon.sim.launcher import TEST_TIMING, Daemon, new_secret, start_pair
from schemas import rpc
from schemas.events import Failed, WriteDone
from schemas.layout import Role
from tests.support.fixtures import stop_cleanly
from tests.support.pushes import push

PORT = 7400  # every host has its own address: one port for all, as in a cluster
SMALL = [SimGroup(num_blocks=64, block_bytes=16384, layers=2)]
# Big enough that a write over TCP takes a while: a partition lands mid-write.
BIG = [SimGroup(num_blocks=96, block_bytes=2 << 20, layers=1)]
SETTINGS = 'peer_connect_timeout_s = 2.0\npeer_idle_close_s = 60.0\n[integrity]\nverify = "all"'
NAMES = ("prefill", "decode1", "decode2", "gone")
STATIC = {"prefill": ["decode2"], "decode2": ["prefill"]}


@dataclass
class Cluster:
    hosts: Hosts
    daemons: dict[str, Daemon]

    def __getitem__(self, name: str) -> Daemon:
        return self.daemons[name]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    work = tmp_path_factory.mktemp("hosts")
    with Hosts(NAMES) as hosts:
        daemons: dict[str, Daemon] = {}
        secret = new_secret()  # one for the cluster: each host has its own folder
        try:
            for name in NAMES:
                folder = work / name  # each host's own folder: socket, journal, log
                folder.mkdir()
                daemons[name] = Daemon(
                    name,
                    folder,
                    PORT,
                    extra=SETTINGS,
                    secret=secret,
                    # A native crash prints every thread's stack to the log.
                    env=dict(UCX_OVER_THE_NETWORK, PYTHONFAULTHANDLER="1"),
                    netns=hosts[name].netns,
                    host=hosts[name].address,
                    peer_addresses=[
                        (peer, f"{hosts[peer].address}:{PORT}") for peer in STATIC.get(name, [])
                    ],
                ).start()
            daemons["prefill"].wait_peer("decode2")
            yield Cluster(hosts, daemons)
        finally:
            for daemon in daemons.values():
                with contextlib.suppress(Exception):
                    stop_cleanly(daemon)


def _uid() -> str:
    return uuid.uuid4().hex[:8]


def _peers(daemon: Daemon) -> dict[str, dict]:
    return {p["node"]: p for p in daemon.status()["peers"]}


def _ended(daemon: Daemon, request_id: str) -> list[str]:
    """How the journal ended the request: "done" or "failed:<reason>", once per ending."""
    endings: list[str] = []

    def collect(record, touched) -> None:
        event = record.event
        if getattr(event, "request_id", None) != request_id:
            return
        if isinstance(event, WriteDone):
            endings.append("done")
        elif isinstance(event, Failed):
            endings.append(f"failed:{event.reason}")

    replay(daemon.journal, on_record=collect)
    return endings


def _log_lines(daemon: Daemon, event: str) -> list[dict]:
    lines = [json.loads(line) for line in daemon.logs().splitlines() if line.startswith("{")]
    return [line for line in lines if line.get("event") == event]


# ------------------------------------------------------------------ harness


def _ours() -> tuple[list[str], str]:
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    return [n for n in namespaces.split() if n.startswith(PREFIX)], links


def test_the_harness_removes_all_it_made_even_when_the_test_fails() -> None:
    before, _ = _ours()
    with pytest.raises(RuntimeError, match="the test failed"), Hosts(["a", "b"]) as hosts:
        sleeper = subprocess.Popen(hosts["a"].command(["sleep", "600"]))
        made = [hosts[n].netns for n in ("a", "b")]
        assert set(made) <= set(_ours()[0])
        raise RuntimeError("the test failed")
    assert sleeper.wait(timeout=10) == -signal.SIGKILL  # what ran in a host is gone
    after, links = _ours()
    assert after == before and not set(made) & set(after)
    assert f"{PREFIX}{os.getpid()}" not in links


def _reaches(hosts: Hosts, src: str, dst: str, port: int = 7999) -> bool:
    """Whether a TCP connection from host ``src`` to a listener on host ``dst`` comes up."""
    listener = subprocess.Popen(
        hosts[dst].command(
            [sys.executable, "-c", _LISTEN.format(port=port)],
        ),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert listener.stdout is not None and listener.stdout.readline().strip() == "listening"
        with entered(hosts[src].netns), socket.socket() as client:
            client.settimeout(1.0)
            try:
                client.connect((hosts[dst].address, port))
            except OSError:
                return False
            return True
    finally:
        listener.kill()
        listener.wait()


_LISTEN = (
    "import socket; s = socket.socket(); "
    "s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); "
    "s.bind(('0.0.0.0', {port})); s.listen(); print('listening', flush=True); "
    "s.settimeout(5); s.accept()"
)


def test_faults_cut_exactly_the_paths_they_name() -> None:
    with Hosts(["a", "b", "c"]) as hosts:
        assert _reaches(hosts, "a", "b") and _reaches(hosts, "b", "a")
        hosts.partition("a", "b")  # a and b lose each other, nothing else
        assert not _reaches(hosts, "a", "b") and not _reaches(hosts, "b", "a")
        assert _reaches(hosts, "a", "c") and _reaches(hosts, "c", "b")
        hosts.heal("a", "b")
        assert _reaches(hosts, "a", "b")
        hosts.drop_inbound("b")  # nothing reaches b; b still sends (no answer comes back)
        assert not _reaches(hosts, "a", "b") and not _reaches(hosts, "c", "b")
        assert _reaches(hosts, "a", "c")
        hosts.mend("b")
        assert _reaches(hosts, "c", "b")
        hosts.cut("c")  # c alone is off the bridge
        assert not _reaches(hosts, "a", "c") and _reaches(hosts, "a", "b")
        hosts.mend("c")
        assert _reaches(hosts, "b", "c")


def test_namespaces_a_dead_run_left_behind_are_swept() -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid nobody has any more: the creator that crashed
    stale = f"{PREFIX}{dead.pid}n1"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    try:
        assert stale in sweep_stale()
        assert stale not in _ours()[0]
    finally:
        subprocess.run(["ip", "netns", "del", stale], capture_output=True)


# ------------------------------------------------------------------ paths


async def test_the_lifecycle_and_the_trim_across_hosts_on_demand_and_static(
    cluster: Cluster,
) -> None:
    prefill, decode1, decode2 = cluster["prefill"], cluster["decode1"], cluster["decode2"]
    tag = _uid()
    async with (
        await SimEngine.create(f"p-{tag}", Role.PUSHER, SMALL, prefill.socket) as pe,
        await SimEngine.create(f"d1-{tag}", Role.RECEIVER, SMALL, decode1.socket) as d1,
        await SimEngine.create(f"d2-{tag}", Role.RECEIVER, SMALL, decode2.socket) as d2,
    ):
        # decode1 names the prefill by address: dialed on demand; it holds a
        # prefix already, so only the tail of the prefill's five blocks moves.
        await push(pe, d1, prefill, f"od-{tag}", [[1, 2, 3, 4, 5]], [[20, 21]], on_demand=True)
        seen = _peers(decode1)["prefill"]
        assert seen["up"] and seen["on_demand"] and seen["direction"] == "dialed"
        assert seen["address"] == prefill.address
        # decode2 and the prefill list each other.
        await push(pe, d2, prefill, f"st-{tag}", [[6, 7, 8]], [[30, 31, 32]], on_demand=False)
        assert not _peers(decode2)["prefill"]["on_demand"]
        assert not _peers(prefill)["decode2"]["on_demand"]
    for daemon in (prefill, decode1, decode2):
        assert daemon.status()["live"] == 0


def test_every_write_between_hosts_went_over_tcp_and_never_shared_memory(
    cluster: Cluster, tmp_path: Path
) -> None:
    """UCX's own protocol tables: the WRITEs to other hosts ran inter-node, on tcp/eth0 only.

    The control: two daemons on this machine's loopback with UCX's default
    transports print an intra-node write over shared memory, which the same
    check tells apart; so the check can fail.
    """
    asyncio.run(_one_push_between_hosts(cluster))
    writes = remote_writes(cluster["prefill"].logs().splitlines())
    assert writes, "UCX printed no remote-write protocol (UCX_PROTO_INFO)"
    for write in writes:
        assert write.scope == "inter-node", write
        assert write.transports == {"tcp/eth0"}, write

    prefill, decode = start_pair(tmp_path, prepare=lambda d: d.env.update({"UCX_PROTO_INFO": "y"}))
    try:
        asyncio.run(_one_push_on_loopback(prefill, decode))
    finally:
        stop_cleanly(prefill, decode)
    local = remote_writes(prefill.logs().splitlines())
    assert local and all(w.scope == "intra-node" for w in local), local
    assert all(not t.startswith("tcp/") for w in local for t in w.transports), local


async def _one_push_between_hosts(cluster: Cluster) -> None:
    tag = _uid()
    async with (
        await SimEngine.create(f"p-{tag}", Role.PUSHER, SMALL, cluster["prefill"].socket) as pe,
        await SimEngine.create(f"d-{tag}", Role.RECEIVER, SMALL, cluster["decode1"].socket) as de,
    ):
        await push(pe, de, cluster["prefill"], f"tcp-{tag}", [[1, 2]], [[3, 4]], on_demand=True)


async def _one_push_on_loopback(prefill: Daemon, decode: Daemon) -> None:
    tag = _uid()
    async with (
        await SimEngine.create(f"p-{tag}", Role.PUSHER, SMALL, prefill.socket) as pe,
        await SimEngine.create(f"d-{tag}", Role.RECEIVER, SMALL, decode.socket) as de,
    ):
        await push(pe, de, prefill, f"lo-{tag}", [[1, 2]], [[3, 4]], on_demand=False)


async def test_one_prefill_host_spreads_requests_over_two_decode_hosts(
    cluster: Cluster,
) -> None:
    prefill = cluster["prefill"]
    tag = _uid()
    async with (
        await SimEngine.create(f"p-{tag}", Role.PUSHER, SMALL, prefill.socket) as pe,
        await SimEngine.create(f"d1-{tag}", Role.RECEIVER, SMALL, cluster["decode1"].socket) as d1,
        await SimEngine.create(f"d2-{tag}", Role.RECEIVER, SMALL, cluster["decode2"].socket) as d2,
    ):
        pushes = [
            push(
                pe,
                d1 if i % 2 else d2,
                prefill,
                f"spread{i}-{tag}",
                [[2 * i + 1, 2 * i + 2]],
                [[2 * i + 1, 2 * i + 2]],
                on_demand=bool(i % 2),
            )
            for i in range(16)
        ]
        await asyncio.gather(*pushes)
    written = prefill.status()["counters"]
    assert written["writes_done"] >= 16


# ------------------------------------------------------------------ faults


async def _until(predicate, timeout: float, what: str) -> float:
    """Poll ``predicate`` until true; the seconds it took."""
    began = time.monotonic()
    while not predicate():
        assert time.monotonic() - began < timeout, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)
    return time.monotonic() - began


def _writing(daemon: Daemon) -> bool:
    return daemon.status()["writes_in_flight"] > 0


async def _push_once_linked(
    pe: SimEngine, de: SimEngine, prefill: Daemon, rid: str, timeout: float = 30.0
) -> float:
    """A push by address, retried while the dial is refused (a healed link's first seconds).

    Right after a link comes back, the kernel may still hold the failed
    neighbour entry of the partition: the dial is refused ``peer_unreachable``
    (cleanly, nothing registered) until it is resolved again. The seconds
    until a push went through.
    """
    began = time.monotonic()
    while True:
        try:
            await push(pe, de, prefill, rid, [[1, 2]], [[1, 2]], on_demand=True)
            return time.monotonic() - began
        except RpcError as refused:
            assert refused.code == "peer_unreachable", refused
            assert time.monotonic() - began < timeout, "the peers never linked again"
            await asyncio.sleep(0.2)


async def test_a_partition_mid_write_fails_both_sides_and_the_other_host_keeps_working(
    cluster: Cluster,
) -> None:
    hosts, prefill, decode1 = cluster.hosts, cluster["prefill"], cluster["decode1"]
    tag = _uid()
    rid = f"cut-{tag}"
    async with (
        await SimEngine.create(f"p-{tag}", Role.PUSHER, BIG, prefill.socket) as pe,
        await SimEngine.create(f"d1-{tag}", Role.RECEIVER, BIG, decode1.socket) as d1,
        await SimEngine.create(f"ps-{tag}", Role.PUSHER, SMALL, prefill.socket) as ps,
        await SimEngine.create(f"d2-{tag}", Role.RECEIVER, SMALL, cluster["decode2"].socket) as d2,
    ):
        blocks = [list(range(1, 95))]
        told: list[rpc.Event] = []
        d1.on_event = told.append
        await d1.decode_register(rid, blocks, "prefill", peer_address=prefill.address)
        await pe.prefill(rid, blocks)
        await _until(lambda: _writing(prefill), 10, "the write to start")
        hosts.cut("decode1")
        cut_at = time.monotonic()
        try:
            # The decode engine lets go at once; its blocks stay the daemon's
            # (quarantined) while the prefill's write may still reach them.
            assert isinstance(await d1.client.release(rid), rpc.Deferred)
            # The other decode host is served throughout.
            for i in range(3):
                await push(
                    ps, d2, prefill, f"other{i}-{tag}", [[i + 1]], [[i + 1]], on_demand=False
                )
            await d1.wait_event(rid, rpc.Released, timeout=30)
            released_s = time.monotonic() - cut_at
            pushed = await pe.wait_event(rid, (rpc.BlocksFreeable, rpc.RequestFailed), timeout=30)
            assert isinstance(pushed, rpc.RequestFailed), pushed
            failed_s = time.monotonic() - cut_at
        finally:
            hosts.mend("decode1")
        # The fence, not a guess: the blocks came back only once the TTL had run.
        assert released_s >= TEST_TIMING.peer_ttl_s * 0.8, released_s
        assert _ended(prefill, rid) == [f"failed:{pushed.reason}"]
        # The decode engine's release ended it (aborted); its blocks were
        # handed back by the fence of the prefill, which the decode logged.
        assert _ended(decode1, rid) == ["failed:aborted"]
        assert [f for f in _log_lines(decode1, "peer fenced") if f["peer"] == "prefill"]
        # Never told kv_arrived over the partial bytes.
        assert not [e for e in told if isinstance(e, rpc.KvArrived) and e.request_id == rid]
        assert prefill.status()["writes_in_flight"] == 0
        recovered_s = await _push_once_linked(pe, d1, prefill, f"after-{tag}")
        await pe.release(rid)
    print(
        f"\npartition mid-write: the decode's blocks released by the fence in {released_s:.2f} s, "
        f"prefill {pushed.reason} in {failed_s:.2f} s; pushing again {recovered_s:.2f} s "
        "after the link came back"
    )


async def test_a_partition_that_heals_inside_the_ttl_delays_the_write_and_it_lands_whole(
    cluster: Cluster,
) -> None:
    """A link down for a third of ``peer_ttl_s`` mid-write: nobody is declared dead.

    TCP keeps the unacknowledged bytes and sends them again once the link is
    back; the write completes, late, and is checked byte for byte; each side
    ends the request exactly once, both "done". No request is lost or ends
    twice.
    """
    hosts, prefill, decode1 = cluster.hosts, cluster["prefill"], cluster["decode1"]
    tag = _uid()
    rid = f"heal-{tag}"
    async with (
        await SimEngine.create(f"p-{tag}", Role.PUSHER, BIG, prefill.socket) as pe,
        await SimEngine.create(f"d1-{tag}", Role.RECEIVER, BIG, decode1.socket) as d1,
    ):
        blocks = [list(range(1, 95))]
        pairs = tail_pairs(pe.layout, blocks, d1.layout, blocks)
        expect = Expectation(pe.engine_id, pairs)
        await d1.decode_register(
            rid, blocks, "prefill", expect=expect, peer_address=prefill.address
        )
        await pe.prefill(rid, blocks)
        await _until(lambda: _writing(prefill), 10, "the write to start")
        downs = (_downs(prefill, "decode1"), _downs(decode1, "prefill"))
        hosts.cut("decode1")
        await asyncio.sleep(TEST_TIMING.peer_ttl_s / 3)
        hosts.mend("decode1")
        arrived = await d1.wait_event(rid, (rpc.KvArrived, rpc.RequestFailed), timeout=30)
        freed = await pe.wait_event(rid, (rpc.BlocksFreeable, rpc.RequestFailed), timeout=30)
        assert isinstance(arrived, rpc.KvArrived), arrived
        assert isinstance(freed, rpc.BlocksFreeable), freed
        report = d1.reports[(rid, 1)]
        assert report.ok and report.blocks_checked == len(blocks[0]), report.problems()
        await d1.release(rid)
        await pe.release(rid)
    assert _ended(prefill, rid) == ["done"]
    assert _ended(decode1, rid) == ["done"]
    # Neither side declared the other dead: the link outlived the cut.
    assert _peers(decode1)["prefill"]["up"] and _peers(prefill)["decode1"]["up"]
    assert _downs(prefill, "decode1") == downs[0] and _downs(decode1, "prefill") == downs[1]


def _downs(daemon: Daemon, peer: str) -> int:
    """How often ``daemon`` has declared ``peer`` down so far."""
    return sum(1 for line in _log_lines(daemon, "peer_down") if line["peer"] == peer)


async def test_loss_in_one_direction_ends_in_both_sides_fencing_and_then_serving_again(
    cluster: Cluster,
) -> None:
    """Everything sent to decode1 is lost; what decode1 sends still arrives.

    decode1 hears no heartbeat and declares the prefill dead after
    ``peer_ttl_s``; the prefill hears decode1 only until decode1's TCP stops
    sending for want of acknowledgements, then declares it dead too. The
    request in the middle ends failed on both sides, never kv_arrived; once
    the loss ends the two link again and serve.
    """
    hosts, prefill, decode1 = cluster.hosts, cluster["prefill"], cluster["decode1"]
    tag = _uid()
    rid = f"oneway-{tag}"
    async with (
        await SimEngine.create(f"p-{tag}", Role.PUSHER, SMALL, prefill.socket) as pe,
        await SimEngine.create(f"d1-{tag}", Role.RECEIVER, SMALL, decode1.socket) as d1,
    ):
        await _push_once_linked(pe, d1, prefill, f"warm-{tag}")  # linked before the loss
        downs = (_downs(prefill, "decode1"), _downs(decode1, "prefill"))
        told: list[rpc.Event] = []
        d1.on_event = told.append
        await d1.decode_register(rid, [[5, 6]], "prefill", peer_address=prefill.address)
        hosts.drop_inbound("decode1")
        lost_at = time.monotonic()
        try:
            await pe.prefill(rid, [[5, 6]])
            pushed = await pe.wait_event(rid, (rpc.BlocksFreeable, rpc.RequestFailed), timeout=30)
            fenced: dict[str, float] = {}
            while len(fenced) < 2:
                for side, peer, before in ((decode1, "prefill", 1), (prefill, "decode1", 0)):
                    if side.node not in fenced and _downs(side, peer) > downs[before]:
                        fenced[side.node] = time.monotonic() - lost_at
                assert time.monotonic() - lost_at < 30, f"only {fenced} fenced"
                await asyncio.sleep(0.01)
            decode_s, prefill_s = fenced["decode1"], fenced["prefill"]
            ended = await d1.wait_event(rid, (rpc.KvArrived, rpc.RequestFailed), timeout=30)
        finally:
            hosts.mend("decode1")
        assert isinstance(pushed, rpc.RequestFailed), pushed
        assert isinstance(ended, rpc.RequestFailed) and ended.reason == "peer_dead", ended
        assert not [e for e in told if isinstance(e, rpc.KvArrived)]
        assert len(_ended(prefill, rid)) == 1 and _ended(decode1, rid) == ["failed:peer_dead"]
        await d1.release(rid)
        await pe.release(rid)
        recovered_s = await _push_once_linked(pe, d1, prefill, f"again-{tag}")
    print(
        f"\none-way loss: decode1 fenced the prefill after {decode_s:.2f} s, the prefill "
        f"fenced decode1 after {prefill_s:.2f} s ({pushed.reason}); serving again "
        f"{recovered_s:.2f} s after the loss ended"
    )


async def test_a_lost_host_is_fenced_its_requests_fail_and_the_others_are_served(
    cluster: Cluster,
) -> None:
    """Every process of host ``gone`` killed and its namespace deleted, mid-request."""
    hosts, prefill, gone = cluster.hosts, cluster["prefill"], cluster["gone"]
    tag = _uid()
    async with (
        await SimEngine.create(f"p-{tag}", Role.PUSHER, BIG, prefill.socket) as pe,
        await SimEngine.create(f"ps-{tag}", Role.PUSHER, SMALL, prefill.socket) as ps,
        await SimEngine.create(f"d2-{tag}", Role.RECEIVER, SMALL, cluster["decode2"].socket) as d2,
    ):
        dg = await SimEngine.create(f"g-{tag}", Role.RECEIVER, BIG, gone.socket)
        blocks = [list(range(1, 95))]
        writing, waiting = f"lostw-{tag}", f"lostr-{tag}"
        for rid, ids in ((writing, blocks), (waiting, [[95]])):
            await dg.decode_register(rid, ids, "prefill", peer_address=prefill.address)
        await pe.prefill(writing, blocks)  # a write under way...
        await pe.prefill(waiting, [[95]], kv_ready=False)  # ...and one not yet ready
        await _until(lambda: _writing(prefill), 10, "the write to start")
        hosts.lose("gone")
        lost_at = time.monotonic()
        with contextlib.suppress(Exception):
            await dg.close()
        served = 0
        while not _downs(prefill, "gone"):
            await push(ps, d2, prefill, f"meanwhile{served}-{tag}", [[1]], [[1]], on_demand=False)
            served += 1
            assert time.monotonic() - lost_at < 30, "the lost host was never fenced"
        fenced_s = time.monotonic() - lost_at
        for rid in (writing, waiting):
            failed = await pe.wait_event(rid, (rpc.BlocksFreeable, rpc.RequestFailed), timeout=30)
            assert isinstance(failed, rpc.RequestFailed), failed
            assert len(_ended(prefill, rid)) == 1
            await pe.release(rid)
        await push(ps, d2, prefill, f"after-{tag}", [[2]], [[2]], on_demand=False)
    assert prefill.status()["live"] == 0
    fenced = [f for f in _log_lines(prefill, "peer fenced") if f["peer"] == "gone"]
    assert fenced, "no fence of the lost host in the prefill's log"
    print(
        f"\nhost lost: the prefill fenced it after {fenced_s:.2f} s and failed both its requests "
        f"({[_ended(prefill, r)[0] for r in (writing, waiting)]}); {served} pushes to decode2 "
        "meanwhile"
    )
