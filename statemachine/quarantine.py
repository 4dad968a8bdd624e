"""The quarantine rule: a pairing whose KV disagreed in behaviour pairs no more.

Fingerprints name what someone listed; the last proof is what the engines
compute (DESIGN.md, "Identity by behaviour"). A decode engine recomputes a
loaded prompt's last token and compares its own K/V there with what the
prefill pushed; when they differ it reports ``kv_mismatch``. The prefill
daemon journals its own ``KvMismatch`` (role pusher) naming both engines'
fingerprints, and from then on that pairing, the prefill fingerprint with
the decode fingerprint, is refused at the pairing (``Registry.plan_trim``,
right after the fingerprint rule) with ``quarantined``, before anything is
written: the decode computes the prompt itself.

The key is the two fingerprints without their placement (the heads and
layers one rank or slice holds): every rank's share of the two instances'
pairing is quarantined by one mismatch in any of them. TP and PP sizes
stay: they are part of each instance. The quarantine ends when the prefill
engine registers with another fingerprint (another key: nothing to lift) or
when an operator clears it (``QuarantineCleared``, journaled, so replay
honours it). Replay rebuilds the quarantine from the journal's records.

Receivers and pushers are reported on after they may have been released;
:class:`RecentReleases` keeps the few facts a report needs of the last
released ones (bounded).
"""

from __future__ import annotations

import hashlib
from typing import Final, NamedTuple

from schemas.events import KvMismatch
from schemas.fingerprint import Fingerprint
from schemas.layout import Role
from schemas.reasons import Reason
from schemas.state import Quarantined, RequestRecord
from statemachine.errors import TrimRefused

PairingKey = tuple[Fingerprint | None, Fingerprint | None]

# Released transfers remembered for a late report: a report comes within one
# engine step of kv_arrived, so a few thousand is many seconds at any rate.
DEFAULT_RECENT_LIMIT: Final = 4096

_NO_PLACEMENT: Final = {"kv_head_range": (0, 0), "layer_range": (0, 0)}


def _instance(fingerprint: Fingerprint | None) -> Fingerprint | None:
    """The fingerprint without what only places one rank's share (its heads, its layers)."""
    if fingerprint is None or (
        fingerprint.kv_head_range == (0, 0) and fingerprint.layer_range == (0, 0)
    ):
        return fingerprint
    fields = {name: getattr(fingerprint, name) for name in Fingerprint.__struct_fields__}
    return Fingerprint(**{**fields, **_NO_PLACEMENT})


def pairing_key(prefill: Fingerprint | None, decode: Fingerprint | None) -> PairingKey:
    return (_instance(prefill), _instance(decode))


def quarantine_id(key: PairingKey) -> str:
    """A short stable name of a pairing, for an operator to clear it by."""
    return hashlib.blake2b(repr(key).encode(), digest_size=6).hexdigest()


def quarantined_by(
    event: KvMismatch, ts: float, known: Quarantined | None
) -> tuple[PairingKey, Quarantined] | None:
    """The pairing a journaled mismatch quarantines, and its entry; None for a receiver's record.

    Only the prefill node's record (role pusher) quarantines: the pairing is
    decided there. A second mismatch of a pairing counts on its first entry.
    """
    if event.role is not Role.PUSHER:
        return None
    key = pairing_key(event.prefill_fingerprint, event.decode_fingerprint)
    if known is not None:
        return key, Quarantined(
            known.id, known.prefill_fingerprint, known.decode_fingerprint, known.since,
            known.request_id, known.engine_id, known.peer, known.peer_engine, known.layer,
            known.position, known.difference, known.tolerance, known.mismatches + 1,
        )  # fmt: skip
    return key, Quarantined(
        quarantine_id(key), key[0], key[1], ts, event.request_id, event.engine_id, event.peer,
        event.peer_engine, event.layer, event.position, event.difference, event.tolerance,
    )  # fmt: skip


def check_quarantine(
    quarantine: dict[PairingKey, Quarantined],
    prefill: Fingerprint | None,
    decode: Fingerprint | None,
) -> None:
    """Raise TrimRefused(QUARANTINED) if the pairing of these two engines is quarantined."""
    if not quarantine:  # every pairing's trim asks: no key to build when none is held
        return
    entry = quarantine.get(pairing_key(prefill, decode))
    if entry is None:
        return
    raise TrimRefused(
        Reason.QUARANTINED,
        f"the pairing of these engines' fingerprints is quarantined (id {entry.id}): decode "
        f"{entry.peer} engine {entry.peer_engine or '?'} found request {entry.request_id}'s KV "
        f"differs at layer {entry.layer}, position {entry.position} (relative "
        f"difference {entry.difference:.6g} > tolerance {entry.tolerance:.6g}); nothing is written "
        "(the decode side must compute this prompt; `kvpushd quarantine clear` ends it)",
    )


class Landed(NamedTuple):
    """What a mismatch report needs of a transfer: its engines, its peer, both fingerprints.

    ``fingerprint`` is this node's engine's; ``remote_fingerprint`` the
    other's, where this node knows it (a pusher does: the receiver's
    forward carried it).
    """

    request_id: str
    incarnation: int
    role: Role
    engine_id: str
    peer: str
    remote_engine: str
    fingerprint: Fingerprint | None
    remote_fingerprint: Fingerprint | None


def landed(record: RequestRecord, fingerprint: Fingerprint | None) -> Landed:
    return Landed(
        record.request_id, record.incarnation, record.role, record.engine_id, record.peer,
        record.remote_engine, fingerprint, record.remote_fingerprint,
    )  # fmt: skip


def moved_kv(record: RequestRecord) -> bool:
    """Whether a request's KV may have reached a decode engine: a receiver, or a pusher
    that trimmed, neither failed."""
    return record.reason is None and (record.role is Role.RECEIVER or record.src is not None)


class RecentReleases:
    """The last ``limit`` released transfers that moved KV, by request id (oldest forgotten)."""

    __slots__ = ("_by_id", "limit")

    def __init__(self, limit: int = DEFAULT_RECENT_LIMIT) -> None:
        self.limit = limit
        self._by_id: dict[str, Landed] = {}

    def add(self, found: Landed) -> None:
        by_id = self._by_id
        by_id.pop(found.request_id, None)
        by_id[found.request_id] = found
        if len(by_id) > self.limit:
            del by_id[next(iter(by_id))]

    def get(self, request_id: str) -> Landed | None:
        return self._by_id.get(request_id)

    def __len__(self) -> int:
        return len(self._by_id)
