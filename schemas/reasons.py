"""Refusal and failure reasons: stable string codes.

The codes are part of the wire protocol, the journal format and the operator's
troubleshooting table, so a code is never renamed or reused; new reasons are
only ever added.
"""

from __future__ import annotations

import enum


class Reason(enum.StrEnum):
    # Registration refusals (the request never becomes live).
    UNKNOWN_ENGINE = "unknown_engine"
    DUPLICATE_REQUEST = "duplicate_request"
    STALE_INCARNATION = "stale_incarnation"
    UNKNOWN_REQUEST = "unknown_request"
    BLOCKS_OWNED = "blocks_owned"
    BLOCK_OUT_OF_RANGE = "block_out_of_range"
    DUPLICATE_BLOCK = "duplicate_block"
    GROUP_COUNT_MISMATCH = "group_count_mismatch"
    ROLE_MISMATCH = "role_mismatch"
    ENGINE_IN_USE = "engine_in_use"
    # A receiver named its pusher's daemon by address (an on-demand peer) and
    # no authenticated link to it came up within peer_connect_timeout_s.
    PEER_UNREACHABLE = "peer_unreachable"
    # Offload slots: too few free in the engine's pool (or it has none); a
    # slot count below zero, or a journaled grant of a slot outside the pool,
    # listed twice or held by another live request (journal damage: the core
    # never grants one).
    OFFLOAD_EXHAUSTED = "offload_exhausted"
    BAD_SLOT = "bad_slot"

    # Trim refusals (the request fails before any byte is written).
    DECODE_LONGER_THAN_PREFILL = "decode_longer_than_prefill"
    SSM_COUNT_MISMATCH = "ssm_count_mismatch"
    RATIO_PADDING_EXCEEDED = "ratio_padding_exceeded"
    BLOCK_COUNT_MISMATCH = "block_count_mismatch"
    # The two engines' KV comes from different models, formats or layouts
    # (schemas/fingerprint.py): refused before anything is written.
    FINGERPRINT_MISMATCH = "fingerprint_mismatch"
    # The two sides registered different content (e.g. the digests of two
    # different prompts): the decode side's blocks are for other KV.
    CONTENT_MISMATCH = "content_mismatch"

    # Lifecycle refusals.
    ILLEGAL_TRANSITION = "illegal_transition"
    RELEASE_DEFERRED = "release_deferred"

    # Failures of a live request.
    ABORTED = "aborted"
    CANCELLED_BY_PEER = "cancelled_by_peer"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    PEER_DEAD = "peer_dead"
    TRANSFER_ERROR = "transfer_error"
    DAEMON_RESTART = "daemon_restart"
    REFUSED_BY_PEER = "refused_by_peer"
    # The receiver's checksums of the blocks that landed differ from the
    # pusher's checksums of its source blocks (verify, ARCHITECTURE.md).
    INTEGRITY_MISMATCH = "integrity_mismatch"
    # The pairing of these two engines' fingerprints is quarantined: a decode
    # recomputed a loaded prompt's last token and its K/V differed from what
    # this prefill pushed there (kv_mismatch, statemachine/quarantine.py).
    # Refused at pairing, before anything is written, until the prefill
    # engine registers with another fingerprint or an operator clears it.
    QUARANTINED = "quarantined"

    # The node's KV offload tier (statemachine/slots.py): a slot's lifecycle
    # refused. Writing a slot not granted to the writer, or a committed one;
    # reading (leasing) one not committed, or an evicted one; granting one
    # not reset since its last use; naming a slot by a generation it no
    # longer has; unleasing a slot the holder holds no lease on; evicting a
    # leased one; and malformed input (a slot out of range, lengths that
    # disagree, a key, namespace or digest too long, too many items).
    SLOT_NOT_GRANTED = "slot_not_granted"
    SLOT_COMMITTED = "slot_committed"
    SLOT_NOT_COMMITTED = "slot_not_committed"
    SLOT_EVICTED = "slot_evicted"
    SLOT_NOT_RESET = "slot_not_reset"
    SLOT_STALE = "slot_stale"
    SLOT_NOT_LEASED = "slot_not_leased"
    SLOT_LEASED = "slot_leased"
    BAD_OFFLOAD = "bad_offload"


