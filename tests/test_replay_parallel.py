"""The optimistic replay (frames folded unchecked while a forked child checks
the CRCs) against the strict one, on clean, torn, damaged and illegal journals.

Replay is crash recovery: the two paths must give the same result, or raise
the same error, whatever the journal holds; the optimistic one stands only
when the journal is clean, and falls back otherwise.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from daemon.journal.replay import encode_snapshot, replay, replay_optimistic
from daemon.journal.writer import FsyncPolicy, Journal
from daemon.node.ledger import Ledger
from schemas.events import (
    FORMAT_VERSION,
    KvReady,
    Record,
    Released,
    WriteDone,
    WriteStarted,
    encode_record,
)
from schemas.layout import EngineLayout, GroupKind, GroupLayout, Role
from statemachine import Registry

LAYOUT = EngineLayout("prefill-0", (GroupLayout(GroupKind.ATTENTION, 4096),))


def write_journal(
    path: Path,
    requests: int,
    *,
    segment_bytes: int,
    snapshot_after: int | None,
    illegal_at: int | None,
) -> None:
    """``requests`` pusher lifecycles through a Ledger, as the daemon journals them.

    ``snapshot_after``: write a snapshot after that many requests.
    ``illegal_at``: after that many requests, journal a record the core
    refuses on replay (a WriteDone for a request that was never registered).
    """
    registry = Registry()
    with Journal.open(path, fsync=FsyncPolicy.NEVER, segment_bytes=segment_bytes) as journal:
        clock = iter(range(1, 1 << 30))
        ledger = Ledger(journal, registry, node="n", clock=lambda: float(next(clock)))
        ledger.append(registry.check_attach(LAYOUT))
        for i in range(requests):
            if i == illegal_at:
                record = Record(FORMAT_VERSION, "n", journal.next_seq, 0.5, WriteDone("ghost", 1))
                journal.append(encode_record(record))
            rid = f"r{i}"
            base = (i * 4) % 4000
            blocks = [list(range(base, base + 4))]
            ledger.append(registry.check_register(rid, 1, Role.PUSHER, "prefill-0", "d", blocks))
            if i % 3 == 2:
                continue  # left live: replay must rebuild it
            ledger.append(registry.check_peer_registration(rid, 1, "d", "decode-0", ((7,),), 1))
            ledger.append(KvReady(rid, 1))
            ledger.append(registry.plan_trim(rid, 1))
            ledger.append(WriteStarted(rid, 1, 1, 65536))
            ledger.append(WriteDone(rid, 1))
            ledger.append(Released(rid, 1))
            if i + 1 == snapshot_after:
                journal.commit()
                seq = journal.next_seq - 1
                journal.write_snapshot(seq, encode_snapshot(registry.snapshot(seq)))


def outcome(path: Path, *, salvage: bool, parallel: bool) -> tuple[Any, ...]:
    """Everything replay says about ``path``: its result, or its error."""
    try:
        result = replay(path, salvage=salvage, parallel=parallel)
    except Exception as exc:  # the error itself is part of the outcome
        return ("raised", type(exc), str(exc))
    return (
        "folded",
        result.registry.snapshot(result.last_seq),
        result.records,
        result.last_seq,
        result.snapshot_seq,
        result.torn_bytes,
        result.torn_at,
        result.damage,
        result.first_ts,
        result.last_ts,
    )


def segment_files(path: Path) -> list[Path]:
    return sorted(path.glob("seg-*.kvj"))


DAMAGE = st.sampled_from(["none", "flip", "truncate", "zeros", "garbage", "drop_frame"])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    requests=st.integers(0, 40),
    segment_bytes=st.sampled_from([512, 2048, 1 << 20]),
    snapshot_after=st.one_of(st.none(), st.integers(1, 40)),
    illegal_at=st.one_of(st.none(), st.integers(0, 40)),
    damage=DAMAGE,
    salvage=st.booleans(),
    data=st.data(),
)
def test_optimistic_and_strict_replay_agree(
    requests: int,
    segment_bytes: int,
    snapshot_after: int | None,
    illegal_at: int | None,
    damage: str,
    salvage: bool,
    data: st.DataObject,
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "journal"
        write_journal(
            path,
            requests,
            segment_bytes=segment_bytes,
            snapshot_after=snapshot_after,
            illegal_at=illegal_at,
        )
        files = segment_files(path)
        target = data.draw(st.sampled_from(files), label="segment")
        raw = bytearray(target.read_bytes())
        if damage == "flip" and len(raw) > 0:
            at = data.draw(st.integers(0, len(raw) - 1), label="flip at")
            raw[at] ^= 1 << data.draw(st.integers(0, 7), label="bit")
        elif damage == "truncate":
            raw = raw[: data.draw(st.integers(0, len(raw)), label="cut at")]
        elif damage == "zeros" and len(raw) > 0:
            at = data.draw(st.integers(0, len(raw) - 1), label="zeros at")
            raw[at : at + data.draw(st.integers(1, 64), label="zeros")] = bytes(64)[: len(raw)]
        elif damage == "garbage":
            raw += data.draw(st.binary(min_size=1, max_size=40), label="garbage")
        elif damage == "drop_frame" and len(raw) > 18 + 8:
            # A whole intact frame removed: every CRC still checks, the numbering does not.
            length = int.from_bytes(raw[18:22], "big")
            del raw[18 : 18 + 8 + length]
        target.write_bytes(bytes(raw))
        strict = outcome(path, salvage=salvage, parallel=False)
        optimistic = outcome(path, salvage=salvage, parallel=True)
        assert optimistic == strict
        if damage == "none" and illegal_at is None:
            # A clean journal is where the optimistic fold must actually count.
            assert replay_optimistic(path, salvage=salvage) is not None


def test_optimistic_fold_stands_on_a_clean_journal_and_falls_back_on_damage(
    tmp_path: Path,
) -> None:
    path = tmp_path / "journal"
    write_journal(path, 30, segment_bytes=4096, snapshot_after=10, illegal_at=None)
    folded = replay_optimistic(path)
    assert folded is not None
    strict = replay(path, parallel=False)
    assert folded.records == strict.records and folded.last_seq == strict.last_seq
    assert folded.registry.snapshot(0) == strict.registry.snapshot(0)
    # One flipped bit in the middle of a segment: the child's CRC pass finds it.
    segment = segment_files(path)[-1]
    raw = bytearray(segment.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    segment.write_bytes(bytes(raw))
    assert replay_optimistic(path) is None
    assert outcome(path, salvage=True, parallel=True) == outcome(path, salvage=True, parallel=False)


def test_a_flip_that_still_decodes_is_caught_by_the_crc(tmp_path: Path) -> None:
    """The fold alone cannot see it (the frame decodes, the core accepts it);
    only the validating child can, and the strict path then refuses it."""
    path = tmp_path / "journal"
    write_journal(path, 6, segment_bytes=1 << 20, snapshot_after=None, illegal_at=None)
    segment = segment_files(path)[0]
    raw = segment.read_bytes()
    # The first WriteStarted's nbytes, 65536 -> 131072 (msgpack uint32): still
    # a valid record the core accepts, but no longer the bytes the CRC covers.
    nbytes = b"\xce\x00\x01\x00\x00"
    assert raw.count(nbytes) >= 2
    segment.write_bytes(raw.replace(nbytes, b"\xce\x00\x02\x00\x00", 1))
    assert replay_optimistic(path) is None
    assert outcome(path, salvage=False, parallel=True) == outcome(
        path, salvage=False, parallel=False
    )
