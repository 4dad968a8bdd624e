"""A simulated inference engine: real shared memory, real client, checked bytes.

It stands in for vLLM/SGLang in tests and in ``kvpushd demo``. It allocates
its KV cache as POSIX shared-memory files, registers them with its daemon
through :mod:`daemon.client`, fills prefill blocks with :mod:`daemon.sim.kvpattern`
bytes before saying ``kv_ready``, and on the decode side checks, when
``KvArrived`` comes, that every destination block holds exactly the pattern of
the prefill block it should and that no other byte of its cache changed. On
the prefill side, ``BlocksFreeable`` triggers the converse check: a push only
reads the source, so no byte of the prefill cache may have changed.

Memory
    One shared-memory region per group, layers between guard bands:
    :mod:`daemon.sim.engine_shm`.

What "no other block changed" means with many requests in flight
    The engine keeps a reference copy of its cache (what every byte should
    hold). Verifying a request compares the whole cache with the reference,
    allowing only the request's paired destination blocks and the blocks of
    other requests still waiting for their KV to differ; it then accepts the
    request's blocks into the reference. A release (or the ``Released`` event
    after a deferred one) accepts the request's blocks as they are, so a late
    write into freed blocks is caught by the next verification. Each check
    compares the whole cache: O(cache size), about 1 ms per 4 MiB, so keep
    simulated caches modest.

The expected pairing is given by the test (or by :func:`tail_pairs` for the
plain tail-trim case) and block expansion is reimplemented in
:mod:`daemon.sim.engine_layout`, not imported from the core: this engine is an
oracle for the daemon, so it must not share the daemon's logic.

This module is what callers import: besides the engine it exports the
layout vocabulary (:class:`SimGroup`, :data:`SimLayout`, :func:`expand`,
:func:`tail_pairs`, :class:`SimError`) and :data:`SHM_DIR`.

Process mode (one engine per process, JSON lines on stdin/stdout):
``python -m harness.engine_process``; see :mod:`harness.engine_process`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import msgspec

from daemon.client import ClientError, ConnectionLost, EngineClient
from daemon.sim import kvpattern
from daemon.sim.engine_layout import SimError, SimGroup, SimLayout, expand, tail_pairs
from daemon.sim.engine_shm import (
    FILE,
    SHM_DIR,
    MemfdRegion,
    Region,
    ShmRegion,
    allocate,
    default_shm_prefix,
)
from daemon.sim.kvpattern import Change, KvView, Mismatch, Pairs, Snapshot
from schemas import rpc
from schemas.fingerprint import Fingerprint
from schemas.kvlayout import GroupSpec, RegionSpec
from schemas.layout import Role

__all__ = [
    "SHM_DIR",
    "Expectation",
    "KvCorruption",
    "SimEngine",
    "SimError",
    "SimGroup",
    "SimLayout",
    "VerifyReport",
    "expand",
    "request_tag",
    "tail_pairs",
]

log = logging.getLogger(__name__)

_CANARY: Final = 0xA5
_BACKGROUND_REQUEST: Final = "<background>"


class KvCorruption(AssertionError):
    """A verification found wrong bytes; carries the report."""

    def __init__(self, report: VerifyReport) -> None:
        super().__init__(str(report))
        self.report = report


def request_tag(request_id: str, incarnation: int) -> str:
    """The pattern tag of one incarnation: residue of another never matches."""
    return f"{request_id}#{incarnation}"


# ------------------------------------------------------------ verification


@dataclass(frozen=True)
class Expectation:
    """What a decode request's blocks should hold: pairs into a source engine's blocks."""

    source_engine: str
    pairs: Pairs


@dataclass(frozen=True)
class VerifyReport:
    request_id: str
    incarnation: int
    mismatches: tuple[Mismatch, ...] = ()
    changes: tuple[Change, ...] = ()
    blocks_checked: int = 0

    @property
    def ok(self) -> bool:
        return not self.mismatches and not self.changes

    def problems(self) -> list[str]:
        return [str(m) for m in self.mismatches] + [str(c) for c in self.changes]

    def raise_if_bad(self) -> None:
        if not self.ok:
            raise KvCorruption(self)

    def __str__(self) -> str:
        head = f"request {self.request_id}#{self.incarnation}: "
        if self.ok:
            return head + f"{self.blocks_checked} blocks verified"
        return head + "; ".join(self.problems())


@dataclass
class _Live:
    """What the engine remembers of one of its requests.

    ``settled``: its blocks may no longer change (verified or released), so
    they are no longer exempt from the "nothing else changed" check.
    """

    role: Role
    kernel_blocks: tuple[tuple[int, ...], ...]
    expectation: Expectation | None = None
    events: list[rpc.Event] = field(default_factory=list)
    settled: bool = False


_Key = tuple[str, int]


# ------------------------------------------------------------------ engine


class SimEngine:
    """One simulated engine with one role, on one daemon connection.

    Build with :meth:`create`; drive with :meth:`prefill` (pusher),
    :meth:`decode_register` / :meth:`verify` (receiver), :meth:`wait_event`,
    :meth:`release`, :meth:`abort`; end with :meth:`close`.
    """

    def __init__(
        self,
        engine_id: str,
        role: Role,
        layout: SimLayout,
        groups: tuple[GroupSpec, ...],
        regions: list[Region],
    ) -> None:
        self.engine_id = engine_id
        self.role = role
        self.layout = layout
        self.groups = groups
        self._shm = regions
        self.view = KvView(groups, {r.name: r.array for r in regions})
        self._reference: Snapshot | None = None
        self._live: dict[_Key, _Live] = {}
        self.reports: dict[_Key, VerifyReport] = {}
        self.on_report: Callable[[VerifyReport], None] | None = None
        self.on_event: Callable[[rpc.Event], None] | None = None
        self._client: EngineClient | None = None
        self._pump: asyncio.Task[None] | None = None
        self._changed = asyncio.Condition()
        self._closed = False

    @classmethod
    async def create(
        cls,
        engine_id: str,
        role: Role | str,
        layout: SimLayout | Sequence[SimGroup | dict[str, Any]],
        socket_path: str,
        *,
        shm_prefix: str | None = None,
        shm_dir: str = SHM_DIR,
        client_name: str = "",
        background: bool = True,
        timeout: float = 30.0,
        fingerprint: Fingerprint | None = None,
        memory: str = FILE,
    ) -> SimEngine:
        """Allocate the cache, fill it, connect, and register the engine.

        ``memory``: ``"file"`` (a /dev/shm file per group) or ``"descriptor"``
        (a sealed memfd per group, passed with the Hello).
        ``background`` fills every block with this engine's own pattern and
        the guards with a canary first, so a write of zeros is visible too.
        ``fingerprint`` is what the engine says produced its KV (none by default).
        """
        layout = msgspec.convert(list(layout), SimLayout)
        prefix = shm_prefix or default_shm_prefix(engine_id)
        groups, regions = allocate(layout, prefix, shm_dir, memory)
        engine = cls(engine_id, Role(role), layout, groups, regions)
        try:
            engine._prepare_memory(background)
            engine._client = await EngineClient.connect(
                socket_path,
                client_name=client_name or f"sim:{engine_id}",
                timeout=timeout,
                descriptors=engine.descriptors,
            )
            await engine._client.register_engine(
                engine_id, groups, engine.region_specs, fingerprint=fingerprint
            )
            engine._pump = asyncio.create_task(engine._pump_events(), name=f"sim-{engine_id}")
        except BaseException:
            await engine.close()
            raise
        return engine

    def _prepare_memory(self, background: bool) -> None:
        for region in self._shm:
            region.array[:] = _CANARY
        if background:
            every = [range(group.num_blocks) for group in self.groups]
            kvpattern.fill_blocks(self.view, self.engine_id, _BACKGROUND_REQUEST, every)
        else:
            for ext in self.view.extents:
                self.view.regions[ext.region][ext.offset : ext.end] = 0
        self._reference = kvpattern.snapshot(self.view)

    @property
    def region_specs(self) -> tuple[RegionSpec, ...]:
        return tuple(r.spec() for r in self._shm)

    @property
    def shm_paths(self) -> tuple[str, ...]:
        """The /dev/shm files of the cache (none when it is shared by descriptor)."""
        return tuple(r.path for r in self._shm if isinstance(r, ShmRegion))

    @property
    def descriptors(self) -> tuple[int, ...]:
        """The memfds to pass with a Hello, in the order the region specs name them."""
        return tuple(r.fd for r in self._shm if isinstance(r, MemfdRegion) and r.fd is not None)

    @property
    def client(self) -> EngineClient:
        if self._client is None:
            raise ConnectionLost("engine not connected")
        return self._client

    # ---------------------------------------------------------- prefill side

    async def prefill(
        self,
        request_id: str,
        blocks: Sequence[Sequence[int]],
        *,
        incarnation: int = 1,
        peer: str = "",
        kv_ready: bool = True,
        content: str = "",
    ) -> rpc.RequestAccepted:
        """Register a pusher request, write its KV pattern, and (by default) say kv_ready."""
        self._require(Role.PUSHER)
        kernel = expand(self.layout, blocks)
        live = _Live(Role.PUSHER, kernel)
        reply = await self._register(request_id, incarnation, blocks, peer, live, content=content)
        kvpattern.fill_blocks(
            self.view, self.engine_id, request_tag(request_id, incarnation), kernel
        )
        reference = self._require_reference()
        for g, ids in enumerate(kernel):
            reference.refresh(self.view, g, ids)
        if kv_ready:
            await self.client.kv_ready(request_id, incarnation)
        return reply

    async def kv_ready(self, request_id: str, incarnation: int = 1) -> rpc.Ok:
        """Say kv_ready later, for a :meth:`prefill` made with ``kv_ready=False``."""
        return await self.client.kv_ready(request_id, incarnation)

    # ----------------------------------------------------------- decode side

    async def decode_register(
        self,
        request_id: str,
        blocks: Sequence[Sequence[int]],
        peer: str,
        *,
        incarnation: int = 1,
        expect: Expectation | None = None,
        peer_address: str = "",
        content: str = "",
        answered: bool = False,
    ) -> rpc.RequestAccepted:
        """Register a receiver request; with ``expect``, KvArrived is verified automatically.

        ``peer_address``: the pusher daemon's ``host:port``, for a peer on demand;
        ``content``: what the blocks are for (checked against the pusher's);
        ``answered``: registered from the prefill's answer (the prefill finished).
        """
        self._require(Role.RECEIVER)
        live = _Live(Role.RECEIVER, expand(self.layout, blocks), expect)
        return await self._register(
            request_id,
            incarnation,
            blocks,
            peer,
            live,
            peer_address,
            content=content,
            answered=answered,
        )

    async def _register(
        self,
        request_id: str,
        incarnation: int,
        blocks: Sequence[Sequence[int]],
        peer: str,
        live: _Live,
        peer_address: str = "",
        *,
        content: str = "",
        answered: bool = False,
    ) -> rpc.RequestAccepted:
        """Register with the daemon, recording the request *before* the call.

        The reply and the first event can arrive in one read; recording first
        means the event pump never sees an event for a request it does not
        know yet. A refused registration restores what was there (a refused
        duplicate must not erase the live original).
        """
        key = (request_id, incarnation)
        previous = self._live.get(key)
        self._live[key] = live
        try:
            return await self.client.register_request(
                self.engine_id,
                request_id,
                live.role,
                blocks,
                incarnation=incarnation,
                peer=peer,
                peer_address=peer_address,
                content=content,
                answered=answered,
            )
        except BaseException:
            if previous is None:
                self._live.pop(key, None)
            else:
                self._live[key] = previous
            raise

    def verify(
        self,
        request_id: str,
        expected_pairs: Pairs,
        *,
        source_engine: str,
        incarnation: int = 1,
    ) -> VerifyReport:
        """Check the request's blocks and everything else; accept its blocks as verified.

        Every destination block in ``expected_pairs`` must hold the pattern of
        its source block of ``source_engine`` for this request and
        incarnation; no other byte may differ from the reference except in
        blocks of other requests still waiting for their KV.
        """
        key = (request_id, incarnation)
        live = self._live.get(key)
        if live is None or live.role is not Role.RECEIVER:
            raise SimError(f"no live receiver request {request_id}#{incarnation}")
        reference = self._require_reference()
        tag = request_tag(request_id, incarnation)
        mismatches = kvpattern.check_blocks(self.view, source_engine, tag, expected_pairs)
        written = [[dst for dst, _ in group] for group in expected_pairs]
        allowed = self._waiting_blocks(exclude=key)
        for g, ids in enumerate(written):
            allowed[g].update(ids)
        changes = kvpattern.changed_blocks(reference, self.view, allowed)
        for g, ids in enumerate(written):
            reference.refresh(self.view, g, ids)
        live.expectation, live.settled = None, True
        checked = sum(len(ids) for ids in written)
        report = VerifyReport(request_id, incarnation, tuple(mismatches), tuple(changes), checked)
        self.reports[key] = report
        return report

    def _waiting_blocks(self, exclude: _Key) -> list[set[int]]:
        """Blocks of receiver requests that may still legitimately be written."""
        waiting: list[set[int]] = [set() for _ in self.groups]
        for key, live in self._live.items():
            if key == exclude or live.role is not Role.RECEIVER or live.settled:
                continue
            for g, ids in enumerate(live.kernel_blocks):
                waiting[g].update(ids)
        return waiting

    # ------------------------------------------------------------ both sides

    async def release(
        self, request_id: str, incarnation: int = 1, *, wait: bool = True, timeout: float = 30.0
    ) -> rpc.Ok | rpc.Deferred:
        """Release; with ``wait``, a Deferred reply is followed by waiting for Released."""
        reply = await self.client.release(request_id, incarnation)
        if isinstance(reply, rpc.Ok):
            self._settle((request_id, incarnation))
        elif wait:
            await self.wait_event(
                request_id, rpc.Released, incarnation=incarnation, timeout=timeout
            )
        return reply

    async def abort(self, request_id: str, incarnation: int = 1) -> rpc.Ok | rpc.Deferred:
        """Abort: the request fails, but its blocks stay the daemon's until released.

        A write already in flight may still land in them, so they are not
        settled here; :meth:`release` (or the ``Released`` event after a
        deferred release) gives them back.
        """
        return await self.client.abort(request_id, incarnation)

    def verify_source(self, request_id: str, incarnation: int = 1) -> VerifyReport:
        """Prefill side: a push only reads the source, so no byte of this cache changed.

        The reference is refreshed after every fill, so any difference is a
        write into the prefill engine's memory (a transfer posted the wrong
        way round, or a stray write).
        """
        key = (request_id, incarnation)
        live = self._live.get(key)
        if live is None or live.role is not Role.PUSHER:
            raise SimError(f"no live pusher request {request_id}#{incarnation}")
        changes = kvpattern.changed_blocks(self._require_reference(), self.view)
        checked = sum(len(ids) for ids in live.kernel_blocks)
        report = VerifyReport(request_id, incarnation, (), tuple(changes), checked)
        self.reports[key] = report
        return report

    async def wait_event(
        self,
        request_id: str,
        kind: type[rpc.Event] | tuple[type[rpc.Event], ...],
        *,
        incarnation: int = 1,
        timeout: float = 30.0,
    ) -> rpc.Event:
        """The first event of ``kind`` for the request (already received or future)."""
        key = (request_id, incarnation)

        def found() -> rpc.Event | None:
            live = self._live.get(key)
            for event in live.events if live else ():
                if isinstance(event, kind):
                    return event
            return None

        async with self._changed:
            try:
                await asyncio.wait_for(
                    self._changed.wait_for(lambda: found() is not None or self._pump_over()),
                    timeout,
                )
            except TimeoutError:
                raise TimeoutError(
                    f"no {_kind_names(kind)} for {request_id}#{incarnation} in {timeout} s"
                ) from None
        event = found()
        if event is None:
            raise ConnectionLost(
                f"connection ended before {_kind_names(kind)} for {request_id}#{incarnation}"
            )
        return event

    def _pump_over(self) -> bool:
        return self._pump is None or self._pump.done()

    async def status(self) -> dict:
        """The daemon's status document."""
        return await self.client.status()

    async def _pump_events(self) -> None:
        """Record every event, verify arrivals, and wake waiters."""
        try:
            async for event in self.client.events():
                try:
                    self._on_daemon_event(event)
                except Exception:
                    log.exception("simulated engine %s failed on %r", self.engine_id, event)
                async with self._changed:
                    self._changed.notify_all()
        finally:
            async with self._changed:
                self._changed.notify_all()

    def _on_daemon_event(self, event: rpc.Event) -> None:
        key = (event.request_id, event.incarnation)
        live = self._live.get(key)
        if live is None:
            live = self._live[key] = _Live(self.role, tuple(() for _ in self.groups))
        live.events.append(event)
        report = None
        if isinstance(event, rpc.KvArrived) and live.expectation is not None:
            expectation = live.expectation
            report = self.verify(
                event.request_id,
                expectation.pairs,
                source_engine=expectation.source_engine,
                incarnation=event.incarnation,
            )
        elif isinstance(event, rpc.BlocksFreeable) and live.role is Role.PUSHER:
            report = self.verify_source(event.request_id, event.incarnation)
        elif isinstance(event, rpc.Released):
            self._settle(key)
        if report is not None and self.on_report is not None:
            self.on_report(report)
        if self.on_event is not None:
            self.on_event(event)

    def _settle(self, key: _Key) -> None:
        """A released request: accept its blocks as they are now.

        From here on they must not change until another request claims them,
        so a write landing after the release shows up at the next verify.
        """
        live = self._live.get(key)
        if live is None or live.role is not Role.RECEIVER or self._reference is None:
            return
        for g, ids in enumerate(live.kernel_blocks):
            self._reference.refresh(self.view, g, ids)
        live.expectation, live.settled = None, True

    def _require(self, role: Role) -> None:
        if self.role is not role:
            raise SimError(f"engine {self.engine_id} is a {self.role}, not a {role}")

    def _require_reference(self) -> Snapshot:
        if self._reference is None:
            raise SimError("engine memory not prepared")
        return self._reference

    # ------------------------------------------------------------- lifecycle

    async def close(self) -> None:
        """Disconnect and unlink the shm files; idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._client is not None:
                await self._client.close()
            if self._pump is not None:
                with contextlib.suppress(asyncio.CancelledError, ClientError):
                    await self._pump
        finally:
            self.view = KvView((), {})
            self._reference = None
            for region in self._shm:
                region.close()

    async def __aenter__(self) -> SimEngine:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


def _kind_names(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(k.__name__ for k in kinds)
