"""KvpushdConnector's start-up guard, on config objects shaped like vLLM's.

``daemon.client.vllm_layout`` reads vLLM's config by attribute and never
imports vLLM, so its rules are pinned here without it; tests_vllm/
test_parallel_guard.py pins the same refusal on a real TP 2 vLLM.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from daemon.client.vllm_layout import SINGLE_RANK_SETTINGS, UnsupportedLayout, check_supported


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


def test_a_setting_this_vllm_does_not_have_counts_as_one() -> None:
    check_supported(SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=1)))


def test_more_than_one_kv_cache_group_is_refused() -> None:
    with pytest.raises(UnsupportedLayout, match="2 KV cache groups"):
        check_supported(_config(), SimpleNamespace(kv_cache_groups=[object(), object()]))
