"""The offload tier's round trips per block, through the blocking client against a real daemon.

What a tier client pays per stored block (``offload_grant`` + one copy into
the slot + ``offload_store``, answered once durable) and per loaded block
(``offload_lease`` + ``offload_unlease``, answered at once; the copy out of
the slot is the reader's and timed apart), in batches of 1, 16 and 256
blocks, one call of each kind per batch (README.md, "Offload tier"). The
digest a real writer computes is not included (a fixed one is sent).

    python -m bench.offload_tier               # records its section in bench/RESULTS.md
    python -m bench.offload_tier --no-record   # prints it only
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.results import load_average, machine, write_section
from daemon.client import BlockingEngineClient
from daemon.client.pool import AttachedPool, attach_pool
from daemon.sim.launcher import Daemon, free_port

TITLE = "Issue 48: the offload tier's round trips per block (bench/offload_tier.py)"
SLOT_BYTES = 16 * 1024
SLOTS = 8192
BATCHES = (1, 16, 256)
NS = "bench"
DIGEST = bytes(32)


def _grant(
    client: BlockingEngineClient, holder: str, n: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    while True:
        granted = client.offload_grant(holder, n)
        if len(granted.slots) == n:
            return granted.slots, granted.generations
        if granted.slots:
            raise RuntimeError(f"a grant of {n} came back short: {granted.slots}")
        time.sleep(0.01)  # the reset task frees slots


def store_round(
    client: BlockingEngineClient, pool: AttachedPool, block: bytes, n: int, serial: int
) -> float:
    start = time.perf_counter()
    slots, generations = _grant(client, "writer", n)
    for slot in slots:
        pool.view(slot)[:] = block
    keys = [f"{serial}-{i}".encode() for i in range(n)]
    flags = client.offload_store("writer", NS, slots, generations, keys, [DIGEST] * n)
    elapsed = time.perf_counter() - start
    assert all(flags), flags
    return elapsed


def lease_round(client: BlockingEngineClient, keys: list[bytes]) -> float:
    start = time.perf_counter()
    leased = client.offload_lease("reader", NS, keys)
    client.offload_unlease("reader", leased.slots, leased.generations)
    elapsed = time.perf_counter() - start
    assert -1 not in leased.slots
    return elapsed


def miss_round_trip(client: BlockingEngineClient, rounds: int) -> float:
    """One call that journals nothing (a lease of a key never stored), median µs: the floor."""
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        client.offload_lease("reader", NS, [b"never stored"])
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def copy_out(pool: AttachedPool, rounds: int) -> float:
    """One block copied out of a slot (what a reader adds per loaded block), median µs."""
    into = bytearray(SLOT_BYTES)
    times = []
    for i in range(rounds):
        start = time.perf_counter()
        into[:] = pool.view(i % 64)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def run(rounds: int) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        config = f"[offload]\nslots = {SLOTS}\nslot_bytes = {SLOT_BYTES}\nreserve = 512"
        daemon = Daemon("bench-tier", Path(tmp), free_port(), extra=config)
        daemon.start()
        try:
            rows = []
            with (
                BlockingEngineClient.connect(daemon.socket) as client,
                attach_pool(daemon.socket, "writer") as pool,
            ):
                block = bytes(range(256)) * (SLOT_BYTES // 256)
                serial = 0
                for n in BATCHES:
                    count = max(8, rounds // n)
                    stores, leases = [], []
                    for _ in range(count):
                        serial += 1
                        stores.append(store_round(client, pool, block, n, serial) / n)
                        keys = [f"{serial}-{i}".encode() for i in range(n)]
                        leases.append(lease_round(client, keys) / n)
                    rows.append(
                        f"| {n} | {count} | {statistics.median(stores) * 1e6:.0f} "
                        f"| {statistics.median(leases) * 1e6:.0f} |"
                    )
                copy_us = copy_out(pool, 1000)
                floor_us = miss_round_trip(client, 500)
        finally:
            daemon.stop()
    header = (
        "| blocks per call | rounds | grant + copy in + store, µs per block "
        "| lease + unlease, µs per block |\n|---|---|---|---|"
    )
    note = (
        f"\n\nA {SLOT_BYTES // 1024} KiB block copied out of a slot (the reader's, beside "
        f"lease + unlease): {copy_us:.1f} µs. One call that journals nothing (a lease "
        f"that misses): {floor_us:.0f} µs, the floor of every call through the blocking "
        "client. Medians over the rounds; a grant and a store each wait for their group "
        "commit's fdatasync, a lease and an unlease do not."
    )
    return header + "\n" + "\n".join(rows) + note


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=512, help="blocks per batch size")
    parser.add_argument("--no-record", action="store_true", help="print, do not record")
    args = parser.parse_args(argv)
    body = run(args.rounds)
    busy = "loaded: other work ran beside it" if os.getloadavg()[0] >= 1 else "not loaded"
    context = (
        f"{time.strftime('%Y-%m-%d')}, {machine()}, load {load_average()} at the end "
        f"({busy}); one "
        f"daemon ([offload] {SLOTS} slots of {SLOT_BYTES // 1024} KiB, memfd, journal "
        "fsync batch) and one blocking client in this process, each batch one call of "
        "each kind."
    )
    print(f"## {TITLE}\n\n{context}\n\n{body}")
    if not args.no_record:
        write_section(TITLE, context, body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
