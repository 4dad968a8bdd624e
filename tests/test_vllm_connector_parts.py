"""The connector's pure parts, without vLLM: the rank and slice map, a load, the router params.

``RankPlan`` (daemon/client/vllm/shares.py) is what makes a TP pair of any
sizes the connector serves move each head exactly once: every share a
prefill rank pushes is loaded by one decode rank (or ended as an unread
replica by one), on engines that name the same KV heads and hold as many
bytes per block. Generated over head counts and TP sizes, every instance
of each. ``Load`` (loads.py) ends all or nothing; ``params.py`` is the
protocol a router carries between the two legs.
"""

from __future__ import annotations

import pickle

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from daemon.client.vllm.layout import rank_fingerprint, rank_map_problem, split_tp
from daemon.client.vllm.loads import Load
from daemon.client.vllm.params import (
    LOCAL,
    PARAMS_VERSION,
    Dispatched,
    PrefillAnswer,
    adopt_dispatch,
    bound_params,
    read_leg,
    receive_spec,
    router_transfer_id,
)
from daemon.client.vllm.shares import RankPlan, holds_run
from daemon.client.vllm.specs import PushSpec, ReceiveSpec, per_group
from harness.hostile_params import MEGABYTE, deep, json_like, made
from schemas.fingerprint import Fingerprint
from schemas.kvlayout import GroupSpec, LayerSpec
from schemas.layout import GroupKind
from statemachine.ranks import UnmappableRanks, share_id

HEAD_BYTES = 64
LAYERS = 4


def _instance(tp: int, heads: int) -> Fingerprint:
    return Fingerprint("m", num_layers=LAYERS, num_kv_heads=heads, tp_size=tp)


def _plan(
    side: str, instance: Fingerprint, rank: int, head_major: bool = True, swap: bool = False
) -> RankPlan:
    own = rank_fingerprint(instance, rank)
    held = own.kv_head_range[1] - own.kv_head_range[0]
    block = held * HEAD_BYTES
    group = GroupSpec(
        GroupKind.ATTENTION,
        16,
        block,
        tuple(LayerSpec("kv", layer * 16 * block) for layer in range(LAYERS)),
    )
    plan = RankPlan(
        f"{side}{rank}", instance, own, rank, instance.tp_size, corrupts=lambda name: swap
    )
    plan.registered((group,), list(range(LAYERS)), head_major)
    return plan


def _engine(plan: RankPlan, spec: PushSpec | ReceiveSpec) -> tuple[tuple[int, int], int]:
    """(The KV heads a spec's engine names, its bytes per block), from what the spec carries.

    A spec on a slice carries the slice (what the link's loop thread registers).
    """
    if spec.engine_id == plan.engine_id:
        assert spec.slice is None
        return plan.own.kv_head_range, plan.groups[0].block_bytes
    assert spec.slice is not None and spec.slice == plan.slices[spec.engine_id]
    return spec.slice.fingerprint.kv_head_range, spec.slice.groups[0].block_bytes


PAIRS = st.tuples(
    st.sampled_from([1, 2, 4, 8]), st.sampled_from([1, 2, 4]), st.sampled_from([1, 2, 4])
).filter(lambda t: rank_map_problem(_instance(t[1], t[0]), _instance(t[2], t[0]), t[2]) is None)


def _pushed_and_loaded(
    heads: int, prefill_tp: int, decode_tp: int, swap: bool = False
) -> tuple[dict[str, tuple[tuple[int, int], int]], dict[str, tuple[tuple[int, int], int]]]:
    """Each share id -> (KV heads, block bytes) of its engine, on the prefill and the decode."""
    prefill, decode = _instance(prefill_tp, heads), _instance(decode_tp, heads)
    by_tp = split_tp(prefill, decode_tp)
    pushers = [_plan("P", prefill, rank, swap=swap) for rank in range(prefill_tp)]
    pushed: dict[str, tuple[tuple[int, int], int]] = {}
    for plan in pushers:
        for share in plan.shares(PushSpec("r", "T", ((1, 2),), split_tp=by_tp)):
            assert share.engine_id, share
            assert share.transfer_id not in pushed, "two prefill ranks push one share"
            pushed[share.transfer_id] = _engine(plan, share)
    leg = _answer(prefill, (by_tp, 1))
    loaded: dict[str, tuple[tuple[int, int], int]] = {}
    for rank in range(decode_tp):
        plan = _plan("D", decode, rank)
        receive = receive_spec("r", leg, ((5, 6),))
        shares = [plan.receiver(receive, source) for source in plan.sources(receive)]
        shares += plan.unread(receive)
        for share in shares:
            assert share.transfer_id not in loaded, "two decode ranks load one share"
            loaded[share.transfer_id] = _engine(plan, share)
    return pushed, loaded


@given(PAIRS)
def test_every_pushed_share_is_loaded_once_on_the_same_heads(pair: tuple[int, int, int]) -> None:
    pushed, loaded = _pushed_and_loaded(*pair)
    # Each share names the same heads and block bytes on both sides: what
    # the prefill daemon's pairing check asks of the two engines.
    assert loaded == pushed


