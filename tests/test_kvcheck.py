"""The behavioural KV check's parts, without vLLM: which blocks, what is kept, what differs.

``kvcheck.py`` keeps the checked blocks of a load when it lands and, after
the forward that recomputed the prompt's last token, finds the first layer
whose token moved beyond the tolerance; ``checkplan.py`` says which blocks
hold that token and in which step it is computed. The real-vLLM side is
tests_vllm/test_pd_drift.py.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch

from daemon.client.vllm.checkplan import CheckPlan, check_slots
from daemon.client.vllm.kvcheck import (
    LoadChecks,
    Plan,
    Slot,
    relative_differences,
    tolerance_for,
    values_dtype,
)
from daemon.client.vllm.specs import ReceiveSpec

BLOCKS, HEADS, BLOCK, HEAD = 8, 2, 32, 16


def cache(seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A CPU-attention-like layer: [blocks, kv heads, block size, keys and values]."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(BLOCKS, HEADS, BLOCK, 2 * HEAD, generator=generator).to(dtype)


def layers(n: int = 3) -> tuple[tuple[int, str, torch.Tensor], ...]:
    return tuple((i, f"model.layers.{i}.attn", cache(i)) for i in range(n))


def checks(group: tuple[tuple[int, str, torch.Tensor], ...], tolerance: float = 1e-3) -> LoadChecks:
    return LoadChecks((group,), tolerance)


def plan(block: int = 3, position: int = 100) -> Plan:
    return Plan(position, (Slot(0, block),), (1, 2), ("share-0",), "prefill-node")


def test_a_token_recomputed_within_rounding_agrees_and_reports_its_difference() -> None:
    group = layers()
    check = checks(group)
    check.plan("r", plan())
    check.landed({"r"}, set())
    for _, _, layer in group:  # the decode's own token: the same values, rounded elsewhere
        layer[3, :, 4] *= 1 + 1e-6
    findings, differences = check.after_forward(["r"])
    assert findings == []
    ((request, difference),) = differences
    assert request == "r" and 0 < difference < 1e-5


def test_a_token_of_other_weights_is_found_naming_the_first_layer_beyond_the_tolerance() -> None:
    group = layers()
    check = checks(group)
    check.plan("r", plan(position=100))
    check.landed({"r"}, set())
    group[0][2][3, :, 4] *= 1 + 1e-7  # layer 0 within rounding
    group[1][2][3, :, 4] = torch.randn(HEADS, 2 * HEAD)  # layer 1: another model's K/V
    findings, _ = check.after_forward(["r"])
    (finding,) = findings
    assert finding.request_id == "r"
    assert finding.disagreement.layer == 1
    assert finding.disagreement.layer_name == "model.layers.1.attn"
    assert finding.disagreement.position == 100
    assert finding.disagreement.difference > 0.1
    assert finding.plan.peer == "prefill-node"


def test_nothing_is_kept_for_a_failed_load_and_a_dropped_one_is_never_compared() -> None:
    group = layers()
    check = checks(group)
    check.plan("failed", plan())
    check.plan("dropped", plan(block=5))
    check.landed({"failed", "dropped"}, {"failed"})
    check.drop(["dropped"])
    for _, _, layer in group:
        layer[3:6] = 0
    assert check.after_forward(["failed", "dropped"]) == ([], [])


def test_the_blocks_are_kept_when_the_load_lands_not_when_it_is_compared() -> None:
    group = layers(1)
    check = checks(group)
    check.plan("r", plan())
    before_landing = group[0][2][3].clone()
    group[0][2][3, :, 9] += 5  # the push landing
    check.landed({"r"}, set())
    group[0][2][3, :, 9] += 5  # the forward writing another token there
    (finding,), _ = check.after_forward(["r"])
    assert not torch.equal(before_landing, group[0][2][3])
    assert finding.disagreement.difference > 0.1


def test_unchanged_garbage_even_nan_counts_as_equal_and_a_changed_nan_is_infinite() -> None:
    before = cache()[None, 0]
    before[0, 0, 20:] = float("nan")  # garbage past the prompt, the same on both sides
    after = before.clone()
    assert float(relative_differences(before, after)[0]) == 0.0
    after[0, 1, 5, 0] = float("nan")  # the recomputed token is not a number
    assert math.isinf(float(relative_differences(before, after)[0]))


def test_the_scale_is_the_changed_elements_not_stale_values_elsewhere() -> None:
    before = torch.zeros(1, HEADS, BLOCK, 2 * HEAD)
    before[0, :, 30:] = 1e6  # stale values, huge, not rewritten
    after = before.clone()
    after[0, :, 4] = torch.linspace(0.5, 1.0, 2 * HEAD)  # the token: 0 before, ~1 now
    assert float(relative_differences(before, after)[0]) > 0.9


def test_fp8_bytes_are_compared_as_the_values_they_hold() -> None:
    values = cache(7)[None, 0].to(torch.float8_e4m3fn)
    before = values.view(torch.uint8)
    after = before.clone()
    # One rounding step up (3 mantissa bits: 1/8 of the value at most).
    after.view(torch.float8_e4m3fn)[0, 0, 3] = (values[0, 0, 3].float() * 1.13).to(
        torch.float8_e4m3fn
    )
    difference = float(relative_differences(before, after, torch.float8_e4m3fn)[0])
    assert 0 < difference < tolerance_for("fp8", "float32")
    assert values_dtype("fp8") is torch.float8_e4m3fn
    assert values_dtype("fp8_e5m2") is torch.float8_e5m2
    assert values_dtype("auto") is None


def test_the_tolerance_follows_the_kv_dtype_and_auto_means_the_models() -> None:
    assert tolerance_for("auto", "float32") == 1e-3
    assert tolerance_for("auto", "torch.bfloat16") == tolerance_for("bfloat16", "float32")
    assert tolerance_for("fp8", "bfloat16") > tolerance_for("auto", "bfloat16")


def test_the_checked_block_is_the_last_prompt_tokens_in_each_token_group() -> None:
    groups = [[10, 11, 12], [20, 21, 22], [30]]
    # Position 64 (a prompt of 65 tokens) starts block 2; group 2 holds state.
    assert check_slots(65, 32, groups, (False, False, True)) == ((0, 12), (1, 22))
    assert check_slots(64, 32, groups, (False, False, True)) == ((0, 11), (1, 21))
    assert check_slots(0, 32, groups, ()) == ()


def test_a_load_is_checked_only_in_the_step_that_computes_its_last_token() -> None:
    plan_ = CheckPlan(32, (False,))
    spec = ReceiveSpec("r", "t", ((5, 6),), "prefill", "addr")
    planned = plan_.plan(spec, 40, [[5, 6]])
    assert planned.check == ((0, 6),) and planned.position == 39
    assert plan_.plan(ReceiveSpec("s", "u", ((7,),), "p", "a"), 0, [[7]]).check == ()
    plan_.plan(ReceiveSpec("x", "v", ((8,),), "p", "a"), 40, [[8, 9]])
    plan_.plan(ReceiveSpec("y", "w", ((1,),), "p", "a"), 40, [[1, 2]])
    check: list[str] = []
    uncheck: list[str] = []
    new = [
        SimpleNamespace(req_id="other", num_computed_tokens=0),
        SimpleNamespace(req_id="r", num_computed_tokens=39),  # the load's first forward
        SimpleNamespace(req_id="x", num_computed_tokens=0),  # failed: recomputes from 0
    ]
    plan_.scheduled(new, check, uncheck)
    assert (check, uncheck) == (["r"], ["x"])
    assert plan_.forget(["y", "r", "nobody"]) == ["y"]


def test_what_is_kept_is_bounded_in_bytes_the_oldest_going_unchecked() -> None:
    group = layers(2)
    block_bytes = group[0][2][0].nbytes * len(group)
    check = LoadChecks((group,), 1e-3, max_bytes=2 * block_bytes)
    for n in range(3):
        check.plan(f"r{n}", plan(block=n))
        check.landed({f"r{n}"}, set())
    for _, _, layer in group:
        layer[0:3] += 1  # every kept block changed: each checked one is a finding
    findings, differences = check.after_forward(["r0", "r1", "r2"])
    assert [f.request_id for f in findings] == ["r1", "r2"]  # r0 was dropped, unchecked
    assert [r for r, _ in differences] == ["r1", "r2"]
