"""``kvpushd demo``: a prefill and a decode daemon on this machine, pushing real bytes.

What a new user runs first. It needs no configuration and leaves nothing
behind (unless ``--keep``):

1. Starts two real daemons (``python -m daemon.cli run``) on loopback, with
   free ports, a generated 0600 shared secret and journals in a work folder,
   and waits until both answer on their engine sockets and see each other.
2. Attaches simulated engines (:class:`daemon.sim.engine.SimEngine`: real
   POSIX shared memory, every block filled with bytes that name it), two per
   side, with two KV-cache groups of 2 and 3 layers.
3. Pushes a seeded stream of requests, 16 in flight: no prefix hit, partial
   hits of varying length, full hits, and a few that the daemons must refuse
   (decode longer than prefill, destination blocks owned by a live request,
   a duplicate registration). Each delivered block is checked byte for byte
   on the decode side; the prefill caches must not change at all. The
   daemons run with ``verify = "all"``: the decode daemon compares checksums
   of every block against the prefill daemon's before its engine hears
   ``kv_arrived``, and the summary says how many it verified.
4. Stops the daemons with SIGTERM (they must exit 0), unlinks the shared
   memory, replays both journals, checks every request's path through them,
   and prints a summary: outcomes, refusals, bytes, throughput, latencies,
   and how to inspect the journals.

Exit status: 0 when every delivered byte was right and every request ended
as planned; 1 otherwise, after saying what went wrong; 2 for unusable
options or a work folder that cannot be used; 130 when stopped by Ctrl-C
(the first one lets the requests in flight finish, a second abandons them).

What the plan holds and why blocks never collide by accident:
:mod:`daemon.sim.demo_plan`.

The parts: :mod:`daemon.sim.demo_plan` (the request stream),
:mod:`daemon.sim.demo_daemons` (the two daemons, the demo's errors),
:mod:`daemon.sim.demo_push` (engines and the push loop),
:mod:`daemon.sim.demo_journal` (the journal checks) and
:mod:`daemon.sim.demo_report` (progress and summary). This module holds the
command: options, the work folder, the phases in order and the verdict.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, TextIO, TypeVar

from daemon.client import ClientError
from daemon.sim.demo_daemons import (
    DEMO_TIMING,
    START_TIMEOUT_S,
    DaemonProc,
    DemoError,
    Interrupted,
    UsageError,
    stop_daemons,
    wait_ready,
)
from daemon.sim.demo_journal import JournalView, check_journal, read_journal
from daemon.sim.demo_plan import (
    DECODE,
    ENGINES_PER_SIDE,
    LAYERS,
    PREFILL,
    REFUSED_KINDS,
    WINDOW,
    Plan,
    make_plan,
    shm_bytes,
)
from daemon.sim.demo_push import (
    SHM_PREFIX,
    Pusher,
    PushResult,
    bad_reports,
    close_engines,
    create_engines,
    remove_stale_shm,
)
from daemon.sim.demo_report import Progress, RunResult, plural, print_summary
from daemon.sim.engine import SimError
from daemon.sim.hosts import UCX_TCP, Hosts
from daemon.sim.launcher import free_port, write_secret

SOCKET_PATH_MAX: Final = 100  # sun_path is 108 bytes; keep a margin
MAX_PROBLEMS_SHOWN: Final = 20
# Every push end-to-end checked (README.md, "Integrity"): the demo shows it on.
VERIFY_ALL: Final = '[integrity]\nverify = "all"'
EXIT_OK: Final = 0
EXIT_FAILED: Final = 1
EXIT_USAGE: Final = 2
EXIT_INTERRUPTED: Final = 130  # what shells report for a Ctrl-C

_T = TypeVar("_T")


@dataclass(frozen=True)
class Options:
    requests: int
    block_size: int
    workdir: Path | None
    keep: bool
    seed: int
    hosts: bool = False  # each daemon on a host of its own: a network namespace, UCX over TCP


def _check_options(opts: Options) -> str | None:
    if opts.hosts and os.geteuid() != 0:
        return "--hosts makes network namespaces: run it as root"
    if opts.requests < 1:
        return "--requests must be at least 1"
    if not 64 <= opts.block_size <= 16 * 2**20:
        return "--block-size must be between 64 bytes and 16 MiB"
    # The engines' caches are memfds (no /dev/shm file): memory, not /dev/shm's size.
    need = shm_bytes(opts.block_size)
    free = _available_memory()
    if free is not None and need > free * 0.8:
        return (
            f"--block-size {opts.block_size} needs {need / 2**20:.0f} MiB of memory for the"
            f" engines' caches, only {free / 2**20:.0f} MiB is available"
        )
    return None


def _available_memory() -> int | None:
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return None


@contextlib.contextmanager
def work_folder(opts: Options) -> Iterator[Path]:
    """The folder for configs, secret, logs and journals; removed at the end unless --keep.

    A folder the user named is kept if it existed before (only what the demo
    wrote into it is removed); one the demo created is removed whole.
    """
    created = opts.workdir is None or not opts.workdir.exists()
    if opts.workdir is None:
        workdir = Path(tempfile.mkdtemp(prefix="kvpushd-demo-"))
    else:
        workdir = opts.workdir.resolve()
        workdir.mkdir(parents=True, exist_ok=True)
    for node in (PREFILL, DECODE):
        if (workdir / f"{node}-journal").exists():
            raise UsageError(
                f"{workdir} already holds a demo journal ({node}-journal); "
                "the daemons would replay it. Pick another --workdir or remove it."
            )
    try:
        yield workdir
    finally:
        if not opts.keep:
            if created:
                shutil.rmtree(workdir, ignore_errors=True)
            else:
                _remove_demo_files(workdir)


def _remove_demo_files(workdir: Path) -> None:
    for node in (PREFILL, DECODE):
        shutil.rmtree(workdir / f"{node}-journal", ignore_errors=True)
        for suffix in (".toml", ".log", ".sock"):
            with contextlib.suppress(FileNotFoundError):
                (workdir / f"{node}{suffix}").unlink()
    with contextlib.suppress(FileNotFoundError):
        (workdir / "secret").unlink()


@contextlib.contextmanager
def socket_folder(workdir: Path) -> Iterator[Path]:
    """The work folder, or a short temp folder when socket paths would be too long."""
    if len(str(workdir / "prefill.sock")) <= SOCKET_PATH_MAX:
        yield workdir
        return
    short = Path(tempfile.mkdtemp(prefix="kvpd-"))
    try:
        yield short
    finally:
        shutil.rmtree(short, ignore_errors=True)


async def _push_phase(
    plan: Plan, daemons: Sequence[DaemonProc], opts: Options, out: TextIO, stop: asyncio.Event
) -> PushResult:
    """Attach the engines, push the plan, close the engines (also when interrupted)."""
    prefill, decode = daemons
    engines = await create_engines(prefill, decode, opts.block_size, f"{SHM_PREFIX}{os.getpid()}")
    shm_files = sum(len(e.shm_paths) for e in engines.all())
    descriptors = sum(len(e.descriptors) for e in engines.all())
    try:
        progress = Progress(plan.size, out, out.isatty())
        start = time.perf_counter()
        outcomes = await Pusher(plan, engines, progress.advance, stop).run()
        elapsed = time.perf_counter() - start
        bad = bad_reports(engines)
    finally:
        leftover = await close_engines(engines)
    if stop.is_set():
        raise Interrupted(f"stopped by a signal after {len(outcomes)} of {plan.size} requests")
    counters = (await asyncio.to_thread(decode.status))["counters"]
    integrity = {k: v for k, v in counters.items() if k.startswith("integrity_")}
    return PushResult(
        outcomes, elapsed, bad, shm_files, leftover, descriptors=descriptors, integrity=integrity
    )


def _stop_on_signals(stop: asyncio.Event, out: TextIO) -> None:
    """First Ctrl-C (or SIGTERM/SIGHUP): finish what is in flight; second: abandon it."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()

    def on_signal() -> None:
        if stop.is_set():
            if task is not None:
                task.cancel()
            return
        stop.set()
        out.write("\n  stopping: finishing the requests in flight (again to abandon them)\n")
        out.flush()

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        loop.add_signal_handler(sig, on_signal)


