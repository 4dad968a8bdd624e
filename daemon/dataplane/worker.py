"""The NIXL worker: the one thread that owns the agent, and its commands.

The agent runs without a NIXL progress thread: with the wrapper's progress
delay of 0 that thread spins a whole core even when idle (see NIXL-FACTS).
Without it, the agent is not thread-safe and only progresses when called, so
exactly one worker thread owns it and makes *every* agent call. The event
loop (plane.py) hands the worker commands through a queue and gets results
back in batches: the worker appends each result (a future to settle, a
notification batch) to an outbox and wakes the loop once per round of work
(one command, or one progress pass), and not at all while a wake-up it sent
has not run yet (:meth:`Worker._flush`); the loop then settles everything
in the outbox in order. With 32 writes in flight one wake-up carries several
completions, and each completion costs no ``call_soon_threadsafe`` handle of
its own.

The worker blocks on its queue while nothing is outstanding, so an idle
daemon costs ~0 CPU (it still wakes every ``idle_progress_s`` for one cheap
progress call, so a stray notification or a peer's wire-up is never stuck
forever). While writes are in flight, or while the daemon expects
notifications (it has receiver requests waiting for data), it polls
``check_xfer_state`` and ``get_new_notifs`` every ``poll_interval_s``. A
receiver must poll while it expects writes: the pusher's DONE for a WRITE
that carries a notification waits for the receiver's next progress call.
A worker that only expects notifications and hears none backs off, up to
four times the interval (``_wait_s``): a receiver registered long before its
data costs a quarter of the polls, at the price of up to 150 us more before
it sees the data (and before the pusher's DONE, which waits for it), while
a pusher with a write in flight always polls at the full rate. Whether it
expects notifications is a flag the loop sets directly
(:meth:`Worker.set_expect`), not a command: turning it off costs the worker
no wake-up, turning it on wakes only an idle worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Final

import numpy as np

from daemon import failpoints
from daemon.dataplane.errors import DataPlaneError, TransferError
from daemon.dataplane.geometry import NIXL_MEM, Region, descriptor_rows
from daemon.dataplane.memory import MappedRegion
from daemon.dataplane.vram import load_cuda_before_nixl, use_device_here
from daemon.dataplane.window import Window
from schemas.kvlayout import MemoryKind, RemoteEngine

log = logging.getLogger(__name__)

# How long close/fence waits for a transfer NIXL refused to cancel before
# giving up on it (it is then kept referenced, never released off-thread).
ABORT_WAIT_S: Final = 5.0

# A worker that only expects notifications polls less often the longer none
# comes: the interval doubles after every EXPECT_BACKOFF_ROUNDS empty rounds,
# up to 2**EXPECT_BACKOFF_STEPS times poll_interval_s.
EXPECT_BACKOFF_ROUNDS: Final = 8
EXPECT_BACKOFF_STEPS: Final = 2

_PR_SET_TIMERSLACK: Final = 29
_PR_SET_NAME: Final = 15

# An outbox entry: (future, result, exception or _CANCEL), or (callback, argument, None).
_Outcome = tuple[Any, Any, Any]
_CANCEL: Final = object()  # the future is to be cancelled


@dataclass(frozen=True, slots=True)
class WriteResult:
    """What a completed write returns (:meth:`DataPlane.write`)."""

    nbytes: int
    descriptors: int  # block descriptors requested (before NIXL merges contiguous ones)
    seconds: float  # from make_prepped_xfer to DONE, measured on the worker


# Commands: what the event loop (plane.py) puts on the worker's queue.


@dataclass(slots=True)
class Call:
    fn: Callable[[], Any]
    fut: asyncio.Future[Any]


@dataclass(slots=True)
class Post:
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
class Cancel:
    xid: int
    ack: asyncio.Future[str]


@dataclass(slots=True)
class Stop:
    fut: asyncio.Future[None]


Command = Call | Post | Cancel | Stop | None  # None: only wake up


@dataclass(slots=True)
class _InFlight:
    post: Post
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
    leaked: list[Any] = field(default_factory=list)


class Worker:
    """Owns the agent: every method runs on the worker thread, but :meth:`submit`."""

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
        self.queue: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self.st = _WorkerState()
        # Makes a GPU's context current on this worker's thread (a recorder in CPU tests).
        self.use_device: Callable[[int], None] = use_device_here
        self.thread = threading.Thread(target=self._run, name=f"nixl-{name}", daemon=True)
        self.started: asyncio.Future[None] = loop.create_future()
        self._stop: Stop | None = None
        # Set by the loop (set_expect), read by the worker when it picks its wait.
        self.expect = False
        self._empty_rounds = 0  # rounds in a row with no command and no notification
        # Worker -> loop: outcomes in order, settled by _deliver on the loop.
        # deque append/popleft are atomic, so the two threads need no lock.
        self._outbox: deque[_Outcome] = deque()
        # True from the worker's call_soon_threadsafe until _deliver starts.
        self._wake_pending = False
        # Counters for tests and benchmarks (each written by one thread).
        self.loop_wakes = 0  # call_soon_threadsafe calls made by the worker
        self.delivered = 0  # outcomes the loop settled or dispatched

    # ---- plumbing -------------------------------------------------------

    def submit(self, cmd: Command) -> None:
        self.queue.put(cmd)

    def set_expect(self, flag: bool) -> None:
        """From the loop: poll continuously while True (see the module docstring)."""
        was = self.expect
        self.expect = flag
        if flag and not was:
            # The worker may be in its long idle wait: cut it short.
            self.queue.put(None)

    def _resolve(
        self, fut: asyncio.Future[Any], result: Any = None, exc: BaseException | None = None
    ) -> None:
        self._outbox.append((fut, result, exc))

    def _cancel_future(self, fut: asyncio.Future[Any]) -> None:
        self._outbox.append((fut, None, _CANCEL))

    def _flush(self) -> None:
        """Wake the loop for what the outbox holds, unless a wake-up is already on its way."""
        if self._wake_pending or not self._outbox:
            return
        self._wake_pending = True
        self.loop_wakes += 1
        try:
            self.loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:  # loop already closed: nobody is left to tell
            self._wake_pending = False

    def _deliver(self) -> None:
        """On the loop: settle every outcome in the outbox, in the order the worker added them."""
        # Cleared before reading: an outcome appended from here on is either
        # read below or comes with a wake-up of its own.
        self._wake_pending = False
        outbox = self._outbox
        while outbox:
            target, result, exc = outbox.popleft()
            self.delivered += 1
            if isinstance(target, asyncio.Future):
                if target.done():
                    continue  # the awaiting side gave up; nothing to deliver
                if exc is _CANCEL:
                    target.cancel()
                elif exc is not None:
                    target.set_exception(exc)
                else:
                    target.set_result(result)
                continue
            try:
                target(result)
            except Exception:
                log.exception("data plane notification delivery failed")

    def _busy(self) -> bool:
        return bool(self.st.inflight) or self.expect

    def _run(self) -> None:
        _tighten_timer_slack()
        _name_thread(b"nixl-worker")
        try:
            self.st.agent = self._create_agent()
        except Exception as exc:
            self._resolve(self.started, exc=_wrap(exc, f"starting NIXL agent {self.name!r}"))
            self._flush()
            return
        self._resolve(self.started)
        self._flush()
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
            try:
                cmd = self.queue.get(timeout=self._wait_s())
            except queue.Empty:
                self._empty_rounds += 1
            else:
                self._empty_rounds = 0
                self._handle(cmd)
                self._flush()
                self._drain()
            if self._stop is None:
                if self._progress():
                    self._empty_rounds = 0
                self._flush()

    def _wait_s(self) -> float | None:
        """How long to wait for a command before the next progress round.

        Writes in flight: poll_interval_s. Only expecting notifications:
        poll_interval_s, doubled after every EXPECT_BACKOFF_ROUNDS rounds
        that found nothing, up to 2**EXPECT_BACKOFF_STEPS times it; a notification
        or a command resets it. Idle: idle_progress_s.
        """
        if self.st.inflight:
            return self.poll_interval_s
        if self.expect:
            steps = min(self._empty_rounds // EXPECT_BACKOFF_ROUNDS, EXPECT_BACKOFF_STEPS)
            return self.poll_interval_s * (1 << steps)
        return self.idle_progress_s

    def _drain(self) -> None:
        while self._stop is None:
            try:
                cmd = self.queue.get_nowait()
            except queue.Empty:
                return
            self._handle(cmd)
            # Per command, not per drain: a large write's transfer() blocks
            # for its copy, and the results before it must not wait for it.
            self._flush()

    def _handle(self, cmd: Command) -> None:
        match cmd:
            case Call(fn, fut):
                try:
                    result = fn()
                except Exception as exc:
                    self._resolve(fut, exc=_wrap(exc, "NIXL call"))
                else:
                    self._resolve(fut, result)
            case Post():
                self._post(cmd)
            case Cancel(xid, ack):
                self._resolve(ack, self._cancel(xid))
            case Stop():
                self._stop = cmd

    # ---- agent -----------------------------------------------------------

    def _create_agent(self) -> Any:
        from nixl._api import nixl_agent, nixl_agent_config

        if load_cuda_before_nixl():
            log.info("CUDA runtime loaded before NIXL's backend: VRAM regions can be registered")
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

    def _progress(self) -> bool:
        """One round: settle finished writes, collect notifications; True if any arrived."""
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
            return False
        if notifs:
            self._outbox.append((self.on_notifs, notifs, None))
            return True
        return False

    def _post(self, post: Post) -> None:
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

    def fail_inflight(self, match: Callable[[Post], bool], code: str, why: str) -> int:
        """Abort every in-flight write ``match`` selects; their awaiters get TransferError."""
        victims = [xid for xid, e in self.st.inflight.items() if match(e.post)]
        for xid in victims:
            entry = self.st.inflight.pop(xid)
            self._release_xfer(entry.handle)
            self._resolve(
                entry.post.fut, exc=TransferError(f"write {xid} aborted: {why}", code=code)
            )
        return len(victims)

    # ---- operations called through Call ---------------------------------

    def add_local(self, engine: RemoteEngine, regions: Sequence[Region]) -> None:
        st = self.st
        if engine.engine_id in st.local:
            raise DataPlaneError(
                f"local engine {engine.engine_id!r} already added", code="duplicate"
            )
        mem = NIXL_MEM[engine.memory]  # VRAM rows carry the CUDA device index here
        reg_dlists: list[Any] = []
        if engine.memory is MemoryKind.VRAM:
            self.use_device(engine.device)
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
            # Revoke first: from here on a stale write lands in the sink, whatever NIXL does next.
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
                case Call(_, fut):
                    self._resolve(fut, exc=closed)
                case Post(fut=fut):
                    self._resolve(fut, exc=TransferError(str(closed), code="closed"))
                case Cancel(_, ack):
                    self._resolve(ack, "settled")
                case Stop(fut):
                    self._resolve(fut)
                case None:
                    pass

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
                (f"remote agent {agent_name}", partial(st.agent.remove_remote_agent, agent_name))
            )
        steps += [
            (f"windows {key}", partial(self._close_windows, entry))
            for key, entry in st.windows.items()
        ]
        for engine_id, local in st.local.items():
            steps.append((f"local dlist {engine_id}", local.dlist.release))
            steps += [
                (f"deregister {engine_id}", partial(st.agent.deregister_memory, r))
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
        self._flush()


def _tighten_timer_slack() -> None:
    """Make this thread's short timed waits wake on time (Linux only, best effort).

    The default 50 us timer slack turns a 50 us poll wait into ~140 us on
    these VMs; it is a per-thread setting, so only the worker is affected.
    """
    _prctl(_PR_SET_TIMERSLACK, 1000)  # 1 us


def _name_thread(name: bytes) -> None:
    """Name this OS thread (``top -H``, /proc/PID/task/TID/comm; best effort, Linux only)."""
    _prctl(_PR_SET_NAME, ctypes.c_char_p(name[:15]))


def _prctl(option: int, arg: Any) -> None:
    """prctl(2) for the calling thread; best effort (not Linux, no libc: nothing happens)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(option, arg, 0, 0, 0)


def _wrap(exc: Exception, what: str, cls: type[DataPlaneError] = DataPlaneError) -> DataPlaneError:
    if isinstance(exc, DataPlaneError):
        return exc
    # A dead peer makes transfer() raise at once (measured: ~1 ms after the
    # receiver process died); callers treat that apart from other failures.
    code = "peer_disconnected" if type(exc).__name__ == "nixlRemoteDisconnectError" else "nixl"
    err = cls(f"{what} failed: {type(exc).__name__}: {exc}", code=code)
    err.__cause__ = exc
    return err
