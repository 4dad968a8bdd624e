"""The data plane: one NIXL agent per daemon, pushing KV blocks with WRITEs.

Threading. The agent runs without a NIXL progress thread: with the wrapper's
progress delay of 0 that thread spins a whole core even when idle (see
NIXL-FACTS). Without it, the agent is not thread-safe and only progresses
when called, so exactly one worker thread owns it and makes *every* agent
call. The event loop hands the worker commands through a queue and gets
results back through ``loop.call_soon_threadsafe`` on asyncio futures.

The worker blocks on its queue while nothing is outstanding, so an idle
daemon costs ~0 CPU (it still wakes every ``idle_progress_s`` for one cheap
progress call, so a stray notification or a peer's wire-up is never stuck
forever). While writes are in flight, or while the daemon expects
notifications (it has receiver requests waiting for data), it polls
``check_xfer_state`` and ``get_new_notifs`` every ``poll_interval_s``. A
receiver must poll while it expects writes: the pusher's DONE for a WRITE
that carries a notification waits for the receiver's next progress call.

Descriptor lists. Each local engine gets ONE prepared descriptor list and
each (remote agent, remote engine) ONE, built with the same indexing:
descriptor ``base_g + l * num_blocks_g + b`` is block ``b`` of layer ``l`` of
group ``g``, where ``base_g`` counts the descriptors of the groups before it.
A request is then one ``make_prepped_xfer`` over two index arrays; runs of
consecutive blocks in a layer merge into one descriptor inside NIXL.

Windows. Peers never learn the addresses of a local engine's own mapping:
each peer gets a window of its own onto the same pages (daemon/dataplane/window.py),
registered with the agent, so that fencing a peer can revoke exactly its
access (``revoke_windows``) and nobody else's.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, TypeVar

import numpy as np

from daemon import failpoints
from daemon.dataplane.memory import MappedRegion
from daemon.dataplane.vram import VramRegion
from daemon.dataplane.window import Window
from schemas.events import Blocks
from schemas.kvlayout import EngineSpec, GroupSpec, MemoryKind, RemoteEngine, RemoteGroup

log = logging.getLogger(__name__)

T = TypeVar("T")

# How long close/fence waits for a transfer NIXL refused to cancel before
# giving up on it (it is then kept referenced, never released off-thread).
ABORT_WAIT_S: Final = 5.0

MAX_DESCRIPTORS: Final = 2**31 - 1

_PR_SET_TIMERSLACK: Final = 29

NotificationHandler = Callable[[str, bytes], None]

# GPU KV caches: an engine's regions are DRAM (/dev/shm, daemon.dataplane.memory) or VRAM
# (CUDA IPC, daemon.dataplane.vram); NIXL names the two like this. One kind per engine.
Region = MappedRegion | VramRegion
NIXL_MEM: Final[dict[MemoryKind, str]] = {MemoryKind.DRAM: "DRAM", MemoryKind.VRAM: "VRAM"}


class DataPlaneError(Exception):
    """A data-plane request was refused or NIXL failed; ``code`` is stable."""

    def __init__(self, message: str, *, code: str = "dataplane") -> None:
        super().__init__(message)
        self.code = code


class TransferError(DataPlaneError):
    """A posted WRITE did not complete.

    Codes: ``xfer_err`` (NIXL reported ERR), ``peer_disconnected`` (the
    remote agent's process is gone), ``nixl`` (another NIXL failure while
    posting), ``fenced`` (its remote agent was removed), ``removed`` (its
    local or remote engine was removed), ``closed`` (the data plane closed).
    In every case the transfer handle is released (aborted) before the error
    is raised, so nothing of it lands afterwards; bytes may already have
    landed (with cma the copy completes inside ``transfer()``), so the
    destination blocks hold undefined content.
    """


@dataclass(frozen=True, slots=True)
class WriteResult:
    nbytes: int
    descriptors: int  # block descriptors requested (before NIXL merges contiguous ones)
    seconds: float  # from make_prepped_xfer to DONE, measured on the worker


# --------------------------------------------------------------------------
# Geometry: pure functions, run on the event loop thread
# --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _GroupGeom:
    kind: str
    num_blocks: int
    block_bytes: int
    n_layers: int
    base: int  # index of this group's first descriptor


@dataclass(frozen=True, slots=True)
class EngineGeometry:
    """What indexing and validation need to know about one engine's blocks."""

    engine_id: str
    groups: tuple[_GroupGeom, ...]
    total: int  # number of descriptors in the engine's prepared list

    @classmethod
    def of(cls, engine_id: str, groups: Sequence[RemoteGroup]) -> EngineGeometry:
        geoms: list[_GroupGeom] = []
        base = 0
        for g in groups:
            n_layers = len(g.layer_addrs)
            geoms.append(_GroupGeom(g.kind.value, g.num_blocks, g.block_bytes, n_layers, base))
            base += n_layers * g.num_blocks
        if base > MAX_DESCRIPTORS:
            # make_prepped_xfer takes int32 indices.
            raise DataPlaneError(
                f"engine {engine_id!r} needs {base} descriptors, more than {MAX_DESCRIPTORS}",
                code="bad_layout",
            )
        return cls(engine_id, tuple(geoms), base)

    def signature(self) -> tuple[tuple[str, int, int], ...]:
        return tuple((g.kind, g.block_bytes, g.n_layers) for g in self.groups)


