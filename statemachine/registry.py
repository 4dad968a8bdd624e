"""The node registry: every live request of one daemon, and who owns which block.

Sans-IO in the style of h11: the shell asks a ``check_*``/``plan_*`` method
what should happen, which either raises a :class:`Refusal` (nothing changed)
or returns event bodies; the shell stamps and journals those events, then
feeds each one to :meth:`Registry.apply`, the only method that mutates. Replay
calls the same :meth:`apply` with the journaled events, so the live registry
and the replayed one are built by the same code (ARCHITECTURE.md, invariant 8).

Refusal rules enforced here:

* an unknown engine, a duplicate live request id, a stale incarnation (one
  covered by a tombstone), a group-count mismatch, block ids outside the
  engine's declared range, a block listed twice;
* a receiver's destination block already owned by another live request
  (invariant 1: one owner per destination block);
* more offload slots than the engine's pool has free: slots are granted
  here, lowest free index first, never one a live request holds, and the
  grant is journaled in ``Registered``, so replay restores who holds which
  slot after a crash (the shell zeroes a slot before it is granted again);
* a release while a write may be in flight is deferred, never honoured
  (invariant 2).

The node's offload tier (its pool of slots and their content index) is
:class:`statemachine.slots.SlotPool`, ``Registry.slots``: every slot event
is folded there, and it travels in the registry's snapshot.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence, Set
from typing import Any

from schemas.events import (
    Blocks,
    DaemonStarted,
    EngineAttached,
    EngineDetached,
    Event,
    Failed,
    Held,
    KvMismatch,
    KvReady,
    PeerRegistered,
    PoolOpened,
    QuarantineCleared,
    Refused,
    Registered,
    RequestEvent,
    SlotsCommitted,
    SlotsCondemned,
    SlotsDiscarded,
    SlotsEvicted,
    SlotsGranted,
    SlotsLeased,
    SlotsReset,
    SlotsStored,
    SlotsUnleased,
    Trimmed,
)
from schemas.fingerprint import Fingerprint
from schemas.layout import EngineLayout, GroupKind, Role
from schemas.reasons import Reason
from schemas.state import (
    Deadlines,
    PendingPeer,
    Quarantined,
    RegistrySnapshot,
    RequestRecord,
    State,
)
from statemachine import content as block_content
from statemachine.errors import IllegalTransition, Refusal
from statemachine.fingerprint import check_fingerprints
from statemachine.quarantine import (
    Landed,
    PairingKey,
    RecentReleases,
    check_quarantine,
    landed,
    moved_kv,
    pairing_key,
    quarantined_by,
)
from statemachine.reactions import Stimulus, Why, react, react_pending
from statemachine.slots import SlotPool
from statemachine.tombstones import Tombstones
from statemachine.transitions import apply as apply_transition
from statemachine.transitions import deadline_seconds
from statemachine.trim import apply_prefix_caching, to_kernel_blocks

DEFAULT_TOMBSTONE_LIMIT = 100_000

_ONE_POOL: tuple[int, ...] = (0,)  # a one-group engine's pools
_BlockKey = tuple[str, int]  # (engine id, pool: the group whose block ids name the memory)

# Module constants, not Enum attribute lookups: replay folds millions of
# events, and each Enum class attribute access costs ~70 ns on 3.11.
PUSHER, RECEIVER = Role.PUSHER, Role.RECEIVER
REGISTERED, TRIMMED, WRITING = State.REGISTERED, State.TRIMMED, State.WRITING
DONE, RELEASED, FAILED = State.DONE, State.RELEASED, State.FAILED


def attention_ratio(layout: EngineLayout) -> int:
    """Kernel blocks per logical block of the engine's attention groups."""
    ratios = {g.per_logical for g in layout.groups if g.kind is GroupKind.ATTENTION}
    return max(ratios, default=1)


def expand_blocks(layout: EngineLayout, logical: Sequence[Sequence[int]]) -> Blocks:
    """Logical ids per group -> kernel ids per group (SSM groups are not expanded)."""
    return tuple(
        tuple(ids)
        if group.kind is GroupKind.SSM
        else tuple(to_kernel_blocks(ids, group.per_logical))
        for group, ids in zip(layout.groups, logical, strict=True)
    )


def validate_layout(layout: EngineLayout) -> None:
    if not layout.engine_id:
        raise Refusal(Reason.UNKNOWN_ENGINE, "engine id must not be empty")
    if not layout.groups:
        raise Refusal(Reason.GROUP_COUNT_MISMATCH, f"engine {layout.engine_id} declares no groups")
    if layout.offload_slots < 0:
        raise Refusal(
            Reason.BAD_SLOT,
            f"engine {layout.engine_id}: offload_slots must be >= 0, got {layout.offload_slots}",
        )
    for g, group in enumerate(layout.groups):
        if group.num_blocks < 0 or group.per_logical < 1:
            raise Refusal(
                Reason.BLOCK_OUT_OF_RANGE,
                f"engine {layout.engine_id} group {g}: num_blocks must be >= 0 and "
                f"per_logical >= 1 (got {group.num_blocks}, {group.per_logical})",
            )
        if group.overlays >= 0:
            _check_overlay(layout, g)


