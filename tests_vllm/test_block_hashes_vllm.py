"""Block hashes computed by vLLM's own functions, paired by two real daemons.

The connector names each block with vLLM's prefix-cache block hash
(daemon/client/vllm/hashes.py, over real ``vllm.v1.request.Request``
objects here), so what vLLM's prefix cache tells apart, the pairing does
too: a LoRA adapter on one leg and not the other (or another adapter),
other prompt embeddings behind the same placeholder ids, another cache
salt. vLLM's CPU build here serves none of those on a P/D pair's tiny
model, so the two legs' registrations come from simulated engines on two
real daemons, with the contents the connector would compute. Each such
pair is refused (``content_mismatch``) before a byte moves; equal requests
push as usual.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from vllm import SamplingParams
from vllm.lora.request import LoRARequest
from vllm.v1.request import Request

from daemon.client.vllm.hashes import block_hashes, content, prompt_block_count
from daemon.sim.engine import Expectation, SimEngine, SimGroup, tail_pairs
from daemon.sim.launcher import Daemon, start_pair, wait_idle
from schemas import rpc
from schemas.events import Failed, WriteStarted
from schemas.layout import Role
from schemas.reasons import Reason

BLOCK = 32
PROMPT = [random.Random(3).randrange(2, 512) for _ in range(80)]  # 3 blocks, the last partial
LAYOUT = [SimGroup(num_blocks=32, block_bytes=2048, layers=2)]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Daemon, Daemon]]:
    daemons = start_pair(tmp_path_factory.mktemp("hashes"))
    yield daemons
    codes = [d.stop() for d in daemons]
    assert codes == [0, 0], [d.logs() for d in daemons]


def _request(**fields: Any) -> Request:
    return Request("r", list(PROMPT), SamplingParams(max_tokens=1), None, **fields)


def _content(request: Request, first: int = 0) -> str:
    count = prompt_block_count(len(PROMPT), BLOCK)
    named = ((first, tuple(range(first, count))),)
    return content(named, block_hashes(request, BLOCK, count))


def _embeds(seed: int) -> torch.Tensor:
    return torch.randn(len(PROMPT), 16, generator=torch.Generator().manual_seed(seed))


LEGS = {
    "a LoRA adapter on the decode leg only": (
        _request(),
        _request(lora_request=LoRARequest("a", 1, "/loras/a")),
    ),
    "another adapter under the same name": (
        _request(lora_request=LoRARequest("a", 1, "/loras/a")),
        _request(lora_request=LoRARequest("a", 1, "/loras/a-v2")),
    ),
    "other prompt embeddings": (
        _request(prompt_embeds=_embeds(1)),
        _request(prompt_embeds=_embeds(2)),
    ),
    "another cache salt": (_request(cache_salt="tenant-1"), _request(cache_salt="tenant-2")),
}  # fmt: skip


async def _push(
    pair: tuple[Daemon, Daemon], rid: str, p_content: str, d_content: str, *, refused: bool
) -> Any:
    prefill, decode = pair
    pe = await SimEngine.create(f"p-{rid}", Role.PUSHER, LAYOUT, prefill.socket)
    de = await SimEngine.create(f"d-{rid}", Role.RECEIVER, LAYOUT, decode.socket)
    try:
        src, dst = [[1, 2, 3]], [[10, 11, 12]]
        expect = Expectation(pe.engine_id, tail_pairs(pe.layout, src, de.layout, dst))
        await de.decode_register(rid, dst, "prefill", expect=expect, content=d_content)
        # A refused pairing fails the pusher at its registration: no kv_ready follows.
        await pe.prefill(rid, src, content=p_content, kv_ready=not refused)
        outcome = await de.wait_event(rid, (rpc.KvArrived, rpc.RequestFailed))
        await de.release(rid)
        await pe.release(rid)
        return outcome
    finally:
        await pe.close()
        await de.close()


@pytest.mark.parametrize("case", list(LEGS))
def test_legs_vllms_prefix_cache_tells_apart_are_never_paired(pair, case: str) -> None:
    prefill_request, decode_request = LEGS[case]
    rid = "legs-" + case.replace(" ", "-")
    failed = asyncio.run(
        _push(pair, rid, _content(prefill_request), _content(decode_request), refused=True)
    )
    assert isinstance(failed, rpc.RequestFailed), failed
    assert failed.reason == Reason.CONTENT_MISMATCH
    assert "the decode's block for prompt block 0" in failed.message, failed.message
    assert "the prefill holds no block with that hash" in failed.message
    wait_idle(*pair)
    for daemon in pair:
        events = daemon.journal_events(rid)
        assert not [e for e in events if isinstance(e, WriteStarted)], events
        assert [e.reason for e in events if isinstance(e, Failed)] == [Reason.CONTENT_MISMATCH]


def test_equal_requests_are_paired_and_pushed(pair) -> None:
    for n, (p, _) in enumerate(LEGS.values()):
        same = _content(p)
        assert same == _content(p)  # deterministic: the chain's seed is the connector's own
        arrived = asyncio.run(_push(pair, f"equal-{n}", same, same, refused=False))
        assert isinstance(arrived, rpc.KvArrived), arrived
    wait_idle(*pair)
