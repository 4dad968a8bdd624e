"""Real vLLM prefill/decode through two kvpushd daemons, token for token.

A prefill instance (KvpushdConnector, kv_producer) and a decode instance
(kv_consumer), both with host staging (``kv_buffer = "host"``: the daemons
read and write host mirrors of vLLM's caches, the connectors copy blocks
out after a prefill and in after a load), each pinned to its own core, each
beside its own daemon; the
daemons have no [[peers]]: the decode daemon dials the prefill's on demand,
at the address the prefill put in ``kv_transfer_params``. The router is
this test: it sends a prompt to the prefill instance with
``do_remote_decode`` and ``max_tokens=1``, then the same prompt to the
decode instance with the ``kv_transfer_params`` the prefill returned. The
oracle: the decode instance's greedy tokens equal a single instance's for
the same prompt (the prefill instance itself, asked without transfer
parameters: same weights), and the decode instance did not compute the
prompt itself (its external-KV prompt-token counter moved).
"""

from __future__ import annotations

import http.client
import json
import os
import random
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from daemon.journal.replay import replay
from daemon.sim.launcher import Daemon, wait_idle
from harness.vllm_router import prefill_leg, route_concurrent
from harness.vllm_servers import VllmServer, VllmServerError, kvpushd_pd
from schemas.events import Failed, Registered, Released, Trimmed, WriteDone, WriteStarted
from schemas.reasons import Reason
from statemachine.content import decode as block_hashes_of

TOKENS = 8
EXTERNAL = "vllm:prompt_tokens_by_source_total"


PD = tuple[VllmServer, VllmServer, Daemon, Daemon]


@pytest.fixture(scope="module")
def pd(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PD]:
    # Host staging on both sides (daemon/client/vllm/staging.py): vLLM's
    # cache is its own, the daemons see mirrors; every test of this module
    # proves the staging's bookkeeping too. The other modules map vLLM's
    # cache itself (kv_buffer "shared", the CPU default). The prefill's mirror
    # is a named /dev/shm file (kv_memory "file"), the decode's a memfd passed
    # by descriptor (the default, as in every other module): pushes go from
    # one kind of memory to the other.
    staged = {"kv_buffer": "host"}
    with kvpushd_pd(
        tiny_model,
        tmp_path_factory.mktemp("pd"),
        prefill_extra_config={**staged, "kv_memory": "file"},
        decode_extra_config=staged,
    ) as pair:
        yield pair
    # The connector removes its KV file at shutdown; when vLLM force-kills its
    # worker instead (it does, at times, on SIGTERM), the file outlives the
    # process and the next connector to start on the machine removes it.
    left = _kv_files()
    assert all(not os.path.exists(f"/proc/{_owner(f)}") for f in left), left
    from daemon.client.kvfile import sweep_stale_kv_files

    sweep_stale_kv_files(Path("/dev/shm"), "kvpushd-vllm-")
    assert not _kv_files()


def _kv_files() -> list[str]:
    return [f for f in os.listdir("/dev/shm") if f.startswith("kvpushd-vllm-")]


def _owner(name: str) -> int:
    return int(name.removeprefix("kvpushd-vllm-").split("-", 1)[0])


def _pd(p: VllmServer, d: VllmServer, prompt: list[int], params: dict | None = None) -> list[int]:
    """One request through the pair, as the router does; the decode side's tokens."""
    first = p.complete(prompt, 1, kv_transfer_params={"do_remote_decode": True})
    sent = first.raw.get("kv_transfer_params")
    assert sent and sent["kvpushd_transfer_id"] and sent["kvpushd_node"] == "prefill", sent
    return d.complete(prompt, TOKENS, kv_transfer_params=params or sent).token_ids


def test_decode_tokens_equal_a_single_instance_and_the_prompt_came_from_the_prefill(
    pd: PD,
) -> None:
    p, d, prefill, decode = pd
    rng = random.Random(3)
    written_before = prefill.status()["counters"]["writes_done"]
    for length in (33, 64, 95, 200):
        prompt = [rng.randrange(2, 512) for _ in range(length)]
        single = p.complete(prompt, TOKENS).token_ids
        before = d.metrics().total(EXTERNAL, source="external_kv_transfer")
        assert _pd(p, d, prompt) == single, length
        loaded = d.metrics().total(EXTERNAL, source="external_kv_transfer") - before
        # The decode instance loaded the prompt instead of computing it.
        assert loaded >= length - 1, (length, loaded)
    wait_idle(prefill, decode)
    assert prefill.status()["counters"]["writes_done"] - written_before == 4
    (link,) = decode.status()["peers"]
    assert (link["node"], link["on_demand"], link["up"]) == ("prefill", True, True)
    for server in (p, d):
        metrics = server.metrics()
        assert metrics.total("vllm:num_requests_running") == 0, server.name
        assert metrics.total("vllm:num_requests_waiting") == 0, server.name


