"""The daemon path against bare NIXL, interleaved: A B A B ...

Each pair runs the daemon part (A), then the bare-NIXL part (B), on the same
machine, one right after the other; ``--pairs`` of them (5 by default). Each
measurement yields one figure per pair, and the table gives the median and
the min-max of those figures over the pairs (a ratio is the median of the
per-pair ratios, so slow and fast spells of a shared machine cancel out).

A, through two daemons (``kvpushd run`` processes, started once for all
pairs; the engines are raw clients registered once):

1. A 256 MiB push (engine -> prefill daemon -> NIXL -> decode daemon ->
   engine) for 64 KiB and 1 MiB blocks, with contiguous destination blocks
   and with scattered ones (the same random permutation bare NIXL uses);
   timed from ``kv_ready`` until both KvArrived and BlocksFreeable have
   arrived; the pair's figure is the median of ``--runs`` runs after one
   warm-up run, bytes checked (all of them after the warm-up, 64 probes
   after every run).
2. The full lifecycle rate of one-block requests (register both sides,
   kv_ready, KvArrived + BlocksFreeable, release both) with 32 in flight,
   the batch fsync policy, and the CPU seconds each daemon used per request
   (user + system, every thread, from /proc).
3. One 4 KiB request alone, kv_ready -> KvArrived + BlocksFreeable, p50 and
   p99.
4. The idle CPU of each daemon (engines connected, nothing in flight).

B, bare NIXL (bench/nixl_bare.py: two fresh processes, one agent each, the
same descriptors, timed make_prepped_xfer -> DONE): the four 256 MiB pushes,
and one 4 KiB WRITE with a notification alone, p50 and p99. The latency the
daemon adds is its p50 (p99) minus bare NIXL's p50 (p99) of the same pair.

    .venv/bin/python -m bench.daemon_bench [--pairs 5] [--runs 3] [--no-record]
    .venv/bin/python -m bench.daemon_bench --quick   # smoke run, never recorded
    .venv/bin/python -m bench.daemon_bench --daemon-cpus 1 --engine-cpus 0

Pinned (``--daemon-cpus``), the run is deployed as an operator would: both
daemons (every thread) on the daemon CPUs, the way ``cpu_affinity`` or the
unit's ``CPUAffinity=`` places them, and the engines (this process) on
``--engine-cpus``; bare NIXL's two processes run on the daemon CPUs too, so
the two sides of a pair share the same cores.

Results go to bench/RESULTS.md ("Daemon vs bare NIXL", or "Daemon vs bare
NIXL, pinned").
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

from bench.nixl_bare import MIB, BareResult, pin_here, run_bare
from bench.results import load_average, machine, write_section
from daemon.affinity import format_cpu_list, parse_cpu_list
from daemon.client import EngineClient
from daemon.dataplane.memory import create_shm_file
from daemon.journal.stats import percentile
from daemon.sim.launcher import Daemon, cpu_seconds, start_pair, thread_cpu
from schemas import rpc
from schemas.kvlayout import GroupSpec, LayerSpec
from schemas.layout import GroupKind, Role

KIB = 1024
BLOCKS = (64 * KIB, MIB)
LAYOUTS = ("contiguous", "scattered")
SMALL = 4 * KIB  # one block of the lifecycle and single-request runs
IN_FLIGHT = 32
PERMUTATION_SEED = 7  # bench/nixl_bare.py's scattered layout uses the same one


@dataclass(frozen=True)
class Settings:
    pairs: int
    total_mib: int
    runs: int
    requests: int
    single: int
    idle_s: float
    # Pinned runs: the daemons' and bare NIXL's CPUs, and the engines' (empty: not pinned).
    daemon_cpus: frozenset[int] = frozenset()
    engine_cpus: frozenset[int] = frozenset()

    @property
    def total(self) -> int:
        return self.total_mib * MIB


FULL = Settings(pairs=5, total_mib=256, runs=3, requests=3000, single=300, idle_s=5.0)
QUICK = Settings(pairs=2, total_mib=16, runs=1, requests=200, single=30, idle_s=0.5)


def permutation(n: int, layout: str) -> np.ndarray:
    """Destination block of source block i: itself, or bare NIXL's scattered permutation."""
    if layout == "contiguous":
        return np.arange(n)
    return np.random.default_rng(PERMUTATION_SEED).permutation(n)


