"""The tier's worker side: chunks copied between vLLM's KV cache and the daemon's pool.

Runs in each vLLM worker (vLLM's thread calls ``submit_store`` and
``submit_load``; the link's loop thread only sends what a store publishes).
Every copy is synchronous, one ``copy_`` per layer page of a block, so a
job is finished when it is submitted: a store's source blocks are read
before vLLM can reuse them, and a load's blocks are in vLLM's cache before
the step that reads them.

A store digests each slot's chunk (crc32c over the bytes as written) and
publishes slot, key and digest to the daemon (``offload_store``), which
commits them durably; the job does not wait for that: an unpublished chunk
is only a later miss. A load copies its leased slots into vLLM's blocks,
then digests each slot again: a slot that is not what was committed (a
write after the commit, a reset it missed, a daemon that lost the pool)
marks every block of the load a load error, which vLLM recomputes or fails
(``kv_load_failure_policy``), never serves. vLLM's own worker asserts
that a job succeeded, so a failed load is reported this way, not as a
failed job: ``KvpushdOffloadingConnector.get_block_ids_with_load_errors``.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Final

import crc32c
import numpy as np
import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)

from daemon.client.errors import ClientError
from daemon.client.pool import AttachedPool, attach_pool
from daemon.client.vllm.tier.geometry import ChunkGeometry, chunk_slots
from daemon.client.vllm.tier.jobs import TierLoad, TierStore
from daemon.client.vllm.tier.session import tier_link

log = logging.getLogger(f"vllm.{__name__}")


def _bytes_of(tensor: torch.Tensor) -> np.ndarray:
    """A CPU tensor's memory as numpy bytes (the tier's worker copies on the CPU only)."""
    if tensor.device.type != "cpu":
        raise ValueError(
            f"the kvpushd offload tier copies host memory; this KV cache is on {tensor.device}"
        )
    return tensor.view(torch.uint8).numpy()


# Without a pool (no daemon), a job tries to attach again at most this often.
REATTACH_EVERY_S: Final = 1.0


def digest(chunk: memoryview) -> bytes:
    """A chunk's digest as the daemon keeps it: crc32c, big-endian."""
    return crc32c.crc32c(chunk).to_bytes(4, "big")