@pytest.mark.parametrize("b_length", [96, 64], ids=["same length", "other length"])
def test_kv_of_another_prompt_is_never_loaded_the_decode_computes_its_own(
    pd: PD, b_length: int
) -> None:
    """A router that changed the prompt between the legs: B decoded with A's params.

    Before prompt identity this served wrong tokens (it was the oracle's
    negative control: B's tokens changed). The prefill's params now carry
    A's length and digest; the decode side sees B is not A and computes B
    itself, and A's push ends at once: an empty receiver that says why,
    which the prefill daemon refuses (nothing written, both journals say why).
    """
    p, d, prefill, decode = pd
    rng = random.Random(4)
    a = [rng.randrange(2, 512) for _ in range(96)]
    b = [rng.randrange(2, 512) for _ in range(b_length)]
    single_a, single_b = p.complete(a, TOKENS).token_ids, p.complete(b, TOKENS).token_ids
    assert single_a != single_b  # the oracle tells the two prompts apart
    sent_a = prefill_leg(p, a)
    assert sent_a["kvpushd_prompt_len"] == 96 and len(sent_a["kvpushd_prompt_digest"]) == 32
    before = d.metrics().total(EXTERNAL, source="external_kv_transfer")
    assert d.complete(b, TOKENS, kv_transfer_params=sent_a).token_ids == single_b
    assert d.metrics().total(EXTERNAL, source="external_kv_transfer") == before
    wait_idle(prefill, decode, timeout=10)  # well before the push's 30 s deadline
    for daemon in (prefill, decode):
        events = daemon.journal_events(sent_a["kvpushd_transfer_id"])
        assert not [e for e in events if isinstance(e, WriteStarted)], events  # no byte of A
        (failed,) = [e for e in events if isinstance(e, Failed)]
        assert failed.reason is Reason.CONTENT_MISMATCH, failed
        assert "not loaded: the prefill computed" in failed.message, failed
    assert "computing the prompt here" in d.log.read_text(errors="replace")


def test_the_same_transfer_sent_twice_loads_once_and_never_hangs(pd: PD) -> None:
    """A client that retries or hedges: the same params at once, and again after.

    One request loads the KV; the others compute the prompt themselves. Every
    answer equals a single instance's, none waits forever, both daemons end
    idle and the decode instance holds no request.
    """
    p, d, prefill, decode = pd
    rng = random.Random(9)
    prompt = [rng.randrange(2, 512) for _ in range(128)]
    single = p.complete(prompt, TOKENS).token_ids
    sent = prefill_leg(p, prompt)
    before = d.metrics().total(EXTERNAL, source="external_kv_transfer")
    with ThreadPoolExecutor(max_workers=2) as pool:
        twice = list(
            pool.map(
                lambda _: d.complete(prompt, TOKENS, kv_transfer_params=sent, timeout_s=60),
                range(2),
            )
        )
    assert [c.token_ids for c in twice] == [single, single]
    again = d.complete(prompt, TOKENS, kv_transfer_params=sent, timeout_s=60)
    assert again.token_ids == single
    loaded = d.metrics().total(EXTERNAL, source="external_kv_transfer") - before
    assert len(prompt) - 1 <= loaded <= len(prompt), loaded  # one load, not two
    wait_idle(prefill, decode)
    registered = [
        e for e in decode.journal_events(sent["kvpushd_transfer_id"]) if isinstance(e, Registered)
    ]
    assert len(registered) == 1, registered
    metrics = d.metrics()
    assert metrics.total("vllm:num_requests_running") == 0
    assert metrics.total("vllm:num_requests_waiting") == 0


