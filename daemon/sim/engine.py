"""A simulated inference engine: real shared memory, real client, checked bytes.

It stands in for vLLM/SGLang in tests and in ``kvpushd demo``. It allocates
its KV cache as POSIX shared-memory files, registers them with its daemon
through :mod:`daemon.client`, fills prefill blocks with :mod:`daemon.sim.kvpattern`
bytes before saying ``kv_ready``, and on the decode side checks, when
``KvArrived`` comes, that every destination block holds exactly the pattern of
the prefill block it should and that no other byte of its cache changed. On
the prefill side, ``BlocksFreeable`` triggers the converse check: a push only
reads the source, so no byte of the prefill cache may have changed.

Memory (one region per group)
    Group ``g`` lives in ``{shm_dir}/{prefix}-g{g}`` (region name ``g{g}``),
    ``prefix`` defaulting to ``kvpushd-{engine_id}-{pid}`` (characters outside
    ``[A-Za-z0-9_.-]`` become ``_``). A region is ``GUARD | layer 0 | GUARD |
    layer 1 | ... | GUARD``: each layer's ``num_blocks * block_bytes`` bytes,
    page-aligned, between 4 KiB guard bands filled with a canary, so a write
    that overruns a layer shows up as a change "outside every block". One
    region per group (not per layer) keeps the file count and the daemon's
    NIXL registrations small while groups keep their own block sizes. The
    files are unlinked on :meth:`SimEngine.close`, at interpreter exit, and in
    process mode on SIGTERM/SIGINT.

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
plain tail-trim case) and block expansion is reimplemented here, not imported
from the core: this engine is an oracle for the daemon, so it must not share
the daemon's logic.

Process mode: ``python -m daemon.sim.engine --engine-id E --role receiver
--layout LAYOUT --socket SOCK`` speaks JSON lines; see :func:`main`.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import json
import logging
import mmap
import os
import re
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, TextIO

import msgspec
import numpy as np

from daemon.client import ClientError, ConnectionLost, EngineClient, RpcError
from daemon.sim import kvpattern
from daemon.sim.kvpattern import Change, KvView, Mismatch, Pairs, Snapshot
from schemas import rpc
from schemas.kvlayout import GroupSpec, LayerSpec, MemoryKind, RegionSpec
from schemas.layout import GroupKind, Role

log = logging.getLogger(__name__)

SHM_DIR: Final = "/dev/shm"
GUARD_BYTES: Final = 4096
_PAGE: Final = 4096
_CANARY: Final = 0xA5
_BACKGROUND_REQUEST: Final = "<background>"

_EVENT_KINDS: Final[dict[str, type[rpc.Event]]] = {
    "kv_arrived": rpc.KvArrived,
    "blocks_freeable": rpc.BlocksFreeable,
    "request_failed": rpc.RequestFailed,
    "released": rpc.Released,
}


class SimError(Exception):
    """A simulated engine was misused (wrong role, unknown request, bad layout)."""


class KvCorruption(AssertionError):
    """A verification found wrong bytes; carries the report."""

    def __init__(self, report: VerifyReport) -> None:
        super().__init__(str(report))
        self.report = report


# ------------------------------------------------------------------ layout


class SimGroup(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One KV-cache group of the simulated model; ``layers`` is a count."""

    num_blocks: int
    block_bytes: int
    kind: GroupKind = GroupKind.ATTENTION
    layers: int = 1
    per_logical: int = 1


SimLayout = tuple[SimGroup, ...]


def parse_layout(text: str) -> SimLayout:
    """A layout from JSON: a list of :class:`SimGroup` objects."""
    return msgspec.json.decode(text, type=SimLayout)


