"""A live daemon's lost answer is not a failure: the connector waits for its word.

The decode daemon accepts a receiver registration and then its connection
to the decode engine ends before the reply leaves (the failpoint
``engine.accepted=error@1``: what a reset connection does). The prefill
daemon's write is held 1.5 s before it is posted, so it lands well after.

Before: the connector took the lost connection for a dead daemon and gave
the blocks back at once (load errors: vLLM recomputed the prompt), while the
write could still land in them. Now it reconnects, sees the same daemon
process (its boot id), asks again (a duplicate: the registration holds),
and waits: the write lands in blocks still held, the prompt's KV is loaded
(the external-KV counter moves), and the tokens equal a single instance's.

The prefill daemon's disk is slow too: every fdatasync of its group commit
stalls 2 s, so every pusher registration and kv_ready is answered late.
The connector's registrations have no time limit while the connection
lives (issue 21, item 3): a slow answer is waited for, never taken for a
refusal that would hand the blocks back while the write may still read
them. The push lands, token-exact, and nothing fails.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from daemon.sim.launcher import Daemon, wait_idle
from harness.vllm_router import prefill_leg
from harness.vllm_servers import EXTERNAL_TOKENS, VllmServer, kvpushd_pd
from schemas.events import Failed, Refused, Registered, WriteDone
from schemas.reasons import Reason

TOKENS = 8
PD = tuple[VllmServer, VllmServer, Daemon, Daemon]


@pytest.fixture(scope="module")
def lossy_pd(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PD]:
    with kvpushd_pd(
        tiny_model,
        tmp_path_factory.mktemp("pd-lost-answer"),
        # The prefill daemon's disk stalls 2 s on every group commit's fdatasync.
        prefill_env={"KVPUSHD_FAILPOINTS": "nixl.post=sleep:1.5,journal.sync_fd=sleep:2"},
        decode_env={"KVPUSHD_FAILPOINTS": "engine.accepted=error@1"},
        kv_load_failure_policy="recompute",
    ) as pd:
        yield pd


def test_a_registration_whose_answer_was_lost_still_loads_its_kv(lossy_pd: PD) -> None:
    p, d, prefill, decode = lossy_pd
    rng = random.Random(41)
    prompt = [rng.randrange(2, 512) for _ in range(128)]
    single = p.complete(prompt, TOKENS).token_ids
    sent = prefill_leg(p, prompt)
    before = d.metrics().total(EXTERNAL_TOKENS, source="external_kv_transfer")
    assert d.complete(prompt, TOKENS, kv_transfer_params=sent, timeout_s=60).token_ids == single
    loaded = d.metrics().total(EXTERNAL_TOKENS, source="external_kv_transfer") - before
    assert loaded >= len(prompt) - 1, loaded  # loaded, not recomputed
    wait_idle(prefill, decode)
    events = decode.journal_events(sent["kvpushd_transfer_id"])
    kinds = [type(e) for e in events]
    assert kinds.count(Registered) == 1 and WriteDone in kinds, kinds
    # Asked again on the new connection: refused as a duplicate, so it was there.
    refusals = [e.reason for e in events if isinstance(e, Refused)]
    assert refusals == [Reason.DUPLICATE_REQUEST], refusals
    log = d.log.read_text(errors="replace")
    assert "its transfers go on" in log and "Recovered from KV load failure" not in log
    # Later requests on the same connector are exact too.
    for length in (40, 150):
        other = [rng.randrange(2, 512) for _ in range(length)]
        want = p.complete(other, TOKENS).token_ids
        params = prefill_leg(p, other)
        assert d.complete(other, TOKENS, kv_transfer_params=params).token_ids == want
    wait_idle(prefill, decode)


def test_a_stalled_prefill_disk_delays_the_push_and_frees_nothing_early(lossy_pd: PD) -> None:
    p, d, prefill, decode = lossy_pd
    rng = random.Random(42)
    prompt = [rng.randrange(2, 512) for _ in range(96)]
    single = p.complete(prompt, TOKENS).token_ids
    started = time.monotonic()
    sent = prefill_leg(p, prompt)
    before = d.metrics().total(EXTERNAL_TOKENS, source="external_kv_transfer")
    assert d.complete(prompt, TOKENS, kv_transfer_params=sent, timeout_s=60).token_ids == single
    # The push waited on the stalled disk (a registration's record is durable first).
    assert time.monotonic() - started > 2.0
    loaded = d.metrics().total(EXTERNAL_TOKENS, source="external_kv_transfer") - before
    assert loaded >= len(prompt) - 1, loaded
    wait_idle(prefill, decode)
    transfer = sent["kvpushd_transfer_id"]
    for daemon in (prefill, decode):
        kinds = [type(e) for e in daemon.journal_events(transfer)]
        assert WriteDone in kinds and Failed not in kinds and Refused not in kinds, kinds
    log = p.log.read_text(errors="replace")
    assert "not registered" not in log, "the prefill connector gave a push up"
