"""Real vLLM P/D with tensor-parallel ranks through kvpushd.

Measured before: a TP 2 prefill and a TP 2 decode failed every request
(each rank registered the same transfer id; the pairs that formed were one
rank's heads into another rank's blocks). Now each rank's worker is its own
engine and pushes its share of a transfer under its own name
(``T@tp<rank>``) to the decode rank of the same index, which holds the same
KV heads; vLLM finishes a load only when every rank reported it.

The oracle: the decode instance's greedy tokens equal a single instance's
(the TP 2 prefill instance asked without transfer parameters: same weights,
same TP), the external-KV counter moved, and both journals show every rank's
pair written.

A TP 2 prefill feeds a TP 1 decode: each prefill rank's one KV head goes
into the head slice of the decode's blocks that holds it (a slice engine
per head), with ``verify = "all"`` checking every written slice end to end.
The oracle there: the decode's tokens equal the TP 2 instance's alone (a
single TP 2 instance gives exactly the TP 1 tokens on this model, measured:
the float sums TP changes do not move its greedy tokens; asking the decode
instance itself would make the prompt a local prefix hit), the external-KV
counter moved by the prompt, and both journals show both ranks' shares
written and verified. The negative control plants a mis-mapping (each
prefill rank's receiver on the other rank's slice): the prefill daemon
refuses both pairings by the heads they name, nothing is written, and the
decode computes the prompt. A TP 1 prefill cannot feed a TP 2 decode (one
prefill rank would write into two decode ranks): the decode computes the
prompt, and the prefill daemon refuses the pairing by the heads.

Every rank of an instance runs on that instance's one core (the CPU build
runs TP over gloo with a shared-memory all-reduce).
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from daemon.cli import main
from daemon.sim.launcher import Daemon, free_port, wait_idle
from daemon.sim.vllm_router import prefill_leg
from daemon.sim.vllm_servers import (
    EXTERNAL_TOKENS,
    VllmServer,
    kvpushd_connector_config,
    kvpushd_pd,
    remove_vllm_shm_segments,
    running,
    vllm_shm_segments,
)
from schemas.events import Failed, Refused, Registered, Released, Trimmed, WriteDone
from schemas.reasons import Reason

TOKENS = 8
PD = tuple[VllmServer, VllmServer, Daemon, Daemon]


@pytest.fixture(scope="module")
def tp2_pd(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PD]:
    with kvpushd_pd(tiny_model, tmp_path_factory.mktemp("pd-tp2"), prefill_tp=2, decode_tp=2) as pd:
        yield pd


def test_tp2_to_tp2_is_token_exact_and_every_rank_pair_is_written(tp2_pd: PD, capsys) -> None:
    p, d, prefill, decode = tp2_pd
    rng = random.Random(21)
    for length in (40, 96, 200):
        prompt = [rng.randrange(2, 512) for _ in range(length)]
        single = p.complete(prompt, TOKENS).token_ids
        sent = prefill_leg(p, prompt)
        assert sent["kvpushd_fingerprint"]["tp_size"] == 2
        before = d.metrics().total(EXTERNAL_TOKENS, source="external_kv_transfer")
        assert d.complete(prompt, TOKENS, kv_transfer_params=sent).token_ids == single, length
        loaded = d.metrics().total(EXTERNAL_TOKENS, source="external_kv_transfer") - before
        assert loaded >= length - 1, (length, loaded)
        wait_idle(prefill, decode)
        transfer = sent["kvpushd_transfer_id"]
        for daemon in (prefill, decode):
            for rank in (0, 1):
                kinds = [type(e) for e in daemon.journal_events(f"{transfer}@tp{rank}")]
                assert WriteDone in kinds and kinds[-1] is Released, (daemon.node, rank, kinds)
            # The bare transfer id names no request: only the ranks' shares do.
            assert daemon.journal_events(transfer) == []
        # The postmortem asked about the transfer shows every rank's share, both sides.
        capsys.readouterr()
        journals = [str(prefill.journal), str(decode.journal)]
        assert main(["journal", "timeline", *journals, "--request", transfer]) == 0
        shown = capsys.readouterr().out
        assert f"{transfer}@tp0" in shown and f"{transfer}@tp1" in shown, shown
    for daemon in (prefill, decode):
        engines = daemon.status()["engines"]
        assert sorted(e.rsplit("-", 1)[-1] for e in engines) == ["tp0", "tp1"], engines
        assert {e["fingerprint"]["tp_size"] for e in engines.values()} == {2}
    for server in (p, d):
        metrics = server.metrics()
        assert metrics.total("vllm:num_requests_running") == 0, server.name
        assert metrics.total("vllm:num_requests_waiting") == 0, server.name


def test_tp2_decode_prefix_hit_moves_only_the_tail_blocks_on_every_rank(tp2_pd: PD) -> None:
    p, d, prefill, decode = tp2_pd
    rng = random.Random(22)
    shared = [rng.randrange(2, 512) for _ in range(64)]
    d.complete([*shared, *(rng.randrange(2, 512) for _ in range(10))], 1)  # caches 2 blocks
    prompt = [*shared, *(rng.randrange(2, 512) for _ in range(40))]  # 104 tokens: 4 blocks
    single = p.complete(prompt, TOKENS).token_ids
    sent = prefill_leg(p, prompt)
    assert d.complete(prompt, TOKENS, kv_transfer_params=sent).token_ids == single
    wait_idle(prefill, decode)
    for rank in (0, 1):
        share = f"{sent['kvpushd_transfer_id']}@tp{rank}"
        (registered,) = [e for e in decode.journal_events(share) if isinstance(e, Registered)]
        (trimmed,) = [e for e in prefill.journal_events(share) if isinstance(e, Trimmed)]
        assert [len(ids) for ids in registered.blocks] == [2], rank
        assert (trimmed.src_before, trimmed.dst_before) == ((4,), (2,)), rank
        assert trimmed.dst == registered.blocks


# ---------------------------------------------------- different TP sizes

# The integrity check reads every written slice back on both sides.
VERIFY_ALL = '[integrity]\nverify = "all"'


@pytest.fixture(scope="module")
def tp2_and_tp1(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[tuple[VllmServer, Daemon], tuple[VllmServer, Daemon]]]:
    """A TP 2 and a TP 1 instance, each kv_both beside its own daemon: either may prefill.

    The TP 1 instance's first load from the TP 2 one is mis-mapped on
    purpose (the negative control, at the start of the one test that loads
    that way).
    """
    workdir = tmp_path_factory.mktemp("pd-tp-mixed")
    cores = sorted(os.sched_getaffinity(0))
    daemons = [
        Daemon(name, workdir, free_port(), extra=VERIFY_ALL).start() for name in ("two", "one")
    ]
    servers = [
        VllmServer(
            name.upper(),
            tiny_model,
            workdir,
            core=core,
            tp=tp,
            extra_args=[
                "--kv-transfer-config",
                # A failed load is recomputed: the negative control's tokens stay right.
                kvpushd_connector_config("kv_both", daemon, kv_load_failure_policy="recompute"),
            ],
            env=env,
        )
        for name, core, tp, daemon, env in zip(
            ("two", "one"),
            (cores[0], cores[-1]),
            (2, 1),
            daemons,
            ({}, {"KVPUSHD_FAILPOINTS": "connector.swap_slices=corrupt@1"}),
            strict=True,
        )
    ]
    shm_before = vllm_shm_segments()
    try:
        with running(*servers):
            yield (servers[0], daemons[0]), (servers[1], daemons[1])
    finally:
        remove_vllm_shm_segments(vllm_shm_segments() - shm_before)
        assert [daemon.stop() for daemon in daemons] == [0, 0]


def test_tp2_prefill_fills_both_head_slices_of_a_tp1_decode_token_exact(tp2_and_tp1) -> None:
    # First (the failpoint fires on the decode's first such load): the negative control.
    _a_mis_mapped_rank_pair_is_refused_by_its_heads(tp2_and_tp1)
    _each_prefill_rank_fills_its_head_slice(tp2_and_tp1)


def _a_mis_mapped_rank_pair_is_refused_by_its_heads(tp2_and_tp1) -> None:
    (p, prefill), (d, decode) = tp2_and_tp1
    rng = random.Random(31)
    prompt = [rng.randrange(2, 512) for _ in range(96)]
    single = p.complete(prompt, TOKENS).token_ids  # the TP 2 instance: TP 1's tokens here
    sent = prefill_leg(p, prompt)
    # The failed load is recomputed (the policy set above): never wrong tokens.
    # (vLLM counts the external tokens it was promised, loaded or not.)
    assert d.complete(prompt, TOKENS, kv_transfer_params=sent).token_ids == single
    wait_idle(prefill, decode, timeout=10)
    transfer = sent["kvpushd_transfer_id"]
    reasons = set()
    for rank in (0, 1):
        share = f"{transfer}@tp{rank}"
        (refused,) = [e for e in prefill.journal_events(share) if isinstance(e, Refused)]
        assert refused.reason is Reason.FINGERPRINT_MISMATCH
        assert "field 'kv_head_range' differs" in refused.message, refused.message
        events = decode.journal_events(share)
        assert not [e for e in events if isinstance(e, WriteDone)], events
        (failed,) = [e for e in events if isinstance(e, Failed)]
        reasons.add(failed.reason)
        assert isinstance(events[-1], Released), events
    # The first refusal fails the load; the other share is refused too, or
    # aborted by the connector first (all or nothing), whichever came first.
    assert Reason.FINGERPRINT_MISMATCH in reasons, reasons
    assert reasons <= {Reason.FINGERPRINT_MISMATCH, Reason.ABORTED}, reasons


def _each_prefill_rank_fills_its_head_slice(tp2_and_tp1) -> None:
    (p, prefill), (d, decode) = tp2_and_tp1
    rng = random.Random(32)
    checked = decode.status()["counters"]["integrity_blocks_verified"]
    for length in (40, 200):
        prompt = [rng.randrange(2, 512) for _ in range(length)]
        # The TP 2 instance alone (asked on the decode, the prompt would be a
        # local prefix hit there): its tokens are the TP 1 tokens on this model.
        single = p.complete(prompt, TOKENS).token_ids
        sent = prefill_leg(p, prompt)
        assert sent["kvpushd_fingerprint"]["tp_size"] == 2
        before = d.metrics().total(EXTERNAL_TOKENS, source="external_kv_transfer")
        assert d.complete(prompt, TOKENS, kv_transfer_params=sent).token_ids == single, length
        loaded = d.metrics().total(EXTERNAL_TOKENS, source="external_kv_transfer") - before
        assert loaded >= length - 1, (length, loaded)
        wait_idle(prefill, decode)
        transfer = sent["kvpushd_transfer_id"]
        engines = set()
        for rank in (0, 1):
            share = f"{transfer}@tp{rank}"
            for daemon in (prefill, decode):
                kinds = [type(e) for e in daemon.journal_events(share)]
                assert WriteDone in kinds and kinds[-1] is Released, (daemon.node, rank, kinds)
            (registered,) = [e for e in decode.journal_events(share) if isinstance(e, Registered)]
            engines.add(registered.engine_id)
        # Each prefill rank's heads went into the slice engine of those heads.
        assert sorted(e.rsplit("-kvh", 1)[-1] for e in engines) == ["0-1", "1-2"], engines
        # Every written slice's bytes were checked against the prefill rank's checksums.
        counters = decode.status()["counters"]
        assert counters["integrity_mismatches"] == 0
        assert counters["integrity_blocks_verified"] > checked, counters
        checked = counters["integrity_blocks_verified"]
    slices = {
        engine_id: engine["fingerprint"]["kv_head_range"]
        for engine_id, engine in decode.status()["engines"].items()
        if "-kvh" in engine_id
    }
    assert sorted(tuple(heads) for heads in slices.values()) == [(0, 1), (1, 2)], slices


def test_a_tp1_prefill_cannot_feed_a_tp2_decode_and_the_decode_computes_the_prompt(
    tp2_and_tp1,
) -> None:
    (d, decode), (p, prefill) = tp2_and_tp1
    rng = random.Random(24)
    prompt = [rng.randrange(2, 512) for _ in range(96)]
    single = d.complete(prompt, TOKENS).token_ids
    sent = prefill_leg(p, prompt)
    before = d.metrics().total(EXTERNAL_TOKENS, source="external_kv_transfer")
    assert d.complete(prompt, TOKENS, kv_transfer_params=sent).token_ids == single
    assert d.metrics().total(EXTERNAL_TOKENS, source="external_kv_transfer") == before
    # The prefill's push ends at once (well before its 30 s deadline).
    wait_idle(prefill, decode, timeout=10)
    transfer = sent["kvpushd_transfer_id"]
    events = prefill.journal_events(transfer)
    (refused,) = [e for e in events if isinstance(e, Refused)]
    assert refused.reason is Reason.FINGERPRINT_MISMATCH, events
    assert "field 'kv_head_range' differs" in refused.message
    (failed,) = [e for e in decode.journal_events(transfer) if isinstance(e, Failed)]
    assert failed.reason is Reason.FINGERPRINT_MISMATCH
