"""Engine fingerprints: a push pairs only engines whose KV is interchangeable.

The rule (statemachine/fingerprint.py) on its own, then at the process level:
two real daemons, simulated engines that declare fingerprints, real NIXL.
A mismatch is refused by the prefill daemon at pairing, before any byte is
written; both journals carry the typed reason with the differing field,
both daemons count it, and the decode engine's blocks are untouched.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import msgspec
import pytest

from daemon.client.errors import RpcError
from daemon.sim.engine import Expectation, SimEngine, SimGroup, tail_pairs
from daemon.sim.kvpattern import changed_blocks, snapshot
from schemas import rpc
from schemas.events import Failed, Refused, Trimmed, WriteStarted
from schemas.fingerprint import Fingerprint
from schemas.layout import Role
from schemas.reasons import Reason
from statemachine import TrimRefused
from statemachine.fingerprint import check_fingerprints, first_difference
from tests.support.metrics import MetricsDaemon, delta, metrics_pair

TINY = Fingerprint(
    "/models/tiny",
    dtype="float32",
    kv_cache_dtype="auto",
    block_size=32,
    num_layers=2,
    num_kv_heads=2,
    head_size=64,
    kv_layout="cpu:auto",
    engine="vllm 0.32.0",
    protocol=1,
)
LAYOUT = [SimGroup(num_blocks=64, block_bytes=2048, layers=2)]

# ------------------------------------------------------------------ the rule


def test_equal_fingerprints_pair_and_so_do_two_undeclared_ones() -> None:
    assert first_difference(TINY, msgspec.structs.replace(TINY)) is None
    assert first_difference(None, None) is None
    check_fingerprints(TINY, TINY)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("model", "/models/other"),
        ("revision", "v2"),
        ("dtype", "bfloat16"),
        ("kv_cache_dtype", "fp8"),
        ("block_size", 16),
        ("num_layers", 3),
        ("num_kv_heads", 4),
        ("head_size", 128),
        ("kv_layout", "cuda:FLASH_ATTN"),
        ("tp_size", 2),
        ("pp_size", 2),
        ("engine", "vllm 0.33.0"),
        ("protocol", 3),
        ("kv_head_range", (0, 1)),
        ("layer_range", (0, 1)),
        ("quantization", "fp8"),
        ("overrides", "0123456789abcdef"),
        ("speculative", "eagle:/drafts/d:3"),
        ("rope", "longrope:long:0123456789abcdef"),
    ],
)
def test_any_differing_field_is_refused_by_name(field: str, value: object) -> None:
    other = msgspec.structs.replace(TINY, **{field: value})
    assert first_difference(TINY, other) == (field, getattr(TINY, field), value)
    with pytest.raises(TrimRefused) as refused:
        check_fingerprints(TINY, other)
    assert refused.value.reason is Reason.FINGERPRINT_MISMATCH
    assert f"field {field!r} differs" in refused.value.message


def test_a_declared_fingerprint_never_pairs_with_an_undeclared_one() -> None:
    assert first_difference(TINY, None) == ("fingerprint", "declared", "none declared")
    assert first_difference(None, TINY) == ("fingerprint", "none declared", "declared")


def test_every_fingerprint_field_is_named_by_the_parametrized_test() -> None:
    # A field added to Fingerprint must be compared (and tested) like the others.
    named = {"model", "revision", "dtype", "kv_cache_dtype", "block_size", "num_layers"}
    named |= {"num_kv_heads", "head_size", "kv_layout", "tp_size", "pp_size", "engine"}
    named |= {"protocol", "kv_head_range", "layer_range", "quantization", "overrides"}
    named |= {"speculative", "rope", "weights"}
    assert set(Fingerprint.__struct_fields__) == named


def test_engines_naming_their_heads_pair_across_tp_sizes_only_on_the_same_heads() -> None:
    # A TP 2 prefill rank's head 1 into the slice of a TP 1 decode rank that holds head 1.
    prefill = msgspec.structs.replace(TINY, tp_size=2, kv_head_range=(1, 2))
    decode_slice = msgspec.structs.replace(TINY, tp_size=1, kv_head_range=(1, 2))
    assert first_difference(prefill, decode_slice) is None
    check_fingerprints(prefill, decode_slice)
    # Mapped to the other head's slice: refused by the heads, whatever the TP sizes.
    wrong = msgspec.structs.replace(decode_slice, kv_head_range=(0, 1))
    assert first_difference(prefill, wrong) == ("kv_head_range", (1, 2), (0, 1))
    # Only one side naming its heads: TP sizes are compared as before.
    unnamed = msgspec.structs.replace(TINY, tp_size=1)
    assert first_difference(prefill, unnamed) == ("tp_size", 2, 1)
    # Stages pair on the layers they name, whatever the PP sizes.
    stage = msgspec.structs.replace(prefill, pp_size=2, layer_range=(1, 2))
    layers = msgspec.structs.replace(decode_slice, layer_range=(1, 2))
    assert first_difference(stage, layers) is None
    assert first_difference(stage, msgspec.structs.replace(layers, layer_range=(0, 1))) == (
        "layer_range",
        (1, 2),
        (0, 1),
    )
    # A scheduler asking whether two instances can pair at all leaves TP aside.
    assert first_difference(prefill, unnamed, ignore={"tp_size", "kv_head_range"}) is None


def test_weights_digests_are_compared_between_shards_of_one_layout_where_both_took_one() -> None:
    prefill = msgspec.structs.replace(TINY, weights="aa" * 16)
    rewritten = msgspec.structs.replace(TINY, weights="bb" * 16)
    # The same layout: a checkpoint rewritten in place is refused by name.
    assert first_difference(prefill, rewritten) == ("weights", "aa" * 16, "bb" * 16)
    with pytest.raises(TrimRefused) as refused:
        check_fingerprints(prefill, rewritten)
    assert "field 'weights' differs" in refused.value.message
    assert first_difference(prefill, msgspec.structs.replace(rewritten, weights="aa" * 16)) is None
    # TP ranks of other sizes hold other shards: not comparable, not compared.
    tp2 = msgspec.structs.replace(prefill, tp_size=2, kv_head_range=(0, 1))
    tp1 = msgspec.structs.replace(rewritten, tp_size=1, kv_head_range=(0, 1))
    assert first_difference(tp2, tp1) is None
    # Equal sizes, other ranks: refused by the heads they name, first.
    rank1 = msgspec.structs.replace(tp2, kv_head_range=(1, 2))
    assert first_difference(tp2, rank1)[0] == "kv_head_range"  # type: ignore[index]
    # An engine that took no digest (its model out of reach) is compared on the rest.
    assert first_difference(prefill, TINY) is None
    assert first_difference(TINY, rewritten) is None


# --------------------------------------------------------- two real daemons


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[MetricsDaemon, ...]]:
    yield from metrics_pair(tmp_path_factory.mktemp("fingerprint"))


async def _engines(
    pair: tuple[MetricsDaemon, ...], p_print: Fingerprint | None, d_print: Fingerprint | None
) -> tuple[SimEngine, SimEngine]:
    prefill, decode = pair
    tag = uuid.uuid4().hex[:8]
    pe = await SimEngine.create(
        f"p-{tag}", Role.PUSHER, LAYOUT, prefill.socket, fingerprint=p_print
    )
    de = await SimEngine.create(
        f"d-{tag}", Role.RECEIVER, LAYOUT, decode.socket, fingerprint=d_print
    )
    return pe, de


async def test_equal_fingerprints_push_and_status_shows_them(pair) -> None:
    prefill, _ = pair
    pe, de = await _engines(pair, TINY, TINY)
    try:
        src, dst = [[3, 4, 5]], [[40, 41, 42]]
        pairs = tail_pairs(pe.layout, src, de.layout, dst)
        await de.decode_register("same", dst, "prefill", expect=Expectation(pe.engine_id, pairs))
        await pe.prefill("same", src)
        assert isinstance(
            await de.wait_event("same", (rpc.KvArrived, rpc.RequestFailed)), rpc.KvArrived
        )
        assert de.reports[("same", 1)].ok, de.reports[("same", 1)].problems()
        shown = prefill.status()["engines"][pe.engine_id]["fingerprint"]
        assert msgspec.convert(shown, Fingerprint) == TINY
        await de.release("same")
        await pe.release("same")
    finally:
        await pe.close()
        await de.close()


@pytest.mark.parametrize(
    ("d_print", "field"),
    [(msgspec.structs.replace(TINY, model="/models/other"), "model"), (None, "fingerprint")],
)
async def test_a_mismatch_writes_nothing_and_both_journals_name_the_field(
    pair, d_print: Fingerprint | None, field: str
) -> None:
    prefill, decode = pair
    p0, d0 = prefill.scrape(), decode.scrape()
    pe, de = await _engines(pair, TINY, d_print)
    rid = f"mismatch-{field}"
    try:
        before = snapshot(de.view)
        await de.decode_register(rid, [[10, 11]], "prefill")
        # Both sides known: the pairing is refused at once, before the KV is ready.
        await pe.prefill(rid, [[1, 2, 3]], kv_ready=False)
        p_failed = await pe.wait_event(rid, (rpc.BlocksFreeable, rpc.RequestFailed))
        d_failed = await de.wait_event(rid, (rpc.KvArrived, rpc.RequestFailed))
        for failed in (p_failed, d_failed):
            assert isinstance(failed, rpc.RequestFailed), failed
            assert failed.reason == Reason.FINGERPRINT_MISMATCH
            assert f"field {field!r} differs" in failed.message
        assert changed_blocks(before, de.view) == []
        # The prefill engine's kv_ready, overtaken by the refused pairing, is
        # refused in its own words (the real-vLLM checks accept exactly these).
        with pytest.raises(RpcError) as late:
            await pe.kv_ready(rid)
        assert late.value.reason is Reason.ILLEGAL_TRANSITION
        assert "KvReady is not allowed in state failed" in late.value.message
        await de.release(rid)
        await pe.release(rid)
    finally:
        await pe.close()
        await de.close()
    p_events, d_events = prefill.journal_events(rid), decode.journal_events(rid)
    pairing, late_ready = [e for e in p_events if isinstance(e, Refused)]
    assert pairing.reason is Reason.FINGERPRINT_MISMATCH and field in pairing.message
    assert late_ready.reason is Reason.ILLEGAL_TRANSITION
    for events in (p_events, d_events):
        (failed_event,) = [e for e in events if isinstance(e, Failed)]
        assert failed_event.reason is Reason.FINGERPRINT_MISMATCH, events
        assert f"field {field!r} differs" in failed_event.message
        assert not [e for e in events if isinstance(e, Trimmed | WriteStarted)], events
    p1, d1 = prefill.scrape(), decode.scrape()
    reason = Reason.FINGERPRINT_MISMATCH.value
    assert delta(p0, p1, "kvpushd_refusals_total", reason=reason) == 1
    assert delta(p0, p1, "kvpushd_failures_total", reason=reason) == 1
    assert delta(d0, d1, "kvpushd_failures_total", reason=reason) == 1
    assert delta(p0, p1, "kvpushd_transfers_started_total") == 0


# ------------------------------------------------------------------ content


@pytest.mark.parametrize("receiver_first", [False, True], ids=["prefill-first", "decode-first"])
async def test_blocks_for_another_prompt_are_never_written_and_both_journals_say_so(
    pair, receiver_first: bool
) -> None:
    """Both sides name the prompt their blocks hold or are for; different ones never pair.

    A router that sent the two legs different prompts under one transfer id
    (with both legs at once the decode cannot compare digests before it
    reports external tokens): the prefill daemon refuses the pairing with
    ``content_mismatch``, nothing is written, and both journals say so. The
    same contents push as usual; a side naming none is not checked.
    """
    prefill, decode = pair
    p0 = prefill.scrape()
    pe, de = await _engines(pair, TINY, TINY)
    rid = f"content-{receiver_first}"
    try:
        before = snapshot(de.view)
        if receiver_first:
            await de.decode_register(rid, [[10, 11]], "prefill", content="digest-b")
            await pe.prefill(rid, [[1, 2, 3]], content="digest-a", kv_ready=False)
        else:
            await pe.prefill(rid, [[1, 2, 3]], content="digest-a", kv_ready=False)
            await de.decode_register(rid, [[10, 11]], "prefill", content="digest-b")
        for engine in (pe, de):
            failed = await engine.wait_event(
                rid, (rpc.KvArrived, rpc.BlocksFreeable, rpc.RequestFailed)
            )
            assert isinstance(failed, rpc.RequestFailed), failed
            assert failed.reason == Reason.CONTENT_MISMATCH
            assert "'digest-a'" in failed.message and "'digest-b'" in failed.message
        assert changed_blocks(before, de.view) == []
        await de.release(rid)
        await pe.release(rid)
        # Equal contents, and one side naming none, push as usual.
        for n, (p_content, d_content) in enumerate([("same", "same"), ("", "named")]):
            ok = f"{rid}-ok{n}"
            src, dst = [[4, 5, 6]], [[20, 21, 22]]
            expect = Expectation(pe.engine_id, tail_pairs(pe.layout, src, de.layout, dst))
            await de.decode_register(ok, dst, "prefill", expect=expect, content=d_content)
            await pe.prefill(ok, src, content=p_content)
            arrived = await de.wait_event(ok, (rpc.KvArrived, rpc.RequestFailed))
            assert isinstance(arrived, rpc.KvArrived), arrived
            assert de.reports[(ok, 1)].ok
            await de.release(ok)
            await pe.release(ok)
    finally:
        await pe.close()
        await de.close()
    for daemon in (prefill, decode):
        (failed_event,) = [e for e in daemon.journal_events(rid) if isinstance(e, Failed)]
        assert failed_event.reason is Reason.CONTENT_MISMATCH
    (refused,) = [e for e in prefill.journal_events(rid) if isinstance(e, Refused)]
    assert refused.reason is Reason.CONTENT_MISMATCH
    reason = Reason.CONTENT_MISMATCH.value
    assert delta(p0, prefill.scrape(), "kvpushd_refusals_total", reason=reason) == 1
