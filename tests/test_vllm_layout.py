"""KvpushdConnector's start-up guard, on config objects shaped like vLLM's.

``daemon.client.vllm.layout`` reads vLLM's config by attribute and never
imports vLLM, so its rules are pinned here without it; tests_vllm/
test_parallel_guard.py pins the same refusal on a real TP 2 vLLM.
"""

from __future__ import annotations

from types import SimpleNamespace

import msgspec
import pytest

from daemon.client.vllm.layout import (
    SINGLE_RANK_SETTINGS,
    UnsupportedLayout,
    check_supported,
    fingerprint,
    group_states,
    group_windows,
    prompt_backoff,
    rank_fingerprint,
    rank_map_problem,
    slice_fingerprint,
    split_pp,
    split_tp,
    window_gap,
)
from schemas.fingerprint import CONNECTOR_PROTOCOL, Fingerprint
from statemachine.fingerprint import first_difference


def _config(**parallel: int) -> SimpleNamespace:
    sizes = {setting: 1 for setting, _ in SINGLE_RANK_SETTINGS} | parallel
    return SimpleNamespace(parallel_config=SimpleNamespace(**sizes))


def test_a_single_rank_instance_with_one_kv_group_is_accepted() -> None:
    check_supported(_config(), SimpleNamespace(kv_cache_groups=[object()]))
    check_supported(_config(), None)  # vLLM may build a connector without the cache config


@pytest.mark.parametrize(("setting", "flag"), SINGLE_RANK_SETTINGS)
def test_each_parallel_setting_above_one_is_refused_by_name(setting: str, flag: str) -> None:
    with pytest.raises(UnsupportedLayout) as refused:
        check_supported(_config(**{setting: 2}))
    assert f"{setting} = 2 ({flag} 2) is not supported" in str(refused.value)
    assert f"{flag} 1" in str(refused.value)


def test_data_parallel_engines_are_accepted() -> None:
    # Each DP engine is an instance of its own to the daemon
    # (tests_vllm/test_pd_production.py drives every engine pair).
    check_supported(_config(data_parallel_size=2), None)


def test_a_setting_this_vllm_does_not_have_counts_as_one() -> None:
    check_supported(SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=1)))


# vLLM's spec classes, by name (the module under test never imports vLLM).
class FullAttentionSpec(SimpleNamespace):
    pass


class SlidingWindowSpec(SimpleNamespace):
    pass


class MambaSpec(SimpleNamespace):
    pass


def _groups(*specs: SimpleNamespace, transfer: bool = True) -> SimpleNamespace:
    return SimpleNamespace(
        kv_cache_groups=[
            SimpleNamespace(kv_cache_spec=spec, enable_kv_transfer=transfer) for spec in specs
        ]
    )


HYBRID = _groups(
    SlidingWindowSpec(block_size=32, sliding_window=48), FullAttentionSpec(block_size=32)
)


def test_sliding_window_beside_full_attention_is_accepted() -> None:
    check_supported(_config(), HYBRID)
    check_supported(_config(tensor_parallel_size=2), HYBRID)


@pytest.mark.parametrize(
    ("config", "groups", "says"),
    [
        (
            _config(),
            _groups(
                FullAttentionSpec(block_size=32), FullAttentionSpec(block_size=32), transfer=False
            ),
            "not transferable",
        ),
        (
            _config(),
            _groups(
                SlidingWindowSpec(block_size=16, sliding_window=8), FullAttentionSpec(block_size=32)
            ),
            "different block sizes",
        ),
        (_config(pipeline_parallel_size=2), HYBRID, "pipeline_parallel_size = 2"),
    ],
    ids=["not-transferable", "block-sizes", "pipeline"],
)
def test_groups_this_connector_cannot_move_are_refused_by_name(
    config: SimpleNamespace, groups: SimpleNamespace, says: str
) -> None:
    with pytest.raises(UnsupportedLayout, match="2 KV cache groups") as refused:
        check_supported(config, groups)
    assert says in str(refused.value)
    assert "--disable-hybrid-kv-cache-manager" in str(refused.value)


def _mamba(mode: str = "none", speculative: int = 0, checkpoints: int = 1) -> MambaSpec:
    # As vLLM's Mamba2 mixer declares it on the CPU build: one prefill
    # checkpoint block, which only mode "align" allocates.
    return MambaSpec(
        block_size=1024,
        shapes=((3, 320), (8, 32, 16)),
        dtypes=("torch.float32", "torch.float32"),
        mamba_type=SimpleNamespace(name="MAMBA2"),
        mamba_cache_mode=mode,
        num_speculative_blocks=speculative,
        num_prefill_checkpoint_blocks=checkpoints,
    )