def test_the_planted_split_swap_names_other_heads() -> None:
    """The negative control (failpoint connector.swap_split) breaks exactly that equality."""
    pushed, loaded = _pushed_and_loaded(4, 1, 2, swap=True)
    assert pushed.keys() == loaded.keys()
    assert pushed != loaded


def test_a_split_push_lies_on_head_slices_of_the_prefill_rank() -> None:
    plan = _plan("P", _instance(1, 4), 0)
    shares = plan.shares(PushSpec("r", "T", ((1,),), split_tp=2))
    assert [s.transfer_id for s in shares] == [share_id("T", 0, 2), share_id("T", 1, 2)]
    assert [plan.slices[s.engine_id][1].kv_head_range for s in shares] == [(0, 2), (2, 4)]
    # Each slice starts its layer's block at that slice's heads.
    offsets = [plan.slices[s.engine_id][0][0].layers[0].offset for s in shares]
    assert offsets == [0, 2 * HEAD_BYTES]


def test_a_cache_that_is_not_head_major_reads_no_slice() -> None:
    plan = _plan("P", _instance(1, 4), 0, head_major=False)
    shares = plan.shares(PushSpec("r", "T", ((1,),), split_tp=2))
    assert [s.engine_id for s in shares] == ["", ""]  # given up, never a wrong run of bytes
    decode = _plan("D", _instance(1, 4), 0, head_major=False)
    two_ranks = ReceiveSpec("r", "T", ((1,),), "p", "h:1", source_ranks=2)
    with pytest.raises(UnmappableRanks):
        decode.sources(two_ranks)


def test_a_forgone_transfer_ends_every_prefill_share_from_the_first_rank_when_unpaired() -> None:
    unpaired = ReceiveSpec("r", "T", (), "p", "h:1", source_ranks=2, paired=False)
    first, second = (_plan("D", _instance(2, 4), rank) for rank in (0, 1))
    assert [s.transfer_id for s in first.forgone(unpaired)] == [
        share_id("T", 0, 2),
        share_id("T", 1, 2),
    ]
    assert second.forgone(unpaired) == []
    # Paired: each rank ends its own source's share, on its own engine.
    paired = ReceiveSpec("r", "T", (), "p", "h:1", source_ranks=2)
    assert [(s.transfer_id, s.engine_id) for s in second.forgone(paired)] == [
        (share_id("T", 1, 2), "D1")
    ]


def test_holds_run() -> None:
    assert holds_run([0, 1, 2, 3], 1, 3)
    assert not holds_run([0, 2, 1, 3], 1, 3)
    assert not holds_run([0, 1], 2, 4)


def test_a_load_ends_all_or_nothing() -> None:
    load = Load("r", ((1,),), 64, 1, 0.0, ("a", "b", "c"))
    load.landed("a")
    assert not load.settled
    # The first failure gives up the shares still pending, once.
    assert load.share_failed("b") == ("c",)
    assert load.failed and not load.settled  # b's blocks are held until released
    assert load.share_ended("c") == ()
    assert not load.settled
    assert load.share_ended("b") == ()
    assert load.settled and load.failed


def test_a_load_whose_shares_all_land_settles_unfailed() -> None:
    load = Load("r", ((1,),), 64, 1, 0.0, ("a", "b"))
    load.landed("b")
    load.landed("a")
    assert load.settled and not load.failed


def test_per_group_names_every_group_even_with_no_block() -> None:
    assert per_group((), 3) == [[], [], []]
    assert per_group(((1, 2), (3,)), 2) == [[1, 2], [3]]


def _answer(prefill: Fingerprint, splits: tuple[int, int] = (1, 1)) -> PrefillAnswer:
    return PrefillAnswer(PARAMS_VERSION, "T", "p", "h:1", prefill, *splits, 7, "d")


def test_the_prefill_answer_reads_back_as_the_decode_load() -> None:
    answer = _answer(_instance(2, 4), (2, 1))
    params = answer.to_params()
    # What a router carries is plain JSON, under kvpushd_* keys beside vLLM's own.
    assert msgspec.json.decode(msgspec.json.encode(params)) == params
    assert params["kvpushd_version"] == PARAMS_VERSION and params["do_remote_prefill"] is True
    assert read_leg(params) == answer
    spec = receive_spec("r", answer, ((3,),), content="c")
    assert (spec.transfer_id, spec.peer, spec.peer_address) == ("T", "p", "h:1")
    assert (spec.source_ranks, spec.source_stages, spec.shares_tp) == (2, 1, 2)
    # The prefill finished it: a transfer it never had fails at the short deadline.
    assert spec.answered


# Each way a router (or anything between the legs) could hand the decode a
# field it cannot trust: dropped, mistyped, out of range, another version.
TAMPERED = st.sampled_from(sorted(_answer(_instance(1, 4)).to_params())).flatmap(
    lambda key: st.tuples(
        st.just(key),
        st.one_of(
            st.just(KeyError),
            st.none(),
            st.booleans(),
            st.integers(-(2**70), 2**70),
            st.floats(allow_nan=False),
            st.text(max_size=3),
            st.lists(st.integers(), max_size=2),
        ),
    )
)


