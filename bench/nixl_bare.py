"""Bare-NIXL reference: the fastest a WRITE of KV blocks goes on this machine.

Two processes, one NIXL agent each, no progress thread (each is driven by
polling every 50 us with a 1 us timer slack, as the daemon's worker
does), each owning a /dev/shm region it
registers. The sender pushes ``total_bytes`` as blocks of ``block_bytes``
through prepared descriptor lists and one ``make_prepped_xfer`` with a
notification, polls to DONE, and the receiver polls notifications
meanwhile. A run is timed from ``make_prepped_xfer`` to DONE; the figure is
the median of a few runs after a warm-up.

Two destination layouts: "contiguous" (block i -> block i: NIXL merges the
whole transfer into one descriptor) and "scattered" (a fixed random
permutation of destination blocks, as in a real block pool: no merging).

    .venv/bin/python -m bench.nixl_bare [--total-mib 256] [--runs 5] [--cpus 1] [--no-record]

``--cpus`` pins both processes (each agent and every thread it starts) to
those CPUs, as ``cpu_affinity`` (or the unit's ``CPUAffinity=``) pins a
daemon: the comparison for a daemon deployed off the engines' cores.

The daemon bench compares against :func:`run_bare`.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import multiprocessing
import os
import statistics
import sys
import time
import uuid
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from bench.results import machine, write_section
from daemon.affinity import format_cpu_list, parse_cpu_list
from daemon.dataplane.memory import SHM_ROOT, MappedRegion, create_shm_file, map_dram_region
from daemon.sim.hosts import enter_for_good

KIB = 1 << 10
MIB = 1 << 20
DEFAULT_BLOCKS = (64 * KIB, 1 * MIB)
LAYOUTS = ("contiguous", "scattered")
POLL_INTERVAL_S = 5e-5
# The daemon's NIXL worker sets its thread's timer slack to 1 us
# (daemon/dataplane/worker.py): with Linux's default 50 us, a 50 us sleep
# lasts ~140 us on these VMs. Both bare processes poll the same way, so the
# comparison measures the daemon, not two polling rates.
TIMER_SLACK_NS = 1000
_PR_SET_TIMERSLACK = 29


@dataclass(frozen=True)
class BareResult:
    block_bytes: int
    layout: str
    total_bytes: int
    seconds: tuple[float, ...]  # per timed run, make_prepped_xfer -> DONE

    @property
    def descriptors(self) -> int:
        return self.total_bytes // self.block_bytes

    @property
    def median_s(self) -> float:
        return statistics.median(self.seconds)

    @property
    def gbps(self) -> float:
        """Median throughput in GB/s (1e9 bytes per second)."""
        return self.total_bytes / self.median_s / 1e9

    @property
    def gbps_range(self) -> tuple[float, float]:
        return (
            self.total_bytes / max(self.seconds) / 1e9,
            self.total_bytes / min(self.seconds) / 1e9,
        )


def set_timer_slack(ns: int | None) -> None:
    """This thread's timer slack (Linux prctl; None: leave the default)."""
    if ns is None or not sys.platform.startswith("linux"):
        return
    if ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_TIMERSLACK, ns, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_TIMERSLACK) failed")


def pin_here(cpus: frozenset[int] | None) -> None:
    """This thread, and what it starts from now on, on ``cpus`` (None: left as it is).

    Linux threads and processes inherit their creator's affinity: set before
    the agent exists, it holds for UCX's threads too.
    """
    if cpus:
        os.sched_setaffinity(0, cpus)


def _agent(name: str) -> Any:
    from nixl._api import nixl_agent, nixl_agent_config

    # No progress thread: with the wrapper's delay of 0 it spins a core (NIXL-FACTS).
    return nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))


def _own_region(tag: str, size: int) -> tuple[MappedRegion, str]:
    spec = create_shm_file(
        os.path.join(SHM_ROOT, f"kvpushd-bench-{tag}-{uuid.uuid4().hex[:8]}"), size
    )
    return map_dram_region(spec, owner_uid=os.getuid()), spec.path


def _register(agent: Any, region: MappedRegion) -> Any:
    return agent.register_memory(np.array([[region.base, region.size, 0]], dtype=np.uint64), "DRAM")


