"""Waiting on real processes: a condition polled off the loop, a process's state."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


async def wait_until(what: str, check: Callable[[], Any], timeout: float = 15.0) -> Any:
    """``check()``'s first truthy value, polled in a thread; AssertionError after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := await asyncio.to_thread(check):
            return value
        await asyncio.sleep(0.02)
    raise AssertionError(f"not within {timeout} s: {what}")


def is_stopped(pid: int) -> bool:
    """Whether the process is stopped (SIGSTOP, or a ``stop`` failpoint)."""
    # /proc/PID/stat: the state letter follows the command name in parentheses.
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"
