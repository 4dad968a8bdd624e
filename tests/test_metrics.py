"""Prometheus metrics: scraped from real daemons while simulated engines push.

The pair is module-scoped and shared, so every test measures deltas between
two scrapes rather than absolute values.
"""

from __future__ import annotations

import ast
import asyncio
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator

import msgspec
import pytest

from daemon.node.metrics import NodeMetrics
from daemon.sim.engine import Expectation, SimEngine, SimGroup, tail_pairs
from schemas import rpc
from schemas.events import DaemonStarted, Failed, Released
from schemas.layout import Role
from schemas.reasons import FAILURE_REASONS, REFUSAL_REASONS, Reason
from schemas.state import RequestRecord, State
from schemas.status import StatusDocument
from tests.support import REPO
from tests.support.metrics import MetricsDaemon, Samples, delta, metrics_pair, value
from tests.support.pushes import engine_pair

LAYOUT = [
    SimGroup(num_blocks=256, block_bytes=4096, layers=2),
    SimGroup(num_blocks=256, block_bytes=2048, layers=3),
]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[MetricsDaemon, ...]]:
    yield from metrics_pair(tmp_path_factory.mktemp("metrics"))


async def _engines(pair: tuple[MetricsDaemon, ...]) -> tuple[SimEngine, SimEngine]:
    return await engine_pair(pair, LAYOUT)


async def _push(pe: SimEngine, de: SimEngine, rid: str, src, dst) -> int:
    """Push one request end to end, release both sides; returns the bytes written."""
    pairs = tail_pairs(pe.layout, src, de.layout, dst)
    await de.decode_register(rid, dst, "prefill", expect=Expectation(pe.engine_id, pairs))
    await pe.prefill(rid, src)
    assert isinstance(await de.wait_event(rid, (rpc.KvArrived, rpc.RequestFailed)), rpc.KvArrived)
    freed = await pe.wait_event(rid, (rpc.BlocksFreeable, rpc.RequestFailed))
    assert isinstance(freed, rpc.BlocksFreeable)
    await de.release(rid)
    await pe.release(rid)
    # Every layer of every paired block is written once.
    return sum(
        len(group_pairs) * group.block_bytes * group.layers
        for group_pairs, group in zip(pairs, LAYOUT, strict=True)
    )


async def _until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition never held"
        await asyncio.sleep(0.01)


def test_status_names_the_metrics_port(pair):
    for daemon in pair:
        assert daemon.status()["metrics_port"] == daemon.metrics_port


async def test_pushes_move_transfer_counters_bytes_and_histograms(pair):
    prefill, decode = pair
    p0, d0 = prefill.scrape(), decode.scrape()
    pe, de = await _engines(pair)
    try:
        expected = 0
        expected += await _push(pe, de, "m1", [[1, 2, 3], [4, 5]], [[10, 11], [12]])
        expected += await _push(pe, de, "m2", [list(range(20, 26)), [30]], [[40, 41, 42], [43]])
        expected += await _push(pe, de, "m3", [[7], [8]], [[50], [51]])
    finally:
        await pe.close()
        await de.close()
    p1, d1 = prefill.scrape(), decode.scrape()
    assert expected > 0
    assert delta(p0, p1, "kvpushd_transfers_started_total") == 3
    assert delta(p0, p1, "kvpushd_transfers_completed_total") == 3
    assert delta(p0, p1, "kvpushd_transfers_failed_total") == 0
    assert delta(p0, p1, "kvpushd_written_bytes_total") == expected
    assert delta(p0, p1, "kvpushd_transfer_seconds_count") == 3
    assert delta(p0, p1, "kvpushd_transfer_seconds_sum") > 0
    # The node's own counters agree with what the observer saw in the journal.
    counters = prefill.status()["counters"]
    assert value(p1, "kvpushd_written_bytes_total") == counters["bytes_written"]
    assert value(p1, "kvpushd_transfers_completed_total") == counters["writes_done"]
    # Each pusher request left registered, trimmed, writing and done once.
    for state in ("registered", "trimmed", "writing", "done"):
        assert delta(p0, p1, "kvpushd_state_seconds_count", state=state) == 3, state
    assert delta(p0, p1, "kvpushd_journal_appends_total", event="write_done") == 3
    assert delta(p0, p1, "kvpushd_journal_appends_total", event="released") == 3
    # The receiver saw the KV arrive; it writes nothing itself.
    assert delta(d0, d1, "kvpushd_kv_arrived_total") == 3
    assert delta(d0, d1, "kvpushd_transfers_completed_total") == 0
    for samples in (p1, d1):
        assert value(samples, "kvpushd_fsync_seconds_count") > 0
        assert value(samples, "kvpushd_journal_durable_seq") > 0
        assert value(samples, "kvpushd_peers_up") == 1


