"""Host staging: vLLM's KV cache stays where vLLM put it; the daemon sees a host mirror.

With ``kv_buffer = "host"`` (the connector's extra config; the only mode
for a cache on a GPU), vLLM allocates its KV cache as it always does, and
the connector keeps a *mirror* of it in memory the daemon maps (a memfd
passed by descriptor, or a /dev/shm file: daemon/client/vllm/sharedmemory.py):
every storage vLLM's layer tensors view, byte for byte, at the same offsets.
Block ``b`` of a layer is then at the same place in the mirror as in the
cache, so the block ids vLLM hands the connector name the mirror's blocks
too, and the daemon, its trim, quarantine and checksums work on the mirror
unchanged.

- A prefill copies a finished request's blocks cache -> mirror before it
  registers the push (:meth:`Staging.copy_out`);
- a decode copies a landed load's blocks mirror -> cache before it reports
  the load finished (:meth:`Staging.copy_in`).

Copies are batched: one call per step, every request's blocks merged into
runs of consecutive ids. Two ways to move them (:data:`RUNS`, :data:`GATHER`):
one copy per (layer, run), or, where the runs are short, one gather per
layer (``index_select`` then ``index_copy_``): on a GPU, a copy per 64 KiB
block is bound by its launch, not by the bus (bench/RESULTS.md, "Direct VRAM
and host staging's copies on an H200"), while a gather is one kernel that
reads or writes the pinned mirror through its device mapping. On a GPU the
copies go on a side stream and end in an event (:class:`Copy`), so vLLM's
step never waits on them; on a CPU cache (what this machine runs, and what
the real-vLLM tests prove the bookkeeping with) the same code copies at
once, and the copy's cost is the staging's whole cost.

:func:`block_major` also serves the shared mode: it finds the block dimension
of vLLM's layer tensors for both.

This module imports torch and never vLLM (daemon/client/vllm/worker.py drives it).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from daemon.client.kvfile import KvFileError
from daemon.client.vllm.sharedmemory import SharedMemory

# Under vLLM's logger tree: vLLM prints only that tree (its "vllm" logger
# does not propagate), so the connector's lines reach vLLM's log this way.
log = logging.getLogger(f"vllm.{__name__}")

SHARED = "shared"  # vLLM's CPU cache is itself the /dev/shm file the daemon maps
HOST = "host"  # vLLM's cache is its own; the daemon maps a host mirror of it
KV_BUFFERS = (SHARED, HOST)
# Each storage's copy starts at a multiple of this in the mirror file.
_ALIGN = 4096
# How a step's blocks move: a copy per run of consecutive ids, or a gather per layer.
RUNS = "runs"
GATHER = "gather"
# AUTO gathers a group's blocks on a GPU when its runs average fewer blocks than this.
AUTO = "auto"
GATHER_BELOW_RUN = 8
# A gather stages its blocks in a temporary on the cache's device: at most this
# many bytes a layer at a time, so a long prompt's step never asks vLLM's GPU
# (most of it vLLM's cache) for one large allocation.
GATHER_CHUNK_BYTES = 16 << 20
# cudaHostRegister flags: usable from every context, and mapped into the GPU's
# address space (the gather's kernels address the mirror there).
_HOST_REGISTER_PORTABLE_MAPPED = 0x01 | 0x02

Blocks = Sequence[Sequence[int]]  # block ids per KV cache group


class StagingError(RuntimeError):
    """The mirror cannot be made (no room in /dev/shm, a layout it cannot copy)."""


def kv_buffer(setting: object, device_type: str) -> str:
    """The connector's ``kv_buffer`` mode: the setting's, else by where vLLM's cache lives."""
    if setting is None or setting == "":
        if device_type == "cpu":
            return SHARED
        log.info(
            "kvpushd: host staging (kv_buffer = 'host'), chosen because vLLM's KV cache is on "
            "%s: this connector hands the daemon host memory only, so the daemon maps a host "
            "mirror and each push and load copies its blocks through it",
            device_type,
        )
        return HOST
    if setting not in KV_BUFFERS:
        raise ValueError(
            f"KvpushdConnector: kv_buffer = {setting!r}; choose one of {', '.join(KV_BUFFERS)}"
        )
    if setting == SHARED and device_type != "cpu":
        raise ValueError(
            f"KvpushdConnector: kv_buffer = 'shared' needs vLLM's KV cache in host memory, and "
            f"it is on {device_type}: use kv_buffer = 'host' (host staging)"
        )
    return str(setting)


