"""What end-to-end integrity checks cost: the checksum per GB, and the push with them.

1. The checksum alone, in this process: the daemon's own code
   (daemon/dataplane/digest.py, crc32c per (group, layer, block)) over a
   /dev/shm mapping, for 4 KiB, 64 KiB and 1 MiB blocks; beside it xxhash's
   XXH3 (64-bit) over the same blocks, when the ``xxhash`` package is
   installed (it is not a dependency: ``pip install xxhash`` to compare).
   Also how much a thread spinning in Python gets done while a checksum of
   the whole region runs in another thread, against alone: does the
   checksum let go of the GIL?
2. Three daemon pairs (``kvpushd run`` processes), ``[integrity] verify`` =
   "off", "sample" (rate 0.01, the default) and "all", measured in
   interleaved rounds (the order rotates each round), each round per
   setting: a push of ``--total-mib`` in 64 KiB blocks (kv_ready ->
   KvArrived + BlocksFreeable, the median of ``--runs`` after a warm-up);
   one 4 KiB request alone, p50 and p99 (kv_ready -> both events); the full
   lifecycle rate of one-block requests, 32 in flight, and the CPU both
   daemons spent per lifecycle (from /proc: steadier than a rate on a
   shared machine). A ratio to "off" is
   taken within each round first; the table gives the median and the
   min-max over the rounds.

    .venv/bin/python -m bench.verify_bench [--rounds 5] [--no-record]
    .venv/bin/python -m bench.verify_bench --quick   # smoke run, never recorded

Results go to bench/RESULTS.md ("Integrity checks (verify)").
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.daemon_bench import BenchEngine, one_request, pct, spread
from bench.nixl_bare import MIB
from bench.results import load_average, machine, write_section
from daemon.dataplane import digest
from daemon.dataplane.memory import create_shm_file, map_dram_region
from daemon.sim.launcher import Daemon, cpu_seconds, start_pair
from schemas.config import VerifyMode
from schemas.kvlayout import EngineSpec, GroupSpec, LayerSpec
from schemas.layout import GroupKind
from statemachine.integrity import sampled

KIB = 1024
DIGEST_BLOCKS = (4 * KIB, 64 * KIB, MIB)
PUSH_BLOCK = 64 * KIB
SMALL = 4 * KIB
IN_FLIGHT = 32
SETTINGS = ("off", "sample", "all")
RATE = 0.01


@dataclass(frozen=True)
class Options:
    rounds: int
    total_mib: int
    runs: int
    requests: int
    single: int
    digest_mib: int


FULL = Options(rounds=5, total_mib=128, runs=3, requests=1000, single=200, digest_mib=256)
QUICK = Options(rounds=2, total_mib=16, runs=1, requests=100, single=20, digest_mib=32)


# ------------------------------------------------------------- 1: the checksum


def _xxh3() -> Callable[[Any], int] | None:
    try:
        import xxhash
    except ImportError:
        return None
    return xxhash.xxh3_64_intdigest  # type: ignore[no-any-return]


def _spin(stop: threading.Event) -> int:
    n = 0
    while not stop.is_set():
        n += 1
    return n


def _progress_while(work: Callable[[], object], seconds: float) -> float:
    """A Python loop's progress while ``work`` runs in a thread, per second, vs alone."""
    stop = threading.Event()
    t0 = time.perf_counter()
    timer = threading.Timer(seconds, stop.set)
    timer.start()
    alone = _spin(stop) / (time.perf_counter() - t0)
    stop.clear()
    worker = threading.Thread(target=lambda: (work(), stop.set()))
    t0 = time.perf_counter()
    worker.start()
    during = _spin(stop) / (time.perf_counter() - t0)
    worker.join()
    return during / alone