def _check_overlay(layout: EngineLayout, g: int) -> None:
    """A group laid over another's memory names an earlier group of its own, equal in blocks."""
    group = layout.groups[g]
    under = layout.groups[group.overlays] if group.overlays < g else None
    if under is None or under.overlays >= 0 or under.num_blocks != group.num_blocks:
        raise Refusal(
            Reason.GROUP_COUNT_MISMATCH,
            f"engine {layout.engine_id} group {g} overlays group {group.overlays}: it must be "
            f"an earlier group with memory of its own and as many blocks",
        )


def _check_expansion_fits(
    layout: EngineLayout, logical: Sequence[Sequence[int]], request_id: str
) -> None:
    """Refuse lists that cannot fit before expanding them.

    Kernel blocks must be distinct and below ``num_blocks``, so no group may
    expand to more than ``num_blocks`` ids; checking after expansion let a
    300-byte request with a huge ``per_logical`` build millions of ids first.
    """
    for g, (group, ids) in enumerate(zip(layout.groups, logical, strict=True)):
        per = 1 if group.kind is GroupKind.SSM else group.per_logical
        if len(ids) * per > group.num_blocks:
            raise Refusal(
                Reason.BLOCK_OUT_OF_RANGE,
                f"request {request_id}: group {g} lists {len(ids)} blocks of {per} kernel "
                f"blocks each, more than the engine's {group.num_blocks}",
            )


def check_blocks(layout: EngineLayout, blocks: Blocks, what: str) -> None:
    """Kernel block ids per group: one list per group, each id in range, none twice.

    The one block check, for live registrations and for replay alike. Replay
    runs it on every registration again, so the text of a refusal is only
    built for a list that is refused.
    """
    groups = layout.groups
    if len(blocks) != len(groups):
        raise Refusal(
            Reason.GROUP_COUNT_MISMATCH,
            f"{what} lists {len(blocks)} groups, engine {layout.engine_id} has {len(groups)}",
        )
    for group, ids in zip(groups, blocks, strict=True):
        if not ids:
            continue
        ordered = sorted(ids)  # one call for both ends: cheaper than min() and max()
        if ordered[0] < 0 or ordered[-1] >= group.num_blocks or len(set(ids)) != len(ids):
            _refuse_blocks(layout, blocks.index(ids), ordered, what)
    if any(group.overlays >= 0 for group in groups):
        _check_overlaid(layout, blocks, what)


def _check_overlaid(layout: EngineLayout, blocks: Blocks, what: str) -> None:
    """No block twice across groups laid over one memory: it would be one block written twice."""
    seen: dict[tuple[int, int], int] = {}
    for g, (group, ids) in enumerate(zip(layout.groups, blocks, strict=True)):
        pool = group.pool(g)
        for block in ids:
            other = seen.setdefault((pool, block), g)
            if other != g:
                raise Refusal(
                    Reason.DUPLICATE_BLOCK,
                    f"{what}: groups {other} and {g} both list block {block}, one memory "
                    f"in engine {layout.engine_id}",
                )


def _refuse_blocks(layout: EngineLayout, g: int, ordered: list[int], what: str) -> None:
    group = layout.groups[g]
    lo, hi = ordered[0], ordered[-1]
    if lo < 0 or hi >= group.num_blocks:
        raise Refusal(
            Reason.BLOCK_OUT_OF_RANGE,
            f"{what}: group {g} block {lo if lo < 0 else hi} is outside engine "
            f"{layout.engine_id}'s range 0..{group.num_blocks - 1}",
        )
    raise Refusal(Reason.DUPLICATE_BLOCK, f"{what}: group {g} lists a block twice")