def _block_rows(base: int, block_bytes: int, n: int) -> np.ndarray:
    rows = np.empty((n, 3), dtype=np.uint64)
    rows[:, 0] = base + np.arange(n, dtype=np.uint64) * np.uint64(block_bytes)
    rows[:, 1] = block_bytes
    rows[:, 2] = 0
    return rows


# --------------------------------------------------------------------------
# receiver process


def _receiver(
    conn: Connection,
    total_bytes: int,
    poll_interval_s: float,
    timer_slack_ns: int | None,
    netns: str | None = None,
    cpus: frozenset[int] | None = None,
) -> None:
    """Own a region, poll notifications, check each run's bytes, ack over the pipe."""
    pin_here(cpus)
    if netns is not None:
        enter_for_good(netns)  # before any thread or agent: they inherit it
    set_timer_slack(timer_slack_ns)
    region, path = _own_region("dst", total_bytes)
    agent = _agent(f"bare-recv-{os.getpid()}")
    reg = _register(agent, region)
    conn.send((agent.get_agent_metadata(), region.base))
    view = region.view()
    probes = np.linspace(0, total_bytes - 1, 64, dtype=np.int64)
    try:
        while True:
            # Keep polling while the sender writes: its DONE waits for our progress.
            for messages in agent.get_new_notifs().values():
                for msg in messages:
                    expect = int(msg.split(b":")[1])
                    conn.send(bool((view[probes] == expect).all()))
            if conn.poll() and conn.recv() == "stop":
                break
            time.sleep(poll_interval_s)
    finally:
        agent.deregister_memory(reg)
        del view
        region.close()
        os.unlink(path)


# --------------------------------------------------------------------------
# sender (this process)


def _one_run(
    agent: Any,
    local: Any,
    remote: Any,
    lidx: np.ndarray,
    ridx: np.ndarray,
    msg: bytes,
    poll_s: float,
) -> float:
    t0 = time.perf_counter()
    handle = agent.make_prepped_xfer("WRITE", local, lidx, remote, ridx, notif_msg=msg)
    state = agent.transfer(handle)
    while state == "PROC":
        time.sleep(poll_s)
        state = agent.check_xfer_state(handle)
    elapsed = time.perf_counter() - t0
    agent.release_xfer_handle(handle)
    if state != "DONE":
        raise RuntimeError(f"bare NIXL write ended in {state}")
    return elapsed


def _measure(
    agent: Any,
    conn: Connection,
    src: MappedRegion,
    remote_name: str,
    remote_base: int,
    block_bytes: int,
    layout: str,
    runs: int,
    poll_s: float,
) -> BareResult:
    total = src.size
    n = total // block_bytes
    local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", _block_rows(src.base, block_bytes, n), "DRAM")
    remote = agent.prep_xfer_dlist(remote_name, _block_rows(remote_base, block_bytes, n), "DRAM")
    lidx = np.arange(n, dtype=np.int32)
    ridx = (
        lidx if layout == "contiguous" else np.random.default_rng(7).permutation(n).astype(np.int32)
    )
    seconds: list[float] = []
    try:
        for run in range(runs + 1):  # run 0 warms connection and page mappings up
            fill = (run % 250) + 1
            src.view().fill(fill)  # outside the timing; lets the receiver check the bytes
            elapsed = _one_run(agent, local, remote, lidx, ridx, b"run:%d" % fill, poll_s)
            if not conn.recv():
                raise RuntimeError(f"receiver saw wrong bytes after run {run}")
            if run:
                seconds.append(elapsed)
    finally:
        agent.release_dlist_handle(local)
        agent.release_dlist_handle(remote)
    return BareResult(block_bytes, layout, total, tuple(seconds))


