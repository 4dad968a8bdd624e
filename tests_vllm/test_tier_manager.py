"""The tier's scheduler side (daemon/client/vllm/tier/manager.py) against a real daemon.

No vLLM server: the manager is driven as vLLM's offloading scheduler
drives it (lookups, the step's end, loads, stores, a request's end), with
vLLM's own request context, over a real daemon's socket. What it holds is
read back from the daemon: every lease it took is given back, once.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext

from daemon.client import BlockingEngineClient
from daemon.client.pool import attach_pool
from daemon.client.vllm.tier.jobs import TierLoad, TierStore
from daemon.client.vllm.tier.manager import TierManager
from daemon.journal.replay import replay
from daemon.sim.launcher import Daemon, free_port
from schemas.events import SlotsLeased, SlotsUnleased

NS = "ns-manager"
SLOT_BYTES = 4096
END = ScheduleEndContext((), ())


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Daemon]:
    made = Daemon(
        "tier", tmp_path, free_port(), extra=f"[offload]\nslots = 64\nslot_bytes = {SLOT_BYTES}"
    ).start()
    yield made
    assert made.stop() == 0, made.logs()


def _by_state(daemon: Daemon) -> dict[str, int]:
    by_state: dict[str, int] = daemon.status()["offload"]["by_state"]
    return by_state


def _publish(daemon: Daemon, keys: list[bytes]) -> None:
    """Another engine stores ``keys`` (holder "writer", namespace NS)."""
    with (
        attach_pool(daemon.socket, "writer", namespace=NS) as pool,
        BlockingEngineClient.connect(daemon.socket) as client,
    ):
        granted = client.offload_grant("writer", len(keys))
        for slot in granted.slots:
            pool.view(slot)[:] = b"\x01" * SLOT_BYTES
        digests = [b"d%d" % i for i in range(len(keys))]
        client.offload_store("writer", "", granted.slots, granted.generations, keys, digests)


def _leases_of(daemon: Daemon, holder: str) -> tuple[int, int]:
    """(slots leased, slots given back) by ``holder``, as journaled."""
    counts = [0, 0]

    def count(record: Any, touched: object) -> None:
        event = record.event
        if isinstance(event, (SlotsLeased, SlotsUnleased)) and event.holder == holder:
            counts[isinstance(event, SlotsUnleased)] += len(event.slots)

    replay(daemon.journal, on_record=count)
    return counts[0], counts[1]


def _given_back(daemon: Daemon) -> tuple[int, int] | None:
    leased, back = _leases_of(daemon, "engine")
    return (leased, back) if leased == back else None


def _until(what: str, check: Any, timeout: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := check():
            return value
        time.sleep(0.02)
    raise AssertionError(f"not within {timeout} s: {what}")


def _answered(manager: TierManager, key: bytes, ctx: ReqContext) -> LookupResult:
    """Step until the manager has the daemon's answer for ``key``."""

    def ask() -> LookupResult | None:
        result = manager.lookup(key, ctx)
        manager.on_schedule_end(END)
        return None if result is LookupResult.RETRY else result

    answer: LookupResult = _until(f"an answer for {key!r}", ask)
    return answer


@pytest.fixture
def manager(daemon: Daemon) -> Iterator[TierManager]:
    # The manager's holder is bound to NS by "its worker": an attach that names it.
    attach_pool(daemon.socket, "engine", namespace=NS).close()
    made = TierManager(daemon.socket, "engine", credits=4)
    yield made
    made.shutdown()


def test_lookups_are_leases_counted_by_requests_and_all_given_back(
    daemon: Daemon, manager: TierManager
) -> None:
    keys = [b"k0", b"k1", b"k2"]
    _publish(daemon, keys)
    a, b = ReqContext("a"), ReqContext("b")
    manager.on_new_request(a)
    manager.on_new_request(b)
    # The first lookup of a key asks the daemon: RETRY until its answer.
    assert manager.lookup(keys[0], a) is LookupResult.RETRY
    assert manager.has_pending_work()
    assert [_answered(manager, k, a) for k in keys] == [LookupResult.HIT] * 3
    assert _answered(manager, b"never stored", a) is LookupResult.MISS
    # Another request finds the live leases at once: one more user, no call.
    assert manager.lookup(keys[0], b) is LookupResult.HIT
    assert _by_state(daemon)["leased"] == 3
    # a loads two of its three: the third goes back now; the loaded ones after the load.
    spec = manager.prepare_load(keys[:2], a)
    assert isinstance(spec, TierLoad) and len(spec.slots) == 2 and min(spec.slots) >= 0
    manager.on_schedule_end(END)
    _until("k2 given back", lambda: _by_state(daemon)["leased"] == 2)
    manager.complete_load(keys[:2], a)
    manager.on_schedule_end(END)
    # k1 is a's alone: back; k0 is b's too: kept.
    _until("k1 given back", lambda: _by_state(daemon)["leased"] == 1)
    manager.on_request_finished(b)
    manager.on_schedule_end(END)
    _until("every lease given back", lambda: _by_state(daemon)["leased"] == 0)
    manager.on_request_finished(a)
    manager.on_schedule_end(END)
    assert not manager.has_pending_work()
    # Each lease the daemon gave (one per key, and one per later answer for
    # a key already held) went back exactly once.
    # (Leases are journaled with no sync of their own: read once they are written.)
    assert _by_state(daemon)["leased"] == 0
    _until("the journal's leases", lambda: _leases_of(daemon, "engine")[0] >= 3)
    leased, back = _until("all given back", lambda: _given_back(daemon))
    assert leased == back >= 3


def test_a_request_that_ends_before_its_answer_leaves_no_lease(
    daemon: Daemon, manager: TierManager
) -> None:
    _publish(daemon, [b"late"])
    ctx = ReqContext("gone-early")
    manager.on_new_request(ctx)
    assert manager.lookup(b"late", ctx) is LookupResult.RETRY
    manager.on_schedule_end(END)  # asked
    manager.on_request_finished(ctx)  # ended before the answer came

    def settled() -> bool:
        manager.on_schedule_end(END)  # drains the answer, gives the lease back
        leased, back = _leases_of(daemon, "engine")
        return leased == back == 1

    _until("the daemon's lease given back, once", settled)
    assert _by_state(daemon)["leased"] == 0


def test_stores_use_slots_granted_ahead_and_never_store_a_key_twice(
    daemon: Daemon, manager: TierManager
) -> None:
    ctx = ReqContext("writer")
    manager.on_new_request(ctx)
    _until("credits", lambda: manager.prepare_store([b"s0"], ctx))
    out = manager.prepare_store([b"s0", b"s1", b"s2"], ctx)
    assert out is not None
    # s0 was planned already: only the new keys, each on its own granted slot.
    assert out.keys_to_store == [b"s1", b"s2"]
    assert isinstance(out.store_spec, TierStore)
    assert len(set(out.store_spec.slots.tolist())) == 2
    assert _by_state(daemon)["granted"] >= 3


def test_a_tier_filter_without_this_tier_misses_without_asking(manager: TierManager) -> None:
    from vllm.v1.kv_offload.base import TierFilter

    ctx = ReqContext("filtered", load_tier_filter=TierFilter(matchers=()))
    assert manager.lookup(b"anything", ctx) is LookupResult.MISS
    assert not manager.has_pending_work()
