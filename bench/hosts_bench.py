"""Across hosts: the daemon path against bare NIXL over UCX TCP between network namespaces.

The same A/B pairs as bench/daemon_bench.py, but the two sides are two
hosts (daemon/sim/hosts.py: a namespace each, one veth on a bridge, UCX
limited to TCP on it), so every byte crosses a network stack instead of
shared memory:

- A: two daemons, one per host, static peers; a 256 MiB push of 64 KiB and
  1 MiB blocks, contiguous and scattered destinations, kv_ready ->
  KvArrived + BlocksFreeable, bytes checked; one 4 KiB request alone,
  p50 and p99.
- B: bare NIXL, a fresh process in each host, the same descriptors, timed
  make_prepped_xfer -> DONE; one 4 KiB WRITE with a notification alone.

The ratio is the daemon's rate over bare NIXL's within each pair; the added
latency is the daemon's p50 (p99) minus bare NIXL's of the same pair.

    python -m bench.hosts_bench [--pairs 3] [--runs 3] [--no-record]   # root

Results go to bench/RESULTS.md ("Across hosts: daemon vs bare NIXL over UCX TCP").
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.daemon_bench import (
    BLOCKS,
    FULL,
    LAYOUTS,
    SMALL,
    DaemonSide,
    Settings,
    bare_in_child,
    pct,
)
from bench.nixl_bare import MIB
from bench.results import load_average, machine, write_section
from daemon.sim.hosts import UCX_TCP, Hosts
from daemon.sim.launcher import Daemon, new_secret

PORT = 7400
TITLE = "Across hosts: daemon vs bare NIXL over UCX TCP"


def start_hosts(hosts: Hosts, workdir: Path) -> tuple[Daemon, Daemon]:
    """A prefill and a decode daemon, each in its host, listing each other."""
    daemons = []
    secret = new_secret()  # one for both: each host has its own folder
    for name, other in (("prefill", "decode"), ("decode", "prefill")):
        folder = workdir / name
        folder.mkdir()
        daemons.append(
            Daemon(
                name,
                folder,
                PORT,
                env=dict(UCX_TCP),
                secret=secret,
                netns=hosts[name].netns,
                host=hosts[name].address,
                peer_addresses=[(other, f"{hosts[other].address}:{PORT}")],
            ).start()
        )
    daemons[0].wait_peer("decode")
    daemons[1].wait_peer("prefill")
    return daemons[0], daemons[1]


async def daemon_round(side: DaemonSide, s: Settings) -> dict[Any, float]:
    out: dict[Any, float] = {}
    for block in BLOCKS:
        for layout in LAYOUTS:
            seconds = await side.push_seconds(block, layout, s.runs)
            out[("push", block, layout)] = s.total / statistics.median(seconds) / 1e9
    _, single, _ = await side.lifecycles(s.single, 1)
    out["p50"], out["p99"] = pct(single, 50), pct(single, 99)
    return out


def bare_round(s: Settings, hosts: Hosts) -> dict[Any, float]:
    where = {"hosts": (hosts["prefill"].netns, hosts["decode"].netns), "env": dict(UCX_TCP)}
    out: dict[Any, float] = {}
    for r in bare_in_child(
        block_sizes=BLOCKS, total_bytes=s.total, runs=s.runs, layouts=LAYOUTS, **where
    ):
        out[("push", r.block_bytes, r.layout)] = r.gbps
    (one,) = bare_in_child(
        block_sizes=(SMALL,), total_bytes=SMALL, runs=s.single, layouts=("contiguous",), **where
    )
    out["p50"], out["p99"] = pct(list(one.seconds), 50), pct(list(one.seconds), 99)
    return out


async def interleaved(s: Settings, workdir: Path) -> tuple[list[dict], list[dict]]:
    daemon_rounds: list[dict[Any, float]] = []
    bare_rounds: list[dict[Any, float]] = []
    with Hosts(["prefill", "decode"]) as hosts:
        pair = start_hosts(hosts, workdir)
        side = DaemonSide(pair, s)
        try:
            await side.open_push()
            await side.open_small()
            for i in range(s.pairs):
                daemon_rounds.append(await daemon_round(side, s))
                bare_rounds.append(await asyncio.to_thread(bare_round, s, hosts))
                a, b = daemon_rounds[-1], bare_rounds[-1]
                ratio = a[("push", MIB, "contiguous")] / b[("push", MIB, "contiguous")]
                print(
                    f"pair {i + 1}: 1 MiB contiguous {ratio:.2f}x of bare, lone request "
                    f"p50 {a['p50'] * 1e3:.2f} ms vs bare {b['p50'] * 1e3:.2f} ms",
                    flush=True,
                )
            await side.close()
        finally:
            for daemon in pair:
                daemon.stop()
    return daemon_rounds, bare_rounds


def table(s: Settings, daemon: list[dict[Any, float]], bare: list[dict[Any, float]]) -> str:
    def spread(values: list[float], fmt: str) -> str:
        return f"{statistics.median(values):{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"

    lines = [
        "| measure | daemon | bare NIXL | daemon / bare |",
        "|---|---|---|---|",
    ]
    for block in BLOCKS:
        for layout in LAYOUTS:
            key = ("push", block, layout)
            a, b = [r[key] for r in daemon], [r[key] for r in bare]
            ratios = [x / y for x, y in zip(a, b, strict=True)]
            lines.append(
                f"| push {s.total_mib} MiB, {block // 1024} KiB blocks, {layout} (GB/s) | "
                f"{spread(a, '.3f')} | {spread(b, '.3f')} | {spread(ratios, '.2f')}x |"
            )
    for q in ("p50", "p99"):
        a, b = [r[q] * 1e3 for r in daemon], [r[q] * 1e3 for r in bare]
        added = [x - y for x, y in zip(a, b, strict=True)]
        lines.append(
            f"| one 4 KiB request alone, {q} (ms) | {spread(a, '.2f')} | {spread(b, '.2f')} | "
            f"+{spread(added, '.2f')} ms |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=3, help="A/B pairs (default 3)")
    parser.add_argument("--runs", type=int, default=FULL.runs, help="timed pushes per pair")
    parser.add_argument("--total-mib", type=int, default=FULL.total_mib, help="push size")
    parser.add_argument("--single", type=int, default=FULL.single, help="lone requests per pair")
    parser.add_argument("--no-record", action="store_true", help="do not update bench/RESULTS.md")
    args = parser.parse_args(argv)
    s = Settings(
        pairs=args.pairs,
        total_mib=args.total_mib,
        runs=args.runs,
        requests=0,
        single=args.single,
        idle_s=0.0,
    )
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    with tempfile.TemporaryDirectory() as tmp:
        daemon_rounds, bare_rounds = asyncio.run(interleaved(s, Path(tmp)))
    body = table(s, daemon_rounds, bare_rounds)
    print(body)
    if args.no_record:
        return
    command = " ".join(["python -m bench.hosts_bench", *sys.argv[1:]]).strip()
    context = (
        f"- date: {started}; machine: {machine()}; load average at the end {load_average()}\n"
        f"- `{command}`: {s.pairs} interleaved pairs, daemon part (A) then bare NIXL (B); "
        "median and min-max over the pairs, ratios and differences taken within each pair\n"
        "- two hosts: a network namespace each on one bridge (veth, MTU 1500), UCX_TLS=tcp on "
        "eth0 for the daemons and for bare NIXL alike; DRAM (/dev/shm) engines\n"
        f"- pushes: per pair the median of {s.runs} runs after a warm-up, bytes checked; lone "
        f"requests: {s.single} per pair"
    )
    write_section(TITLE, context, body)


if __name__ == "__main__":
    main()
