"""The connector's worker side: vLLM's KV memory, and each step's pushes and loads (vLLM's thread).

Every field here is vLLM's thread's. The worker registers vLLM's memory
with the daemon (daemon/client/vllm/memory.py), turns each step's
metadata into daemon calls handed to the link's loop thread
(daemon/client/vllm/calls.py), on the engines and shares ``RankPlan``
names (daemon/client/vllm/shares.py), and each step takes what came back
from the daemon to say which sends and loads are over (a load ends all
at once: daemon/client/vllm/loads.py). With host staging, blocks go
through a host mirror (daemon/client/vllm/staging.py) on the way out
and in.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import time
from pathlib import Path

import torch

from daemon import failpoints
from daemon.client.kvfile import sweep_stale_kv_files
from daemon.client.vllm import stats as vs
from daemon.client.vllm.calls import DaemonCalls
from daemon.client.vllm.kvcheck import KvCheckSettings, LoadChecks
from daemon.client.vllm.layout import rank_fingerprint
from daemon.client.vllm.loads import Load
from daemon.client.vllm.memory import (
    SharedAllocation,
    check_memory,
    in_model_order,
    layout,
    memory_note,
)
from daemon.client.vllm.metadata import KvpushdConnectorMetadata
from daemon.client.vllm.sharedmemory import DESCRIPTOR, FILE, SHM_DIR, SHM_PREFIX, SharedMemory
from daemon.client.vllm.shares import RankPlan
from daemon.client.vllm.specs import (
    MAX_SEEN,
    Blocks,
    DaemonLost,
    Freed,
    GaveUp,
    ReceiveSpec,
    WorkerEvent,
    outcome,
)
from daemon.client.vllm.staging import SHARED, Copy, Staging, StagingError, block_major
from schemas import rpc
from schemas.fingerprint import Fingerprint
from statemachine.ranks import UnmappableRanks

log = logging.getLogger(f"vllm.{__name__}")


class WorkerSide:
    def __init__(
        self,
        socket_path: str,
        engine_id: str,
        fingerprint: Fingerprint,
        rank: int = 0,
        tp_size: int = 1,
        stage: int = 0,
        pp_size: int = 1,
        *,
        group_layers: tuple[tuple[str, ...], ...] | None = None,
        buffer: str = SHARED,
        memory: str = DESCRIPTOR,
        num_blocks: int | None = None,
        states: tuple[bool, ...] = (False,),
        kv_check: KvCheckSettings | None = None,
    ) -> None:
        # Checking loads by behaviour (daemon/client/vllm/kvcheck.py): how,
        # and the checks under way once vLLM's memory is known (None: off).
        self._kv_check = kv_check
        self._checks: LoadChecks | None = None
        # Which KV cache groups hold recurrent state (Mamba/SSM), in group order.
        self._states = states
        # vLLM's block count (None: not told), to find each tensor's block dimension.
        self._num_blocks = num_blocks
        # Where the daemon reads and writes: vLLM's cache itself (shared), or
        # a host mirror of it (host staging, daemon/client/vllm/staging.py).
        self.buffer = buffer
        self._staging: Staging | None = None
        # Landed loads whose blocks still go mirror -> cache, and the copies
        # under way with the loads they end.
        self._to_stage_in: list[Load] = []
        self._staging_in: list[tuple[Copy, list[str]]] = []
        # The layer names of each KV cache group (None: every layer, one group).
        self._group_layers = group_layers
        # The engine's fingerprint names the heads and layers this rank holds.
        own = rank_fingerprint(fingerprint, rank, stage)
        self._stage, self._pp_size = stage, pp_size
        self._plan = RankPlan(
            engine_id,
            fingerprint,
            own,
            rank,
            tp_size,
            stage,
            pp_size,
            corrupts=failpoints.corrupts,
        )
        if memory == FILE:
            sweep_stale_kv_files(Path(SHM_DIR), SHM_PREFIX)
        # The pid in the name tells an operator whose memory it is (in
        # /proc/PID/fd for a memfd; the sweep goes by a file's owner's lock,
        # daemon/client/kvfile.py).
        self._memory = SharedMemory(
            memory, Path(SHM_DIR) / f"{SHM_PREFIX}{os.getpid()}-{engine_id}"
        )
        self._allocation: SharedAllocation | None = None
        # What the daemon says, and the connector's own word on the link's
        # loop thread (GaveUp, Freed, DaemonLost), in order: drained each step.
        self._events: queue.SimpleQueue[WorkerEvent] = queue.SimpleQueue()
        # Daemon request (a share of a push) -> (vLLM request id, generation),
        # and each pushing request's shares not over yet.
        self._sending: dict[str, tuple[str, int]] = {}
        self._pushes: dict[str, set[str]] = {}
        # Daemon request (a prefill rank's share) -> the load it is part of.
        self._receiving: dict[str, Load] = {}
        self._done_sending: set[str] = set()
        self._done_receiving: set[str] = set()
        # Finished request ids remembered until their send ends (pruned past MAX_SEEN).
        self._finished_seen: set[str] = set()
        # Loads that ended without their KV (vLLM recomputes or fails them).
        self._failed_loads: set[str] = set()
        # Bytes of one block of each group, over all its layers (for the stats).
        self._group_nbytes: tuple[int, ...] = ()
        self.stats = vs.KvpushdStats()
        self._calls = DaemonCalls(
            socket_path,
            engine_id,
            own,
            self._events,
            lambda t: t in self._sending or t in self._receiving,
        )
        self._link = self._calls.link

    # memory -------------------------------------------------------------

    def shared_allocation(self) -> SharedAllocation:
        self._allocation = SharedAllocation(self._memory)
        return self._allocation

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        allocation = self._allocation
        check_memory(kv_caches, self.buffer, allocation, self._states)
        kv_caches, layer_ids = in_model_order(
            kv_caches, self._group_layers, self._plan.own, self._stage, self._pp_size
        )
        kv_caches, parts = block_major(kv_caches, self._num_blocks)
        if self._kv_check is not None:
            # vLLM's own cache, not a staging mirror: what the forward reads and writes.
            names = self._group_layers or (tuple(parts),)
            self._checks = LoadChecks.over(kv_caches, parts, names, self._kv_check)
        if any(len(names) > 1 for names in parts.values()):
            # Keys and values are layers of their own: a layer slice is no run of them.
            layer_ids = None
        group_layers = tuple(
            tuple(part for name in names for part in parts[name])
            for names in self._group_layers or (tuple(parts),)
        )
        if self.buffer == SHARED:
            assert allocation is not None and allocation.buffer is not None
            buffer = allocation.buffer
        else:
            try:
                self._staging = Staging.create(kv_caches, group_layers, self._memory)
            except StagingError as exc:
                raise RuntimeError(str(exc)) from exc
            # The daemon sees the mirror: same shapes, same offsets, its own file.
            kv_caches, buffer = self._staging.mirror, self._staging.buffer
        groups = layout(kv_caches, group_layers, buffer, self._states)
        region = self._memory.region()  # the buffer's memory, named for the daemon
        own = self._plan.own
        held = own.kv_head_range[1] - own.kv_head_range[0]
        head_major = all(t.dim() == 4 and t.shape[1] == held for t in kv_caches.values())
        self._plan.registered(groups, layer_ids, head_major)
        self._group_nbytes = tuple(group.block_bytes * len(group.layers) for group in groups)
        device = next(iter(self._staging.cache.values())).device if self._staging else "cpu"
        note = memory_note(self.buffer, self._memory, str(device))
        self._calls.registered(groups, region, self._memory.descriptors, note)
        # The memory lives as long as vLLM: a restarted daemon maps it again
        # when the connector registers anew (a memfd goes with each Hello).
        self._link.start()

    # per step -----------------------------------------------------------

    def post(self, metadata: KvpushdConnectorMetadata) -> None:
        generation = self._link.generation
        # Host staging: this step's finished prefills' blocks go to the
        # mirror in one batch, and each push waits for it before it registers.
        staged = Copy()
        if self._staging is not None and metadata.push:
            staged = self._staging.copy_out([push.block_ids for push in metadata.push])
            self.stats.staged("out", staged.nbytes)
        for push in metadata.push:
            shares = self._plan.shares(push)
            if any(share.transfer_id in self._sending for share in shares):
                # Another live request pushes this transfer (the scheduler
                # lets only one; this guards its bounded memory): this one
                # pushes nothing, and the other's bookkeeping stays whole.
                log.warning(
                    "kvpushd: %s: transfer %s is already pushed by another request",
                    push.request_id,
                    push.transfer_id,
                )
                shares = []
            if not shares:
                # A replica no decode rank reads from: nothing reads its blocks.
                self._done_sending.add(push.request_id)
                continue
            self._pushes[push.request_id] = {share.transfer_id for share in shares}
            for share in shares:
                self._sending[share.transfer_id] = (push.request_id, generation)
                self._link.spawn(self._calls.push(share, generation, staged))
        for receive in metadata.receive:
            self._start_load(receive, generation)
        if metadata.abort:
            self.abort(metadata.abort)
        for forgone in metadata.forgo:
            for receiver in self._plan.forgone(forgone):
                self._link.spawn(self._calls.forgo(receiver, generation))
        for queued in metadata.hold:
            self._hold_all(queued)
        for unpushed in metadata.unpushed:
            for share in self._plan.shares(unpushed):
                self._link.spawn(self._calls.announce(share))
        for request_id in metadata.unloaded:  # registered nothing: failed
            self._failed_loads.add(request_id)
            self._done_receiving.add(request_id)

    def _start_load(self, receive: ReceiveSpec, generation: int) -> None:
        """Register one receiver per prefill rank that feeds this rank's blocks."""
        try:
            sources = self._plan.sources(receive)
        except UnmappableRanks as exc:
            # The scheduler pairs only instances whose ranks map; this rank
            # cannot (its cache is not head-major, or its layers carry no
            # index): nothing is registered, so no write can reach the
            # blocks, and the load ends failed.
            log.warning("kvpushd: %s: %s", receive.request_id, exc)
            self._load_nothing(receive)
            return
        first = receive.block_ids[0] if receive.block_ids else ()
        if len(first) > 1 and failpoints.corrupts("connector.reverse_group"):
            # The negative control: the first group's KV lands misplaced (its
            # blocks named in reverse: each hash then names another's block).
            receive = dataclasses.replace(receive, block_ids=(first[::-1], *receive.block_ids[1:]))
        receive = self._maybe_swap_states(receive)
        # The negative control's planted mis-mapping: each prefill rank's
        # receiver on the next rank's head slice (the daemon must refuse it).
        sliced = any(source.heads.slices > 1 for source in sources)
        swap = sliced and failpoints.corrupts("connector.swap_slices")
        shares = [self._plan.receiver(receive, source, swap=swap) for source in sources]
        if any(share.transfer_id in self._receiving for share in shares):
            # Another request loads this transfer (the scheduler lets only
            # one claim it; this guards its bounded memory): this one
            # registers nothing, so no write can reach its blocks, and its
            # load ends now, failed.
            log.warning(
                "kvpushd: %s: transfer %s is already loading for another request",
                receive.request_id,
                receive.transfer_id,
            )
            self._load_nothing(receive)
            return
        load = Load(
            receive.request_id,
            receive.block_ids,
            self._nbytes(receive.block_ids),
            generation,
            time.monotonic(),
            tuple(share.transfer_id for share in shares),
        )
        if self._checks is not None:
            self._checks.plan_load(receive, load.shares)
        for share in shares:
            self._receiving[share.transfer_id] = load
            self._link.spawn(self._calls.receive(share, generation))
        for unread in self._plan.unread(receive):
            self._link.spawn(self._calls.forgo(unread, generation))

    def _maybe_swap_states(self, receive: ReceiveSpec) -> ReceiveSpec:
        """The negative control for recurrent state: two layers' states land in each other's blocks.

        State blocks carry no token hash, so nothing but the tokens can tell.
        """
        blocks = list(receive.block_ids)
        held = [g for g, state in enumerate(self._states[: len(blocks)]) if state and blocks[g]]
        if len(held) < 2 or not failpoints.corrupts("connector.swap_states"):
            return receive
        a, b = held[:2]
        blocks[a], blocks[b] = blocks[b], blocks[a]
        return dataclasses.replace(receive, block_ids=tuple(blocks))

    def _load_nothing(self, receive: ReceiveSpec) -> None:
        """End a load that registered nothing: it failed (vLLM recomputes or fails it)."""
        self._failed_loads.add(receive.request_id)
        self._done_receiving.add(receive.request_id)

    def _hold_all(self, queued: ReceiveSpec) -> None:
        """Hold the push of every prefill rank this rank will load from (best effort).

        A hold that does not arrive costs nothing worse than before holds:
        the push ends at its deadline and this instance computes the prompt.
        """
        try:
            sources = self._plan.sources(queued)
        except UnmappableRanks:
            return
        for source in sources:
            self._link.spawn(self._calls.hold(self._plan.receiver(queued, source)))

    def _nbytes(self, block_ids: Blocks) -> int:
        """The KV bytes of these blocks, over all their groups' layers."""
        return sum(len(ids) * n for ids, n in zip(block_ids, self._group_nbytes, strict=False))

    def finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str], set[str]]:
        """(Sends over, loads over, the loads of those that failed.)"""
        self._finished_seen.update(finished_req_ids)
        if len(self._finished_seen) > MAX_SEEN:
            # Only sends wait for vLLM to name them finished: forget the others.
            pending = {request_id for request_id, _ in self._sending.values()}
            self._finished_seen &= pending | self._done_sending
        while True:
            try:
                event = self._events.get_nowait()
            except queue.Empty:
                break
            self._on_event(event)
        if self._staging is not None:
            self._stage_in()
        sending = {r for r in self._done_sending if r in self._finished_seen}
        self._done_sending -= sending
        self._finished_seen -= sending
        receiving, self._done_receiving = self._done_receiving, set()
        # A failed load is finished too (every one is in ``receiving``):
        # vLLM ends its wait on both sets.
        failed, self._failed_loads = self._failed_loads, set()
        if self._checks is not None and receiving:
            # Before vLLM hears the load is over, so before any forward reads it.
            self._checks.landed(receiving, failed)
        return sending, receiving, failed

    def check_loads(self, metadata: KvpushdConnectorMetadata) -> None:
        """After the forward: compare the K/V it computed over loaded KV with the pushed.

        A disagreement (the KV is not this engine's) is a load error for
        vLLM (``load_errors``) and a report to the daemon, which journals it
        and quarantines the pairing.
        """
        if self._checks is None:
            return
        for found in self._checks.after_step(metadata.check, metadata.uncheck, self.stats.checked):
            why, detail = found.disagreement, f"layer {found.disagreement.layer_name}"
            for share in found.plan.shares:
                self._link.spawn(
                    self._calls.mismatch(
                        share, why.layer, why.position, why.difference, why.tolerance, detail
                    )
                )

    def load_errors(self) -> set[int]:
        """Blocks of loads found not this engine's since vLLM last asked."""
        return self._checks.load_errors() if self._checks is not None else set()

    def _on_event(self, event: WorkerEvent) -> None:
        if isinstance(event, DaemonLost):
            self._daemon_lost(event.generation)
            return
        transfer_id = event.request_id
        if transfer_id in self._sending:
            # A pusher's blocks are only read while it writes: once the write
            # is over (or never happens), vLLM may have them back.
            if isinstance(event, rpc.BlocksFreeable | rpc.RequestFailed | rpc.Released | GaveUp):
                # Released: the daemon dropped it (a deadline, while we were
                # away); a released pusher has no write left. The blocks go
                # back once every share of the request is over.
                request_id, _ = self._sending.pop(transfer_id)
                if isinstance(event, rpc.RequestFailed):
                    # The prefill's own log names why nothing (more) was pushed.
                    log.warning(
                        "kvpushd: push %s failed: %s %s", transfer_id, event.reason, event.message
                    )
                shares = self._pushes.get(request_id, set())
                shares.discard(transfer_id)
                if not shares:
                    self._pushes.pop(request_id, None)
                    self._done_sending.add(request_id)
                self.stats.ended(outcome(event, "pushed"))
                if not isinstance(event, GaveUp | rpc.Released):
                    self._link.spawn(self._calls.release(transfer_id))
            return
        load = self._receiving.get(transfer_id)
        if load is None:
            return
        give_up: tuple[str, ...] = ()
        if isinstance(event, rpc.KvArrived):
            # Done is settled: the write is over, its slice holds the KV.
            load.landed(transfer_id)
            self._link.spawn(self._calls.release(transfer_id))
        elif isinstance(event, rpc.RequestFailed):
            # The data will not come, but a write may still be in flight
            # (quarantine): the blocks go back to vLLM only once the daemon
            # has released the request.
            log.warning("kvpushd: %s failed: %s %s", transfer_id, event.reason, event.message)
            self.stats.ended(outcome(event, "loaded"))
            give_up = load.share_failed(transfer_id)
            self._abort_all(give_up)
            self._link.spawn(self._calls.release_then_free(transfer_id))
        elif isinstance(event, rpc.Released):
            self._events.put(Freed(transfer_id))  # a deferred release was carried out
        elif isinstance(event, GaveUp | Freed):
            if isinstance(event, GaveUp):  # a failure was counted when it came
                self.stats.ended(outcome(event, "loaded"))
            self._abort_all(load.share_ended(transfer_id))
        self._settle(load)

    def _abort_all(self, shares: tuple[str, ...]) -> None:
        for share in shares:
            self._link.spawn(self._calls.abort(share))

    def _settle(self, load: Load) -> None:
        """End the load once every share has landed, or every share is released."""
        if not load.settled:
            return
        for share in load.shares:
            self._receiving.pop(share, None)
        if load.failed:
            # Never silently wrong KV: vLLM fails or recomputes these blocks.
            self._failed_loads.add(load.request_id)
        else:
            self.stats.loaded(load.nbytes, time.monotonic() - load.posted_at)
            if self._staging is not None:
                # Host staging: finished once its blocks are in vLLM's cache.
                self._to_stage_in.append(load)
                return
        self._done_receiving.add(load.request_id)

    def _stage_in(self) -> None:
        """Copy this step's landed loads mirror -> cache (one batch); end those copied."""
        assert self._staging is not None
        if self._to_stage_in:
            loads, self._to_stage_in = self._to_stage_in, []
            copy = Copy()
            # The hybrid negative control's twin for staging: the KV never reaches vLLM.
            if not failpoints.corrupts("connector.skip_stage_in"):
                copy = self._staging.copy_in([load.blocks for load in loads])
                self.stats.staged("in", copy.nbytes)
            self._staging_in.append((copy, [load.request_id for load in loads]))
        still = []
        for copy, request_ids in self._staging_in:
            if copy.done():
                self._done_receiving.update(request_ids)
            else:
                still.append((copy, request_ids))
        self._staging_in = still

    def abort(self, request_ids: list[str]) -> None:
        """vLLM finished these decode requests while their KV was still loading."""
        aborted = set(request_ids)
        for load in {id(load): load for load in self._receiving.values()}.values():
            if load.request_id in aborted:
                self._abort_all(tuple(load.pending))

    def _daemon_lost(self, generation: int) -> None:
        """The daemon went away: end every transfer the lost connection held.

        A prefill's blocks are no longer read by anyone (the daemon's NIXL
        agent died with it). A decode's blocks: its peer fences a dead daemon
        and fails the write; the loads end failed, never as arrived.
        Transfers posted under a newer connection are not touched.
        """
        lost = [t for t, (_, g) in self._sending.items() if g <= generation]
        lost += [
            t
            for t, load in self._receiving.items()
            if load.generation <= generation and t in load.holding
        ]
        for transfer_id in lost:
            self._on_event(GaveUp(transfer_id, "daemon_unavailable", "connection lost"))

    def close(self) -> None:
        self._link.close()
        if self._staging is not None:
            self._staging.close()
            self._staging = None
        self._memory.close()