class TierWorker(OffloadingWorker):
    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        geometry: ChunkGeometry,
        socket_path: str,
        holder: str,
        namespace: str,
    ) -> None:
        self._geometry = geometry
        # Attaching binds the holder to its namespace (schemas/rpc.py OffloadAttach).
        self._attach: Callable[[], AttachedPool] = functools.partial(
            attach_pool, socket_path, holder, namespace=namespace
        )
        self._holder = holder
        self._pool: AttachedPool | None = None
        self._memory: np.ndarray | None = None  # the whole pool's bytes
        # Across the thread boundary (both thread-safe): the link's loop sets
        # ``_pool_void`` when the daemon that granted the pool is gone (its
        # successor may hold another: a memfd dies with its daemon), and
        # hands over the pool it attached on a new connection; vLLM's thread
        # takes them at its next job, before it copies.
        self._pool_void = threading.Event()
        self._handover: queue.SimpleQueue[AttachedPool] = queue.SimpleQueue()
        # vLLM's caches as numpy views of the same memory: a numpy slice and
        # copy cost a fraction of torch's for one page (bench/tier_copy.py).
        self._tensors = [_bytes_of(canonical.tensor) for canonical in kv_caches.tensors]
        # Per group: (tensor index, page bytes, offset in a block) of each layer.
        self._layers = [
            [
                (ref.tensor_idx, ref.page_size_bytes, offset)
                for ref, offset in zip(refs, geometry.page_offsets(group), strict=True)
            ]
            for group, refs in enumerate(kv_caches.group_data_refs)
        ]
        self._finished: list[TransferResult] = []
        self._load_errors: set[int] = set()
        self._next_attach = 0.0
        try:
            pool = self._attach()
        except (ClientError, OSError) as exc:
            # vLLM serves without the tier until its daemon is up (a new connection attaches).
            log.warning("kvpushd tier: no daemon to attach to (%s): no tier until it is up", exc)
        else:
            self._install(pool, first=True)
        self._link = tier_link(socket_path, holder, self._pool_void.set, self._reattach_soon)

    # vLLM's OffloadingWorker --------------------------------------------------

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        assert isinstance(dst_spec, TierStore), dst_spec
        started = time.perf_counter()
        if not self._pool_ready():
            return self._moved_nothing(job_id)  # no pool: nothing stored, a later miss
        try:
            groups = self._copy(src_spec, dst_spec.slots.tolist(), store=True)
            digests = [
                digest(self._chunk(int(slot), groups[i])) for i, slot in enumerate(dst_spec.slots)
            ]
        except (IndexError, ValueError) as exc:  # slots of another pool than the one mapped
            log.error("kvpushd tier: a store did not fit the mapped pool, nothing stored: %s", exc)
            return self._moved_nothing(job_id)
        self._link.spawn(
            self._publish(
                dst_spec.slots.tolist(), list(dst_spec.generations), list(dst_spec.keys), digests
            )
        )
        self._finish(job_id, groups, started)
        return True

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        assert isinstance(src_spec, TierLoad), src_spec
        started = time.perf_counter()
        slots = src_spec.slots.tolist()
        if not self._pool_ready() or min(slots, default=0) < 0:
            # No pool, or a key the scheduler had no lease for.
            log.error("kvpushd tier: a load from no leased slot: its blocks are load errors")
            self._load_errors.update(int(block) for block in dst_spec.block_ids)
            return self._moved_nothing(job_id)
        try:
            groups = self._copy(dst_spec, slots, store=False)
        except (IndexError, ValueError) as exc:  # slots of another pool than the one mapped
            log.error("kvpushd tier: a load did not fit the mapped pool, load errors: %s", exc)
            self._load_errors.update(int(block) for block in dst_spec.block_ids)
            return self._moved_nothing(job_id)
        for i, slot in enumerate(slots):
            if digest(self._chunk(slot, groups[i])) != src_spec.digests[i]:
                # Never handed out again: the daemon takes it out of its index.
                self._link.spawn(self._condemn(slot, src_spec.generations[i]))
                self._load_errors.update(int(block) for block in dst_spec.block_ids)
                log.error(
                    "kvpushd tier: slot %d (generation %d) is not the chunk committed "
                    "there: the load's %d blocks are reported load errors, not served",
                    slot,
                    src_spec.generations[i],
                    len(dst_spec.block_ids),
                )
                break
        self._finish(job_id, groups, started)
        return True

    def get_finished(self) -> list[TransferResult]:
        finished, self._finished = self._finished, []
        return finished

    def wait(self, job_ids: set[int]) -> None:
        return None  # every job finished when it was submitted

    def shutdown(self) -> None:
        self._link.close()
        self._drop_pool()

    # what the connector asks --------------------------------------------------

    def take_load_errors(self) -> set[int]:
        """The blocks of loads whose slots were not what was committed, since the last call."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    # the pool -----------------------------------------------------------------

    def _pool_ready(self) -> bool:
        """Whether a pool is mapped, after taking what the loop handed over (vLLM's thread)."""
        handed = None
        while not self._handover.empty():
            if handed is not None:
                handed.close()
            handed = self._handover.get_nowait()
        if handed is not None:
            self._pool_void.clear()
            self._install(handed)
        elif self._pool_void.is_set() or self._pool is None:
            now = time.monotonic()
            if now >= self._next_attach:
                self._next_attach = now + REATTACH_EVERY_S
                self._pool_void.clear()
                try:
                    self._install(self._attach())
                except Exception as exc:  # no daemon now: a new connection attaches
                    self._drop_pool()
                    log.warning("kvpushd tier: no pool to attach to: %s", exc)
        return self._pool is not None and not self._pool_void.is_set()

    async def _reattach_soon(self) -> None:
        """On the loop, on every new connection: attach (binding the namespace) for the next job."""
        try:
            pool = await asyncio.to_thread(self._attach)
        except Exception as exc:  # the next job tries again
            log.warning("kvpushd tier: attaching the pool on a new connection: %s", exc)
            return
        self._handover.put(pool)

    def _install(self, pool: AttachedPool, first: bool = False) -> None:
        """Map ``pool`` in place of the one before.

        A pool whose slots are too small for this engine's chunks stops vLLM
        at start-up; met later (a daemon restarted with another config), the
        tier is off for this engine until a pool fits.
        """
        self._drop_pool()
        try:
            self._geometry.check_fits(pool.slot_bytes)
        except ValueError as exc:
            pool.close()
            if first:
                raise
            log.error("kvpushd tier: %s", exc)
            return
        self._memory = np.frombuffer(pool.memory, dtype=np.uint8)
        self._pool = pool
        log.info(
            "kvpushd tier: %s attached to the pool %s (%d slots of %d bytes)",
            self._holder,
            pool.pool_id,
            pool.slots,
            pool.slot_bytes,
        )

    def _drop_pool(self) -> None:
        old, self._pool, self._memory = self._pool, None, None
        if old is not None:
            old.close()

    # copies -------------------------------------------------------------------

    def _pairs(self, spec: GPULoadStoreSpec) -> Iterator[tuple[int, int, int, int]]:
        """(group, vLLM block, slot index, block within its chunk) of every block of a job."""
        per_chunk = self._geometry.blocks_per_chunk
        at, chunks = 0, 0
        spans = zip(spec.group_sizes, spec.block_indices, strict=True)
        for group, (count, first) in enumerate(spans):
            if count == 0:
                continue
            places = chunk_slots(int(first), int(count), per_chunk)
            for i, (chunk, within) in enumerate(places):
                yield group, int(spec.block_ids[at + i]), chunks + chunk, within
            at += count
            chunks += places[-1][0] + 1

    def _copy(self, spec: GPULoadStoreSpec, slots: list[int], *, store: bool) -> dict[int, int]:
        """Copy every page of the job; returns each slot index's group."""
        groups: dict[int, int] = {}
        for group, block, index, within in self._pairs(spec):
            groups[index] = group
            slot = self._slot(slots[index])
            base = within * self._geometry.block_bytes(group)
            for tensor, page, offset in self._layers[group]:
                mine = slot[base + offset : base + offset + page]
                theirs = self._tensors[tensor][block, :page]
                if store:
                    mine[:] = theirs
                else:
                    theirs[:] = mine
        if len(groups) != len(slots):
            raise ValueError(f"a job of {len(slots)} slots filled {len(groups)}")
        return groups

    def _slot(self, slot: int) -> np.ndarray:
        assert self._pool is not None and self._memory is not None
        start = self._pool.offset(slot)
        return self._memory[start : start + self._pool.slot_bytes]

    def _chunk(self, slot: int, group: int) -> memoryview:
        assert self._pool is not None
        return memoryview(self._pool.view(slot)[: self._geometry.chunk_bytes(group)])

    def _moved_nothing(self, job_id: int) -> bool:
        """End a job that copied nothing (vLLM takes no failed job: what failed is said apart)."""
        self._finished.append(TransferResult(job_id, True, 0, 0.0))
        return True

    def _finish(self, job_id: int, groups: dict[int, int], started: float) -> None:
        size = sum(self._geometry.chunk_bytes(group) for group in groups.values())
        elapsed = time.perf_counter() - started
        self._finished.append(TransferResult(job_id, True, size, elapsed))

    async def _condemn(self, slot: int, generation: int) -> None:
        try:
            await self._link.client().offload_condemn(self._holder, [slot], [generation])
        except Exception as exc:  # found again, it fails its digest again and is reported again
            log.warning("kvpushd tier: slot %d not reported bad: %s", slot, exc)

    async def _publish(
        self, slots: list[int], generations: list[int], keys: list[bytes], digests: list[bytes]
    ) -> None:
        """On the loop: the daemon commits what the store wrote (or keeps an earlier commit)."""
        try:
            await self._link.client().offload_store(
                self._holder, "", slots, generations, keys, digests
            )
        except Exception as exc:  # a refusal or a lost daemon: a later miss, nothing worse
            log.warning("kvpushd tier: %d stored chunks not published: %s", len(slots), exc)
