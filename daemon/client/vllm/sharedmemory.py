"""The one region a vLLM worker shares with its daemon, held for the process's life.

``kv_memory = "descriptor"`` (the default): a sealed memfd
(daemon/client/memfd.py) that the link passes with every Hello, so a
restarted daemon maps it again; no file anywhere, nothing to sweep, no
dependence on /dev/shm's size. ``kv_memory = "file"``: a named /dev/shm file,
locked by this process (daemon/client/kvfile.py), for a daemon from before
descriptors. Either holds vLLM's cache itself (``kv_buffer = "shared"``) or
host staging's mirror of it (``kv_buffer = "host"``).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Final

import torch

from daemon.client.kvfile import create_kv_file
from daemon.client.memfd import create_kv_memfd
from schemas.kvlayout import RegionSpec, SharedAs

SHM_DIR: Final = "/dev/shm"
SHM_PREFIX: Final = "kvpushd-vllm-"
DESCRIPTOR: Final = SharedAs.DESCRIPTOR
FILE: Final = SharedAs.FILE
KV_MEMORIES: Final = (DESCRIPTOR, FILE)


def kv_memory(setting: object) -> str:
    """The connector's ``kv_memory``: how the daemon gets the memory (a descriptor by default)."""
    if setting is None or setting == "":
        return DESCRIPTOR
    if setting not in KV_MEMORIES:
        raise ValueError(
            f"KvpushdConnector: kv_memory = {setting!r}; choose one of {', '.join(KV_MEMORIES)}"
        )
    return str(setting)


class SharedMemory:
    """The one region this engine shares with its daemon, held for the process's life.

    By descriptor: a sealed memfd (daemon/client/memfd.py), which the link
    passes with every Hello, so a restarted daemon maps it again. By file:
    ``path``, locked by this process (daemon/client/kvfile.py) and removed
    at close.
    """

    def __init__(self, how: str, path: Path) -> None:
        self.how = how
        self.path = path  # the file's (by file), or the memfd's name (by descriptor)
        self.fd: int | None = None  # the memfd, or the descriptor holding the file's lock
        self.size = 0

    def tensor(self, size: int) -> torch.Tensor:
        """Make the memory (once) and view it as ``size`` int8s, shared with the daemon."""
        assert self.fd is None, "the shared memory is made once"
        if self.how == DESCRIPTOR:
            self.fd = create_kv_memfd(self.path.name, size)
            # Opening the descriptor's /proc link maps the memfd itself.
            where = f"/proc/self/fd/{self.fd}"
        else:
            self.fd = create_kv_file(self.path, size)
            where = str(self.path)
        self.size = size
        return torch.from_file(where, shared=True, size=size, dtype=torch.int8)

    @property
    def descriptors(self) -> tuple[int, ...]:
        """What the link passes with each Hello."""
        return (self.fd,) if self.how == DESCRIPTOR and self.fd is not None else ()

    def where(self) -> str:
        """Where the memory is, for a log line."""
        if self.how == DESCRIPTOR:
            return f"a sealed memfd ({self.path.name}) passed by descriptor"
        return str(self.path)

    def region(self) -> RegionSpec:
        """How the registration names the memory: descriptor 0, or the file's path."""
        if self.how == DESCRIPTOR:
            return RegionSpec("kv", self.size, descriptor=0)
        return RegionSpec("kv", self.size, path=str(self.path))

    def close(self) -> None:
        if self.how == FILE:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