async def test_trim_refusal_counts_refusal_and_failure(pair):
    prefill, decode = pair
    p0, d0 = prefill.scrape(), decode.scrape()
    pe, de = await _engines(pair)
    try:
        # The decode side asks for more blocks than the prefill side has.
        await de.decode_register("refused", [[1, 2, 3, 4], [5]], "prefill")
        await pe.prefill("refused", [[7, 8], [9, 10]], kv_ready=False)
        failed = await pe.wait_event("refused", rpc.RequestFailed)
        assert failed.reason == "decode_longer_than_prefill"
        await de.wait_event("refused", rpc.RequestFailed)
        await de.release("refused")
        await pe.release("refused")
    finally:
        await pe.close()
        await de.close()
    p1, d1 = prefill.scrape(), decode.scrape()
    reason = "decode_longer_than_prefill"
    assert delta(p0, p1, "kvpushd_refusals_total", reason=reason) == 1
    assert delta(p0, p1, "kvpushd_failures_total", reason=reason) == 1
    assert delta(d0, d1, "kvpushd_failures_total", reason=reason) == 1
    assert delta(p0, p1, "kvpushd_transfers_started_total") == 0
    # Labels exist from the start, so other reasons read zero, not absent.
    assert ("kvpushd_refusals_total", (("reason", "peer_dead"),)) in p1


def _labels(samples: Samples, name: str, label: str) -> set[str]:
    return {dict(labels)[label] for (n, labels), _ in samples.items() if n == name}


def test_metric_names_follow_prometheus_conventions(pair):
    samples = pair[0].scrape()
    names = {name for name, _ in samples}
    # The standard process collector names, once; no private copies of them.
    for name in ("process_start_time_seconds", "process_cpu_seconds_total", "process_open_fds"):
        assert name in names, name
    assert not [n for n in names if n.startswith("kvpushd_process_")]
    assert [n for n in names if n.endswith("start_time_seconds")] == ["process_start_time_seconds"]
    # Units last.
    assert "kvpushd_written_bytes_total" in names
    assert "kvpushd_bytes_written_total" not in names
    # A reason appears only on the family that can see it.
    refusals = _labels(samples, "kvpushd_refusals_total", "reason")
    failures = _labels(samples, "kvpushd_failures_total", "reason")
    assert refusals == {r.value for r in REFUSAL_REASONS}
    assert failures == {r.value for r in FAILURE_REASONS}
    for never_refused in ("transfer_error", "aborted", "deadline_exceeded", "release_deferred"):
        assert never_refused not in refusals
    for never_failed in ("blocks_owned", "peer_unreachable", "release_deferred"):
        assert never_failed not in failures


