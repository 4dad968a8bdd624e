"""The node's KV offload tier against real daemons (README.md, "Offload tier").

Real ``kvpushd run`` processes (daemon/sim/launcher.py), the real Unix
socket, the blocking client and :func:`daemon.client.pool.attach_pool`: the
pool's descriptor crosses the socket, each holder maps the daemon's bytes,
and every claim below is read back through a mapping, the status document,
the metrics or the journal.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Final

import pytest

from daemon.client import BlockingEngineClient, RpcError
from daemon.client.pool import AttachedPool, attach_pool
from daemon.journal.replay import replay
from daemon.sim.launcher import Daemon, free_port
from schemas import rpc
from schemas.events import (
    MAX_BATCH,
    MAX_KEY_BYTES,
    SlotsCondemned,
    SlotsDiscarded,
    SlotsEvicted,
    SlotsReset,
    SlotsStored,
)
from tests.support import REPO

SLOT_BYTES: Final = 8192
NS: Final = "ns-test"


def offload_config(slots: int, *, path: str = "", reserve: int = 0, metrics: int = 0) -> str:
    lines = [f"metrics_port = {metrics}"] if metrics else []
    lines += ["[offload]", f"slots = {slots}", f"slot_bytes = {SLOT_BYTES}"]
    lines += [f'path = "{path}"'] if path else []
    lines += [f"reserve = {reserve}"] if reserve else []
    return "\n".join(lines)


def start(tmp: Path, name: str, config: str, env: dict[str, str] | None = None) -> Daemon:
    daemon = Daemon(name, tmp, free_port(), extra=config, env=env or {})
    daemon.start()
    return daemon


def wait_for(what: str, check: Callable[[], Any], timeout: float = 15.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := check():
            return value
        time.sleep(0.02)
    raise AssertionError(f"not within {timeout} s: {what}")


def tier(daemon: Daemon) -> dict[str, Any]:
    document: dict[str, Any] = daemon.status()["offload"]
    return document


def states(daemon: Daemon) -> dict[str, int]:
    by_state: dict[str, int] = tier(daemon)["by_state"]
    return by_state


def settled(daemon: Daemon) -> bool:
    """No slot waits for its reset."""
    return states(daemon)["evicted"] == 0


def slot_events(daemon: Daemon) -> list[Any]:
    found: list[Any] = []
    replay(daemon.journal, on_record=lambda record, touched: found.append(record.event))
    return [e for e in found if type(e).__name__.startswith(("Slots", "PoolOpened"))]


def journaled(daemon: Daemon, kind: type, slots: Any) -> list[Any] | None:
    """The slot events, once ``kind`` records naming every one of ``slots`` are in the journal
    (a record is applied, so in the status, a moment before it is written)."""
    events = slot_events(daemon)
    named = {s for e in events if isinstance(e, kind) for s in e.slots}
    return events if set(slots) <= named else None


def fill(pool: AttachedPool, slot: int, seed: bytes) -> bytes:
    """Write a pattern made from ``seed`` into ``slot``; its digest."""
    data = hashlib.shake_256(seed).digest(SLOT_BYTES)
    pool.view(slot)[:] = data
    return hashlib.sha256(data).digest()


def store_new(
    client: BlockingEngineClient, pool: AttachedPool, holder: str, keys: list[bytes]
) -> tuple[rpc.OffloadGranted, list[bytes]]:
    """Grant one slot per key (waiting for resets if short), fill, store; the grant, digests."""
    granted = wait_for("a grant", lambda: _granted(client, holder, len(keys)))
    digests = [fill(pool, s, k) for s, k in zip(granted.slots, keys, strict=True)]
    flags = client.offload_store(holder, NS, granted.slots, granted.generations, keys, digests)
    assert flags == (True,) * len(keys)
    return granted, digests


def _granted(client: BlockingEngineClient, holder: str, n: int) -> rpc.OffloadGranted | None:
    granted = client.offload_grant(holder, n)
    if len(granted.slots) == n:
        return granted
    if granted.slots:
        pytest.fail(f"asked {n} slots, granted {granted.slots}: the tests ask whole grants")
    time.sleep(0.05)
    return None


def key(tag: str) -> bytes:
    return hashlib.sha256(tag.encode()).digest()


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    metrics = free_port()
    daemon = start(tmp_path_factory.mktemp("offload"), "tier", offload_config(64, metrics=metrics))
    daemon.metrics_port = metrics  # type: ignore[attr-defined]
    yield daemon
    assert daemon.stop() == 0, daemon.logs()


@pytest.fixture
def client(shared: Daemon) -> Iterator[BlockingEngineClient]:
    with BlockingEngineClient.connect(shared.socket) as made:
        yield made


# ------------------------------------------------------- the pool and a round trip


def test_attach_maps_the_bytes_the_daemon_zeroes(shared: Daemon) -> None:
    holder = f"zero-{uuid.uuid4().hex[:6]}"
    with attach_pool(shared.socket, holder) as pool, attach_pool(shared.socket, "watcher") as other:
        assert (pool.slots, pool.slot_bytes, pool.pool_id) == (
            64,
            SLOT_BYTES,
            tier(shared)["pool_id"],
        )
        assert pool.header_bytes == 4096
        with BlockingEngineClient.connect(shared.socket) as writer:
            granted = writer.offload_grant(holder, 2)
            assert len(granted.slots) == 2
            for slot in granted.slots:
                assert not any(pool.view(slot)), "granted dirty"
                pool.view(slot)[:] = b"\xab" * SLOT_BYTES
                # One memory: the other mapping sees the write at once.
                assert bytes(other.view(slot)) == b"\xab" * SLOT_BYTES
        # The writer's connection closed before it stored: its grant is
        # abandoned, and the daemon zeroes the slots in the memory we map.
        for slot in granted.slots:
            wait_for(f"slot {slot} zeroed", lambda s=slot: not any(pool.view(s)))
        wait_for("the abandoned grant reset", lambda: settled(shared))
    events = wait_for("the resets journaled", lambda: journaled(shared, SlotsReset, granted.slots))
    abandoned = [e for e in events if isinstance(e, SlotsDiscarded) and e.why == "abandoned"]
    assert any(set(granted.slots) <= set(e.slots) for e in abandoned)


def test_stored_keys_are_leased_to_another_holder_with_the_same_bytes(
    shared: Daemon, client: BlockingEngineClient
) -> None:
    writer, reader = f"w-{uuid.uuid4().hex[:6]}", f"r-{uuid.uuid4().hex[:6]}"
    keys = [key(f"rt-{uuid.uuid4().hex}-{i}") for i in range(3)]
    with attach_pool(shared.socket, writer) as wpool, attach_pool(shared.socket, reader) as rpool:
        before = tier(shared)
        granted, digests = store_new(client, wpool, writer, keys)
        written = [bytes(wpool.view(s)) for s in granted.slots]
        with BlockingEngineClient.connect(shared.socket) as second:
            leased = second.offload_lease(reader, NS, [keys[0], key("never stored"), *keys[1:]])
            assert leased.slots == (granted.slots[0], -1, *granted.slots[1:])
            assert leased.generations[1] == 0 and leased.digests[1] == b""
            assert leased.digests[:1] + leased.digests[2:] == tuple(digests)
            pairs = [
                (s, g) for s, g in zip(leased.slots, leased.generations, strict=True) if s >= 0
            ]
            hits = [s for s, _ in pairs]
            # The reader's own mapping holds the writer's bytes, and they match the digest.
            for slot, data, digest in zip(hits, written, digests, strict=True):
                assert bytes(rpool.view(slot)) == data
                assert hashlib.sha256(rpool.view(slot)).digest() == digest
            assert states(shared)["leased"] >= 3
            second.offload_unlease(reader, hits, [g for _, g in pairs])
        after = tier(shared)
    assert after["hits"] - before["hits"] == 3
    assert after["misses"] - before["misses"] == 1
    assert after["committed"] - before["committed"] == 3
    scraped = _scrape(shared)
    assert scraped[("kvpushd_offload_lookups_total", (("result", "hit"),))] >= 3
    assert scraped[("kvpushd_offload_lookups_total", (("result", "miss"),))] >= 1
    assert scraped[("kvpushd_offload_stores_total", (("result", "committed"),))] >= 3
    assert ("kvpushd_offload_slots", (("state", "committed"),)) in scraped
    text = subprocess.run(
        [sys.executable, "-m", "daemon.cli", "status", "--socket", shared.socket],
        capture_output=True, text=True, check=True, cwd=REPO,
    ).stdout  # fmt: skip
    assert "offload  64 slots of 8192 bytes in memfd" in text
    assert "hit rate" in text


def _scrape(daemon: Daemon) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    url = f"http://127.0.0.1:{daemon.metrics_port}/metrics"  # type: ignore[attr-defined]
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_an_attach_binds_its_holder_to_a_namespace_the_holders_other_calls_act_in(
    shared: Daemon, client: BlockingEngineClient
) -> None:
    """A worker binds; the scheduler of that engine names only the holder ("")."""
    holder = f"bound-{uuid.uuid4().hex[:6]}"
    unbound = f"unbound-{uuid.uuid4().hex[:6]}"
    keys = [key(f"bind-{uuid.uuid4().hex}-{i}") for i in range(2)]
    # A holder nobody bound cannot name the empty namespace.
    with pytest.raises(RpcError) as refused:
        client.offload_lease(unbound, "", keys)
    assert refused.value.code == "bad_offload"
    with attach_pool(shared.socket, holder, namespace="ns-bound") as pool:
        granted = wait_for("a grant", lambda: _granted(client, holder, 2))
        digests = [fill(pool, s, k) for s, k in zip(granted.slots, keys, strict=True)]
        # Stored in the bound namespace without naming it...
        assert client.offload_store(holder, "", granted.slots, granted.generations, keys, digests)
        # ...so another holder finds the keys there, and in no other.
        assert -1 not in client.offload_lease("reader-b", "ns-bound", keys).slots
        assert client.offload_lease("reader-c", NS, keys).slots == (-1, -1)
        # The bound holder may not act in another namespace, nor be bound
        # elsewhere while a connection of it lives.
        with pytest.raises(RpcError) as other:
            client.offload_lease(holder, NS, keys)
        assert other.value.code == "bad_offload"
        with pytest.raises(RpcError) as rebind:
            attach_pool(shared.socket, holder, namespace="ns-elsewhere").close()
        assert rebind.value.code == "bad_offload"
        leased = client.offload_lease(holder, "", keys)
        assert leased.slots == granted.slots
        client.offload_unlease(holder, leased.slots, leased.generations)


def test_a_duplicate_key_keeps_the_first_and_the_loser_is_reset(
    shared: Daemon, client: BlockingEngineClient
) -> None:
    first, second = f"a-{uuid.uuid4().hex[:6]}", f"b-{uuid.uuid4().hex[:6]}"
    same = key(f"dup-{uuid.uuid4().hex}")
    with attach_pool(shared.socket, first) as pool:
        won, won_digest = store_new(client, pool, first, [same])
        lost = client.offload_grant(second, 1)
        loser = lost.slots[0]
        digest = fill(pool, loser, b"another computation of the same key")
        flags = client.offload_store(second, NS, lost.slots, lost.generations, [same], [digest])
        assert flags == (False,)
        leased = client.offload_lease("dup-reader", NS, [same])
        assert leased.slots == won.slots and leased.digests == tuple(won_digest)
        client.offload_unlease("dup-reader", leased.slots, leased.generations)
        # The loser is reset: zero, free, one generation on.
        wait_for("the loser reset", lambda: not any(pool.view(loser)) and settled(shared))
    events = slot_events(shared)
    assert any(
        isinstance(e, SlotsDiscarded) and e.why == "duplicate_key" and loser in e.slots
        for e in events
    )
    assert tier(shared)["duplicates"] >= 1


# ------------------------------------------------------------- a condemned slot


def test_a_condemned_slot_misses_at_once_and_is_evicted_and_reset_once_unleased(
    shared: Daemon, client: BlockingEngineClient
) -> None:
    """A reader whose loaded bytes differ from the digest condemns the slot: the next
    lookup misses (no recompute loop), and the slot goes once the reader's lease does."""
    writer, reader = f"cw-{uuid.uuid4().hex[:6]}", f"cr-{uuid.uuid4().hex[:6]}"
    bad = key(f"condemn-{uuid.uuid4().hex}")
    with attach_pool(shared.socket, writer) as pool:
        before = tier(shared)
        stored, digests = store_new(client, pool, writer, [bad])
        (slot,), (generation,) = stored.slots, stored.generations
        leased = client.offload_lease(reader, NS, [bad])
        assert (leased.slots, leased.digests) == (stored.slots, tuple(digests))
        pool.view(slot)[:8] = b"\xff" * 8  # a write after the commit: the digest differs
        assert hashlib.sha256(pool.view(slot)).digest() != leased.digests[0]
        client.offload_condemn(reader, leased.slots, leased.generations)
        # Never handed out again, to the reporter or anyone, while its lease holds it.
        assert client.offload_lease(reader, NS, [bad]).slots == (-1,)
        assert client.offload_lease(f"other-{reader}", NS, [bad]).slots == (-1,)
        assert tier(shared)["condemned"] - before["condemned"] == 1
        assert states(shared)["leased"] >= 1
        # Said again: no refusal, nothing more counted.
        client.offload_condemn(reader, leased.slots, leased.generations)
        assert tier(shared)["condemned"] - before["condemned"] == 1
        # The lease given back: evicted (condemned), zeroed, reset a generation on.
        client.offload_unlease(reader, leased.slots, leased.generations)
        wait_for("the condemned slot zeroed", lambda: not any(pool.view(slot)))
        events = wait_for("its reset journaled", lambda: journaled(shared, SlotsReset, [slot]))
        history = [
            (type(e).__name__, getattr(e, "holder", ""), getattr(e, "why", ""))
            for e in events
            if isinstance(e, SlotsCondemned | SlotsEvicted | SlotsReset)
            and (slot, generation) in zip(e.slots, e.generations, strict=True)
        ]
        assert history == [
            ("SlotsCondemned", reader, "bad_digest"),
            ("SlotsEvicted", "", "condemned"),
            ("SlotsReset", "", ""),
        ]
        # The key is stored again (in whichever slot) and hits with its new bytes.
        again, again_digests = store_new(client, pool, writer, [bad])
        found = client.offload_lease(reader, NS, [bad])
        assert found.slots == again.slots and found.digests == tuple(again_digests)
        assert hashlib.sha256(pool.view(found.slots[0])).digest() == found.digests[0]
        client.offload_unlease(reader, found.slots, found.generations)
    warned = [
        line
        for line in shared.logs().splitlines()
        if "offload slot condemned" in line and f'"holder": "{reader}"' in line
    ]
    assert len(warned) == 1, warned  # said twice, condemned (and logged) once
    assert f'"slot": {slot}' in warned[0] and f'"generation": {generation}' in warned[0]
    scraped = _scrape(shared)
    assert scraped[("kvpushd_offload_condemned_total", ())] >= 1


