"""The tier's worker side (daemon/client/vllm/tier/copier.py) against a real daemon.

No vLLM server: the worker gets tensors laid out as vLLM's canonical KV
(one int8 tensor per layer, ``(num_blocks, page_bytes)``) and jobs as
vLLM's offloading connector hands them, and maps the daemon's real pool.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
)

from daemon.client import BlockingEngineClient
from daemon.client.vllm.tier.copier import TierWorker
from daemon.client.vllm.tier.geometry import ChunkGeometry
from daemon.client.vllm.tier.jobs import TierLoad, TierStore
from daemon.sim.launcher import Daemon, free_port

PAGE = 4096
LAYERS = 2
BLOCKS = 8
SLOTS = 16
NS = "ns-worker"


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Daemon]:
    made = Daemon(
        "tier", tmp_path, free_port(), extra=f"[offload]\nslots = {SLOTS}\nslot_bytes = 8192"
    ).start()
    yield made
    assert made.stop() == 0, made.logs()


def _worker(daemon: Daemon, tensors: list[torch.Tensor]) -> TierWorker:
    caches = CanonicalKVCaches(
        [CanonicalKVCacheTensor(t, PAGE) for t in tensors],
        [[CanonicalKVCacheRef(i, PAGE) for i in range(LAYERS)]],
    )
    geometry = ChunkGeometry(1, 32, ((PAGE,) * LAYERS,))
    return TierWorker(caches, geometry, daemon.socket, "worker", NS)


def _kv(seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randint(-128, 127, (BLOCKS, PAGE), dtype=torch.int8, generator=generator)
        for _ in range(LAYERS)
    ]


def _job(blocks: list[int]) -> GPULoadStoreSpec:
    return GPULoadStoreSpec(blocks, group_sizes=[len(blocks)], block_indices=[0])


def _stored(client: BlockingEngineClient, keys: list[bytes]) -> tuple[list[int], ...]:
    """Wait until ``keys`` are committed; their (slots, generations, digests)."""
    deadline = time.monotonic() + 10
    while True:
        leased = client.offload_lease("reader", NS, keys)
        if -1 not in leased.slots:
            return list(leased.slots), list(leased.generations), list(leased.digests)
        assert time.monotonic() < deadline, "the store was not published"
        client.offload_unlease(
            "reader",
            [s for s in leased.slots if s >= 0],
            [g for s, g in zip(leased.slots, leased.generations, strict=True) if s >= 0],
        )
        time.sleep(0.05)


def test_a_store_and_a_load_move_every_layer_page_of_every_block_exactly(daemon: Daemon) -> None:
    source, target = _kv(1), [torch.zeros(BLOCKS, PAGE, dtype=torch.int8) for _ in range(LAYERS)]
    writer = _worker(daemon, source)
    with BlockingEngineClient.connect(daemon.socket) as client:
        granted = client.offload_grant("worker", 3)
        keys = [b"w0", b"w1", b"w2"]
        writer.submit_store(1, _job([5, 2, 7]), TierStore(granted.slots, granted.generations, keys))
        assert [r.job_id for r in writer.get_finished()] == [1]
        slots, generations, digests = _stored(client, keys)
        reader = _worker(daemon, target)
        reader.submit_load(2, TierLoad(slots, generations, digests), _job([0, 1, 3]))
        assert not reader.take_load_errors()
        for layer in range(LAYERS):
            for got, put in ((0, 5), (1, 2), (3, 7)):
                assert torch.equal(target[layer][got], source[layer][put]), (layer, got)
            assert not target[layer][2].any()  # untouched
        reader.shutdown()
    writer.shutdown()


def test_a_load_that_is_not_what_was_committed_is_load_errors_and_the_slot_condemned(
    daemon: Daemon,
) -> None:
    target = [torch.zeros(BLOCKS, PAGE, dtype=torch.int8) for _ in range(LAYERS)]
    worker = _worker(daemon, _kv(2))
    with BlockingEngineClient.connect(daemon.socket) as client:
        granted = client.offload_grant("worker", 1)
        worker.submit_store(1, _job([4]), TierStore(granted.slots, granted.generations, [b"c"]))
        slots, generations, _ = _stored(client, [b"c"])
        reader = _worker(daemon, target)
        # A digest that is not the slot's: its blocks are load errors, never served.
        reader.submit_load(2, TierLoad(slots, generations, [b"nope"]), _job([6]))
        assert reader.take_load_errors() == {6}
        assert [r.job_id for r in reader.get_finished()] == [2]
        # ...and the slot leaves the index: nobody finds the key again.
        deadline = time.monotonic() + 10
        while client.offload_lease("other", NS, [b"c"]).slots != (-1,):
            assert time.monotonic() < deadline, "the slot was not condemned"
            time.sleep(0.05)
        client.offload_unlease("reader", slots, generations)
        reader.shutdown()
    worker.shutdown()


def test_slots_outside_the_mapped_pool_never_raise_into_vllm(daemon: Daemon) -> None:
    worker = _worker(daemon, _kv(3))
    # A load from a slot the pool does not have, and one from no lease (-1).
    worker.submit_load(1, TierLoad([SLOTS + 5], [0], [b"x"]), _job([1]))
    worker.submit_load(2, TierLoad([-1], [-1], [b""]), _job([2]))
    assert worker.take_load_errors() == {1, 2}
    # A store into a slot the pool does not have stores nothing and raises nothing.
    worker.submit_store(3, _job([3]), TierStore([SLOTS + 1], [0], [b"k"]))
    assert sorted(r.job_id for r in worker.get_finished()) == [1, 2, 3]
    worker.shutdown()
