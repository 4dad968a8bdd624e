"""The start-up line where vLLM itself computes wrong: MLA on its CPU build with its rotary op.

``daemon.client.vllm.layout.mla_rope_warning`` reads vLLM's config by
attribute, so its rule is pinned here on config-shaped objects;
tests_vllm/test_mla_rope_warning_vllm.py pins it on vLLM's own resolved
config, and tests_vllm/test_pd_mla.py checks that servers started with the
flag never log it.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from daemon.client.vllm.layout import custom_op_enabled, mla_rope_warning

FLAG = "custom_ops: -rotary_embedding"


def _config(custom_ops: list[str], *, mla: bool = True, device: str = "cpu") -> SimpleNamespace:
    return SimpleNamespace(
        model_config=SimpleNamespace(use_mla=mla),
        device_config=SimpleNamespace(device_type=device),
        compilation_config=SimpleNamespace(custom_ops=custom_ops),
    )


@pytest.mark.parametrize(
    ("custom_ops", "enabled"),
    [
        (["all"], True),  # vLLM's base mode without Inductor (--enforce-eager)
        (["none"], False),  # with Inductor: vLLM's pure-torch ops
        (["none", "+rotary_embedding"], True),
        (["all", "-rotary_embedding"], False),  # the fix docs/mla-on-vllm-cpu.md names
        (["-rotary_embedding"], False),
        (["all", "+rotary_embedding", "-rotary_embedding"], False),  # vLLM refuses it anyway
        (["all", "-silu_and_mul"], True),  # another op disabled
        ([], True),  # unresolved: vLLM's default_on reads no "none"
    ],
)
def test_the_rotary_op_is_enabled_by_vllms_rule(custom_ops: list[str], enabled: bool) -> None:
    assert custom_op_enabled(custom_ops, "rotary_embedding") is enabled
    line = mla_rope_warning(_config(custom_ops))
    assert (line is not None) is enabled
    if line is not None:
        assert FLAG in line and "docs/mla-on-vllm-cpu.md" in line


def test_only_an_mla_model_on_cpu_is_warned_about() -> None:
    assert mla_rope_warning(_config(["all"], mla=False)) is None
    assert mla_rope_warning(_config(["all"], device="cuda")) is None
    # A config that names none of it (another vLLM, a test double): nothing to say.
    assert mla_rope_warning(SimpleNamespace()) is None