@given(TAMPERED)
def test_a_tampered_answer_reads_as_the_same_answer_or_as_why_not(
    tampered: tuple[str, object],
) -> None:
    """Never a guess: a decode reads the prefill's answer as it is, or refuses it with a reason."""
    key, value = tampered
    answer = _answer(_instance(1, 4))
    params = answer.to_params()
    if value is KeyError:
        del params[key]
    else:
        params[key] = value
    leg = read_leg(params)
    if isinstance(leg, str):
        assert leg.startswith("the prefill")
    else:
        # Read exactly as it stands: nothing dropped, defaulted or coerced (a
        # well-typed other value, such as another digest, is the content
        # checks' to refuse, and test_pd_never_wrong's).
        assert _ours(leg.to_params()) == _ours(params)
        assert all(type(v) is type(answer.to_params()[k]) for k, v in _ours(params).items())


def _ours(params: dict[str, object]) -> dict[str, object]:
    return {k: v for k, v in params.items() if k.startswith("kvpushd_")}


def test_an_answer_of_another_version_says_which() -> None:
    params = _answer(_instance(1, 4)).to_params() | {"kvpushd_version": PARAMS_VERSION + 1}
    leg = read_leg(params)
    assert isinstance(leg, str) and f"version {PARAMS_VERSION + 1}" in leg


@pytest.mark.parametrize(
    ("fields", "why"),
    [
        ({"transfer_id": "x@y"}, "transfer_id"),
        ({"remote_engine_id": ""}, "remote_engine_id"),
        ({"remote_port": True}, "remote_port"),
        ({"remote_port": 70000}, "remote_port"),
        ({"tp_size": "2"}, "tp_size"),
        ({"pp_size": 0}, "pp_size"),
    ],
)
def test_a_dispatch_leg_that_is_not_usable_says_why_and_changes_nothing(
    fields: dict[str, object], why: str
) -> None:
    params = {
        "transfer_id": "t1",
        "remote_engine_id": "p",
        "remote_host": "h",
        "remote_port": 9,
        **fields,
    }
    before = dict(params)
    problem = adopt_dispatch(params)
    assert problem is not None and why in problem
    assert params == before


def test_a_dispatch_leg_becomes_the_fields_the_decode_reads() -> None:
    params: dict[str, object] = {
        "transfer_id": "t1",
        "remote_engine_id": "p",
        "remote_host": "h",
        "remote_port": 9,
        "tp_size": 2,
    }
    assert adopt_dispatch(params) is None
    leg = read_leg(params)
    assert leg == Dispatched(True, "t1", "p", "h:9", 2, 1)
    spec = receive_spec("r", leg, ())
    assert (spec.transfer_id, spec.peer_address, spec.source_ranks) == ("t1", "h:9", 2)
    assert not spec.answered  # the prefill may not have started: the push's whole wait
    assert router_transfer_id({"transfer_id": "x" * 201}) is None


@given(json_like())
def test_bounded_params_keep_what_reads_and_only_plain_small_json_beside_it(drawn: object) -> None:
    """What the connector puts in place of a client's params (vLLM pickles them with its step)."""
    params = made(drawn)
    kept, dropped, unread = bound_params(params)
    # Shallow and small whatever came: pickled at the default recursion limit.
    assert len(pickle.dumps(kept)) < 256 << 10
    if not isinstance(params, dict):
        assert kept == LOCAL and unread
        return
    assert set(kept) <= set(params) and len(dropped) == len(params) - len(kept)
    for key, value in kept.items():
        assert key.startswith(("kvpushd_", "do_remote_")) or value is params[key] or value is None


@pytest.mark.parametrize("where", ["kvpushd_fingerprint", "remote_block_ids", "anything"])
def test_a_deep_dict_or_a_megabyte_anywhere_in_the_params_is_dropped_by_name(where: str) -> None:
    answer = _answer(_instance(1, 4)).to_params()
    for hostile in (deep(), MEGABYTE):
        kept, dropped, unread = bound_params({**answer, where: hostile})
        assert where not in kept and len(dropped) == 1 and dropped[0].startswith(repr(where))
        assert unread is (where == "kvpushd_fingerprint")
        pickle.dumps(kept)


@pytest.mark.parametrize(
    "field", ["tp_size", "pp_size", "block_size", "num_layers", "head_size", "kv_head_range"]
)
def test_a_fingerprint_with_a_size_out_of_its_bounds_does_not_read(field: str) -> None:
    """A TP size of 0 once reached ``decode_tp % prefill_tp`` inside vLLM's scheduler."""
    answer = _answer(_instance(1, 4)).to_params()
    bad = [-1, 2] if field == "kv_head_range" else 0 if field.endswith("p_size") else -1
    for value in (bad, 2**40, "2"):
        answer["kvpushd_fingerprint"] = {**answer["kvpushd_fingerprint"], field: value}
        assert isinstance(read_leg(answer), str)
        assert bound_params(answer).unread