def descriptor_rows(engine: RemoteEngine) -> np.ndarray:
    """The N x 3 (addr, len, dev) rows of an engine's descriptor list, in index order.

    Used for both local and remote lists, so both sides index alike by construction.
    """
    parts: list[np.ndarray] = []
    for g in engine.groups:
        offsets = np.arange(g.num_blocks, dtype=np.uint64) * np.uint64(g.block_bytes)
        for addr in g.layer_addrs:
            rows = np.empty((g.num_blocks, 3), dtype=np.uint64)
            rows[:, 0] = np.uint64(addr) + offsets
            rows[:, 1] = g.block_bytes
            rows[:, 2] = engine.device
            parts.append(rows)
    if not parts:
        return np.empty((0, 3), dtype=np.uint64)
    return np.concatenate(parts)


def _check_ids(ids: np.ndarray, num_blocks: int, side: str, g: int) -> None:
    if ids.size and (ids.min() < 0 or ids.max() >= num_blocks):
        bad = ids[(ids < 0) | (ids >= num_blocks)]
        raise DataPlaneError(
            f"group {g}: {side} block ids {bad[:8].tolist()} outside 0..{num_blocks - 1}",
            code="bad_blocks",
        )


def build_indices(
    local: EngineGeometry, remote: EngineGeometry, src: Blocks, dst: Blocks
) -> tuple[np.ndarray, np.ndarray, int]:
    """Local and remote descriptor indices (int32) for ``src[g][i] -> dst[g][i]``, and bytes.

    Refuses, before anything is posted: group counts that differ, groups whose
    kind/block size/layer count differ, pair counts that differ within a
    group, block ids out of range, and a destination block named twice (two
    sources into one block would be a silent overwrite).
    """
    if not (len(src) == len(dst) == len(local.groups) == len(remote.groups)):
        raise DataPlaneError(
            f"group counts differ: src {len(src)}, dst {len(dst)},"
            f" local engine {len(local.groups)}, remote engine {len(remote.groups)}",
            code="mismatch",
        )
    if local.signature() != remote.signature():
        raise DataPlaneError(
            f"engines {local.engine_id!r} and {remote.engine_id!r} have incompatible layouts:"
            f" {local.signature()} vs {remote.signature()}",
            code="mismatch",
        )
    lparts: list[np.ndarray] = []
    rparts: list[np.ndarray] = []
    nbytes = 0
    for g, (lg, rg) in enumerate(zip(local.groups, remote.groups, strict=True)):
        if len(src[g]) != len(dst[g]):
            raise DataPlaneError(
                f"group {g}: {len(src[g])} source blocks vs {len(dst[g])} destination blocks",
                code="mismatch",
            )
        if not src[g]:
            continue
        s = np.asarray(src[g], dtype=np.int64)
        d = np.asarray(dst[g], dtype=np.int64)
        _check_ids(s, lg.num_blocks, "source", g)
        _check_ids(d, rg.num_blocks, "destination", g)
        if np.unique(d).size != d.size:
            raise DataPlaneError(
                f"group {g}: a destination block is named twice", code="bad_blocks"
            )
        layers = np.arange(lg.n_layers, dtype=np.int64)[:, None]
        lparts.append((lg.base + layers * lg.num_blocks + s[None, :]).ravel())
        rparts.append((rg.base + layers * rg.num_blocks + d[None, :]).ravel())
        nbytes += lg.n_layers * s.size * lg.block_bytes
    if not lparts:
        empty = np.empty(0, dtype=np.int32)
        return empty, empty, 0
    return (
        np.concatenate(lparts).astype(np.int32),
        np.concatenate(rparts).astype(np.int32),
        nbytes,
    )


def _local_remote_engine(spec: EngineSpec, regions: Mapping[str, Region | Window]) -> RemoteEngine:
    """Validate a local engine against its mapped regions; the view peers need."""
    by_name = {r.name: r for r in spec.regions}
    for r in spec.regions:
        mapped = regions.get(r.name)
        if mapped is None or mapped.closed:
            raise DataPlaneError(f"region {r.name!r} is not mapped", code="bad_layout")
        if mapped.memory is not r.memory:  # VRAM: opened by daemon.dataplane.vram, not mapped
            raise DataPlaneError(
                f"region {r.name!r} is declared {r.memory.value}, opened as {mapped.memory.value}",
                code="bad_layout",
            )
        if mapped.size != r.size:
            raise DataPlaneError(
                f"region {r.name!r} is mapped with {mapped.size} bytes, spec says {r.size}",
                code="bad_layout",
            )
    groups = []
    for g, group in enumerate(spec.groups):
        groups.append(_local_group(g, group, by_name, regions))
    memory, device = _engine_memory(spec, regions)
    return RemoteEngine(spec.engine_id, memory, device, tuple(groups))


def _engine_memory(
    spec: EngineSpec, regions: Mapping[str, Region | Window]
) -> tuple[MemoryKind, int]:
    """Where all of an engine's regions live: one NIXL memory type and device per engine.

    A descriptor list has one memory type and RemoteEngine one (memory,
    device), so an engine mixing DRAM and VRAM, or two GPUs, is refused.
    """
    places = {(regions[r.name].memory, regions[r.name].device) for r in spec.regions}
    if len(places) > 1:
        found = ", ".join(f"{m.value} device {d}" for m, d in sorted(places))
        raise DataPlaneError(
            f"engine {spec.engine_id!r}: regions must all be DRAM or all VRAM on one device,"
            f" found {found}",
            code="bad_layout",
        )
    return places.pop() if places else (MemoryKind.DRAM, 0)


