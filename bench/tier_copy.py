"""What the offload tier's worker costs per block: its copies and digests, without vLLM's engine.

    .venv-vllm/bin/python -m bench.tier_copy [--blocks 256] [--layers 2] [--no-record]

A real daemon with a pool; the tier's worker (daemon/client/vllm/tier/copier.py
``TierWorker``) over torch tensors laid out as vLLM's canonical KV (one
int8 tensor per layer, ``(num_blocks, page_bytes)``) stores jobs of 16
blocks into granted slots and loads them back, as vLLM's offloading
connector hands them; µs per block, median of the rounds. The store's
publish (the daemon round trip) is off the job's path and not counted here
(bench/offload_tier.py measures the round trips).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
)

from bench.results import load_average, machine, write_section
from daemon.client import BlockingEngineClient
from daemon.client.vllm.tier.copier import TierWorker
from daemon.client.vllm.tier.geometry import ChunkGeometry
from daemon.client.vllm.tier.jobs import TierLoad, TierStore
from daemon.sim.launcher import Daemon, free_port

PAGE = 32 * 1024  # one layer's page of one 32-token block of the tiny llama (fp32)
JOB = 16


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args(argv)
    slot_bytes = -(-PAGE * args.layers // 4096) * 4096
    tensors = [
        torch.randint(-128, 127, (args.blocks, PAGE), dtype=torch.int8) for _ in range(args.layers)
    ]
    caches = CanonicalKVCaches(
        [CanonicalKVCacheTensor(t, PAGE) for t in tensors],
        [[CanonicalKVCacheRef(i, PAGE) for i in range(args.layers)]],
    )
    geometry = ChunkGeometry(1, 32, ((PAGE,) * args.layers,))
    stores: list[float] = []
    loads: list[float] = []
    with tempfile.TemporaryDirectory(prefix="tier-copy-") as tmp:
        pool = f"[offload]\nslots = {2 * args.blocks}\nslot_bytes = {slot_bytes}"
        daemon = Daemon("tier", Path(tmp), free_port(), extra=pool).start()
        try:
            worker = TierWorker(caches, geometry, daemon.socket, "bench", "ns-bench")
            with BlockingEngineClient.connect(daemon.socket) as client:
                for _ in range(args.rounds):
                    granted = _grant(client, args.blocks)
                    stores.append(_run(worker, granted, args.blocks, store=True))
                    loads.append(_run(worker, granted, args.blocks, store=False))
            worker.shutdown()
        finally:
            daemon.stop()
    rows = [
        "| per block | µs | GB/s |",
        "|---|---|---|",
        f"| store (copy + crc32c) | {statistics.median(stores):.1f} | "
        f"{PAGE * args.layers / statistics.median(stores) / 1e3:.2f} |",
        f"| load (copy + crc32c) | {statistics.median(loads):.1f} | "
        f"{PAGE * args.layers / statistics.median(loads) / 1e3:.2f} |",
    ]
    table = "\n".join(rows)
    print(table)
    if not args.no_record:
        write_section(
            "Offload tier: the worker's cost per block (bench/tier_copy.py)",
            f"{time.strftime('%Y-%m-%d')}, {machine()}, load {load_average()}: "
            f"`.venv-vllm/bin/python -m bench.tier_copy`: blocks of {args.layers} layers x "
            f"{PAGE // 1024} KiB, jobs of {JOB} blocks, median of {args.rounds} rounds of "
            f"{args.blocks} blocks; torch with its default threads.",
            table,
        )
    return 0


def _grant(client: BlockingEngineClient, n: int) -> list[tuple[int, int]]:
    granted: list[tuple[int, int]] = []
    while len(granted) < n:
        reply = client.offload_grant("bench", n - len(granted))
        granted += list(zip(reply.slots, reply.generations, strict=True))
        if not reply.slots:
            time.sleep(0.05)
    return granted


def _run(worker: TierWorker, granted: list[tuple[int, int]], blocks: int, *, store: bool) -> float:
    """µs per block of ``blocks`` blocks in jobs of JOB."""
    started = time.perf_counter()
    for first in range(0, blocks, JOB):
        ids = list(range(first, min(blocks, first + JOB)))
        gpu = GPULoadStoreSpec(ids, group_sizes=[len(ids)], block_indices=[first])
        slots = [granted[i][0] for i in ids]
        gens = [granted[i][1] for i in ids]
        if store:
            keys = [f"k{time.monotonic_ns()}-{i}".encode() for i in ids]
            worker.submit_store(first, gpu, TierStore(slots, gens, keys))
        else:
            worker.submit_load(first, TierLoad(slots, gens, [b"\0" * 4] * len(ids)), gpu)
    elapsed = time.perf_counter() - started
    worker.get_finished()
    worker.take_load_errors()
    return elapsed / blocks * 1e6


if __name__ == "__main__":
    raise SystemExit(main())
