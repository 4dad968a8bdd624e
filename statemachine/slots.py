"""The node's KV offload tier: a pool of equal slots, its content index, each slot's lifecycle.

The daemon owns one pool of equal slots (the shell maps its memory and hands
it to the engines); engines store KV there under a content key and find it
again by that key, across requests, engines and restarts. The content index
maps (namespace, offload key) to the one slot that holds it, committed. A
slot walks the table ``SLOT_TRANSITIONS`` (read it as a table: for a state,
the events allowed and the state each leads to)::

    free -> granted -> stored -> committed <-> leased
              |          |          |
              +----------+----------+--> evicted -> free (reset: zeroed, generation + 1)

Anything the table does not list is refused with the reason
``SLOT_REFUSALS`` names for that state and event, and nothing changes. Three
guards sit beside the table: a store names the slot's own writer
(``slot_not_granted``); a commit publishes a key nobody has published
(``slot_committed``); an unlease gives back leases its holder holds
(``slot_not_leased``); and one rule: the unlease that takes a slot's last
lease leads to ``committed``, not ``leased``. Eviction needs no guard: a
slot with a lease is ``leased``, and ``leased`` has no eviction
(``slot_leased``). Every use of a slot is named by its generation, which
only its reset bumps: a word about an older use is refused
(``slot_stale``), and no slot is ever granted that was not reset
(``slot_not_reset``), the seed's failure (an offload buffer of one request
read by the next) refused by the table rather than avoided by care.

A reader that finds a committed slot's bytes differ from its digest
condemns it (``SlotsCondemned``, allowed in ``committed`` and ``leased``,
leading back to the same state): the slot leaves the content index at once
(no lookup hands it out again, and its key may be committed anew, in
another slot), keeps its leases and its place in the eviction order, and is
marked condemned until its reset. :meth:`SlotPool.check_evict_condemned`
evicts (``condemned``) every condemned slot no lease holds; LRU eviction
takes them before any other. Without it a reader would find the same bad
slot on every lookup and recompute forever.

Sans-IO like :class:`statemachine.registry.Registry`: the shell asks a
``check_*`` method (or :meth:`SlotPool.abandon`, :meth:`SlotPool.on_restart`),
which raises :class:`Refusal` and changes nothing, or returns the events to
journal; the shell journals them and feeds each to :meth:`SlotPool.apply`,
the only method that mutates, all or nothing per record. Replay runs the
same :meth:`apply` (the registry delegates every slot event here), so the
live pool and the replayed one are built by the same code.

At a daemon start the shell journals, in this order, :meth:`on_restart`'s
events (every lease dropped: its readers died with the daemon; every
granted or stored slot discarded: its writers too) and then
:meth:`check_pool_opened`'s: ``PoolOpened``, preceded, where the journal's
pool is lost (another size, slot size or id, or memory that did not
survive), by ``SlotsEvicted(why="pool_lost")`` of every committed slot, so
each slot's history says why its content went. A pool of another size is
resized by ``PoolOpened``: dropped slots are forgotten, new ones are free.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, Final, NamedTuple

from schemas.events import (
    MAX_BATCH,
    MAX_DIGEST_BYTES,
    MAX_KEY_BYTES,
    MAX_NAMESPACE,
    MAX_POOL_SLOTS,
    PoolOpened,
    Record,
    SlotsCommitted,
    SlotsCondemned,
    SlotsDiscarded,
    SlotsEvicted,
    SlotsGranted,
    SlotsLeased,
    SlotsReset,
    SlotsStored,
    SlotsUnleased,
)
from schemas.reasons import Reason
from schemas.state import SlotPoolSnapshot, SlotRecord, SlotState
from statemachine.errors import Refusal

__all__ = [
    "CONDEMN_WHYS",
    "DISCARD_WHYS",
    "EVICT_WHYS",
    "MAX_BATCH",
    "MAX_DIGEST_BYTES",
    "MAX_KEY_BYTES",
    "MAX_NAMESPACE",
    "MAX_POOL_SLOTS",
    "SLOT_EVENTS",
    "SLOT_REFUSALS",
    "SLOT_TRANSITIONS",
    "SlotLine",
    "SlotPool",
    "SlotState",
    "slot_history",
]

FREE, GRANTED, STORED = SlotState.FREE, SlotState.GRANTED, SlotState.STORED
COMMITTED, LEASED, EVICTED = SlotState.COMMITTED, SlotState.LEASED, SlotState.EVICTED

NOT_GRANTED, IS_COMMITTED = Reason.SLOT_NOT_GRANTED, Reason.SLOT_COMMITTED
NOT_COMMITTED, IS_EVICTED = Reason.SLOT_NOT_COMMITTED, Reason.SLOT_EVICTED
NOT_RESET, NOT_LEASED, IS_LEASED = Reason.SLOT_NOT_RESET, Reason.SLOT_NOT_LEASED, Reason.SLOT_LEASED
ILLEGAL = Reason.ILLEGAL_TRANSITION

# Why a granted or stored slot is given up (SlotsDiscarded.why), why a
# committed one is evicted (SlotsEvicted.why), and why a reader condemns one
# (SlotsCondemned.why).
DISCARD_WHYS: Final = ("duplicate_key", "abandoned", "restart", "not_zero")
EVICT_WHYS: Final = ("lru", "pool_lost", "reset_cache", "operator", "condemned")
CONDEMN_WHYS: Final = ("bad_digest",)


def _frozen(table: dict[Any, dict[type, Any]]) -> Mapping[Any, Mapping[type, Any]]:
    return MappingProxyType({key: MappingProxyType(row) for key, row in table.items()})


# fmt: off
SLOT_TRANSITIONS: Final[Mapping[SlotState, Mapping[type, SlotState]]] = _frozen({
    # state       event            -> next state
    FREE:      {SlotsGranted:   GRANTED},
    GRANTED:   {SlotsStored:    STORED,
                SlotsDiscarded: EVICTED},
    STORED:    {SlotsCommitted: COMMITTED,
                SlotsDiscarded: EVICTED},
    COMMITTED: {SlotsLeased:    LEASED,
                SlotsEvicted:   EVICTED,
                SlotsCondemned: COMMITTED},  # out of the index, evicted next
    LEASED:    {SlotsLeased:    LEASED,
                SlotsUnleased:  LEASED,      # COMMITTED when the last lease goes
                SlotsCondemned: LEASED},     # out of the index, leases kept
    EVICTED:   {SlotsReset:     FREE},
})

# Every pair the table does not list, and the reason it is refused with (the
# most specific one a caller can act on): event -> (states -> reason).
_REFUSED: Final[dict[type, dict[tuple[SlotState, ...], Reason]]] = {
    # event            refused in these states            with
    SlotsGranted:   {(GRANTED, STORED, COMMITTED, LEASED, EVICTED): NOT_RESET},
    SlotsStored:    {(FREE, STORED, EVICTED):             NOT_GRANTED,
                     (COMMITTED, LEASED):                 IS_COMMITTED},
    SlotsCommitted: {(FREE, EVICTED):                     NOT_GRANTED,
                     (GRANTED,):                          ILLEGAL,      # not stored yet
                     (COMMITTED, LEASED):                 IS_COMMITTED},
    SlotsDiscarded: {(FREE, EVICTED):                     NOT_GRANTED,
                     (COMMITTED, LEASED):                 IS_COMMITTED},
    SlotsLeased:    {(FREE, GRANTED, STORED):             NOT_COMMITTED,
                     (EVICTED,):                          IS_EVICTED},
    SlotsUnleased:  {(FREE, GRANTED, STORED, COMMITTED, EVICTED): NOT_LEASED},
    SlotsEvicted:   {(FREE, GRANTED, STORED):             NOT_COMMITTED,
                     (LEASED,):                           IS_LEASED,
                     (EVICTED,):                          IS_EVICTED},
    SlotsCondemned: {(FREE, GRANTED, STORED):             NOT_COMMITTED,
                     (EVICTED,):                          IS_EVICTED},
    SlotsReset:     {(FREE, GRANTED, STORED):             ILLEGAL,      # in use, or reset
                     (COMMITTED,):                        IS_COMMITTED,
                     (LEASED,):                           IS_LEASED},
}
# fmt: on

# The same, state -> event -> reason, as _walk reads it.
SLOT_REFUSALS: Final[Mapping[SlotState, Mapping[type, Reason]]] = _frozen(
    {
        state: {
            kind: reason
            for kind, row in _REFUSED.items()
            for states, reason in row.items()
            if state in states
        }
        for state in SlotState
    }
)

SLOT_EVENTS: Final = (
    SlotsGranted,
    SlotsStored,
    SlotsCommitted,
    SlotsDiscarded,
    SlotsLeased,
    SlotsUnleased,
    SlotsEvicted,
    SlotsCondemned,
    SlotsReset,
)

# What each refusal tells the caller, after "slot N (generation G) is STATE".
_SAYS: Final = {
    NOT_GRANTED: "it is not granted to a writer",
    IS_COMMITTED: "its content is published and is never written again",
    NOT_COMMITTED: "nothing readable is in it yet",
    IS_EVICTED: "its content is gone",
    NOT_RESET: "it was not reset since its last use",
    NOT_LEASED: "no lease is held on it",
    IS_LEASED: "a reader holds a lease on it",
    ILLEGAL: "the slot table does not allow it",
}

# Why a lost pool is refused while a slot is in one of these states.
_LOST_REFUSAL: Final = {
    GRANTED: ILLEGAL,
    STORED: ILLEGAL,
    COMMITTED: IS_COMMITTED,
    LEASED: IS_LEASED,
}

# Events that may name a slot more than once: each is one lease more or less.
_REPEATABLE: Final = frozenset({SlotsLeased, SlotsUnleased})

Hit = tuple[int, int, bytes]
"""What a lease hands a reader: (slot, generation, digest of the slot's bytes)."""


def _bad(message: str) -> Refusal:
    return Refusal(Reason.BAD_OFFLOAD, message)


def _check_holder(holder: str, what: str) -> None:
    if not holder:
        raise _bad(f"{what}: no holder named")


def _check_namespace(namespace: str, what: str) -> None:
    if not namespace or len(namespace) > MAX_NAMESPACE:
        raise _bad(f"{what}: a namespace is 1 to {MAX_NAMESPACE} characters, got {len(namespace)}")


def _check_key(key: bytes, what: str) -> None:
    if not key or len(key) > MAX_KEY_BYTES:
        raise _bad(f"{what}: an offload key is 1 to {MAX_KEY_BYTES} bytes, got {len(key)}")


def _check_count(count: int, what: str) -> None:
    if count > MAX_BATCH:
        raise _bad(f"{what}: {count} items, at most {MAX_BATCH} in one call")


class SlotPool:
    """The offload pool of one node: each slot's state and generation, and the content index.

    Pure and mutable, like the registry. ``size``, ``slot_bytes`` and
    ``pool_id`` are the pool as last opened (all empty: none yet).
    """

    def __init__(self, slots: int = 0, slot_bytes: int = 0, pool_id: str = "") -> None:
        if not 0 <= slots <= MAX_POOL_SLOTS or slot_bytes < 0:
            raise _bad(f"a pool of {slots} slots of {slot_bytes} bytes")
        self.size = slots
        self.slot_bytes = slot_bytes
        self.pool_id = pool_id
        self._state: list[SlotState] = [FREE] * slots
        self._gen: list[int] = [0] * slots
        # Sparse, by slot: its writer (grant to reset), what it stored
        # (namespace, key, digest; store to reset), its readers' lease counts.
        self._holder: dict[int, str] = {}
        self._content: dict[int, tuple[str, bytes, bytes]] = {}
        self._leases: dict[int, dict[str, int]] = {}
        # The content index: (namespace, key) -> committed or leased slot,
        # not condemned.
        self._index: dict[tuple[str, bytes], int] = {}
        # Slots a reader condemned (out of the index), until their reset.
        self._condemned: set[int] = set()
        # Committed and leased slots, least recently committed or leased first.
        self._recency: dict[int, None] = {}
        # Evicted slots waiting for their reset, in the order they were evicted.
        self._evicted: dict[int, None] = {}
        # Free slots; a min-heap over them for lowest-first grants (it may
        # hold stale entries: _lowest_free skips what is not free).
        self._free: set[int] = set(range(slots))
        self._heap: list[int] = list(range(slots))
        self._counts: dict[SlotState, int] = dict.fromkeys(SlotState, 0)
        self._counts[FREE] = slots
        # The highest generation of a slot a smaller pool dropped.
        self._retired = 0

    # ------------------------------------------------------------------ reads

    @property
    def opened(self) -> bool:
        """Whether a pool was opened (a journal without one has none)."""
        return self.size > 0 or self.slot_bytes > 0 or self.pool_id != ""

    def _slot(self, slot: int) -> int:
        if not 0 <= slot < self.size:
            raise _bad(f"slot {slot} is outside the pool of {self.size}")
        return slot

    def state(self, slot: int) -> SlotState:
        return self._state[self._slot(slot)]

    def generation(self, slot: int) -> int:
        return self._gen[self._slot(slot)]

    def holder(self, slot: int) -> str | None:
        """The writer it was granted to, from its grant until its reset."""
        return self._holder.get(self._slot(slot))

    def digest(self, slot: int) -> bytes | None:
        """The digest its writer stored with it, until its reset."""
        content = self._content.get(self._slot(slot))
        return None if content is None else content[2]

    def key(self, slot: int) -> tuple[str, bytes] | None:
        """The (namespace, key) it stored, until its reset."""
        content = self._content.get(self._slot(slot))
        return None if content is None else content[:2]

    def where(self, namespace: str, key: bytes) -> int | None:
        """The committed (or leased) slot holding ``key`` in ``namespace``, not condemned."""
        return self._index.get((namespace, key))

    def is_condemned(self, slot: int) -> bool:
        """Whether a reader condemned the slot (from then until its reset)."""
        return self._slot(slot) in self._condemned

    def condemned(self) -> list[int]:
        """The condemned slots, by number."""
        return sorted(self._condemned)

    def free_count(self) -> int:
        return len(self._free)

    def leases(self, slot: int) -> Mapping[str, int]:
        """Each reader's lease count on the slot (empty unless leased)."""
        return MappingProxyType(dict(self._leases.get(self._slot(slot), {})))

    def evicted(self) -> list[int]:
        """Slots waiting for a reset (for the shell's reset worker), oldest eviction first."""
        return list(self._evicted)

    def counts(self) -> dict[SlotState, int]:
        """Slots per state, every state named (for metrics and status)."""
        return dict(self._counts)

    def index_size(self) -> int:
        return len(self._index)

    # ----------------------------------------------------------------- checks

    def check_grant(self, holder: str, n: int) -> SlotsGranted | None:
        """Up to ``n`` free slots for ``holder``, lowest numbers first; None if none is free.

        None tells the shell to evict (:meth:`check_evict`) and reset first.
        """
        _check_holder(holder, "grant")
        if n < 1:
            raise _bad(f"grant: {n} slots asked for")
        _check_count(n, "grant")
        taken = self._lowest_free(n)
        if not taken:
            return None
        gen = self._gen
        return SlotsGranted(holder, tuple(taken), tuple(gen[s] for s in taken))

    def _lowest_free(self, n: int) -> list[int]:
        heap, free = self._heap, self._free
        if len(heap) > 2 * len(free) + 64:
            heap[:] = sorted(free)  # a sorted list is a heap; the stale entries go
        taken: list[int] = []
        while heap and len(taken) < n:
            slot = heapq.heappop(heap)
            if slot in free and (not taken or slot != taken[-1]):
                taken.append(slot)
        for slot in taken:  # a check changes nothing: they stay free until granted
            heapq.heappush(heap, slot)
        return taken

    def check_store(
        self, holder: str, namespace: str, items: Sequence[tuple[int, int, bytes, bytes]]
    ) -> list[SlotsStored | SlotsCommitted | SlotsDiscarded]:
        """``holder`` says its bytes are in: items are (slot, generation, key, digest).

        Every item is checked before any is taken (the bounds, then each
        slot: its generation, not committed, granted to ``holder``). Returns
        ``SlotsStored`` of all, ``SlotsCommitted`` of those whose key is not
        in the index yet (of keys twice in the batch, the first), and
        ``SlotsDiscarded(why="duplicate_key")`` of the rest: a second commit
        of a key keeps the first and resets the loser. Empty ones are left out.
        """
        if not items:
            return []
        _check_count(len(items), "store")
        stored = SlotsStored(
            holder,
            namespace,
            tuple(item[0] for item in items),
            tuple(item[1] for item in items),
            tuple(item[2] for item in items),
            tuple(item[3] for item in items),
        )
        self._check_stored(stored)
        index = self._index
        won: list[int] = []
        lost: list[int] = []
        seen: set[bytes] = set()
        for slot, key in zip(stored.slots, stored.keys, strict=True):
            if key in seen or (namespace, key) in index:
                lost.append(slot)
            else:
                won.append(slot)
                seen.add(key)
        gen = self._gen
        events: list[SlotsStored | SlotsCommitted | SlotsDiscarded] = [stored]
        if won:
            events.append(SlotsCommitted(tuple(won), tuple(gen[s] for s in won)))
        if lost:
            events.append(SlotsDiscarded(tuple(lost), tuple(gen[s] for s in lost), "duplicate_key"))
        return events

    def check_lease(
        self, holder: str, namespace: str, keys: Sequence[bytes]
    ) -> tuple[SlotsLeased | None, list[Hit | None]]:
        """Lease each key's committed slot to ``holder``: (the event, one answer per key).

        An answer is (slot, generation, digest) for a key committed in
        ``namespace`` (leased by the event), None for a miss; a miss does
        not stop the others. A key asked twice is two leases.
        """
        _check_holder(holder, "lease")
        _check_namespace(namespace, "lease")
        _check_count(len(keys), "lease")
        for key in keys:
            _check_key(key, "lease")
        index, gen, content = self._index, self._gen, self._content
        answers: list[Hit | None] = []
        slots: list[int] = []
        for key in keys:
            slot = index.get((namespace, key))
            if slot is None:
                answers.append(None)
            else:
                answers.append((slot, gen[slot], content[slot][2]))
                slots.append(slot)
        if not slots:
            return None, answers
        return SlotsLeased(holder, tuple(slots), tuple(gen[s] for s in slots)), answers

    def check_unlease(self, holder: str, items: Sequence[tuple[int, int]]) -> SlotsUnleased:
        """``holder`` gives back leases, items (slot, generation); a slot twice is two."""
        _check_holder(holder, "unlease")
        if not items:
            raise _bad("unlease: no slot named")
        _check_count(len(items), "unlease")
        event = SlotsUnleased(
            holder, tuple(item[0] for item in items), tuple(item[1] for item in items)
        )
        self._check_unleased(event)
        return event

    def check_evict(self, n: int, why: str = "lru") -> SlotsEvicted | None:
        """The ``n`` least recently used committed slots without a lease; None if there is none.

        Recency: a slot is used when it is committed and when it is leased.
        Condemned slots without a lease go first (lowest numbers first): nobody
        can read them.
        """
        self._check_why(why, EVICT_WHYS)
        if n < 1:
            raise _bad(f"evict: {n} slots asked for")
        state, condemned = self._state, self._condemned
        chosen = self._unleased_condemned()[:n]
        if len(chosen) < n:
            for slot in self._recency:
                if state[slot] is COMMITTED and slot not in condemned:
                    chosen.append(slot)
                    if len(chosen) == n:
                        break
        return self._evict(chosen, why)

    def check_evict_condemned(self) -> SlotsEvicted | None:
        """Every condemned slot no lease holds any more (``condemned``); None if there is none."""
        return self._evict(self._unleased_condemned(), "condemned")

    def _unleased_condemned(self) -> list[int]:
        state = self._state
        return sorted(s for s in self._condemned if state[s] is COMMITTED)

    def check_condemn(
        self, holder: str, items: Sequence[tuple[int, int]], why: str = "bad_digest"
    ) -> SlotsCondemned | None:
        """``holder`` says slots are bad, items (slot, generation): out of the index for good.

        Every item is checked (the bounds; each slot committed or leased, at
        its generation; an item twice counts once); the slots not condemned
        yet are condemned by the event. None when all of them are already:
        a reader may say it again.
        """
        _check_holder(holder, "condemn")
        self._check_why(why, CONDEMN_WHYS)
        if not items:
            raise _bad("condemn: no slot named")
        _check_count(len(items), "condemn")
        pairs = list(dict.fromkeys((item[0], item[1]) for item in items))
        event = SlotsCondemned(holder, tuple(p[0] for p in pairs), tuple(p[1] for p in pairs), why)
        self._walk(event)
        fresh = [p for p in pairs if p[0] not in self._condemned]
        if not fresh:
            return None
        return SlotsCondemned(holder, tuple(p[0] for p in fresh), tuple(p[1] for p in fresh), why)

    def check_evict_all(self, why: str) -> SlotsEvicted | None:
        """Every committed slot without a lease (vLLM's cache reset, an operator); None: none."""
        self._check_why(why, EVICT_WHYS)
        state = self._state
        return self._evict([s for s in self._recency if state[s] is COMMITTED], why)

    def _evict(self, slots: list[int], why: str) -> SlotsEvicted | None:
        if not slots:
            return None
        gen = self._gen
        return SlotsEvicted(tuple(slots), tuple(gen[s] for s in slots), why)

    def check_discard(self, slots: Sequence[int], why: str) -> SlotsDiscarded:
        """Give granted or stored slots up unpublished (``not_zero``: not zeroed at grant)."""
        self._check_why(why, DISCARD_WHYS)
        event = SlotsDiscarded(tuple(slots), self._generations_of(slots), why)
        self._walk(event)
        return event

    def check_reset(self, slots: Sequence[int]) -> SlotsReset:
        """Evicted slots the shell has zeroed: free again, each one generation on."""
        event = SlotsReset(tuple(slots), self._generations_of(slots))
        self._walk(event)
        return event

    def _generations_of(self, slots: Sequence[int]) -> tuple[int, ...]:
        gen, size = self._gen, self.size
        return tuple(gen[s] if 0 <= s < size else -1 for s in slots)  # -1: refused by _walk

    @staticmethod
    def _check_why(why: str, whys: tuple[str, ...]) -> None:
        if why not in whys:
            raise _bad(f"{why!r} is not one of {', '.join(whys)}")

    def abandon(self, holder: str) -> list[SlotsUnleased | SlotsDiscarded]:
        """``holder`` is gone: its leases given back, its granted and stored slots discarded."""
        leased: list[int] = []
        for slot, readers in sorted(self._leases.items()):
            leased.extend([slot] * readers.get(holder, 0))
        state = self._state
        writing = sorted(
            s for s, h in self._holder.items() if h == holder and state[s] in (GRANTED, STORED)
        )
        gen = self._gen
        events: list[SlotsUnleased | SlotsDiscarded] = []
        if leased:
            events.append(SlotsUnleased(holder, tuple(leased), tuple(gen[s] for s in leased)))
        if writing:
            events.append(
                SlotsDiscarded(tuple(writing), tuple(gen[s] for s in writing), "abandoned")
            )
        return events

    def on_restart(self) -> list[SlotsUnleased | SlotsDiscarded]:
        """The daemon restarted: every lease dropped (one record per holder), every
        granted or stored slot discarded (``restart``): their engines' sessions died."""
        per_holder: dict[str, list[int]] = {}
        for slot, readers in sorted(self._leases.items()):
            for holder, count in readers.items():
                per_holder.setdefault(holder, []).extend([slot] * count)
        gen, state = self._gen, self._state
        events: list[SlotsUnleased | SlotsDiscarded] = [
            SlotsUnleased(holder, tuple(slots), tuple(gen[s] for s in slots))
            for holder, slots in sorted(per_holder.items())
        ]
        writing = sorted(s for s in self._holder if state[s] in (GRANTED, STORED))
        if writing:
            events.append(SlotsDiscarded(tuple(writing), tuple(gen[s] for s in writing), "restart"))
        return events

    def check_pool_opened(
        self, slots: int, slot_bytes: int, pool_id: str, survived: bool
    ) -> list[SlotsEvicted | PoolOpened]:
        """The pool as the daemon opened it at start, after :meth:`on_restart`'s events.

        ``[PoolOpened]``, preceded, when the journal's pool is lost (another
        size, slot size or id, or its memory did not survive), by the
        eviction of every committed slot (``pool_lost``): their content is
        gone, and each slot's history says so. Refused while a slot is
        leased, granted or stored: :meth:`on_restart` first.
        """
        event = PoolOpened(slots, slot_bytes, pool_id, survived)
        self._check_pool(event)
        if not self._loses(event):
            return [event]
        self._check_lost(event, (GRANTED, STORED, LEASED), "on_restart() first")
        lost = self.check_evict_all("pool_lost")
        return [event] if lost is None else [lost, event]

    def _check_pool(self, event: PoolOpened) -> None:
        if not 0 <= event.slots <= MAX_POOL_SLOTS or event.slot_bytes < 0:
            raise _bad(
                f"a pool of {event.slots} slots of {event.slot_bytes} bytes "
                f"(at most {MAX_POOL_SLOTS} slots)"
            )

    def _loses(self, event: PoolOpened) -> bool:
        """Whether the journal's content is gone: it had a pool, and this is not that one."""
        same = (event.slots, event.slot_bytes, event.pool_id) == (
            self.size,
            self.slot_bytes,
            self.pool_id,
        )
        return self.opened and not (same and event.survived)

    def _check_lost(self, event: PoolOpened, states: tuple[SlotState, ...], fix: str) -> None:
        """A lost pool's content is gone: refused while a slot in ``states`` says otherwise."""
        for state in states:
            if self._counts[state]:
                slot = self._state.index(state)
                raise Refusal(
                    _LOST_REFUSAL[state],
                    f"PoolOpened: the pool's content is lost but slot {slot} is {state.value} "
                    f"(pool {self.pool_id!r} of {self.size} x {self.slot_bytes} bytes, now "
                    f"{event.pool_id!r} of {event.slots} x {event.slot_bytes}, survived "
                    f"{event.survived}): {fix}",
                )

    # --------------------------------------------------------------- the fold

    def apply(self, event: Any) -> None:
        """Fold one journaled event; all or nothing per record.

        Raises :class:`Refusal` (and changes nothing) if any slot it names
        may not take it.
        """
        step = _APPLY.get(type(event))
        if step is None:
            raise Refusal(ILLEGAL, f"{type(event).__name__} is not an offload slot event")
        step(self, event)

    def _walk(self, event: Any) -> None:
        """The checks every slot record passes: lengths, range, generation, the table."""
        slots, gens = event.slots, event.generations
        kind = type(event)
        name = kind.__name__
        if len(slots) != len(gens):
            raise _bad(f"{name} names {len(slots)} slots and {len(gens)} generations")
        if not slots:
            raise _bad(f"{name} names no slot")
        if kind not in _REPEATABLE and len(set(slots)) != len(slots):
            raise _bad(f"{name} names a slot twice")
        size, states, current = self.size, self._state, self._gen
        for slot, generation in zip(slots, gens, strict=True):
            if not 0 <= slot < size:
                raise _bad(f"{name}: slot {slot} is outside the pool of {size}")
            if generation != current[slot]:
                raise Refusal(
                    Reason.SLOT_STALE,
                    f"{name}: slot {slot} is at generation {current[slot]}, not {generation} "
                    "(it was reset since: that use of it is over)",
                )
            state = states[slot]
            if kind not in SLOT_TRANSITIONS[state]:
                reason = SLOT_REFUSALS[state][kind]
                raise Refusal(
                    reason,
                    f"{name}: slot {slot} (generation {generation}) is {state.value}: "
                    f"{_SAYS[reason]}",
                )

    def _move(self, slot: int, new: SlotState) -> None:
        counts = self._counts
        counts[self._state[slot]] -= 1
        counts[new] += 1
        self._state[slot] = new

    def _apply_granted(self, event: SlotsGranted) -> None:
        _check_holder(event.holder, "SlotsGranted")
        self._walk(event)
        holder, free, move = self._holder, self._free, self._move
        for slot in event.slots:
            move(slot, GRANTED)
            holder[slot] = event.holder
            free.discard(slot)

    def _check_stored(self, event: SlotsStored) -> None:
        what = "store"
        _check_holder(event.holder, what)
        _check_namespace(event.namespace, what)
        n = len(event.slots)
        if not len(event.generations) == len(event.keys) == len(event.digests) == n:
            raise _bad(
                f"{what}: {n} slots, {len(event.generations)} generations, "
                f"{len(event.keys)} keys and {len(event.digests)} digests"
            )
        for key, digest in zip(event.keys, event.digests, strict=True):
            _check_key(key, what)
            if len(digest) > MAX_DIGEST_BYTES:
                raise _bad(
                    f"{what}: a digest is at most {MAX_DIGEST_BYTES} bytes, got {len(digest)}"
                )
        self._walk(event)
        holders = self._holder
        for slot in event.slots:
            if holders[slot] != event.holder:
                raise Refusal(
                    NOT_GRANTED,
                    f"SlotsStored: slot {slot} is granted to {holders[slot]!r}, "
                    f"not {event.holder!r}: it has one writer",
                )

    def _apply_stored(self, event: SlotsStored) -> None:
        self._check_stored(event)
        content, move, namespace = self._content, self._move, event.namespace
        for slot, key, digest in zip(event.slots, event.keys, event.digests, strict=True):
            move(slot, STORED)
            content[slot] = (namespace, key, digest)

    def _apply_committed(self, event: SlotsCommitted) -> None:
        self._walk(event)
        index, content = self._index, self._content
        seen: dict[tuple[str, bytes], int] = {}
        for slot in event.slots:
            ident = content[slot][:2]
            other = index.get(ident, seen.get(ident))
            if other is not None:
                raise Refusal(
                    IS_COMMITTED,
                    f"SlotsCommitted: slot {slot}'s key is committed already, in slot {other} "
                    "(a second commit of a key is discarded: the first stays)",
                )
            seen[ident] = slot
        recency, move = self._recency, self._move
        for ident, slot in seen.items():
            move(slot, COMMITTED)
            index[ident] = slot
            recency[slot] = None

    def _apply_discarded(self, event: SlotsDiscarded) -> None:
        self._walk(event)
        evicted, move = self._evicted, self._move
        for slot in event.slots:
            move(slot, EVICTED)
            evicted[slot] = None

    def _apply_leased(self, event: SlotsLeased) -> None:
        _check_holder(event.holder, "SlotsLeased")
        self._walk(event)
        leases, recency, holder, move = self._leases, self._recency, event.holder, self._move
        for slot in event.slots:
            readers = leases.get(slot)
            if readers is None:
                leases[slot] = {holder: 1}
                move(slot, LEASED)
            else:
                readers[holder] = readers.get(holder, 0) + 1
            del recency[slot]  # a lease uses it: most recent now
            recency[slot] = None

    def _check_unleased(self, event: SlotsUnleased) -> Counter[int]:
        _check_holder(event.holder, "SlotsUnleased")
        self._walk(event)
        wanted = Counter(event.slots)
        holder = event.holder
        for slot, count in wanted.items():
            held = self._leases[slot].get(holder, 0)
            if held < count:
                raise Refusal(
                    NOT_LEASED,
                    f"SlotsUnleased: {holder!r} holds {held} leases on slot {slot}, "
                    f"gives back {count}",
                )
        return wanted

    def _apply_unleased(self, event: SlotsUnleased) -> None:
        wanted = self._check_unleased(event)
        leases, holder = self._leases, event.holder
        for slot, count in wanted.items():
            readers = leases[slot]
            left = readers[holder] - count
            if left:
                readers[holder] = left
                continue
            del readers[holder]
            if not readers:  # the last lease went: committed again
                del leases[slot]
                self._move(slot, COMMITTED)

    def _unindex(self, slot: int) -> None:
        """Take ``slot``'s key out of the index, if the index still maps it to this slot
        (a condemned slot's key may be committed again in another one)."""
        ident = self._content[slot][:2]
        if self._index.get(ident) == slot:
            del self._index[ident]

    def _apply_evicted(self, event: SlotsEvicted) -> None:
        self._walk(event)
        recency, evicted = self._recency, self._evicted
        for slot in event.slots:
            self._move(slot, EVICTED)
            self._unindex(slot)
            del recency[slot]
            evicted[slot] = None

    def _apply_condemned(self, event: SlotsCondemned) -> None:
        _check_holder(event.holder, "SlotsCondemned")
        self._walk(event)
        condemned = self._condemned
        for slot in event.slots:
            self._unindex(slot)
            condemned.add(slot)

    def _apply_reset(self, event: SlotsReset) -> None:
        self._walk(event)
        gen, holder, content, evicted = self._gen, self._holder, self._content, self._evicted
        for slot in event.slots:
            self._move(slot, FREE)
            gen[slot] += 1
            holder.pop(slot, None)
            content.pop(slot, None)
            del evicted[slot]
            self._condemned.discard(slot)
            self._free.add(slot)
            heapq.heappush(self._heap, slot)

    def _apply_pool_opened(self, event: PoolOpened) -> None:
        self._check_pool(event)
        if self._loses(event):
            self._check_lost(
                event, (GRANTED, STORED, COMMITTED, LEASED), "discard and evict them first"
            )
        if event.slots != self.size:
            self._resize(event.slots)
        self.slot_bytes, self.pool_id = event.slot_bytes, event.pool_id

    def _resize(self, size: int) -> None:
        """Only free and evicted slots are dropped (PoolOpened checked); new ones are free."""
        old, states, gen = self.size, self._state, self._gen
        if size < old:
            for slot in range(size, old):
                self._counts[states[slot]] -= 1
                self._retired = max(self._retired, gen[slot])
                self._free.discard(slot)
                self._evicted.pop(slot, None)
                self._holder.pop(slot, None)
                self._content.pop(slot, None)
                self._condemned.discard(slot)
            del states[size:]
            del gen[size:]
        else:
            # A slot number that comes back starts above any generation it had.
            base = max(max(gen, default=0), self._retired) + 1 if self.opened else 0
            states.extend([FREE] * (size - old))
            gen.extend([base] * (size - old))
            self._free.update(range(old, size))
            self._counts[FREE] += size - old
        self.size = size
        self._heap = sorted(self._free)

    # -------------------------------------------------------------- snapshots

    def snapshot(self) -> SlotPoolSnapshot:
        states, gen, holder, content, leases, condemned = (
            self._state,
            self._gen,
            self._holder,
            self._content,
            self._leases,
            self._condemned,
        )
        records = []
        for slot in range(self.size):
            state, generation = states[slot], gen[slot]
            if state is FREE and not generation:
                continue
            namespace, key, digest = content.get(slot, ("", b"", b""))
            readers = tuple(sorted(leases.get(slot, {}).items()))
            holder_of = holder.get(slot, "")
            records.append(
                SlotRecord(
                    slot,
                    state,
                    generation,
                    holder_of,
                    namespace,
                    key,
                    digest,
                    readers,
                    slot in condemned,
                )
            )
        return SlotPoolSnapshot(
            self.size,
            self.slot_bytes,
            self.pool_id,
            tuple(records),
            tuple(self._recency),
            tuple(self._evicted),
            self._retired,
        )

    @classmethod
    def from_snapshot(cls, snap: SlotPoolSnapshot) -> SlotPool:
        pool = cls(snap.size, snap.slot_bytes, snap.pool_id)
        pool._retired = snap.retired_generation
        states, gen, index = pool._state, pool._gen, pool._index
        for record in snap.records:
            slot, state = pool._slot(record.slot), record.state
            pool._move(slot, state)
            gen[slot] = record.generation
            if record.holder:
                pool._holder[slot] = record.holder
            if record.namespace or record.key:
                pool._content[slot] = (record.namespace, record.key, record.digest)
            if state is LEASED:
                pool._leases[slot] = dict(record.leases)
            if record.condemned:
                if state not in (COMMITTED, LEASED, EVICTED):
                    raise _bad(f"snapshot: slot {slot} is {state.value} and condemned")
                pool._condemned.add(slot)
            elif state in (COMMITTED, LEASED):
                ident = (record.namespace, record.key)
                if ident in index:
                    raise _bad(f"snapshot: slots {index[ident]} and {slot} hold one key")
                index[ident] = slot
        pool._free = {s for s in range(snap.size) if states[s] is FREE}
        pool._heap = sorted(pool._free)
        pool._recency = dict.fromkeys(snap.recency)
        pool._evicted = dict.fromkeys(snap.evicted)
        published = {s for s in range(snap.size) if states[s] in (COMMITTED, LEASED)}
        if set(pool._recency) != published or set(pool._evicted) != {
            s for s in range(snap.size) if states[s] is EVICTED
        }:
            raise _bad("snapshot: the pool's recency or eviction order disagrees with its slots")
        return pool


_APPLY: Final[Mapping[type, Callable[[SlotPool, Any], None]]] = MappingProxyType(
    {
        PoolOpened: SlotPool._apply_pool_opened,
        SlotsGranted: SlotPool._apply_granted,
        SlotsStored: SlotPool._apply_stored,
        SlotsCommitted: SlotPool._apply_committed,
        SlotsDiscarded: SlotPool._apply_discarded,
        SlotsLeased: SlotPool._apply_leased,
        SlotsUnleased: SlotPool._apply_unleased,
        SlotsEvicted: SlotPool._apply_evicted,
        SlotsCondemned: SlotPool._apply_condemned,
        SlotsReset: SlotPool._apply_reset,
    }
)


# ------------------------------------------------------------------ history


class SlotLine(NamedTuple):
    """One record of a slot's history: the slot's state and generation after it, and a flag.

    ``state`` and ``generation`` are None where the pool has no such slot.
    ``flag`` is empty, or says what is wrong with the record: a read
    (``SlotsLeased``) naming a generation the slot no longer had, or any
    record replay refuses (it then changed nothing).
    """

    record: Record
    state: SlotState | None
    generation: int | None
    flag: str


def slot_history(
    records: Iterable[Record], slot: int, pool: SlotPool | None = None
) -> list[SlotLine]:
    """Every record naming ``slot`` (and every ``PoolOpened``), in order, folded as replay folds.

    ``pool`` is the pool before the first record (a snapshot's; a fresh
    one if None), folded on by every slot record, whichever slots it names.
    A record replay refuses is listed flagged, never raised.
    """
    pool = pool if pool is not None else SlotPool()
    lines: list[SlotLine] = []
    for record in records:
        event = record.event
        if isinstance(event, SLOT_EVENTS):
            names = slot in event.slots
        elif isinstance(event, PoolOpened):
            names = True
        else:
            continue
        flag = ""
        if names and isinstance(event, SlotsLeased) and 0 <= slot < pool.size:
            current = pool.generation(slot)
            read = [g for s, g in zip(event.slots, event.generations, strict=False) if s == slot]
            if any(g != current for g in read):
                flag = (
                    f"a read of generation {read[0]}: slot {slot} is at generation {current} "
                    "(it changed generation: another use's content)"
                )
        try:
            pool.apply(event)
        except Refusal as exc:
            if names:
                flag = f"{flag}; refused on replay: {exc}" if flag else f"refused on replay: {exc}"
        if names:
            inside = 0 <= slot < pool.size
            lines.append(
                SlotLine(
                    record,
                    pool.state(slot) if inside else None,
                    pool.generation(slot) if inside else None,
                    flag,
                )
            )
    return lines
