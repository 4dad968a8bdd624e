"""The daemon off the engines' cores: ``cpu_affinity`` pins every thread of it.

The daemon's hot threads are the event loop and the NIXL worker, which
makes the cma copies of a push inside ``transfer()`` and polls every
``nixl.poll_interval_s`` while writes are in flight. Left to the scheduler,
both land on whatever core is free, which on a serving node is an engine's:
the copy and the polls then take time slices from a prefill's or a decode's
step, and an engine's busy core delays the daemon in turn. ``cpu_affinity``
(README.md, "Configuration") names the cores the daemon may use instead.

:func:`pin` is called once at start-up (``daemon.service.run``), before the
event loop and the data plane start: Linux threads inherit the affinity of
the thread that creates them, so the loop's thread, the NIXL worker, UCX's
threads and any thread pool created later all stay on the set. The threads
that already exist then (the interpreter's main thread, any a library
started at import) are pinned one by one. The systemd unit's
``CPUAffinity=`` does the same from outside, before exec.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Final

from daemon.startup import StartupError

ONLINE: Final = Path("/sys/devices/system/cpu/online")


def parse_cpu_list(text: str) -> frozenset[int]:
    """The CPUs of a kernel CPU list ("0-3,6", as in /sys and Cpus_allowed_list)."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        first, _, last = part.partition("-")
        low, high = int(first), int(last or first)
        if low < 0 or high < low:
            raise ValueError(f"not a CPU range: {part!r}")
        cpus.update(range(low, high + 1))
    return frozenset(cpus)


def format_cpu_list(cpus: Iterable[int]) -> str:
    """The kernel's form of a CPU set: ranges of consecutive ids ("0-3,6")."""
    parts: list[str] = []
    ordered = sorted(set(cpus))
    start = 0
    for i, cpu in enumerate(ordered):
        if i + 1 == len(ordered) or ordered[i + 1] != cpu + 1:
            first = ordered[start]
            parts.append(str(first) if first == cpu else f"{first}-{cpu}")
            start = i + 1
    return ",".join(parts)


def online_cpus() -> frozenset[int]:
    """The CPUs this machine has online (sysfs; the count of CPUs where there is none)."""
    try:
        return parse_cpu_list(ONLINE.read_text())
    except (OSError, ValueError):
        return frozenset(range(os.cpu_count() or 1))


def affinity_problem(wanted: Iterable[int], online: frozenset[int]) -> str | None:
    """Why ``wanted`` cannot be the daemon's CPUs on a machine with ``online``; None: it can."""
    missing = sorted(set(wanted) - online)
    if not missing:
        return None
    return (
        f"cpu_affinity: CPU {format_cpu_list(missing)} does not exist on this machine "
        f"(CPUs online: {format_cpu_list(online)}); name cores of this machine that the "
        f"engines do not use, or leave cpu_affinity empty to not pin the daemon"
    )


def _threads() -> list[int]:
    """The ids of this process's threads now (/proc/self/task); just this one without /proc."""
    try:
        return [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:
        return [0]


def pin(cpus: Iterable[int]) -> None:
    """Put this process's threads, and every thread they create later, on ``cpus``.

    Empty: leave the affinity alone (not pinned). Raises StartupError for a
    CPU the machine does not have, or a set the kernel refuses (a cgroup's
    cpuset that excludes it).
    """
    wanted = frozenset(cpus)
    if not wanted:
        return
    problem = affinity_problem(wanted, online_cpus())
    if problem is not None:
        raise StartupError(problem)
    for tid in _threads():
        try:
            os.sched_setaffinity(tid, wanted)
        except ProcessLookupError:
            continue  # the thread ended meanwhile
        except OSError as exc:
            raise StartupError(
                f"cpu_affinity: the kernel refused CPUs {format_cpu_list(wanted)} "
                f"({exc.strerror}); a cpuset (cgroup, container, the unit's AllowedCPUs=) "
                f"may exclude them: name CPUs the daemon is allowed to run on"
            ) from exc
