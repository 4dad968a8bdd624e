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
decode computes the prompt.

A TP 1 prefill feeds a TP 2 decode when its router names the decode's TP
on the prefill leg (``kvpushd_decode_tp``): it pushes one share per decode
rank, each from the head slice of its blocks holding that rank's head, into
the decode rank's whole blocks; the same oracle, and a negative control
that reads each share from the other slice (refused by the heads). Not told
(as vLLM's own proxies send the prefill leg), it pushes one whole share no
decode rank can take: the decode computes the prompt, and the prefill
daemon refuses the pairing by the heads.

Every rank of an instance runs on that instance's one core (the CPU build
runs TP over gloo with a shared-memory all-reduce).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest
from refusals import the_pairing_refusal
from split_pairs import (
    TOKENS,
    Shape,
    Side,
    a_split_push_fills_each_decode_rank,
    load_split_across_ranks,
    not_paired,
    split_pair,
)

from daemon.cli import main
from daemon.sim.launcher import Daemon, wait_idle
from harness.vllm_router import prefill_leg
from harness.vllm_servers import (
    EXTERNAL_TOKENS,
    VllmServer,
    kvpushd_pd,
)
from schemas.events import Failed, Registered, Released, Trimmed, WriteDone
from schemas.reasons import Reason

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


# The negative controls' planted mis-mappings, each on the first load (or
# split push) of its kind in the TP 1 instance's worker.
SWAPS = ("connector.swap_slices", "connector.swap_split")


@pytest.fixture(scope="module")
def tp2_and_tp1(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Side]]:
    """A TP 2 and a TP 1 instance, each kv_both beside its own daemon: either may prefill.

    The TP 1 instance's first load from the TP 2 one, and its first push
    split for the TP 2 one, are mis-mapped on purpose (the negative
    controls, each at the start of the one test that moves KV that way).
    """
    shapes = [
        Shape("two", tp=2),
        Shape("one", env={"KVPUSHD_FAILPOINTS": ",".join(f"{p}=corrupt@1" for p in SWAPS)}),
    ]
    with split_pair(tiny_model, tmp_path_factory.mktemp("pd-tp-mixed"), shapes) as sides:
        yield sides


def test_tp2_prefill_fills_both_head_slices_of_a_tp1_decode_token_exact(tp2_and_tp1) -> None:
    # First (the failpoint fires on the decode's first such load): the negative control.
    _a_mis_mapped_rank_pair_is_refused_by_its_heads(tp2_and_tp1)
    two, one = tp2_and_tp1
    rng = random.Random(32)
    for length in (40, 200):
        prompt = [rng.randrange(2, 512) for _ in range(length)]
        engines = load_split_across_ranks(two, one, prompt, ("@tp0", "@tp1")).decode
        # Each prefill rank's heads went into the slice engine of those heads.
        assert sorted(e.rsplit("-kvh", 1)[-1] for e in engines) == ["0-1", "1-2"], engines
    slices = {
        engine_id: engine["fingerprint"]["kv_head_range"]
        for engine_id, engine in one[1].status()["engines"].items()
        if "-kvh" in engine_id
    }
    assert sorted(tuple(heads) for heads in slices.values()) == [(0, 1), (1, 2)], slices


def _a_mis_mapped_rank_pair_is_refused_by_its_heads(tp2_and_tp1: list[Side]) -> None:
    (p, prefill), (d, decode) = tp2_and_tp1
    rng = random.Random(31)
    prompt = [rng.randrange(2, 512) for _ in range(96)]
    single = p.complete(prompt, TOKENS).token_ids  # the TP 2 instance: TP 1's tokens here
    sent = prefill_leg(p, prompt)
    # The failed load is recomputed (split_pair's policy): never wrong tokens.
    # (vLLM counts the external tokens it was promised, loaded or not.)
    assert d.complete(prompt, TOKENS, kv_transfer_params=sent).token_ids == single
    wait_idle(prefill, decode, timeout=10)
    transfer = sent["kvpushd_transfer_id"]
    reasons = set()
    for rank in (0, 1):
        share = f"{transfer}@tp{rank}"
        refused = the_pairing_refusal(prefill.journal_events(share))
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


def test_a_tp1_prefill_told_the_decodes_tp_fills_each_tp2_rank_from_a_head_slice(
    tp2_and_tp1,
) -> None:
    two, one = tp2_and_tp1
    a_split_push_fills_each_decode_rank(
        one, two, ("@tp0", "@tp1"), "kv_head_range", "-kvh", seed=33, decode_tp=2
    )


def test_a_tp1_prefill_not_told_the_decodes_tp_cannot_feed_it_and_the_decode_computes(
    tp2_and_tp1,
) -> None:
    # vLLM's own proxies send the prefill leg without the decode's TP size.
    decode_side, prefill_side = tp2_and_tp1
    rng = random.Random(24)
    prompt = [rng.randrange(2, 512) for _ in range(96)]
    not_paired(prefill_side, decode_side, prompt, "kv_head_range")
