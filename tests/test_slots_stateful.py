"""A Hypothesis state machine over the offload tier's SlotPool (statemachine/slots.py).

Three holders grant, store (often the same keys, sometimes with another
holder's slots or an old generation), lease, unlease (sometimes more than
they hold), condemn (a reader's digest differed: mostly slots they lease,
now and then any), evict (condemned slots too), reset, abandon and
restart, and the daemon reopens its pool (survived or not, sometimes
resized). Beside the checks, raw records
of any kind and any slot are applied as a damaged journal would, and must
be refused or be legal. Every refusal must leave the snapshot unchanged;
every event a check returned must apply; every applied event is logged,
and folding the log into a fresh pool, or through the registry's snapshot
codec, must give the same pool.

Invariants: a key maps to one committed (or leased) slot not condemned, and
back, and a condemned slot is found by no key; a leased slot is never
evicted or reset; every slot granted was reset (free)
since its last use; generations only grow; the counts add up.
"""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis import event as hyp_event
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from daemon.journal.replay import decode_snapshot, encode_snapshot
from schemas.events import (
    Event,
    PoolOpened,
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
from schemas.state import SlotState
from statemachine import Refusal, Registry
from statemachine.slots import SlotPool

FREE, LEASED, COMMITTED = SlotState.FREE, SlotState.LEASED, SlotState.COMMITTED
HOLDERS = ("a", "b", "c")
NAMESPACES = ("n1", "n2")
KEYS = (b"k0", b"k1", b"k2", b"k3")

holder_st = st.sampled_from(HOLDERS)
ns_st = st.sampled_from(NAMESPACES)
key_st = st.sampled_from(KEYS)
slot_st = st.integers(-1, 8)
gen_st = st.integers(0, 3)


class ContractViolation(AssertionError):
    """The core returned an event and then refused to apply it."""


class SlotMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool = SlotPool()
        self.log: list[Event] = []
        # Per slot number ever seen: the highest generation, and whether it
        # was reset (free) since its last use.
        self.top_gen: dict[int, int] = {}
        self.reset_since_use: dict[int, bool] = {}
        # When each committed or leased slot was last used (committed or
        # leased), by a tick of this model's own: eviction takes the oldest.
        self.used: dict[int, int] = {}
        self.tick = 0
        self._commit(self.pool.check_pool_opened(6, 4096, "pool-0", True))

    # ------------------------------------------------------------ plumbing

    def _apply_logged(self, event: Event) -> None:
        """Apply one event; on success log it and check the before/after rules."""
        pool = self.pool
        named = getattr(event, "slots", ())
        if not isinstance(named, tuple):
            named = ()
        inside = [s for s in named if 0 <= s < pool.size]
        leased_before = {s: dict(pool.leases(s)) for s in inside}
        state_before = {s: pool.state(s) for s in inside}
        gen_before = {s: pool.generation(s) for s in inside}
        pool.apply(event)
        self.log.append(event)
        hyp_event(f"{type(event).__name__} {getattr(event, 'why', '')}".strip())
        if isinstance(event, SlotsEvicted | SlotsReset):
            for s in event.slots:
                assert not leased_before[s], f"slot {s} had leases {leased_before[s]}"
        if isinstance(event, SlotsGranted):
            for s in event.slots:
                assert state_before[s] is FREE
                assert self.reset_since_use[s], f"slot {s} granted without a reset"
                self.reset_since_use[s] = False
        if isinstance(event, SlotsReset):
            for s in event.slots:
                self.reset_since_use[s] = True
                assert pool.generation(s) == gen_before[s] + 1
        if isinstance(event, SlotsCommitted | SlotsLeased):
            for s in event.slots:
                self.tick += 1
                self.used[s] = self.tick
        if isinstance(event, SlotsEvicted):
            for s in event.slots:
                del self.used[s]
                if event.why == "condemned":
                    assert pool.is_condemned(s)
        if isinstance(event, SlotsCondemned):
            for s in event.slots:
                assert pool.is_condemned(s) and pool.state(s) is state_before[s]
                assert dict(pool.leases(s)) == leased_before[s]  # leases kept
                ident = pool.key(s)
                assert ident is not None and pool.where(*ident) != s
        if isinstance(event, SlotsReset):
            for s in event.slots:
                assert not pool.is_condemned(s)
        if isinstance(event, PoolOpened):
            # A slot a smaller pool dropped is new memory when it comes back
            # (a new pool, or a file cut and extended: zeros).
            for s in [s for s in self.reset_since_use if s >= pool.size]:
                del self.reset_since_use[s]
            assert not [s for s in self.used if s >= pool.size]  # evicted before
            for s in range(pool.size):
                self.reset_since_use.setdefault(s, True)

    def _commit(self, events: list | Event | None) -> None:
        if events is None:
            return
        for event in events if isinstance(events, list) else [events]:
            before = self.pool.snapshot()
            try:
                self._apply_logged(event)
            except Refusal as exc:
                assert self.pool.snapshot() == before
                raise ContractViolation(f"core returned {event!r}, then refused it: {exc}") from exc

    def _ask(self, question, *args) -> object:  # type: ignore[no-untyped-def]
        """A check: a refusal changes nothing; an answer is committed."""
        before = self.pool.snapshot()
        try:
            answer = question(*args)
        except Refusal as exc:
            assert self.pool.snapshot() == before, "a refusal changed the pool"
            hyp_event(f"refused {exc.reason.value}")
            return None
        assert self.pool.snapshot() == before, "a check changed the pool"
        if isinstance(answer, tuple):  # check_lease: (event, answers)
            self._commit(answer[0])
        else:
            self._commit(answer)  # type: ignore[arg-type]
        return answer

    def _slots_in(self, *states: SlotState) -> list[int]:
        return [s for s in range(self.pool.size) if self.pool.state(s) in states]

    # --------------------------------------------------------------- rules

    @rule(holder=holder_st, n=st.integers(0, 4))
    def grant(self, holder: str, n: int) -> None:
        self._ask(self.pool.check_grant, holder, n)

    @rule(holder=holder_st, ns=ns_st, data=st.data())
    def store(self, holder: str, ns: str, data: st.DataObject) -> None:
        """Mostly the holder's own granted slots; now and then another's, a free or
        committed one, one outside the pool, or an old generation."""
        pool = self.pool
        mine = [s for s in self._slots_in(SlotState.GRANTED) if pool.holder(s) == holder]
        if data.draw(st.integers(0, 3)):
            if not mine:
                return
            picks = data.draw(st.lists(st.sampled_from(mine), min_size=1, max_size=4, unique=True))
            wrong = False
        else:
            others = [-1, 0, 7, *self._slots_in(SlotState.GRANTED, COMMITTED)]
            picks = data.draw(st.lists(st.sampled_from([*mine, *others]), max_size=4))
            wrong = data.draw(st.booleans())
        items = []
        for slot in picks:
            gen = pool.generation(slot) if 0 <= slot < pool.size else 0
            items.append((slot, gen + wrong, data.draw(key_st), data.draw(st.binary(max_size=4))))
        self._ask(pool.check_store, holder, ns, items)

    @rule(
        writer=holder_st,
        reader=holder_st,
        ns=ns_st,
        keys=st.lists(key_st, min_size=1, max_size=3),
        give_back=st.booleans(),
        bad_digest=st.integers(0, 3),
    )
    def session(
        self,
        writer: str,
        reader: str,
        ns: str,
        keys: list[bytes],
        give_back: bool,
        bad_digest: int,
    ) -> None:
        """The path an engine takes: grant, store, then a reader leases (and gives back);
        now and then the reader's digest differs: it condemns what it leased first, and
        the daemon evicts what no lease holds after the unlease."""
        self.store_keys(writer, ns, keys)
        answer = self._ask(self.pool.check_lease, reader, ns, keys)
        if isinstance(answer, tuple) and answer[0] is not None:
            leased = answer[0]
            pairs = list(zip(leased.slots, leased.generations, strict=True))
            if bad_digest < 2:
                self._ask(self.pool.check_condemn, reader, pairs)
                for slot, _ in pairs:
                    ident = self.pool.key(slot)
                    assert ident is not None
                    (hit,) = self.pool.check_lease(reader, ident[0], [ident[1]])[1]
                    assert hit is None or hit[0] != slot, f"condemned slot {slot} handed out again"
            if not bad_digest:  # the engine recomputes and stores the keys again
                self.store_keys(writer, ns, keys)
            if give_back:
                self._ask(self.pool.check_unlease, reader, pairs)
                self._ask(self.pool.check_evict_condemned)

    def store_keys(self, writer: str, ns: str, keys: list[bytes]) -> None:
        granted = self._ask(self.pool.check_grant, writer, len(keys))
        if isinstance(granted, SlotsGranted):
            items = [
                (s, g, key, b"d")
                for s, g, key in zip(granted.slots, granted.generations, keys, strict=False)
            ]
            self._ask(self.pool.check_store, writer, ns, items)

    @rule(holder=holder_st, ns=ns_st, keys=st.lists(key_st, max_size=4))
    def lease(self, holder: str, ns: str, keys: list[bytes]) -> None:
        answer = self._ask(self.pool.check_lease, holder, ns, keys)
        if answer is not None:
            _, hits = answer  # type: ignore[misc]
            for key, hit in zip(keys, hits, strict=True):
                assert (hit is None) == (self.pool.where(ns, key) is None)

    @rule(holder=holder_st, data=st.data())
    def unlease(self, holder: str, data: st.DataObject) -> None:
        pool = self.pool
        held = [s for s in self._slots_in(LEASED) for _ in range(pool.leases(s).get(holder, 0))]
        picks = data.draw(st.lists(st.sampled_from([*held, 0, 5]), min_size=1, max_size=4))
        stale = data.draw(st.integers(0, 9)) == 0
        items = [(s, (pool.generation(s) if 0 <= s < pool.size else 0) + stale) for s in picks]
        self._ask(pool.check_unlease, holder, items)
        if data.draw(st.booleans()):  # as the daemon does after each unlease
            self._ask(pool.check_evict_condemned)

    @rule(holder=holder_st, data=st.data())
    def condemn(self, holder: str, data: st.DataObject) -> None:
        """A reader's digest differed: mostly a slot it leases, now and then a committed,
        condemned, evicted or free one, one outside the pool, or an old generation."""
        pool = self.pool
        mine = [s for s in self._slots_in(LEASED) if pool.leases(s).get(holder)]
        if mine and data.draw(st.integers(0, 3)):
            picks = data.draw(st.lists(st.sampled_from(mine), min_size=1, max_size=2))
        else:
            others = [-1, 0, 7, *self._slots_in(COMMITTED, SlotState.EVICTED, SlotState.GRANTED)]
            picks = data.draw(st.lists(st.sampled_from([*mine, *others]), min_size=1, max_size=3))
        stale = data.draw(st.integers(0, 9)) == 0
        items = [(s, (pool.generation(s) if 0 <= s < pool.size else 0) + stale) for s in picks]
        self._ask(pool.check_condemn, holder, items)

    @rule()
    def evict_condemned(self) -> None:
        self._ask(self.pool.check_evict_condemned)
        assert not [s for s in self.pool.condemned() if self.pool.state(s) is COMMITTED]

    @rule(n=st.integers(0, 3), why=st.sampled_from(["lru", "lru", "operator", "bogus"]))
    def evict(self, n: int, why: str) -> None:
        self._ask(self.pool.check_evict, n, why)

    @rule(why=st.sampled_from(["reset_cache", "operator"]))
    def evict_all(self, why: str) -> None:
        self._ask(self.pool.check_evict_all, why)

    @rule(data=st.data())
    def reset(self, data: st.DataObject) -> None:
        evicted = self.pool.evicted()
        if evicted and data.draw(st.booleans()):
            slots = evicted[: data.draw(st.integers(1, len(evicted)))]
        else:
            slots = data.draw(st.lists(slot_st, min_size=1, max_size=3))
        self._ask(self.pool.check_reset, slots)

    @rule(data=st.data())
    def discard_not_zero(self, data: st.DataObject) -> None:
        granted = self._slots_in(SlotState.GRANTED)
        slots = [data.draw(st.sampled_from(granted))] if granted else [data.draw(slot_st)]
        self._ask(self.pool.check_discard, slots, "not_zero")

    @rule(holder=holder_st)
    def abandon(self, holder: str) -> None:
        self._ask(self.pool.abandon, holder)
        assert not any(self.pool.leases(s).get(holder) for s in range(self.pool.size))

    @rule(
        survived=st.booleans(),
        size=st.sampled_from([6, 6, 6, 4, 8]),
        pool_id=st.sampled_from(["pool-0", "pool-0", "pool-1"]),
    )
    def restart(self, survived: bool, size: int, pool_id: str) -> None:
        self._ask(self.pool.on_restart)
        assert self.pool.counts()[LEASED] == 0
        self._ask(self.pool.check_pool_opened, size, 4096, pool_id, survived)
        assert (self.pool.size, self.pool.pool_id) == (size, pool_id)

    @rule(
        kind=st.sampled_from(
            [
                SlotsGranted,
                SlotsStored,
                SlotsCommitted,
                SlotsDiscarded,
                SlotsLeased,
                SlotsUnleased,
                SlotsEvicted,
                SlotsCondemned,
                SlotsReset,
            ]
        ),
        holder=holder_st,
        data=st.data(),
    )
    def raw_record(self, kind: type, holder: str, data: st.DataObject) -> None:
        """A record straight from a (damaged) journal: refused, or legal by the table.

        Half of them name one slot in use (leased, committed, evicted, ...) at
        its generation, by its writer or one of its readers, where only the
        table can refuse; the rest any slots, generations and holder."""
        pool = self.pool
        busy = [s for s in range(pool.size) if pool.state(s) is not FREE]
        if busy and data.draw(st.booleans()):
            slot = data.draw(st.sampled_from(busy))
            slots, gens = [slot], (pool.generation(slot),)
            holder = data.draw(st.sampled_from([*pool.leases(slot), pool.holder(slot) or holder]))
        else:
            slots = data.draw(st.lists(slot_st, min_size=1, max_size=2))
            gens = tuple(
                pool.generation(s) if 0 <= s < pool.size and data.draw(st.integers(0, 4)) else 0
                for s in slots
            )
        slots_t = tuple(slots)
        keys = tuple(data.draw(key_st) for _ in slots)
        digests = (b"",) * len(slots)
        make = {
            SlotsGranted: lambda: SlotsGranted(holder, slots_t, gens),
            SlotsStored: lambda: SlotsStored(
                holder, data.draw(ns_st), slots_t, gens, keys, digests
            ),
            SlotsCommitted: lambda: SlotsCommitted(slots_t, gens),
            SlotsDiscarded: lambda: SlotsDiscarded(slots_t, gens, "abandoned"),
            SlotsLeased: lambda: SlotsLeased(holder, slots_t, gens),
            SlotsUnleased: lambda: SlotsUnleased(holder, slots_t, gens),
            SlotsEvicted: lambda: SlotsEvicted(slots_t, gens, "lru"),
            SlotsCondemned: lambda: SlotsCondemned(holder, slots_t, gens, "bad_digest"),
            SlotsReset: lambda: SlotsReset(slots_t, gens),
        }
        event = make[kind]()
        before = pool.snapshot()
        try:
            self._apply_logged(event)
        except Refusal as exc:
            assert pool.snapshot() == before, "a refused record changed the pool"
            hyp_event(f"raw {kind.__name__} refused {exc.reason.value}")

    # ---------------------------------------------------------- invariants

    @invariant()
    def a_key_maps_to_one_published_slot_and_back(self) -> None:
        pool = self.pool
        published: dict[tuple[str, bytes], int] = {}
        for s in range(pool.size):
            if pool.state(s) in (COMMITTED, LEASED):
                ident = pool.key(s)
                assert ident is not None
                if pool.is_condemned(s):
                    assert pool.where(*ident) != s, f"condemned slot {s} is found by {ident}"
                    continue
                assert ident not in published, f"{ident} in slots {published[ident]} and {s}"
                published[ident] = s
                assert pool.where(*ident) == s
        assert pool.index_size() == len(published)

    @invariant()
    def condemned_slots_are_committed_leased_or_evicted(self) -> None:
        pool = self.pool
        for s in pool.condemned():
            assert pool.state(s) in (COMMITTED, LEASED, SlotState.EVICTED), s

    @invariant()
    def leases_and_states_agree(self) -> None:
        pool = self.pool
        for s in range(pool.size):
            leases = pool.leases(s)
            assert (pool.state(s) is LEASED) == bool(leases)
            assert all(count > 0 for count in leases.values())

    @invariant()
    def generations_only_grow(self) -> None:
        for s in range(self.pool.size):
            gen = self.pool.generation(s)
            assert gen >= self.top_gen.get(s, 0), (s, gen, self.top_gen[s])
            self.top_gen[s] = gen

    @invariant()
    def eviction_takes_the_least_recently_used_unleased_slots(self) -> None:
        pool = self.pool
        assert set(self.used) == set(self._slots_in(COMMITTED, LEASED))
        # Condemned ones first (lowest numbers first), then least recently used.
        condemned = [s for s in self._slots_in(COMMITTED) if pool.is_condemned(s)]
        rest = [s for s in self._slots_in(COMMITTED) if not pool.is_condemned(s)]
        unleased = condemned + sorted(rest, key=self.used.__getitem__)
        for n in (1, 2, 5):
            chosen = pool.check_evict(n)
            assert (chosen.slots if chosen else ()) == tuple(unleased[:n])

    @invariant()
    def counts_add_up(self) -> None:
        pool = self.pool
        counts = pool.counts()
        assert sum(counts.values()) == pool.size
        for state in SlotState:
            assert counts[state] == len(self._slots_in(state)), state
        assert pool.free_count() == counts[FREE]
        assert sorted(pool.evicted()) == self._slots_in(SlotState.EVICTED)

    @invariant()
    def replay_and_the_snapshot_codec_rebuild_the_same_pool(self) -> None:
        replayed = SlotPool()
        for event in self.log:
            replayed.apply(event)
        snapshot = self.pool.snapshot()
        assert replayed.snapshot() == snapshot
        registry = Registry()
        for event in self.log:
            registry.apply(event, 0.0)
        encoded = registry.snapshot(len(self.log))
        back = Registry.from_snapshot(decode_snapshot(encode_snapshot(encoded)))
        assert back.slots.snapshot() == snapshot
        # What the next checks answer does not depend on how the pool was built.
        for pool in (replayed, back.slots):
            assert pool.check_grant("x", 3) == self.pool.check_grant("x", 3)
            assert pool.check_evict(3) == self.pool.check_evict(3)
            assert pool.check_evict_condemned() == self.pool.check_evict_condemned()


SlotMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestSlotMachine = SlotMachine.TestCase