def test_a_new_store_of_a_condemned_key_hits_while_the_old_slot_is_still_leased(
    shared: Daemon, client: BlockingEngineClient
) -> None:
    """The engine recomputes and stores the key again while it still holds the bad slot's
    lease: the new copy commits (no duplicate) and is what every lookup finds."""
    holder = f"re-{uuid.uuid4().hex[:6]}"
    same = key(f"restore-{uuid.uuid4().hex}")
    with attach_pool(shared.socket, holder) as pool:
        old, _ = store_new(client, pool, holder, [same])
        leased = client.offload_lease(holder, NS, [same])
        client.offload_condemn(holder, leased.slots, leased.generations)
        new, new_digests = store_new(client, pool, holder, [same])  # committed, not a duplicate
        assert new.slots != old.slots
        found = client.offload_lease("re-reader", NS, [same])
        assert found.slots == new.slots and found.digests == tuple(new_digests)
        client.offload_unlease("re-reader", found.slots, found.generations)
        # The old slot's eviction leaves the new entry in the index.
        client.offload_unlease(holder, leased.slots, leased.generations)
        wait_for("the old slot reset", lambda: journaled(shared, SlotsReset, old.slots))
        found = client.offload_lease("re-reader", NS, [same])
        assert found.slots == new.slots
        client.offload_unlease("re-reader", found.slots, found.generations)