def expand(layout: SimLayout, logical: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
    """Logical ids per group -> kernel ids: L -> L*r .. L*r+r-1; SSM groups as is."""
    if len(logical) != len(layout):
        raise SimError(f"{len(logical)} block lists for {len(layout)} groups")
    return tuple(
        tuple(ids)
        if group.kind is GroupKind.SSM
        else tuple(b * group.per_logical + k for b in ids for k in range(group.per_logical))
        for group, ids in zip(layout, logical, strict=True)
    )


def tail_pairs(
    src_layout: SimLayout,
    src_logical: Sequence[Sequence[int]],
    dst_layout: SimLayout,
    dst_logical: Sequence[Sequence[int]],
) -> tuple[tuple[tuple[int, int], ...], ...]:
    """The expected (destination, source) kernel pairs for plain tail alignment.

    Per group, the prefill side's last N kernel blocks go into the decode
    side's N (N = 0: nothing). Cases the daemon handles differently (SSM or
    ratio padding with unequal counts) must be spelled out by the caller.
    """
    src, dst = expand(src_layout, src_logical), expand(dst_layout, dst_logical)
    pairs = []
    for g, (s, d) in enumerate(zip(src, dst, strict=True)):
        if len(d) > len(s):
            raise SimError(f"group {g}: decode has {len(d)} blocks, prefill only {len(s)}")
        tail = s[len(s) - len(d) :]
        pairs.append(tuple(zip(d, tail, strict=True)))
    return tuple(pairs)


def request_tag(request_id: str, incarnation: int) -> str:
    """The pattern tag of one incarnation: residue of another never matches."""
    return f"{request_id}#{incarnation}"


# ------------------------------------------------------------ shared memory

_LIVE_PATHS: set[str] = set()
_LIVE_LOCK = threading.Lock()


def _unlink_all() -> None:
    """Last resort at interpreter exit: no shm file outlives its engine."""
    with _LIVE_LOCK:
        paths = list(_LIVE_PATHS)
        _LIVE_PATHS.clear()
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


atexit.register(_unlink_all)


class ShmRegion:
    """One POSIX shared-memory file, mapped; created exclusively, unlinked on close."""

    def __init__(self, name: str, path: str, size: int) -> None:
        self.name = name
        self.path = path
        self.size = size
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o660)
        with _LIVE_LOCK:
            _LIVE_PATHS.add(path)
        try:
            os.ftruncate(fd, size)
            self._map: mmap.mmap | None = mmap.mmap(fd, size)
        except BaseException:
            self.unlink()
            raise
        finally:
            os.close(fd)
        self.array = np.frombuffer(self._map, dtype=np.uint8)

    def spec(self) -> RegionSpec:
        """How the engine names this region to its daemon."""
        return RegionSpec(self.name, self.size, MemoryKind.DRAM, path=self.path)

    def unlink(self) -> None:
        with _LIVE_LOCK:
            _LIVE_PATHS.discard(self.path)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def close(self) -> None:
        """Unlink, then unmap if no numpy view is still exported."""
        self.unlink()
        self.array = np.empty(0, dtype=np.uint8)
        if self._map is not None:
            with contextlib.suppress(BufferError):  # a caller still holds a view
                self._map.close()
            self._map = None


