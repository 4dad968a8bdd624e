"""The tier's scheduler side: which chunks the node holds, leased before they are loaded.

vLLM's scheduler thread calls every method here; none waits for the daemon.
A key the manager has no answer for is looked up as ``RETRY`` and asked
for at the end of the step, with every other key of that step, in one
``offload_lease`` call; vLLM asks again next step and gets ``HIT`` (the
daemon leased the chunk to this engine: it cannot be evicted or reset
until unleased) or ``MISS``. A lease is this engine's, counted by the
requests that hold it; when none does, it goes back (``offload_unlease``,
batched per step too). Stores are planned here with slots the daemon
granted ahead (credits), so ``prepare_store`` is local; the worker writes
the slots and publishes them (daemon/client/vllm/tier/copier.py).

The loop thread only answers: it puts each reply on a queue that the
scheduler's thread drains at its next call, so every field below is the
scheduler thread's.
"""

from __future__ import annotations

import logging
import queue
import time
from collections import OrderedDict
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any, Final

from vllm.v1.kv_offload.base import (
    LoadStoreSpec,
    Locality,
    LookupResult,
    Medium,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from daemon.client.vllm.link import Link
from daemon.client.vllm.tier.jobs import TierLoad, TierStore
from daemon.client.vllm.tier.session import tier_link

log = logging.getLogger(f"vllm.{__name__}")

# After a grant that brought nothing, the next is asked no sooner than this.
GRANT_BACKOFF_S: Final = 0.5
# The same failure is logged at most this often (a daemon that is away
# fails every step's calls).
WARN_EVERY_S: Final = 10.0

# Keys this engine stored recently and does not store again (a bound: a
# key evicted since is only stored again once it falls out of this).
STORED_MEMORY: Final = 65536


@dataclass(slots=True)
class Lease:
    slot: int
    generation: int
    digest: bytes
    users: int = 0


NO_LEASE: Final = Lease(-1, -1, b"")


@dataclass(slots=True)
class _Request:
    held: set[bytes] = field(default_factory=set)  # keys whose lease it counts
    missed: set[bytes] = field(default_factory=set)
    waiting: set[bytes] = field(default_factory=set)


class TierManager(OffloadingManager):
    def __init__(self, socket_path: str, holder: str, credits: int, link: Link | None = None):
        self._holder = holder
        self._credit_target = max(1, credits)
        # Replies the loop thread hands over: (kind, payload).
        self._replies: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._link = link or tier_link(socket_path, holder, self._daemon_gone)
        self._requests: dict[str, _Request] = {}
        self._leases: dict[bytes, Lease] = {}
        self._waiters: dict[bytes, set[str]] = {}
        self._to_lease: dict[bytes, None] = {}  # asked at the step's end, in order
        self._to_unlease: list[tuple[int, int]] = []
        self._credits: list[tuple[int, int]] = []
        self._granting = False
        self._next_grant = 0.0
        self._warned: dict[str, float] = {}  # the loop thread's: when each failure was logged
        self._stored: OrderedDict[bytes, None] = OrderedDict()
        self._ask_credits()

    # lookups and loads --------------------------------------------------------

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        self._requests.setdefault(req_context.req_id, _Request())
        return RequestOffloadingContext()

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        self._drain()
        # A request whose kv_load_tiers leaves out the node's (local memory) tier.
        if not req_context.load_tier_filter.allows(Medium.CPU, Locality.LOCAL):
            return LookupResult.MISS
        request = self._requests.setdefault(req_context.req_id, _Request())
        if key in request.held:
            return LookupResult.HIT
        if key in request.missed:
            return LookupResult.MISS
        lease = self._leases.get(key)
        if lease is not None:  # another request holds it: this one counts too
            lease.users += 1
            request.held.add(key)
            return LookupResult.HIT
        request.waiting.add(key)
        asked = key in self._waiters  # by another request, or by this one before
        self._waiters.setdefault(key, set()).add(req_context.req_id)
        if not asked:
            self._to_lease[key] = None
        return LookupResult.RETRY

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> CacheHitSource:
        return CacheHitSource.HOST

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        request = self._requests.setdefault(req_context.req_id, _Request())
        # A key with no lease here (a daemon that went away since the lookup)
        # loads from no slot: the worker reports its blocks load errors.
        leases = [self._leases.get(key) or NO_LEASE for key in keys]
        # What it looked up beyond what it loads goes back now.
        for key in request.held - set(keys):
            self._let_go(request, key)
        return TierLoad(
            [lease.slot for lease in leases],
            [lease.generation for lease in leases],
            [lease.digest for lease in leases],
        )

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        request = self._requests.get(req_context.req_id)
        if request is not None:
            for key in keys:
                self._let_go(request, key)

    def on_request_finished(self, req_context: ReqContext) -> None:
        request = self._requests.pop(req_context.req_id, None)
        if request is None:
            return
        for key in list(request.held):
            self._let_go(request, key)
        for key in request.waiting:
            waiters = self._waiters.get(key)
            if waiters is not None:
                waiters.discard(req_context.req_id)

    # stores -------------------------------------------------------------------

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        self._drain()
        new = [key for key in keys if key not in self._stored and key not in self._leases]
        take = new[: len(self._credits)]
        granted, self._credits = self._credits[: len(take)], self._credits[len(take) :]
        for key in take:
            self._stored[key] = None
        while len(self._stored) > STORED_MEMORY:
            self._stored.popitem(last=False)
        if len(self._credits) < self._credit_target // 2:
            self._ask_credits()
        if new and not take:
            return None  # no slot granted yet: vLLM stores nothing this time
        return PrepareStoreOutput(
            keys_to_store=take,
            store_spec=TierStore([s for s, _ in granted], [g for _, g in granted], take),
            evicted_keys=[],
        )

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        if not success:
            for key in keys:
                self._stored.pop(key, None)

    # the step's end: what this step asked goes out in one call each ------------

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._drain()
        # Unleases first: on one connection, the daemon sees a slot given back
        # before it is asked for again.
        if self._to_unlease:
            items, self._to_unlease = self._to_unlease, []
            self._link.spawn(self._unlease(items))
        if self._to_lease:
            keys, self._to_lease = list(self._to_lease), {}
            self._link.spawn(self._lease(keys))

    def has_pending_work(self) -> bool:
        # Requests wait on lease answers: keep the engine stepping until they come.
        return bool(self._waiters) or bool(self._to_lease) or bool(self._to_unlease)

    def reset_cache(self) -> None:
        # The node's tier is every engine's: this engine forgets what it knows
        # of it (its stored keys), nothing more; leases in use stay counted.
        self._stored.clear()

    def shutdown(self) -> None:
        self._link.close()

    # the daemon's answers, on the scheduler's thread ---------------------------

    def _drain(self) -> None:
        while True:
            try:
                kind, payload = self._replies.get_nowait()
            except queue.Empty:
                return
            if kind == "lease":
                self._leased(*payload)
            elif kind == "grant":
                self._granting = False
                self._credits.extend(payload)
                if not payload:
                    self._next_grant = time.monotonic() + GRANT_BACKOFF_S
            elif kind == "gone":
                # A daemon that restarted holds none of this engine's grants or
                # leases: forget them (a load in flight is checked by digest).
                self._credits.clear()
                self._leases.clear()
                for request in self._requests.values():
                    request.held.clear()

    def _leased(self, keys: list[bytes], answers: list[tuple[int, int, bytes] | None]) -> None:
        for key, answer in zip(keys, answers, strict=True):
            waiters = self._waiters.pop(key, set())
            if answer is None:
                for rid in waiters:
                    request = self._requests.get(rid)
                    if request is not None:
                        request.waiting.discard(key)
                        request.missed.add(key)
                continue
            lease = self._leases.get(key)
            if lease is None:
                lease = self._leases[key] = Lease(*answer)
            else:  # held already: the daemon counted this answer as one more lease
                self._to_unlease.append((answer[0], answer[1]))
            for rid in waiters:
                request = self._requests.get(rid)
                if request is not None and key in request.waiting:
                    request.waiting.discard(key)
                    request.held.add(key)
                    lease.users += 1
            if lease.users == 0:
                self._let_go_lease(key, lease)

    def _let_go(self, request: _Request, key: bytes) -> None:
        if key not in request.held:
            return
        request.held.discard(key)
        lease = self._leases.get(key)
        if lease is None:
            return
        lease.users -= 1
        if lease.users <= 0:
            self._let_go_lease(key, lease)

    def _let_go_lease(self, key: bytes, lease: Lease) -> None:
        del self._leases[key]
        self._to_unlease.append((lease.slot, lease.generation))

    def _ask_credits(self) -> None:
        if self._granting or time.monotonic() < self._next_grant:
            return
        self._granting = True
        self._link.spawn(self._grant(self._credit_target - len(self._credits)))

    def _daemon_gone(self) -> None:
        self._replies.put(("gone", None))

    # on the loop thread: calls, and their answers queued -------------------------

    async def _lease(self, keys: list[bytes]) -> None:
        answers: list[tuple[int, int, bytes] | None] = [None] * len(keys)
        try:
            reply = await self._link.client().offload_lease(self._holder, "", keys)
            answers = [
                None if slot < 0 else (slot, generation, digest)
                for slot, generation, digest in zip(
                    reply.slots, reply.generations, reply.digests, strict=True
                )
            ]
        except Exception as exc:  # no daemon, or a refusal: every key misses
            self._warn("lookup", "kvpushd tier: lookups fail (every key misses): %s", exc)
        self._replies.put(("lease", (keys, answers)))

    def _warn(self, kind: str, message: str, exc: Exception) -> None:
        now = time.monotonic()
        if now - self._warned.get(kind, -WARN_EVERY_S) >= WARN_EVERY_S:
            self._warned[kind] = now
            log.warning(message, exc)

    async def _unlease(self, items: list[tuple[int, int]]) -> None:
        try:
            await self._link.client().offload_unlease(
                self._holder, [slot for slot, _ in items], [gen for _, gen in items]
            )
        except Exception as exc:  # a daemon that restarted dropped them already
            log.debug("kvpushd tier: unlease of %d slots: %s", len(items), exc)

    async def _grant(self, count: int) -> None:
        granted: list[tuple[int, int]] = []
        try:
            reply = await self._link.client().offload_grant(self._holder, max(1, count))
            granted = list(zip(reply.slots, reply.generations, strict=True))
        except Exception as exc:
            self._warn("grant", "kvpushd tier: no slots granted (nothing stored): %s", exc)
        self._replies.put(("grant", granted))
