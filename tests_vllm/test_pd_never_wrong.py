"""Never wrong by construction, on real vLLM: blocks paired by their content hashes.

Each case here served wrong tokens, leaked blocks or was never refused
before block hashes (daemon/client/vllm/hashes.py, statemachine/content.py):

- a prefill leg run with ``max_tokens`` above 1 computed a token past the
  prompt; at a prompt length that fills its last block the prefill pushed a
  block more than the decode has, and the tail trim paired every decode
  block with the block after its own (4 of 12 prompts decoded wrong);
- a planted misalignment (the prefill names one block less at its end)
  was written as it came: now the block hashes refuse it before any byte;
- a router ``transfer_id`` used by two live prefill requests lost the
  first push's bookkeeping, and its blocks stayed held for good.

The decode recomputes a load that failed (``kv_load_failure_policy``
recompute), so every answer still equals a single instance's.
"""

from __future__ import annotations

import copy
import http.client
import json
import random
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from daemon.journal.replay import replay
from daemon.sim.launcher import Daemon, free_port, wait_idle
from harness.hostile_params import hostile_legs
from harness.vllm_router import external_tokens, loads_token_exact, prefill_leg
from harness.vllm_servers import VllmServer, VllmServerError, kvpushd_pd
from schemas.events import Failed, PeerRegistered, Registered, WriteDone, WriteStarted
from schemas.reasons import Reason
from statemachine.content import decode as decode_content

TOKENS = 8
BLOCK = 32

PD = tuple[VllmServer, VllmServer, Daemon, Daemon]


@pytest.fixture(scope="module")
def pd(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PD]:
    with kvpushd_pd(
        tiny_model,
        tmp_path_factory.mktemp("pd-never-wrong"),
        # The first push of the prefill instance is the planted misalignment.
        prefill_server_env={"KVPUSHD_FAILPOINTS": "connector.shift_push=corrupt@1"},
        kv_load_failure_policy="recompute",
    ) as pair:
        yield pair


def test_a_push_shifted_by_one_block_is_refused_by_the_hashes_before_any_write(pd: PD) -> None:
    """The planted misalignment (first push): refused, naming the first block that differs.

    The decode holds the prompt's first 3 blocks in its own cache and names
    blocks 3 and 4; the prefill names blocks 0 to 3 (its last one left out),
    so the tail trim pairs decode block 3 with prefill block 2. Without
    block hashes that was written as it came, and decoded.
    """
    p, d, prefill, decode = pd
    rng = random.Random(1)
    prompt = [rng.randrange(2, 512) for _ in range(150)]
    # The decode's own prefix hit: 96 shared tokens are 3 full blocks.
    d.complete(prompt[:96] + [rng.randrange(2, 512) for _ in range(40)], 1)
    single = p.complete(prompt, TOKENS).token_ids
    before = external_tokens(d)
    sent = prefill_leg(p, prompt)
    assert d.complete(prompt, TOKENS, kv_transfer_params=sent).token_ids == single
    assert external_tokens(d) == before  # the load failed; the decode computed the prompt
    wait_idle(prefill, decode, timeout=10)
    transfer = sent["kvpushd_transfer_id"]
    for daemon in (prefill, decode):
        events = daemon.journal_events(transfer)
        assert not [e for e in events if isinstance(e, WriteStarted)], (daemon.node, events)
        (failed,) = [e for e in events if isinstance(e, Failed)]
        assert failed.reason is Reason.CONTENT_MISMATCH, (daemon.node, failed)
    (failed,) = [e for e in prefill.journal_events(transfer) if isinstance(e, Failed)]
    message = failed.message
    assert "the decode's block for prompt block 3" in message, message
    assert "would receive the prefill's prompt block 2" in message, message
    assert "the prefill holds that hash at prompt block 3" in message, message
    p.wait_kv_usage_zero()
    d.wait_kv_usage_zero()