def _local_group(
    g: int, group: GroupSpec, specs: Mapping[str, object], regions: Mapping[str, Region | Window]
) -> RemoteGroup:
    if group.block_bytes <= 0 or group.num_blocks <= 0 or not group.layers:
        raise DataPlaneError(
            f"group {g}: needs block_bytes > 0, num_blocks > 0 and at least one layer",
            code="bad_layout",
        )
    addrs = []
    span = group.num_blocks * group.block_bytes
    for l, layer in enumerate(group.layers):  # noqa: E741 - l is the layer index throughout
        if layer.region not in specs:
            raise DataPlaneError(
                f"group {g} layer {l}: unknown region {layer.region!r}", code="bad_layout"
            )
        region = regions[layer.region]
        if layer.offset < 0 or layer.offset + span > region.size:
            raise DataPlaneError(
                f"group {g} layer {l}: blocks [{layer.offset}, {layer.offset + span}) do not fit"
                f" in region {layer.region!r} of {region.size} bytes",
                code="bad_layout",
            )
        addrs.append(region.base + layer.offset)
    return RemoteGroup(
        group.kind, group.num_blocks, group.block_bytes, tuple(addrs), group.per_logical
    )


def _check_remote_engine(engine: RemoteEngine) -> None:
    # DRAM and VRAM both accepted (NIXL_MEM); the device id goes into every descriptor row.
    if engine.memory not in NIXL_MEM or engine.device < 0:
        raise DataPlaneError(
            f"remote engine {engine.engine_id!r}: unsupported memory"
            f" {engine.memory} device {engine.device}",
            code="bad_layout",
        )
    for g, group in enumerate(engine.groups):
        if group.block_bytes <= 0 or group.num_blocks <= 0 or not group.layer_addrs:
            raise DataPlaneError(
                f"remote engine {engine.engine_id!r} group {g}: bad geometry", code="bad_layout"
            )


# --------------------------------------------------------------------------
# Worker: owns the agent; every method below runs on the worker thread
# --------------------------------------------------------------------------


@dataclass(slots=True)
class _Call:
    fn: Callable[[], Any]
    fut: asyncio.Future[Any]


@dataclass(slots=True)
class _Post:
    xid: int
    local_engine: str
    remote_agent: str
    remote_engine: str
    lidx: np.ndarray
    ridx: np.ndarray
    notif: bytes
    nbytes: int
    fut: asyncio.Future[WriteResult]


@dataclass(slots=True)
class _Cancel:
    xid: int
    ack: asyncio.Future[str]


@dataclass(slots=True)
class _Expect:
    flag: bool


@dataclass(slots=True)
class _Stop:
    fut: asyncio.Future[None]


_Command = _Call | _Post | _Cancel | _Expect | _Stop


@dataclass(slots=True)
class _InFlight:
    post: _Post
    handle: Any  # nixl_xfer_handle
    t0: float


@dataclass(slots=True)
class _LocalEngine:
    reg_dlists: list[Any]
    dlist: Any  # nixl_prepped_dlist_handle


@dataclass(slots=True)
class _PeerWindows:
    windows: list[Window]
    reg_dlists: list[Any]


@dataclass(slots=True)
class _WorkerState:
    agent: Any = None  # nixl_agent; created and used on the worker thread only
    local: dict[str, _LocalEngine] = field(default_factory=dict)
    remote: dict[tuple[str, str], Any] = field(default_factory=dict)
    windows: dict[tuple[str, str], _PeerWindows] = field(default_factory=dict)  # (peer, engine)
    # Revoked windows, kept as reservations while the peer that knew them may live.
    revoked: dict[str, list[Window]] = field(default_factory=dict)
    inflight: dict[int, _InFlight] = field(default_factory=dict)
    expect: bool = False
    leaked: list[Any] = field(default_factory=list)


