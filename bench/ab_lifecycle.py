"""Two checkouts of kvpushd, interleaved: lifecycle rate, CPU per thread, lone latency, idle.

For comparing one change (issue 14, items 2 and 3) on a shared machine: each
round runs every checkout in turn (A B A B ...), each in a fresh daemon pair
started from that checkout's own ``.venv`` (so each runs its own code), and
measures what the hand-offs and per-message steps cost:

- ``rate``: one-block lifecycles with 32 in flight (daemon_bench's), req/s;
- ``cpu``: CPU per lifecycle of each daemon, split into its event loop
  thread and the rest (and, where the code names it, the NIXL worker), from
  /proc/PID/task/*/schedstat;
- ``p50``/``p99``: one 4 KiB request alone, kv_ready -> both events;
- ``idle``: each daemon's CPU over an idle window, % of a core.

    .venv/bin/python -m bench.ab_lifecycle --checkout /tmp/before --checkout . [--rounds 5]

Each checkout needs ``make venv``. The driver prints one JSON line per run
and a table of medians (min-max) per checkout; nothing is recorded.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()


def _groups(pid: int) -> dict[str, float]:
    """On-CPU seconds of a daemon's threads: the event loop (main thread) and the rest.

    The rest is the NIXL worker, the fsync thread and UCX's own threads.
    ``nixl`` is the worker alone, where it names its OS thread
    (``nixl-worker``; older code does not, and reads 0 there).
    """
    from daemon.sim.launcher import thread_cpu

    out = {"loop": 0.0, "other": 0.0, "nixl": 0.0}
    for tid, (name, ran) in thread_cpu(pid).items():
        out["loop" if tid == pid else "other"] += ran
        if name == "nixl-worker":
            out["nixl"] += ran
    return out


async def _child(requests: int, single: int, idle_s: float) -> dict[str, Any]:
    from bench.daemon_bench import FULL, IN_FLIGHT, DaemonSide, pct
    from daemon.sim.launcher import start_pair

    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        pair = start_pair(Path(tmp))
        side = DaemonSide(pair, FULL)
        try:
            await side.open_small()
            await side.lifecycles(200, IN_FLIGHT)  # warm-up
            pids = {d.node: d.proc.pid for d in pair if d.proc}
            before = {n: _groups(p) for n, p in pids.items()}
            # (A checkout's daemon_bench may return (rate, latencies) or, since
            # issue 14 item 1, (rate, latencies, latencies to KvArrived).)
            out["rate"], *_ = await side.lifecycles(requests, IN_FLIGHT)
            after = {n: _groups(p) for n, p in pids.items()}
            for node in pids:
                for k in before[node]:
                    out[f"cpu_{node}_{k}"] = (after[node][k] - before[node][k]) / requests
                out[f"cpu_{node}"] = out[f"cpu_{node}_loop"] + out[f"cpu_{node}_other"]
            _, lone, *_ = await side.lifecycles(single, 1)
            out["p50"], out["p99"] = pct(lone, 50), pct(lone, 99)
            await asyncio.sleep(1.0)
            before = {n: _groups(p) for n, p in pids.items()}
            t0 = time.perf_counter()
            await asyncio.sleep(idle_s)
            after = {n: _groups(p) for n, p in pids.items()}
            elapsed = time.perf_counter() - t0
            for node in pids:
                ran = {k: after[node][k] - before[node][k] for k in after[node]}
                out[f"idle_{node}"] = (ran["loop"] + ran["other"]) / elapsed
                out[f"idle_{node}_nixl"] = ran["nixl"] / elapsed  # part of "other"
            await side.close()
        finally:
            for daemon in pair:
                daemon.stop()
    out["load1"] = os.getloadavg()[0]
    return out


def _fmt(key: str, x: float) -> str:
    if key == "rate":
        return f"{x:,.0f}"
    if key.startswith("idle"):
        return f"{x * 100:.2f}"
    return f"{x * 1e3:.3f}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkout", action="append", type=Path, default=[])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--single", type=int, default=300)
    parser.add_argument("--idle-s", type=float, default=5.0)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(asyncio.run(_child(args.requests, args.single, args.idle_s))))
        return
    if not args.checkout:
        parser.error("give at least one --checkout")
    runs: dict[Path, list[dict[str, Any]]] = {c: [] for c in args.checkout}
    for r in range(args.rounds):
        for checkout in args.checkout:
            root = checkout.resolve()
            env = dict(os.environ, PYTHONPATH=str(root))
            cmd = [str(root / ".venv/bin/python"), str(HERE), "--child"]
            cmd += ["--requests", str(args.requests), "--single", str(args.single)]
            cmd += ["--idle-s", str(args.idle_s)]
            done = subprocess.run(
                cmd, cwd=root, env=env, capture_output=True, text=True, check=False
            )
            if done.returncode:
                sys.exit(f"{root}: exit {done.returncode}\n{done.stderr[-4000:]}")
            result = json.loads(done.stdout.strip().splitlines()[-1])
            runs[checkout].append(result)
            print(json.dumps({"round": r + 1, "checkout": str(checkout), **result}), flush=True)
    # Imported here: a child runs this file in an older checkout, whose
    # bench/results.py may lack it.
    from bench.results import spread

    keys = [k for k in runs[args.checkout[0]][0] if k != "load1"]
    print("| measurement | " + " | ".join(str(c) for c in args.checkout) + " |")
    print("|---|" + "---|" * len(args.checkout))
    for key in keys:
        cells = [
            spread([run[key] for run in runs[c]], lambda x, key=key: _fmt(key, x))
            for c in args.checkout
        ]
        print(f"| {key} | " + " | ".join(cells) + " |")
    loads = [run["load1"] for rs in runs.values() for run in rs]
    print(f"load average (1 min) at the end of each run: {min(loads):.2f}-{max(loads):.2f}")


if __name__ == "__main__":
    main()