def digest_costs(o: Options) -> dict[str, Any]:
    size = o.digest_mib * MIB
    path = f"/dev/shm/kvpushd-bench-digest-{os.getpid()}"
    spec = create_shm_file(path, size)
    region = map_dram_region(spec, owner_uid=os.getuid())
    out: dict[str, Any] = {}
    try:
        region.view()[:] = np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8)
        xxh3 = _xxh3()
        for block in DIGEST_BLOCKS:
            n = size // block
            engine = EngineSpec(
                "bench", (GroupSpec(GroupKind.ATTENTION, n, block, (LayerSpec(spec.name),)),), ()
            )
            regions = {spec.name: region}
            ids = (tuple(range(n)),)
            times = []
            for _ in range(5):
                t0 = time.perf_counter()
                digest.digests(engine, regions, ids)
                times.append(time.perf_counter() - t0)
            out[("crc32c", block)] = statistics.median(times) / (size / 1e9)
            if xxh3 is not None:
                view = region.view()
                times = []
                for _ in range(5):
                    t0 = time.perf_counter()
                    for b in range(n):
                        xxh3(view[b * block : (b + 1) * block].data)
                    times.append(time.perf_counter() - t0)
                out[("xxh3", block)] = statistics.median(times) / (size / 1e9)
            if block == PUSH_BLOCK:
                work = functools.partial(digest.digests, engine, regions, ids)
                out["gil"] = _progress_while(work, 0.3)
        out["xxhash"] = xxh3 is not None
    finally:
        region.close()
        os.unlink(path)
    return out


# ------------------------------------------------------------- 2: the daemons


class Side:
    """One daemon pair under one setting, with a 64 KiB push pair and a 4 KiB pair."""

    def __init__(self, setting: str, pair: tuple[Daemon, Daemon], o: Options) -> None:
        self.setting = setting
        self.prefill, self.decode = pair
        self.o = o
        self.ids = 0
        self.push: tuple[BenchEngine, BenchEngine] | None = None
        self.timed: list[str] = []  # ids of the timed pushes
        self.small: tuple[BenchEngine, BenchEngine] | None = None

    def rid(self, tag: str) -> str:
        self.ids += 1
        return f"{self.setting}-{tag}-{self.ids}"

    async def open(self) -> None:
        n = self.o.total_mib * MIB // PUSH_BLOCK
        tag = self.setting
        p = await BenchEngine.open(self.prefill.socket, f"vp-{tag}", n, PUSH_BLOCK)
        d = await BenchEngine.open(self.decode.socket, f"vd-{tag}", n, PUSH_BLOCK)
        src = p.memory()
        src[:] = np.random.default_rng(n).integers(0, 256, n * PUSH_BLOCK, dtype=np.uint8)
        del src
        self.push = (p, d)
        self.small = (
            await BenchEngine.open(self.prefill.socket, f"vsp-{tag}", IN_FLIGHT * 2, SMALL),
            await BenchEngine.open(self.decode.socket, f"vsd-{tag}", IN_FLIGHT * 2, SMALL),
        )

    async def close(self) -> None:
        for engine in (*(self.push or ()), *(self.small or ())):
            await engine.close()

    async def push_gbs(self) -> float:
        assert self.push is not None
        p, d = self.push
        blocks = list(range(p.blocks))
        seconds = []
        for run in range(self.o.runs + 1):  # run 0 warms up
            rid = self.rid("push")
            _, t_kv, _, end = await one_request(p, d, rid, blocks, blocks)
            if run:
                seconds.append(end - t_kv)
                self.timed.append(rid)
        dst, src = d.memory(), p.memory()
        same = np.array_equal(dst[:: 4 * KIB + 1], src[:: 4 * KIB + 1])
        del dst, src
        if not same:
            raise RuntimeError(f"{self.setting}: wrong bytes after the push")
        return self.o.total_mib * MIB / statistics.median(seconds) / 1e9

    async def lifecycles(self, n: int, in_flight: int) -> tuple[float, list[float]]:
        assert self.small is not None
        p, d = self.small
        free = asyncio.Queue[int]()
        for slot in range(p.blocks):
            free.put_nowait(slot)
        latencies: list[float] = []
        sem = asyncio.Semaphore(in_flight)

        async def one() -> None:
            async with sem:
                slot = await free.get()
                _, t_kv, _, end = await one_request(p, d, self.rid("one"), [slot], [slot])
                latencies.append(end - t_kv)
                free.put_nowait(slot)

        t0 = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(n)))
        return n / (time.perf_counter() - t0), latencies

    async def measure(self) -> dict[str, float]:
        out = {"push": await self.push_gbs()}
        _, lone = await self.lifecycles(self.o.single, 1)
        out["p50"], out["p99"] = pct(lone, 50), pct(lone, 99)
        before = self.cpu()
        out["rate"], _ = await self.lifecycles(self.o.requests, IN_FLIGHT)
        after = self.cpu()
        out["cpu"] = sum(after.values()) - sum(before.values())
        out["cpu"] /= self.o.requests
        return out

    def cpu(self) -> dict[str, float]:
        """CPU seconds (user + system, all threads) of each daemon so far."""
        return {d.node: cpu_seconds(d.proc.pid) for d in (self.prefill, self.decode) if d.proc}

    def checked(self) -> str:
        """Requests the decode daemon compared checksums for, of all this side made;
        and how many of the timed pushes were among those chosen."""
        verify = VerifyMode(self.setting)
        pushes = sum(sampled(rid, verify, RATE) for rid in self.timed)
        made = self.decode.status()["counters"]["integrity_checked"]
        return f"{made} of {self.ids} ({pushes} of {len(self.timed)} timed pushes)"