def test_a_condemned_slot_nobody_leases_is_evicted_and_reset_right_away(
    shared: Daemon, client: BlockingEngineClient
) -> None:
    """A reader that gave its lease back before it checked still condemns: nothing holds
    the slot, so the condemn itself evicts it."""
    holder = f"late-{uuid.uuid4().hex[:6]}"
    bad = key(f"late-{uuid.uuid4().hex}")
    with attach_pool(shared.socket, holder) as pool:
        stored, _ = store_new(client, pool, holder, [bad])
        leased = client.offload_lease(holder, NS, [bad])
        client.offload_unlease(holder, leased.slots, leased.generations)
        client.offload_condemn(holder, leased.slots, leased.generations)
        assert client.offload_lease(holder, NS, [bad]).slots == (-1,)
        (slot,), (generation,) = stored.slots, stored.generations
        events = wait_for("its reset journaled", lambda: journaled(shared, SlotsReset, [slot]))
        evicted = [
            e.why
            for e in events
            if isinstance(e, SlotsEvicted)
            and (slot, generation) in zip(e.slots, e.generations, strict=True)
        ]
        assert evicted == ["condemned"]


def test_a_condemned_slot_whose_lease_a_restart_dropped_is_evicted_at_the_start(
    tmp_path: Path,
) -> None:
    path = f"/dev/shm/kvpushd-test-pool-{uuid.uuid4().hex[:8]}"
    daemon = start(tmp_path, "condemn-restart", offload_config(8, path=path))
    try:
        with (
            BlockingEngineClient.connect(daemon.socket) as client,
            attach_pool(daemon.socket, "w") as pool,
        ):
            keys = [key("cr-bad"), key("cr-good")]
            stored, digests = store_new(client, pool, "w", keys)
            leased = client.offload_lease("r", NS, keys[:1])
            client.offload_condemn("r", leased.slots, leased.generations)
        daemon.kill()  # the reader's lease dies with the daemon, never given back
        daemon.start()
        assert tier(daemon)["survived"]
        wait_for("the condemned slot reset", lambda: settled(daemon))
        events = slot_events(daemon)
        opened = max(i for i, e in enumerate(events) if type(e).__name__ == "PoolOpened")
        after = [(type(e).__name__, getattr(e, "why", "")) for e in events[opened + 1 :]]
        assert after[:2] == [("SlotsEvicted", "condemned"), ("SlotsReset", "")]
        assert events[opened + 1].slots == (stored.slots[0],)
        with BlockingEngineClient.connect(daemon.socket) as client:
            found = client.offload_lease("after", NS, keys)
            assert found.slots == (-1, stored.slots[1]) and found.digests[1] == digests[1]
    finally:
        daemon.kill()
        os.unlink(path)