class Registry:
    """Live requests, engines, block ownership and tombstones of one node."""

    def __init__(
        self,
        *,
        deadlines: Deadlines | None = None,
        tombstone_limit: int = DEFAULT_TOMBSTONE_LIMIT,
    ) -> None:
        self.deadlines = deadlines or Deadlines()
        self._seconds = deadline_seconds(self.deadlines)
        self.engines: dict[str, EngineLayout] = {}
        self.live: dict[str, RequestRecord] = {}
        self.pending: dict[str, PendingPeer] = {}
        self.tombstones = Tombstones(tombstone_limit)
        # Destination-block ownership, receivers only: (engine, pool) -> block -> request.
        self._owners: dict[_BlockKey, dict[int, str]] = {}
        # Offload slots held by live requests, both ways: engine -> slot ->
        # request, and request -> its slots (in grant order).
        self._slot_holders: dict[str, dict[int, str]] = {}
        self._granted: dict[str, tuple[int, ...]] = {}
        # Pairings whose KV disagreed in behaviour (statemachine/quarantine.py),
        # and the last released transfers, which a late mismatch report names.
        self.quarantine: dict[PairingKey, Quarantined] = {}
        self.recent = RecentReleases()
        # The node's offload tier: its slots, their lifecycle and the content
        # index (statemachine/slots.py); the slot events fold there.
        self.slots = SlotPool()

    # ------------------------------------------------------------------ queries

    def get(self, request_id: str) -> RequestRecord | None:
        return self.live.get(request_id)

    def owner_of(self, engine_id: str, group: int, block: int) -> str | None:
        layout = self.engines.get(engine_id)
        pool = layout.groups[group].pool(group) if layout is not None else group
        return self._owners.get((engine_id, pool), {}).get(block)

    def owned_blocks(self) -> dict[_BlockKey, dict[int, str]]:
        return {key: dict(owners) for key, owners in self._owners.items() if owners}

    def offload_slots(self, request_id: str) -> tuple[int, ...]:
        """The offload slots a live request holds (none once it is released)."""
        return self._granted.get(request_id, ())

    def slots_held(self, engine_id: str) -> dict[int, str]:
        """Slot -> live request holding it, for one engine's offload pool."""
        return dict(self._slot_holders.get(engine_id, {}))

    def lookup(self, request_id: str, incarnation: int) -> RequestRecord:
        """The live record for exactly this incarnation, or a typed refusal."""
        record = self.live.get(request_id)
        if record is not None and record.incarnation == incarnation:
            return record
        if self.tombstones.covers(request_id, incarnation) or (
            record is not None and incarnation < record.incarnation
        ):
            raise Refusal(
                Reason.STALE_INCARNATION,
                f"request {request_id}#{incarnation} was already released",
            )
        raise Refusal(Reason.UNKNOWN_REQUEST, f"no live request {request_id}#{incarnation}")

    def expired(self, now: float) -> list[RequestRecord | PendingPeer]:
        """Live records and pending peer registrations whose deadline has passed."""
        due: list[RequestRecord | PendingPeer] = [
            r for r in self.live.values() if r.deadline <= now
        ]
        if self.pending:
            pending_due = self.pending_due
            due.extend(p for p in self.pending.values() if pending_due(p) <= now)
        return due

    def next_deadline(self) -> float | None:
        """The earliest deadline of a live record or pending registration (None: none)."""
        due = [r.deadline for r in self.live.values()]
        due.extend(map(self.pending_due, self.pending.values()))
        return min(due, default=None)

    def pending_due(self, pending: PendingPeer) -> float:
        """When a pending receiver registration fails if no engine here registers it.

        One made from the prefill's answer (``answered``: the prefill engine
        finished the request and registers its push within a step or two)
        waits ``answered``, at most ``registered``: past that, this prefill
        never had the transfer (``react_pending``, ``unknown_request``). One
        sent with the prefill's leg waits ``registered``: the prefill may not
        even have started the request.
        """
        deadlines = self.deadlines
        if pending.registration.answered:
            return pending.received_at + min(deadlines.answered, deadlines.registered)
        return pending.received_at + deadlines.registered

    # ------------------------------------------------------------- validation

    def _engine(self, engine_id: str) -> EngineLayout:
        layout = self.engines.get(engine_id)
        if layout is None:
            raise Refusal(Reason.UNKNOWN_ENGINE, f"engine {engine_id!r} is not registered")
        return layout

    def _check_new_key(self, request_id: str, incarnation: int) -> None:
        live = self.live.get(request_id)
        if live is not None:
            raise Refusal(
                Reason.DUPLICATE_REQUEST,
                f"request {request_id} is already live as incarnation {live.incarnation} "
                f"({live.state.value})",
            )
        if self.tombstones.covers(request_id, incarnation):
            raise Refusal(
                Reason.STALE_INCARNATION,
                f"request {request_id}#{incarnation} was already released "
                f"(latest released incarnation {self.tombstones.get(request_id)})",
            )

    def _check_pending(self, request_id: str, incarnation: int, role: Role) -> None:
        pending = self.pending.get(request_id)
        if pending is None:
            return
        if role is not PUSHER:
            raise Refusal(
                Reason.ROLE_MISMATCH,
                f"request {request_id}: a receiver registration for it is pending here",
            )
        if pending.registration.incarnation != incarnation:
            raise Refusal(
                Reason.DUPLICATE_REQUEST,
                f"request {request_id}: pending receiver registration is incarnation "
                f"{pending.registration.incarnation}, not {incarnation}",
            )

    def _pools(self, engine_id: str) -> tuple[int, ...]:
        """Each group's pool: the group whose block ids name its memory (its own, mostly)."""
        groups = self.engines[engine_id].groups
        if len(groups) == 1:
            # The common case, on the apply path of every receiver: no tuple built.
            return _ONE_POOL
        return tuple(group.pool(g) for g, group in enumerate(groups))

    def _check_unowned(self, engine_id: str, blocks: Blocks, request_id: str) -> None:
        pools = self._pools(engine_id)
        for g, ids in enumerate(blocks):
            owners = self._owners.get((engine_id, pools[g]))
            if not owners or owners.keys().isdisjoint(ids):
                continue  # none of these blocks is anyone's (the common case, checked in C)
            for block in ids:
                owner = owners.get(block)
                if owner is not None and owner != request_id:
                    raise Refusal(
                        Reason.BLOCKS_OWNED,
                        f"engine {engine_id} group {g} block {block} is owned by live "
                        f"request {owner}",
                    )

    def check_attach(self, layout: EngineLayout) -> EngineAttached:
        validate_layout(layout)
        current = self.engines.get(layout.engine_id)
        if current is not None and current != layout and self._engine_busy(layout.engine_id):
            raise Refusal(
                Reason.ENGINE_IN_USE,
                f"engine {layout.engine_id} has live requests; its layout cannot change",
            )
        return EngineAttached(layout)

    def check_detach(self, engine_id: str) -> EngineDetached:
        self._engine(engine_id)
        if self._engine_busy(engine_id):
            raise Refusal(Reason.ENGINE_IN_USE, f"engine {engine_id} has live requests")
        return EngineDetached(engine_id)

    def _engine_busy(self, engine_id: str) -> bool:
        return any(r.engine_id == engine_id for r in self.live.values())

    def check_register(
        self,
        request_id: str,
        incarnation: int,
        role: Role,
        engine_id: str,
        peer: str,
        logical_blocks: Sequence[Sequence[int]],
        offload_slots: int = 0,
        unavailable: Set[int] = frozenset(),
        content: str = "",
        answered: bool = False,
    ) -> Registered:
        """Validate a local engine's registration; blocks are logical ids.

        ``offload_slots`` slots of the engine's offload pool are granted too
        (:meth:`_grant`); ``unavailable`` are slots the shell cannot hand out
        yet although no live request holds them (released, not yet zeroed).
        ``content`` names what the blocks hold (checked at the pairing).
        ``answered``: a receiver registered from the prefill's answer
        (:meth:`pending_due`); a pusher's is not kept.
        """
        layout = self._engine(engine_id)
        self._check_new_key(request_id, incarnation)
        self._check_pending(request_id, incarnation, role)
        if len(logical_blocks) != len(layout.groups):
            raise Refusal(
                Reason.GROUP_COUNT_MISMATCH,
                f"request {request_id} lists {len(logical_blocks)} groups, engine "
                f"{engine_id} has {len(layout.groups)}",
            )
        if any(lid < 0 for ids in logical_blocks for lid in ids):
            raise Refusal(Reason.BLOCK_OUT_OF_RANGE, f"request {request_id}: negative block id")
        _check_expansion_fits(layout, logical_blocks, request_id)
        # Block hashes name exactly the blocks listed (statemachine/content.py).
        block_content.check_counts(request_id, content, tuple(map(len, logical_blocks)))
        event = Registered(
            request_id,
            incarnation,
            role,
            engine_id,
            peer,
            expand_blocks(layout, logical_blocks),
            self._grant(layout, request_id, offload_slots, unavailable) if offload_slots else (),
            content,
            answered and role is RECEIVER,
        )
        self._check_registered(event)
        return event

    def _grant(
        self, layout: EngineLayout, request_id: str, count: int, unavailable: Set[int]
    ) -> tuple[int, ...]:
        """``count`` free offload slots of the engine's pool, lowest index first.

        Free means held by no live request (whatever the shell's pool says:
        after a restart the shell's pool is new, the journal is not) and not
        ``unavailable``. Lowest first keeps grants deterministic.
        """
        if count < 0:
            raise Refusal(
                Reason.BAD_SLOT, f"request {request_id}: offload_slots must be >= 0, got {count}"
            )
        engine_id, size = layout.engine_id, layout.offload_slots
        if not size:
            raise Refusal(
                Reason.OFFLOAD_EXHAUSTED,
                f"request {request_id}: engine {engine_id} has no offload pool",
            )
        held = self._slot_holders.get(engine_id, {})
        free = [s for s in range(size) if s not in held and s not in unavailable]
        if len(free) < count:
            raise Refusal(
                Reason.OFFLOAD_EXHAUSTED,
                f"request {request_id}: {count} offload slots wanted, engine {engine_id} has "
                f"{len(free)} free of {size} ({len(held)} held by live requests)",
            )
        return tuple(free[:count])

    def _check_registered(self, event: Registered) -> PendingPeer | None:
        """The checks of a registration in kernel blocks, live and in replay alike.

        Returns the pending receiver registration it joins, if any. Each
        ``_check_*`` call runs only when a cheap test found something to
        refuse: replay runs this on every registration.
        """
        rid, inc, role, engine_id = event.request_id, event.incarnation, event.role, event.engine_id
        layout = self.engines.get(engine_id)
        if layout is None:
            layout = self._engine(engine_id)
        if rid in self.live or self.tombstones.covers(rid, inc):
            self._check_new_key(rid, inc)
        pending = self.pending.get(rid)
        if pending is not None:
            self._check_pending(rid, inc, role)
        check_blocks(layout, event.blocks, f"request {rid}")
        if role is RECEIVER:
            self._check_unowned(engine_id, event.blocks, rid)
        if event.offload_slots:
            self._check_slots(layout, event)
        return pending

    def _check_slots(self, layout: EngineLayout, event: Registered) -> None:
        """A journaled grant: slots of the pool, each once, none held by a live request.

        Grants made by :meth:`_grant` always pass; replay runs this on every
        journaled grant, so damage cannot make two live requests share a slot.
        """
        slots, rid, engine_id = event.offload_slots, event.request_id, event.engine_id
        ordered = sorted(slots)
        if ordered[0] < 0 or ordered[-1] >= layout.offload_slots:
            raise Refusal(
                Reason.BAD_SLOT,
                f"request {rid}: offload slots {list(slots)} are not all in engine {engine_id}'s "
                f"pool of {layout.offload_slots}",
            )
        if len(set(slots)) != len(slots):
            raise Refusal(Reason.BAD_SLOT, f"request {rid}: an offload slot is listed twice")
        held = self._slot_holders.get(engine_id)
        if held and not held.keys().isdisjoint(slots):
            slot = next(s for s in slots if s in held)
            raise Refusal(
                Reason.BAD_SLOT,
                f"request {rid}: offload slot {slot} of engine {engine_id} is held by live "
                f"request {held[slot]}",
            )

    def check_peer_registration(
        self,
        request_id: str,
        incarnation: int,
        peer: str,
        engine_id: str,
        blocks: Blocks,
        per_logical: int,
        fingerprint: Fingerprint | None = None,
        content: str = "",
        answered: bool = False,
    ) -> PeerRegistered:
        """Validate a receiver's registration forwarded by its daemon.

        One for a request released here is refused at once
        (``stale_incarnation``, its tombstone), one for a request that ended
        and is not released yet too (``illegal_transition``); one for a
        request this node does not know waits pending (:meth:`pending_due`).
        """
        record = self.live.get(request_id)
        if record is not None and record.incarnation == incarnation:
            if record.role is not PUSHER:
                raise Refusal(
                    Reason.ROLE_MISMATCH, f"request {request_id} is a receiver on this node"
                )
            if record.remote_blocks is not None:
                raise Refusal(
                    Reason.DUPLICATE_REQUEST,
                    f"request {request_id}#{incarnation}: receiver already registered",
                )
            if record.state is not REGISTERED:
                raise IllegalTransition(
                    f"request {request_id}#{incarnation}: receiver registration arrived in "
                    f"state {record.state.value}"
                )
        else:
            self._check_new_key(request_id, incarnation)
            if request_id in self.pending:
                raise Refusal(
                    Reason.DUPLICATE_REQUEST,
                    f"request {request_id}: receiver registration already pending",
                )
        if per_logical < 1:
            raise Refusal(Reason.BLOCK_OUT_OF_RANGE, f"per_logical must be >= 1, got {per_logical}")
        block_content.decode(request_id, content)  # refused if it does not parse
        return PeerRegistered(
            request_id,
            incarnation,
            peer,
            engine_id,
            blocks,
            per_logical,
            fingerprint,
            content,
            answered,
        )

    def check_hold(self, record: RequestRecord, now: float) -> Held | None:
        """The decode side's word that it will load ``record`` once it has blocks.

        The pusher then waits for its receiver until ``now`` plus its
        ``registered`` deadline, never past its registration plus ``held``
        (the operator's bound). None when that would not lengthen the wait.
        Raises :class:`Refusal` for a receiver, or a pusher whose receiver
        already registered or that left ``registered``.
        """
        if record.role is not PUSHER:
            raise Refusal(Reason.ROLE_MISMATCH, f"request {record.request_id} is a receiver here")
        until = min(now + self.deadlines.registered, record.entered_at + self.deadlines.held)
        held = Held(record.request_id, record.incarnation, until)
        apply_transition(record, held, now, self._seconds)  # refused by the table or a guard
        return held if until > record.deadline else None

    def check_kv_ready(self, record: RequestRecord) -> KvReady:
        """The prefill engine's word that the KV is computed: pushers only."""
        if record.role is not PUSHER:
            raise Refusal(Reason.ROLE_MISMATCH, f"request {record.request_id} is a receiver here")
        return KvReady(record.request_id, record.incarnation)

    def plan_trim(self, request_id: str, incarnation: int) -> Trimmed:
        """Pair the pusher's blocks with the receiver's; raises TrimRefused.

        Refused first when the two engines' fingerprints differ.
        """
        record = self.lookup(request_id, incarnation)
        if record.role is not PUSHER or record.state is not REGISTERED:
            raise IllegalTransition(
                f"request {request_id}#{incarnation}: only a registered pusher request can be "
                f"trimmed (this one is a {record.role.value} in state {record.state.value})"
            )
        if record.remote_blocks is None:
            raise IllegalTransition(
                f"request {request_id}#{incarnation}: the receiver's registration has not arrived"
            )
        layout = self._engine(record.engine_id)
        # Before any pairing: blocks of the right size from another model
        # would be written, loaded and decoded into wrong tokens.
        check_fingerprints(layout.fingerprint, record.remote_fingerprint)
        # A pairing whose KV a decode found not to be its own, by what it
        # computed, pairs no more until cleared (statemachine/quarantine.py).
        if self.quarantine:
            check_quarantine(self.quarantine, layout.fingerprint, record.remote_fingerprint)
        # Blocks meant for other KV (another prompt, adapter or input, or
        # other positions of it) are never written: the blocks' content
        # hashes must agree with the pairing the trim is about to make.
        block_content.check_pairing(request_id, record.content, record.remote_content)
        dst, src = apply_prefix_caching(
            record.remote_blocks,
            record.blocks,
            group_kinds=[g.kind for g in layout.groups],
            decode_per_logical=record.remote_per_logical,
            prefill_per_logical=attention_ratio(layout),
        )
        return Trimmed(
            request_id,
            incarnation,
            src=tuple(tuple(ids) for ids in src),
            dst=tuple(tuple(ids) for ids in dst),
            src_before=tuple(len(ids) for ids in record.blocks),
            dst_before=tuple(len(ids) for ids in record.remote_blocks),
        )

    # ------------------------------------------------------------- behaviour

    def find_landed(self, request_id: str, incarnation: int) -> Landed | None:
        """A transfer that may have moved KV, live or recently released, of exactly this
        incarnation (statemachine/quarantine.py ``moved_kv``); None if unknown here."""
        record = self.live.get(request_id)
        if record is not None and record.incarnation == incarnation:
            if not moved_kv(record):
                return None
            layout = self.engines.get(record.engine_id)
            return landed(record, layout.fingerprint if layout is not None else None)
        found = self.recent.get(request_id)
        return found if found is not None and found.incarnation == incarnation else None

    def check_kv_mismatch(
        self,
        request_id: str,
        incarnation: int,
        *,
        layer: int,
        position: int,
        difference: float,
        tolerance: float,
        detail: str = "",
    ) -> tuple[KvMismatch, Landed]:
        """A decode engine's report that a load's KV is not its own: the receiver's record.

        The receiver may be released (a late report); it must have been a
        receiver here whose data landed. Raises :class:`Refusal` otherwise.
        """
        found = self.find_landed(request_id, incarnation)
        if found is None:
            raise Refusal(
                Reason.UNKNOWN_REQUEST,
                f"kv_mismatch for {request_id}#{incarnation}: no receiver of that id is live "
                f"or recently released on this node",
            )
        if found.role is not RECEIVER:
            raise Refusal(
                Reason.ROLE_MISMATCH,
                f"kv_mismatch for {request_id}#{incarnation}: it is a pusher on this node, "
                "only a decode engine reports what it loaded",
            )
        record = self.live.get(request_id)
        if record is not None and record.incarnation == incarnation and record.state is not DONE:
            raise IllegalTransition(
                f"kv_mismatch for {request_id}#{incarnation}: no KV landed for it "
                f"(state {record.state.value})"
            )
        if difference <= tolerance:
            raise Refusal(
                Reason.ILLEGAL_TRANSITION,
                f"kv_mismatch for {request_id}#{incarnation}: the difference {difference:.6g} "
                f"is within the tolerance {tolerance:.6g}",
            )
        event = KvMismatch(
            request_id, incarnation, RECEIVER, found.engine_id, found.peer, "", layer, position,
            difference, tolerance, detail, None, found.fingerprint,
        )  # fmt: skip
        return event, found

    def check_peer_kv_mismatch(
        self,
        node: str,
        request_id: str,
        incarnation: int,
        decode_engine: str,
        *,
        layer: int,
        position: int,
        difference: float,
        tolerance: float,
        detail: str = "",
    ) -> KvMismatch:
        """The decode daemon ``node`` reports that what this node pushed was not its engine's KV.

        The pusher's record, naming both fingerprints: the pairing it quarantines.
        """
        found = self.find_landed(request_id, incarnation)
        if found is None or found.role is not PUSHER or found.peer != node:
            raise Refusal(
                Reason.UNKNOWN_REQUEST,
                f"kv_mismatch from {node} for {request_id}#{incarnation}: this node pushed no "
                "such request to it (or released it long ago)",
            )
        return KvMismatch(
            request_id, incarnation, PUSHER, found.engine_id, node,
            decode_engine or found.remote_engine, layer, position, difference, tolerance,
            detail, found.fingerprint, found.remote_fingerprint,
        )  # fmt: skip

    def check_clear(self, ids: Sequence[str], every: bool = False) -> list[QuarantineCleared]:
        """An operator's clear of the quarantined pairings ``ids`` (or of all: ``every``)."""
        by_id = {entry.id: entry for entry in self.quarantine.values()}
        unknown = [i for i in ids if i not in by_id]
        if unknown:
            raise Refusal(
                Reason.UNKNOWN_REQUEST,
                f"no quarantined pairing {', '.join(unknown)} here "
                f"(quarantined: {', '.join(sorted(by_id)) or 'none'})",
            )
        chosen = list(by_id) if every else list(dict.fromkeys(ids))
        return [
            QuarantineCleared(by_id[i].prefill_fingerprint, by_id[i].decode_fingerprint, i)
            for i in chosen
        ]

    # The rules below are the reactions table's (statemachine/reactions.py);
    # these look the request up first, as the engine's calls do.

    def plan_abort(
        self, request_id: str, incarnation: int, reason: Reason, message: str
    ) -> list[RequestEvent]:
        """Events that end a live request early (engine abort)."""
        record = self.lookup(request_id, incarnation)
        return react(record, Stimulus.ENGINE_ABORT, Why(reason, message))

    def plan_release(self, request_id: str, incarnation: int) -> list[RequestEvent]:
        """Events for an engine's release: honoured, or deferred while quarantined."""
        record = self.lookup(request_id, incarnation)
        return react(record, Stimulus.ENGINE_RELEASE)

    def follow_up(self, record: RequestRecord) -> list[RequestEvent]:
        """What ``record``'s new state calls for at once: a deferred release, now due.

        The ledger (daemon/node/ledger.py) asks after every event it applies
        and appends the answer to the same commit, so no caller can forget it.
        """
        return react(record, Stimulus.QUARANTINE_LIFTED)

    def on_deadline(self, due: RequestRecord | PendingPeer) -> RequestEvent:
        """The event that moves an expired request on towards ``released``.

        The shell must make it true before journaling it: abort the NIXL
        transfer of a pusher caught writing, and fence a receiver's peer (drop
        its link and its NIXL metadata) before ``PeerSettled(fenced=True)``.
        """
        if isinstance(due, PendingPeer):
            return react_pending(due, Stimulus.DEADLINE)[0]
        return react(due, Stimulus.DEADLINE, None)[0]

    # ------------------------------------------------------------------- fold

    def apply(self, event: Event, ts: float) -> RequestRecord | None:
        """Fold one journaled event into the registry; returns the record touched.

        Raises :class:`Refusal` (and changes nothing) if the event is not
        legal here; for a journal written by this code that means damage or a
        bug, and replay reports it.
        """
        kind = type(event)
        handler = _HANDLERS.get(kind)
        if handler is not None:
            return handler(self, event, ts)
        rid = event.request_id  # type: ignore[union-attr]
        record = self.live.get(rid)
        if record is None:
            if isinstance(event, Failed) and rid in self.pending:
                self._fail_pending(event)
                return None
            self.lookup(rid, event.incarnation)  # type: ignore[union-attr]
            raise AssertionError("unreachable: lookup raises for a missing record")
        new = apply_transition(record, event, ts, self._seconds)  # type: ignore[arg-type]
        if new.state is RELEASED:
            self._drop(new)
        else:
            self.live[rid] = new
        return new

    def _apply_registered(self, event: Registered, ts: float) -> RequestRecord:
        pending = self._check_registered(event)
        rid, inc = event.request_id, event.incarnation
        # A pusher whose receiver is already pending is claimed: it waits ``registered``.
        claimed = pending is not None and pending.registration.incarnation == inc
        wait = self.deadlines.registered if claimed else self._registered_wait(event.role)
        record = RequestRecord(
            rid, inc, event.role, event.engine_id, event.peer, REGISTERED, event.blocks, ts,
            ts + wait, content=event.content, answered=event.answered,
        )  # fmt: skip
        if event.offload_slots:
            self._hold_slots(rid, event.engine_id, event.offload_slots)
        if event.role is RECEIVER:
            self._claim(record)
        elif pending is not None:
            reg = pending.registration
            if reg.incarnation == inc:
                del self.pending[rid]
                record = apply_transition(record, reg, ts, self._seconds)
        self.live[rid] = record
        return record

    def _registered_wait(self, role: Role) -> float:
        """How long a new request may stay registered: a pusher nobody claimed, ``unclaimed``."""
        if role is PUSHER:
            return min(self.deadlines.registered, self.deadlines.unclaimed)
        return self.deadlines.registered

    def _apply_peer_registered(self, event: PeerRegistered, ts: float) -> RequestRecord | None:
        record = self.live.get(event.request_id)
        if record is not None and record.incarnation == event.incarnation:
            new = apply_transition(record, event, ts, self._seconds)
            self.live[new.request_id] = new
            return new
        self._check_new_key(event.request_id, event.incarnation)
        if event.request_id in self.pending:
            raise Refusal(Reason.DUPLICATE_REQUEST, f"request {event.request_id}: already pending")
        self.pending[event.request_id] = PendingPeer(event, ts)
        return None

    def _fail_pending(self, event: Failed) -> None:
        pending = self.pending[event.request_id]
        if pending.registration.incarnation != event.incarnation:
            self.lookup(event.request_id, event.incarnation)
        del self.pending[event.request_id]
        self.tombstones.add(event.request_id, event.incarnation)
        return None

    def _apply_attached(self, event: EngineAttached, ts: float) -> None:
        self.check_attach(event.layout)
        self.engines[event.layout.engine_id] = event.layout
        return None

    def _apply_detached(self, event: EngineDetached, ts: float) -> None:
        self.check_detach(event.engine_id)
        del self.engines[event.engine_id]
        return None

    def _apply_nothing(self, event: Event, ts: float) -> None:
        return None

    def _apply_kv_mismatch(self, event: KvMismatch, ts: float) -> None:
        key = pairing_key(event.prefill_fingerprint, event.decode_fingerprint)
        quarantined = quarantined_by(event, ts, self.quarantine.get(key))
        if quarantined is not None:
            self.quarantine[quarantined[0]] = quarantined[1]
        return None

    def _apply_quarantine_cleared(self, event: QuarantineCleared, ts: float) -> None:
        self.quarantine.pop(pairing_key(event.prefill_fingerprint, event.decode_fingerprint), None)
        return None

    def _apply_slots(self, event: Event, ts: float) -> None:
        self.slots.apply(event)
        return None

    def _claim(self, record: RequestRecord) -> None:
        owned, engine_id, request_id = self._owners, record.engine_id, record.request_id
        pools = self._pools(engine_id)
        for g, ids in enumerate(record.blocks):
            if ids:
                owners = owned.get((engine_id, pools[g]))
                if owners is None:
                    owned[(engine_id, pools[g])] = dict.fromkeys(ids, request_id)
                else:
                    owners.update(dict.fromkeys(ids, request_id))

    def _hold_slots(self, request_id: str, engine_id: str, slots: tuple[int, ...]) -> None:
        self._granted[request_id] = slots
        holders = self._slot_holders.get(engine_id)
        if holders is None:
            self._slot_holders[engine_id] = dict.fromkeys(slots, request_id)
        else:
            holders.update(dict.fromkeys(slots, request_id))

    def _drop(self, record: RequestRecord) -> None:
        # Invariant 5: nothing about a released request survives but its tombstone.
        del self.live[record.request_id]
        if self._granted:
            slots = self._granted.pop(record.request_id, None)
            if slots is not None:
                holders = self._slot_holders[record.engine_id]
                for slot in slots:
                    del holders[slot]
                if not holders:
                    del self._slot_holders[record.engine_id]
        if record.role is RECEIVER:
            owned, engine_id = self._owners, record.engine_id
            pools = self._pools(engine_id)
            for g, ids in enumerate(record.blocks):
                key = (engine_id, pools[g])
                owners = owned.get(key)
                if owners is not None:
                    pop = owners.pop
                    for block in ids:
                        pop(block, None)
                    if not owners:
                        del owned[key]
        self.tombstones.add(record.request_id, record.incarnation)
        if moved_kv(record):
            # A decode engine may report on it after the release (kv_mismatch).
            layout = self.engines.get(record.engine_id)
            self.recent.add(landed(record, layout.fingerprint if layout is not None else None))

    # -------------------------------------------------------------- snapshots

    def snapshot(self, last_seq: int) -> RegistrySnapshot:
        return RegistrySnapshot(
            last_seq=last_seq,
            engines=tuple(self.engines.values()),
            live=tuple(self.live.values()),
            pending=tuple(self.pending.values()),
            tombstones=tuple(self.tombstones),
            offload=tuple(self._granted.items()),
            quarantine=tuple(self.quarantine.values()),
            slots=self.slots.snapshot() if self.slots.opened else None,
        )

    @classmethod
    def from_snapshot(
        cls,
        snap: RegistrySnapshot,
        *,
        deadlines: Deadlines | None = None,
        tombstone_limit: int = DEFAULT_TOMBSTONE_LIMIT,
    ) -> Registry:
        registry = cls(deadlines=deadlines, tombstone_limit=tombstone_limit)
        registry.engines = {layout.engine_id: layout for layout in snap.engines}
        registry.pending = {p.registration.request_id: p for p in snap.pending}
        registry.tombstones = Tombstones(tombstone_limit, snap.tombstones)
        registry.quarantine = {
            pairing_key(q.prefill_fingerprint, q.decode_fingerprint): q for q in snap.quarantine
        }
        if snap.slots is not None:
            registry.slots = SlotPool.from_snapshot(snap.slots)
        for record in snap.live:
            registry.live[record.request_id] = record
            if record.role is RECEIVER:
                registry._claim(record)
        for request_id, slots in snap.offload:
            holder = registry.live.get(request_id)
            if holder is None:
                raise Refusal(
                    Reason.BAD_SLOT,
                    f"snapshot: request {request_id} holds offload slots but is not live",
                )
            registry._hold_slots(request_id, holder.engine_id, slots)
        return registry