def _reasons_in_calls(names: set[str]) -> set[Reason]:
    """The Reason.X literals passed to calls of ``names`` anywhere in the core or the runtime."""
    found: set[Reason] = set()
    for path in [*(REPO / "statemachine").glob("*.py"), *(REPO / "daemon" / "node").glob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            called = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
            if called not in names:
                continue
            for arg in ast.walk(node):
                if (
                    isinstance(arg, ast.Attribute)
                    and isinstance(arg.value, ast.Name)
                    and arg.value.id == "Reason"
                ):
                    found.add(Reason[arg.attr])
    return found


def test_reason_sets_cover_every_raise_site():
    # What the core and runtime refuse with is journaled as Refused; what they
    # fail a request with (a Why) as Failed. A new reason raised somewhere
    # must be added to its set, or its series would be missing until it occurs.
    refused = _reasons_in_calls({"Refusal", "TrimRefused", "_refuse"})
    assert refused, "the scan found no refusals"
    assert refused | {Reason.ILLEGAL_TRANSITION} <= REFUSAL_REASONS, refused - REFUSAL_REASONS
    failed = _reasons_in_calls({"Why"})
    assert failed <= FAILURE_REASONS, failed - FAILURE_REASONS
    # A trim refusal fails the pusher's request, and a receiver fails with the
    # reason the pusher refused its forwarded registration with.
    trim = _reasons_in_calls({"TrimRefused", "_refuse"})
    assert trim <= FAILURE_REASONS, trim - FAILURE_REASONS


async def test_live_requests_gauge_matches_status(pair):
    prefill, decode = pair
    pe, de = await _engines(pair)
    try:
        await de.decode_register("held", [[60], [61]], "prefill")
        await pe.prefill("held", [[1, 2], [3]], kv_ready=False)  # trims, then waits for KV
        # Wait for a steady state, so status and scrape see the same thing.
        await _until(lambda: prefill.status()["by_state"] == {"trimmed": 1})
        assert decode.status()["by_state"] == {"registered": 1}
        for daemon in pair:
            by_state = daemon.status()["by_state"]
            samples = daemon.scrape()
            assert by_state, daemon.node
            for state in ("registered", "trimmed", "writing", "done", "failed"):
                gauge = value(samples, "kvpushd_live_requests", state=state)
                assert gauge == by_state.get(state, 0), (daemon.node, state, by_state)
        await pe.kv_ready("held")
        assert isinstance(await de.wait_event("held", rpc.KvArrived), rpc.KvArrived)
        await de.release("held")
        await pe.release("held")
    finally:
        await pe.close()
        await de.close()
    for daemon in pair:
        assert daemon.status()["live"] == 0
        samples = daemon.scrape()
        assert sum(v for (n, _), v in samples.items() if n == "kvpushd_live_requests") == 0


def test_only_metrics_path_is_served(pair):
    prefill, _ = pair
    with pytest.raises(urllib.error.HTTPError) as missing:
        urllib.request.urlopen(f"http://127.0.0.1:{prefill.metrics_port}/nope", timeout=5)
    assert missing.value.code == 404


def _record(state: State, entered_at: float, role: Role = Role.PUSHER) -> RequestRecord:
    return RequestRecord("r", 1, role, "e", "peer", state, ((1,),), entered_at, entered_at + 30)


def test_restart_seeds_time_in_state_from_the_replayed_registry():
    # No daemon needed: feed the observer what Node.record() would.
    writing = _record(State.WRITING, entered_at=100.0)
    # Built alone: the status it gauges is a plain document, the live records a list.
    metrics = NodeMetrics(status=lambda: StatusDocument(node="n"), live=lambda: [writing])
    observe = metrics.observe
    observe(DaemonStarted(1, "0.1.0", "boot"), None, 104.0)
    failed = msgspec.structs.replace(writing, state=State.FAILED, entered_at=105.0)
    observe(Failed("r", 1, Reason.DAEMON_RESTART, "restarted"), failed, 105.0)
    released = msgspec.structs.replace(failed, state=State.RELEASED, entered_at=107.5)
    observe(Released("r", 1), released, 107.5)

    def sample(name: str, **labels: str) -> float | None:
        return metrics.registry.get_sample_value(name, labels)

    # The write died with the old process: a failed transfer, 5 s in writing.
    assert sample("kvpushd_transfers_failed_total") == 1
    assert sample("kvpushd_state_seconds_sum", state="writing") == 5.0
    assert sample("kvpushd_state_seconds_sum", state="failed") == 2.5
    assert sample("kvpushd_failures_total", reason="daemon_restart") == 1
    assert sample("kvpushd_journal_appends_total", event="released") == 1
    assert sample("kvpushd_metrics_errors_total") == 0