async def _live_phase(
    plan: Plan, daemons: Sequence[DaemonProc], opts: Options, out: TextIO
) -> PushResult:
    """Start the daemons, wait until they are peered, then push the plan."""
    stop = asyncio.Event()
    _stop_on_signals(stop, out)
    started = time.monotonic()
    where = ", ".join(f"{d.node} on 127.0.0.1:{d.port}" for d in daemons)
    out.write(f"  starting daemons: {where}\n")
    out.flush()
    for d in daemons:
        d.start(wait=False)
    deadline = started + START_TIMEOUT_S
    await asyncio.gather(*(wait_ready(d, deadline, stop) for d in daemons))
    out.write(f"  daemons up and peered in {time.monotonic() - started:.1f} s\n")
    out.write(
        f"  engines: {ENGINES_PER_SIDE} prefill -> {ENGINES_PER_SIDE} decode,"
        f" groups of {LAYERS[0]} and {LAYERS[1]} layers\n"
    )
    out.flush()
    return await _push_phase(plan, daemons, opts, out, stop)


def _run_loop(coro: Coroutine[object, object, _T]) -> _T:
    """uvloop when available: on a 2-core machine the demo shares the CPUs with two daemons."""
    try:
        import uvloop
    except ImportError:
        run: Callable[[Coroutine[object, object, _T]], _T] = asyncio.run
    else:
        run = uvloop.run
    try:
        return run(coro)
    except asyncio.CancelledError:
        raise Interrupted("stopped by a second signal; requests in flight abandoned") from None


