"""Real vLLM P/D when things go wrong: a load error or a held block, never wrong tokens.

Abort: the decode client gives up while the prefill daemon's write is in
flight (a failpoint holds it just before it is posted). vLLM keeps the
request's blocks until the connector says the load is over, which it says
only once the daemon released them (after the pusher's final word), so the
late write lands in blocks nobody else uses; later requests reuse them and
their tokens still equal a single instance's.

The decode instance runs with ``kv_load_failure_policy=recompute``: when its
KV cannot come (the prefill daemon was killed with SIGKILL after the
prefill ran and before the decode side registered), the connector reports
a failed receive and vLLM recomputes the prompt, so the output
still equals a single instance's. Both connectors end every transfer they
held: the prefill's blocks go back to vLLM (nothing can read them any
more), the decode's load ends as failed, and the decode daemon ends empty.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from daemon.sim.launcher import Daemon
from harness.vllm_router import prefill_leg
from harness.vllm_servers import VllmServer, VllmServerError, kvpushd_pd
from schemas.events import Failed
from schemas.reasons import Reason

TOKENS = 8
EXTERNAL = "vllm:prompt_tokens_by_source_total"


@pytest.fixture(scope="module")
def recompute_pd(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[VllmServer, VllmServer, Daemon, Daemon]]:
    with kvpushd_pd(
        tiny_model,
        tmp_path_factory.mktemp("pd-fail"),
        # Every push waits 1.5 s before it is posted: long enough for a client to give up.
        prefill_env={"KVPUSHD_FAILPOINTS": "nixl.post=sleep:1.5"},
        kv_load_failure_policy="recompute",
    ) as pair:
        yield pair


def test_a_decode_aborted_while_the_write_is_in_flight_keeps_its_blocks_until_released(
    recompute_pd,
) -> None:
    p, d, prefill, decode = recompute_pd
    rng = random.Random(8)
    for _ in range(3):  # the abort path once released twice (a stale refusal after Released)
        prompt = [rng.randrange(2, 512) for _ in range(128)]
        sent = prefill_leg(p, prompt)
        transfer = sent["kvpushd_transfer_id"]
        with pytest.raises(OSError):  # the client gives up (and disconnects) at 0.5 s
            d.complete(prompt, TOKENS, kv_transfer_params=sent, timeout_s=0.5)
        deadline = time.monotonic() + 30
        while decode.status()["live"] or prefill.status()["live"]:
            assert time.monotonic() < deadline, decode.status()["requests"]
            time.sleep(0.1)
        time.sleep(0.3)  # a second release, had one been sent, is journaled by now
        events = [type(e).__name__ for e in decode.journal_events(transfer)]
        # Aborted while the write was in flight; the release waited for the
        # pusher's word; one release, no refusal after it.
        assert events == [
            "Registered",
            "WriteStarted",
            "Failed",
            "ReleaseDeferred",
            "PeerSettled",
            "Released",
        ], events
    # The blocks went back to vLLM and serve others: outputs stay exact.
    for length in (40, 128, 150):
        other = [rng.randrange(2, 512) for _ in range(length)]
        single = p.complete(other, TOKENS).token_ids
        got_p = p.complete(other, 1, kv_transfer_params={"do_remote_decode": True})
        got = d.complete(other, TOKENS, kv_transfer_params=got_p.raw["kv_transfer_params"])
        assert got.token_ids == single, length
    metrics = d.metrics()
    assert metrics.total("vllm:num_requests_running") == 0
    assert metrics.total("vllm:num_requests_waiting") == 0


def test_a_prefill_daemon_killed_mid_write_then_restarted_loses_no_token_and_no_block(
    recompute_pd,
) -> None:
    p, d, prefill, decode = recompute_pd
    rng = random.Random(11)
    prompt = [rng.randrange(2, 512) for _ in range(140)]
    single = p.complete(prompt, TOKENS).token_ids
    sent = prefill_leg(p, prompt)
    transfer = sent["kvpushd_transfer_id"]
    with ThreadPoolExecutor(1) as pool:
        decoding = pool.submit(d.complete, prompt, TOKENS, kv_transfer_params=sent)
        # The pusher is writing (journaled, the receiver told) when it dies.
        deadline = time.monotonic() + 30
        while "WriteStarted" not in _names(decode.journal_events(transfer)):
            assert time.monotonic() < deadline and not decoding.done()
            time.sleep(0.02)
        prefill.kill()
        assert decoding.result().token_ids == single  # a load error, recomputed
    # The decode daemon fenced the dead pusher (nothing of it can land any
    # more) and failed the load; only then were the blocks let go.
    events = decode.journal_events(transfer)
    assert _names(events) == ["Registered", "WriteStarted", "Failed", "Released"]
    assert events[2].reason is Reason.PEER_DEAD and events[2].settled
    prefill.start()
    # The prefill connector registers its engine again on its own; the
    # transfer that died with the daemon is failed there and let go.
    deadline = time.monotonic() + 30
    while not prefill.status()["engines"] or prefill.status()["live"]:
        assert time.monotonic() < deadline, prefill.status()
        time.sleep(0.1)
    names = _names(prefill.journal_events(transfer))
    assert "Failed" in names and names[-1] == "Released", names
    # The restarted daemon maps the prefill's KV memory again from the memfd
    # the connector passed with its new Hello: no file anywhere.
    (engine,) = prefill.status()["engines"].values()
    assert (engine["memory"], engine["kv"]) == ("descriptor", "cache"), engine
    assert not [f for f in os.listdir("/dev/shm") if f.startswith("kvpushd-vllm-")]
    external_before = d.metrics().total(EXTERNAL, source="external_kv_transfer")
    for length in (60, 140):
        other = [rng.randrange(2, 512) for _ in range(length)]
        expected = p.complete(other, TOKENS).token_ids
        got_p = p.complete(other, 1, kv_transfer_params={"do_remote_decode": True})
        got = d.complete(other, TOKENS, kv_transfer_params=got_p.raw["kv_transfer_params"])
        assert got.token_ids == expected, length
    # The KV came through the restarted daemon, not from a recompute.
    _wait_for(lambda: d.metrics().total(EXTERNAL, source="external_kv_transfer")
              >= external_before + 60 + 140 - 2)  # fmt: skip
    _wait_for(lambda: not decode.status()["live"] and not prefill.status()["live"])
    for server in (p, d):
        metrics = server.metrics()
        assert metrics.total("vllm:num_requests_running") == 0
        assert metrics.total("vllm:num_requests_waiting") == 0


def test_a_decode_request_dropped_before_it_got_blocks_ends_the_push_at_once(
    recompute_pd,
) -> None:
    """vLLM finished it while it waited for a slot: nothing loads, the prefill's blocks go back.

    Sixteen long requests fill the decode server's sixteen slots, so the
    P/D request waits (no blocks, no receiver); its client gives up. The
    connector registers a receiver with no block whose content says why,
    the prefill daemon refuses the pairing naming it, nothing is written,
    and both sides end well before the 30 s registration deadline.
    """
    p, d, prefill, decode = recompute_pd
    rng = random.Random(14)
    prompt = [rng.randrange(2, 512) for _ in range(100)]
    sent = prefill_leg(p, prompt)
    transfer = sent["kvpushd_transfer_id"]
    fillers = [[rng.randrange(2, 512) for _ in range(8)] for _ in range(16)]
    with ThreadPoolExecutor(16) as pool:
        busy = [pool.submit(d.complete, f, 600) for f in fillers]
        _wait_for(lambda: d.metrics().total("vllm:num_requests_running") == 16)
        with pytest.raises(OSError):  # still waiting for a slot when its client gives up
            d.complete(prompt, TOKENS, kv_transfer_params=sent, timeout_s=0.5)
        assert d.metrics().total("vllm:num_requests_running") == 16
        given_up = time.monotonic()
        _wait_for(lambda: not prefill.status()["live"] and not decode.status()["live"])
        ended_after = time.monotonic() - given_up
        for done in busy:
            done.result()
    assert ended_after < 15, ended_after  # not the 30 s deadline
    received = decode.journal_events(transfer)
    assert _names(received) == ["Registered", "Failed", "Released"]
    assert received[0].blocks == ((),)  # no block of the decode instance was involved
    pushed = prefill.journal_events(transfer)
    assert "WriteStarted" not in _names(pushed) and _names(pushed)[-1] == "Released"
    for events in (received, pushed):
        (failed,) = [e for e in events if isinstance(e, Failed)]
        assert failed.reason is Reason.CONTENT_MISMATCH, failed
        assert "not loaded: the decode request ended FINISHED_ABORTED" in failed.message
    metrics = d.metrics()
    assert metrics.total("vllm:num_requests_running") == 0
    assert metrics.total("vllm:num_requests_waiting") == 0


def _names(events: list) -> list[str]:
    return [type(e).__name__ for e in events]


def _wait_for(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.1)


def test_a_killed_prefill_daemon_makes_a_load_error_and_vllm_recomputes(recompute_pd) -> None:
    p, d, prefill, decode = recompute_pd
    rng = random.Random(7)
    prompt = [rng.randrange(2, 512) for _ in range(100)]
    single = p.complete(prompt, TOKENS).token_ids
    first = p.complete(prompt, 1, kv_transfer_params={"do_remote_decode": True})
    sent = first.raw["kv_transfer_params"]
    refused_before = decode.status()["counters"]["refusals"]
    prefill.kill()  # SIGKILL: its pusher request was registered and ready
    got = d.complete(prompt, TOKENS, kv_transfer_params=sent).token_ids
    assert got == single  # recomputed, never wrong
    # The decode daemon refused the receiver (peer_unreachable): a load error.
    assert decode.status()["counters"]["refusals"] == refused_before + 1
    # Reported as a failed receive (vLLM recomputes it), never as block errors.
    assert "not registered" in d.log.read_text()
    deadline = time.monotonic() + 30
    while decode.status()["live"]:
        assert time.monotonic() < deadline, decode.status()["requests"]
        time.sleep(0.1)
    # The decode engine never registered a receiver it could not be sure of.
    metrics = d.metrics()
    assert metrics.total("vllm:num_requests_running") == 0
    assert metrics.total("vllm:num_requests_waiting") == 0
    # The prefill instance got its blocks back and keeps serving.
    assert p.complete(prompt, TOKENS).token_ids == single


def test_with_the_fail_policy_the_client_gets_an_error_never_wrong_tokens(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    with kvpushd_pd(
        tiny_model, tmp_path_factory.mktemp("pd-fail-policy"), kv_load_failure_policy="fail"
    ) as (p, d, prefill, decode):
        rng = random.Random(9)
        prompt = [rng.randrange(2, 512) for _ in range(100)]
        first = p.complete(prompt, 1, kv_transfer_params={"do_remote_decode": True})
        prefill.kill()
        with pytest.raises(VllmServerError):
            d.complete(prompt, TOKENS, kv_transfer_params=first.raw["kv_transfer_params"])
        deadline = time.monotonic() + 30
        while decode.status()["live"]:
            assert time.monotonic() < deadline, decode.status()["requests"]
            time.sleep(0.1)
        assert d.metrics().total("vllm:num_requests_running") == 0