def pct(values: list[float], q: float) -> float:
    return percentile(sorted(values), q)


# ------------------------------------------------------------------ engines


@dataclass
class BenchEngine:
    """A raw engine client with one shm region; events resolve per-request futures.

    Raw clients, not simulated engines: the simulated engine checks its
    whole cache on every event, which would be timed along with the daemon.
    Each event is stamped with ``perf_counter`` as it is read.
    """

    client: EngineClient
    engine_id: str
    path: str
    blocks: int
    block_bytes: int
    waiters: dict[str, asyncio.Future[tuple[float, rpc.Event]]] = field(default_factory=dict)

    @classmethod
    async def open(cls, sock: str, engine_id: str, blocks: int, block_bytes: int) -> BenchEngine:
        path = f"/dev/shm/kvpushd-bench-{engine_id}-{os.getpid()}"
        region = create_shm_file(path, blocks * block_bytes)
        holder: list[BenchEngine] = []
        client = await EngineClient.connect(
            sock, on_event=lambda event: holder[0].deliver(event), queue_events=False
        )
        engine = cls(client, engine_id, path, blocks, block_bytes)
        holder.append(engine)
        groups = (GroupSpec(GroupKind.ATTENTION, blocks, block_bytes, (LayerSpec(region.name),)),)
        await client.register_engine(engine_id, groups, (region,))
        return engine

    def deliver(self, event: rpc.Event) -> None:
        future = self.waiters.pop(getattr(event, "request_id", ""), None)
        if future is not None and not future.done():
            future.set_result((time.perf_counter(), event))

    def expect(self, request_id: str) -> asyncio.Future[tuple[float, rpc.Event]]:
        future = asyncio.get_running_loop().create_future()
        self.waiters[request_id] = future
        return future

    def memory(self) -> np.memmap:
        return np.memmap(self.path, dtype=np.uint8, mode="r+")

    async def close(self) -> None:
        await self.client.close()
        os.unlink(self.path)


def _check(done: tuple[float, rpc.Event], kind: type) -> float:
    stamp, event = done
    if not isinstance(event, kind):
        raise RuntimeError(f"expected {kind.__name__}, got {event!r}")
    return stamp


async def one_request(
    pusher: BenchEngine,
    receiver: BenchEngine,
    rid: str,
    src_blocks: list[int],
    dst_blocks: list[int],
) -> tuple[float, float, float, float]:
    """Register both sides, kv_ready, wait for both events, release both.

    Returns (start, kv_ready sent, KvArrived read, last event read),
    perf_counter seconds.
    """
    arrived, freed = receiver.expect(rid), pusher.expect(rid)
    t0 = time.perf_counter()
    await receiver.client.register_request(
        receiver.engine_id, rid, Role.RECEIVER, [dst_blocks], peer="prefill"
    )
    await pusher.client.register_request(pusher.engine_id, rid, Role.PUSHER, [src_blocks])
    t_kv = time.perf_counter()
    await pusher.client.kv_ready(rid)
    done = await asyncio.gather(arrived, freed)
    t_arrived = _check(done[0], rpc.KvArrived)
    end = max(t_arrived, _check(done[1], rpc.BlocksFreeable))
    await asyncio.gather(receiver.client.release(rid), pusher.client.release(rid))
    return t0, t_kv, t_arrived, end


# ------------------------------------------------------------------ A: daemons