def block_major(
    kv_caches: dict[str, torch.Tensor], num_blocks: int | None
) -> tuple[dict[str, torch.Tensor], dict[str, tuple[str, ...]]]:
    """vLLM's layer tensors as views whose first dimension is the block, and each layer's parts.

    vLLM's CPU attention lays a layer out ``[blocks, ...]``: one part, the
    layer itself. GPU backends such as FlashAttention lay it out
    ``[2, blocks, ...]`` (all keys, then all values): its keys and its
    values are then two layers for the daemon (``<name>/k``, ``<name>/v``),
    each block-major. Any other shape is refused, never guessed.
    """
    views: dict[str, torch.Tensor] = {}
    parts: dict[str, tuple[str, ...]] = {}
    for name, tensor in kv_caches.items():
        if num_blocks is None or tensor.shape[0] == num_blocks:
            views[name] = tensor
            parts[name] = (name,)
        elif tensor.dim() > 2 and tensor.shape[0] == 2 and tensor.shape[1] == num_blocks:
            views[f"{name}/k"], views[f"{name}/v"] = tensor[0], tensor[1]
            parts[name] = (f"{name}/k", f"{name}/v")
        else:
            raise ValueError(
                f"KvpushdConnector: layer {name}'s KV cache has shape {tuple(tensor.shape)}; "
                f"neither [{num_blocks} blocks, ...] nor [2, {num_blocks} blocks, ...]"
            )
    return views, parts


@dataclass
class Copy:
    """One batched copy: done at once on a CPU, or when its CUDA event has completed."""

    event: Any = None  # torch.cuda.Event, or None for a copy already done
    nbytes: int = 0  # what it copies, for the connector's stats

    def done(self) -> bool:
        return self.event is None or bool(self.event.query())

    def wait(self) -> None:
        """Block until the copy completed (call it off vLLM's step, e.g. in a thread)."""
        if self.event is not None:
            self.event.synchronize()


class _Mapped:
    """Pinned host bytes as the GPU addresses them: enough of CUDA's array interface for torch."""

    def __init__(self, address: int, nbytes: int) -> None:
        # Registered host memory has the same address on the GPU where the
        # device can use host pointers (every x86-64 Linux GPU of these years).
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|i1",
            "data": (address, False),
            "version": 3,
            "strides": None,
        }


def runs(ids: Iterable[int]) -> list[tuple[int, int]]:
    """Sorted distinct ids as [first, end) runs of consecutive ids."""
    out: list[tuple[int, int]] = []
    for block in sorted(set(ids)):
        if out and out[-1][1] == block:
            out[-1] = (out[-1][0], block + 1)
        else:
            out.append((block, block + 1))
    return out