def default_shm_prefix(engine_id: str, pid: int | None = None) -> str:
    """The default file-name prefix: ``kvpushd-{engine_id}-{pid}``, file-name safe."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", engine_id)
    return f"kvpushd-{safe}-{os.getpid() if pid is None else pid}"


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def _group_memory(
    g: int, group: SimGroup, prefix: str, shm_dir: str
) -> tuple[GroupSpec, ShmRegion]:
    name = f"g{g}"
    stride = _round_up(group.num_blocks * group.block_bytes, _PAGE) + GUARD_BYTES
    layers = tuple(LayerSpec(name, GUARD_BYTES + li * stride) for li in range(group.layers))
    region = ShmRegion(
        name, os.path.join(shm_dir, f"{prefix}-{name}"), GUARD_BYTES + group.layers * stride
    )
    spec = GroupSpec(group.kind, group.num_blocks, group.block_bytes, layers, group.per_logical)
    return spec, region


def allocate(
    layout: SimLayout, prefix: str, shm_dir: str = SHM_DIR
) -> tuple[tuple[GroupSpec, ...], list[ShmRegion]]:
    """Create one shm region per group; on failure, unlink what was created."""
    specs: list[GroupSpec] = []
    regions: list[ShmRegion] = []
    try:
        for g, group in enumerate(layout):
            if group.num_blocks < 0 or group.block_bytes < 1 or group.layers < 1:
                raise SimError(f"group {g}: invalid sizes {group}")
            spec, region = _group_memory(g, group, prefix, shm_dir)
            specs.append(spec)
            regions.append(region)
    except BaseException:
        for region in regions:
            region.close()
        raise
    return tuple(specs), regions


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
        regions: list[ShmRegion],
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
    ) -> SimEngine:
        """Allocate the cache, fill it, connect, and register the engine.

        ``background`` fills every block with this engine's own pattern and
        the guards with a canary first, so a write of zeros is visible too.
        """
        layout = msgspec.convert(list(layout), SimLayout)
        prefix = shm_prefix or default_shm_prefix(engine_id)
        groups, regions = allocate(layout, prefix, shm_dir)
        engine = cls(engine_id, Role(role), layout, groups, regions)
        try:
            engine._prepare_memory(background)
            engine._client = await EngineClient.connect(
                socket_path, client_name=client_name or f"sim:{engine_id}", timeout=timeout
            )
            await engine._client.register_engine(engine_id, groups, engine.region_specs)
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
        return tuple(r.path for r in self._shm)

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
    ) -> rpc.RequestAccepted:
        """Register a pusher request, write its KV pattern, and (by default) say kv_ready."""
        self._require(Role.PUSHER)
        kernel = expand(self.layout, blocks)
        live = _Live(Role.PUSHER, kernel)
        reply = await self._register(request_id, incarnation, blocks, peer, live)
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
    ) -> rpc.RequestAccepted:
        """Register a receiver request; with ``expect``, KvArrived is verified automatically."""
        self._require(Role.RECEIVER)
        live = _Live(Role.RECEIVER, expand(self.layout, blocks), expect)
        return await self._register(request_id, incarnation, blocks, peer, live)

    async def _register(
        self,
        request_id: str,
        incarnation: int,
        blocks: Sequence[Sequence[int]],
        peer: str,
        live: _Live,
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
                self.engine_id, request_id, live.role, blocks, incarnation=incarnation, peer=peer
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


# ------------------------------------------------------------ process mode


class _Control:
    """The JSON-lines control protocol of process mode.

    One command per input line, run in order: ``{"cmd": ..., "tag": ...,
    ...}``. Each gets one output line ``{"reply": cmd, "tag": ..., "ok": true,
    ...}`` or ``{"reply": cmd, "tag": ..., "ok": false, "error": ..., "code":
    ...}``. Events and verification results are written as they happen:
    ``{"event": "kv_arrived", "request_id": ..., "incarnation": ...}``,
    ``{"event": "verified", "request_id": ..., "ok": ..., "problems": [...]}``.

    Commands: ``prefill`` (request_id, blocks, incarnation, peer, kv_ready),
    ``kv_ready``, ``decode_register`` (request_id, blocks, peer, incarnation,
    and to verify on arrival ``source`` plus ``pairs`` or ``source_blocks``,
    the prefill side's logical blocks, tail-aligned with this engine's
    layout), ``verify`` (same fields), ``wait`` (request_id, event, timeout),
    ``release`` (wait), ``abort``, ``status``, ``info``, ``close``.
    """

    def __init__(self, engine: SimEngine, out: TextIO) -> None:
        self.engine = engine
        self.out = out
        self.failed_verifications = 0
        engine.on_event = self._event
        engine.on_report = self._report

    def emit(self, message: dict[str, Any]) -> None:
        self.out.write(json.dumps(message, default=_jsonable) + "\n")
        self.out.flush()

    def _event(self, event: rpc.Event) -> None:
        self.emit({"event": _event_name(event), **msgspec.to_builtins(event)})

    def _report(self, report: VerifyReport) -> None:
        self.failed_verifications += not report.ok
        self.emit(_report_json(report) | {"event": "verified"})

    async def run(self, command: dict[str, Any]) -> bool:
        """Run one command and write its reply; False once ``close`` was asked."""
        name = str(command.get("cmd", ""))
        reply: dict[str, Any] = {"reply": name, "tag": command.get("tag")}
        handler = getattr(self, f"cmd_{name}", None)
        try:
            if handler is None:
                raise SimError(f"unknown command {name!r}")
            reply |= {"ok": True, **(await handler(command) or {})}
        except RpcError as exc:
            reply |= {"ok": False, "error": exc.message, "code": exc.code}
        except (ClientError, SimError, TimeoutError, KeyError, TypeError, ValueError) as exc:
            reply |= {"ok": False, "error": f"{type(exc).__name__}: {exc}", "code": None}
        self.emit(reply)
        return name != "close"

    def _pairs(self, c: dict[str, Any]) -> Pairs:
        if "pairs" in c:
            return tuple(tuple((int(d), int(s)) for d, s in group) for group in c["pairs"])
        layout = self.engine.layout
        return tail_pairs(layout, c["source_blocks"], layout, c["blocks"])

    async def cmd_prefill(self, c: dict[str, Any]) -> dict[str, Any]:
        reply = await self.engine.prefill(
            c["request_id"],
            c["blocks"],
            incarnation=c.get("incarnation", 1),
            peer=c.get("peer", ""),
            kv_ready=c.get("kv_ready", True),
        )
        return {"state": reply.state}

    async def cmd_kv_ready(self, c: dict[str, Any]) -> None:
        await self.engine.kv_ready(c["request_id"], c.get("incarnation", 1))

    async def cmd_decode_register(self, c: dict[str, Any]) -> dict[str, Any]:
        expect = Expectation(c["source"], self._pairs(c)) if "source" in c else None
        reply = await self.engine.decode_register(
            c["request_id"],
            c["blocks"],
            c.get("peer", ""),
            incarnation=c.get("incarnation", 1),
            expect=expect,
        )
        return {"state": reply.state}

    async def cmd_verify(self, c: dict[str, Any]) -> dict[str, Any]:
        report = self.engine.verify(
            c["request_id"],
            self._pairs(c),
            source_engine=c["source"],
            incarnation=c.get("incarnation", 1),
        )
        self.failed_verifications += not report.ok
        return _report_json(report)

    async def cmd_wait(self, c: dict[str, Any]) -> dict[str, Any]:
        kind = _EVENT_KINDS[c["event"]]
        incarnation = c.get("incarnation", 1)
        event = await self.engine.wait_event(
            c["request_id"], kind, incarnation=incarnation, timeout=c.get("timeout", 30.0)
        )
        result = {"event": msgspec.to_builtins(event)}
        report = self.engine.reports.get((c["request_id"], incarnation))
        if isinstance(event, rpc.KvArrived) and report is not None:
            result["verified"] = _report_json(report)
        return result

    async def cmd_release(self, c: dict[str, Any]) -> dict[str, Any]:
        reply = await self.engine.release(
            c["request_id"], c.get("incarnation", 1), wait=c.get("wait", True)
        )
        return {"result": _reply_kind(reply)}

    async def cmd_abort(self, c: dict[str, Any]) -> dict[str, Any]:
        reply = await self.engine.abort(c["request_id"], c.get("incarnation", 1))
        return {"result": _reply_kind(reply)}

    async def cmd_status(self, c: dict[str, Any]) -> dict[str, Any]:
        return {"status": await self.engine.status()}

    async def cmd_info(self, c: dict[str, Any]) -> dict[str, Any]:
        return _info(self.engine)

    async def cmd_close(self, c: dict[str, Any]) -> None:
        return None


def _kind_names(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(k.__name__ for k in kinds)


def _info(engine: SimEngine) -> dict[str, Any]:
    return {
        "engine_id": engine.engine_id,
        "role": engine.role.value,
        "pid": os.getpid(),
        "regions": [msgspec.to_builtins(r) for r in engine.region_specs],
        "groups": [msgspec.to_builtins(g) for g in engine.groups],
    }


def _report_json(report: VerifyReport) -> dict[str, Any]:
    return {
        "request_id": report.request_id,
        "incarnation": report.incarnation,
        "ok": report.ok,
        "blocks_checked": report.blocks_checked,
        "problems": report.problems(),
    }


def _reply_kind(reply: rpc.Reply) -> str:
    return "deferred" if isinstance(reply, rpc.Deferred) else "ok"


def _event_name(event: rpc.Event) -> str:
    return next(name for name, kind in _EVENT_KINDS.items() if isinstance(event, kind))


def _jsonable(value: object) -> object:
    if isinstance(value, bytes):
        return value.hex()
    return str(value)


def _start_line_reader(
    source: TextIO, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue[str | None]
) -> None:
    """Feed lines from a blocking file into the loop (works for ttys, pipes, files)."""

    def pump() -> None:
        for line in source:
            loop.call_soon_threadsafe(queue.put_nowait, line)
        loop.call_soon_threadsafe(queue.put_nowait, None)

    threading.Thread(target=pump, name="sim-stdin", daemon=True).start()


async def _serve(args: argparse.Namespace, out: TextIO) -> int:
    # Signals are handled before any shm file exists, so a SIGTERM during
    # start-up still ends in close() and unlinks them.
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    create = SimEngine.create(
        args.engine_id,
        args.role,
        parse_layout(_read_arg(args.layout)),
        args.socket,
        shm_prefix=args.shm_prefix,
        shm_dir=args.shm_dir,
        background=not args.no_background,
    )
    engine = await _unless_stopped(create, stop)
    if engine is _STOPPED:
        return 0
    control = _Control(engine, out)
    lines: asyncio.Queue[str | None] = asyncio.Queue()
    source = open(args.commands) if args.commands else sys.stdin  # noqa: SIM115
    _start_line_reader(source, loop, lines)
    control.emit({"event": "ready", **_info(engine)})
    try:
        await _command_loop(control, lines, stop)
    finally:
        await engine.close()
        control.emit({"event": "closed", "failed_verifications": control.failed_verifications})
    return 1 if control.failed_verifications else 0


_STOPPED: Final = object()


async def _unless_stopped(coro: Any, stop: asyncio.Event) -> Any:
    """Await ``coro``, or cancel it and return ``_STOPPED`` if ``stop`` is set first.

    Cancelling is how a SIGTERM interrupts start-up or a long ``wait``:
    :meth:`SimEngine.create` cleans up its shm files when cancelled.
    """
    task = asyncio.ensure_future(coro)
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return _STOPPED


async def _command_loop(
    control: _Control, lines: asyncio.Queue[str | None], stop: asyncio.Event
) -> None:
    """Run commands in order until ``close``, end of input, or a signal."""
    while True:
        line = await _unless_stopped(lines.get(), stop)
        if line is _STOPPED or line is None:
            return
        if not line.strip():
            continue
        try:
            command = json.loads(line)
        except json.JSONDecodeError as exc:
            control.emit({"reply": None, "ok": False, "error": f"bad JSON: {exc}"})
            continue
        if not isinstance(command, dict):
            control.emit({"reply": None, "ok": False, "error": "a command is a JSON object"})
            continue
        go_on = await _unless_stopped(control.run(command), stop)
        if go_on is _STOPPED or not go_on:
            return


def _read_arg(value: str) -> str:
    """``@path`` reads the file; anything else is the value itself."""
    if value.startswith("@"):
        with open(value[1:]) as f:
            return f.read()
    return value


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m daemon.sim.engine",
        description="Simulated inference engine for kvpushd (JSON-lines control on stdin/stdout).",
    )
    p.add_argument("--engine-id", required=True)
    p.add_argument("--role", required=True, choices=[r.value for r in Role])
    p.add_argument(
        "--layout",
        required=True,
        help='JSON list of groups, or @file: [{"num_blocks": 64, "block_bytes": 4096, '
        '"layers": 2, "kind": "attention", "per_logical": 1}]',
    )
    p.add_argument("--socket", required=True, help="the daemon's engine socket")
    p.add_argument("--shm-prefix", default=None, help="default: kvpushd-{engine_id}-{pid}")
    p.add_argument("--shm-dir", default=SHM_DIR)
    p.add_argument("--commands", default=None, help="read commands from this file, not stdin")
    p.add_argument("--no-background", action="store_true", help="start with zeroed blocks")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run one simulated engine until ``close``, end of input, SIGTERM or SIGINT.

    Exit status: 0, 1 when a verification failed, 2 when it could not start.
    """
    args = _parser().parse_args(argv)
    out = sys.stdout
    try:
        return _run_loop(_serve(args, out))
    except (ClientError, SimError, OSError, msgspec.MsgspecError) as exc:
        out.write(json.dumps({"event": "error", "error": f"{type(exc).__name__}: {exc}"}) + "\n")
        out.flush()
        return 2


def _run_loop(coro: Any) -> int:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


if __name__ == "__main__":
    sys.exit(main())