def _extra(setting: str) -> str:
    return f'[integrity]\nverify = "{setting}"\nsample_rate = {RATE}'


async def interleaved(o: Options, workdir: Path) -> tuple[dict[str, list[dict]], dict[str, str]]:
    sides: list[Side] = []
    rounds: dict[str, list[dict[str, float]]] = {s: [] for s in SETTINGS}
    try:
        for setting in SETTINGS:
            folder = workdir / setting
            folder.mkdir()
            side = Side(setting, start_pair(folder, extra=_extra(setting)), o)
            sides.append(side)
            await side.open()
        for r in range(o.rounds):
            order = sides[r % len(sides) :] + sides[: r % len(sides)]
            for side in order:
                rounds[side.setting].append(await side.measure())
            line = "; ".join(
                f"{s} {rounds[s][-1]['push']:.2f} GB/s p50 {rounds[s][-1]['p50'] * 1e3:.2f} ms "
                f"{rounds[s][-1]['rate']:,.0f} req/s"
                for s in SETTINGS
            )
            print(f"round {r + 1}: {line}", flush=True)
        checked = {side.setting: side.checked() for side in sides}
        for side in sides:
            await side.close()
    finally:
        for side in sides:
            side.prefill.stop()
            side.decode.stop()
    return rounds, checked


# ------------------------------------------------------------------ the table


def _size(block: int) -> str:
    return f"{block // KIB} KiB" if block < MIB else f"{block // MIB} MiB"


def digest_table(costs: dict[str, Any]) -> str:
    lines = [
        "| block size | crc32c (the daemon's digest.py), ms per GB | XXH3-64 (xxhash), ms per GB |",
        "|---|---|---|",
    ]
    for block in DIGEST_BLOCKS:
        xxh = costs.get(("xxh3", block))
        xxh_text = f"{xxh * 1e3:.0f}" if xxh is not None else "not installed"
        lines.append(f"| {_size(block)} | {costs[('crc32c', block)] * 1e3:.0f} | {xxh_text} |")
    return "\n".join(lines)