class Staging:
    """vLLM's layer tensors (``cache``) and their views in the host mirror (``mirror``).

    ``groups``: each KV cache group's layer names, in group order (block ids
    come per group).
    """

    def __init__(
        self,
        cache: dict[str, torch.Tensor],
        mirror: dict[str, torch.Tensor],
        groups: Sequence[Sequence[str]],
        buffer: torch.Tensor,
        copies: str = AUTO,
    ) -> None:
        self.cache = cache
        self.mirror = mirror
        self.groups = [list(names) for names in groups]
        self.buffer = buffer  # the whole mirror, int8
        self.copies = copies
        self._cuda = any(t.device.type == "cuda" for t in cache.values())
        self._stream = torch.cuda.Stream() if self._cuda else None
        self._pinned = False
        # The mirror as the cache's device addresses it (the gather's side of it).
        self._mirror_here: dict[str, torch.Tensor] = mirror

    @classmethod
    def create(
        cls,
        cache: dict[str, torch.Tensor],
        groups: Sequence[Sequence[str]],
        memory: SharedMemory,
        copies: str = AUTO,
    ) -> Staging:
        """Make the mirror in ``memory``: each storage the layers view, back to back."""
        if copies not in (AUTO, RUNS, GATHER):
            raise StagingError(f"KvpushdConnector: copies must be {AUTO}, {RUNS} or {GATHER}")
        storages: dict[int, tuple[int, int]] = {}  # data_ptr -> (offset in the file, nbytes)
        size = 0
        for tensor in cache.values():
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in storages:
                size += -size % _ALIGN
                storages[storage.data_ptr()] = (size, storage.nbytes())
                size += storage.nbytes()
        if not storages:
            raise StagingError("KvpushdConnector: vLLM registered no KV cache to stage")
        try:
            buffer = memory.tensor(size)
        except (KvFileError, OSError) as exc:
            raise StagingError(
                f"KvpushdConnector: host staging needs a mirror as large as vLLM's KV cache "
                f"storages: {exc}"
            ) from exc
        mirror = {}
        for name, tensor in cache.items():
            offset, nbytes = storages[tensor.untyped_storage().data_ptr()]
            flat = buffer[offset : offset + nbytes].view(tensor.dtype)
            # as_strided's offset counts from the start of the whole file's
            # storage, not from this slice: the storage's own place goes in.
            start = offset // tensor.element_size() + tensor.storage_offset()
            mirror[name] = flat.as_strided(tensor.shape, tensor.stride(), start)
        staging = cls(cache, mirror, groups, buffer, copies)
        staging._pin()
        log.info(
            "kvpushd: host staging: a %d-byte mirror of %d KV storage(s) on %s in %s%s",
            size,
            len(storages),
            next(iter(cache.values())).device,
            memory.where(),
            " (pinned)" if staging._pinned else "",
        )
        return staging

    def _pin(self) -> None:
        """Page-lock the mirror for asynchronous GPU copies (CUDA only)."""
        if not self._cuda:
            return
        ptr, size = self.buffer.data_ptr(), self.buffer.numel()
        err = torch.cuda.cudart().cudaHostRegister(ptr, size, _HOST_REGISTER_PORTABLE_MAPPED)
        if int(err) != 0:
            raise StagingError(
                f"KvpushdConnector: cannot pin the {size}-byte host mirror (cudaHostRegister "
                f"error {int(err)}): raise the locked-memory limit (ulimit -l) for vLLM"
            )
        self._pinned = True
        try:
            self._mirror_here = self._mirror_on_gpu(ptr, size)
        except (RuntimeError, TypeError, ValueError) as exc:
            # Then the gather cannot address the mirror; copies per run still can.
            log.warning(
                "kvpushd: host staging: the GPU cannot address the pinned mirror (%s);"
                " blocks move by a copy per run",
                exc,
            )
            self.copies = RUNS

    def _mirror_on_gpu(self, ptr: int, size: int) -> dict[str, torch.Tensor]:
        device = next(t.device for t in self.cache.values() if t.device.type == "cuda")
        flat = torch.as_tensor(_Mapped(ptr, size), device=device)
        return {
            # Same dtype, shape, strides and offset from the file's start as the
            # host view: the same bytes, addressed from the GPU.
            name: flat[: size - size % view.element_size()]
            .view(view.dtype)
            .as_strided(view.shape, view.stride(), view.storage_offset())
            for name, view in self.mirror.items()
        }

    def copy_out(self, requests: Sequence[Blocks]) -> Copy:
        """Cache -> mirror: the blocks of every request in ``requests`` (a prefill's step)."""
        return self._copy(requests, self._mirror_here, self.cache, wait_for_compute=True)

    def copy_in(self, requests: Sequence[Blocks]) -> Copy:
        """Mirror -> cache: the blocks of every load in ``requests`` (a decode's step)."""
        return self._copy(requests, self.cache, self._mirror_here, wait_for_compute=False)

    def _copy(
        self,
        requests: Sequence[Blocks],
        into: dict[str, torch.Tensor],
        out_of: dict[str, torch.Tensor],
        *,
        wait_for_compute: bool,
    ) -> Copy:
        per_group = [
            runs(b for blocks in requests if g < len(blocks) for b in blocks[g])
            for g in range(len(self.groups))
        ]
        if self._stream is None:
            return Copy(nbytes=self._copy_runs(per_group, into, out_of))
        if wait_for_compute:
            # The forward that wrote the blocks was queued on vLLM's stream.
            self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream):
            nbytes = self._copy_runs(per_group, into, out_of, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        return Copy(event, nbytes)

    def _copy_runs(
        self,
        per_group: list[list[tuple[int, int]]],
        into: dict[str, torch.Tensor],
        out_of: dict[str, torch.Tensor],
        *,
        non_blocking: bool = False,
    ) -> int:
        nbytes = 0
        for names, group_runs in zip(self.groups, per_group, strict=True):
            if not group_runs or not names:
                continue
            if self._gathers(group_runs):
                nbytes += self._gather(names, group_runs, into, out_of)
                continue
            for name in names:
                target, source = into[name], out_of[name]
                for first, end in group_runs:
                    run = target[first:end]
                    run.copy_(source[first:end], non_blocking=non_blocking)
                    nbytes += run.nbytes
        return nbytes

    def _gather(
        self,
        names: list[str],
        group_runs: list[tuple[int, int]],
        into: dict[str, torch.Tensor],
        out_of: dict[str, torch.Tensor],
    ) -> int:
        ids = [b for first, end in group_runs for b in range(first, end)]
        index = torch.tensor(ids, device=into[names[0]].device)
        nbytes = 0
        for name in names:
            target, source = into[name], out_of[name]
            block = target[0].nbytes
            step = max(1, GATHER_CHUNK_BYTES // block)
            for at in range(0, len(ids), step):
                chunk = index[at : at + step]
                target.index_copy_(0, chunk, source.index_select(0, chunk))
            nbytes += len(ids) * block
        return nbytes

    def _gathers(self, group_runs: list[tuple[int, int]]) -> bool:
        if self.copies != AUTO:
            return self.copies == GATHER
        if not self._cuda:
            return False  # a CPU copy has no launch to save
        blocks = sum(end - first for first, end in group_runs)
        return blocks < GATHER_BELOW_RUN * len(group_runs)

    def close(self) -> None:
        if self._pinned:
            torch.cuda.cudart().cudaHostUnregister(self.buffer.data_ptr())
            self._pinned = False