def test_hostile_condemn_calls_get_their_reason_and_change_nothing(
    shared: Daemon, client: BlockingEngineClient
) -> None:
    holder = f"hc-{uuid.uuid4().hex[:6]}"
    kept = key(f"hc-kept-{uuid.uuid4().hex}")
    with attach_pool(shared.socket, holder) as pool:
        stored, digests = store_new(client, pool, holder, [kept])
        slot, gen = stored.slots[0], stored.generations[0]
        open_grant = client.offload_grant(holder, 1)
        before = tier(shared)
        cases: list[tuple[str, Callable[[], Any]]] = [
            ("bad_offload", lambda: client.offload_condemn(holder, [10_000], [0])),
            ("bad_offload", lambda: client.offload_condemn(holder, [slot], [gen, gen])),
            ("bad_offload", lambda: client.offload_condemn(holder, [], [])),
            ("slot_stale", lambda: client.offload_condemn(holder, [slot], [gen + 1])),
            (
                "slot_not_committed",
                lambda: client.offload_condemn(holder, open_grant.slots, open_grant.generations),
            ),
            ("bad_request", lambda: client.offload_condemn("", [slot], [gen])),
            (
                "bad_request",
                lambda: client.offload_condemn(
                    holder, [slot] * (MAX_BATCH + 1), [gen] * (MAX_BATCH + 1)
                ),
            ),
        ]
        for code, call in cases:
            with pytest.raises(RpcError) as refused:
                call()
            assert refused.value.code == code, (code, refused.value)
        after = tier(shared)
        assert after["by_state"] == before["by_state"]
        assert after["condemned"] == before["condemned"]
        # Nothing moved: the key still hits with its digest.
        leased = client.offload_lease(holder, NS, [kept])
        assert leased.slots == stored.slots and leased.digests == tuple(digests)
        client.offload_unlease(holder, leased.slots, leased.generations)
    events = slot_events(shared)
    assert not any(isinstance(e, SlotsCondemned) and e.holder == holder for e in events)


