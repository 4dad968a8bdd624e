"""Tests of the journal storage layer (daemon/journal/: format, writer, recovery, reader)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import itertools
import os
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from daemon.journal.format import (
    FRAME_OVERHEAD,
    HEADER_SIZE,
    MAX_RECORD_BYTES,
    JournalClosed,
    JournalCorrupt,
    JournalError,
    JournalFatal,
    JournalLocked,
    segment_name,
    snapshot_name,
)
from daemon.journal.groupcommit import GroupCommit
from daemon.journal.reader import Snapshot, read_journal
from daemon.journal.writer import FsyncPolicy, Journal

# --------------------------------------------------------------------------
# helpers


def payload(i: int, size: int = 12) -> bytes:
    """A deterministic payload, distinct per i, of exactly ``size`` bytes."""
    return (f"rec-{i:06d}|".encode() * (size // 11 + 1))[:size]


def write_journal(directory: Path, payloads: list[bytes], **options: Any) -> list[int]:
    # Format 1, a frame per record, named: the tests that cut, flip or count
    # frames walk its frames (format 2's: tests/test_journal_format2.py), and
    # the journal's default is format 2.
    with Journal.open(directory, format=1, **options) as journal:
        return [journal.append(p) for p in payloads]


def records(directory: Path, *, salvage: bool = False) -> list[tuple[int, bytes]]:
    return list(read_journal(directory, salvage=salvage).records)


def segments(directory: Path) -> list[Path]:
    return sorted(directory.glob("seg-*.kvj"))


def first_seq_of(segment: Path) -> int:
    return int(segment.name.removeprefix("seg-").removesuffix(".kvj"))


def frame_spans(segment: Path) -> list[tuple[int, int]]:
    """[start, end) of every frame, walked from the lengths alone."""
    data = segment.read_bytes()
    spans = []
    offset = HEADER_SIZE
    while offset < len(data):
        end = offset + FRAME_OVERHEAD + int.from_bytes(data[offset : offset + 4], "big")
        spans.append((offset, end))
        offset = end
    return spans


def single_segment_journal(directory: Path, payloads: list[bytes]) -> tuple[Path, bytes]:
    write_journal(directory, payloads)
    (segment,) = segments(directory)
    return segment, segment.read_bytes()


def flip_bit(data: bytes, index: int, bit: int) -> bytes:
    damaged = bytearray(data)
    damaged[index] ^= 1 << bit
    return bytes(damaged)


class SyncRecorder:
    """An fdatasync that records which file each call synced and can be made to fail."""

    def __init__(self) -> None:
        self.synced: list[str] = []
        self.fail_with: int | None = None

    def __call__(self, fd: int) -> None:
        if self.fail_with is not None:
            raise OSError(self.fail_with, os.strerror(self.fail_with))
        self.synced.append(os.path.basename(os.readlink(f"/proc/self/fd/{fd}")))
        os.fdatasync(fd)


class CountingSync:
    """An fdatasync that only counts its calls (what is synced does not matter here)."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, fd: int) -> None:
        self.calls += 1


class InlineExecutor(concurrent.futures.Executor):
    """Runs each job at once, on the calling thread.

    Stands in for GroupCommit's fsync thread so that a sync completes a fixed
    number of event-loop passes after its commit, never late because a loaded
    machine did not schedule the thread.
    """

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:
            future.set_exception(exc)
        return future


@pytest.fixture
def journal_dir(tmp_path: Path) -> Path:
    return tmp_path / "journal"


# --------------------------------------------------------------------------
# appending, committing, reopening


def test_round_trip_and_seq_continuity_across_reopen(journal_dir: Path) -> None:
    first = [payload(i) for i in range(5)]
    assert write_journal(journal_dir, first) == [1, 2, 3, 4, 5]

    with Journal.open(journal_dir) as journal:
        assert journal.next_seq == 6
        assert journal.durable_seq == 5
        assert list(journal.take_recovered().records) == list(enumerate(first, start=1))
        assert journal.append(b"six") == 6
        assert journal.append(b"seven") == 7
        assert journal.commit() == 7

    contents = read_journal(journal_dir)
    assert list(contents.records) == [*enumerate(first, start=1), (6, b"six"), (7, b"seven")]
    assert contents.last_seq == 7
    assert contents.torn_bytes == 0
    assert contents.torn_at is None
    assert contents.snapshot is None
    # Reopening never appends to an old file: each process got its own segment.
    assert [p.name for p in segments(journal_dir)] == [segment_name(1), segment_name(6)]