@pytest.mark.parametrize("prefill_tokens", [2, 5])
def test_a_prefill_leg_with_more_than_one_token_pushes_exactly_the_prompt(
    pd: PD, prefill_tokens: int
) -> None:
    """Prompt lengths k*32-1, k*32 and k*32+1: the decode's tokens equal a single instance's.

    At k*32 the prefill computed a token into a block past the prompt; it
    pushes the prompt's blocks only, each named with its hash.
    """
    p, d, prefill, decode = pd
    rng = random.Random(prefill_tokens)
    for length in (63, 64, 65, 127, 128, 129):
        prompt = [rng.randrange(2, 512) for _ in range(length)]
        single = p.complete(prompt, TOKENS).token_ids
        before = external_tokens(d)
        sent = prefill_leg(p, prompt, max_tokens=prefill_tokens)
        assert d.complete(prompt, TOKENS, kv_transfer_params=sent).token_ids == single, length
        assert external_tokens(d) - before >= length - 1, length
        wait_idle(prefill, decode, timeout=10)
        transfer = sent["kvpushd_transfer_id"]
        (push,) = [e for e in prefill.journal_events(transfer) if isinstance(e, Registered)]
        (blocks,) = push.blocks
        assert len(blocks) == -(-length // BLOCK), (length, push.blocks)
        hashes = decode_content(transfer, push.content)
        assert hashes is not None and hashes[0] is not None, push.content
        assert hashes[0].first == 0 and len(hashes[0].hashes) == len(blocks)
        assert any(isinstance(e, WriteDone) for e in decode.journal_events(transfer))


def test_a_transfer_id_used_by_two_live_prefill_requests_pushes_once_and_leaks_nothing(
    pd: PD,
) -> None:
    """A router's retry under its own ``transfer_id``: the second leg pushes nothing.

    The first push goes on and loads; the second prefill request's blocks go
    back at once; after the decode loaded, the prefill instance holds no
    block and has no push pending.
    """
    p, d, prefill, decode = pd
    rng = random.Random(77)
    prompt = [rng.randrange(2, 512) for _ in range(100)]
    single = p.complete(prompt, TOKENS).token_ids
    first = prefill_leg(p, prompt, transfer_id="xfer-reused-1")
    again = p.complete(
        prompt,
        1,
        kv_transfer_params={"do_remote_decode": True, "transfer_id": "xfer-reused-1"},
    )
    assert not again.raw.get("kv_transfer_params"), again.raw  # nothing to load from
    assert first["kvpushd_transfer_id"] == "xfer-reused-1"
    before = external_tokens(d)
    assert d.complete(prompt, TOKENS, kv_transfer_params=first).token_ids == single
    assert external_tokens(d) - before >= len(prompt) - 1
    wait_idle(prefill, decode, timeout=10)
    registered = [e for e in prefill.journal_events("xfer-reused-1") if isinstance(e, Registered)]
    assert len(registered) == 1, registered
    p.wait_kv_usage_zero()
    d.wait_kv_usage_zero()
    assert "already pushed by" in p.log.read_text(errors="replace")


def test_a_prefill_leg_aborted_with_both_legs_at_once_ends_the_decodes_wait_at_once(
    pd: PD,
) -> None:
    """Both legs at once, and the prefill's client goes away: nothing will be pushed.

    The prefill instance says so at once (a pusher with no block, its
    content naming why): the decode's early receiver is refused within a
    second or two instead of waiting for the push's 30 s deadline, and the
    decode computes the prompt itself.
    """
    p, d, prefill, decode = pd
    rng = random.Random(78)
    prompt = [rng.randrange(2, 512) for _ in range(120)]
    single = p.complete(prompt, TOKENS).token_ids
    transfer = "xfer-aborted-prefill"
    decode_params = {
        "do_remote_decode": False,
        "do_remote_prefill": True,
        "remote_engine_id": prefill.node,
        "remote_host": "127.0.0.1",
        "remote_port": prefill.port,
        "tp_size": 1,
        "pp_size": 1,
        "transfer_id": transfer,
    }
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": 900,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "kv_transfer_params": {"do_remote_decode": True, "transfer_id": transfer},
    }
    with ThreadPoolExecutor(1) as pool:
        decoding = pool.submit(
            d.complete, prompt, TOKENS, kv_transfer_params=decode_params, timeout_s=60
        )
        conn = http.client.HTTPConnection("127.0.0.1", p.port, timeout=30)
        conn.request(
            "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        response = conn.getresponse()
        assert response.status == 200
        assert response.readline()  # the prompt is computed; the client goes
        conn.close()
        gone = time.monotonic()
        assert decoding.result().token_ids == single
        waited = time.monotonic() - gone
    assert waited < 10, waited  # the push's registered deadline is 30 s
    wait_idle(prefill, decode, timeout=10)
    events = prefill.journal_events(transfer)
    (failed,) = [e for e in events if isinstance(e, Failed)]
    assert failed.reason is Reason.CONTENT_MISMATCH, failed
    assert "not pushed: the prefill request ended FINISHED_ABORTED" in failed.message
    assert not [e for e in events if isinstance(e, WriteStarted)]
    p.wait_kv_usage_zero()
    d.wait_kv_usage_zero()


def test_a_decode_daemon_outage_does_not_pin_the_prefills_blocks(pd: PD) -> None:
    """The decode daemon is gone (SIGKILL) while prefill legs keep coming.

    The decode instance computes those prompts (its loads fail at once: no
    daemon), so no receiver ever claims the pushes; each push holds the
    prefill's blocks for ``[deadlines] unclaimed`` (5 s), not for the whole
    ``registered`` deadline (30 s). After a restart, remote KV comes back.
    """
    p, d, prefill, decode = pd
    rng = random.Random(79)
    decode.kill()
    sent_at = time.monotonic()
    for _ in range(6):
        prompt = [rng.randrange(2, 512) for _ in range(200)]
        single = p.complete(prompt, TOKENS).token_ids
        sent = prefill_leg(p, prompt)
        assert d.complete(prompt, TOKENS, kv_transfer_params=sent).token_ids == single
    assert p.metrics().total("vllm:kv_cache_usage_perc") > 0  # the pushes hold their blocks
    p.wait_kv_usage_zero(timeout_s=15)
    assert time.monotonic() - sent_at < 25  # well before a 30 s registered deadline
    assert prefill.status()["live"] == 0
    decode.start()
    deadline = time.monotonic() + 30
    while not decode.status()["engines"]:
        assert time.monotonic() < deadline, "the decode connector did not register again"
        time.sleep(0.2)
    loads_token_exact(p, d, [rng.randrange(2, 512) for _ in range(100)], TOKENS)


# What a router (or anything between the legs) may do to the prefill's answer
# that leaves nothing to trust: drop a field, retype one, send another version.
TAMPERED = (
    ("kvpushd_version", None),
    ("kvpushd_version", 2),
    ("kvpushd_node", None),
    ("kvpushd_split_tp", "1"),
)


def test_an_answer_with_a_field_dropped_retyped_or_of_another_version_is_computed(
    pd: PD,
) -> None:
    """Never a guess: the decode computes the prompt, says why, and serves on.

    Nothing tells the prefill's daemon (its name may be what is missing):
    its push, which no receiver claims or holds, ends at its ``unclaimed``
    deadline (5 s), and its journal says so.
    """
    p, d, prefill, decode = pd
    rng = random.Random(404)

    def by_params() -> float:
        return d.metrics().total("vllm:kvpushd_not_loaded_total", why="params")

    counted = by_params()
    transfers = []
    for key, value in TAMPERED:
        prompt = [rng.randrange(2, 512) for _ in range(80)]
        single = p.complete(prompt, TOKENS).token_ids
        sent = prefill_leg(p, prompt)
        transfers.append(sent["kvpushd_transfer_id"])
        if value is None:
            del sent[key]
        else:
            sent[key] = value
        before = external_tokens(d)
        assert d.complete(prompt, TOKENS, kv_transfer_params=sent).token_ids == single, key
        assert external_tokens(d) == before, key
    deadline = time.monotonic() + 15  # stats reach /metrics with the engine's next steps
    while by_params() < counted + len(TAMPERED):
        assert time.monotonic() < deadline, "the params refusals did not reach /metrics"
        time.sleep(0.2)
    log = d.log.read_text(errors="replace")
    assert "params version 2; this connector reads version 1" in log
    assert "kvpushd_version" in log and "kvpushd_node" in log and "kvpushd_split_tp" in log
    # The decode still loads an answer left as it was.
    loads_token_exact(p, d, [rng.randrange(2, 512) for _ in range(80)], TOKENS)
    wait_idle(prefill, decode, timeout=20)  # the tampered pushes' unclaimed deadline (5 s)
    for transfer in transfers:
        (failed,) = [e for e in prefill.journal_events(transfer) if isinstance(e, Failed)]
        assert failed.reason is Reason.DEADLINE_EXCEEDED, (transfer, failed)
        assert decode.journal_events(transfer) == []
    p.wait_kv_usage_zero()
    d.wait_kv_usage_zero()


def test_a_decode_leg_asking_for_prompt_logprobs_computes_its_prompt_and_ends_the_push_at_once(
    pd: PD,
) -> None:
    """vLLM reads no prefix for a request with prompt logprobs: nothing may be loaded into it.

    The decode computes the prompt (its prompt logprobs need every prompt
    token's logits) and answers as a single instance. The connector says so
    when vLLM asks for external tokens (vLLM would drop them) and ends the
    prefill's push then: a receiver of no block that says why, which the
    prefill daemon refuses, naming it in both journals.
    """
    p, d, prefill, decode = pd
    rng = random.Random(808)

    def by_logprobs() -> float:
        return d.metrics().total("vllm:kvpushd_not_loaded_total", why="prompt_logprobs")

    counted = by_logprobs()
    prompt = [rng.randrange(2, 512) for _ in range(90)]
    single = p.complete(prompt, TOKENS, prompt_logprobs=1)
    before = external_tokens(d)
    sent = prefill_leg(p, prompt)
    answer = d.complete(prompt, TOKENS, kv_transfer_params=sent, prompt_logprobs=1)
    assert answer.token_ids == single.token_ids
    logprobs = [c["prompt_logprobs"] for c in (answer.raw["choices"][0], single.raw["choices"][0])]
    assert logprobs[0] == logprobs[1]
    assert external_tokens(d) == before
    wait_idle(prefill, decode, timeout=10)
    events = prefill.journal_events(sent["kvpushd_transfer_id"])
    assert not [e for e in events if isinstance(e, WriteStarted)], events
    (failed,) = [e for e in events if isinstance(e, Failed)]
    assert failed.reason is Reason.CONTENT_MISMATCH, failed
    assert "not loaded: the request asks for prompt logprobs" in failed.message, failed
    deadline = time.monotonic() + 15  # stats reach /metrics with the engine's next steps
    while by_logprobs() < counted + 1:
        assert time.monotonic() < deadline, "the refusal did not reach /metrics"
        time.sleep(0.2)
    assert "asks for prompt logprobs" in d.log.read_text(errors="replace")
    p.wait_kv_usage_zero()
    d.wait_kv_usage_zero()


def test_hostile_params_sent_to_a_decode_leave_it_serving_token_exact(pd: PD) -> None:
    """No request takes the decode's engine down (issue 47): each hostile shape computes locally.

    A real prefill answer for the prompt, changed one way at a time
    (harness/hostile_params.py): sizes of 0 (a fingerprint TP size of 0
    once killed the engine with ``ZeroDivisionError`` inside vLLM's
    ``schedule()``), negative and huge, wrong types, a dict nested 500 deep
    (``RecursionError`` as vLLM pickled the step: a plain vLLM dies of it
    too), megabyte strings, a closed or foreign address, the decode's own
    node, a transfer its prefill never had. Each is answered as a single
    instance answers, and the decode then still loads a clean P/D request
    token-exact.

    A leg that still reads names a transfer its prefill never had: the
    prefill daemon keeps the receiver (registered from an answer) pending
    only ``[deadlines] answered`` (2 s), then fails it ``unknown_request``;
    before, each such load waited out the push's ``registered`` deadline
    (30 s) before the decode computed the prompt. Pinned by the journals,
    not by a clock: the stale leg's failure is the short deadline's on both
    sides, and no hostile transfer ended at any deadline of its own.
    """
    p, d, prefill, decode = pd
    rng = random.Random(4747)
    prompt = [rng.randrange(2, 512) for _ in range(70)]
    single = p.complete(prompt, TOKENS).token_ids
    answer = prefill_leg(p, prompt)
    shapes = hostile_legs(decode.node, f"127.0.0.1:{decode.port}", f"127.0.0.1:{free_port()}")
    took: dict[str, float] = {}

    def send(number: int) -> None:
        name, change = shapes[number]
        sent = copy.deepcopy(answer)
        # Each its own transfer: a leg that still reads claims it (a second would be a
        # duplicate). A leg that still reads names a transfer its prefill never had: its
        # load fails at the prefill daemon's answered deadline (2 s), then recomputes.
        sent["kvpushd_transfer_id"] = f"hostile-{number}"
        change(sent)
        started = time.monotonic()
        try:
            assert d.complete(prompt, TOKENS, kv_transfer_params=sent).token_ids == single, name
        except VllmServerError as exc:  # vLLM's own API refuses integers past 64 bits
            assert "HTTP 400" in str(exc) and "extra_args integers" in str(exc), (name, exc)
        took[name] = time.monotonic() - started

    with ThreadPoolExecutor(max_workers=16) as pool:  # those waits at once, not one by one
        list(pool.map(send, range(len(shapes))))
    log = d.log.read_text(errors="replace")
    assert "EngineCore encountered a fatal error" not in log
    assert "kv_transfer_params dropped 'kvpushd_fingerprint'" in log
    stale = [n for n, (name, _) in enumerate(shapes) if name == "a transfer its prefill never had"]
    print(f"the stale leg computed in {took[shapes[stale[0]][0]]:.1f} s")  # 30 s+ before
    wait_idle(prefill, decode, timeout=20)  # forgone receivers end at answered too
    # The stale leg: the prefill's pending receiver (answered) failed at the short
    # deadline, naming the transfer, and the decode's receive failed with its words.
    transfer = f"hostile-{stale[0]}"
    on_prefill = prefill.journal_events(transfer)
    assert [type(e) for e in on_prefill] == [PeerRegistered, Failed], on_prefill
    assert on_prefill[0].answered
    assert on_prefill[1].reason is Reason.UNKNOWN_REQUEST, on_prefill
    assert f"transfer {transfer}, which this prefill never had" in on_prefill[1].message
    on_decode = decode.journal_events(transfer)
    assert next(e for e in on_decode if isinstance(e, Registered)).answered
    (failed,) = [e for e in on_decode if isinstance(e, Failed)]
    assert failed.reason is Reason.UNKNOWN_REQUEST, failed
    assert "which this prefill never had" in failed.message, failed
    # No hostile transfer waited out a deadline on either daemon.
    for daemon in (prefill, decode):
        ended = _failures(daemon, "hostile-")
        assert ended, daemon.node
        assert Reason.DEADLINE_EXCEEDED not in {e.reason for e in ended}, (daemon.node, ended)
    loads_token_exact(p, d, [rng.randrange(2, 512) for _ in range(80)], TOKENS)
    p.wait_kv_usage_zero()
    d.wait_kv_usage_zero()


def _failures(daemon: Daemon, prefix: str) -> list[Failed]:
    """The Failed records of a daemon's journal whose request id starts with ``prefix``."""
    failed: list[Failed] = []

    def collect(record: Any, touched: object) -> None:
        event = record.event
        if isinstance(event, Failed) and event.request_id.startswith(prefix):
            failed.append(event)

    replay(daemon.journal, on_record=collect)
    return failed