# ------------------------------------------------------------------ hostile input


def test_hostile_calls_get_their_reason_and_change_nothing(
    shared: Daemon, client: BlockingEngineClient
) -> None:
    owner, other = f"own-{uuid.uuid4().hex[:6]}", f"oth-{uuid.uuid4().hex[:6]}"
    kept = key(f"kept-{uuid.uuid4().hex}")
    with attach_pool(shared.socket, owner) as pool:
        stored, digests = store_new(client, pool, owner, [kept])
        open_grant = client.offload_grant(owner, 1)
        slot, gen = open_grant.slots[0], open_grant.generations[0]
        before = tier(shared)
        committed_slot = stored.slots[0]
        long_key = b"k" * (MAX_KEY_BYTES + 1)
        committed_gen = stored.generations[0]

        def store(holder: str, slots: list[int], gens: list[int], keys: list[bytes]) -> Any:
            return client.offload_store(holder, NS, slots, gens, keys, [b"d"])

        cases: list[tuple[str, Callable[[], Any]]] = [
            # A slot outside the pool.
            ("bad_offload", lambda: store(owner, [10_000], [0], [b"x"])),
            # A generation the slot no longer has.
            ("slot_stale", lambda: store(owner, [slot], [gen + 1], [b"x"])),
            # Another holder's grant.
            ("slot_not_granted", lambda: store(other, [slot], [gen], [b"x"])),
            # A committed slot written again.
            ("slot_committed", lambda: store(owner, [committed_slot], [committed_gen], [b"x"])),
            # Lists that are not parallel.
            ("bad_offload", lambda: store(owner, [slot], [gen], [b"x", b"y"])),
            # A key over the bound, and a batch over the bound: refused as they are decoded.
            ("bad_request", lambda: store(owner, [slot], [gen], [long_key])),
            ("bad_request", lambda: client.offload_lease(owner, NS, [b"k"] * (MAX_BATCH + 1))),
            ("bad_request", lambda: client.offload_grant(owner, MAX_BATCH + 1)),
            ("bad_request", lambda: client.offload_grant("", 1)),
            # Giving back a lease nobody holds, and one at a generation it no longer has.
            (
                "slot_not_leased",
                lambda: client.offload_unlease(other, [committed_slot], [committed_gen]),
            ),
            (
                "slot_stale",
                lambda: client.offload_unlease(other, [committed_slot], [committed_gen + 7]),
            ),
        ]
        for code, call in cases:
            with pytest.raises(RpcError) as refused:
                call()
            assert refused.value.code == code, (code, refused.value)
        after = tier(shared)
        assert after["by_state"] == before["by_state"]
        assert (after["committed"], after["hits"]) == (before["committed"], before["hits"])
        # Nothing moved: the open grant is still the owner's to store, the
        # committed key still hits with its digest, and the daemon serves on.
        digest = fill(pool, slot, b"late but legal")
        assert client.offload_store(
            owner, NS, [slot], [gen], [key(uuid.uuid4().hex)], [digest]
        ) == (True,)
        leased = client.offload_lease(owner, NS, [kept])
        assert leased.slots == stored.slots and leased.digests == tuple(digests)
        client.offload_unlease(owner, leased.slots, leased.generations)
    assert shared.exited() is None