def daemon_table(o: Options, rounds: dict[str, list[dict]], checked: dict[str, str]) -> str:
    def col(setting: str, key: str) -> list[float]:
        return [r[key] for r in rounds[setting]]

    def vs_off(setting: str, key: str) -> list[float]:
        return [a / b for a, b in zip(col(setting, key), col("off", key), strict=True)]

    def minus_off(setting: str, key: str) -> list[float]:
        return [a - b for a, b in zip(col(setting, key), col("off", key), strict=True)]

    def x(v: float) -> str:
        return f"{v:.3f}x"

    def ms(v: float) -> str:
        return f"{v * 1e3:.2f}"

    names = {"off": "off", "sample": f"sample {RATE:.0%}", "all": "all"}
    lines = [
        "| measurement | " + " | ".join(names[s] for s in SETTINGS) + " |",
        "|---|" + "---|" * len(SETTINGS),
    ]
    rows: list[tuple[str, Callable[[str], str]]] = [
        (
            f"{o.total_mib} MiB push, 64 KiB blocks, GB/s",
            lambda s: spread(col(s, "push"), lambda v: f"{v:.2f}"),
        ),
        ("push throughput vs off (per round)", lambda s: spread(vs_off(s, "push"), x)),
        (
            f"lifecycle rate, one-block requests, {IN_FLIGHT} in flight, req/s",
            lambda s: spread(col(s, "rate"), lambda v: f"{v:,.0f}"),
        ),
        ("lifecycle rate vs off (per round)", lambda s: spread(vs_off(s, "rate"), x)),
        (
            "CPU per lifecycle, both daemons (user + system, all threads), ms",
            lambda s: spread(col(s, "cpu"), lambda v: f"{v * 1e3:.3f}"),
        ),
        ("CPU per lifecycle vs off (per round)", lambda s: spread(vs_off(s, "cpu"), x)),
        ("one 4 KiB request alone, p50, ms", lambda s: spread(col(s, "p50"), ms)),
        ("one 4 KiB request alone, p99, ms", lambda s: spread(col(s, "p99"), ms)),
        ("added p50 vs off (per round), ms", lambda s: spread(minus_off(s, "p50"), ms)),
        ("added p99 vs off (per round), ms", lambda s: spread(minus_off(s, "p99"), ms)),
    ]
    for label, cell in rows:
        lines.append(f"| {label} | " + " | ".join(cell(s) for s in SETTINGS) + " |")
    lines.append(
        "| requests the decode daemon checked, of all the side made | "
        + " | ".join(checked[s] for s in SETTINGS)
        + " |"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short smoke run (never recorded)")
    parser.add_argument("--rounds", type=int, help=f"interleaved rounds (default {FULL.rounds})")
    parser.add_argument("--total-mib", type=int, help=f"push size (default {FULL.total_mib})")
    parser.add_argument("--no-record", action="store_true", help="do not update bench/RESULTS.md")
    args = parser.parse_args(argv)
    base = QUICK if args.quick else FULL
    o = Options(
        rounds=args.rounds or base.rounds,
        total_mib=args.total_mib or base.total_mib,
        runs=base.runs,
        requests=base.requests,
        single=base.single,
        digest_mib=base.digest_mib,
    )
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    load_before = load_average()
    costs = digest_costs(o)
    print(digest_table(costs))
    print(f"loop progress while a checksum runs in a thread: {costs['gil']:.0%} of alone")
    with tempfile.TemporaryDirectory() as tmp:
        rounds, checked = asyncio.run(interleaved(o, Path(tmp)))
    body = daemon_table(o, rounds, checked)
    print(body)
    if args.quick or args.no_record:
        return
    load = load_average()
    command = " ".join(["python -m bench.verify_bench", *sys.argv[1:]]).strip()
    context = (
        f"- date: {started}; machine: {machine()}; load average at the start "
        f"{load_before}, at the end {load} (shared with other engineers' runs)\n"
        f"- `{command}`: the checksum alone over {o.digest_mib} MiB of /dev/shm (median of 5), "
        f"then three daemon pairs (verify off / sample at {RATE} / all) in {o.rounds} "
        "interleaved rounds, the order rotating; per round and setting a push (median of "
        f"{o.runs} after a warm-up), {o.single} lone 4 KiB requests, {o.requests:,} lifecycles; "
        "a ratio or difference to off is taken within each round, then median (min-max)\n"
        f"- a Python thread's progress while a {o.digest_mib} MiB checksum (64 KiB blocks) runs "
        f"in another thread: {costs['gil']:.0%} of its progress alone (crc32c drops the GIL)"
    )
    write_section("Integrity checks (verify)", context, digest_table(costs) + "\n\n" + body)


if __name__ == "__main__":
    main()