def fold(events: Iterable[tuple[Event, float]], registry: Registry | None = None) -> Registry:
    """Apply ``(event, ts)`` pairs in order; the replay path of the core."""
    registry = registry if registry is not None else Registry()
    apply = registry.apply
    for event, ts in events:
        apply(event, ts)
    return registry


_HANDLERS: dict[type, Callable[[Registry, Any, float], RequestRecord | None]] = {
    Registered: Registry._apply_registered,
    PeerRegistered: Registry._apply_peer_registered,
    EngineAttached: Registry._apply_attached,
    EngineDetached: Registry._apply_detached,
    DaemonStarted: Registry._apply_nothing,
    Refused: Registry._apply_nothing,
    KvMismatch: Registry._apply_kv_mismatch,
    QuarantineCleared: Registry._apply_quarantine_cleared,
    PoolOpened: Registry._apply_slots,
    SlotsGranted: Registry._apply_slots,
    SlotsStored: Registry._apply_slots,
    SlotsCommitted: Registry._apply_slots,
    SlotsDiscarded: Registry._apply_slots,
    SlotsLeased: Registry._apply_slots,
    SlotsUnleased: Registry._apply_slots,
    SlotsEvicted: Registry._apply_slots,
    SlotsCondemned: Registry._apply_slots,
    SlotsReset: Registry._apply_slots,
}