def test_a_prefill_request_aborted_by_its_client_registers_no_push(pd: PD) -> None:
    """A prefill leg whose client went away: nobody needs its KV, nothing is pushed."""
    p, _, prefill, _ = pd
    rng = random.Random(10)
    before = _registered_count(prefill)
    prompt = [rng.randrange(2, 512) for _ in range(64)]
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": 900,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "kv_transfer_params": {"do_remote_decode": True},
    }
    conn = http.client.HTTPConnection("127.0.0.1", p.port, timeout=30)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    assert response.readline()  # generating: the prompt is computed, the client goes
    conn.close()
    deadline = time.monotonic() + 20
    while p.metrics().total("vllm:num_requests_running"):
        assert time.monotonic() < deadline, "the aborted request still runs"
        time.sleep(0.1)
    time.sleep(0.5)  # a push, had one been posted, reaches the daemon by now
    assert _registered_count(prefill) == before
    assert prefill.status()["live"] == 0


def _registered_count(daemon: Daemon) -> int:
    out: list[object] = []
    replay(daemon.journal, on_record=lambda record, _: out.append(record.event))
    return sum(isinstance(e, Registered) for e in out)


def test_a_decode_prefix_hit_moves_only_the_tail_blocks(pd: PD) -> None:
    """The decode instance already holds the prompt's first blocks: only the rest move.

    Its connector registers the blocks vLLM still has to fill; the prefill
    daemon pairs them with the prefill's last blocks (the tail trim), and the
    tokens still equal a single instance's.
    """
    p, d, prefill, decode = pd
    rng = random.Random(5)
    shared = [rng.randrange(2, 512) for _ in range(64)]
    d.complete([*shared, *(rng.randrange(2, 512) for _ in range(10))], 1)  # caches 2 blocks
    prompt = [*shared, *(rng.randrange(2, 512) for _ in range(40))]  # 104 tokens: 4 blocks
    single = p.complete(prompt, TOKENS).token_ids
    first = p.complete(prompt, 1, kv_transfer_params={"do_remote_decode": True})
    sent = first.raw["kv_transfer_params"]
    assert d.complete(prompt, TOKENS, kv_transfer_params=sent).token_ids == single
    wait_idle(prefill, decode)
    transfer = sent["kvpushd_transfer_id"]
    (registered,) = [e for e in decode.journal_events(transfer) if isinstance(e, Registered)]
    (trimmed,) = [e for e in prefill.journal_events(transfer) if isinstance(e, Trimmed)]
    assert [len(ids) for ids in registered.blocks] == [2]  # the two blocks after the hit
    assert (trimmed.src_before, trimmed.dst_before) == ((4,), (2,))
    assert trimmed.dst == registered.blocks


def test_a_full_decode_prefix_hit_moves_only_the_block_of_the_last_token(pd: PD) -> None:
    """The decode instance holds every full block of the prompt already.

    vLLM computes a prompt's last token itself, so the block that holds it
    is all that is left to fill: one block moves (the prefill's last), the
    daemon trims the three before it, and the tokens still equal.
    """
    p, d, prefill, decode = pd
    rng = random.Random(12)
    prompt = [rng.randrange(2, 512) for _ in range(97)]  # 3 full blocks and one token
    single = p.complete(prompt, TOKENS).token_ids
    d.complete(prompt, 1)  # caches the 3 full blocks on the decode instance
    first = p.complete(prompt, 1, kv_transfer_params={"do_remote_decode": True})
    sent = first.raw["kv_transfer_params"]
    assert d.complete(prompt, TOKENS, kv_transfer_params=sent).token_ids == single
    wait_idle(prefill, decode)
    transfer = sent["kvpushd_transfer_id"]
    (registered,) = [e for e in decode.journal_events(transfer) if isinstance(e, Registered)]
    (trimmed,) = [e for e in prefill.journal_events(transfer) if isinstance(e, Trimmed)]
    assert [len(ids) for ids in registered.blocks] == [1]
    assert (trimmed.src_before, trimmed.dst_before) == ((4,), (1,))
    assert trimmed.dst == registered.blocks


def test_thirty_two_concurrent_requests_with_shared_prefixes_are_token_exact(pd: PD) -> None:
    p, d, prefill, decode = pd
    rng = random.Random(6)
    prefixes = [[rng.randrange(2, 512) for _ in range(32 * k)] for k in (1, 2, 3)]
    prompts = [
        [*prefixes[i % 3], *(rng.randrange(2, 512) for _ in range(rng.randrange(1, 70)))]
        for i in range(32)
    ]
    singles = [p.complete(prompt, TOKENS).token_ids for prompt in prompts]
    with ThreadPoolExecutor(max_workers=32) as pool:
        got = list(pool.map(lambda prompt: _pd(p, d, prompt), prompts))
    wrong = [i for i, (a, b) in enumerate(zip(got, singles, strict=True)) if a != b]
    assert wrong == []
    wait_idle(prefill, decode)


