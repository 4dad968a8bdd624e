"""The demo's push loop: engines attached, each planned request pushed and checked.

:class:`Pusher` runs the plan, one task per slot (a slot's requests one
after another), and turns each request and probe into an :class:`Outcome`:
delivered (every byte verified on the decode side, the prefill cache
unchanged), refused for the planned reason, or an error saying what went
wrong.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from daemon.client import ClientError, RpcError
from daemon.sim.demo_daemons import DaemonProc
from daemon.sim.demo_plan import (
    ENGINES_PER_SIDE,
    PREFILL,
    SLOT_BLOCKS,
    WINDOW,
    Kind,
    Logical,
    Plan,
    Probe,
    Transfer,
    expected_outcome,
    layouts,
)
from daemon.sim.engine import (
    SHM_DIR,
    Expectation,
    SimEngine,
    SimError,
    SimLayout,
    tail_pairs,
)
from daemon.sim.engine_shm import DESCRIPTOR
from schemas import rpc
from schemas.layout import Role

SHM_PREFIX: Final = "kvpushd-demo-"  # then PID-ENGINE-gGROUP
EVENT_TIMEOUT_S: Final = 30.0


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
    shm_files: int  # shared-memory files the engines created (none: they pass memfds)
    leftover_shm: list[str]  # ... and those still there after closing them
    descriptors: int = 0  # regions the engines passed to their daemons as memfds
    # The decode daemon's integrity counters (verify = "all"): requests
    # checked, block checksums found equal, mismatches.
    integrity: dict[str, int] = field(default_factory=dict)


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
                    f"prefill-{i}",
                    Role.PUSHER,
                    p_layout,
                    prefill.socket,
                    shm_prefix=f"{tag}-p{i}",
                    memory=DESCRIPTOR,
                )
            )
            engines.decode.append(
                await SimEngine.create(
                    f"decode-{i}",
                    Role.RECEIVER,
                    d_layout,
                    decode.socket,
                    shm_prefix=f"{tag}-d{i}",
                    memory=DESCRIPTOR,
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
