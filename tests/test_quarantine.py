"""The quarantine rule (statemachine/quarantine.py) in the pure core.

A decode engine that recomputes a loaded prompt's token and finds its K/V
differs reports ``kv_mismatch``; the prefill node's pusher record then
quarantines the pairing of the two engines' fingerprints, refused at the
pairing (``quarantined``) until an operator clears it or the prefill
registers with another fingerprint. Replay and snapshots keep it; the
registry remembers released transfers a late report may name.
"""

from __future__ import annotations

import msgspec
import pytest

from daemon.journal.replay import decode_snapshot, encode_snapshot
from schemas.events import Event, KvMismatch, KvReady, QuarantineCleared, WriteDone, WriteStarted
from schemas.fingerprint import Fingerprint
from schemas.layout import EngineLayout, GroupKind, GroupLayout, Role
from schemas.reasons import Reason
from statemachine import Refusal, Registry, TrimRefused
from statemachine.quarantine import RecentReleases, landed, pairing_key, quarantine_id
from statemachine.registry import fold

ATT = GroupKind.ATTENTION
P_PRINT = Fingerprint("/models/tiny", dtype="float32", num_layers=2, num_kv_heads=2)
D_PRINT = msgspec.structs.replace(P_PRINT)
OTHER = msgspec.structs.replace(P_PRINT, revision="v2")


def prefill_registry(fingerprint: Fingerprint | None = P_PRINT) -> tuple[Registry, list[Event]]:
    registry = Registry()
    journal: list[Event] = []
    do(
        registry,
        journal,
        registry.check_attach(
            EngineLayout("pre", (GroupLayout(ATT, 64),), fingerprint=fingerprint)
        ),
    )
    return registry, journal


def do(registry: Registry, journal: list[Event], *events: Event) -> None:
    for event in events:
        registry.apply(event, 100.0 + len(journal))
        journal.append(event)


def push(
    registry: Registry,
    journal: list[Event],
    rid: str,
    decode: Fingerprint | None = D_PRINT,
    *,
    release: bool = True,
) -> None:
    """A whole push on the prefill node: registered, forwarded, trimmed, written, released."""
    do(registry, journal, registry.check_register(rid, 1, Role.PUSHER, "pre", "decode", [[1, 2]]))
    do(
        registry,
        journal,
        registry.check_peer_registration(rid, 1, "decode", "dec", ((5, 6),), 1, decode),
    )
    do(registry, journal, registry.plan_trim(rid, 1))
    do(registry, journal, KvReady(rid, 1), WriteStarted(rid, 1, 2, 4096), WriteDone(rid, 1))
    if release:
        do(registry, journal, *registry.plan_release(rid, 1))


def mismatch(registry: Registry, rid: str) -> KvMismatch:
    return registry.check_peer_kv_mismatch(
        "decode", rid, 1, "dec", layer=1, position=47, difference=0.75, tolerance=0.01
    )


def test_a_pushers_mismatch_quarantines_the_pairing_and_the_next_pairing_is_refused() -> None:
    registry, journal = prefill_registry()
    push(registry, journal, "r1")  # released before the report: remembered
    event = mismatch(registry, "r1")
    assert event.role is Role.PUSHER and event.engine_id == "pre" and event.peer_engine == "dec"
    assert (event.prefill_fingerprint, event.decode_fingerprint) == (P_PRINT, D_PRINT)
    do(registry, journal, event)
    (entry,) = registry.quarantine.values()
    assert entry.id == quarantine_id(pairing_key(P_PRINT, D_PRINT))
    assert (entry.request_id, entry.layer, entry.position) == ("r1", 1, 47)
    # The same pairing is refused at the trim, before anything is written.
    do(registry, journal, registry.check_register("r2", 1, Role.PUSHER, "pre", "decode", [[3]]))
    do(
        registry,
        journal,
        registry.check_peer_registration("r2", 1, "decode", "dec", ((7,),), 1, D_PRINT),
    )
    with pytest.raises(TrimRefused) as refused:
        registry.plan_trim("r2", 1)
    assert refused.value.reason is Reason.QUARANTINED
    assert entry.id in refused.value.message and "layer 1, position 47" in refused.value.message
    # Another decode fingerprint is another pairing: it pairs.
    do(registry, journal, registry.check_register("r3", 1, Role.PUSHER, "pre", "decode", [[4]]))
    do(
        registry,
        journal,
        registry.check_peer_registration("r3", 1, "decode", "dec", ((8,),), 1, OTHER),
    )
    with pytest.raises(TrimRefused) as other:
        registry.plan_trim("r3", 1)
    assert other.value.reason is Reason.FINGERPRINT_MISMATCH  # refused, but not quarantined


