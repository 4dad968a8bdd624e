"""Real vLLM P/D across hosts: each server beside its daemon on a host of its own.

Three network namespaces on one bridge (daemon/sim/hosts.py): ``prefill``
(its vLLM server and daemon), ``decode`` (the same), and ``router``, where
this test's HTTP calls come from. The daemons reach each other only over
the bridge, UCX limited to TCP; the decode daemon dials the prefill's at the
address the prefill put in ``kv_transfer_params``. The decode runs with
``kv_load_failure_policy=recompute``.

- Token-exact against the prefill instance alone, the prompt's KV loaded
  from the other host (vLLM's external-KV counter moves).
- A partition mid-transfer: the prefill daemon holds each write 1.5 s before
  posting it (failpoint), the two hosts stop reaching each other (the
  router still reaches both) once the decode daemon has journaled the write
  as started; the decode daemon hears
  nothing for ``peer_ttl_s``, fences the prefill and fails the load, vLLM
  recomputes the prompt: the same tokens. Once the link is back, the next
  request loads over it again.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from daemon.sim.hosts import Hosts
from daemon.sim.launcher import Daemon
from harness.vllm_router import prefill_leg
from harness.vllm_servers import VllmServer, kvpushd_pd
from schemas.reasons import Reason

TOKENS = 8
EXTERNAL = "vllm:prompt_tokens_by_source_total"
PD = tuple[Hosts, VllmServer, VllmServer, Daemon, Daemon]


@pytest.fixture(scope="module")
def across(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PD]:
    with (
        Hosts(["router", "prefill", "decode"]) as hosts,
        kvpushd_pd(
            tiny_model,
            tmp_path_factory.mktemp("pd-hosts"),
            hosts=hosts,
            # Each write waits before it is posted: a window to cut the link in.
            prefill_env={"KVPUSHD_FAILPOINTS": "nixl.post=sleep:1.5"},
            kv_load_failure_policy="recompute",
        ) as (p, d, prefill, decode),
    ):
        yield hosts, p, d, prefill, decode


def _external(d: VllmServer) -> float:
    return d.metrics().total(EXTERNAL, source="external_kv_transfer")


def _names(events: list) -> list[str]:
    return [type(e).__name__ for e in events]


def test_the_decode_host_loads_the_prefill_hosts_kv_token_exact(across: PD) -> None:
    _, p, d, prefill, decode = across
    rng = random.Random(23)
    for length in (40, 150):
        prompt = [rng.randrange(2, 512) for _ in range(length)]
        single = p.complete(prompt, TOKENS).token_ids
        sent = prefill_leg(p, prompt)
        assert sent["kvpushd_address"] == prefill.address  # the prefill host's, not loopback
        before = _external(d)
        assert d.complete(prompt, TOKENS, kv_transfer_params=sent).token_ids == single
        assert _external(d) - before >= length - 32  # the prompt came over the network
        events = decode.journal_events(sent["kvpushd_transfer_id"])
        assert "WriteDone" in _names(events), _names(events)
    (link,) = [peer for peer in decode.status()["peers"] if peer["node"] == "prefill"]
    assert link["up"] and link["address"] == prefill.address


def test_a_partition_mid_transfer_is_a_load_error_that_recompute_turns_into_the_same_tokens(
    across: PD,
) -> None:
    hosts, p, d, prefill, decode = across
    rng = random.Random(29)
    prompt = [rng.randrange(2, 512) for _ in range(140)]
    single = p.complete(prompt, TOKENS).token_ids
    sent = prefill_leg(p, prompt)
    transfer = sent["kvpushd_transfer_id"]
    with ThreadPoolExecutor(1) as pool:
        decoding = pool.submit(d.complete, prompt, TOKENS, kv_transfer_params=sent)
        deadline = time.monotonic() + 30
        while "WriteStarted" not in _names(decode.journal_events(transfer)):
            assert time.monotonic() < deadline and not decoding.done()
            time.sleep(0.02)
        # Between the two hosts only: the router still reaches the decode server.
        hosts.partition("prefill", "decode")
        try:
            assert decoding.result(timeout=60).token_ids == single  # a load error, recomputed
        finally:
            hosts.heal("prefill", "decode")
    events = decode.journal_events(transfer)
    assert _names(events)[:3] == ["Registered", "WriteStarted", "Failed"], _names(events)
    assert events[2].reason is Reason.PEER_DEAD
    # The prefill daemon lost the decode too: its share failed, its blocks went back.
    deadline = time.monotonic() + 30
    while prefill.status()["live"] or decode.status()["live"]:
        assert time.monotonic() < deadline, (prefill.status()["requests"], decode.status())
        time.sleep(0.1)
    assert "Failed" in _names(prefill.journal_events(transfer))
    # The link comes back (the decode daemon dials again on demand) and serves.
    other = [rng.randrange(2, 512) for _ in range(100)]
    single = p.complete(other, TOKENS).token_ids
    deadline = time.monotonic() + 30
    while True:
        before = _external(d)
        got = d.complete(other, TOKENS, kv_transfer_params=prefill_leg(p, other)).token_ids
        assert got == single
        if _external(d) > before:
            break  # loaded from the prefill host again
        assert time.monotonic() < deadline, "the hosts never served a load again"
        time.sleep(0.5)