class DaemonSide:
    """Two daemons and their engines, kept for every pair."""

    def __init__(self, pair: tuple[Daemon, Daemon], settings: Settings) -> None:
        self.prefill, self.decode = pair
        self.settings = settings
        self.push: dict[int, tuple[BenchEngine, BenchEngine]] = {}
        self.small: tuple[BenchEngine, BenchEngine] | None = None
        self._ids = 0

    def rid(self, tag: str) -> str:
        self._ids += 1
        return f"{tag}-{self._ids}"

    async def open(self) -> None:
        await self.open_push()
        await self.open_small()

    async def open_push(self) -> None:
        """Per block size, a pusher and a receiver engine of the push size, source filled."""
        total = self.settings.total
        for block in BLOCKS:
            n = total // block
            tag = f"{block // KIB}k"
            p = await BenchEngine.open(self.prefill.socket, f"push-p-{tag}", n, block)
            d = await BenchEngine.open(self.decode.socket, f"push-d-{tag}", n, block)
            self.push[block] = (p, d)
            src = p.memory()
            src[:] = np.random.default_rng(block).integers(0, 256, total, dtype=np.uint8)
            del src

    async def open_small(self) -> None:
        """A pusher and a receiver engine of 4 KiB blocks for the one-block lifecycles."""
        blocks = IN_FLIGHT * 2
        self.small = (
            await BenchEngine.open(self.prefill.socket, "rate-p", blocks, SMALL),
            await BenchEngine.open(self.decode.socket, "rate-d", blocks, SMALL),
        )

    async def close(self) -> None:
        engines = [e for pair in self.push.values() for e in pair]
        engines += list(self.small or ())
        for engine in engines:
            await engine.close()

    async def push_seconds(self, block: int, layout: str, runs: int) -> list[float]:
        """kv_ready -> KvArrived + BlocksFreeable of one all-blocks request, per timed run."""
        p, d = self.push[block]
        n = p.blocks
        perm = permutation(n, layout)
        src, dst = p.memory(), d.memory()
        probes = np.random.default_rng(n).integers(0, n * block, 64)  # source offsets
        mapped = perm[probes // block] * block + probes % block
        expect = np.array(src[probes])
        seconds = []
        try:
            dst[:] = 0
            for run in range(runs + 1):  # run 0 is a warm-up, fully checked
                dst[mapped] = ~expect
                _, t_kv, _, end = await one_request(
                    p, d, self.rid(f"push-{layout}"), list(range(n)), perm.tolist()
                )
                if not np.array_equal(dst[mapped], expect):
                    raise RuntimeError(f"{layout} push of {block} B blocks: wrong bytes")
                if run == 0:
                    got = np.asarray(dst).reshape(n, block)[perm]
                    if not np.array_equal(got, np.asarray(src).reshape(n, block)):
                        raise RuntimeError(f"{layout} push of {block} B blocks: wrong bytes")
                    del got
                else:
                    seconds.append(end - t_kv)
        finally:
            del src, dst
        return seconds

    async def lifecycles(self, n: int, in_flight: int) -> tuple[float, list[float], list[float]]:
        """(requests/s, seconds to both events, seconds to KvArrived) of ``n`` lifecycles.

        ``n`` one-block lifecycles, ``in_flight`` at once. Latency is from the
        registrations with several in flight, from kv_ready for one alone.
        """
        assert self.small is not None
        p, d = self.small
        free = asyncio.Queue[int]()
        for slot in range(p.blocks):
            free.put_nowait(slot)
        latencies: list[float] = []
        arrivals: list[float] = []
        sem = asyncio.Semaphore(in_flight)

        async def one() -> None:
            async with sem:
                slot = await free.get()
                t0, t_kv, t_arrived, end = await one_request(
                    p, d, self.rid(f"c{in_flight}"), [slot], [slot]
                )
                start = t0 if in_flight > 1 else t_kv
                latencies.append(end - start)
                arrivals.append(t_arrived - start)
                free.put_nowait(slot)

        t0 = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(n)))
        return n / (time.perf_counter() - t0), latencies, arrivals

    def cpu(self) -> dict[str, float]:
        """CPU seconds of each daemon so far (clock ticks: for long windows)."""
        return {d.node: cpu_seconds(d.proc.pid) for d in (self.prefill, self.decode) if d.proc}

    def ran(self) -> dict[str, float]:
        """On-CPU seconds of each daemon's live threads (nanoseconds: for idle windows)."""
        return {
            d.node: sum(t for _, t in thread_cpu(d.proc.pid).values())
            for d in (self.prefill, self.decode)
            if d.proc
        }

    async def round(self) -> dict[Any, float]:
        s = self.settings
        out: dict[Any, float] = {}
        for block in BLOCKS:
            for layout in LAYOUTS:
                seconds = await self.push_seconds(block, layout, s.runs)
                out[("push", block, layout)] = s.total / statistics.median(seconds) / 1e9
        before = self.cpu()
        out["rate"], _, _ = await self.lifecycles(s.requests, IN_FLIGHT)
        after = self.cpu()
        for node in after:
            out[("cpu", node)] = (after[node] - before[node]) / s.requests
        _, single, arrived = await self.lifecycles(s.single, 1)
        out["p50"], out["p99"] = pct(single, 50), pct(single, 99)
        out["arrived p50"], out["arrived p99"] = pct(arrived, 50), pct(arrived, 99)
        await asyncio.sleep(min(1.0, s.idle_s))  # let trailing work (syncs, logs) settle
        before = self.ran()
        t0 = time.perf_counter()
        await asyncio.sleep(s.idle_s)
        after = self.ran()
        elapsed = time.perf_counter() - t0
        for node in after:
            out[("idle", node)] = (after[node] - before[node]) / elapsed
        return out


