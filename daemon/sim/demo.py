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
   on the decode side; the prefill caches must not change at all.
4. Stops the daemons with SIGTERM (they must exit 0), unlinks the shared
   memory, replays both journals, checks every request's path through them,
   and prints a summary: outcomes, refusals, bytes, throughput, latencies,
   and how to inspect the journals.

Exit status: 0 when every delivered byte was right and every request ended
as planned; 1 otherwise, after saying what went wrong; 2 for unusable
options or a work folder that cannot be used; 130 when stopped by Ctrl-C
(the first one lets the requests in flight finish, a second abandons them).

The plan (kinds, lengths, engines, block ids) depends only on ``--requests``
and ``--seed``. Destination blocks never collide by accident: request ``i``
runs in slot ``i % WINDOW``, each slot owns a fixed range of block ids on
every engine, and a slot runs its requests one after another, so a range is
reused only after its previous request was released on both sides. The only
collisions are the deliberate ``blocks_owned`` probes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import enum
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, TextIO, TypeVar

from daemon.client import ClientError, EngineClient, RpcError
from daemon.journal.format import JournalError
from daemon.journal.replay import ReplayError, replay
from daemon.journal.stats import JournalStats, percentile
from daemon.ops.texttable import table
from daemon.sim.engine import (
    SHM_DIR,
    Expectation,
    SimEngine,
    SimError,
    SimGroup,
    SimLayout,
    tail_pairs,
)
from daemon.sim.launcher import Daemon, Timing, free_port, write_secret
from schemas import rpc
from schemas.events import Record, Refused, WriteStarted
from schemas.layout import Role
from schemas.reasons import Reason
from schemas.state import RequestRecord, State

PREFILL: Final = "prefill"
DECODE: Final = "decode"
SHM_PREFIX: Final = "kvpushd-demo-"  # then PID-ENGINE-gGROUP

WINDOW: Final = 16  # requests in flight, one per slot
SLOT_BLOCKS: Final = 12  # block ids per slot and group; also the longest request
SLIDING_BLOCKS: Final = 4  # group 1 is a sliding-window group: it keeps the last 4 blocks
PROBE_BLOCKS: Final = 1  # a decode block past every slot, claimed only by duplicate probes
LAYERS: Final = (2, 3)  # layers of group 0 and group 1
ENGINES_PER_SIDE: Final = 2
EVENT_TIMEOUT_S: Final = 30.0
START_TIMEOUT_S: Final = 60.0
STOP_TIMEOUT_S: Final = 20.0
SOCKET_PATH_MAX: Final = 100  # sun_path is 108 bytes; keep a margin
MAX_PROBLEMS_SHOWN: Final = 20
EXIT_OK: Final = 0
EXIT_FAILED: Final = 1
EXIT_USAGE: Final = 2
EXIT_INTERRUPTED: Final = 130  # what shells report for a Ctrl-C

_T = TypeVar("_T")


class DemoError(Exception):
    """The demo could not run (a daemon did not start, an engine could not attach)."""


class UsageError(DemoError):
    """The options or the work folder cannot be used; nothing was started."""


class Interrupted(DemoError):
    """A signal asked the demo to stop; the daemons were stopped and the memory freed."""


# ===================================================================== plan


class Kind(enum.StrEnum):
    NO_HIT = "no prefix hit"
    PARTIAL = "partial prefix hit"
    FULL_HIT = "full prefix hit"
    TOO_LONG = Reason.DECODE_LONGER_THAN_PREFILL.value
    BLOCKS_OWNED = Reason.BLOCKS_OWNED.value
    DUPLICATE = Reason.DUPLICATE_REQUEST.value


DELIVERED_KINDS: Final = (Kind.NO_HIT, Kind.PARTIAL, Kind.FULL_HIT)
REFUSED_KINDS: Final = (Kind.TOO_LONG, Kind.BLOCKS_OWNED, Kind.DUPLICATE)
PROBE_KINDS: Final = (Kind.BLOCKS_OWNED, Kind.DUPLICATE)

Logical = tuple[tuple[int, ...], ...]  # logical block ids per group


def expected_outcome(kind: Kind) -> str:
    """The outcome string a request of ``kind`` must end with."""
    return "delivered" if kind in DELIVERED_KINDS else f"refused: {kind.value}"


@dataclass(frozen=True)
class Probe:
    """A registration that must be refused, made while its host request is live.

    ``blocks_owned``: a new request claiming one of the host's destination
    blocks. ``duplicate_request``: the host's own id registered again.
    """

    request_id: str
    kind: Kind


@dataclass(frozen=True)
class Transfer:
    """One request pushed from a prefill engine to a decode engine."""

    request_id: str
    kind: Kind
    slot: int
    prefill_engine: int
    decode_engine: int
    src: Logical  # the prefill side's full sequence
    dst: Logical  # the decode side's uncomputed suffix
    decode_first: bool  # which engine registers first
    probe: Probe | None = None