def test_a_second_mismatch_counts_on_the_first_and_placement_is_one_pairing() -> None:
    registry, journal = prefill_registry()
    push(registry, journal, "r1")
    push(registry, journal, "r2")
    # Both pushed before either report: the second counts on the first.
    do(registry, journal, mismatch(registry, "r1"))
    do(registry, journal, mismatch(registry, "r2"))
    (entry,) = registry.quarantine.values()
    assert entry.mismatches == 2 and entry.request_id == "r1"
    # A rank's or a slice's fingerprint (its heads, its layers) is the same pairing.
    rank = msgspec.structs.replace(P_PRINT, kv_head_range=(1, 2), layer_range=(0, 2))
    assert pairing_key(rank, D_PRINT) == pairing_key(P_PRINT, D_PRINT)
    assert pairing_key(msgspec.structs.replace(P_PRINT, tp_size=2), D_PRINT) != pairing_key(
        P_PRINT, D_PRINT
    )


def test_a_clear_ends_it_and_replay_and_snapshots_keep_both() -> None:
    registry, journal = prefill_registry()
    push(registry, journal, "r1")
    do(registry, journal, mismatch(registry, "r1"))
    (entry,) = registry.quarantine.values()
    # Replay of the journal, and a snapshot, rebuild the quarantine.
    assert set(fold((e, 1.0) for e in journal).quarantine) == set(registry.quarantine)
    snap = decode_snapshot(encode_snapshot(registry.snapshot(len(journal))))
    assert Registry.from_snapshot(snap).quarantine == registry.quarantine
    with pytest.raises(Refusal) as unknown:
        registry.check_clear(["nosuchid"])
    assert unknown.value.reason is Reason.UNKNOWN_REQUEST and entry.id in unknown.value.message
    cleared = registry.check_clear([entry.id])
    assert cleared == [QuarantineCleared(P_PRINT, D_PRINT, entry.id)]
    do(registry, journal, *cleared)
    assert registry.quarantine == {}
    assert fold((e, 1.0) for e in journal).quarantine == {}
    push(registry, journal, "r2")  # pairs again


def test_a_receivers_report_is_journaled_but_quarantines_nothing_on_the_decode_node() -> None:
    registry = Registry()
    registry.apply(
        registry.check_attach(EngineLayout("dec", (GroupLayout(ATT, 64),), fingerprint=D_PRINT)),
        1.0,
    )
    registry.apply(registry.check_register("r1", 1, Role.RECEIVER, "dec", "prefill", [[5]]), 2.0)
    kwargs = dict(layer=0, position=3, difference=1.0, tolerance=0.1)
    with pytest.raises(Refusal) as early:
        registry.check_kv_mismatch("r1", 1, **kwargs)  # type: ignore[arg-type]
    assert early.value.reason is Reason.ILLEGAL_TRANSITION  # nothing landed yet
    registry.apply(WriteDone("r1", 1), 3.0)
    for released in registry.plan_release("r1", 1):
        registry.apply(released, 4.0)
    assert "r1" not in registry.live
    event, found = registry.check_kv_mismatch("r1", 1, **kwargs)  # type: ignore[arg-type]
    assert (event.role, event.engine_id, event.peer) == (Role.RECEIVER, "dec", "prefill")
    assert event.decode_fingerprint == D_PRINT and found.peer == "prefill"
    registry.apply(event, 5.0)
    assert registry.quarantine == {}
    for rid, inc, reason in [
        ("nope", 1, Reason.UNKNOWN_REQUEST),
        ("r1", 2, Reason.UNKNOWN_REQUEST),
    ]:
        with pytest.raises(Refusal) as bad:
            registry.check_kv_mismatch(rid, inc, **kwargs)  # type: ignore[arg-type]
        assert bad.value.reason is reason
    with pytest.raises(Refusal) as within:
        registry.check_kv_mismatch("r1", 1, layer=0, position=3, difference=0.1, tolerance=0.1)
    assert "within the tolerance" in within.value.message
    # A peer's report naming a request this node never pushed to it is refused.
    with pytest.raises(Refusal):
        registry.check_peer_kv_mismatch("decode", "r1", 1, "x", **kwargs)  # type: ignore[arg-type]


def test_the_recent_releases_are_bounded() -> None:
    registry, journal = prefill_registry()
    push(registry, journal, "r0", release=False)
    recent = RecentReleases(limit=3)
    record = registry.live["r0"]
    for n in range(5):
        recent.add(landed(msgspec.structs.replace(record, request_id=f"r{n}"), None))
    assert len(recent) == 3 and recent.get("r0") is None and recent.get("r4") is not None