# ------------------------------------------------------------------ B: bare NIXL


def _bare_child(conn: Connection, kwargs: dict[str, Any]) -> None:
    try:
        conn.send(run_bare(**kwargs))
    except BaseException as exc:
        conn.send(exc)
        raise


def bare_in_child(**kwargs: Any) -> list[BareResult]:
    """run_bare in a fresh process: it must hold the only NIXL agent of its process."""
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_bare_child, args=(child, kwargs))
    proc.start()
    try:
        if not parent.poll(600):
            raise RuntimeError("bare NIXL run gave no result in 10 minutes")
        result = parent.recv()
    finally:
        proc.join(60)
        if proc.is_alive():
            proc.kill()
            proc.join()
    if isinstance(result, BaseException):
        raise result
    return result


def bare_round(s: Settings) -> dict[Any, float]:
    out: dict[Any, float] = {}
    cpus = s.daemon_cpus or None
    pushes = bare_in_child(
        block_sizes=BLOCKS, total_bytes=s.total, runs=s.runs, layouts=LAYOUTS, cpus=cpus
    )
    for r in pushes:
        out[("push", r.block_bytes, r.layout)] = r.gbps
    (one,) = bare_in_child(
        block_sizes=(SMALL,), total_bytes=SMALL, runs=s.single, layouts=("contiguous",), cpus=cpus
    )
    out["p50"], out["p99"] = pct(list(one.seconds), 50), pct(list(one.seconds), 99)
    return out


# ------------------------------------------------------------------ the table


def spread(values: list[float], fmt: Callable[[float], str]) -> str:
    """'median (min-max)' of the per-pair figures."""
    med = fmt(statistics.median(values))
    return f"{med} ({fmt(min(values))}-{fmt(max(values))})"


