"""The worker's calls to its daemon, and what it remembers of them: all on the link's loop thread.

Every field here is the loop thread's: vLLM's thread only hands calls in
(``Link.spawn``) and reads what comes back from ``events`` (the daemon's
events and the connector's own, ``GaveUp`` and ``Freed``). A lost
connection is not an answer: a call whose answer it took is asked again
if the same daemon answers a reconnect (``lived``), and ends with the
rest once that daemon is known gone (``gone``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import queue
from collections.abc import Callable
from typing import Final

from daemon.client.engine_client import EngineClient
from daemon.client.errors import ClientError, RpcError
from daemon.client.vllm.link import CALL_TIMEOUT_S, Link
from daemon.client.vllm.shares import Slices
from daemon.client.vllm.specs import (
    Blocks,
    DaemonLost,
    Freed,
    GaveUp,
    PushSpec,
    ReceiveSpec,
    WorkerEvent,
    per_group,
)
from daemon.client.vllm.staging import Copy
from schemas import rpc
from schemas.fingerprint import Fingerprint
from schemas.kvlayout import GroupSpec, MemoryNote, RegionSpec
from schemas.layout import Role
from schemas.reasons import Reason

log = logging.getLogger(f"vllm.{__name__}")

# Registrations and kv_ready wait as long as the connection lives: a slow
# daemon (a stalled fdatasync) may have taken the call, and only its answer,
# or its end, says so.
UNTIL_ANSWERED: Final = math.inf


class DaemonCalls:
    """One engine's calls to its daemon (the link's ``Session``).

    ``still_ours``: whether vLLM still waits on a transfer (vLLM's thread's
    bookkeeping, read here before a lost registration is asked again). The
    one read across threads, on purpose: a membership test of a dict (atomic
    under the GIL) is the freshest word there is; a copy the loop kept, fed
    by vLLM's thread through the link, could only lag behind the moment vLLM
    takes blocks back, and widen the window this check narrows. What closes
    that window is the daemon's: a transfer it knew, ended meanwhile, is
    refused as stale (its tombstone), never registered anew.
    """

    def __init__(
        self,
        socket_path: str,
        engine_id: str,
        fingerprint: Fingerprint,
        events: queue.SimpleQueue[WorkerEvent],
        still_ours: Callable[[str], bool],
    ) -> None:
        self._engine_id = engine_id
        self._fingerprint = fingerprint
        self._events = events
        self._still_ours = still_ours
        # The engine's memory, once vLLM registered it.
        self._groups: tuple[GroupSpec, ...] = ()
        self._region: RegionSpec | None = None
        self._note: MemoryNote | None = None
        self.descriptors: tuple[int, ...] = ()
        # The slice engines the specs named: registered when first used, and
        # again on every new connection.
        self._slices: Slices = {}
        self._slices_registered: set[str] = set()  # on the current connection
        self._slice_lock = asyncio.Lock()
        # Transfers registered on the current connection.
        self._posted: set[str] = set()
        # Transfers whose release was asked and not yet answered.
        self._releasing: set[str] = set()
        # Failed loads' releases that got no answer, asked again on a
        # reconnect to the same daemon.
        self._unreleased: set[str] = set()
        # Receivers whose registration is not answered yet.
        self._registering: dict[str, asyncio.Event] = {}
        # Transfers whose registration's answer a lost connection took.
        self._unsure: dict[str, PushSpec | ReceiveSpec] = {}
        self.link = Link(socket_path, engine_id, self)

    def registered(
        self,
        groups: tuple[GroupSpec, ...],
        region: RegionSpec,
        descriptors: tuple[int, ...],
        note: MemoryNote,
    ) -> None:
        """The engine's memory (vLLM's thread, before the link connects)."""
        self._groups, self._region, self._note = groups, region, note
        # Passed with every Hello (the region names descriptor 0).
        self.descriptors = descriptors

    # the link's session ----------------------------------------------------

    async def register(self, client: EngineClient) -> None:
        assert self._region is not None
        # The slices used before are registered again: a re-asked receiver
        # goes to the engine it was first registered on.
        self._slices_registered = set()
        await client.register_engine(
            self._engine_id,
            self._groups,
            (self._region,),
            fingerprint=self._fingerprint,
            memory_note=self._note,
        )
        for slice_id in list(self._slices):
            await self._register_slice(client, slice_id)

    def lived(self, client: EngineClient) -> None:
        # The same daemon lived: its word on what it holds of ours came
        # again with the registration (live outcomes, releases); calls
        # whose answer the lost connection took are asked again.
        for spec in list(self._unsure.values()):
            self.link.spawn(self._ask_again(spec, client))
        self._unsure.clear()
        for transfer_id in self._unreleased:
            self.link.spawn(self.release_then_free(transfer_id))
        self._unreleased.clear()

    def gone(self, generation: int) -> None:
        # What a restarted daemon resends about them is not ours to wait for.
        self._posted = set()
        self._releasing = set()
        self._unsure.clear()
        self._unreleased.clear()
        self._events.put(DaemonLost(generation))

    def on_event(self, event: rpc.Event, client: EngineClient) -> None:
        transfer_id = event.request_id
        if transfer_id not in self._posted:
            if isinstance(event, rpc.KvArrived | rpc.BlocksFreeable | rpc.RequestFailed):
                # The outcome of a transfer vLLM no longer waits for (one a
                # restarted daemon resends after the old connection ended, or
                # a forgone receiver's): let the daemon drop it now (vLLM may
                # be idle, with no step to carry it out).
                self.link.spawn(self.release(transfer_id, client))
            return
        if isinstance(event, rpc.Released):
            self._posted.discard(transfer_id)
            self._releasing.discard(transfer_id)
        self._events.put(event)

    # pushes and loads ------------------------------------------------------

    async def push(self, push: PushSpec, generation: int, staged: Copy) -> None:
        if not staged.done():
            await asyncio.to_thread(staged.wait)
        if not push.engine_id:
            self._gave_up(
                push.transfer_id,
                RuntimeError(
                    "the KV a decode rank holds is not one run of each block here (the cache "
                    "is not head-major [blocks, heads, ...], or the layers not one run)"
                ),
            )
            return
        try:
            client = self.link.client(generation)
            self._posted.add(push.transfer_id)
            await self._register_pusher(push, client)
            await client.kv_ready(push.transfer_id, timeout=UNTIL_ANSWERED)
        except (RpcError, RuntimeError) as exc:
            # Refused, or no daemon to ask: nothing will read these blocks, so
            # vLLM may have them back; the decode side fails its load on its own.
            self._gave_up(push.transfer_id, exc)
        except ClientError as exc:
            # The connection ended mid-call: a write may already read the blocks.
            self._unsure_of(push, exc)

    async def receive(self, receive: ReceiveSpec, generation: int) -> None:
        # An abort of this share waits until its registration was answered:
        # one that overtook it would find nothing, and the blocks would go
        # back while the registration still lands.
        answered = self._registering[receive.transfer_id] = asyncio.Event()
        try:
            self._posted.add(receive.transfer_id)
            await self._engine_ready(receive)
            await self._register_receiver(receive, generation)
        except (RpcError, RuntimeError) as exc:
            # Never registered: no write can target these blocks. The load
            # ends as a load error, so vLLM recomputes or fails the request.
            self._gave_up(receive.transfer_id, exc)
        except ClientError as exc:
            # The connection ended mid-call: a write may already target them.
            self._unsure_of(receive, exc)
        finally:
            answered.set()
            if self._registering.get(receive.transfer_id) is answered:
                del self._registering[receive.transfer_id]

    async def forgo(self, receive: ReceiveSpec, generation: int) -> None:
        """Register a receiver with no block for a request vLLM dropped before its load.

        Not one of ours to report: vLLM has forgotten the request. Its
        outcome (``kv_arrived`` with nothing written, or a failure) comes as
        an event for a transfer this connection did not post, which is
        released at once (``on_event``).
        """
        with contextlib.suppress(ClientError, RuntimeError):  # the deadline ends it instead
            await self._engine_ready(receive)
            await self._register_receiver(receive, generation)

    async def announce(self, share: PushSpec) -> None:
        """Register a pusher with no block for a transfer this instance will not push.

        Not one of ours to report: vLLM has its blocks back already. Its
        outcome comes as an event for a transfer this connection did not
        post, which is released at once (``on_event``).
        """
        with contextlib.suppress(ClientError, RuntimeError):  # the deadline ends it instead
            client = self.link.client()
            await self._register_pusher(share, client)
            await client.kv_ready(share.transfer_id, timeout=CALL_TIMEOUT_S)

    async def hold(self, share: ReceiveSpec) -> None:
        try:
            await self.link.client().hold(
                share.transfer_id, share.peer, share.peer_address, timeout=CALL_TIMEOUT_S
            )
        except (ClientError, RuntimeError) as exc:
            log.info("kvpushd: hold of %s: %s", share.transfer_id, exc)

    async def mismatch(
        self,
        transfer_id: str,
        layer: int,
        position: int,
        difference: float,
        tolerance: float,
        detail: str = "",
    ) -> None:
        """Report that a load's KV is not this engine's (the worker spawns it on the link).

        ``transfer_id``: the receiver's daemon request id (the share's, as
        registered; it may be released). Best effort, one log line either
        way: the load's own outcome is the worker's, not this call's. Numbers
        are taken as Python ints and floats (a tensor's item, say).
        """
        try:
            await self.link.client().kv_mismatch(
                transfer_id, layer=int(layer), position=int(position),
                difference=float(difference), tolerance=float(tolerance), detail=detail[:256],
                timeout=CALL_TIMEOUT_S,
            )  # fmt: skip
        except (ClientError, RuntimeError) as exc:
            log.warning("kvpushd: kv_mismatch report of %s not taken: %s", transfer_id, exc)

    async def _ask_again(self, spec: PushSpec | ReceiveSpec, client: EngineClient) -> None:
        """A registration whose answer was lost with a connection to a daemon that lived.

        Asked again: accepted (the first never arrived), a duplicate (it did:
        its outcome comes as for any other), or stale (it did, and was
        released meanwhile: nothing holds its blocks).
        """
        transfer_id = spec.transfer_id
        if not self._still_ours(transfer_id):
            # Its request ended meanwhile and vLLM may have given its blocks
            # to another: registering them again would name blocks that are
            # no longer this transfer's.
            return
        try:
            if isinstance(spec, PushSpec):
                with contextlib.suppress(RpcError):  # a duplicate: it is there
                    await self._register_pusher(spec, client)
                await client.kv_ready(transfer_id, timeout=UNTIL_ANSWERED)
            else:
                await self._engine_ready(spec)
                await self._register_receiver(spec, self.link.generation)
        except RpcError as exc:
            if exc.code == Reason.STALE_INCARNATION:
                self._gave_up(transfer_id, exc)
            # Otherwise it is there (a duplicate, a kv_ready already said):
            # its outcome comes from the daemon.
        except (ClientError, RuntimeError) as exc:
            self._unsure_of(spec, exc)

    def _unsure_of(self, spec: PushSpec | ReceiveSpec, exc: BaseException) -> None:
        """A call's answer was lost with its connection: wait for the daemon's word.

        Asked again if the same daemon answers a reconnect; ended if it is
        known gone.
        """
        log.warning(
            "kvpushd: %s: no answer from the daemon (%s); its blocks stay held until it is "
            "known gone or says what became of it",
            spec.transfer_id,
            exc,
        )
        self._unsure[spec.transfer_id] = spec

    def _gave_up(self, transfer_id: str, exc: BaseException) -> None:
        reason = exc.code if isinstance(exc, RpcError) else "daemon_unavailable"
        self._posted.discard(transfer_id)
        log.warning("kvpushd: %s not registered: %s", transfer_id, exc)
        self._events.put(GaveUp(transfer_id, reason, str(exc)))

    # registrations ---------------------------------------------------------

    async def _engine_ready(self, spec: PushSpec | ReceiveSpec) -> None:
        """Make sure the spec's engine (this rank's, or a slice of it) is registered now."""
        engine_id = spec.engine_id
        if engine_id in ("", self._engine_id) or engine_id in self._slices_registered:
            return
        if spec.slice is not None:
            self._slices.setdefault(engine_id, spec.slice)
        async with self._slice_lock:
            if engine_id not in self._slices_registered:
                await self._register_slice(self.link.client(), engine_id)

    async def _register_slice(self, client: EngineClient, slice_id: str) -> None:
        assert self._region is not None
        groups, slice_print = self._slices[slice_id]
        await client.register_engine(
            slice_id, groups, (self._region,), fingerprint=slice_print, memory_note=self._note
        )
        self._slices_registered.add(slice_id)

    async def _register_pusher(self, push: PushSpec, client: EngineClient) -> None:
        await self._engine_ready(push)
        await client.register_request(
            push.engine_id or self._engine_id,
            push.transfer_id,
            Role.PUSHER,
            self._per_group(push.block_ids),
            timeout=UNTIL_ANSWERED,
            content=push.content,
        )

    async def _register_receiver(self, receive: ReceiveSpec, generation: int) -> None:
        await self.link.client(generation).register_request(
            receive.engine_id or self._engine_id,
            receive.transfer_id,
            Role.RECEIVER,
            self._per_group(receive.block_ids),
            peer=receive.peer,
            # The decode daemon dials the prefill's on demand if it has no link.
            peer_address=receive.peer_address,
            timeout=UNTIL_ANSWERED,
            content=receive.content,
            answered=receive.answered,
        )

    def _per_group(self, block_ids: Blocks) -> list[list[int]]:
        return per_group(block_ids, len(self._groups) or 1)

    # releases --------------------------------------------------------------

    async def abort(self, transfer_id: str) -> None:
        # The daemon cancels the push (or keeps the blocks until the pusher's
        # final word); the blocks come back through the release.
        registering = self._registering.get(transfer_id)
        if registering is not None:
            await registering.wait()
        with contextlib.suppress(ClientError, RuntimeError):
            await self.link.client().abort(transfer_id)
        await self.release_then_free(transfer_id)

    async def release_then_free(self, transfer_id: str) -> None:
        if transfer_id not in self._posted:
            # Released already (a sibling share's failure aborted it, then
            # its own failure came), or never registered: nothing holds the
            # blocks, and a second release would be journaled as stale.
            self._events.put(Freed(transfer_id))
            return
        if not self._first_release(transfer_id):
            return  # already asked (an abort, then its failure): its answer frees the blocks
        try:
            reply = await self.link.client().release(transfer_id)
        except RpcError as exc:
            # Already released (stale), or unknown: nothing holds the blocks.
            log.warning("kvpushd: release of %s: %s", transfer_id, exc)
            self._releasing.discard(transfer_id)
            self._events.put(Freed(transfer_id))
            return
        except (ClientError, RuntimeError) as exc:
            # No answer (no connection, or it ended mid-call): the daemon may
            # live and hold the blocks. Asked again when it answers a
            # reconnect; ended with the rest if it is known gone.
            log.warning("kvpushd: release of %s: no answer (%s)", transfer_id, exc)
            self._releasing.discard(transfer_id)
            self._unreleased.add(transfer_id)
            return
        if isinstance(reply, rpc.Ok):
            self._releasing.discard(transfer_id)
            self._posted.discard(transfer_id)
            self._events.put(Freed(transfer_id))
        # Deferred: the daemon sends Released when the quarantine lifts.

    async def release(self, transfer_id: str, client: EngineClient | None = None) -> None:
        if not self._first_release(transfer_id):
            return
        # The daemon's deadline releases it anyway.
        with contextlib.suppress(ClientError, RuntimeError):
            await (client or self.link.client()).release(transfer_id)
        self._posted.discard(transfer_id)
        self._releasing.discard(transfer_id)

    def _first_release(self, transfer_id: str) -> bool:
        """Note a release asked of the daemon; False if one is under way.

        One release per request: the abort path released twice (once after
        the abort, once for the failure it caused), and the second, arriving
        after the request was gone, was journaled as a stale refusal.
        """
        if transfer_id in self._releasing:
            return False
        self._releasing.add(transfer_id)
        return True