NEMOTRON = _groups(_mamba(), _mamba(), FullAttentionSpec(block_size=32))


def test_mamba_state_beside_attention_is_accepted_in_mode_none() -> None:
    # The Mamba group's block_size (1024: one state per request) differs from
    # the attention's: a state is one block whatever its token count.
    check_supported(_config(), NEMOTRON)
    check_supported(_config(data_parallel_size=2), NEMOTRON)
    assert group_states(NEMOTRON) == (True, True, False)
    assert group_states(None) == group_states(HYBRID)[1:] == (False,)
    assert prompt_backoff(group_states(NEMOTRON)) == 1
    assert prompt_backoff(group_states(HYBRID)) == 0


@pytest.mark.parametrize(
    ("config", "groups", "says"),
    [
        (_config(), _groups(_mamba("align"), FullAttentionSpec(block_size=32)), "--no-enable-"),
        (_config(), _groups(_mamba(speculative=2), FullAttentionSpec(block_size=32)), "2 spec"),
        (_config(tensor_parallel_size=2), NEMOTRON, "tensor_parallel_size = 2"),
        (_config(), _groups(_mamba("all")), "mamba_cache_mode 'all'"),
    ],
    ids=["align", "speculative-blocks", "tp", "mamba-only"],
)
def test_state_this_connector_cannot_move_is_refused_by_name(
    config: SimpleNamespace, groups: SimpleNamespace, says: str
) -> None:
    with pytest.raises(UnsupportedLayout, match="Mamba/SSM state") as refused:
        check_supported(config, groups)
    assert says in str(refused.value)


def test_the_fingerprint_names_each_state_groups_layout() -> None:
    nemotron = fingerprint(_vllm_config(), "0", kv_cache_config=NEMOTRON)
    state = "mamba2[3x320;8x32x16|float32;float32]"
    assert nemotron.kv_layout.endswith(f":groups={state},{state},full")
    # The conv state laid out the other way (VLLM_SSM_CONV_STATE_LAYOUT=DS) does not pair.
    transposed = _groups(_mamba(), _mamba(), FullAttentionSpec(block_size=32))
    for group in transposed.kv_cache_groups[:2]:
        group.kv_cache_spec.shapes = ((320, 3), (8, 32, 16))
    other = fingerprint(_vllm_config(), "0", kv_cache_config=transposed)
    assert first_difference(nemotron, other)[0] == "kv_layout"


def test_each_group_names_its_window() -> None:
    assert group_windows(HYBRID) == (48, 0)
    assert group_windows(None) == (0,)
    assert group_windows(_groups(FullAttentionSpec(block_size=32))) == (0,)


@pytest.mark.parametrize(
    ("prompt_len", "gap"),
    [(79, 48), (111, 48), (80, None), (78, None), (150, None), (47, None), (48, None)],
)
def test_a_prompt_whose_window_starts_a_freed_block_cannot_be_loaded(
    prompt_len: int, gap: int | None
) -> None:
    # Window 48, blocks of 32: the prefill keeps tokens from len - 47 on; at
    # len 79 that is token 32, a block start, so block 0 (holding token 31,
    # which the decode's recomputed last token attends to) is gone.
    assert window_gap(prompt_len, 32, (48, 0)) == gap
    assert window_gap(prompt_len, 32, (0,)) is None


def _vllm_config(
    speculative: object = None, cache_dtype: str = "auto", **model: object
) -> SimpleNamespace:
    """A tiny llama's vLLM config, as the fingerprint reads it (``model``: more model fields)."""
    return SimpleNamespace(
        model_config=SimpleNamespace(
            model="/m",
            revision=None,
            dtype="torch.float32",
            get_total_num_hidden_layers=lambda: 2,
            get_total_num_kv_heads=lambda: 2,
            get_head_size=lambda: 64,
            **model,
        ),
        cache_config=SimpleNamespace(cache_dtype=cache_dtype, block_size=32),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
        speculative_config=speculative,
    )