def table(s: Settings, daemon: list[dict[Any, float]], bare: list[dict[Any, float]]) -> str:
    def col(rounds: list[dict[Any, float]], key: Any) -> list[float]:
        return [r[key] for r in rounds]

    def gb(x: float) -> str:
        return f"{x:.2f}"

    def ms(x: float) -> str:
        return f"{x * 1e3:.2f}"

    lines = [
        "| measurement | daemon path, median (min-max) | bare NIXL, median (min-max) "
        "| daemon / bare, median (min-max) | target |",
        "|---|---|---|---|---|",
    ]
    for block in BLOCKS:
        size = f"{block // KIB} KiB" if block < MIB else f"{block // MIB} MiB"
        for layout in LAYOUTS:
            key = ("push", block, layout)
            ratios = [a / b for a, b in zip(col(daemon, key), col(bare, key), strict=True)]
            lines.append(
                f"| {s.total_mib} MiB push, {size} blocks, {layout}, GB/s "
                f"| {spread(col(daemon, key), gb)} | {spread(col(bare, key), gb)} "
                f"| {spread(ratios, lambda x: f'{x:.2f}x')} | >= 0.95x |"
            )
    lines.append(
        f"| full lifecycle rate, one-block requests, batch fsync, {IN_FLIGHT} in flight "
        f"({s.requests:,} requests), req/s | {spread(col(daemon, 'rate'), lambda x: f'{x:,.0f}')}"
        " | | | >= 5,000 req/s |"
    )
    for node in ("prefill", "decode"):
        lines.append(
            f"| CPU per lifecycle, {node} daemon (user + system, all threads), ms "
            f"| {spread(col(daemon, ('cpu', node)), lambda x: f'{x * 1e3:.3f}')} | | "
            "| <= 0.15 ms |"
        )
    for q in ("p50", "p99"):
        lines.append(
            f"| one {SMALL // KIB} KiB request alone, kv_ready -> KvArrived + BlocksFreeable "
            f"(bare: one WRITE with notification, post -> DONE), {q}, ms "
            f"| {spread(col(daemon, q), ms)} | {spread(col(bare, q), ms)} | | |"
        )
    for q in ("p50", "p99"):
        added = [a - b for a, b in zip(col(daemon, q), col(bare, q), strict=True)]
        target = "p99 <= 1 ms" if q == "p99" else ""
        lines.append(
            f"| latency added over bare NIXL, {q} (daemon {q} - bare {q}, per pair), ms "
            f"| {spread(added, ms)} | | | {target} |"
        )
    for q in ("p50", "p99"):
        lines.append(
            f"| one {SMALL // KIB} KiB request alone, kv_ready -> KvArrived only, {q}, ms "
            f"| {spread(col(daemon, f'arrived {q}'), ms)} | | | |"
        )
    for q in ("p50", "p99"):
        added = [a - b for a, b in zip(col(daemon, f"arrived {q}"), col(bare, q), strict=True)]
        lines.append(
            f"| latency added over bare NIXL up to KvArrived, {q} (per pair), ms "
            f"| {spread(added, ms)} | | | |"
        )
    for node in ("prefill", "decode"):
        lines.append(
            f"| idle CPU, {node} daemon, % of a core "
            f"| {spread(col(daemon, ('idle', node)), lambda x: f'{x * 100:.2f}')} | | | < 0.5 % |"
        )
    return "\n".join(lines)


def _pair_line(i: int, a: dict[Any, float], b: dict[Any, float]) -> str:
    pushes = " ".join(
        f"{block // KIB}k/{layout[0]} {a[('push', block, layout)]:.2f}/"
        f"{b[('push', block, layout)]:.2f}"
        for block in BLOCKS
        for layout in LAYOUTS
    )
    return (
        f"pair {i + 1}: push GB/s daemon/bare {pushes}; {a['rate']:,.0f} req/s; "
        f"cpu/req {a[('cpu', 'prefill')] * 1e3:.3f}/{a[('cpu', 'decode')] * 1e3:.3f} ms; "
        f"p50/p99 {a['p50'] * 1e3:.2f}/{a['p99'] * 1e3:.2f} ms "
        f"(bare {b['p50'] * 1e3:.3f}/{b['p99'] * 1e3:.3f}); "
        f"idle {a[('idle', 'prefill')] * 100:.2f}/{a[('idle', 'decode')] * 100:.2f} %"
    )


