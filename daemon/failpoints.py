"""Named crash and fault points, armed only through the environment.

A failpoint is one line at a place where a crash or an I/O error matters
(``failpoints.hit("journal.sync_fd")``). Unless ``KVPUSHD_FAILPOINTS`` is
set, every point is disarmed and :func:`hit` returns after one check of an
empty mapping, so the daemon pays nothing worth measuring in production.

Syntax: ``KVPUSHD_FAILPOINTS="name=action[@N][,name=action[@N]...]"``.

Actions:

``crash``
    SIGKILL this process at once: no cleanup, no flush, exactly what a
    ``kill -9`` or a power cut of the process does (the page cache survives).
``error``
    Raise ``OSError(EIO)``, as a failed ``write``/``fdatasync`` does. Only at
    points marked ``io`` below, where the surrounding code treats an OSError
    as the real system call failing.
``enospc``
    Raise ``OSError(ENOSPC)`` (a full disk); same points as ``error``.
``sleep:S``
    Block the calling thread for S seconds (a stalled disk or event loop).
``stop``
    SIGSTOP this process (a frozen process, resumed by SIGCONT from outside).
``corrupt``
    Only at points marked ``corrupts`` below, and the only action there: the
    code at the point damages what it names (a KV byte, a block list), to
    show that the integrity check catches it. Such a point is passed with
    :func:`corrupts`, which says whether to damage now.

``@N`` fires the action on the Nth hit of that point only (hits count from 1
in each process); without it the action fires on every hit. Before a
``crash`` or ``stop`` one JSON line goes to stderr, so a test can tell a
failpoint death from any other.

An unknown name, an unknown action, or ``error``/``enospc`` at a point that
does no I/O raises ValueError when this module is imported: a mistyped
failpoint must fail loudly, never silently test nothing.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Final

ENV: Final = "KVPUSHD_FAILPOINTS"


@dataclass(frozen=True, slots=True)
class Point:
    """A place in the daemon where a failpoint line sits."""

    where: str
    io: bool  # an OSError raised here is handled as the real syscall failing
    corrupts: bool = False  # a ``corrupt`` point: passed with corrupts(), not hit()


# Every failpoint in the daemon, with where it is. Keep in step with the
# hit() lines: tests/test_crash.py checks these names against the code.
POINTS: Final[Mapping[str, Point]] = MappingProxyType(
    {
        "journal.append": Point(
            "Journal.append: before a record is buffered (nothing of it on disk yet)", io=False
        ),
        "journal.write": Point(
            "Journal.write_pending/_write_buffer: before write(2) of the buffered records",
            io=True,
        ),
        "journal.sync_fd": Point(
            "Journal.sync_fd: before the fdatasync GroupCommit runs in its sync thread",
            io=True,
        ),
        "journal.fdatasync": Point(
            "Journal._sync_segment: before the synchronous fdatasync of commit(), "
            "of a rotation's seal and of a snapshot's commit",
            io=True,
        ),
        "journal.rotate": Point(
            "Journal._start_segment: before a new segment is created (hit 1 is the one "
            "open() creates, later hits are rotations, after the old segment was sealed)",
            io=True,
        ),
        "journal.snapshot": Point(
            "Journal.write_snapshot: before the snapshot file is written", io=True
        ),
        "groupcommit.synced": Point(
            "GroupCommit._synced: the sync thread's fdatasync succeeded; before the "
            "records are marked durable and their waiters woken (nobody told yet)",
            io=False,
        ),
        "nixl.post": Point(
            "dataplane Worker._post (worker.py): before make_prepped_xfer (nothing posted)", io=True
        ),
        "nixl.posted": Point(
            "dataplane Worker._post (worker.py): transfer() returned; the WRITE and its "
            "notification are posted, maybe complete",
            io=True,
        ),
        "node.write_done": Point(
            "Transfers._write: the pusher's WriteDone is durable; before the prefill "
            "engine and the decode daemon are told",
            io=False,
        ),
        "node.kv_arrived": Point(
            "Transfers._arrived: the receiver's WriteDone is durable; before the decode "
            "engine is told",
            io=False,
        ),
        "peer.send": Point(
            "PeerManager.send: before a daemon message (not a heartbeat) is queued", io=False
        ),
        "engine.reply": Point(
            "engine_server Session.send: before a reply or event frame to an engine", io=False
        ),
        "engine.accepted": Point(
            "EngineServer._reply: a registration was accepted and the reply's send fails "
            "(error): that engine's connection ends while the daemon lives",
            io=True,
        ),
        "integrity.flip_dst": Point(
            "Integrity.landed (daemon/node/integrity.py), or Transfers.on_notification "
            "(daemon/node/transfers.py) for an unchecked request: the receiver heard the "
            "data landed; flip one byte of its first destination block before any check",
            io=False,
            corrupts=True,
        ),
        "connector.swap_slices": Point(
            "KvpushdConnector WorkerSide._start_load (daemon/client/vllm/worker.py): a decode rank "
            "fed by several prefill ranks registers each prefill rank's receiver on the "
            "next rank's head slice (a planted rank mis-mapping; one hit per load)",
            io=False,
            corrupts=True,
        ),
        "connector.swap_split": Point(
            "KvpushdConnector RankPlan.shares (daemon/client/vllm/shares.py): a prefill rank "
            "that splits its push for a decode with more ranks or stages pushes each decode "
            "rank's (and stage's) share from the next head (and layer) slice (a planted "
            "rank mis-mapping; one hit per push)",
            io=False,
            corrupts=True,
        ),
        "connector.reverse_group": Point(
            "KvpushdConnector WorkerSide._start_load (daemon/client/vllm/worker.py): a decode load "
            "registers its first KV cache group's blocks in reverse order (a planted "
            "misplacement: each block's hash then names another block; one hit per load "
            "with two blocks or more in that group)",
            io=False,
            corrupts=True,
        ),
        "connector.swap_states": Point(
            "KvpushdConnector WorkerSide._start_load (daemon/client/vllm/worker.py): a decode load "
            "of a model with recurrent state registers its first two state groups' blocks "
            "the other way round (a planted misplacement no block hash can see: a state "
            "names no token; one hit per load with two state blocks)",
            io=False,
            corrupts=True,
        ),
        "connector.skip_stage_in": Point(
            "KvpushdConnector WorkerSide._stage_in (daemon/client/vllm/worker.py): with host "
            "staging, a decode step's landed loads are reported finished without the copy "
            "from the host mirror into vLLM's cache (a planted lost copy; one hit per step "
            "that has landed loads)",
            io=False,
            corrupts=True,
        ),
        "connector.shift_push": Point(
            "KvpushdConnector SchedulerSide.finished (daemon/client/vllm/scheduler.py): a finished "
            "prefill names its prompt's blocks without the last one, with their true block "
            "hashes, so the tail trim pairs each decode block with the block before its own "
            "(a planted misalignment the block hashes must refuse; one hit per push)",
            io=False,
            corrupts=True,
        ),
        "offload.skip_reset": Point(
            "OffloadTier._reset_round (daemon/node/offload.py): a round of evicted offload "
            "slots is journaled reset without being zeroed (a planted stale slot the grant's "
            "zero check must catch; one hit per round)",
            io=False,
            corrupts=True,
        ),
        "integrity.shift_src": Point(
            "_wire_src (daemon/node/transfers.py): the pusher hands NIXL the "
            "front of its blocks instead of the trimmed tail (a planted front-trim)",
            io=False,
            corrupts=True,
        ),
    }
)

ACTIONS: Final = ("crash", "error", "enospc", "sleep", "stop", "corrupt")


@dataclass(slots=True)
class Failpoint:
    """One armed point: its action, when it fires, and how often it was hit."""

    name: str
    action: str
    seconds: float = 0.0
    nth: int | None = None  # fire on this hit only; None: on every hit
    hits: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def count(self) -> int:
        # Points are hit from the event loop and from worker threads.
        with self._lock:
            self.hits += 1
            return self.hits

    def fires(self, hit: int) -> bool:
        return self.nth is None or hit == self.nth


def parse(spec: str) -> dict[str, Failpoint]:
    """``"a=crash@3,b=sleep:0.5"`` -> armed failpoints; raises ValueError on anything odd."""
    armed: dict[str, Failpoint] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, sep, action = item.partition("=")
        name = name.strip()
        if not sep:
            raise ValueError(f"{ENV}: {item!r} is not name=action")
        if name not in POINTS:
            raise ValueError(f"{ENV}: unknown failpoint {name!r} (known: {', '.join(POINTS)})")
        if name in armed:
            raise ValueError(f"{ENV}: failpoint {name!r} is armed twice")
        armed[name] = _parse_action(name, action.strip())
    return armed


def _parse_action(name: str, text: str) -> Failpoint:
    body, at, nth_text = text.partition("@")
    nth = None
    if at:
        if not nth_text.isdigit() or int(nth_text) < 1:
            raise ValueError(f"{ENV}: {name}={text}: @N needs a whole number N >= 1")
        nth = int(nth_text)
    kind, colon, arg = body.partition(":")
    if kind not in ACTIONS:
        raise ValueError(f"{ENV}: {name}={text}: unknown action (known: {', '.join(ACTIONS)})")
    if (kind == "sleep") != bool(colon):
        raise ValueError(f"{ENV}: {name}={text}: only sleep takes an argument (sleep:S)")
    seconds = 0.0
    if kind == "sleep":
        try:
            seconds = float(arg)
        except ValueError:
            raise ValueError(f"{ENV}: {name}={text}: sleep:S needs a number of seconds") from None
        if not 0 <= seconds < 3600:
            raise ValueError(f"{ENV}: {name}={text}: sleep must be 0..3600 s")
    if kind in ("error", "enospc") and not POINTS[name].io:
        raise ValueError(f"{ENV}: {name} does no I/O; {kind} is only for io points")
    if (kind == "corrupt") != POINTS[name].corrupts:
        raise ValueError(
            f"{ENV}: {name}={text}: corrupt is the only action of a corrupting point,"
            " and only there"
        )
    return Failpoint(name, kind, seconds, nth)


# Rebound (never mutated) by configure(); hit() reads it once per call.
_ARMED: Mapping[str, Failpoint] = MappingProxyType(parse(os.environ.get(ENV, "")))


def configure(spec: str) -> None:
    """Re-arm from ``spec`` in this process (tests that run a journal in-process)."""
    global _ARMED
    _ARMED = MappingProxyType(parse(spec))


def armed() -> Mapping[str, Failpoint]:
    return _ARMED


def hit(name: str) -> None:
    """Pass the failpoint ``name``: nothing happens unless it is armed."""
    if not _ARMED:
        return
    point = _ARMED.get(name)
    if point is not None:
        _fire(point)


def corrupts(name: str) -> bool:
    """Pass the corrupting point ``name``: True when the code there must damage now."""
    if not _ARMED:
        return False
    point = _ARMED.get(name)
    return point is not None and point.fires(point.count())


def _fire(point: Failpoint) -> None:
    n = point.count()
    if not point.fires(n):
        return
    if point.action == "crash":
        _say(point, n)
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)  # SIGKILL is asynchronous for other threads; never run on
    elif point.action == "stop":
        _say(point, n)
        # Aimed at this thread, so this thread is the one that takes the stop
        # on its way out of the call: sent to the process, another thread may
        # take it while this one runs on past the failpoint for a while (seen:
        # a WRITE posted after "stop" fired, 1 run in ~20 on a loaded box).
        signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)
    elif point.action == "sleep":
        time.sleep(point.seconds)
    elif point.action == "error":
        raise OSError(errno.EIO, f"{os.strerror(errno.EIO)} (failpoint {point.name})")
    elif point.action == "enospc":
        raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} (failpoint {point.name})")


def _say(point: Failpoint, n: int) -> None:
    line = {"event": "failpoint", "failpoint": point.name, "action": point.action, "hit": n}
    line |= {"level": "critical", "pid": os.getpid()}
    # os.write, not print(): nothing buffered may be lost to the SIGKILL.
    # sys.stderr's descriptor, not 2: under `kvpushd run` descriptor 2 feeds
    # daemon.nativelog's child, which might write the line after the crash.
    os.write(_stderr_fd(), (json.dumps(line) + "\n").encode())


def _stderr_fd() -> int:
    try:
        return sys.stderr.fileno()
    except (AttributeError, ValueError, OSError):
        return 2