class _Worker:
    def __init__(
        self,
        name: str,
        backend: str,
        loop: asyncio.AbstractEventLoop,
        poll_interval_s: float,
        idle_progress_s: float | None,
        on_notifs: Callable[[dict[str, list[bytes]]], None],
    ) -> None:
        self.name = name
        self.backend = backend
        self.loop = loop
        self.poll_interval_s = poll_interval_s
        self.idle_progress_s = idle_progress_s
        self.on_notifs = on_notifs
        self.queue: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self.st = _WorkerState()
        self.thread = threading.Thread(target=self._run, name=f"nixl-{name}", daemon=True)
        self.started: asyncio.Future[None] = loop.create_future()
        self._stop: _Stop | None = None

    # ---- plumbing -------------------------------------------------------

    def submit(self, cmd: _Command) -> None:
        self.queue.put(cmd)

    def _resolve(
        self, fut: asyncio.Future[Any], result: Any = None, exc: BaseException | None = None
    ) -> None:
        def apply() -> None:
            if fut.done():
                return  # the awaiting side gave up; nothing to deliver
            if exc is not None:
                fut.set_exception(exc)
            else:
                fut.set_result(result)

        with contextlib.suppress(RuntimeError):  # loop already closed
            self.loop.call_soon_threadsafe(apply)

    def _cancel_future(self, fut: asyncio.Future[Any]) -> None:
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(fut.cancel)

    def _busy(self) -> bool:
        return bool(self.st.inflight) or self.st.expect

    def _run(self) -> None:
        _tighten_timer_slack()
        try:
            self.st.agent = self._create_agent()
        except Exception as exc:
            self._resolve(self.started, exc=_wrap(exc, f"starting NIXL agent {self.name!r}"))
            return
        self._resolve(self.started)
        try:
            self._loop()
        except Exception:
            log.exception("data plane worker %r crashed; closing its agent", self.name)
        finally:
            self._shutdown()

    def _loop(self) -> None:
        while self._stop is None:
            # Block on the queue, not in sleep(): a command wakes the worker at
            # once, and the timeout paces polling: ~0 CPU when idle, one round
            # per poll_interval_s when busy (spinning instead would halve
            # throughput on 2 cores: NIXL-FACTS).
            timeout = self.poll_interval_s if self._busy() else self.idle_progress_s
            try:
                cmd = self.queue.get(timeout=timeout)
            except queue.Empty:
                pass
            else:
                self._handle(cmd)
                self._drain()
            if self._stop is None:
                self._progress()

    def _drain(self) -> None:
        while self._stop is None:
            try:
                cmd = self.queue.get_nowait()
            except queue.Empty:
                return
            self._handle(cmd)

    def _handle(self, cmd: _Command) -> None:
        match cmd:
            case _Call(fn, fut):
                try:
                    result = fn()
                except Exception as exc:
                    self._resolve(fut, exc=_wrap(exc, "NIXL call"))
                else:
                    self._resolve(fut, result)
            case _Post():
                self._post(cmd)
            case _Cancel(xid, ack):
                self._resolve(ack, self._cancel(xid))
            case _Expect(flag):
                self.st.expect = flag
            case _Stop():
                self._stop = cmd

    # ---- agent -----------------------------------------------------------

    def _create_agent(self) -> Any:
        from nixl._api import nixl_agent, nixl_agent_config

        config = nixl_agent_config(
            enable_prog_thread=False, enable_listen_thread=False, backends=[self.backend]
        )
        try:
            agent = nixl_agent(self.name, config)
        except Exception as exc:
            raise DataPlaneError(
                f"NIXL backend {self.backend!r} failed to start for agent {self.name!r}:"
                f" {type(exc).__name__}: {exc} (with UCX, check UCX_TLS: shared-memory-only"
                " transports cannot start; cma or tcp is needed)",
                code="backend",
            ) from exc
        if self.backend not in agent.backends:
            # The wrapper only logs a warning for a missing plugin.
            raise DataPlaneError(
                f"NIXL backend {self.backend!r} is not available"
                f" (plugins found: {agent.get_plugin_list()})",
                code="backend",
            )
        return agent

    def _progress(self) -> None:
        agent = self.st.agent
        for xid, entry in list(self.st.inflight.items()):
            error: DataPlaneError | None = None
            try:
                state = agent.check_xfer_state(entry.handle)
            except Exception as exc:
                state, error = "ERR", _wrap(exc, f"write {xid}", TransferError)
            if state == "DONE":
                del self.st.inflight[xid]
                self._finish(entry)
            elif state != "PROC":
                del self.st.inflight[xid]
                self._release_xfer(entry.handle)
                error = error or TransferError(f"write {xid} failed in NIXL", code="xfer_err")
                self._resolve(entry.post.fut, exc=error)
        try:
            notifs = agent.get_new_notifs()
        except Exception as exc:
            log.warning("get_new_notifs failed: %s", exc)
            return
        if notifs:
            with contextlib.suppress(RuntimeError):
                self.loop.call_soon_threadsafe(self.on_notifs, notifs)

    def _post(self, post: _Post) -> None:
        st = self.st
        local = st.local.get(post.local_engine)
        remote = st.remote.get((post.remote_agent, post.remote_engine))
        if local is None or remote is None:
            missing = "local engine" if local is None else "remote engine"
            self._resolve(post.fut, exc=DataPlaneError(f"{missing} is gone", code="unknown_engine"))
            return
        t0 = time.perf_counter()
        try:
            failpoints.hit("nixl.post")
            handle = st.agent.make_prepped_xfer(
                "WRITE", local.dlist, post.lidx, remote, post.ridx, notif_msg=post.notif
            )
        except Exception as exc:
            self._resolve(post.fut, exc=_wrap(exc, "make_prepped_xfer", TransferError))
            return
        entry = _InFlight(post, handle, t0)
        try:
            # With cma the whole copy happens inside this call (it drops the GIL).
            state = st.agent.transfer(handle)
            failpoints.hit("nixl.posted")
        except Exception as exc:
            self._release_xfer(handle)
            self._resolve(post.fut, exc=_wrap(exc, "transfer", TransferError))
            return
        if state == "DONE":
            self._finish(entry)
        elif state == "PROC":
            st.inflight[post.xid] = entry
        else:
            self._release_xfer(handle)
            self._resolve(
                post.fut,
                exc=TransferError(
                    f"write {post.xid}: transfer() returned {state}", code="xfer_err"
                ),
            )

    def _finish(self, entry: _InFlight) -> None:
        seconds = time.perf_counter() - entry.t0
        self._release_xfer(entry.handle)  # a DONE handle releases cleanly
        post = entry.post
        self._resolve(post.fut, WriteResult(post.nbytes, int(post.lidx.size), seconds))

    def _release_xfer(self, handle: Any) -> None:
        """Release a transfer handle; for one still in flight that aborts it.

        If NIXL refuses to cancel, wait for the transfer to settle and try
        again; a handle that still cannot be released is kept referenced so
        its finalizer never runs on another thread.
        """
        try:
            handle.release()
            return
        except Exception as exc:
            log.warning("releasing a transfer failed (%s); waiting for it to settle", exc)
        deadline = time.monotonic() + ABORT_WAIT_S
        while time.monotonic() < deadline:
            try:
                if self.st.agent.check_xfer_state(handle) != "PROC":
                    break
            except Exception:
                break
            time.sleep(self.poll_interval_s)
        try:
            handle.release()
        except Exception as exc:
            log.error("transfer handle could not be released, keeping it: %s", exc)
            self.st.leaked.append(handle)

    def _cancel(self, xid: int) -> str:
        entry = self.st.inflight.pop(xid, None)
        if entry is None:
            return "settled"  # already finished (or failed) before the cancel arrived
        # One last look, so a write that already ended is reported as what it
        # was (a fenced peer's faulting write must show as failed, not aborted).
        try:
            state = self.st.agent.check_xfer_state(entry.handle)
        except Exception:
            state = "ERR"
        if state == "DONE":
            self._finish(entry)
            return "settled"
        self._release_xfer(entry.handle)
        if state != "PROC":
            error = TransferError(f"write {xid} failed in NIXL", code="xfer_err")
            self._resolve(entry.post.fut, exc=error)
            return "settled"
        self._cancel_future(entry.post.fut)
        return "aborted"

    def fail_inflight(self, match: Callable[[_Post], bool], code: str, why: str) -> int:
        """Abort every in-flight write ``match`` selects; their awaiters get TransferError."""
        victims = [xid for xid, e in self.st.inflight.items() if match(e.post)]
        for xid in victims:
            entry = self.st.inflight.pop(xid)
            self._release_xfer(entry.handle)
            self._resolve(
                entry.post.fut, exc=TransferError(f"write {xid} aborted: {why}", code=code)
            )
        return len(victims)

    # ---- operations called through _Call ---------------------------------

    def add_local(self, engine: RemoteEngine, regions: Sequence[Region]) -> None:
        st = self.st
        if engine.engine_id in st.local:
            raise DataPlaneError(
                f"local engine {engine.engine_id!r} already added", code="duplicate"
            )
        mem = NIXL_MEM[engine.memory]  # VRAM rows carry the CUDA device index here
        reg_dlists: list[Any] = []
        try:
            for region in regions:
                rows = np.array([[region.base, region.size, region.device]], dtype=np.uint64)
                reg_dlists.append(st.agent.register_memory(rows, mem))
            dlist = st.agent.prep_xfer_dlist("NIXL_INIT_AGENT", descriptor_rows(engine), mem)
        except Exception:
            for reg in reg_dlists:
                with contextlib.suppress(Exception):
                    st.agent.deregister_memory(reg)
            raise
        st.local[engine.engine_id] = _LocalEngine(reg_dlists, dlist)

    def remove_local(self, engine_id: str) -> int:
        st = self.st
        local = st.local.pop(engine_id, None)
        if local is None:
            raise DataPlaneError(f"unknown local engine {engine_id!r}", code="unknown_engine")
        n = self.fail_inflight(
            lambda p: p.local_engine == engine_id, "removed", "local engine removed"
        )
        local.dlist.release()
        for reg in local.reg_dlists:
            st.agent.deregister_memory(reg)
        # An engine leaves only with no live request: no peer has a write
        # for it to make, so its windows can go (the reservations of fenced
        # peers stay).
        for key in [k for k in st.windows if k[1] == engine_id]:
            self._close_windows(st.windows.pop(key))
        return n

    def open_windows(
        self, peer: str, engine_id: str, regions: Sequence[MappedRegion]
    ) -> list[Window]:
        st = self.st
        if (peer, engine_id) in st.windows:
            raise DataPlaneError(
                f"engine {engine_id!r} already has windows for {peer!r}", code="duplicate"
            )
        windows: list[Window] = []
        regs: list[Any] = []
        try:
            for region in regions:
                windows.append(Window(region))
                rows = np.array([[windows[-1].base, region.size, 0]], dtype=np.uint64)
                regs.append(st.agent.register_memory(rows, "DRAM"))
        except BaseException:
            self._close_windows(_PeerWindows(windows, regs))
            raise
        st.windows[(peer, engine_id)] = _PeerWindows(windows, regs)
        return windows

    def revoke_windows(self, peer: str) -> int:
        """Revoke, then deregister, every window of ``peer``; returns how many."""
        st = self.st
        n = 0
        for key in [k for k in st.windows if k[0] == peer]:
            entry = st.windows.pop(key)
            # Revoke first: from here on a stale write faults, whatever NIXL does next.
            for window in entry.windows:
                window.revoke()
            st.revoked.setdefault(peer, []).extend(entry.windows)
            self._deregister_windows(entry)
            n += len(entry.windows)
        return n

    def drop_revoked(self, peer: str) -> int:
        """Free the reservations of ``peer``'s revoked windows (that process is gone)."""
        windows = self.st.revoked.pop(peer, [])
        for window in windows:
            window.close()
        return len(windows)

    def _deregister_windows(self, entry: _PeerWindows) -> None:
        for reg in entry.reg_dlists:
            try:
                self.st.agent.deregister_memory(reg)
            except Exception as exc:
                log.warning("deregistering a window failed: %s", exc)

    def _close_windows(self, entry: _PeerWindows) -> None:
        self._deregister_windows(entry)
        for window in entry.windows:
            window.close()

    def add_remote_agent(self, metadata: bytes) -> str:
        name = self.st.agent.add_remote_agent(metadata)
        # The bindings return the name as bytes; notifications key it as str.
        return name.decode() if isinstance(name, bytes) else str(name)

    def remove_remote_agent(self, name: str) -> int:
        st = self.st
        n = self.fail_inflight(
            lambda p: p.remote_agent == name, "fenced", f"agent {name!r} removed"
        )
        for key in [k for k in st.remote if k[0] == name]:
            st.remote.pop(key).release()
        st.agent.remove_remote_agent(name)
        return n

    def add_remote_engine(self, agent_name: str, engine: RemoteEngine) -> None:
        st = self.st
        key = (agent_name, engine.engine_id)
        if key in st.remote:
            raise DataPlaneError(
                f"remote engine {engine.engine_id!r} of {agent_name!r} already added",
                code="duplicate",
            )
        try:
            dlist = st.agent.prep_xfer_dlist(
                agent_name, descriptor_rows(engine), NIXL_MEM[engine.memory]
            )
        except Exception as exc:
            raise DataPlaneError(
                f"cannot prepare remote engine {engine.engine_id!r} of {agent_name!r}:"
                f" {type(exc).__name__}: {exc}. The agent's metadata must be (re)loaded after"
                " the remote engine registered its memory.",
                code="nixl",
            ) from exc
        st.remote[key] = dlist

    def remove_remote_engine(self, agent_name: str, engine_id: str) -> int:
        dlist = self.st.remote.pop((agent_name, engine_id), None)
        if dlist is None:
            raise DataPlaneError(
                f"unknown remote engine {engine_id!r} of {agent_name!r}", code="unknown_engine"
            )
        n = self.fail_inflight(
            lambda p: (p.remote_agent, p.remote_engine) == (agent_name, engine_id),
            "removed",
            "remote engine removed",
        )
        dlist.release()
        return n

    # ---- shutdown ----------------------------------------------------------

    def _refuse_queued(self) -> None:
        """Answer commands that arrived after the stop, so no awaiter hangs."""
        while True:
            try:
                cmd = self.queue.get_nowait()
            except queue.Empty:
                return
            closed = DataPlaneError(f"data plane {self.name!r} is closed", code="state")
            match cmd:
                case _Call(_, fut):
                    self._resolve(fut, exc=closed)
                case _Post(fut=fut):
                    self._resolve(fut, exc=TransferError(str(closed), code="closed"))
                case _Cancel(_, ack):
                    self._resolve(ack, "settled")
                case _Stop(fut):
                    self._resolve(fut)

    def _shutdown(self) -> None:
        st = self.st
        self._refuse_queued()
        steps: list[tuple[str, Callable[[], object]]] = [
            (
                "abort writes",
                lambda: self.fail_inflight(lambda _: True, "closed", "data plane closed"),
            ),
        ]
        steps += [(f"remote dlist {k}", d.release) for k, d in st.remote.items()]
        for agent_name in sorted({k[0] for k in st.remote}):
            steps.append(
                (f"remote agent {agent_name}", lambda a=agent_name: st.agent.remove_remote_agent(a))
            )
        steps += [
            (f"windows {key}", lambda e=entry: self._close_windows(e))
            for key, entry in st.windows.items()
        ]
        for engine_id, local in st.local.items():
            steps.append((f"local dlist {engine_id}", local.dlist.release))
            steps += [
                (f"deregister {engine_id}", lambda r=r: st.agent.deregister_memory(r))
                for r in local.reg_dlists
            ]
        for what, step in steps:
            try:
                step()
            except Exception as exc:
                log.warning("data plane close: %s failed: %s", what, exc)
        # Drop every NIXL object here so their finalizers and the agent's
        # destructor run on this thread, not wherever the GC happens to be.
        st.remote.clear()
        st.local.clear()
        st.windows.clear()
        st.leaked.clear()
        st.agent = None
        if self._stop is not None:
            self._resolve(self._stop.fut)
        self._refuse_queued()