def run_demo(opts: Options, out: TextIO) -> int:
    plan = make_plan(opts.requests, opts.seed)
    counts = plan.kinds()
    refused = sum(counts[k] for k in REFUSED_KINDS)
    out.write(
        f"kvpushd demo: {plan.size} requests (seed {opts.seed}), {refused} of them must be"
        f" refused; blocks of {opts.block_size:,} B, {WINDOW} in flight\n"
    )
    stale = remove_stale_shm()
    if stale:
        out.write(f"  removed {len(stale)} shared-memory files of a demo run that was killed\n")
    with work_folder(opts) as workdir, socket_folder(workdir) as sockets:
        note = "kept (--keep)" if opts.keep else "removed at the end"
        out.write(f"  work folder {workdir} ({note})\n")
        out.flush()
        with contextlib.ExitStack() as stack:
            hosts = stack.enter_context(Hosts([PREFILL, DECODE])) if opts.hosts else None
            if hosts is not None:
                out.write(
                    f"  hosts: {PREFILL} at {hosts[PREFILL].address}, {DECODE} at "
                    f"{hosts[DECODE].address} (network namespaces; UCX over TCP)\n"
                )
            daemons = _daemons(workdir, sockets, hosts)
            return _run_daemons(plan, daemons, workdir, opts, out)


def _daemons(workdir: Path, sockets: Path, hosts: Hosts | None) -> tuple[DaemonProc, DaemonProc]:
    """The prefill and decode daemons, on this machine's loopback or each on its host."""
    ports = {PREFILL: free_port(), DECODE: free_port()}
    made = []
    for node, peer in ((PREFILL, DECODE), (DECODE, PREFILL)):
        where: dict[str, Any] = {"peers": [(peer, ports[peer])]}
        if hosts is not None:
            where = {
                "netns": hosts[node].netns,
                "host": hosts[node].address,
                "peer_addresses": [(peer, f"{hosts[peer].address}:{ports[peer]}")],
                "env": dict(UCX_TCP),
            }
        made.append(
            DaemonProc(
                node,
                workdir,
                ports[node],
                extra=VERIFY_ALL,
                timing=DEMO_TIMING,
                socket_dir=sockets,
                detached=True,
                **where,
            )
        )
    return made[0], made[1]