def run_bare(
    block_sizes: tuple[int, ...] = DEFAULT_BLOCKS,
    *,
    total_bytes: int = 256 * MIB,
    runs: int = 5,
    layouts: tuple[str, ...] = LAYOUTS,
    poll_interval_s: float = POLL_INTERVAL_S,
    timer_slack_ns: int | None = TIMER_SLACK_NS,
    hosts: tuple[str, str] | None = None,
    env: dict[str, str] | None = None,
    cpus: frozenset[int] | None = None,
) -> list[BareResult]:
    """Measure bare NIXL WRITEs between two processes; one result per (block size, layout).

    The calling process is the sender and must hold no other NIXL agent; its
    calling thread keeps the timer slack set here. ``hosts``: the network
    namespaces (daemon/sim/hosts.py) of the sender and the receiver; the
    calling thread moves into the sender's for good. ``env``: set in this
    process (and so the receiver's) before either agent exists (UCX_TLS...).
    ``cpus``: both processes' CPUs (the calling thread is pinned for good).
    """
    if any(total_bytes % b for b in block_sizes):
        raise ValueError("total_bytes must be a multiple of every block size")
    os.environ.update(env or {})
    pin_here(cpus)
    if hosts is not None:
        enter_for_good(hosts[0])
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(
        target=_receiver,
        args=(
            child,
            total_bytes,
            poll_interval_s,
            timer_slack_ns,
            hosts[1] if hosts else None,
            cpus,
        ),
        daemon=True,
    )
    proc.start()
    set_timer_slack(timer_slack_ns)
    src, path = _own_region("src", total_bytes)
    agent = _agent(f"bare-send-{os.getpid()}")
    reg = _register(agent, src)
    results: list[BareResult] = []
    try:
        if not parent.poll(120):
            raise RuntimeError("receiver process did not start")
        metadata, remote_base = parent.recv()
        name = agent.add_remote_agent(metadata)
        name = name.decode() if isinstance(name, bytes) else name
        for block_bytes in block_sizes:
            for layout in layouts:
                results.append(
                    _measure(
                        agent,
                        parent,
                        src,
                        name,
                        remote_base,
                        block_bytes,
                        layout,
                        runs,
                        poll_interval_s,
                    )
                )
        agent.remove_remote_agent(name)
        parent.send("stop")
        proc.join(30)
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join()
        agent.deregister_memory(reg)
        src.close()
        os.unlink(path)
    return results


def memcpy_gbps(total_bytes: int = 256 * MIB, runs: int = 5) -> float:
    """Median GB/s of one in-process copy of ``total_bytes`` (numpy), for scale."""
    src = np.full(total_bytes, 1, dtype=np.uint8)
    dst = np.zeros(total_bytes, dtype=np.uint8)
    seconds = []
    for run in range(runs + 1):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        if run:
            seconds.append(time.perf_counter() - t0)
    return total_bytes / statistics.median(seconds) / 1e9


def _size(b: int) -> str:
    return f"{b // MIB} MiB" if b >= MIB else f"{b // KIB} KiB"


def table(results: list[BareResult]) -> str:
    lines = [
        "| block | layout | descriptors | median ms | GB/s (median) | GB/s (min-max) |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        lo, hi = r.gbps_range
        lines.append(
            f"| {_size(r.block_bytes)} | {r.layout} | {r.descriptors:,} | {r.median_s * 1e3:.1f}"
            f" | {r.gbps:.2f} | {lo:.2f}-{hi:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--total-mib", type=int, default=256)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument(
        "--cpus", type=parse_cpu_list, help="pin both processes to these CPUs (e.g. 1, 0-1)"
    )
    parser.add_argument("--no-record", action="store_true", help="do not update bench/RESULTS.md")
    args = parser.parse_args()
    results = run_bare(total_bytes=args.total_mib * MIB, runs=args.runs, cpus=args.cpus)
    copy = memcpy_gbps(args.total_mib * MIB, args.runs)
    body = table(results) + f"\n\nFor scale, one in-process memcpy (numpy): {copy:.2f} GB/s."
    print(body)
    if not args.no_record:
        now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
        context = (
            f"- date: {now}\n"
            f"- machine: {machine()}\n"
            f"- two processes, one agent each, no progress thread, polling every"
            f" {POLL_INTERVAL_S * 1e6:.0f} us with a {TIMER_SLACK_NS / 1e3:g} us timer slack"
            " (as the daemon's NIXL worker);"
            f" {args.total_mib} MiB per WRITE with a notification,"
            f" /dev/shm regions, timed make_prepped_xfer -> DONE, median of {args.runs} runs"
            " after one warm-up"
            + (f"; both processes pinned to CPU {format_cpu_list(args.cpus)}" if args.cpus else "")
            + "\n"
            "- contiguous: NIXL merges the blocks into one descriptor;"
            " scattered: destination blocks randomly permuted, nothing merges"
        )
        write_section("NIXL bare", context, body)


if __name__ == "__main__":
    main()