def test_a_daemon_without_a_tier_refuses_clearly(solo_daemon: Daemon) -> None:
    with pytest.raises(RpcError) as refused:
        attach_pool(solo_daemon.socket, "h")
    assert refused.value.code == "no_offload_tier"
    assert "[offload]" in refused.value.message
    with BlockingEngineClient.connect(solo_daemon.socket) as client:
        with pytest.raises(RpcError) as again:
            client.offload_grant("h", 1)
        assert again.value.code == "no_offload_tier"
        assert client.status()["offload"] is None


# --------------------------------------------------------- a writer killed mid-store

_WRITER: Final = textwrap.dedent(
    """
    import json, sys, time
    from daemon.client import BlockingEngineClient
    from daemon.client.pool import attach_pool
    socket, holder = sys.argv[1], sys.argv[2]
    pool = attach_pool(socket, holder)
    client = BlockingEngineClient.connect(socket)
    granted = client.offload_grant(holder, 3)
    for slot in granted.slots:
        pool.view(slot)[:] = b"\\xee" * pool.slot_bytes
    print(json.dumps([granted.slots, granted.generations]), flush=True)
    time.sleep(600)  # killed here, its bytes written, its store never sent
    """
)


def test_a_writer_killed_mid_store_publishes_nothing_and_its_grant_is_reset(
    shared: Daemon, client: BlockingEngineClient
) -> None:
    holder = f"killed-{uuid.uuid4().hex[:6]}"
    child = subprocess.Popen(
        [sys.executable, "-c", _WRITER, shared.socket, holder],
        stdout=subprocess.PIPE, text=True, cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    try:
        assert child.stdout is not None
        slots, generations = json.loads(child.stdout.readline())
        assert len(slots) == 3
        assert states(shared)["granted"] >= 3
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    with attach_pool(shared.socket, "observer") as pool:
        for slot in slots:
            wait_for(f"slot {slot} zeroed", lambda s=slot: not any(pool.view(s)))
    wait_for("its grant reset", lambda: settled(shared) and states(shared)["granted"] == 0)
    events = slot_events(shared)
    assert any(
        isinstance(e, SlotsDiscarded) and e.why == "abandoned" and set(slots) <= set(e.slots)
        for e in events
    )
    # Nothing of it was published; its slots come back a generation on.
    assert not any(isinstance(e, SlotsStored) and e.holder == holder for e in events)
    regranted = client.offload_grant(f"next-{holder}", 64)
    mine = dict(zip(regranted.slots, regranted.generations, strict=True))
    for slot, generation in zip(slots, generations, strict=True):
        assert mine[slot] == generation + 1


# ---------------------------------------------------------------- a small pool: LRU


def test_a_small_pool_evicts_unleased_slots_least_recent_first_never_a_leased_one(
    tmp_path: Path,
) -> None:
    daemon = start(tmp_path, "lru", offload_config(4, reserve=1))
    try:
        with (
            BlockingEngineClient.connect(daemon.socket) as client,
            attach_pool(daemon.socket, "w") as pool,
        ):
            keys = [key(f"lru-{i}") for i in range(8)]
            (k0_grant, k0_digest) = store_new(client, pool, "w", keys[:1])
            store_new(client, pool, "w", keys[1:2])
            leased = client.offload_lease("reader", NS, [keys[0]])  # held to the end
            assert leased.slots == k0_grant.slots
            # k1 used after k0 (leased and given back): k0 is the least recently used.
            again = client.offload_lease("reader", NS, [keys[1]])
            client.offload_unlease("reader", again.slots, again.generations)
            for k in keys[2:]:
                store_new(client, pool, "w", [k])
                wait_for("the reserve kept", lambda: tier(daemon)["by_state"]["free"] >= 1)
            # Four slots, one kept free: the leased k0 and the two most recent stay.
            found = client.offload_lease("checker", NS, keys)
            hit = [i for i, s in enumerate(found.slots) if s >= 0]
            assert hit == [0, 6, 7], found.slots
            assert found.digests[0] == k0_digest[0]
            assert hashlib.sha256(pool.view(found.slots[0])).digest() == k0_digest[0]
        evicted = [e for e in slot_events(daemon) if isinstance(e, SlotsEvicted)]
        assert {e.why for e in evicted} == {"lru"}
        assert all(k0_grant.slots[0] not in e.slots for e in evicted)
    finally:
        assert daemon.stop() == 0, daemon.logs()


# ------------------------------------------------------- a planted stale slot


def test_a_reset_that_did_not_zero_is_caught_at_grant_never_granted_dirty(tmp_path: Path) -> None:
    daemon = start(
        tmp_path,
        "stale",
        offload_config(4),
        env={"KVPUSHD_FAILPOINTS": "offload.skip_reset=corrupt@1"},
    )
    try:
        with attach_pool(daemon.socket, "watch") as pool:
            with BlockingEngineClient.connect(daemon.socket) as writer:
                first = writer.offload_grant("dirty", 1)
                (slot,), (generation,) = first.slots, first.generations
                pool.view(slot)[:] = b"\x5a" * SLOT_BYTES
            # Abandoned; its first reset round skips the zeroing (the failpoint)
            # but says reset: the slot is free, a generation on, and dirty.
            wait_for("reset journaled", lambda: settled(daemon) and tier(daemon)["resets"] >= 1)
            assert bytes(pool.view(slot)) == b"\x5a" * SLOT_BYTES
            with BlockingEngineClient.connect(daemon.socket) as client:
                granted = client.offload_grant("next", 4)
                assert (slot, generation + 1) not in zip(
                    granted.slots, granted.generations, strict=True
                )
                for s in granted.slots:
                    assert not any(pool.view(s)), f"slot {s} granted dirty"
                assert tier(daemon)["not_zero"] == 1
                # Discarded and reset again, for real this time: granted later, clean.
                wait_for("zeroed", lambda: not any(pool.view(slot)) and settled(daemon))
                later = wait_for("regranted", lambda: client.offload_grant("later", 1).slots)
                assert later == (slot,)
        discarded = [
            e for e in slot_events(daemon) if isinstance(e, SlotsDiscarded) and e.why == "not_zero"
        ]
        assert [(e.slots, e.generations) for e in discarded] == [((slot,), (generation + 1,))]
        assert f'"slot": {slot}' in daemon.logs() and "not zero at grant" in daemon.logs()
    finally:
        assert daemon.stop() == 0, daemon.logs()


# ------------------------------------------------------------ daemon restarts


def _store_some(
    daemon: Daemon, n: int
) -> tuple[list[bytes], list[bytes], list[bytes], rpc.OffloadGranted]:
    with (
        BlockingEngineClient.connect(daemon.socket) as client,
        attach_pool(daemon.socket, "before") as pool,
    ):
        keys = [key(f"restart-{i}") for i in range(n)]
        granted, digests = store_new(client, pool, "before", keys)
        data = [bytes(pool.view(s)) for s in granted.slots]
        # Leased when the daemon dies: the restart drops the lease.
        client.offload_lease("before-reader", NS, keys[:1])
        return keys, digests, data, granted


def test_a_pool_under_dev_shm_survives_kill_9_and_its_keys_hit_again(tmp_path: Path) -> None:
    path = f"/dev/shm/kvpushd-test-pool-{uuid.uuid4().hex[:8]}"
    daemon = start(tmp_path, "keep", offload_config(8, path=path))
    try:
        pool_id = tier(daemon)["pool_id"]
        keys, digests, data, granted = _store_some(daemon, 4)
        daemon.kill()
        daemon.start()
        assert tier(daemon)["pool_id"] == pool_id and tier(daemon)["survived"]
        with (
            BlockingEngineClient.connect(daemon.socket) as client,
            attach_pool(daemon.socket, "after") as pool,
        ):
            assert pool.pool_id == pool_id
            found = client.offload_lease("after", NS, keys)
            assert found.slots == granted.slots
            assert found.digests == tuple(digests)
            for slot, written in zip(found.slots, data, strict=True):
                assert bytes(pool.view(slot)) == written
            assert states(daemon)["leased"] == 4  # the dead daemon's lease is gone
    finally:
        daemon.kill()
        os.unlink(path)


def test_a_memfd_pool_dies_with_the_daemon_every_key_misses_every_slot_reset(
    tmp_path: Path,
) -> None:
    daemon = start(tmp_path, "lose", offload_config(8))
    try:
        pool_id = tier(daemon)["pool_id"]
        keys, _, _, granted = _store_some(daemon, 4)
        daemon.kill()
        daemon.start()
        assert tier(daemon)["pool_id"] != pool_id and not tier(daemon)["survived"]
        wait_for("the lost slots reset", lambda: settled(daemon))
        with BlockingEngineClient.connect(daemon.socket) as client:
            found = client.offload_lease("after", NS, keys)
            assert found.slots == (-1,) * 4
            regranted = client.offload_grant("after", 8)
        mine = dict(zip(regranted.slots, regranted.generations, strict=True))
        for slot, generation in zip(granted.slots, granted.generations, strict=True):
            assert mine[slot] == generation + 1  # reset before reuse
        events = slot_events(daemon)
        lost = [e for e in events if isinstance(e, SlotsEvicted) and e.why == "pool_lost"]
        assert len(lost) == 1 and set(lost[0].slots) == set(granted.slots)
    finally:
        daemon.kill()