def test_records_are_reiterable_and_sized(journal_dir: Path) -> None:
    write_journal(journal_dir, [payload(i) for i in range(10)])
    contents = read_journal(journal_dir)
    assert len(contents.records) == 10
    assert list(contents.records) == list(contents.records)


def test_new_journal_starts_at_seq_one_and_empty_read(journal_dir: Path) -> None:
    with Journal.open(journal_dir) as journal:
        assert journal.next_seq == 1
        assert journal.durable_seq == 0
        assert journal.commit() == 0
    contents = read_journal(journal_dir)
    assert list(contents.records) == []
    assert contents.last_seq == 0


def test_fsync_policy_is_a_str_enum() -> None:
    assert [p.value for p in FsyncPolicy] == ["always", "batch", "never"]
    assert FsyncPolicy("batch") is FsyncPolicy.BATCH
    assert str(FsyncPolicy.NEVER) == "never"


def test_policy_always_syncs_every_append(journal_dir: Path) -> None:
    sync = SyncRecorder()
    with Journal.open(journal_dir, fsync=FsyncPolicy.ALWAYS, fdatasync=sync) as journal:
        before = len(sync.synced)
        for i in range(4):
            seq = journal.append(payload(i))
            assert journal.durable_seq == seq
            assert journal.pending == 0
        assert sync.synced[before:] == [segment_name(1)] * 4


def test_policy_batch_syncs_once_per_commit(journal_dir: Path) -> None:
    sync = SyncRecorder()
    with Journal.open(journal_dir, fdatasync=sync) as journal:
        before = len(sync.synced)
        seqs = [journal.append(payload(i)) for i in range(50)]
        assert journal.durable_seq == 0
        assert journal.pending == 50
        assert len(sync.synced) == before
        assert journal.commit() == seqs[-1]
        assert sync.synced[before:] == [segment_name(1)]
        assert journal.commit() == seqs[-1]  # nothing buffered: no second sync
        assert sync.synced[before:] == [segment_name(1)]


def test_policy_never_writes_without_syncing(journal_dir: Path) -> None:
    sync = SyncRecorder()
    with Journal.open(journal_dir, fsync="never", fdatasync=sync) as journal:
        before = len(sync.synced)
        for i in range(20):
            journal.append(payload(i))
        assert journal.commit() == 20
        assert len(sync.synced) == before
        # "Durable" means handed to the OS: a reader sees the records already.
        assert len(read_journal(journal_dir).records) == 20