def _run_daemons(
    plan: Plan, daemons: tuple[DaemonProc, DaemonProc], workdir: Path, opts: Options, out: TextIO
) -> int:
    """Run the plan through the daemons, stop them, read their journals, judge."""
    write_secret(workdir / "secret")
    for d in daemons:
        d.write_config()
    try:
        push = _run_loop(_live_phase(plan, daemons, opts, out))
    finally:
        # Also on errors and signals: no daemon outlives the demo.
        codes, stop_problems = stop_daemons(daemons)
    journals = [read_journal(d.node, d.journal) for d in daemons]
    problems = _collect_problems(plan, push, stop_problems, journals)
    result = RunResult(plan, push, journals, codes, problems)
    print_summary(result, workdir, opts.keep, out)
    return _verdict(result, out)


def _collect_problems(
    plan: Plan, push: PushResult, stop_problems: list[str], journals: list[JournalView]
) -> list[str]:
    problems = [
        f"{o.request_id} ({o.kind.value}): expected {o.expected}, got {o.actual}"
        for o in sorted(push.outcomes, key=lambda o: o.request_id)
        if not o.ok
    ]
    missing = set(plan.expected()) - {o.request_id for o in push.outcomes}
    problems += [f"{rid}: never finished" for rid in sorted(missing)]
    flagged = {o.request_id for o in push.outcomes if not o.ok}
    problems += [
        f"{rid}: verification failed on {line}"
        for rid, line in sorted(push.bad_reports.items())
        if rid not in flagged
    ]
    problems += [f"shared memory file not unlinked: {path}" for path in push.leftover_shm]
    mismatches = push.integrity.get("integrity_mismatches", 0)
    if mismatches:
        problems.append(f"{mismatches} integrity mismatches (the decode journal names the blocks)")
    problems += stop_problems
    by_id = {o.request_id: o for o in push.outcomes}
    for view in journals:
        problems += check_journal(view, plan, by_id)
    return problems


def _verdict(result: RunResult, out: TextIO) -> int:
    if not result.problems:
        out.write(
            f"\ndemo OK: {plural(len(result.outcomes), 'request')} ended as planned,"
            " every delivered byte verified.\n"
        )
        return EXIT_OK
    out.write(f"\ndemo FAILED: {plural(len(result.problems), 'problem')}\n")
    for line in result.problems[:MAX_PROBLEMS_SHOWN]:
        out.write(f"  - {line}\n")
    if len(result.problems) > MAX_PROBLEMS_SHOWN:
        more = len(result.problems) - MAX_PROBLEMS_SHOWN
        out.write(f"  ... and {more} more; the journals and daemon logs tell the rest (--keep)\n")
    out.flush()
    print(
        f"kvpushd demo: FAILED with {plural(len(result.problems), 'problem')} (listed above)",
        file=sys.stderr,
    )
    return EXIT_FAILED


def main(args: argparse.Namespace) -> int:
    opts = Options(args.requests, args.block_size, args.workdir, args.keep, args.seed, args.hosts)
    problem = _check_options(opts)
    if problem is not None:
        print(f"kvpushd demo: {problem}", file=sys.stderr)
        return EXIT_USAGE
    try:
        return run_demo(opts, sys.stdout)
    except UsageError as exc:
        print(f"kvpushd demo: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except Interrupted as exc:
        sys.stdout.flush()
        print(f"\nkvpushd demo: {exc}; daemons stopped, memory freed", file=sys.stderr)
        return EXIT_INTERRUPTED
    except KeyboardInterrupt:
        # Outside the event loop (stopping the daemons, reading the journals):
        # the finally clauses on the way out stopped the daemons.
        print("\nkvpushd demo: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except (DemoError, ClientError, SimError, OSError) as exc:
        sys.stdout.flush()
        print(f"\nkvpushd demo: FAILED: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_FAILED
