"""Deadlines: a request (or a peer's registration) that waited too long moves on.

What a deadline calls for is the core's (``Stimulus.DEADLINE`` in
statemachine/reactions.py); this module only keeps time and carries out the
two things that must happen before the core's answer is committed: a write
still in flight is aborted first, and a quarantine that ends is fenced first
(the peer's link closed, its agent forgotten, its windows revoked), so the
journal never says no write can land while one still can.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from daemon.node.ledger import Ledger
from daemon.node.peers import Peers
from daemon.node.transfers import Transfers
from daemon.node.windows import Windows
from schemas.events import Event, PeerRegistered
from schemas.state import PendingPeer, RequestRecord
from statemachine.reactions import Cause, Stimulus, react, react_pending

# The loop acts on a deadline at most TICK_S late, and wakes at least every
# IDLE_S (a wall-clock jump is caught then).
TICK_S = 0.05
IDLE_S = 1.0


class Deadlines:
    def __init__(
        self,
        *,
        ledger: Ledger,
        transfers: Transfers,
        peers: Peers,
        windows: Windows,
        clock: Callable[[], float],
    ) -> None:
        self._ledger = ledger
        self._transfers = transfers
        self._peers = peers
        self._windows = windows
        self._clock = clock
        self._wake_at = 0.0  # when the loop plans to wake next (clock time)
        self._moved = asyncio.Event()

    async def run(self) -> None:
        # Sleeps until the earliest deadline (no later than TICK_S after it,
        # no sooner than IDLE_S apart when nothing is live); a record whose
        # deadline falls before the planned wake-up wakes it early
        # (:meth:`observe`). An idle daemon used to wake every 100 ms for
        # nothing: most of its idle CPU.
        registry = self._ledger.registry
        while True:
            for due in registry.expired(self._clock()):
                await self._on_deadline(due)
            now = self._clock()
            nxt = registry.next_deadline()
            delay = IDLE_S if nxt is None else min(IDLE_S, nxt - now)
            delay = max(delay, TICK_S)
            self._wake_at = now + delay
            self._moved.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._moved.wait(), delay)

    def observe(self, event: Event, touched: object, ts: float) -> None:
        """Ledger observer: wake the loop for a deadline before its planned wake-up."""
        if type(touched) is RequestRecord:
            due = touched.deadline
        elif type(event) is PeerRegistered:
            # Pending (it touched no record): its own deadline, which for a
            # receiver registered from an answer is a short one.
            registry = self._ledger.registry
            pending = registry.pending.get(event.request_id)
            if pending is None:
                return
            due = registry.pending_due(pending)
        else:
            return
        if due < self._wake_at - TICK_S:
            self._wake_at = due
            self._moved.set()

    async def _on_deadline(self, due: RequestRecord | PendingPeer) -> None:
        ledger = self._ledger
        registry = ledger.registry
        if isinstance(due, PendingPeer):
            if registry.pending.get(due.registration.request_id) is due:
                await ledger.commit(react_pending(due, Stimulus.DEADLINE), Cause.DAEMON)
            return
        current = registry.get(due.request_id)
        if current is None or current != due:
            return
        events = react(current, Stimulus.DEADLINE)
        if current.request_id in self._transfers.writes:
            # Abort the NIXL transfer before saying it failed; if the write
            # ended meanwhile, the record moved on and this deadline is moot.
            await self._transfers.cancel_write(current.request_id)
            if registry.get(due.request_id) != due:
                return
        elif any(getattr(e, "fenced", False) for e in events):
            # Fence the peer before declaring no write can land any more.
            peer = current.peer
            await self._peers.fence_in_turn(peer, close_link="a quarantine deadline passed")
            current = ledger.current(due.request_id, due.incarnation)
            if current is not None:
                await ledger.react(current, Stimulus.DEADLINE)
            await self._windows.rewindow(peer)
            return
        await ledger.react(current, Stimulus.DEADLINE)