def test_the_fingerprint_names_each_groups_window() -> None:
    vllm_config = _vllm_config()
    hybrid = fingerprint(vllm_config, "0", kv_cache_config=HYBRID)
    single = fingerprint(
        vllm_config, "0", kv_cache_config=_groups(FullAttentionSpec(block_size=32))
    )
    assert hybrid.kv_layout.endswith(":groups=swa48,full")
    # An instance with the hybrid allocator off does not pair with one that has it on.
    assert first_difference(hybrid, single)[0] == "kv_layout"


@pytest.mark.parametrize(
    ("field", "model", "speculative"),
    [
        ("kv_cache_dtype", {"cache_dtype": "fp8"}, None),
        ("quantization", {"quantization": "fp8"}, None),
        ("overrides", {"hf_overrides": {"rope_theta": 20000.0}}, None),
        ("speculative", {}, SimpleNamespace(method="eagle", model="/d", num_speculative_tokens=3)),
    ],
)
def test_the_fingerprint_names_what_else_changes_the_kv(
    field: str, model: dict[str, object], speculative: object
) -> None:
    plain = fingerprint(_vllm_config(), "0")
    other = fingerprint(_vllm_config(speculative, **model), "0")
    assert first_difference(plain, other)[0] == field
    # n-gram proposals keep no KV of their own: the KV pairs.
    ngram = SimpleNamespace(method="ngram", model=None, num_speculative_tokens=4)
    assert first_difference(plain, fingerprint(_vllm_config(ngram), "0")) is None


def test_the_fingerprint_names_the_cpu_attention_kernels_block_layout() -> None:
    # vLLM's "vec" kernels keep a block's keys dimension-major, its "amx"
    # ones (bfloat16 on CPUs with AMX) in tiles: the same model and block
    # size on two hosts may hold one KV in different bytes.
    vec = fingerprint(_vllm_config(), "0", attention_isa="vec")
    amx = fingerprint(_vllm_config(), "0", attention_isa="amx")
    assert vec.kv_layout.endswith(":isa=vec")
    assert first_difference(vec, amx)[0] == "kv_layout"


def test_an_mla_model_holds_one_replicated_latent_whatever_its_config_says() -> None:
    # DeepSeek's config says 128 KV heads; MLA caches one latent per token on every rank.
    mla = _vllm_config(use_mla=True)
    mla.model_config.get_total_num_kv_heads = lambda: 128
    one = fingerprint(mla, "0")
    assert one.num_kv_heads == 1 and one.kv_layout.endswith(":mla")
    tp = {n: msgspec.structs.replace(one, tp_size=n) for n in (1, 2, 4)}
    # Every TP pairing maps, each decode rank fed by exactly one prefill rank.
    for p, d in [(2, 1), (1, 2), (4, 2), (2, 4), (4, 1)]:
        assert rank_map_problem(tp[p], tp[d], split_tp=d if d > p else None) is None, (p, d)
    assert {rank_fingerprint(tp[2], r).kv_head_range for r in (0, 1)} == {(0, 1)}


# ------------------------------------------------------------- rank pairing

INSTANCE = Fingerprint(
    "/models/tiny", num_layers=2, num_kv_heads=2, tp_size=2, protocol=CONNECTOR_PROTOCOL
)


def test_each_rank_names_the_heads_it_holds_and_a_slice_names_its_own() -> None:
    assert [rank_fingerprint(INSTANCE, r).kv_head_range for r in (0, 1)] == [(0, 1), (1, 2)]
    single = msgspec.structs.replace(INSTANCE, tp_size=1)
    assert rank_fingerprint(single, 0).kv_head_range == (0, 2)
    assert rank_fingerprint(single, 0).layer_range == (0, 2)
    assert slice_fingerprint(single, (1, 2), (0, 2)).kv_head_range == (1, 2)
    # A TP 2 prefill rank pairs with the TP 1 decode's slice of its heads, not the other.
    rank1 = rank_fingerprint(INSTANCE, 1)
    assert first_difference(rank1, slice_fingerprint(single, (1, 2), (0, 2))) is None
    assert first_difference(rank1, slice_fingerprint(single, (0, 1), (0, 2))) == (
        "kv_head_range",
        (1, 2),
        (0, 1),
    )


