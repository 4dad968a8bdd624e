"""The node's KV offload tier at run time (README.md, "Offload tier").

The core's slot table (``Registry.slots``, statemachine/slots.py) says which
slot of the pool may be granted, stored, committed, leased, evicted or
reset, and refuses the rest; this part carries it out:

- the calls (``OffloadAttach``, ``OffloadGrant``, ``OffloadStore``,
  ``OffloadLease``, ``OffloadUnlease``, ``OffloadCondemn``): each asks the
  core and commits what it says through the ledger, one record per batch.
  Grants, stores and condemns are answered once durable; leases and
  unleases at once (their records are made durable by the next group
  commit: a daemon that dies loses every lease anyway, and readers check
  digests).
- condemned slots (a reader's digest differed): out of the index at once;
  after a condemn, after each unlease and at a start (the restart dropped
  every lease), those no lease holds any more are evicted (``condemned``)
  and the reset task zeroes them.
- the pool's memory (daemon/dataplane/pool.py), passed to each client that
  attaches (its descriptor on the reply's frame).
- holders: which connections named each holder; when the last one closes,
  the core's ``abandon`` is journaled (its grants discarded, then reset;
  its leases dropped).
- the reset task: it keeps ``reserve`` slots free ahead of grants,
  evicting the least recently used unleased slots (condemned ones first),
  and zeroes every evicted slot in a thread (once its
  eviction is durable), checks it, and journals ``SlotsReset`` only then. A grant checks
  each slot zero before the holder hears of it; one that is not is
  discarded ``not_zero`` (counted, logged) and reset, never granted dirty.
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

import structlog

from daemon import failpoints
from daemon.dataplane.pool import Pool
from daemon.journal.format import JournalFatal
from daemon.node.descriptors import Passing
from daemon.node.engine_state import EngineSession
from daemon.node.ledger import Ledger
from daemon.node.lifecycle import Lifecycle
from daemon.node.tasks import Spawn
from schemas import rpc
from schemas.config import OffloadConfig
from schemas.events import SlotsDiscarded
from schemas.reasons import Reason
from schemas.state import SlotState
from schemas.status import OffloadLine
from statemachine import Refusal
from statemachine.reactions import Cause

log = structlog.get_logger("kvpushd.offload")

# Slots a grant checks on the loop; more are checked in a thread (a grant
# goes ahead of need, but a large one must not stall the other calls).
_INLINE_CHECK_BYTES: Final = 1 << 20
# Slots zeroed per round of the reset task (then the loop runs the calls).
_RESET_ROUND_BYTES: Final = 64 << 20
# The reset task looks again this often even when nothing woke it.
_RESET_PERIOD_S: Final = 1.0
# Holders one connection may name (a tier client names one or two).
MAX_HOLDERS_PER_CONNECTION: Final = 64
# Holders whose namespace binding is kept (the most recently attached).
MAX_BOUND_HOLDERS: Final = 4096
_WHY_NOT_ZERO: Final = "not_zero"


@dataclass
class OffloadCounters:
    """What the tier did since the daemon started (status, metrics)."""

    hits: int = 0
    misses: int = 0
    committed: int = 0
    duplicates: int = 0
    resets: int = 0
    not_zero: int = 0
    condemned: int = 0


class _Gone(Exception):
    """The connection closed before its call ran: nothing is done for it."""


class OffloadTier:
    """The tier's runtime part; with ``pool`` None (``[offload]`` off) every call is refused."""

    def __init__(
        self,
        config: OffloadConfig,
        *,
        pool: Pool | None,
        ledger: Ledger,
        spawn: Spawn,
        life: Lifecycle,
    ) -> None:
        self.pool = pool
        self._ledger = ledger
        self._spawn = spawn
        self._life = life
        self.reserve = min(config.reserved, config.slots)
        self.counters = OffloadCounters()
        self._sessions: dict[str, set[EngineSession]] = {}  # holder -> connections naming it
        self._holders: dict[EngineSession, set[str]] = {}
        # holder -> the namespace its attach bound (kept past its connections:
        # an attach's own connection closes at once; bounded, oldest first out).
        self._namespaces: OrderedDict[str, str] = OrderedDict()
        self._ended: weakref.WeakSet[EngineSession] = weakref.WeakSet()
        self._wake = asyncio.Event()
        self._unsynced = False  # leases appended that nobody asked a sync for
        # The last eviction journaled without waiting (a condemned slot's, after
        # an unlease): durable before the reset task zeroes a byte.
        self._evicted_seq = 0
        self._round_slots = 1 if pool is None else max(1, _RESET_ROUND_BYTES // pool.slot_bytes)
        self._log = log

    @property
    def enabled(self) -> bool:
        return self.pool is not None

    def handlers(self) -> dict[type, Any]:
        """The engine server's table for the tier's calls."""
        if self.pool is None:
            return {kind: self._off for kind in _CALLS}
        return {
            rpc.OffloadAttach: self.attach,
            rpc.OffloadGrant: self.grant,
            rpc.OffloadStore: self.store,
            rpc.OffloadLease: self.lease,
            rpc.OffloadUnlease: self.unlease,
            rpc.OffloadCondemn: self.condemn,
        }

    # ------------------------------------------------------------ start / stop

    async def begin(self) -> None:
        """Journal the pool as opened and what the restart calls for; start the reset task."""
        pool = self.pool
        if pool is None:
            return
        ledger = self._ledger
        slots = ledger.registry.slots
        # First what the restart ended (leases dropped; grants and stores
        # discarded: their writers died with the connections), then the pool
        # as opened (a pool that is not the journal's evicts its content).
        restarted = slots.on_restart()
        if restarted:
            ledger.commit(restarted, Cause.RESTART)
        ledger.commit(
            slots.check_pool_opened(pool.slots, pool.slot_bytes, pool.pool_id, pool.survived),
            Cause.RESTART,
        )
        # Condemned slots whose leases the restart dropped: nobody reads them.
        condemned = slots.check_evict_condemned()
        if condemned is not None:
            ledger.commit([condemned], Cause.RESTART)
        await ledger.durable(ledger.journal.next_seq - 1)
        self._log.info(
            "offload pool opened",
            slots=pool.slots,
            slot_bytes=pool.slot_bytes,
            pool_id=pool.pool_id,
            survived=pool.survived,
            path=pool.path or "memfd",
            committed=slots.counts()[SlotState.COMMITTED],
            evicted=len(slots.evicted()),
        )
        self._spawn(self._keep_free())
        self._wake.set()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()

    # ---------------------------------------------------------------- holders

    def _touch(self, session: EngineSession, holder: str) -> None:
        """``session`` names ``holder``: the holder lives while such a connection does."""
        if session in self._ended:
            raise _Gone
        named = self._holders.get(session)
        if named is None:
            named = self._holders[session] = set()
        if holder in named:
            return
        if len(named) >= MAX_HOLDERS_PER_CONNECTION:
            raise Refusal(
                Reason.BAD_OFFLOAD,
                f"a connection may name at most {MAX_HOLDERS_PER_CONNECTION} holders",
            )
        named.add(holder)
        self._sessions.setdefault(holder, set()).add(session)

    def disconnected(self, session: EngineSession) -> None:
        """A connection ended: each holder it was the last to name is abandoned."""
        self._ended.add(session)
        for holder in self._holders.pop(session, ()):
            sessions = self._sessions.get(holder)
            if sessions is None:
                continue
            sessions.discard(session)
            if sessions:
                continue
            del self._sessions[holder]
            self._abandon(holder)

    def _abandon(self, holder: str) -> None:
        # A node that stops journals nothing more: its restart drops every
        # lease and discards every grant anyway (SlotPool.on_restart).
        if self._life.closing:
            return
        events = self._ledger.registry.slots.abandon(holder)
        if not events:
            return
        try:
            self._ledger.commit(events, Cause.ENGINE).tell_when_durable()
        except JournalFatal:
            return
        self._log.info("offload holder gone: abandoned", holder=holder)
        self._wake.set()

    def _bind(self, session: EngineSession, holder: str, namespace: str) -> None:
        """``holder``'s chunks live in ``namespace`` from now on (its attach said so)."""
        bound = self._namespaces.get(holder)
        others = self._sessions.get(holder, set()) - {session}
        if bound is not None and bound != namespace and others:
            raise Refusal(
                Reason.BAD_OFFLOAD,
                f"holder {holder} is bound to namespace {bound} by a connection that lives",
            )
        self._namespaces[holder] = namespace
        self._namespaces.move_to_end(holder)
        while len(self._namespaces) > MAX_BOUND_HOLDERS:
            self._namespaces.popitem(last=False)

    def _namespace(self, holder: str, named: str) -> str:
        """The namespace a call of ``holder`` acts in: the one it names, or its bound one."""
        bound = self._namespaces.get(holder)
        if not named:
            if bound is None:
                raise Refusal(
                    Reason.BAD_OFFLOAD,
                    f"holder {holder} names no namespace and none is bound: attach it with one",
                )
            return bound
        if bound is not None and bound != named:
            raise Refusal(
                Reason.BAD_OFFLOAD,
                f"holder {holder} is bound to namespace {bound}, not {named}",
            )
        return named

    # ------------------------------------------------------------------ calls

    async def _off(self, session: EngineSession, req: Any) -> rpc.Reply:
        return rpc.Error(
            req.id,
            rpc.NO_OFFLOAD_TIER,
            "this daemon has no offload tier: set [offload] slots and slot_bytes in its config",
        )

    async def attach(self, session: EngineSession, req: rpc.OffloadAttach) -> Any:
        pool = self.pool
        assert pool is not None
        try:
            self._touch(session, req.holder)
        except _Gone:
            return _gone(req)
        if req.namespace:
            self._bind(session, req.holder, req.namespace)
        reply = rpc.OffloadPool(
            req.id, pool.slots, pool.slot_bytes, pool.header_bytes, pool.pool_id
        )
        return Passing(reply, (pool.fd,))

    async def grant(self, session: EngineSession, req: rpc.OffloadGrant) -> rpc.Reply:
        pool = self.pool
        assert pool is not None
        try:
            self._touch(session, req.holder)
        except _Gone:
            return _gone(req)
        slots = self._ledger.registry.slots
        granted = slots.check_grant(req.holder, req.n)
        if granted is None or len(granted.slots) < req.n:
            self._wake.set()  # short: the reset task frees more
        if granted is None:
            return rpc.OffloadGranted(req.id, (), ())
        committed = self._ledger.commit([granted], Cause.ENGINE)
        # Each slot zero before the holder hears of it: one that is not
        # (a reset that did not zero, a write into a free slot) is discarded.
        if len(granted.slots) * pool.slot_bytes <= _INLINE_CHECK_BYTES:
            dirty = pool.dirty(granted.slots)
        else:
            dirty = await asyncio.to_thread(pool.dirty, granted.slots)
        pairs = list(zip(granted.slots, granted.generations, strict=True))
        if dirty:
            dirty_set = set(dirty)
            discarded = self._discard_dirty(req.holder, [p for p in pairs if p[0] in dirty_set])
            if discarded is not None:
                committed = discarded
            pairs = [p for p in pairs if p[0] not in dirty_set]
        await committed
        return rpc.OffloadGranted(req.id, tuple(s for s, _ in pairs), tuple(g for _, g in pairs))

    def _discard_dirty(self, holder: str, pairs: list[tuple[int, int]]) -> Any:
        """Journal the slots a grant found not zero as discarded; they go back to reset."""
        slots = self._ledger.registry.slots
        # Still the holder's grant at that generation (its connection may have
        # closed while a thread checked them: then they were abandoned).
        pairs = [
            (s, g)
            for s, g in pairs
            if slots.state(s) is SlotState.GRANTED and slots.generation(s) == g
        ]
        if not pairs:
            return None
        self.counters.not_zero += len(pairs)
        for slot, generation in pairs:
            self._log.warning(
                "offload slot not zero at grant: discarded, reset again, never granted dirty",
                slot=slot,
                generation=generation,
                holder=holder,
            )
        event = slots.check_discard([s for s, _ in pairs], _WHY_NOT_ZERO)
        self._wake.set()
        return self._ledger.commit([event], Cause.DAEMON)

    async def store(self, session: EngineSession, req: rpc.OffloadStore) -> rpc.Reply:
        try:
            self._touch(session, req.holder)
        except _Gone:
            return _gone(req)
        n = len(req.slots)
        if not (len(req.generations) == len(req.keys) == len(req.digests) == n):
            raise Refusal(
                Reason.BAD_OFFLOAD,
                f"a store names {n} slots, {len(req.generations)} generations, "
                f"{len(req.keys)} keys and {len(req.digests)} digests: they must be parallel",
            )
        items = list(zip(req.slots, req.generations, req.keys, req.digests, strict=True))
        namespace = self._namespace(req.holder, req.namespace)
        events = self._ledger.registry.slots.check_store(req.holder, namespace, items)
        committed = self._ledger.commit(events, Cause.ENGINE)
        losers: set[int] = set()
        for event in events:
            if type(event) is SlotsDiscarded:
                losers.update(event.slots)
        if losers:
            self._wake.set()  # the losers' reset
        flags = tuple(slot not in losers for slot in req.slots)
        self.counters.duplicates += len(losers)
        self.counters.committed += n - len(losers)
        await committed
        return rpc.OffloadStored(req.id, flags)

    async def lease(self, session: EngineSession, req: rpc.OffloadLease) -> rpc.Reply:
        try:
            self._touch(session, req.holder)
        except _Gone:
            return _gone(req)
        namespace = self._namespace(req.holder, req.namespace)
        leased, found = self._ledger.registry.slots.check_lease(req.holder, namespace, req.keys)
        if leased is not None:
            self._commit_lazily([leased])
        slots: list[int] = []
        generations: list[int] = []
        digests: list[bytes] = []
        for hit in found:
            if hit is None:
                slots.append(-1)
                generations.append(0)
                digests.append(b"")
            else:
                slots.append(hit[0])
                generations.append(hit[1])
                digests.append(hit[2])
        hits = len(found) - slots.count(-1)
        self.counters.hits += hits
        self.counters.misses += len(found) - hits
        return rpc.OffloadLeased(req.id, tuple(slots), tuple(generations), tuple(digests))

    async def unlease(self, session: EngineSession, req: rpc.OffloadUnlease) -> rpc.Reply:
        try:
            self._touch(session, req.holder)
        except _Gone:
            return _gone(req)
        items = _slot_pairs(req, "an unlease")
        slots = self._ledger.registry.slots
        event = slots.check_unlease(req.holder, items)
        self._commit_lazily([event])
        if slots.free_count() < self.reserve:
            self._wake.set()  # unleased slots may be evicted now
        self._evict_condemned()
        return rpc.Ok(req.id)

    async def condemn(self, session: EngineSession, req: rpc.OffloadCondemn) -> rpc.Reply:
        try:
            self._touch(session, req.holder)
        except _Gone:
            return _gone(req)
        items = _slot_pairs(req, "a condemn")
        event = self._ledger.registry.slots.check_condemn(req.holder, items)
        if event is None:
            return rpc.Ok(req.id)  # condemned already: said again
        committed = self._ledger.commit([event], Cause.ENGINE)
        self.counters.condemned += len(event.slots)
        for slot, generation in zip(event.slots, event.generations, strict=True):
            self._log.warning(
                "offload slot condemned: its bytes differ from its digest; never leased "
                "again, evicted and reset once no lease holds it",
                slot=slot,
                generation=generation,
                holder=req.holder,
                why=event.why,
            )
        self._evict_condemned()
        await committed
        return rpc.Ok(req.id)

    def _evict_condemned(self) -> None:
        """Evict the condemned slots no lease holds any more; the reset task zeroes them."""
        victims = self._ledger.registry.slots.check_evict_condemned()
        if victims is None:
            return
        commit = self._ledger.commit([victims], Cause.DAEMON)
        self._evicted_seq = commit.seq
        commit.tell_when_durable()
        self._wake.set()

    def _commit_lazily(self, events: list[Any]) -> None:
        """Journal leases and unleases without asking for a sync: they ride the
        next group commit someone waits for, or the reset task's next period
        asks for one. A daemon that dies loses every lease anyway (its restart
        drops them all), so none waits for an fdatasync, nor starts one: on
        two cores a sync thread per lease doubled the round trip."""
        self._ledger.commit(events, Cause.ENGINE)
        self._unsynced = True

    # ------------------------------------------------------------ reset task

    async def _keep_free(self) -> None:
        """Reset every evicted slot, and evict (LRU) to keep ``reserve`` slots free."""
        while not self._life.closing:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(_RESET_PERIOD_S):
                    await self._wake.wait()
            self._wake.clear()
            group = self._ledger.group
            if self._unsynced and group is not None and not self._life.closing:
                self._unsynced = False
                group.request()  # leases journaled since the last period: on disk soon
            try:
                while not self._life.closing and await self._reset_round():
                    pass
            except JournalFatal:
                return  # the node stops (Node._journal_failed)
            except Exception:
                # A bug here must not end the resets for good: logged, and
                # tried again next period.
                self._log.exception("offload reset round failed")

    async def _reset_round(self) -> bool:
        """Evict what the reserve needs, reset one round of evicted slots; False: nothing to do."""
        pool = self.pool
        assert pool is not None
        slots = self._ledger.registry.slots
        evicted = slots.evicted()
        short = self.reserve - slots.free_count() - len(evicted)
        if short > 0:
            victims = slots.check_evict(short, why="lru")
            if victims is not None:
                # Durable before a byte is zeroed: a crash must never replay
                # a committed slot whose bytes are gone.
                await self._ledger.commit([victims])
                evicted = slots.evicted()
        batch = evicted[: self._round_slots]
        if not batch:
            return False
        if self._evicted_seq:
            # Condemned slots evicted after an unlease: their eviction durable
            # before a byte is zeroed, like the LRU's above.
            seq, self._evicted_seq = self._evicted_seq, 0
            await self._ledger.durable(seq)
        if failpoints.corrupts("offload.skip_reset"):
            # A planted stale slot: reset journaled, bytes left as they were.
            # The grant's zero check must catch it.
            self._log.warning("failpoint offload.skip_reset: slots not zeroed", slots=batch)
        else:
            await asyncio.to_thread(_zero_and_check, pool, batch)
        # Only this task resets, so the batch is still evicted after the await.
        event = slots.check_reset(batch)
        await self._ledger.commit([event])
        self.counters.resets += len(batch)
        return True

    # ----------------------------------------------------------------- status

    def status(self) -> OffloadLine | None:
        pool = self.pool
        if pool is None:
            return None
        slots = self._ledger.registry.slots
        counts = {str(getattr(k, "value", k)): v for k, v in slots.counts().items()}
        c = self.counters
        return OffloadLine(
            slots=pool.slots,
            slot_bytes=pool.slot_bytes,
            pool_id=pool.pool_id,
            path=pool.path,
            survived=pool.survived,
            reserve=self.reserve,
            by_state={s.value: counts.get(s.value, 0) for s in SlotState},
            holders=len(self._sessions),
            hits=c.hits,
            misses=c.misses,
            committed=c.committed,
            duplicates=c.duplicates,
            resets=c.resets,
            not_zero=c.not_zero,
            condemned=c.condemned,
        )


_CALLS: Final = (
    rpc.OffloadAttach,
    rpc.OffloadGrant,
    rpc.OffloadStore,
    rpc.OffloadLease,
    rpc.OffloadUnlease,
    rpc.OffloadCondemn,
)


def _slot_pairs(req: rpc.OffloadUnlease | rpc.OffloadCondemn, what: str) -> list[tuple[int, int]]:
    """A call's (slot, generation) items; ``bad_offload`` when the two lists are not parallel."""
    if len(req.generations) != len(req.slots):
        raise Refusal(
            Reason.BAD_OFFLOAD,
            f"{what} names {len(req.slots)} slots and {len(req.generations)} "
            "generations: they must be parallel",
        )
    return list(zip(req.slots, req.generations, strict=True))


def _gone(req: Any) -> rpc.Reply:
    # Never sent: the connection it would go to is closed.
    return rpc.Error(req.id, rpc.BAD_REQUEST, "the connection closed before the call ran")


def _zero_and_check(pool: Pool, slots: Sequence[int]) -> None:
    """In a thread: zero ``slots``, then read them back (a reset is journaled only after)."""
    pool.zero(slots)
    dirty = pool.dirty(slots)
    if dirty:
        # Written while being zeroed: nobody holds an evicted slot, so this is
        # a stray writer. Zero again; the grant's check is the last word.
        log.warning("offload slots written while being reset", slots=list(dirty))
        pool.zero(dirty)