def _tighten_timer_slack() -> None:
    """Make this thread's short timed waits wake on time (Linux only, best effort).

    The default 50 us timer slack turns a 50 us poll wait into ~140 us on
    these VMs; it is a per-thread setting, so only the worker is affected.
    """
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_TIMERSLACK, 1000, 0, 0, 0)  # 1 us


def _wrap(exc: Exception, what: str, cls: type[DataPlaneError] = DataPlaneError) -> DataPlaneError:
    if isinstance(exc, DataPlaneError):
        return exc
    # A dead peer makes transfer() raise at once (measured: ~1 ms after the
    # receiver process died); callers treat that apart from other failures.
    code = "peer_disconnected" if type(exc).__name__ == "nixlRemoteDisconnectError" else "nixl"
    err = cls(f"{what} failed: {type(exc).__name__}: {exc}", code=code)
    err.__cause__ = exc
    return err


async def _settle(fut: asyncio.Future[T]) -> T:
    """Await ``fut`` to completion even if the caller is cancelled meanwhile.

    The worker's state change happens whatever the caller does; letting the
    caller leave early would let the loop-side tables disagree with the
    agent's. The cancellation is re-raised once ``fut`` has settled.
    """
    cancelled = False
    while not fut.done():
        try:
            await asyncio.shield(fut)
        except asyncio.CancelledError:
            cancelled = cancelled or not fut.done()
        except Exception:
            pass  # fut's own exception, re-raised below
    if cancelled:
        if not fut.cancelled():
            fut.exception()  # mark it retrieved
        raise asyncio.CancelledError
    return fut.result()