def test_the_connectors_stats_reach_vllms_metrics(pd: PD) -> None:
    """Transfers ended by outcome, bytes loaded, load time, and requests that loaded nothing."""
    p, d, prefill, decode = pd
    rng = random.Random(12)

    def ended(server: VllmServer, outcome: str) -> float:
        return server.metrics().total("vllm:kvpushd_transfers_ended_total", outcome=outcome)

    def not_loaded(why: str) -> float:
        return d.metrics().total("vllm:kvpushd_not_loaded_total", why=why)

    def staged(server: VllmServer, direction: str) -> float:
        return server.metrics().total("vllm:kvpushd_staged_bytes_total", direction=direction)

    def checks(result: str) -> float:
        return d.metrics().total("vllm:kvpushd_kv_checks_total", result=result)

    pushed, loaded, by_prompt = ended(p, "pushed"), ended(d, "loaded"), not_loaded("prompt")
    refused = ended(p, "failed:content_mismatch")
    out, into = staged(p, "out"), staged(d, "in")
    nbytes = d.metrics().total("vllm:kvpushd_loaded_bytes_total")
    timed = d.metrics().total("vllm:kvpushd_load_seconds_count")
    agreed, mismatched = checks("agree"), checks("kv_mismatch")
    differences = d.metrics().total("vllm:kvpushd_kv_check_difference_count")
    prompt = [rng.randrange(2, 512) for _ in range(100)]
    single = p.complete(prompt, TOKENS).token_ids
    sent = prefill_leg(p, prompt)
    assert d.complete(prompt, TOKENS, kv_transfer_params=sent).token_ids == single
    other = [rng.randrange(2, 512) for _ in range(100)]
    d.complete(other, TOKENS, kv_transfer_params=prefill_leg(p, prompt))  # another prompt
    wait_idle(prefill, decode)
    deadline = time.monotonic() + 15  # stats reach /metrics with the engine's next steps
    # The second push is refused: the decode's receiver says it loads nothing.
    while (
        ended(p, "pushed") < pushed + 1
        or ended(p, "failed:content_mismatch") < refused + 1
        or not_loaded("prompt") < by_prompt + 1
        or checks("agree") < agreed + 1
    ):
        assert time.monotonic() < deadline, "the connector's stats did not reach /metrics"
        time.sleep(0.2)
    assert ended(d, "loaded") == loaded + 1
    # The load was checked by the decode's own K/V of the last token, and agreed.
    assert checks("agree") == agreed + 1 and checks("kv_mismatch") == mismatched
    assert d.metrics().total("vllm:kvpushd_kv_check_difference_count") == differences + 1
    assert d.metrics().total("vllm:kvpushd_load_seconds_count") == timed + 1
    # The bytes the prefill daemon journaled for the write. (Not the decode's
    # record: a receiver that hears the data land before the pusher's
    # Writing goes straight to done, with no WriteStarted of its own.)
    (started,) = [
        e
        for e in prefill.journal_events(sent["kvpushd_transfer_id"])
        if isinstance(e, WriteStarted)
    ]
    assert d.metrics().total("vllm:kvpushd_loaded_bytes_total") - nbytes == started.nbytes
    # Host staging copied the load's blocks mirror -> cache once, and each of
    # the prefill's two pushes (same prompt) cache -> mirror. (At least: vLLM
    # publishes a worker's stats with a later step of its engine, so copies of
    # this module's earlier pushes may reach /metrics in this window too.)
    assert staged(d, "in") - into == started.nbytes
    assert staged(p, "out") - out >= 2 * started.nbytes
    assert staged(p, "in") == 0 and staged(d, "out") == 0


def test_both_sides_say_at_start_up_where_their_host_mirror_is(pd: PD) -> None:
    p, d, _, _ = pd
    for server, where in ((p, " in /dev/shm/kvpushd-vllm-"), (d, " in a sealed memfd (")):
        (line,) = [ln for ln in server.log.read_text().splitlines() if "host staging:" in ln]
        assert "-byte mirror of 1 KV storage(s) on cpu" + where in line, line