def test_append_commits_by_itself_only_when_the_segment_is_full(journal_dir: Path) -> None:
    # The journal has no commit window: under BATCH a record waits in the
    # buffer for its caller's commit (GroupCommit's, in the daemon), however
    # long that takes, unless the segment fills up.
    sync = CountingSync()
    fill = -(-(256 - HEADER_SIZE) // (FRAME_OVERHEAD + 12))  # appends that fill a segment
    with Journal.open(journal_dir, format=1, segment_bytes=256, fdatasync=sync) as journal:
        before = sync.calls
        for i in range(fill - 1):
            assert journal.append(payload(i)) == i + 1
        assert (journal.durable_seq, journal.pending, sync.calls) == (0, fill - 1, before)
        journal.append(payload(fill))
        assert (journal.durable_seq, journal.pending) == (fill, 0)
        assert sync.calls > before
    assert [p.name for p in segments(journal_dir)] == [segment_name(1), segment_name(fill + 1)]


async def test_group_commit_syncs_what_was_appended_during_a_sync_unasked(
    journal_dir: Path,
) -> None:
    # A record appended while a sync is in flight, that nobody awaits (a
    # detach, a refusal journaled before the reply is built), must still be
    # made durable soon after, not left buffered until some later commit.
    gate, in_sync = threading.Event(), threading.Event()
    hold = False

    def fdatasync(fd: int) -> None:
        if hold:
            in_sync.set()
            gate.wait(10)
        os.fdatasync(fd)

    with Journal.open(journal_dir, fdatasync=fdatasync) as journal:
        commit = GroupCommit(journal, on_fatal=lambda exc: None)
        try:
            hold = True
            first = journal.append(b"awaited")
            waiter = asyncio.ensure_future(commit.durable(first))
            assert await asyncio.to_thread(in_sync.wait, 10)
            hold = False
            unasked = journal.append(b"appended meanwhile")
            gate.set()
            await asyncio.wait_for(waiter, 10)
            for _ in range(500):
                if journal.durable_seq >= unasked:
                    break
                await asyncio.sleep(0.01)
            assert journal.durable_seq == unasked
            assert journal.pending == 0
        finally:
            commit.close()


async def appends_through_group_commit(
    directory: Path, window_s: float, appends: int, monkeypatch: pytest.MonkeyPatch
) -> int:
    """Append one record about every millisecond through GroupCommit; return the fsyncs."""
    sync = CountingSync()
    with Journal.open(directory, fdatasync=sync) as journal:
        commit = GroupCommit(journal, window_s=window_s, on_fatal=lambda exc: None)
        monkeypatch.setattr(commit, "_executor", InlineExecutor())
        before = sync.calls
        try:
            for i in range(appends):
                journal.append(payload(i))
                commit.request()  # what a handler's `await commit.durable(seq)` does
                await asyncio.sleep(0.001)
            await asyncio.wait_for(commit.durable(appends), 10)
        finally:
            commit.close()
        assert (journal.durable_seq, journal.pending) == (appends, 0)
        return sync.calls - before


async def test_group_commit_window_puts_more_records_in_each_fsync(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # With a window of 0 each record gets a commit of its own (the next one
    # arrives only after its sync is done). With 20 ms, a commit waits for
    # the records of the next 20 ms: even on a machine so loaded that the
    # loop stalls now and then, some of them share an fsync.
    appends = 60
    unwindowed = await appends_through_group_commit(tmp_path / "0", 0.0, appends, monkeypatch)
    windowed = await appends_through_group_commit(tmp_path / "20", 0.02, appends, monkeypatch)
    assert 0 < windowed < unwindowed <= appends


def test_payload_size_limits(journal_dir: Path) -> None:
    with Journal.open(journal_dir) as journal:
        with pytest.raises(ValueError, match=r"1\.\.16777216"):
            journal.append(b"")
        with pytest.raises(ValueError):
            journal.append(bytes(MAX_RECORD_BYTES + 1))
        assert journal.append(bytes(MAX_RECORD_BYTES)) == 1
    ((seq, big),) = records(journal_dir)
    assert (seq, len(big)) == (1, MAX_RECORD_BYTES)


def test_second_writer_is_locked_out(journal_dir: Path) -> None:
    with Journal.open(journal_dir), pytest.raises(JournalLocked):
        Journal.open(journal_dir)
    with Journal.open(journal_dir) as journal:
        assert journal.next_seq == 1


def test_open_removes_stale_temporary_files(journal_dir: Path) -> None:
    write_journal(journal_dir, [payload(0)])
    stale = journal_dir / (snapshot_name(1) + ".tmp")
    stale.write_bytes(b"half a snapshot")
    assert records(journal_dir) == [(1, payload(0))]  # readers ignore it
    with Journal.open(journal_dir):
        assert not stale.exists()


def test_open_validates_options_before_touching_the_directory(journal_dir: Path) -> None:
    with pytest.raises(ValueError):
        Journal.open(journal_dir, fsync="sometimes")
    with pytest.raises(ValueError):
        Journal.open(journal_dir, segment_bytes=HEADER_SIZE)
    assert not journal_dir.exists()


def test_closed_journal_refuses_calls(journal_dir: Path) -> None:
    journal = Journal.open(journal_dir)
    journal.close()
    journal.close()  # idempotent
    with pytest.raises(JournalClosed):
        journal.append(b"late")
    with pytest.raises(JournalClosed):
        journal.commit()


@settings(max_examples=100, deadline=None)
@given(
    sizes=st.lists(st.integers(min_value=1, max_value=300), min_size=1, max_size=80),
    segment_bytes=st.integers(min_value=HEADER_SIZE + 1, max_value=2048),
    commit_every=st.integers(min_value=1, max_value=20),
)
def test_round_trip_any_sizes_and_rotation(
    sizes: list[int], segment_bytes: int, commit_every: int
) -> None:
    expected = [(i + 1, payload(i, size)) for i, size in enumerate(sizes)]
    with tempfile.TemporaryDirectory() as tmp:
        with Journal.open(tmp, segment_bytes=segment_bytes) as journal:
            for index, (_, data) in enumerate(expected):
                journal.append(data)
                if index % commit_every == 0:
                    journal.commit()
        assert list(read_journal(tmp).records) == expected


# --------------------------------------------------------------------------
# torn tails


def test_truncation_at_every_offset_of_the_last_three_records(tmp_path: Path) -> None:
    payloads = [payload(i, size) for i, size in enumerate([5, 17, 1, 30, 9, 12])]
    _, data = single_segment_journal(tmp_path / "src", payloads)
    spans = frame_spans(segments(tmp_path / "src")[0])
    copy_dir = tmp_path / "copy"
    copy_dir.mkdir()
    copy = copy_dir / segment_name(1)

    for cut in range(spans[-3][0], len(data)):
        copy.write_bytes(data[:cut])
        contents = read_journal(copy_dir)
        intact = [i for i, (_, end) in enumerate(spans) if end <= cut]
        last_end = spans[intact[-1]][1]
        assert list(contents.records) == [(i + 1, payloads[i]) for i in intact], cut
        assert contents.torn_bytes == cut - last_end, cut
        assert contents.torn_at == (None if cut == last_end else (copy, last_end)), cut
        assert contents.last_seq == len(intact)


def test_segment_cut_inside_its_header_is_a_torn_tail(tmp_path: Path) -> None:
    _, data = single_segment_journal(tmp_path / "src", [payload(0)])
    copy_dir = tmp_path / "copy"
    copy_dir.mkdir()
    copy = copy_dir / segment_name(1)
    for cut in range(HEADER_SIZE):
        copy.write_bytes(data[:cut])
        contents = read_journal(copy_dir)
        assert list(contents.records) == []
        assert contents.torn_at == (copy, 0)
        assert contents.torn_bytes == cut
        assert contents.last_seq == 0
    copy.write_bytes(data[:HEADER_SIZE])
    assert read_journal(copy_dir).torn_at is None


def test_open_replaces_a_segment_with_a_torn_header(tmp_path: Path) -> None:
    _, data = single_segment_journal(tmp_path / "src", [payload(0)])
    journal_dir = tmp_path / "copy"
    journal_dir.mkdir()
    (journal_dir / segment_name(1)).write_bytes(data[:7])
    with Journal.open(journal_dir) as journal:
        assert journal.take_recovered().torn_bytes == 7
        assert journal.append(b"fresh") == 1
    assert records(journal_dir) == [(1, b"fresh")]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    sizes=st.lists(st.integers(min_value=1, max_value=200), min_size=1, max_size=30),
    data=st.data(),
)
def test_any_truncation_returns_a_prefix(sizes: list[int], data: st.DataObject) -> None:
    payloads = [payload(i, size) for i, size in enumerate(sizes)]
    with tempfile.TemporaryDirectory() as tmp:
        segment, raw = single_segment_journal(Path(tmp), payloads)
        cut = data.draw(st.integers(min_value=0, max_value=len(raw)), label="cut")
        segment.write_bytes(raw[:cut])
        contents = read_journal(tmp)
        got = list(contents.records)
        assert got == [(i + 1, p) for i, p in enumerate(payloads[: len(got)])]
        intact_end = HEADER_SIZE + sum(FRAME_OVERHEAD + len(p) for p in payloads[: len(got)])
        assert contents.torn_bytes == (cut - intact_end if cut >= HEADER_SIZE else cut)


def is_subsequence(items: list[bytes], of: list[bytes]) -> bool:
    remaining = iter(of)
    return all(item in remaining for item in items)


@settings(max_examples=150, deadline=None)
@given(
    sizes=st.lists(st.integers(min_value=1, max_value=120), min_size=1, max_size=25),
    data=st.data(),
)
def test_any_corrupted_byte_is_caught_or_cut(sizes: list[int], data: st.DataObject) -> None:
    payloads = [payload(i, size) for i, size in enumerate(sizes)]
    with tempfile.TemporaryDirectory() as tmp:
        segment, raw = single_segment_journal(Path(tmp), payloads)
        index = data.draw(st.integers(min_value=HEADER_SIZE, max_value=len(raw) - 1))
        damaged = bytearray(raw)
        damaged[index] ^= data.draw(st.integers(min_value=1, max_value=255), label="xor")
        segment.write_bytes(damaged)

        try:
            contents = read_journal(tmp)
        except JournalCorrupt:
            pass
        else:  # a torn tail: what is left is an intact prefix
            got = list(contents.records)
            assert got == list(enumerate(payloads[: len(got)], start=1))
            assert contents.torn_bytes > 0
        salvaged = read_journal(tmp, salvage=True)
        assert is_subsequence([p for _, p in salvaged.records], payloads)
        assert len(salvaged.records) == len(payloads) - 1


def test_reopen_cuts_torn_tail_and_keeps_everything_before(journal_dir: Path) -> None:
    before = [payload(i) for i in range(10)]
    write_journal(journal_dir, before)
    (segment,) = segments(journal_dir)
    intact_size = segment.stat().st_size
    # A frame header promising 50 bytes, followed by only 10 of them.
    with segment.open("ab") as f:
        f.write((50).to_bytes(4, "big") + b"\x12\x34\x56\x78" + b"x" * 10)

    with Journal.open(journal_dir) as journal:
        recovered = journal.take_recovered()
        assert recovered.torn_bytes == 18
        assert recovered.torn_at == (segment, intact_size)
        with pytest.raises(JournalError):
            journal.take_recovered()
        assert [journal.append(payload(i)) for i in range(10, 13)] == [11, 12, 13]

    assert segment.stat().st_size == intact_size
    assert records(journal_dir) == [(i + 1, payload(i)) for i in range(13)]
    assert read_journal(journal_dir).torn_bytes == 0


def test_reopen_removes_a_last_segment_left_without_records(journal_dir: Path) -> None:
    write_journal(journal_dir, [payload(0)])
    with Journal.open(journal_dir):
        pass  # leaves seg-2 holding only its header
    assert [p.name for p in segments(journal_dir)] == [segment_name(1), segment_name(2)]
    with Journal.open(journal_dir) as journal:
        assert journal.append(b"two") == 2
    assert [p.name for p in segments(journal_dir)] == [segment_name(1), segment_name(2)]
    assert records(journal_dir) == [(1, payload(0)), (2, b"two")]


def test_reopen_syncs_the_previous_last_segment(journal_dir: Path) -> None:
    write_journal(journal_dir, [payload(0)], fsync="never")
    sync = SyncRecorder()
    with Journal.open(journal_dir, fdatasync=sync):
        assert segment_name(1) in sync.synced


# --------------------------------------------------------------------------
# corruption


def test_bit_flips_in_a_middle_record_are_corruption(tmp_path: Path) -> None:
    payloads = [payload(i) for i in range(7)]
    segment, data = single_segment_journal(tmp_path / "src", payloads)
    start, end = frame_spans(segment)[3]
    copy_dir = tmp_path / "copy"
    copy_dir.mkdir()
    copy = copy_dir / segment.name
    others = [(i + 1, p) for i, p in enumerate(payloads) if i != 3]

    for index, bit in itertools.product(range(start, end), range(8)):
        copy.write_bytes(flip_bit(data, index, bit))
        with pytest.raises(JournalCorrupt) as caught:
            read_journal(copy_dir)
        assert caught.value.path == copy
        assert caught.value.offset == start
        assert str(start) in str(caught.value) and segment.name in str(caught.value)

        salvaged = read_journal(copy_dir, salvage=True)
        assert list(salvaged.records) == others, (index, bit)
        assert [(d.offset, d.length) for d in salvaged.damage] == [(start, end - start)]
        assert salvaged.torn_bytes == 0


def test_bit_flips_in_the_last_record_are_a_torn_tail(tmp_path: Path) -> None:
    payloads = [payload(i) for i in range(5)]
    segment, data = single_segment_journal(tmp_path / "src", payloads)
    start, end = frame_spans(segment)[-1]
    copy_dir = tmp_path / "copy"
    copy_dir.mkdir()
    copy = copy_dir / segment.name

    for index, bit in itertools.product(range(start, end), range(8)):
        copy.write_bytes(flip_bit(data, index, bit))
        contents = read_journal(copy_dir)
        assert list(contents.records) == [(i + 1, p) for i, p in enumerate(payloads[:-1])]
        assert contents.torn_at == (copy, start)
        assert contents.torn_bytes == end - start


def test_zeroed_run_in_the_middle_is_corruption(tmp_path: Path) -> None:
    payloads = [payload(i, 30) for i in range(40)]
    segment, data = single_segment_journal(tmp_path, payloads)
    spans = frame_spans(segment)
    segment.write_bytes(data[:300] + bytes(512) + data[812:])

    with pytest.raises(JournalCorrupt) as caught:
        read_journal(tmp_path)
    assert caught.value.offset == next(s for s, e in spans if s <= 300 < e)

    salvaged = read_journal(tmp_path, salvage=True)
    kept = [i for i, (s, e) in enumerate(spans) if e <= 300 or s >= 812]
    assert [p for _, p in salvaged.records] == [payloads[i] for i in kept]
    assert len(salvaged.damage) == 1
    assert not salvaged.seqs_exact


def test_salvage_resumes_at_a_frame_right_after_a_zero_run(tmp_path: Path) -> None:
    # The resumed frame's length starts with zero bytes that extend the run.
    payloads = [payload(i, 30) for i in range(40)]
    segment, data = single_segment_journal(tmp_path, payloads)
    spans = frame_spans(segment)
    hole_start, hole_end = spans[5][0], spans[20][0]
    segment.write_bytes(data[:hole_start] + bytes(hole_end - hole_start) + data[hole_end:])

    salvaged = read_journal(tmp_path, salvage=True)
    assert [p for _, p in salvaged.records] == payloads[:5] + payloads[20:]
    assert [(d.offset, d.length) for d in salvaged.damage] == [(hole_start, hole_end - hole_start)]


def test_zeroed_run_at_the_tail_is_torn(tmp_path: Path) -> None:
    payloads = [payload(i, 30) for i in range(40)]
    segment, data = single_segment_journal(tmp_path, payloads)
    spans = frame_spans(segment)

    segment.write_bytes(data + bytes(512))
    contents = read_journal(tmp_path)
    assert len(contents.records) == 40
    assert contents.torn_bytes == 512

    zeroed_from = len(data) - 512
    segment.write_bytes(data[:zeroed_from] + bytes(512))
    contents = read_journal(tmp_path)
    kept = [i for i, (_, end) in enumerate(spans) if end <= zeroed_from]
    assert [p for _, p in contents.records] == [payloads[i] for i in kept]
    assert contents.torn_bytes == len(data) - spans[kept[-1]][1]


def test_bad_segment_header_is_corruption(tmp_path: Path) -> None:
    segment, data = single_segment_journal(tmp_path, [payload(0)])
    for index in range(HEADER_SIZE):
        segment.write_bytes(flip_bit(data, index, 0))
        with pytest.raises(JournalCorrupt, match="header"):
            read_journal(tmp_path)


def test_header_disagreeing_with_file_name_is_corruption(tmp_path: Path) -> None:
    segment, _ = single_segment_journal(tmp_path / "src", [payload(0)])
    journal_dir = tmp_path / "copy"
    journal_dir.mkdir()
    shutil.copy(segment, journal_dir / segment_name(5))
    with pytest.raises(JournalCorrupt, match="file name"):
        read_journal(journal_dir)


def test_single_segment_file_can_be_read_under_any_name(tmp_path: Path) -> None:
    payloads = [payload(i) for i in range(3)]
    segment, _ = single_segment_journal(tmp_path / "src", payloads)
    copy = tmp_path / "copied.bin"
    shutil.copy(segment, copy)
    assert list(read_journal(copy).records) == list(enumerate(payloads, start=1))
    assert read_journal(segment).segments == (segment,)


def test_missing_journal_path_raises(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        read_journal(tmp_path / "absent")


# --------------------------------------------------------------------------
# rotation


def rotated_journal(directory: Path, count: int, segment_bytes: int = 256) -> list[bytes]:
    payloads = [payload(i, 1 + i % 40) for i in range(count)]
    write_journal(directory, payloads, segment_bytes=segment_bytes)
    return payloads


def test_rotation_spreads_records_over_segments_in_order(journal_dir: Path) -> None:
    payloads = rotated_journal(journal_dir, 300)
    paths = segments(journal_dir)
    assert len(paths) > 10
    assert records(journal_dir) == list(enumerate(payloads, start=1))
    # Each segment's name gives its first seq, and it is cut near the limit.
    next_seq = 1
    for path in paths:
        assert path.name == segment_name(next_seq)
        next_seq += len(frame_spans(path))
    assert all(p.stat().st_size <= 256 + FRAME_OVERHEAD + 40 for p in paths)


def test_rotation_seals_segments_even_with_policy_never(journal_dir: Path) -> None:
    sync = SyncRecorder()
    with Journal.open(journal_dir, fsync="never", segment_bytes=256, fdatasync=sync) as journal:
        for i in range(100):
            journal.append(payload(i))
        journal.commit()
        sealed = {p.name for p in segments(journal_dir)} - {journal.segment_path.name}
    assert sealed and sealed <= set(sync.synced)


def test_damage_in_a_sealed_segment_is_corruption_even_at_its_end(journal_dir: Path) -> None:
    rotated_journal(journal_dir, 100)
    first = segments(journal_dir)[0]
    first.write_bytes(first.read_bytes()[:-3])
    with pytest.raises(JournalCorrupt, match=first.name):
        read_journal(journal_dir)
    salvaged = read_journal(journal_dir, salvage=True)
    assert len(salvaged.damage) == 1
    assert salvaged.records and salvaged.last_seq == 100


def test_missing_segment_is_a_gap(journal_dir: Path) -> None:
    payloads = rotated_journal(journal_dir, 100)
    doomed = segments(journal_dir)[2]
    lost = len(frame_spans(doomed))
    doomed.unlink()
    with pytest.raises(JournalCorrupt, match="gap"):
        read_journal(journal_dir)
    salvaged = read_journal(journal_dir, salvage=True)
    assert ["gap" in d.reason for d in salvaged.damage] == [True]
    assert len(salvaged.records) == 100 - lost
    assert list(salvaged.records)[-1] == (100, payloads[-1])  # numbering stays exact


def test_journal_must_start_at_seq_one_without_a_snapshot(journal_dir: Path) -> None:
    rotated_journal(journal_dir, 100)
    segments(journal_dir)[0].unlink()
    with pytest.raises(JournalCorrupt, match="gap: records 1\\.\\."):
        read_journal(journal_dir)


# --------------------------------------------------------------------------
# snapshots and pruning


def test_snapshot_prune_replay(journal_dir: Path) -> None:
    payloads = [payload(i) for i in range(100)]
    with Journal.open(journal_dir, segment_bytes=256) as journal:
        for data in payloads:
            journal.append(data)
        journal.commit()
        journal.write_snapshot(20, b"state@20")
        journal.write_snapshot(60, b"state@60")
        before = set(journal_dir.iterdir())
        deleted = journal.prune(retain_segments=0)

    assert journal_dir / snapshot_name(20) in deleted
    assert all(not p.exists() for p in deleted)
    assert set(journal_dir.iterdir()) == before - set(deleted)
    deleted_segments = [p for p in deleted if p.suffix == ".kvj"]
    assert deleted_segments and all(p in before for p in deleted_segments)

    contents = read_journal(journal_dir)
    assert contents.snapshot == Snapshot(60, b"state@60")
    assert list(contents.records) == [(i + 1, payloads[i]) for i in range(60, 100)]
    assert contents.last_seq == 100
    # What is left starts no later than the first record the snapshot lacks.
    assert first_seq_of(segments(journal_dir)[0]) <= 61


def test_prune_retains_the_newest_covered_segments(journal_dir: Path) -> None:
    with Journal.open(journal_dir, segment_bytes=256) as journal:
        for i in range(100):
            journal.append(payload(i))
        journal.commit()
        journal.write_snapshot(90, b"s")
        covered = [
            path
            for path, successor in itertools.pairwise(segments(journal_dir))
            if first_seq_of(successor) - 1 <= 90
        ]
        deleted = journal.prune(retain_segments=2)
    assert deleted == covered[:-2]
    assert all(p.exists() for p in covered[-2:])


def test_prune_never_deletes_the_active_segment(journal_dir: Path) -> None:
    with Journal.open(journal_dir) as journal:
        for i in range(5):
            journal.append(payload(i))
        journal.commit()
        journal.write_snapshot(5, b"all")
        assert journal.prune(retain_segments=0) == []
        assert journal.segment_path.exists()


def test_reopen_after_prune_continues_after_snapshot(journal_dir: Path) -> None:
    with Journal.open(journal_dir) as journal:
        for i in range(5):
            journal.append(payload(i))
        journal.commit()
        journal.write_snapshot(5, b"all")
    with Journal.open(journal_dir) as journal:
        assert journal.prune(retain_segments=0) == [journal_dir / segment_name(1)]
    with Journal.open(journal_dir) as journal:
        assert journal.snapshot_seq == 5
        assert journal.append(b"six") == 6
    contents = read_journal(journal_dir)
    assert contents.snapshot == Snapshot(5, b"all")
    assert list(contents.records) == [(6, b"six")]


def test_snapshot_newer_than_the_surviving_tail(journal_dir: Path) -> None:
    # Policy never: the snapshot reached the disk, the last records did not.
    with Journal.open(journal_dir, format=1, fsync="never") as journal:
        for i in range(10):
            journal.append(payload(i))
        journal.commit()
        journal.write_snapshot(10, b"state@10")
    segment = journal_dir / segment_name(1)
    segment.write_bytes(segment.read_bytes()[: frame_spans(segment)[5][0] + 3])

    with Journal.open(journal_dir) as journal:
        assert journal.take_recovered().last_seq == 10
        assert journal.append(b"eleven") == 11
    contents = read_journal(journal_dir)
    assert contents.snapshot == Snapshot(10, b"state@10")
    assert list(contents.records) == [(11, b"eleven")]


def test_snapshot_seq_must_be_durable(journal_dir: Path) -> None:
    with Journal.open(journal_dir) as journal:
        journal.append(b"a")
        with pytest.raises(ValueError):
            journal.write_snapshot(1, b"not yet durable")
        journal.commit()
        with pytest.raises(ValueError):
            journal.write_snapshot(0, b"zero")
        assert journal.write_snapshot(1, b"ok") == journal_dir / snapshot_name(1)


def test_damaged_snapshot_is_corruption_and_salvage_falls_back(journal_dir: Path) -> None:
    with Journal.open(journal_dir) as journal:
        for i in range(10):
            journal.append(payload(i))
        journal.commit()
        journal.write_snapshot(3, b"old")
        newest = journal.write_snapshot(7, b"new")
    newest.write_bytes(flip_bit(newest.read_bytes(), HEADER_SIZE + FRAME_OVERHEAD, 1))

    with pytest.raises(JournalCorrupt, match="snapshot"):
        read_journal(journal_dir)
    with pytest.raises(JournalCorrupt):
        Journal.open(journal_dir)
    salvaged = read_journal(journal_dir, salvage=True)
    assert salvaged.snapshot == Snapshot(3, b"old")
    assert [seq for seq, _ in salvaged.records] == list(range(4, 11))
    assert [d.path for d in salvaged.damage] == [newest]


# --------------------------------------------------------------------------
# fatal I/O errors


def test_fdatasync_failure_is_fatal_and_sticky(journal_dir: Path) -> None:
    sync = SyncRecorder()
    journal = Journal.open(journal_dir, fdatasync=sync)
    committed = [payload(i) for i in range(5)]
    for data in committed:
        journal.append(data)
    journal.commit()

    sync.fail_with = errno.EIO
    journal.append(b"doomed")
    with pytest.raises(JournalFatal) as caught:
        journal.commit()
    assert isinstance(caught.value.__cause__, OSError)
    assert caught.value.__cause__.errno == errno.EIO
    with pytest.raises(JournalFatal):
        journal.append(b"again")
    with pytest.raises(JournalFatal):
        journal.commit()
    with pytest.raises(JournalFatal):
        journal.write_snapshot(1, b"s")
    journal.close()  # releases the lock without raising again

    assert records(journal_dir)[:5] == list(enumerate(committed, start=1))
    with Journal.open(journal_dir) as reopened:
        assert reopened.next_seq >= 6


class FailingWrite:
    """os.write that, once armed, stores half its buffer and then fails with ENOSPC."""

    def __init__(self) -> None:
        self.armed = False
        self.calls_since_armed = 0

    def __call__(self, fd: int, data: bytes | bytearray | memoryview) -> int:
        if not self.armed:
            return os.write(fd, data)
        self.calls_since_armed += 1
        if self.calls_since_armed == 1:
            view = memoryview(data)
            return os.write(fd, view[: len(view) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_enospc_from_write_is_fatal(journal_dir: Path) -> None:
    write = FailingWrite()
    journal = Journal.open(journal_dir, write=write)
    committed = [payload(i) for i in range(5)]
    for data in committed:
        journal.append(data)
    journal.commit()

    write.armed = True
    for i in range(5, 10):
        journal.append(payload(i))
    with pytest.raises(JournalFatal) as caught:
        journal.commit()
    assert isinstance(caught.value.__cause__, OSError)
    assert caught.value.__cause__.errno == errno.ENOSPC
    assert write.calls_since_armed == 2  # the short write was continued, never retried
    with pytest.raises(JournalFatal):
        journal.append(b"more")
    journal.close()

    # The half-written batch is a torn tail: cut on reopen, nothing before it lost.
    with Journal.open(journal_dir) as reopened:
        recovered = reopened.take_recovered()
        assert recovered.torn_bytes > 0
        got = list(recovered.records)
        assert got[:5] == list(enumerate(committed, start=1))
        assert reopened.append(b"after") == len(got) + 1
    assert records(journal_dir)[-1] == (len(got) + 1, b"after")