async def interleaved(s: Settings, workdir: Path) -> tuple[list[dict], list[dict]]:
    daemon_rounds: list[dict[Any, float]] = []
    bare_rounds: list[dict[Any, float]] = []
    # The daemons inherit this thread's affinity at exec, as under CPUAffinity=;
    # then this process (the engines) moves to its own CPUs.
    pin_here(s.daemon_cpus or None)
    pair = start_pair(workdir)
    pin_here(s.engine_cpus or None)
    side = DaemonSide(pair, s)
    try:
        await side.open()
        for i in range(s.pairs):
            daemon_rounds.append(await side.round())
            bare_rounds.append(await asyncio.to_thread(bare_round, s))
            print(_pair_line(i, daemon_rounds[-1], bare_rounds[-1]), flush=True)
        await side.close()
    finally:
        for daemon in pair:
            daemon.stop()
    return daemon_rounds, bare_rounds


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short smoke run (never recorded)")
    parser.add_argument("--pairs", type=int, help=f"A/B pairs (default {FULL.pairs})")
    parser.add_argument("--total-mib", type=int, help=f"push size (default {FULL.total_mib})")
    parser.add_argument("--runs", type=int, help=f"timed pushes per pair (default {FULL.runs})")
    parser.add_argument("--requests", type=int, help=f"lifecycles (default {FULL.requests})")
    parser.add_argument("--single", type=int, help=f"lone requests (default {FULL.single})")
    parser.add_argument("--idle-s", type=float, help=f"idle window (default {FULL.idle_s})")
    parser.add_argument(
        "--daemon-cpus", type=parse_cpu_list, help="pin both daemons and bare NIXL (e.g. 1)"
    )
    parser.add_argument(
        "--engine-cpus", type=parse_cpu_list, help="pin the engines, this process (e.g. 0)"
    )
    parser.add_argument("--no-record", action="store_true", help="do not update bench/RESULTS.md")
    args = parser.parse_args(argv)
    base = QUICK if args.quick else FULL
    s = Settings(
        pairs=args.pairs or base.pairs,
        total_mib=args.total_mib or base.total_mib,
        runs=args.runs or base.runs,
        requests=args.requests or base.requests,
        single=args.single or base.single,
        idle_s=args.idle_s or base.idle_s,
        daemon_cpus=args.daemon_cpus or frozenset(),
        engine_cpus=args.engine_cpus or frozenset(),
    )
    if s.pairs < 1 or s.runs < 1 or s.total % MIB:
        parser.error("--pairs and --runs must be >= 1, --total-mib a whole number of MiB")
    if bool(s.daemon_cpus) != bool(s.engine_cpus) or s.daemon_cpus & s.engine_cpus:
        parser.error("--daemon-cpus and --engine-cpus go together, on different CPUs")
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    with tempfile.TemporaryDirectory() as tmp:
        daemon_rounds, bare_rounds = asyncio.run(interleaved(s, Path(tmp)))
    body = table(s, daemon_rounds, bare_rounds)
    print(body)
    if args.quick or args.no_record:
        return
    load = load_average()
    command = " ".join(["python -m bench.daemon_bench", *sys.argv[1:]]).strip()
    context = (
        f"- date: {started}; machine: {machine()}; load average at the end {load}\n"
        f"- `{command}`: {s.pairs} interleaved pairs, each the daemon part (A) then bare NIXL "
        f"(B); a figure per pair, the table gives the median and min-max over the pairs; a "
        f"ratio or a difference is taken within each pair first\n"
        f"- pushes: DRAM (/dev/shm), UCX (cma); daemon timed kv_ready -> KvArrived + "
        f"BlocksFreeable, bare (two fresh processes per pair, prepped dlists) "
        f"make_prepped_xfer -> DONE; per pair the median of {s.runs} runs after a warm-up; "
        f"scattered = destination blocks randomly permuted (nothing merges)\n"
        f"- lifecycle: register both sides, kv_ready, both events, release both; CPU from "
        f"/proc (daemon.sim.launcher.cpu_seconds) over the {s.requests:,} requests; lone "
        f"requests: {s.single} per pair; idle: {s.idle_s:g} s with the engines connected, threads' "
        f"run time from /proc/PID/task/*/schedstat"
    )
    title = "Daemon vs bare NIXL"
    if s.daemon_cpus:
        title += ", pinned"
        context += (
            f"\n- pinned: both daemons (every thread, inherited at exec as under the unit's "
            f"CPUAffinity=) and both bare NIXL processes on CPU {format_cpu_list(s.daemon_cpus)}, "
            f"the engines (the bench process) on CPU {format_cpu_list(s.engine_cpus)}"
        )
    write_section(title, context, body)


if __name__ == "__main__":
    main()
