"""Where a lifecycle's CPU goes: both daemons under cProfile for N one-block lifecycles.

Two daemons run under harness/profiled.py (``Daemon.profile_to``): cProfile
around ``kvpushd run``, collecting only between the bench's signals, so the
start-up (imports, NIXL, replay), a warm-up and the drain stay out. The
lifecycles are bench/daemon_bench.py's: register both sides, kv_ready,
KvArrived + BlocksFreeable, release both, ``--in-flight`` at once, batch fsync.

For each daemon: the CPU per request of each thread (from /proc, with the
profiler on), Python function calls per request, and the top ``--top``
functions by total time (the function's own) and by cumulative time (with
what it calls), per request. cProfile hooks the main thread only (the event
loop), timed by that thread's CPU clock (``--wall``: the wall clock, which
counts the loop's waits too, for the GIL say): the NIXL worker and fsync
threads show in the thread line, not in the tables. The profiler's own cost
inflates every time it measures, the more the more calls a function makes,
so read the tables for where the time goes, not how much.

    .venv/bin/python -m bench.profile_lifecycle [--requests 3000] [--wall] [--dir DIR] [--no-record]

Results go to bench/RESULTS.md ("Where a lifecycle's CPU goes"); the raw
profiles stay in ``--dir`` (``python -m pstats DIR/prefill.prof``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pstats
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.daemon_bench import FULL, IN_FLIGHT, DaemonSide
from bench.results import machine, write_section
from daemon.sim.launcher import Daemon, start_pair, thread_cpu

REPO = Path(__file__).resolve().parents[1]
NODES = ("prefill", "decode")
WARM_UP = 200


def start_profiled(workdir: Path, outdir: Path, wall: bool) -> tuple[Daemon, Daemon]:
    # The daemons run in their work folder: harness.profiled (not installed)
    # is found through PYTHONPATH, this checkout first.
    pythonpath = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))

    def profiled(daemon: Daemon) -> None:
        daemon.profile_to = outdir / f"{daemon.node}.prof"
        daemon.profile_wall = wall
        daemon.env = {**daemon.env, "PYTHONPATH": pythonpath}

    return start_pair(workdir, prepare=profiled)


async def profile_lifecycles(
    pair: tuple[Daemon, Daemon], requests: int, in_flight: int
) -> tuple[float, dict[str, dict[int, tuple[str, float]]]]:
    """Run the lifecycles with the profilers on; (req/s, each daemon's per-thread CPU delta)."""
    side = DaemonSide(pair, FULL)
    await side.open_small()
    try:
        await side.lifecycles(WARM_UP, in_flight)
        for daemon in pair:
            daemon.profile(True)
        await asyncio.sleep(0.2)  # the signals are handled before the first request
        before = {d.node: thread_cpu(d.proc.pid) for d in pair if d.proc}
        rate, _, _ = await side.lifecycles(requests, in_flight)
        after = {d.node: thread_cpu(d.proc.pid) for d in pair if d.proc}
        for daemon in pair:
            daemon.profile(False)
    finally:
        await side.close()
    used = {
        node: {
            tid: (name, seconds - before[node].get(tid, (name, 0.0))[1])
            for tid, (name, seconds) in after[node].items()
        }
        for node in after
    }
    return rate, used


def where(func: tuple[str, int, str]) -> str:
    """A short name for a pstats key: repo-relative file, package-relative, or a built-in."""
    filename, line, name = func
    if filename == "~":
        return name.replace("|", "/")  # "{built-in method ...}" / "{method 'x' of 'y' objects}"
    path = Path(filename)
    try:
        short = str(path.relative_to(REPO))
    except ValueError:
        parts = path.parts
        if "site-packages" in parts:
            short = "/".join(parts[parts.index("site-packages") + 1 :])
        elif "lib" in parts:
            short = "/".join(parts[len(parts) - 1 - parts[::-1].index("lib") + 1 :])
        else:
            short = filename
    return f"{short}:{line}({name})"


def top_table(stats: pstats.Stats, key: str, top: int, requests: int) -> str:
    """The top functions by ``key`` ("tottime" or "cumtime"), per request."""
    raw: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
    index = 2 if key == "tottime" else 3
    ranked = sorted(raw.items(), key=lambda item: item[1][index], reverse=True)[:top]
    lines = [
        "| function | calls / req | own us / req | cumulative us / req |",
        "|---|---|---|---|",
    ]
    for func, (_cc, nc, tt, ct, _callers) in ranked:
        lines.append(
            f"| `{where(func)}` | {nc / requests:.2f} | {tt / requests * 1e6:.1f} "
            f"| {ct / requests * 1e6:.1f} |"
        )
    return "\n".join(lines)


def report(
    node: str,
    prof: Path,
    threads: dict[int, tuple[str, float]],
    pid: int,
    requests: int,
    top: int,
) -> str:
    stats = pstats.Stats(str(prof))
    raw: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
    calls = sum(v[1] for v in raw.values())
    own = sum(v[2] for v in raw.values())
    loop = threads.get(pid, ("", 0.0))[1]
    others = sorted((s for tid, (_, s) in threads.items() if tid != pid and s > 0), reverse=True)
    other_text = ", ".join(f"{s / requests * 1e3:.3f}" for s in others) or "none"
    return (
        f"### {node} daemon\n\n"
        f"CPU per request with the profiler on (/proc, per thread), ms: loop thread "
        f"{loop / requests * 1e3:.3f}; other threads (NIXL worker, fsync, ...; busiest first) "
        f"{other_text}. Profiled (loop thread): "
        f"{calls / requests:,.0f} Python function calls and {own / requests * 1e6:,.0f} us per "
        f"request.\n\n"
        f"By own time (tottime):\n\n{top_table(stats, 'tottime', top, requests)}\n\n"
        f"By cumulative time (cumtime):\n\n{top_table(stats, 'cumtime', top, requests)}\n"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--in-flight", type=int, default=IN_FLIGHT)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument(
        "--wall", action="store_true", help="wall clock (waits included), not the loop's CPU"
    )
    parser.add_argument("--dir", type=Path, help="keep the profiles here (default: a temp dir)")
    parser.add_argument("--no-record", action="store_true", help="do not update bench/RESULTS.md")
    args = parser.parse_args(argv)
    if not 1 <= args.in_flight <= 2 * IN_FLIGHT:
        parser.error(f"--in-flight must be 1..{2 * IN_FLIGHT}")
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    with tempfile.TemporaryDirectory() as tmp:
        outdir = args.dir or Path(tmp)
        outdir.mkdir(parents=True, exist_ok=True)
        pair = start_profiled(Path(tmp), outdir, args.wall)
        try:
            rate, used = asyncio.run(profile_lifecycles(pair, args.requests, args.in_flight))
        finally:
            codes = [daemon.stop() for daemon in pair]
        if codes != [0, 0]:
            raise RuntimeError(f"the daemons exited {codes}")
        sections = [
            report(
                d.node, outdir / f"{d.node}.prof", used[d.node], d.proc.pid, args.requests, args.top
            )
            for d in pair
            if d.proc
        ]
    body = "\n".join(sections)
    print(body)
    if args.no_record:
        return
    command = " ".join(["python -m bench.profile_lifecycle", *sys.argv[1:]]).strip()
    context = (
        f"- date: {started}; machine: {machine()}\n"
        f"- `{command}`: {args.requests:,} one-block lifecycles, {args.in_flight} in flight, "
        f"batch fsync, after {WARM_UP} untimed ones; {rate:,.0f} req/s with the profilers on\n"
        f"- cProfile on each daemon's loop thread only (harness/profiled.py), by "
        f"{'the wall clock' if args.wall else 'its CPU clock (time.thread_time)'}, collecting "
        f"from just before the first request to just after the last; times per request, "
        f"inflated by cProfile's own overhead: read them for where the time goes, not how much"
    )
    write_section("Where a lifecycle's CPU goes", context, body)


if __name__ == "__main__":
    main()
