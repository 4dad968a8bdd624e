"""A decode request queued for blocks longer than the push's deadline still loads its KV.

Issue 21, item 6. The prefill daemon's ``registered`` deadline is 1 s: a
push whose receiver has not registered by then fails. The decode server has
a KV cache of 33 blocks (a 1024-token context needs 32), and one long
request (a 200-token prompt generating 800 tokens) holds them for 1.5 s or
more (measured: 1.7 s on a quiet machine, so a 2 s deadline was not always
outlasted); the P/D request's 900-token prompt needs 29 blocks, so it waits in
vLLM's queue until that one finishes. While it waits, the decode connector
holds the push every 0.5 s (``hold_every_s``), and the prefill daemon
journals each ``Held``. The KV still moves: the decode's tokens equal a
single instance's, its external-KV counter moved by the prompt, and no
push failed. Before holds, every such request's push ran out at its
deadline and the decode recomputed (or, with the ``fail`` policy used
here, failed the request).
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from daemon.sim.launcher import Daemon, wait_idle
from harness.vllm_router import prefill_leg
from harness.vllm_servers import EXTERNAL_TOKENS, VllmServer, kvpushd_pd
from schemas.events import Failed, Held, WriteDone

PD = tuple[VllmServer, VllmServer, Daemon, Daemon]
# 33 blocks of 32 tokens x 2 layers x 2 KV heads x 64 x (K and V) x 4 bytes.
BLOCK_BYTES = 32 * 2 * 2 * 64 * 2 * 4
TOKENS = 8


@pytest.fixture(scope="module")
def queued_pd(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PD]:
    with kvpushd_pd(
        tiny_model,
        tmp_path_factory.mktemp("pd-hold"),
        prefill_daemon_extra="[deadlines]\nregistered = 1.0\nheld = 60.0",
        decode_kv_cache_bytes=33 * BLOCK_BYTES,
        decode_extra_config={"hold_every_s": 0.5},
    ) as pd:
        yield pd


def test_a_decode_request_queued_past_the_push_deadline_still_loads_the_prefills_kv(
    queued_pd: PD,
) -> None:
    p, d, prefill, decode = queued_pd
    rng = random.Random(61)
    long_prompt = [rng.randrange(2, 512) for _ in range(200)]
    prompt = [rng.randrange(2, 512) for _ in range(900)]
    single = p.complete(prompt, TOKENS).token_ids
    occupier = threading.Thread(target=d.complete, args=(long_prompt, 800), daemon=True)
    occupier.start()
    time.sleep(0.5)  # the long request holds its blocks and keeps taking more
    started = time.monotonic()
    sent = prefill_leg(p, prompt)
    before = d.metrics().total(EXTERNAL_TOKENS, source="external_kv_transfer")
    answer = d.complete(prompt, TOKENS, kv_transfer_params=sent, timeout_s=180)
    waited = time.monotonic() - started
    occupier.join(timeout=180)
    assert answer.token_ids == single
    loaded = d.metrics().total(EXTERNAL_TOKENS, source="external_kv_transfer") - before
    assert loaded >= len(prompt) - 1, loaded
    wait_idle(prefill, decode)
    transfer = sent["kvpushd_transfer_id"]
    events = prefill.journal_events(transfer)
    held = [e for e in events if isinstance(e, Held)]
    # It queued past the push's deadline, and the holds carried it over.
    assert waited > 1.0 and held, (waited, events)
    assert WriteDone in {type(e) for e in events}, events
    for daemon in (prefill, decode):
        assert not [e for e in daemon.journal_events(transfer) if isinstance(e, Failed)]