# --------------------------------------------------------------------------
# The facade the daemon uses, on the event loop
# --------------------------------------------------------------------------


class DataPlane:
    """One NIXL agent driven by one worker thread; async methods for the event loop.

    Lifecycle for a pair of daemons: each ``start()``s, adds its local engines,
    then sends ``metadata()`` (taken AFTER its engines were added: metadata
    carries the registrations, and a peer cannot prepare a remote engine from
    stale metadata; loading newer metadata for a known agent updates it) and
    its engines' ``RemoteEngine`` to the peer, which calls
    ``add_remote_agent`` then ``add_remote_engine``.

    ``poll_interval_s`` paces the worker while writes are in flight or
    notifications are expected; ``idle_progress_s`` is how often an otherwise
    idle worker makes one progress call (None: never). A receiver should call
    ``expect_notifications(True)`` while it waits for data: a pusher's
    notified WRITE only completes when the receiver progresses, so without it
    each write takes up to ``idle_progress_s`` (measured: 100 ms per write).
    """

    def __init__(
        self,
        name: str,
        *,
        backend: str = "UCX",
        poll_interval_s: float = 5e-5,
        idle_progress_s: float | None = 0.1,
    ) -> None:
        self.name = name
        self.backend = backend
        self.poll_interval_s = poll_interval_s
        self.idle_progress_s = idle_progress_s
        self._worker: _Worker | None = None
        self._closed = False
        self._handler: NotificationHandler | None = None
        self._xids = itertools.count(1)
        # Loop-side mirror of what the worker holds, for validation before posting.
        self._local: dict[str, EngineGeometry] = {}
        self._remote_agents: set[str] = set()
        self._remote: dict[tuple[str, str], EngineGeometry] = {}
        self._remote_specs: dict[tuple[str, str], RemoteEngine] = {}
        # Counters (read them from the event loop).
        self.writes = 0
        self.bytes_written = 0
        self.write_errors = 0
        self.writes_cancelled = 0
        self.notifications = 0
        self.notifications_dropped = 0

    @property
    def agent_name(self) -> str:
        return self.name

    # ---- lifecycle -------------------------------------------------------

    async def start(self) -> None:
        if self._worker is not None:
            raise DataPlaneError(f"data plane {self.name!r} already started", code="state")
        worker = _Worker(
            self.name,
            self.backend,
            asyncio.get_running_loop(),
            self.poll_interval_s,
            self.idle_progress_s,
            self._deliver_notifs,
        )
        worker.thread.start()
        try:
            await _settle(worker.started)
        except BaseException:
            if worker.started.exception() is None:
                # The agent started but our caller was cancelled: stop it again.
                worker.submit(_Stop(worker.loop.create_future()))
            await asyncio.to_thread(worker.thread.join)
            raise
        self._worker = worker

    async def close(self) -> None:
        """Abort writes in flight, release every NIXL object, stop the worker. Idempotent."""
        worker = self._worker
        if worker is None or self._closed:
            return
        self._closed = True
        fut: asyncio.Future[None] = worker.loop.create_future()
        worker.submit(_Stop(fut))
        await _settle(fut)
        await asyncio.to_thread(worker.thread.join)
        self._local.clear()
        self._remote.clear()
        self._remote_specs.clear()
        self._remote_agents.clear()

    def _live_worker(self) -> _Worker:
        if self._worker is None or self._closed or not self._worker.thread.is_alive():
            raise DataPlaneError(f"data plane {self.name!r} is not running", code="state")
        return self._worker

    async def _call(self, fn: Callable[[], T]) -> T:
        worker = self._live_worker()
        fut: asyncio.Future[T] = worker.loop.create_future()
        worker.submit(_Call(fn, fut))
        return await _settle(fut)

    # ---- agents and engines ------------------------------------------------

    async def metadata(self) -> bytes:
        worker = self._live_worker()
        return await self._call(lambda: bytes(worker.st.agent.get_agent_metadata()))

    async def add_local_engine(
        self, spec: EngineSpec, regions: Mapping[str, Region]
    ) -> RemoteEngine:
        """Register the engine's regions and prepare its descriptor list.

        Returns the ``RemoteEngine`` a peer needs (addresses in this process).
        """
        worker = self._live_worker()
        if spec.engine_id in self._local:
            raise DataPlaneError(f"local engine {spec.engine_id!r} already added", code="duplicate")
        engine = _local_remote_engine(spec, regions)
        geometry = EngineGeometry.of(engine.engine_id, engine.groups)
        mapped = [regions[r.name] for r in spec.regions]
        await self._call(lambda: worker.add_local(engine, mapped))
        self._local[spec.engine_id] = geometry
        return engine

    async def open_windows(
        self, peer: str, spec: EngineSpec, regions: Mapping[str, Region]
    ) -> RemoteEngine:
        """The ``RemoteEngine`` to give ``peer``: its own windows onto the engine's regions.

        VRAM cannot be mapped twice in one process (a CUDA IPC handle opens
        once), so a VRAM engine's peers share its one registration, and
        fencing cannot revoke their access to it (see RELIABILITY.md).
        """
        worker = self._live_worker()
        if spec.engine_id not in self._local:
            raise DataPlaneError(f"unknown local engine {spec.engine_id!r}", code="unknown_engine")
        dram = [m for r in spec.regions if isinstance(m := regions[r.name], MappedRegion)]
        if len(dram) != len(spec.regions):
            return _local_remote_engine(spec, regions)
        windows = await self._call(lambda: worker.open_windows(peer, spec.engine_id, dram))
        return _local_remote_engine(spec, {w.name: w for w in windows})

    async def revoke_windows(self, peer: str) -> int:
        """Fence ``peer`` out of this process's memory: a write it posts from now on faults.

        Returns how many windows were revoked; open new ones for its next link.
        """
        worker = self._live_worker()
        return await self._call(lambda: worker.revoke_windows(peer))

    async def drop_revoked(self, peer: str) -> int:
        """Unmap ``peer``'s revoked windows, once the process that knew them is known gone."""
        worker = self._live_worker()
        return await self._call(lambda: worker.drop_revoked(peer))

    async def remove_local_engine(self, engine_id: str) -> int:
        """Abort its writes in flight, release its list, deregister its regions.

        Returns how many writes were aborted. Unmap the regions only after this.
        """
        worker = self._live_worker()
        if self._local.pop(engine_id, None) is None:
            raise DataPlaneError(f"unknown local engine {engine_id!r}", code="unknown_engine")
        return await self._call(lambda: worker.remove_local(engine_id))

    async def add_remote_agent(self, metadata: bytes) -> str:
        """Load a peer agent's metadata (again, to refresh it); returns its name."""
        worker = self._live_worker()
        name = await self._call(lambda: worker.add_remote_agent(metadata))
        if name == self.name:
            raise DataPlaneError("a remote agent has this agent's own name", code="bad_agent")
        self._remote_agents.add(name)
        return name

    async def remove_remote_agent(self, name: str) -> int:
        """Fence a peer: abort its writes in flight, release its lists, forget it.

        When this returns, no write to that agent is in flight and none can be
        posted. Returns how many writes were aborted.
        """
        worker = self._live_worker()
        if name not in self._remote_agents:
            raise DataPlaneError(f"unknown remote agent {name!r}", code="unknown_agent")
        self._remote_agents.discard(name)
        for key in [k for k in self._remote if k[0] == name]:
            del self._remote[key], self._remote_specs[key]
        return await self._call(lambda: worker.remove_remote_agent(name))

    async def add_remote_engine(self, agent_name: str, engine: RemoteEngine) -> None:
        """Prepare a peer engine's descriptor list; adding the identical engine again is a no-op."""
        worker = self._live_worker()
        if agent_name not in self._remote_agents:
            raise DataPlaneError(f"unknown remote agent {agent_name!r}", code="unknown_agent")
        key = (agent_name, engine.engine_id)
        if key in self._remote:
            if self._remote_specs.get(key) == engine:
                return  # the same engine again (a peer link reconnect): nothing to do
            raise DataPlaneError(
                f"remote engine {engine.engine_id!r} of {agent_name!r} already added with"
                " another layout; remove_remote_engine first",
                code="duplicate",
            )
        _check_remote_engine(engine)
        geometry = EngineGeometry.of(engine.engine_id, engine.groups)
        await self._call(lambda: worker.add_remote_engine(agent_name, engine))
        self._remote[key] = geometry
        self._remote_specs[key] = engine

    async def remove_remote_engine(self, agent_name: str, engine_id: str) -> int:
        worker = self._live_worker()
        self._remote_specs.pop((agent_name, engine_id), None)
        if self._remote.pop((agent_name, engine_id), None) is None:
            raise DataPlaneError(
                f"unknown remote engine {engine_id!r} of {agent_name!r}", code="unknown_engine"
            )
        return await self._call(lambda: worker.remove_remote_engine(agent_name, engine_id))

    # ---- writes --------------------------------------------------------------

    def _geometries(
        self, local_engine: str, remote_agent: str, remote_engine: str
    ) -> tuple[EngineGeometry, EngineGeometry]:
        local = self._local.get(local_engine)
        if local is None:
            raise DataPlaneError(f"unknown local engine {local_engine!r}", code="unknown_engine")
        if remote_agent not in self._remote_agents:
            raise DataPlaneError(f"unknown remote agent {remote_agent!r}", code="unknown_agent")
        remote = self._remote.get((remote_agent, remote_engine))
        if remote is None:
            raise DataPlaneError(
                f"unknown remote engine {remote_engine!r} of {remote_agent!r}",
                code="unknown_engine",
            )
        return local, remote

    async def write(
        self,
        local_engine: str,
        remote_agent: str,
        remote_engine: str,
        src: Blocks,
        dst: Blocks,
        notif: bytes,
    ) -> WriteResult:
        """Write ``src[g][i]`` of every layer into ``dst[g][i]`` with one NIXL WRITE.

        Validation errors raise DataPlaneError before anything is posted. A
        write of zero blocks in total never touches NIXL (and sends no
        notification). If the caller is cancelled, the transfer is aborted
        (its handle released) before the cancellation propagates.
        """
        worker = self._live_worker()
        local, remote = self._geometries(local_engine, remote_agent, remote_engine)
        lidx, ridx, nbytes = build_indices(local, remote, src, dst)
        if nbytes == 0:
            return WriteResult(0, 0, 0.0)
        xid = next(self._xids)
        fut: asyncio.Future[WriteResult] = worker.loop.create_future()
        worker.submit(
            _Post(xid, local_engine, remote_agent, remote_engine, lidx, ridx, notif, nbytes, fut)
        )
        try:
            result = await asyncio.shield(fut)
        except asyncio.CancelledError:
            await self._cancel_write(worker, xid, fut)
            raise
        except TransferError:
            self.write_errors += 1
            raise
        self.writes += 1
        self.bytes_written += result.nbytes
        return result

    async def _cancel_write(
        self, worker: _Worker, xid: int, fut: asyncio.Future[WriteResult]
    ) -> None:
        self.writes_cancelled += 1
        ack: asyncio.Future[str] = worker.loop.create_future()
        worker.submit(_Cancel(xid, ack))
        try:
            await _settle(ack)
        finally:
            if fut.done() and not fut.cancelled():
                exc = fut.exception()  # retrieved: nobody else will look at it
                if isinstance(exc, TransferError):
                    # Posted before the cancel reached the worker, and failed
                    # (a fenced peer's revoked window, say): worth a count and a line.
                    self.write_errors += 1
                    log.warning("write %d failed before its cancel arrived: %s", xid, exc)

    # ---- notifications ---------------------------------------------------------

    def set_notification_handler(self, callback: NotificationHandler | None) -> None:
        """``callback(remote_agent_name, message)`` runs on the event loop thread.

        NIXL keys notifications by the sending agent's name only; the message
        must identify the request (and its incarnation). A cancelled or
        fenced write's notification is normally never delivered, but the
        handler must tolerate late or unknown messages.
        """
        self._handler = callback

    def expect_notifications(self, flag: bool) -> None:
        """While True, the worker polls for notifications (and thus progresses) continuously.

        A hint about polling: on a data plane that is closed (a fatal journal
        error closes it while peer messages are still being handled) there is
        nothing to poll, and nothing to refuse.
        """
        if self._closed:
            return
        self._live_worker().submit(_Expect(bool(flag)))

    def _deliver_notifs(self, notifs: dict[str, list[bytes]]) -> None:
        for agent_name, messages in notifs.items():
            for message in messages:
                self.notifications += 1
                handler = self._handler
                if handler is None:
                    self.notifications_dropped += 1
                    log.warning("notification from %s dropped: no handler", agent_name)
                    continue
                try:
                    handler(agent_name, bytes(message))
                except Exception:
                    log.exception("notification handler failed for %s", agent_name)
