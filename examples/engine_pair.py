"""Two engines, one KV transfer each way, every byte checked.

The README's "Integrating an engine" walks through this file and shows how
to start the two daemons it needs (they peer with each other, one per
engine). Run it as their user, with their sockets and node names:

    python examples/engine_pair.py /tmp/kvpushd-a.sock a /tmp/kvpushd-b.sock b

It prints one line per transfer and exits 0 when the bytes arrived intact.
"""

from __future__ import annotations

import argparse
import asyncio
import mmap
import os

import torch

from daemon.client import EngineClient, create_kv_memfd
from schemas import rpc
from schemas.kvlayout import GroupSpec, LayerSpec, RegionSpec
from schemas.layout import GroupKind, Role

NUM_BLOCKS = 16
BLOCK_BYTES = 4096  # one block of one layer
LAYERS = 2
REGION_BYTES = LAYERS * NUM_BLOCKS * BLOCK_BYTES  # 128 KiB: the whole cache


class Engine:
    """An engine's KV cache in a sealed memfd, and its connection to its own daemon."""

    def __init__(self, name: str, node: str, client: EngineClient, fd: int) -> None:
        self.name, self.node, self.client, self.fd = name, node, client, fd
        self.kv = torch.frombuffer(mmap.mmap(fd, REGION_BYTES), dtype=torch.uint8)
        # kv[layer, block] is block `block` of layer `layer`: BLOCK_BYTES bytes.
        self.kv = self.kv.view(LAYERS, NUM_BLOCKS, BLOCK_BYTES)

    @classmethod
    async def start(cls, name: str, socket: str, node: str) -> Engine:
        # No file: the memory goes to the daemon as a descriptor with the Hello.
        fd = create_kv_memfd(f"example-{name}", REGION_BYTES)
        client = await EngineClient.connect(socket, descriptors=(fd,))
        engine = cls(name, node, client, fd)
        # Layer l's blocks start at l * NUM_BLOCKS * BLOCK_BYTES in region "kv".
        layers = tuple(LayerSpec("kv", layer * NUM_BLOCKS * BLOCK_BYTES) for layer in range(LAYERS))
        groups = (GroupSpec(GroupKind.ATTENTION, NUM_BLOCKS, BLOCK_BYTES, layers),)
        region = RegionSpec("kv", REGION_BYTES, descriptor=0)  # the Hello's first descriptor
        await client.register_engine(name, groups, (region,))
        return engine

    async def wait_for(self, request_id: str, kind: type) -> None:
        """The event ``kind`` for ``request_id``; a failure ends the example."""
        while True:
            event = await self.client.next_event(timeout=30)
            if isinstance(event, rpc.RequestFailed):
                raise SystemExit(f"{request_id} failed: {event.reason}: {event.message}")
            if isinstance(event, kind) and event.request_id == request_id:
                return

    async def release(self, request_id: str) -> None:
        if isinstance(await self.client.release(request_id), rpc.Deferred):
            await self.wait_for(request_id, rpc.Released)  # a write was still in flight

    async def close(self) -> None:
        await self.client.close()
        os.close(self.fd)  # the daemon lets go of its copy once the engine is gone


async def transfer(request_id: str, prefill: Engine, decode: Engine, prefill_first: bool) -> None:
    """Push 4 computed blocks from ``prefill``; ``decode`` already holds the first."""
    src = [1, 2, 3, 4]  # the prefill engine's blocks of the whole sequence
    dst = [10, 11, 12]  # the decode engine's blocks still to fill: its prefix cache has the 1st
    prefill.kv[:, src] = torch.randint(0, 256, (LAYERS, len(src), BLOCK_BYTES), dtype=torch.uint8)
    before = decode.kv.clone()

    async def register_prefill() -> None:
        await prefill.client.register_request(prefill.name, request_id, Role.PUSHER, [src])
        await prefill.client.kv_ready(request_id)  # the KV above is computed

    async def register_decode() -> None:
        await decode.client.register_request(
            decode.name, request_id, Role.RECEIVER, [dst], peer=prefill.node
        )

    # Either side may register first; the write starts once both have.
    order = [register_prefill, register_decode]
    for register in order if prefill_first else reversed(order):
        await register()
    await decode.wait_for(request_id, rpc.KvArrived)
    await prefill.wait_for(request_id, rpc.BlocksFreeable)
    # The decode side's blocks hold the prefill side's *last* blocks.
    assert torch.equal(decode.kv[:, dst], prefill.kv[:, src[-len(dst) :]]), "KV differs"
    others = [block for block in range(NUM_BLOCKS) if block not in dst]
    assert torch.equal(decode.kv[:, others], before[:, others]), "a block outside dst changed"
    await decode.release(request_id)
    await prefill.release(request_id)
    print(f"{request_id}: {prefill.name} -> {decode.name}, {len(dst) * LAYERS} blocks checked")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("socket_a")
    parser.add_argument("node_a")
    parser.add_argument("socket_b")
    parser.add_argument("node_b")
    args = parser.parse_args()
    a = await Engine.start("engine-a", args.socket_a, args.node_a)
    b = await Engine.start("engine-b", args.socket_b, args.node_b)
    try:
        await transfer("req-a-to-b", prefill=a, decode=b, prefill_first=True)
        await transfer("req-b-to-a", prefill=b, decode=a, prefill_first=False)
    finally:
        await a.close()
        await b.close()


if __name__ == "__main__":
    asyncio.run(main())
