"""Drives a pusher node's core through realistic request lifecycles, without a daemon.

For tests and tools that need real journals (the fuzzers' base journal,
postmortem and replay tests): every event goes through the same check/plan
methods the daemon uses, then through a Ledger (its append, without waiting), under a fake clock.
"""

from __future__ import annotations

from daemon.node.ledger import Ledger
from schemas.events import (
    DaemonStarted,
    Failed,
    KvReady,
    Refused,
    WriteDone,
    WriteStarted,
)
from schemas.layout import EngineLayout, GroupKind, GroupLayout, Role
from schemas.reasons import Reason
from statemachine import Refusal

PREFILL = EngineLayout(
    "prefill-0",
    (GroupLayout(GroupKind.ATTENTION, 4096), GroupLayout(GroupKind.ATTENTION, 4096)),
)


class FakeClock:
    """Deterministic wall clock: each read advances by ``step`` seconds."""

    def __init__(self, start: float = 1_700_000_000.0, step: float = 0.0005) -> None:
        self.now = start
        self.step = step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


def push_one(rec: Ledger, rid: str, *, prefill_blocks, decode_blocks, fail: bool = False):
    """One request through the pusher lifecycle; returns the final record or the refusal."""
    reg = rec.registry
    try:
        rec.append(
            reg.check_register(
                rid, 1, Role.PUSHER, PREFILL.engine_id, "decode-node", prefill_blocks
            )
        )
        rec.append(
            reg.check_peer_registration(
                rid, 1, "decode-node", "decode-0", tuple(tuple(g) for g in decode_blocks), 1
            )
        )
        rec.append(KvReady(rid, 1))
        trimmed = reg.plan_trim(rid, 1)
    except Refusal as refusal:
        rec.append(Refused(rid, 1, PREFILL.engine_id, refusal.reason, refusal.message))
        if reg.get(rid) is not None:
            for event in reg.plan_abort(rid, 1, refusal.reason, refusal.message):
                rec.append(event)
            for event in reg.plan_release(rid, 1):
                rec.append(event)
        return refusal
    rec.append(trimmed)
    n = sum(len(g) for g in trimmed.src)
    rec.append(WriteStarted(rid, 1, n, n * 4096))
    if fail:
        for event in reg.plan_release(rid, 1):  # deferred: a write is in flight
            rec.append(event)
        rec.append(Failed(rid, 1, Reason.TRANSFER_ERROR, "injected"))
        record = reg.get(rid)
    else:
        rec.append(WriteDone(rid, 1))
        record = reg.get(rid)
        for event in reg.plan_release(rid, 1):
            rec.append(event)
        return record
    assert record is not None
    for event in reg.follow_up(record):
        rec.append(event)
    return record


def run_mix(rec: Ledger, n: int) -> dict[str, int]:
    """A mix of hits, full hits, refusals and failures; returns expected counts."""
    rec.append(DaemonStarted(1234, "test", "boot-1"))
    rec.append(rec.registry.check_attach(PREFILL))
    counts = {"done": 0, "refused": 0, "failed": 0}
    for i in range(n):
        rid = f"req-{i}"
        base = (i * 8) % 4000
        prefill = [list(range(base, base + 6)), list(range(base, base + 6))]
        kind = i % 5
        if kind == 3:
            decode = [list(range(9)), [1]]  # decode longer than prefill: refused
            counts["refused"] += 1
        elif kind == 4:
            decode = [[7000 + i], [8000 + i]]
            counts["failed"] += 1
        elif kind == 2:
            decode = [[], []]  # full hit
            counts["done"] += 1
        else:
            decode = [[100, 101], [200]]
            counts["done"] += 1
        push_one(rec, rid, prefill_blocks=prefill, decode_blocks=decode, fail=kind == 4)
    return counts