# Which reasons each journaled event can carry, for the metric families that
# count them by reason (a series for a reason that cannot occur there would
# read as a promise that it might). tests/test_metrics.py checks these against
# the core's raise sites.

# A Refused record: the registration checks (offload slots included), a peer
# not connected, the trim, a message in the wrong state, and a daemon that is
# draining.
REFUSAL_REASONS: frozenset[Reason] = frozenset(
    {
        Reason.UNKNOWN_ENGINE,
        Reason.DUPLICATE_REQUEST,
        Reason.STALE_INCARNATION,
        Reason.UNKNOWN_REQUEST,
        Reason.BLOCKS_OWNED,
        Reason.BLOCK_OUT_OF_RANGE,
        Reason.DUPLICATE_BLOCK,
        Reason.GROUP_COUNT_MISMATCH,
        Reason.ROLE_MISMATCH,
        Reason.ENGINE_IN_USE,
        Reason.PEER_UNREACHABLE,
        Reason.PEER_DEAD,
        Reason.DAEMON_RESTART,
        Reason.DECODE_LONGER_THAN_PREFILL,
        Reason.SSM_COUNT_MISMATCH,
        Reason.RATIO_PADDING_EXCEEDED,
        Reason.BLOCK_COUNT_MISMATCH,
        Reason.FINGERPRINT_MISMATCH,
        Reason.CONTENT_MISMATCH,
        Reason.QUARANTINED,
        Reason.ILLEGAL_TRANSITION,
        Reason.OFFLOAD_EXHAUSTED,
        Reason.BAD_SLOT,
        # An offload slot not zero at grant (daemon/node/integrity.py).
        Reason.INTEGRITY_MISMATCH,
        # The offload tier's slots (statemachine/slots.py).
        Reason.SLOT_NOT_GRANTED,
        Reason.SLOT_COMMITTED,
        Reason.SLOT_NOT_COMMITTED,
        Reason.SLOT_EVICTED,
        Reason.SLOT_NOT_RESET,
        Reason.SLOT_STALE,
        Reason.SLOT_NOT_LEASED,
        Reason.SLOT_LEASED,
        Reason.BAD_OFFLOAD,
    }
)

# A Failed record: the failures of a live request, a trim refusal (it fails
# the pusher's request), and on the receiver whatever the pusher reports in
# its WriteFailed, which includes its refusals of the forwarded registration.
FAILURE_REASONS: frozenset[Reason] = frozenset(
    {
        Reason.ABORTED,
        Reason.CANCELLED_BY_PEER,
        Reason.DEADLINE_EXCEEDED,
        Reason.PEER_DEAD,
        Reason.TRANSFER_ERROR,
        Reason.DAEMON_RESTART,
        Reason.REFUSED_BY_PEER,
        Reason.INTEGRITY_MISMATCH,
        Reason.UNKNOWN_ENGINE,
        Reason.GROUP_COUNT_MISMATCH,
        Reason.DECODE_LONGER_THAN_PREFILL,
        Reason.SSM_COUNT_MISMATCH,
        Reason.RATIO_PADDING_EXCEEDED,
        Reason.BLOCK_COUNT_MISMATCH,
        Reason.FINGERPRINT_MISMATCH,
        Reason.CONTENT_MISMATCH,
        Reason.QUARANTINED,
        Reason.ROLE_MISMATCH,
        Reason.DUPLICATE_REQUEST,
        Reason.STALE_INCARNATION,
        Reason.BLOCK_OUT_OF_RANGE,
        Reason.ILLEGAL_TRANSITION,
        # A receiver registered from a prefill's answer naming a transfer that
        # prefill never had: failed pending, at its ``answered`` deadline.
        Reason.UNKNOWN_REQUEST,
    }
)
