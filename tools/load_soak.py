"""Load soak: the load fleet of tests/test_load.py for 100,000+ requests, with engine churn.

Two real daemons; rounds of 16 fresh SimEngines (8 per side) that each run
``--per-round`` verified requests and then close, so the run covers both
steady load and engines coming and going. After every round it records each
daemon's RSS (VmRSS) and descriptor count, and checks that the departed
engines' /dev/shm files are gone and no longer mapped by either daemon.

    .venv/bin/python tools/load_soak.py --requests 100000

``--tombstones`` (default 2,000) bounds the daemons' memory of released ids,
so a flat RSS is expected; the daemon default (100,000) legitimately grows
until that many requests have been released. Exit 1 if a check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from daemon.sim.launcher import Daemon, start_pair  # noqa: E402 - after sys.path
from harness.loadfleet import Fleet, Sample, wait_idle, wait_unmapped  # noqa: E402

MIB = 1024


async def rounds(
    pair: tuple[Daemon, Daemon], total: int, per_round: int, concurrency: int
) -> list[Sample]:
    samples = [Sample.take(pair, 0)]
    done = 0
    started = time.perf_counter()
    while done < total:
        fleet = await Fleet.create(*pair)
        paths = fleet.shm_paths
        try:
            n = min(per_round, total - done)
            await fleet.run(n, concurrency)
            done += n
        finally:
            await fleet.close()
        await wait_idle(pair)
        leftovers = [p for p in paths if os.path.exists(p)]
        mapped = await wait_unmapped(pair, paths)
        if leftovers or mapped:
            raise AssertionError(f"after {done}: files {leftovers}, still mapped {mapped}")
        samples.append(Sample.take(pair, done))
        rate = done / (time.perf_counter() - started)
        print(
            f"  {done:>8,} done  {rate:5.0f}/s  rss {samples[-1].rss}  fds {samples[-1].fds}",
            file=sys.stderr,
            flush=True,
        )
    return samples


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=100_000)
    parser.add_argument("--per-round", type=int, default=5_000, help="requests per fleet")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--tombstones", type=int, default=2_000)
    parser.add_argument("--workdir", type=Path)
    args = parser.parse_args(argv)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="kvpushd-load-"))
    workdir.mkdir(parents=True, exist_ok=True)
    extra = f"[limits]\ntombstones = {args.tombstones}"
    pair = start_pair(workdir, extra=extra)
    started = time.perf_counter()
    try:
        samples = asyncio.run(rounds(pair, args.requests, args.per_round, args.concurrency))
    except AssertionError as exc:
        print(f"FAILED: {exc}", file=sys.stderr)
        return 1
    finally:
        codes = [d.stop() for d in pair]
    seconds = time.perf_counter() - started
    summary = summarize(samples, seconds, args)
    print(json.dumps(summary, indent=1))
    print(f"daemon exit codes {codes}", file=sys.stderr)
    return 0 if summary["ok"] and codes == [0, 0] else 1


def summarize(samples: list[Sample], seconds: float, args: argparse.Namespace) -> dict:
    """RSS after the first round (the warm-up) against the end; descriptors throughout."""
    warm = samples[1] if len(samples) > 2 else samples[0]
    end = samples[-1]
    nodes = sorted(end.rss)
    growth = {n: end.rss[n] - warm.rss[n] for n in nodes}
    peak = {n: max(s.rss[n] for s in samples[1:]) - warm.rss[n] for n in nodes}
    fds = {n: sorted({s.fds[n] for s in samples}) for n in nodes}
    return {
        "requests": end.completed,
        "seconds": round(seconds, 1),
        "per_second": round(end.completed / seconds),
        "machine": f"Python {platform.python_version()}, nproc {os.cpu_count()}",
        "tombstones": args.tombstones,
        "rss_kib_start": samples[0].rss,
        "rss_kib_after_warmup": warm.rss,
        "rss_kib_end": end.rss,
        "rss_growth_after_warmup_kib": growth,
        "rss_peak_over_warmup_kib": peak,
        "fd_counts_seen": fds,
        "ok": all(g < 16 * MIB for g in growth.values()) and all(len(v) == 1 for v in fds.values()),
    }


if __name__ == "__main__":
    sys.exit(main())