def test_each_stage_names_its_layers_and_pairs_only_with_a_slice_of_those_layers() -> None:
    staged = msgspec.structs.replace(INSTANCE, tp_size=1, pp_size=2)
    assert [rank_fingerprint(staged, 0, s).layer_range for s in (0, 1)] == [(0, 1), (1, 2)]
    one_stage = msgspec.structs.replace(staged, pp_size=1)
    stage1 = rank_fingerprint(staged, 0, 1)
    assert first_difference(stage1, slice_fingerprint(one_stage, (0, 2), (1, 2))) is None
    assert first_difference(stage1, slice_fingerprint(one_stage, (0, 2), (0, 1))) == (
        "layer_range",
        (1, 2),
        (0, 1),
    )


def test_instances_pair_when_the_prefill_has_a_multiple_of_the_decodes_ranks() -> None:
    def tp(size: int) -> Fingerprint:
        return msgspec.structs.replace(INSTANCE, tp_size=size)

    assert rank_map_problem(tp(2), tp(2)) is None
    assert rank_map_problem(tp(2), tp(1)) is None
    assert rank_map_problem(tp(4), tp(2)) is None  # TP 4 replicates the 2 heads
    # A decode with more ranks: only a push the prefill split for its TP.
    problem = rank_map_problem(tp(1), tp(2))
    assert problem is not None and "only when it splits its push for TP 2" in problem
    assert rank_map_problem(tp(1), tp(2), split_tp=2) is None
    assert rank_map_problem(tp(2), tp(4), split_tp=4) is None
    problem = rank_map_problem(tp(1), tp(4), split_tp=2)
    assert problem is not None and "it pushed for TP 2" in problem
    problem = rank_map_problem(tp(2), tp(1), split_tp=4)  # split for another decode
    assert problem is not None and "pushed for TP 4" in problem

    def pp(size: int) -> Fingerprint:
        return msgspec.structs.replace(INSTANCE, pp_size=size)

    assert rank_map_problem(pp(2), pp(2)) is None
    assert rank_map_problem(pp(2), pp(1)) is None
    problem = rank_map_problem(pp(1), pp(2))
    assert problem is not None and "span two of the decode's 2 stages" in problem


@pytest.mark.parametrize(
    ("own", "told", "split"),
    [
        (1, None, 1),  # unsaid (vLLM's own proxies): its own TP
        (1, 2, 2),
        (2, 4, 4),
        (1, 8, 8),  # TP 8 replicates the 2 heads: each decode rank reads one
        (2, 2, 2),
        (2, 1, 2),  # a decode with fewer ranks takes whole shares
        (1, 3, 1),  # 3 ranks cannot hold 2 heads
        (2, 3, 2),  # not a multiple
        (1, "2", 1),
        (1, True, 1),
        (1, 10**9, 1),  # beyond any real TP size: never looped over
    ],
)
def test_a_prefill_splits_its_push_only_for_a_decode_tp_it_maps_onto(
    own: int, told: object, split: int
) -> None:
    instance = msgspec.structs.replace(INSTANCE, tp_size=own)
    assert split_tp(instance, told) == split


@pytest.mark.parametrize(
    ("own", "layers", "told", "split"),
    [
        (1, 2, None, 1),  # unsaid (vLLM's own proxies): its own PP
        (1, 2, 2, 2),
        (2, 4, 4, 4),
        (1, 2, 3, 1),  # more stages than layers
        (2, 7, 3, 2),  # 7 layers: stages [4, 3] and [3, 2, 2]; a decode stage straddles
        (2, 2, 1, 2),  # a decode with fewer stages takes whole shares
        (1, 2, "2", 1),
        (1, 2, 10**9, 1),
    ],
)
def test_a_prefill_splits_its_push_only_for_a_decode_pp_whose_stages_nest_in_its_own(
    own: int, layers: int, told: object, split: int
) -> None:
    instance = msgspec.structs.replace(INSTANCE, pp_size=own, num_layers=layers)
    assert split_pp(instance, told) == split
    if split > own:
        decode = msgspec.structs.replace(INSTANCE, pp_size=told, num_layers=layers)
        assert rank_map_problem(instance, decode, split_pp=split) is None
        assert rank_map_problem(instance, decode) is not None


def test_instances_of_different_block_sizes_do_not_pair() -> None:
    # The prefill's 32-token blocks are not runs of the decode's 64-token
    # ones in vLLM's CPU layout (each head's keys dimension-major, measured
    # in docs/block-sizes-on-vllm-cpu.md): refused at the pairing, never written.
    small, large = _vllm_config(), _vllm_config()
    large.cache_config.block_size = 64
    assert first_difference(fingerprint(small, "0"), fingerprint(large, "0"))[0] == "block_size"
