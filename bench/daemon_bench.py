"""The daemon path against bare NIXL, in one run.

1. A 256 MiB push through two daemons (engine -> prefill daemon -> NIXL ->
   decode daemon -> engine) against the same descriptors pushed by bare NIXL
   agents in two processes, for 64 KiB and 1 MiB blocks.
2. The full lifecycle rate of one-block requests with the batch fsync policy.
3. The latency one request adds over a bare NIXL write with notification.
4. The idle CPU of each daemon.

Run from the repository root: .venv/bin/python -m bench.daemon_bench
Results go to bench/RESULTS.md ("Daemon vs bare NIXL").
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.nixl_bare import MIB, run_bare
from bench.results import write_section
from daemon.client import EngineClient
from daemon.dataplane.memory import create_shm_file
from daemon.journal.stats import percentile
from daemon.sim.launcher import Daemon, cpu_seconds, daemon_pair
from schemas import rpc
from schemas.kvlayout import GroupSpec, LayerSpec
from schemas.layout import GroupKind, Role

KIB = 1024


async def push_through_daemons(
    pair: tuple[Daemon, Daemon], block_bytes: int, total: int, runs: int
) -> list[float]:
    """Seconds from kv_ready to BlocksFreeable for one all-blocks request, per run.

    Raw engine clients, not simulated engines: the simulated engine checks
    its whole cache on every event, which would be timed along with the push.
    The bytes are compared once, untimed, after the last run.
    """
    prefill, decode = pair
    n = total // block_bytes
    tag = f"{block_bytes // KIB}k"
    p, p_path = await _engine(prefill.socket, f"bp-{tag}", n, block_bytes)
    d, d_path = await _engine(decode.socket, f"bd-{tag}", n, block_bytes)
    src = np.memmap(p_path, dtype=np.uint8, mode="r+")
    dst = np.memmap(d_path, dtype=np.uint8, mode="r+")
    src[:] = np.random.default_rng(block_bytes).integers(0, 256, total, dtype=np.uint8)
    dst[:] = 0  # touch every page so the first run does not pay for page faults
    seconds = []
    try:
        for run in range(runs + 1):  # the first run warms the UCX connection up
            rid = f"big-{tag}-{run}"
            await d.register_request(
                f"bd-{tag}", rid, Role.RECEIVER, [list(range(n))], peer="prefill"
            )
            await p.register_request(f"bp-{tag}", rid, Role.PUSHER, [list(range(n))])
            t0 = time.perf_counter()
            await p.kv_ready(rid)
            freed = await p.next_event(timeout=60)
            elapsed = time.perf_counter() - t0
            arrived = await d.next_event(timeout=60)
            assert isinstance(freed, rpc.BlocksFreeable), freed
            assert isinstance(arrived, rpc.KvArrived), arrived
            if run:
                seconds.append(elapsed)
            await d.release(rid)
            await p.release(rid)
        assert np.array_equal(src, dst), "the destination does not hold the source bytes"
    finally:
        del src, dst
        await p.close()
        await d.close()
        os.unlink(p_path)
        os.unlink(d_path)
    return seconds


async def _engine(
    sock: str, engine_id: str, blocks: int, block_bytes: int = 4096
) -> tuple[EngineClient, str]:
    path = f"/dev/shm/kvpushd-bench-{engine_id}-{os.getpid()}"
    region = create_shm_file(path, blocks * block_bytes)
    client = await EngineClient.connect(sock, queue_events=True)
    groups = (GroupSpec(GroupKind.ATTENTION, blocks, block_bytes, (LayerSpec(region.name),)),)
    await client.register_engine(engine_id, groups, (region,))
    return client, path


async def lifecycle_rate(
    pair: tuple[Daemon, Daemon], n: int, concurrency: int
) -> tuple[float, list[float]]:
    """Requests/s of the whole lifecycle for one-block requests, and per-request latencies."""
    prefill, decode = pair
    blocks = concurrency * 2
    p_id, d_id = f"rate-p{concurrency}", f"rate-d{concurrency}"
    p, p_path = await _engine(prefill.socket, p_id, blocks)
    d, d_path = await _engine(decode.socket, d_id, blocks)
    arrived: dict[str, asyncio.Future[None]] = {}
    freed: dict[str, asyncio.Future[None]] = {}

    async def pump(client: EngineClient, waiters: dict[str, asyncio.Future[None]]) -> None:
        async for event in client.events():
            future = waiters.get(event.request_id)
            if future is not None and not future.done():
                future.set_result(None)

    pumps = [asyncio.create_task(pump(d, arrived)), asyncio.create_task(pump(p, freed))]
    free_slots = asyncio.Queue[int]()
    for slot in range(blocks):
        free_slots.put_nowait(slot)
    latencies: list[float] = []
    loop = asyncio.get_running_loop()

    async def one(i: int) -> None:
        slot = await free_slots.get()
        rid = f"c{concurrency}-{i}"
        arrived[rid] = loop.create_future()
        freed[rid] = loop.create_future()
        t0 = time.perf_counter()
        await d.register_request(d_id, rid, Role.RECEIVER, [[slot]], peer="prefill")
        await p.register_request(p_id, rid, Role.PUSHER, [[slot]])
        t_kv = time.perf_counter()
        await p.kv_ready(rid)
        await asyncio.gather(arrived[rid], freed[rid])
        del arrived[rid], freed[rid]
        latencies.append(time.perf_counter() - (t0 if concurrency > 1 else t_kv))
        await asyncio.gather(d.release(rid), p.release(rid))
        free_slots.put_nowait(slot)

    sem = asyncio.Semaphore(concurrency)

    async def bounded(i: int) -> None:
        async with sem:
            await one(i)

    t0 = time.perf_counter()
    await asyncio.gather(*(bounded(i) for i in range(n)))
    elapsed = time.perf_counter() - t0
    for task in pumps:
        task.cancel()
    await p.close()
    await d.close()
    for path in (p_path, d_path):
        os.unlink(path)
    return n / elapsed, latencies


async def single_latency(pair: tuple[Daemon, Daemon], n: int) -> list[float]:
    """One request at a time, one 4 KiB block: kv_ready -> KvArrived + BlocksFreeable."""
    _, latencies = await lifecycle_rate(pair, n, 1)
    return latencies


def pct(values: list[float], q: float) -> float:
    return percentile(sorted(values), q)


async def daemon_part(args: argparse.Namespace, workdir: Path) -> dict:
    pair = daemon_pair(workdir)
    for daemon in pair:
        daemon.start()
    pair[1].wait_peer("prefill")
    out: dict = {}
    try:
        for block in (64 * KIB, MIB):
            out[("push", block)] = await push_through_daemons(
                pair, block, args.total_mib * MIB, args.runs
            )
        out["rate"], out["rate_lat"] = await lifecycle_rate(pair, args.requests, 32)
        out["single"] = await single_latency(pair, 500)
        before = {d.node: cpu_seconds(d.proc.pid) for d in pair}
        await asyncio.sleep(5.0)
        out["idle"] = {d.node: (cpu_seconds(d.proc.pid) - before[d.node]) / 5.0 for d in pair}
    finally:
        for daemon in pair:
            daemon.stop()
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--total-mib", type=int, default=256)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--requests", type=int, default=3000)
    args = parser.parse_args()
    bare = {
        r.block_bytes: r
        for r in run_bare(
            (64 * KIB, MIB),
            total_bytes=args.total_mib * MIB,
            runs=args.runs,
            layouts=("contiguous",),
        )
    }
    bare_one = run_bare((4 * KIB,), total_bytes=4 * KIB, runs=200, layouts=("contiguous",))[0]
    with tempfile.TemporaryDirectory() as tmp:
        out = asyncio.run(daemon_part(args, Path(tmp)))
    total = args.total_mib * MIB
    lines = ["| measurement | daemon path | bare NIXL | ratio | target |", "|---|---|---|---|---|"]
    for block in (64 * KIB, MIB):
        daemon_gbps = total / statistics.median(out[("push", block)]) / 1e9
        bare_gbps = bare[block].gbps
        lines.append(
            f"| {args.total_mib} MiB push, {block // KIB} KiB blocks | {daemon_gbps:.2f} GB/s | "
            f"{bare_gbps:.2f} GB/s | {daemon_gbps / bare_gbps:.2f}x | >= 0.9x |"
        )
    lines.append(
        f"| lifecycle rate, one-block requests, batch fsync, 32 in flight "
        f"({args.requests} requests) | {out['rate']:,.0f} req/s | | | >= 3,000 req/s |"
    )
    single = out["single"]
    bare_s = bare_one.median_s
    lines.append(
        f"| one 4 KiB request alone, kv_ready -> KvArrived + BlocksFreeable, "
        f"p50 / p99 | {pct(single, 50) * 1e3:.2f} / {pct(single, 99) * 1e3:.2f} ms | "
        f"{bare_s * 1e6:.0f} us (post -> DONE, with notification) | | |"
    )
    lines.append(
        f"| latency added over bare NIXL, p50 / p99 | {(pct(single, 50) - bare_s) * 1e3:.2f} / "
        f"{(pct(single, 99) - bare_s) * 1e3:.2f} ms | | | p99 <= 1 ms |"
    )
    for node, frac in out["idle"].items():
        lines.append(f"| idle CPU, {node} daemon | {frac * 100:.1f} % of a core | | | ~0 |")
    body = "\n".join(lines)
    print(body)
    write_section(
        "Daemon vs bare NIXL",
        f"{time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}; DRAM, UCX (cma), bare = two processes, prepped dlists",
        body,
    )


if __name__ == "__main__":
    main()