def test_each_daemon_shows_how_its_engines_memory_came_and_only_a_file_mirror_is_a_file(
    pd: PD,
) -> None:
    p, d, prefill, decode = pd
    (p_line,) = prefill.status()["engines"].values()
    (d_line,) = decode.status()["engines"].values()
    assert (p_line["memory"], p_line["kv"]) == ("file", "staging"), p_line
    assert (d_line["memory"], d_line["kv"]) == ("descriptor", "staging"), d_line
    assert "kv_memory = 'file'" in p_line["memory_why"], p_line
    assert "sealed memfd passed by descriptor" in d_line["memory_why"], d_line
    assert "host mirror" in d_line["memory_why"], d_line
    # The prefill's mirror file is the only kvpushd file; the decode has none.
    owners = {_owner(name) for name in _kv_files()}
    assert len(owners) == 1 and owners <= set(p.pids()), (owners, p.pids(), d.pids())


def test_both_legs_at_once_under_the_routers_transfer_id_are_token_exact(pd: PD) -> None:
    """vLLM's push-mode proxy's contract: both legs at once, a router-made ``transfer_id``.

    The decode leg carries no kvpushd field, only the proxy's (the prefill
    daemon's node as ``remote_engine_id``, its peer address as
    ``remote_host``/``remote_port``, the prefill's TP and PP sizes): the
    decode allocates and registers while the prefill computes. Its tokens
    equal a single instance's, the external-KV counter moved by the
    prompt, and both journals show the router's transfer id written and
    released, each side having named its blocks' content hashes.
    """
    p, d, prefill, decode = pd
    rng = random.Random(71)
    for length in (40, 150, 300):
        prompt = [rng.randrange(2, 512) for _ in range(length)]
        single = p.complete(prompt, TOKENS).token_ids
        before = d.metrics().total(EXTERNAL, source="external_kv_transfer")
        routed = route_concurrent(
            p, d, prompt, TOKENS, prefill_node=prefill.node,
            prefill_address=f"127.0.0.1:{prefill.port}",
        )  # fmt: skip
        assert routed.token_ids == single, length
        loaded = d.metrics().total(EXTERNAL, source="external_kv_transfer") - before
        assert loaded >= length - 1, (length, loaded)
        wait_idle(prefill, decode)
        transfer = routed.params["transfer_id"]
        assert transfer.startswith("xfer-")
        for daemon in (prefill, decode):
            events = daemon.journal_events(transfer)
            kinds = [type(e) for e in events]
            assert WriteDone in kinds and kinds[-1] is Released, (daemon.node, kinds)
            (registered,) = [e for e in events if isinstance(e, Registered)]
            # Each side named every block it registered with its content hash.
            hashes = block_hashes_of(transfer, registered.content)
            assert hashes is not None and hashes[0] is not None, registered
            assert len(hashes[0].hashes) == len(registered.blocks[0]), registered


def test_both_legs_at_once_with_two_prompts_never_load_the_other_prompts_kv(pd: PD) -> None:
    """A router that sent the two legs different prompts under one transfer id.

    The decode reported external tokens before the prefill had answered (it
    had nothing to compare), so only the daemons can tell: the prefill
    daemon refuses the pairing with ``content_mismatch``, nothing is
    written, and the decode request fails (the ``fail`` policy) instead of
    decoding the other prompt's KV.
    """
    p, d, prefill, decode = pd
    rng = random.Random(72)
    prompt, other = ([rng.randrange(2, 512) for _ in range(96)] for _ in range(2))
    # Earlier tests' refused pairings (a receiver that loads nothing says so).
    earlier = _refused(decode)
    with pytest.raises(VllmServerError):
        route_concurrent(
            p, d, prompt, TOKENS, prefill_node=prefill.node,
            prefill_address=f"127.0.0.1:{prefill.port}", decode_prompt=other,
        )  # fmt: skip
    wait_idle(prefill, decode)
    transfers = _refused(decode) - earlier
    assert len(transfers) == 1, transfers
    (transfer,) = transfers
    for daemon in (prefill, decode):
        events = daemon.journal_events(transfer)
        assert not [e for e in events if isinstance(e, WriteStarted)], events
        (failed,) = [e for e in events if isinstance(e, Failed)]
        assert failed.reason is Reason.CONTENT_MISMATCH, events
    metrics = d.metrics()
    assert metrics.total("vllm:num_requests_running") == 0
    assert metrics.total("vllm:num_requests_waiting") == 0


def _refused(daemon: Daemon) -> set[str]:
    """The transfers whose pairing ``daemon``'s journal says was refused (content_mismatch)."""
    return {
        e.request_id
        for e in _all_events(daemon)
        if isinstance(e, Failed) and e.reason is Reason.CONTENT_MISMATCH
    }


def _all_events(daemon: Daemon) -> list[object]:
    out: list[object] = []
    replay(daemon.journal, on_record=lambda record, _: out.append(record.event))
    return out
