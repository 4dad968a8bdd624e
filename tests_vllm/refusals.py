"""The one refusal a refused pairing leaves in the prefill daemon's journal.

The prefill connector registers its push and then says kv_ready, two calls
apart. The decode's registration may land between them: the daemon refuses
the pairing and fails the transfer, and the kv_ready that follows is refused
too (nothing is ready to push in a failed transfer). That second refusal is
a race the journal records truthfully, not a second fault, so the checks
below accept it and nothing else.
"""

from __future__ import annotations

from collections.abc import Sequence

from schemas.events import Event, Refused
from schemas.reasons import Reason

KV_READY_AFTER_FAILURE = "KvReady is not allowed in state failed"


def the_pairing_refusal(events: Sequence[Event]) -> Refused:
    """The single fingerprint refusal in a pusher's journal; fails on any other refusal."""
    refusals = [e for e in events if isinstance(e, Refused)]
    pairing = [e for e in refusals if e.reason is Reason.FINGERPRINT_MISMATCH]
    assert len(pairing) == 1, events
    refused = pairing[0]
    for other in refusals:
        if other is not refused:
            assert other.reason is Reason.ILLEGAL_TRANSITION, events
            assert KV_READY_AFTER_FAILURE in other.message, events
    return refused