@dataclass(frozen=True)
class Plan:
    transfers: tuple[Transfer, ...]

    @property
    def probes(self) -> tuple[Probe, ...]:
        return tuple(t.probe for t in self.transfers if t.probe is not None)

    @property
    def size(self) -> int:
        return len(self.transfers) + len(self.probes)

    def kinds(self) -> Counter[Kind]:
        counts = Counter(t.kind for t in self.transfers)
        counts.update(p.kind for p in self.probes)
        return counts

    def expected(self) -> dict[str, str]:
        """Request (or probe) id -> the outcome it must end with."""
        out = {t.request_id: expected_outcome(t.kind) for t in self.transfers}
        out.update({p.request_id: expected_outcome(p.kind) for p in self.probes})
        return out


def refusals_per_kind(n: int) -> int:
    """A few of each refusal: 2 % of the stream each, at least one from 10 requests on."""
    if n < 10:
        return 0
    return max(1, n // 50)


def _spread(rng: random.Random, n: int, count: int, taken: set[int], gap: bool) -> list[int]:
    """``count`` positions in 1..n-1 not in ``taken``; with ``gap``, none adjacent to another."""
    chosen: list[int] = []
    candidates = list(range(1, n))
    rng.shuffle(candidates)
    for p in candidates:
        if len(chosen) == count:
            break
        if p in taken or (gap and (p - 1 in taken or p + 1 in taken)):
            continue
        chosen.append(p)
        taken.add(p)
    return chosen


def _choose_kinds(n: int, rng: random.Random) -> list[Kind]:
    """The kind of each position; a probe's host is the position before it."""
    each = refusals_per_kind(n)
    taken: set[int] = set()
    # Probes first and never adjacent, so the position before each is a free host.
    probes = _spread(rng, n, 2 * each, taken, gap=True)
    hosts = {p - 1 for p in probes}
    taken |= hosts
    too_long = _spread(rng, n, each, taken, gap=False)
    kinds: list[Kind] = []
    for i in range(n):
        if i in probes:
            kinds.append(PROBE_KINDS[probes.index(i) % 2])
        elif i in too_long:
            kinds.append(Kind.TOO_LONG)
        elif i in hosts:
            # A host must own at least one destination block while it is live.
            kinds.append(rng.choice((Kind.NO_HIT, Kind.PARTIAL)))
        else:
            kinds.append(rng.choices(DELIVERED_KINDS, weights=(35, 50, 15))[0])
    return kinds


def _lengths(kind: Kind, rng: random.Random) -> tuple[int, int]:
    """(prefill blocks, decode blocks) of group 0 for a request of ``kind``."""
    if kind is Kind.TOO_LONG:
        length = rng.randint(1, SLOT_BLOCKS - 2)
        return length, length + rng.randint(1, 2)
    if kind is Kind.PARTIAL:
        length = rng.randint(2, SLOT_BLOCKS)
        return length, rng.randint(1, length - 1)
    length = rng.randint(1, SLOT_BLOCKS)
    return length, 0 if kind is Kind.FULL_HIT else length


def _blocks(rng: random.Random, slot: int, counts: Sequence[int]) -> Logical:
    """Block ids from the slot's range, in a shuffled order as a real allocator hands them out."""
    base = slot * SLOT_BLOCKS
    return tuple(tuple(rng.sample(range(base, base + SLOT_BLOCKS), c)) for c in counts)


def make_plan(n: int, seed: int) -> Plan:
    """The request stream: a pure function of ``n`` and ``seed``."""
    rng = random.Random(seed)
    kinds = _choose_kinds(n, rng)
    transfers: list[Transfer] = []
    for i, kind in enumerate(kinds):
        rid = f"r{i:04d}"
        if kind in PROBE_KINDS:
            host = transfers[-1]  # position i-1, a host by construction
            transfers[-1] = dataclasses.replace(host, probe=Probe(rid, kind))
            continue
        slot = len(transfers) % WINDOW
        p_len, d_len = _lengths(kind, rng)
        # Group 1 is a sliding-window group: it holds at most the last few blocks.
        src = _blocks(rng, slot, (p_len, min(p_len, SLIDING_BLOCKS)))
        dst = _blocks(rng, slot, (d_len, min(d_len, SLIDING_BLOCKS, p_len)))
        transfers.append(
            Transfer(
                request_id=rid,
                kind=kind,
                slot=slot,
                prefill_engine=rng.randrange(ENGINES_PER_SIDE),
                decode_engine=rng.randrange(ENGINES_PER_SIDE),
                src=src,
                dst=dst,
                # Mostly decode first (its daemon forwards before the prefill
                # engine registers); the rest exercise the other order.
                decode_first=rng.random() < 0.75,
            )
        )
    return Plan(tuple(transfers))


def layouts(block_bytes: int) -> tuple[SimLayout, SimLayout]:
    """(prefill, decode) layouts: the same model, the decode side has probe blocks too."""
    slots = WINDOW * SLOT_BLOCKS

    def layout(num_blocks: int) -> SimLayout:
        return tuple(SimGroup(num_blocks, block_bytes, layers=n) for n in LAYERS)

    return layout(slots), layout(slots + PROBE_BLOCKS)


def shm_bytes(block_bytes: int) -> int:
    """Shared memory the four engines allocate (blocks only; guards are small)."""
    p, d = layouts(block_bytes)
    per = [sum(g.num_blocks * g.block_bytes * g.layers for g in lay) for lay in (p, d)]
    return ENGINES_PER_SIDE * sum(per)


# ================================================================== daemons

# Heartbeats every 0.5 s and a 5 s TTL: a busy 2-core machine must not
# make a daemon declare its peer dead in the middle of the demo.
DEMO_TIMING: Final = Timing(heartbeat_s=0.5, peer_ttl_s=5.0, drain_s=5.0)


class DaemonProc(Daemon):
    """A launcher daemon as the demo runs it, and how the demo reports its trouble.

    Built ``detached`` (a session of its own, so that Ctrl-C reaches only the
    demo, which lets the requests in flight finish and then stops the daemons
    in order; the death signal covers a demo that is killed outright).
    """

    @property
    def peer(self) -> str:
        return self.peers[0][0]

    def check_alive(self) -> None:
        code = self.exited()
        if code is not None:
            raise DemoError(f"the {self.node} daemon exited with status {code}\n{self.log_tail()}")

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return f"(no log at {self.log_path})"
        return "\n".join(f"  {self.node}| {line}" for line in text)

    def stop_or_kill(self) -> int:
        """SIGTERM, wait for the drain; a daemon that hangs is killed and reported."""
        try:
            return self.stop(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return -signal.SIGKILL


async def wait_ready(daemon: DaemonProc, deadline: float, stop: asyncio.Event) -> None:
    """Poll the daemon's status over its engine socket until it sees its peer up."""
    last = "no answer on the engine socket"
    while time.monotonic() < deadline:
        if stop.is_set():
            raise Interrupted("stopped by a signal while the daemons were starting")
        daemon.check_alive()
        try:
            async with await EngineClient.connect(
                daemon.socket, client_name="kvpushd-demo", timeout=2.0
            ) as client:
                status = await client.status(timeout=2.0)
            if any(p.get("node") == daemon.peer and p.get("up") for p in status["peers"]):
                return
            last = f"answers, but does not see {daemon.peer} up yet"
        except (ClientError, OSError, TimeoutError) as exc:
            last = str(exc)
        await asyncio.sleep(0.1)
    raise DemoError(
        f"the {daemon.node} daemon was not ready within {START_TIMEOUT_S:.0f} s: {last}\n"
        f"{daemon.log_tail()}"
    )


# ================================================================= running


@dataclass
class Outcome:
    """How one planned request (or probe) ended, as the demo saw it."""

    request_id: str
    kind: Kind
    actual: str  # "delivered", "refused: REASON", or "error: ..."
    latency_s: float | None = None  # end to end, delivered requests only
    nbytes: int = 0  # bytes pushed into the decode cache
    blocks: int = 0  # kernel blocks verified on the decode side

    @property
    def expected(self) -> str:
        return expected_outcome(self.kind)

    @property
    def ok(self) -> bool:
        return self.actual == self.expected


@dataclass
class Engines:
    prefill: list[SimEngine] = field(default_factory=list)
    decode: list[SimEngine] = field(default_factory=list)

    def all(self) -> list[SimEngine]:
        return [*self.prefill, *self.decode]


@dataclass
class PushResult:
    outcomes: list[Outcome]
    seconds: float  # the push phase: first registration to last release
    bad_reports: dict[str, str]  # request id -> its failed verification
    shm_files: int  # shared-memory files the engines created
    leftover_shm: list[str]  # ... and those still there after closing them


def pushed_bytes(layout: SimLayout, dst: Logical) -> tuple[int, int]:
    """(bytes, kernel blocks) written into the decode cache for ``dst``."""
    nbytes = sum(len(ids) * g.block_bytes * g.layers for g, ids in zip(layout, dst, strict=True))
    return nbytes, sum(len(ids) for ids in dst)


class Pusher:
    """Runs the plan against the engines: one task per slot, each request checked."""

    def __init__(
        self,
        plan: Plan,
        engines: Engines,
        on_outcome: Callable[[Outcome], None],
        stop: asyncio.Event,
    ) -> None:
        self.plan = plan
        self.engines = engines
        self.on_outcome = on_outcome
        self.stop = stop  # set by a signal: start nothing new, finish what is in flight
        self.outcomes: list[Outcome] = []
        self._recorded: set[str] = set()

    async def run(self) -> list[Outcome]:
        slots: dict[int, list[Transfer]] = {}
        for t in self.plan.transfers:
            slots.setdefault(t.slot, []).append(t)
        await asyncio.gather(*(self._slot(ts) for ts in slots.values()))
        return self.outcomes

    async def _slot(self, transfers: list[Transfer]) -> None:
        # In order: the next request of a slot reuses its blocks only once the
        # previous one was released on both sides.
        for t in transfers:
            if self.stop.is_set():
                return
            await self._one(t)

    def _record(self, outcome: Outcome) -> None:
        self.outcomes.append(outcome)
        self._recorded.add(outcome.request_id)
        self.on_outcome(outcome)

    async def _one(self, t: Transfer) -> None:
        pe = self.engines.prefill[t.prefill_engine]
        de = self.engines.decode[t.decode_engine]
        try:
            if t.kind is Kind.TOO_LONG:
                outcome = await self._refused_transfer(t, pe, de)
            else:
                outcome = await self._delivered_transfer(t, pe, de)
        except (ClientError, SimError, TimeoutError) as exc:
            outcome = Outcome(t.request_id, t.kind, f"error: {type(exc).__name__}: {exc}")
            if t.probe is not None and t.probe.request_id not in self._recorded:
                self._record(Outcome(t.probe.request_id, t.probe.kind, "error: host failed"))
            await _abandon(t.request_id, pe, de)
        self._record(outcome)

    async def _register(self, t: Transfer, pe: SimEngine, de: SimEngine, expect: bool) -> None:
        expectation = None
        if expect:
            pairs = tail_pairs(pe.layout, t.src, de.layout, t.dst)
            expectation = Expectation(pe.engine_id, pairs)
        kv_ready = t.kind is not Kind.TOO_LONG
        if t.decode_first:
            await de.decode_register(t.request_id, t.dst, PREFILL, expect=expectation)
            await pe.prefill(t.request_id, t.src, kv_ready=kv_ready)
        else:
            await pe.prefill(t.request_id, t.src, kv_ready=kv_ready)
            await de.decode_register(t.request_id, t.dst, PREFILL, expect=expectation)

    async def _delivered_transfer(self, t: Transfer, pe: SimEngine, de: SimEngine) -> Outcome:
        start = time.perf_counter()
        await self._register(t, pe, de, expect=True)
        arrived, freed = await _both_events(t.request_id, pe, de)
        latency = time.perf_counter() - start
        # The probe runs while the host is done but not yet released: its
        # blocks are still owned and its id still live.
        if t.probe is not None:
            self._record(await self._probe(t, t.probe, de))
        actual = _delivery_verdict(t.request_id, arrived, freed, pe, de)
        await _release_both(t.request_id, pe, de)
        nbytes, blocks = pushed_bytes(de.layout, t.dst)
        return Outcome(t.request_id, t.kind, actual, latency, nbytes, blocks)

    async def _refused_transfer(self, t: Transfer, pe: SimEngine, de: SimEngine) -> Outcome:
        await self._register(t, pe, de, expect=False)
        d_event, p_event = await _both_events(t.request_id, pe, de)
        if (
            isinstance(d_event, rpc.RequestFailed)
            and isinstance(p_event, rpc.RequestFailed)
            and d_event.reason is p_event.reason
        ):
            actual = f"refused: {d_event.reason.value}"
        else:
            actual = f"error: decode got {_name(d_event)}, prefill got {_name(p_event)}"
        # Nothing may have been written: verifying with no pairs checks that
        # none of the request's blocks (nor any other settled block) changed.
        empty = tuple(() for _ in de.layout)
        report = de.verify(t.request_id, empty, source_engine=pe.engine_id)
        if not report.ok:
            actual = f"error: bytes changed in a refused request: {_problems(report.problems())}"
        await _release_both(t.request_id, pe, de)
        return Outcome(t.request_id, t.kind, actual)

    async def _probe(self, host: Transfer, probe: Probe, de: SimEngine) -> Outcome:
        if probe.kind is Kind.BLOCKS_OWNED:
            rid, blocks = probe.request_id, ((host.dst[0][0],), ())
        else:
            spare = WINDOW * SLOT_BLOCKS  # a probe-only block: free, so only the id is wrong
            rid, blocks = host.request_id, ((spare,), ())
        try:
            await de.client.register_request(de.engine_id, rid, Role.RECEIVER, blocks, peer=PREFILL)
        except RpcError as exc:
            return Outcome(probe.request_id, probe.kind, f"refused: {exc.code}")
        # Accepted: that is the bug the probe looks for. Undo it as well as we can.
        if rid != host.request_id:
            with contextlib.suppress(ClientError):
                await de.client.abort(rid)
                await de.client.release(rid)
        return Outcome(probe.request_id, probe.kind, f"error: {rid} with {blocks} was accepted")


async def _both_events(rid: str, pe: SimEngine, de: SimEngine) -> tuple[rpc.Event, rpc.Event]:
    """The decode side's arrival (or failure) and the prefill side's freeable (or failure)."""
    d_event, p_event = await asyncio.gather(
        de.wait_event(rid, (rpc.KvArrived, rpc.RequestFailed), timeout=EVENT_TIMEOUT_S),
        pe.wait_event(rid, (rpc.BlocksFreeable, rpc.RequestFailed), timeout=EVENT_TIMEOUT_S),
    )
    return d_event, p_event


def _delivery_verdict(
    rid: str, arrived: rpc.Event, freed: rpc.Event, pe: SimEngine, de: SimEngine
) -> str:
    if not isinstance(arrived, rpc.KvArrived) or not isinstance(freed, rpc.BlocksFreeable):
        return f"error: decode got {_name(arrived)}, prefill got {_name(freed)}"
    d_report, p_report = de.reports.get((rid, 1)), pe.reports.get((rid, 1))
    if d_report is None or p_report is None:
        return "error: the simulated engines did not verify the request"
    if not d_report.ok:
        return f"error: wrong bytes on the decode side: {_problems(d_report.problems())}"
    if not p_report.ok:
        return f"error: the prefill cache changed: {_problems(p_report.problems())}"
    return "delivered"


async def _release_both(rid: str, pe: SimEngine, de: SimEngine) -> None:
    await asyncio.gather(
        de.release(rid, timeout=EVENT_TIMEOUT_S), pe.release(rid, timeout=EVENT_TIMEOUT_S)
    )


async def _abandon(rid: str, pe: SimEngine, de: SimEngine) -> None:
    """After an error: abort and release on both sides, best effort, so the slot frees up."""
    for engine in (de, pe):
        with contextlib.suppress(ClientError, SimError, TimeoutError):
            await engine.abort(rid)
        with contextlib.suppress(ClientError, SimError, TimeoutError):
            await engine.release(rid, timeout=EVENT_TIMEOUT_S)


def _name(event: rpc.Event) -> str:
    reason = getattr(event, "reason", None)
    return type(event).__name__ + (f"({reason.value})" if reason is not None else "")


def _problems(problems: Sequence[str], limit: int = 1) -> str:
    more = f" (+{len(problems) - limit} more)" if len(problems) > limit else ""
    return "; ".join(problems[:limit]) + more


def remove_stale_shm(shm_dir: str = SHM_DIR) -> list[str]:
    """Unlink the shm files of demo runs that were killed outright (their pid is gone).

    A SIGKILL leaves no chance to clean up; the next run does it.
    """
    removed = []
    for path in Path(shm_dir).glob(f"{SHM_PREFIX}*"):
        pid = path.name.removeprefix(SHM_PREFIX).split("-", 1)[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            with contextlib.suppress(OSError):
                path.unlink()
                removed.append(str(path))
    return removed


async def create_engines(
    prefill: DaemonProc, decode: DaemonProc, block_bytes: int, tag: str
) -> Engines:
    """Two engines per side; closed by the caller (even when this fails half-way)."""
    p_layout, d_layout = layouts(block_bytes)
    engines = Engines()
    try:
        for i in range(ENGINES_PER_SIDE):
            engines.prefill.append(
                await SimEngine.create(
                    f"prefill-{i}", Role.PUSHER, p_layout, prefill.socket, shm_prefix=f"{tag}-p{i}"
                )
            )
            engines.decode.append(
                await SimEngine.create(
                    f"decode-{i}", Role.RECEIVER, d_layout, decode.socket, shm_prefix=f"{tag}-d{i}"
                )
            )
    except BaseException:
        await close_engines(engines)
        raise
    return engines


async def close_engines(engines: Engines) -> list[str]:
    """Close every engine; the shm paths that still exist afterwards (should be none)."""
    paths = [p for e in engines.all() for p in e.shm_paths]
    for engine in engines.all():
        with contextlib.suppress(ClientError, OSError):
            await engine.close()
    return [p for p in paths if os.path.exists(p)]


def bad_reports(engines: Engines) -> dict[str, str]:
    """Request id -> what its failed verification found, on any engine.

    The outcome of a request usually says it already; this also catches a
    verification that failed where the demo was not looking for it.
    """
    return {
        report.request_id: f"{e.engine_id}: {_problems(report.problems())}"
        for e in engines.all()
        for report in e.reports.values()
        if not report.ok
    }


# ================================================================ progress


class Progress:
    """A ``\\r`` bar on a terminal; a plain line every 10 % otherwise."""

    def __init__(self, total: int, out: TextIO, tty: bool) -> None:
        self.total = max(1, total)
        self.out = out
        self.tty = tty
        self.done = 0
        self.problems = 0
        self.started = time.perf_counter()
        self._last_draw = 0.0
        self._next_tenth = 1

    def advance(self, outcome: Outcome) -> None:
        self.done += 1
        self.problems += not outcome.ok
        if self.tty:
            self._draw(final=self.done >= self.total)
        else:
            self._line()

    def _status(self) -> str:
        elapsed = time.perf_counter() - self.started
        problems = _plural(self.problems, "problem")
        return f"{self.done}/{self.total} requests  {problems}  {elapsed:.1f} s"

    def _draw(self, final: bool) -> None:
        now = time.perf_counter()
        if not final and now - self._last_draw < 0.1:
            return  # a redraw per request would cost more than the push itself
        self._last_draw = now
        width = 30
        filled = width * self.done // self.total
        bar = "#" * filled + "-" * (width - filled)
        self.out.write(f"\r  pushing [{bar}] {self._status()}")
        if final:
            self.out.write("\n")
        self.out.flush()

    def _line(self) -> None:
        while self.done * 10 >= self._next_tenth * self.total and self._next_tenth <= 10:
            self.out.write(f"  pushed {self._next_tenth * 10:3d}%  {self._status()}\n")
            self.out.flush()
            self._next_tenth += 1


# ================================================================ journals


@dataclass
class JournalView:
    """What one daemon's journal says, folded through the core as on replay."""

    node: str
    path: Path
    stats: JournalStats
    records: int = 0
    live: int = 0
    states: dict[str, list[State]] = field(default_factory=dict)  # request -> states entered
    failures: dict[str, Reason] = field(default_factory=dict)
    refused: dict[str, list[Reason]] = field(default_factory=dict)
    write_bytes: dict[str, int] = field(default_factory=dict)
    error: str = ""

    def on_record(self, record: Record, touched: object) -> None:
        self.stats.on_record(record, touched)
        event = record.event
        rid = getattr(event, "request_id", None)
        if rid is None:
            return
        if isinstance(event, Refused):
            self.refused.setdefault(rid, []).append(event.reason)
        elif isinstance(event, WriteStarted):
            self.write_bytes[rid] = event.nbytes
        if isinstance(touched, RequestRecord):
            states = self.states.setdefault(rid, [])
            if not states or states[-1] is not touched.state:
                states.append(touched.state)
            if touched.state is State.FAILED and touched.reason is not None:
                self.failures[rid] = touched.reason


def read_journal(node: str, path: Path) -> JournalView:
    view = JournalView(node, path, JournalStats())
    try:
        result = replay(path, on_record=view.on_record)
    except (JournalError, ReplayError) as exc:
        view.error = f"{type(exc).__name__}: {exc}"
        return view
    view.records, view.live = result.records, len(result.registry.live)
    if result.torn_bytes:
        view.error = f"torn tail of {result.torn_bytes} bytes after a clean stop"
    return view


def check_journal(view: JournalView, plan: Plan, outcomes: dict[str, Outcome]) -> list[str]:
    """Every planned request took the path it should have through this journal."""
    problems: list[str] = []
    if view.error:
        return [f"{view.node} journal: {view.error}"]
    if view.live:
        problems.append(f"{view.node} journal: {view.live} requests still live after the stop")
    for t in plan.transfers:
        problems += _check_transfer(view, t, outcomes.get(t.request_id))
    for probe in plan.probes:
        if probe.kind is Kind.BLOCKS_OWNED and probe.request_id in view.states:
            problems.append(
                f"{view.node} journal: refused probe {probe.request_id} became a request"
            )
    return problems


def _check_transfer(view: JournalView, t: Transfer, outcome: Outcome | None) -> list[str]:
    where = f"{view.node} journal, {t.request_id} ({t.kind.value})"
    states = view.states.get(t.request_id, [])
    path = " -> ".join(s.value for s in states) or "nothing"
    if not states or states[-1] is not State.RELEASED:
        return [f"{where}: does not end released: {path}"]
    if t.kind is Kind.TOO_LONG:
        reason = view.failures.get(t.request_id)
        if State.FAILED not in states or reason is not Reason.DECODE_LONGER_THAN_PREFILL:
            return [f"{where}: expected failed ({t.kind.value}), got {path} ({reason})"]
        if view.node == PREFILL and Reason.DECODE_LONGER_THAN_PREFILL not in view.refused.get(
            t.request_id, []
        ):
            return [f"{where}: the trim refusal was not journaled"]
        return []
    if State.DONE not in states or State.FAILED in states:
        return [f"{where}: expected done -> released, got {path}"]
    if view.node == PREFILL and outcome is not None and outcome.actual == "delivered":
        journaled = view.write_bytes.get(t.request_id)
        if journaled != outcome.nbytes:
            return [
                f"{where}: journal says {journaled} bytes written, the engines {outcome.nbytes}"
            ]
    return []


# ================================================================= summary


def _table(header: Sequence[str], rows: Sequence[Sequence[object]], right: int = 1) -> str:
    """The summary's tables: indented, numbers (columns from ``right`` on) right-aligned."""
    return table(header, rows, indent="  ", right=right)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB ({nbytes:,} bytes)"


@dataclass
class RunResult:
    """Everything the summary needs."""

    plan: Plan
    push: PushResult
    journals: list[JournalView]
    exit_codes: dict[str, int]
    problems: list[str]

    @property
    def outcomes(self) -> list[Outcome]:
        return self.push.outcomes


def outcome_rows(result: RunResult) -> list[tuple[str, int, int]]:
    expected = Counter(result.plan.kinds())
    actual = Counter(o.kind for o in result.outcomes if o.ok)
    rows = []
    for kind in (*DELIVERED_KINDS, *REFUSED_KINDS):
        label = f"delivered, {kind.value}" if kind in DELIVERED_KINDS else f"refused, {kind.value}"
        rows.append((label, expected[kind], actual[kind]))
    errors = sum(not o.ok for o in result.outcomes)
    if errors:
        rows.append(("NOT AS PLANNED", 0, errors))
    rows.append(("total", result.plan.size, len(result.outcomes)))
    return rows


def final_state_rows(journals: Sequence[JournalView], plan: Plan) -> list[list[object]]:
    """Per node: how the journal says each request ended."""

    def label(view: JournalView, rid: str) -> str:
        states = view.states.get(rid, [])
        if not states:
            return "never registered (refused)"
        last = states[-1].value
        if State.FAILED in states:
            reason = view.failures.get(rid)
            return f"{last} after failed ({reason.value if reason else '?'})"
        if State.DONE in states:
            return f"{last} after done"
        return last

    ids = [t.request_id for t in plan.transfers] + [
        p.request_id for p in plan.probes if p.kind is Kind.BLOCKS_OWNED
    ]
    counts = [Counter(label(v, rid) for rid in ids) for v in journals]
    keys = sorted(set().union(*counts))
    return [[key, *(c[key] for c in counts)] for key in keys]


def refusal_rows(result: RunResult) -> list[list[object]]:
    expected = {k.value: n for k, n in result.plan.kinds().items() if k in REFUSED_KINDS}
    seen = Counter(
        o.actual.removeprefix("refused: ")
        for o in result.outcomes
        if o.actual.startswith("refused")
    )
    journaled = [v.stats.refusals for v in result.journals]
    reasons = sorted(set(expected) | set(seen) | set().union(*journaled))
    return [[r, expected.get(r, 0), seen[r], *(j.get(r, 0) for j in journaled)] for r in reasons]


def latency_rows(result: RunResult) -> list[list[object]]:
    e2e = sorted(o.latency_s for o in result.outcomes if o.ok and o.latency_s is not None)
    rows: list[list[object]] = []
    if e2e:
        rows.append(
            [
                "end to end (demo, delivered)",
                len(e2e),
                _ms(percentile(e2e, 50)),
                _ms(percentile(e2e, 99)),
                _ms(e2e[-1]),
            ]
        )
    for view in result.journals:
        for name, n, p50, p99, mx in view.stats.latency_table():
            rows.append([f"{view.node:<8} {name}", n, _ms(p50), _ms(p99), _ms(mx)])
    return rows


def cli_command() -> str:
    """How to call kvpushd from this shell: bare when on PATH, else the venv's script."""
    script = Path(sys.executable).parent / "kvpushd"
    on_path = shutil.which("kvpushd")
    if on_path and (not script.exists() or Path(on_path).resolve() == script.resolve()):
        return "kvpushd"
    if script.exists():
        with contextlib.suppress(ValueError):
            return str(script.relative_to(Path.cwd()))
        return str(script)
    return f"{sys.executable} -m daemon.cli"


def example_ids(result: RunResult) -> list[str]:
    """The first request that went wrong, a delivered partial hit and a refused one."""
    picks = [o.request_id for o in result.outcomes if not o.ok][:1]
    for kind in (Kind.PARTIAL, Kind.TOO_LONG):
        for o in result.outcomes:
            if o.kind is kind and o.ok:
                picks.append(o.request_id)
                break
    return picks or [t.request_id for t in result.plan.transfers[:1]]


def print_summary(result: RunResult, workdir: Path, keep: bool, out: TextIO) -> None:
    w = out.write
    delivered = [o for o in result.outcomes if o.ok and o.latency_s is not None]
    nbytes = sum(o.nbytes for o in delivered)
    blocks = sum(o.blocks for o in delivered)
    push = max(result.push.seconds, 1e-9)
    names = [v.node for v in result.journals]

    w("\nsummary\n\n")
    w(_table(["requests by outcome", "planned", "as planned"], outcome_rows(result)) + "\n\n")
    w(_table(["final state in journal", *names], final_state_rows(result.journals, result.plan)))
    w("\n\n")
    refusals = refusal_rows(result)
    header = ["refusal reason", "planned", "engines told", *(f"{n} journal" for n in names)]
    w(_table(header, refusals or [["-", 0, 0, *(0 for _ in names)]]) + "\n\n")
    wrong = sum(o.actual.startswith("error: wrong bytes") for o in result.outcomes)
    checked = (
        "every byte verified" if not wrong else f"{_plural(wrong, 'request')} with WRONG bytes"
    )
    w(f"  bytes moved      {_size(nbytes)} in {blocks:,} blocks, {checked}\n")
    w(
        f"  push phase       {result.push.seconds:.2f} s: {nbytes / push / 1e9:.3g} GB/s,"
        f" {len(result.outcomes) / push:.1f} requests/s, {WINDOW} in flight\n"
    )
    # Measured: the demo process (pattern fills and whole-cache checks) is
    # busy all along while the daemons idle; say so, so nobody quotes these
    # figures as the daemon's speed.
    w("                   (bound by the simulated engines filling and checking every byte)\n\n")
    rows = latency_rows(result)
    header = ["latency", "count", "p50 ms", "p99 ms", "max ms"]
    w(_table(header, rows or [["-", 0, "-", "-", "-"]]) + "\n\n")
    codes = ", ".join(f"{node} exited {code}" for node, code in result.exit_codes.items())
    w(f"  daemons          stopped with SIGTERM: {codes}\n")
    created, left = result.push.shm_files, len(result.push.leftover_shm)
    w(f"  shared memory    {created} files created, {created - left} unlinked\n\n")
    _print_journals(result, workdir, keep, w)


def _print_journals(result: RunResult, workdir: Path, keep: bool, w: Callable[[str], int]) -> None:
    for view in result.journals:
        w(f"  {view.node + ' journal':<16} {view.path}  ({view.records} records)\n")
    if not keep:
        w(f"\n  work folder {workdir} removed; run with --keep to inspect the journals:\n")
    else:
        w(f"\n  kept in {workdir}; inspect the journals with:\n")
    cli = cli_command()
    for view in result.journals:
        w(f"    {cli} journal stats {view.path}\n")
    for rid in example_ids(result):
        for view in result.journals:
            w(f"    {cli} journal show {view.path} --request {rid}\n")


# ===================================================================== main


@dataclass(frozen=True)
class Options:
    requests: int
    block_size: int
    workdir: Path | None
    keep: bool
    seed: int


def _check_options(opts: Options) -> str | None:
    if opts.requests < 1:
        return "--requests must be at least 1"
    if not 64 <= opts.block_size <= 16 * 2**20:
        return "--block-size must be between 64 bytes and 16 MiB"
    need = shm_bytes(opts.block_size)
    with contextlib.suppress(OSError):
        stat = os.statvfs("/dev/shm")
        free = stat.f_bavail * stat.f_frsize
        if need > free * 0.8:
            return (
                f"--block-size {opts.block_size} needs {need / 2**20:.0f} MiB of /dev/shm,"
                f" only {free / 2**20:.0f} MiB is free"
            )
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
    return PushResult(outcomes, elapsed, bad, shm_files, leftover)


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


def _stop_daemons(daemons: Sequence[DaemonProc]) -> tuple[dict[str, int], list[str]]:
    codes = {d.node: d.stop_or_kill() for d in daemons}
    problems = [
        f"the {d.node} daemon exited {codes[d.node]} after SIGTERM, not 0\n{d.log_tail()}"
        for d in daemons
        if codes[d.node] != 0
    ]
    return codes, problems


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
        p_port, d_port = free_port(), free_port()
        prefill, decode = (
            DaemonProc(
                node, workdir, port, [peer], timing=DEMO_TIMING, socket_dir=sockets, detached=True
            )
            for node, port, peer in (
                (PREFILL, p_port, (DECODE, d_port)),
                (DECODE, d_port, (PREFILL, p_port)),
            )
        )
        daemons = (prefill, decode)
        write_secret(workdir / "secret")
        for d in daemons:
            d.write_config()
        try:
            push = _run_loop(_live_phase(plan, daemons, opts, out))
        finally:
            # Also on errors and signals: no daemon outlives the demo.
            codes, stop_problems = _stop_daemons(daemons)
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
    problems += stop_problems
    by_id = {o.request_id: o for o in push.outcomes}
    for view in journals:
        problems += check_journal(view, plan, by_id)
    return problems


def _verdict(result: RunResult, out: TextIO) -> int:
    if not result.problems:
        out.write(
            f"\ndemo OK: {_plural(len(result.outcomes), 'request')} ended as planned,"
            " every delivered byte verified.\n"
        )
        return EXIT_OK
    out.write(f"\ndemo FAILED: {_plural(len(result.problems), 'problem')}\n")
    for line in result.problems[:MAX_PROBLEMS_SHOWN]:
        out.write(f"  - {line}\n")
    if len(result.problems) > MAX_PROBLEMS_SHOWN:
        more = len(result.problems) - MAX_PROBLEMS_SHOWN
        out.write(f"  ... and {more} more; the journals and daemon logs tell the rest (--keep)\n")
    out.flush()
    print(
        f"kvpushd demo: FAILED with {_plural(len(result.problems), 'problem')} (listed above)",
        file=sys.stderr,
    )
    return EXIT_FAILED


def main(args: argparse.Namespace) -> int:
    opts = Options(args.requests, args.block_size, args.workdir, args.keep, args.seed)
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
