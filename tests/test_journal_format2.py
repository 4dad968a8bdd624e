"""Journal format 2 (daemon/journal/format.py): a frame per commit, beside format 1.

The framing byte for byte, directories mixing both formats, torn and
corrupt groups classified by the same rules as format 1's frames,
recovery of a torn group, replay of a group in one decode call, and a
round trip of any sizes, commits and rotations.
"""

from __future__ import annotations

import itertools
import struct
import tempfile
from pathlib import Path

import pytest
from crc32c import crc32c
from hypothesis import given, settings
from hypothesis import strategies as st

from daemon.journal import writer as writer_module
from daemon.journal.format import (
    DEFAULT_WRITE_FORMAT,
    FRAME_OVERHEAD,
    GROUP_FRAMES,
    GROUP_OVERHEAD,
    HEADER_SIZE,
    RECORD_FRAMES,
    Framing,
    JournalCorrupt,
    check_frames,
    frame_problem,
    pack_file_header,
    parse_header,
    segment_name,
)
from daemon.journal.reader import first_payload, read_journal, read_unchecked
from daemon.journal.replay import fold_contents, replay
from daemon.journal.writer import FsyncPolicy, Journal
from daemon.node.ledger import Ledger
from daemon.postmortem.sources import group_sources
from schemas.config import DEFAULT_JOURNAL_FORMAT, JournalConfig
from schemas.events import KvReady, Record, WriteDone, WriteStarted
from schemas.layout import EngineLayout, GroupKind, GroupLayout, Role
from statemachine import Registry


def payload(i: int, size: int = 12) -> bytes:
    return (f"rec-{i:06d}|".encode() * (size // 11 + 1))[:size]


def segments(directory: Path) -> list[Path]:
    return sorted(directory.glob("seg-*.kvj"))


def write_groups(directory: Path, groups: list[list[bytes]], **options: object) -> None:
    """Each inner list appended, then committed: one group each."""
    with Journal.open(directory, format=2, **options) as journal:  # type: ignore[arg-type]
        for group in groups:
            for one in group:
                journal.append(one)
            journal.commit()


def group_spans(segment: Path) -> list[tuple[int, int]]:
    """[start, end) of every group, walked from the lengths alone."""
    data = segment.read_bytes()
    spans, offset = [], HEADER_SIZE
    while offset < len(data):
        end = offset + FRAME_OVERHEAD + int.from_bytes(data[offset : offset + 4], "big")
        spans.append((offset, end))
        offset = end
    return spans


def flip_bit(data: bytes, index: int, bit: int) -> bytes:
    damaged = bytearray(data)
    damaged[index] ^= 1 << bit
    return bytes(damaged)


def numbered(groups: list[list[bytes]]) -> list[tuple[int, bytes]]:
    return list(enumerate(itertools.chain.from_iterable(groups), start=1))


# --------------------------------------------------------------------------
# the framing


def test_a_group_is_framed_as_the_spec_says(tmp_path: Path) -> None:
    write_groups(tmp_path, [[b"a", b"bc", b"def"]])
    (segment,) = segments(tmp_path)
    data = segment.read_bytes()
    assert parse_header(data, b"KVPJ") == (1, 2)
    body = b"\xdd" + struct.pack(">I", 3) + b"abcdef" + struct.pack(">3I", 1, 2, 3)
    length = struct.pack(">I", len(body))
    assert data[HEADER_SIZE:] == length + struct.pack(">I", crc32c(length + body)) + body
    assert len(data) == HEADER_SIZE + GROUP_OVERHEAD + 6 + 3 * 4


def test_records_appended_between_two_writes_make_one_group(tmp_path: Path) -> None:
    groups = [[payload(0)], [payload(1), payload(2)], [payload(i) for i in range(3, 10)]]
    write_groups(tmp_path, groups)
    (segment,) = segments(tmp_path)
    assert len(group_spans(segment)) == 3
    assert list(read_journal(tmp_path).records) == numbered(groups)


def test_the_split_phase_commit_writes_one_group(tmp_path: Path) -> None:
    with Journal.open(tmp_path, format=2) as journal:
        for i in range(5):
            journal.append(payload(i))
        written, fd = journal.write_pending()
        assert written == 5 and fd is not None
        journal.sync_fd(fd)
        journal.mark_durable(written)
        assert journal.durable_seq == 5
    assert len(group_spans(segments(tmp_path)[0])) == 1


def test_policy_always_writes_a_group_per_record(tmp_path: Path) -> None:
    with Journal.open(tmp_path, format=2, fsync=FsyncPolicy.ALWAYS) as journal:
        for i in range(4):
            journal.append(payload(i))
            assert journal.durable_seq == i + 1
    assert len(group_spans(segments(tmp_path)[0])) == 4


def test_a_group_never_passes_the_size_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(writer_module, "MAX_GROUP_BYTES", 64)
    payloads = [payload(i, 20) for i in range(10)]
    write_groups(tmp_path, [payloads])
    spans = group_spans(segments(tmp_path)[0])
    assert len(spans) > 1
    assert all(end - start - FRAME_OVERHEAD <= 64 for start, end in spans)
    assert list(read_journal(tmp_path).records) == numbered([payloads])


def test_one_default_format_for_the_daemon_and_the_journal(tmp_path: Path) -> None:
    """``journal.format``'s default and Journal.open's, when not told, are one constant."""
    assert JournalConfig().format == DEFAULT_JOURNAL_FORMAT == DEFAULT_WRITE_FORMAT
    with Journal.open(tmp_path) as journal:
        assert journal.format == JournalConfig().format
        journal.append(payload(0))
    (segment,) = segments(tmp_path)
    assert parse_header(segment.read_bytes(), b"KVPJ") == (1, JournalConfig().format)
    with pytest.raises(ValueError):
        Journal.open(tmp_path / "other", format=3)


# --------------------------------------------------------------------------
# the frame checks: one walk per format, and the reasons it gives

# Frames of each format, built by hand, and what is wrong with them.
F1_OK = struct.pack(">II", 3, crc32c(b"abc", crc32c(struct.pack(">I", 3)))) + b"abc"


def frame_2(body: bytes, crc: int | None = None) -> bytes:
    length = struct.pack(">I", len(body))
    return length + struct.pack(">I", crc32c(length + body) if crc is None else crc) + body


def body_2(mark: int, count: int, payloads: bytes, sizes: list[int]) -> bytes:
    return struct.pack(">BI", mark, count) + payloads + struct.pack(f">{len(sizes)}I", *sizes)


REASONS = [
    (RECORD_FRAMES, b"\x00\x00\x00", "frame header cut short (3 bytes before end of file)"),
    (RECORD_FRAMES, b"", "frame header cut short (0 bytes before end of file)"),
    (RECORD_FRAMES, bytes(8), "zero record length"),
    (
        RECORD_FRAMES,
        struct.pack(">II", (1 << 24) + 1, 0),
        "record length 16777217 exceeds 16777216",
    ),
    (RECORD_FRAMES, F1_OK[:-1], "3-byte record runs 1 bytes past end of file"),
    (
        RECORD_FRAMES,
        F1_OK[:4] + bytes(4) + b"abc",
        f"record CRC mismatch (stored 0x00000000, computed {int.from_bytes(F1_OK[4:8]):#010x})",
    ),
    (GROUP_FRAMES, struct.pack(">II", 9, 0) + bytes(9), "group length 9 is below 10"),
    (GROUP_FRAMES, struct.pack(">II", (1 << 25) + 1, 0), "group length 33554433 exceeds 33554432"),
    (
        GROUP_FRAMES,
        frame_2(body_2(0xDD, 1, b"a", [1]))[:-2],
        "10-byte group runs 2 bytes past end of file",
    ),
    (
        GROUP_FRAMES,
        frame_2(body_2(0xDD, 1, b"a", [1]), crc=7),
        "group CRC mismatch (stored 0x00000007, computed ",
    ),
    (GROUP_FRAMES, frame_2(body_2(0x93, 1, b"a", [1])), "group mark 0x93, expected 0xdd"),
    (
        GROUP_FRAMES,
        frame_2(body_2(0xDD, 2, b"a", [1])),
        "group count 2 does not fit its 10-byte body",
    ),
    (
        GROUP_FRAMES,
        frame_2(body_2(0xDD, 1, b"ab", [1])),
        "group sizes add up to 1, its body holds 2",
    ),
    (
        GROUP_FRAMES,
        frame_2(body_2(0xDD, 2, b"ab", [0, 2])),
        "group holds a record size outside 1..16777216",
    ),
]


@pytest.mark.parametrize(("framing", "frame", "reason"), REASONS)
def test_each_check_gives_its_reason(framing: Framing, frame: bytes, reason: str) -> None:
    """The reasons damage reports carry, one per check, alone and after an intact frame.

    The walk gives the one-frame check's reason where it stops, but at end of
    file, where nothing is wrong: no frame is not a bad frame to a walk.
    """
    intact = F1_OK if framing is RECORD_FRAMES else frame_2(body_2(0xDD, 1, b"z", [1]))
    for data in (frame, intact + frame):
        view = memoryview(data)
        offset = len(data) - len(frame)
        why = frame_problem(framing, data, view, offset)
        assert why is not None and why.startswith(reason)
        at_end = offset == len(data)
        walked = (offset, 0 if offset == 0 else 1, None if at_end else why)
        assert check_frames(framing, data, view, 0) == walked


@st.composite
def damaged_frames(draw: st.DrawFn) -> tuple[Framing, bytes]:
    """Intact frames of either format, then a few bytes flipped, cut, zeroed or added."""
    framing = draw(st.sampled_from([RECORD_FRAMES, GROUP_FRAMES]))
    sized = st.binary(min_size=1, max_size=20)
    if framing is RECORD_FRAMES:
        frames = [
            struct.pack(">II", len(p), crc32c(p, crc32c(struct.pack(">I", len(p))))) + p
            for p in draw(st.lists(sized, max_size=6))
        ]
    else:
        groups = draw(st.lists(st.lists(sized, min_size=1, max_size=4), max_size=4))
        frames = [frame_2(body_2(0xDD, len(g), b"".join(g), [len(p) for p in g])) for g in groups]
    data = bytearray(draw(st.binary(max_size=3)) + b"".join(frames))
    for kind, at, value in draw(
        st.lists(
            st.tuples(
                st.sampled_from(["flip", "cut", "zero", "add"]),
                st.integers(0, 200),
                st.integers(0, 255),
            ),
            max_size=3,
        )
    ):
        if not data:
            break
        at %= len(data)
        if kind == "flip":
            data[at] ^= 1 << (value % 8)
        elif kind == "cut":
            del data[at:]
        elif kind == "zero":
            data[at : at + value % 40] = bytes(len(data[at : at + value % 40]))
        else:
            data[at:at] = bytes([value]) * (value % 5 + 1)
    return framing, bytes(data)


@settings(max_examples=300, deadline=None)
@given(damaged_frames())
def test_the_walk_and_the_one_frame_check_agree(case: tuple[Framing, bytes]) -> None:
    """From every offset: the walk stops where a frame first fails, with that frame's
    reason; stepping frame by frame with the one-frame check ends there too; the
    next valid frame found is the first offset the one-frame check accepts."""
    framing, data = case
    view = memoryview(data)
    valid = [o for o in range(len(data)) if frame_problem(framing, data, view, o) is None]
    for offset in range(len(data) + 1):
        stop, records, why = check_frames(framing, data, view, offset)
        assert why == (None if stop == len(data) else frame_problem(framing, data, view, stop))
        step, counted = offset, 0
        while frame_problem(framing, data, view, step) is None:
            step, more, _ = check_frames(framing, data, view, step, last=step)
            counted += more
        assert (step, counted) == (stop, records)
        assert framing.find(data, view, offset) == next((o for o in valid if o >= offset), None)


# --------------------------------------------------------------------------
# both formats in one directory


def test_format_1_segments_followed_by_format_2_ones(tmp_path: Path) -> None:
    old = [payload(i) for i in range(5)]
    with Journal.open(tmp_path, format=1) as journal:
        for one in old:
            journal.append(one)
    write_groups(tmp_path, [[payload(5), payload(6)], [payload(7)]])
    with Journal.open(tmp_path, format=1) as journal:
        assert journal.append(payload(8)) == 9
    versions = [parse_header(p.read_bytes(), b"KVPJ")[1] for p in segments(tmp_path)]
    assert versions == [1, 2, 1]
    assert list(read_journal(tmp_path).records) == list(
        enumerate([*old, *(payload(i) for i in range(5, 9))], start=1)
    )
    snapshot, unchecked = read_unchecked(tmp_path)
    assert snapshot is None and list(unchecked) == list(read_journal(tmp_path).records)
    assert [first_payload(p) for p in segments(tmp_path)] == [payload(0), payload(5), payload(8)]


def test_a_snapshot_inside_a_group(tmp_path: Path) -> None:
    with Journal.open(tmp_path, format=2) as journal:
        for i in range(6):
            journal.append(payload(i))
        journal.commit()
        journal.write_snapshot(4, b"state@4")
    contents = read_journal(tmp_path)
    assert list(contents.records) == [(5, payload(4)), (6, payload(5))]
    assert [(seq, bytes(p), sizes) for seq, p, sizes in contents.records.units()] == [
        (5, payload(4), None),
        (6, payload(5), None),
    ]


def test_rotation_in_format_2(tmp_path: Path) -> None:
    payloads = [payload(i, 1 + i % 40) for i in range(300)]
    with Journal.open(tmp_path, format=2, segment_bytes=256) as journal:
        for index, one in enumerate(payloads):
            journal.append(one)
            if index % 3 == 0:
                journal.commit()
    assert len(segments(tmp_path)) > 10
    assert list(read_journal(tmp_path).records) == list(enumerate(payloads, start=1))


# --------------------------------------------------------------------------
# torn groups and corrupt ones: format 1's rules, a group for a frame


def test_truncation_at_every_offset_of_the_last_groups(tmp_path: Path) -> None:
    groups = [[payload(0)], [payload(1), payload(2, 30)], [payload(3, 5)], [payload(4), payload(5)]]
    write_groups(tmp_path / "src", groups)
    (segment,) = segments(tmp_path / "src")
    data = segment.read_bytes()
    spans = group_spans(segment)
    copy_dir = tmp_path / "copy"
    copy_dir.mkdir()
    copy = copy_dir / segment_name(1)
    for cut in range(spans[1][0], len(data)):
        copy.write_bytes(data[:cut])
        contents = read_journal(copy_dir)
        intact = [i for i, (_, end) in enumerate(spans) if end <= cut]
        last_end = spans[intact[-1]][1]
        assert list(contents.records) == numbered([groups[i] for i in intact]), cut
        assert contents.torn_bytes == cut - last_end, cut
        assert contents.torn_at == (None if cut == last_end else (copy, last_end)), cut


def test_bit_flips_in_the_last_group_are_a_torn_tail(tmp_path: Path) -> None:
    groups = [[payload(0), payload(1)], [payload(2), payload(3), payload(4)]]
    write_groups(tmp_path / "src", groups)
    (segment,) = segments(tmp_path / "src")
    data = segment.read_bytes()
    start, end = group_spans(segment)[-1]
    copy_dir = tmp_path / "copy"
    copy_dir.mkdir()
    copy = copy_dir / segment.name
    for index, bit in itertools.product(range(start, end), range(8)):
        copy.write_bytes(flip_bit(data, index, bit))
        contents = read_journal(copy_dir)
        assert list(contents.records) == numbered(groups[:1]), (index, bit)
        assert contents.torn_at == (copy, start)
        assert contents.torn_bytes == end - start


def test_a_corrupt_group_followed_by_a_valid_one_is_corruption(tmp_path: Path) -> None:
    groups = [[payload(0)], [payload(1), payload(2)], [payload(3)], [payload(4), payload(5)]]
    write_groups(tmp_path / "src", groups)
    (segment,) = segments(tmp_path / "src")
    data = segment.read_bytes()
    start, end = group_spans(segment)[1]
    copy_dir = tmp_path / "copy"
    copy_dir.mkdir()
    copy = copy_dir / segment.name
    for index, bit in itertools.product(range(start, end), range(8)):
        copy.write_bytes(flip_bit(data, index, bit))
        with pytest.raises(JournalCorrupt) as caught:
            read_journal(copy_dir)
        assert (caught.value.path, caught.value.offset) == (copy, start)
        with pytest.raises(JournalCorrupt):
            Journal.open(copy_dir)
        salvaged = read_journal(copy_dir, salvage=True)
        kept = [p for i, g in enumerate(groups) if i != 1 for p in g]
        assert [p for _, p in salvaged.records] == kept, (index, bit)
        assert [(d.offset, d.length) for d in salvaged.damage] == [(start, end - start)]
        assert not salvaged.seqs_exact


def test_zeros_never_parse_as_a_group(tmp_path: Path) -> None:
    write_groups(tmp_path, [[payload(0)], [payload(1)]])
    (segment,) = segments(tmp_path)
    data = segment.read_bytes()
    segment.write_bytes(data + bytes(600))
    contents = read_journal(tmp_path)
    assert len(contents.records) == 2 and contents.torn_bytes == 600
    start, _ = group_spans(segment)[0]
    segment.write_bytes(data[:start] + bytes(len(data) - start))
    contents = read_journal(tmp_path)
    assert list(contents.records) == [] and contents.torn_at == (segment, start)


def test_damage_in_a_sealed_format_2_segment_is_corruption(tmp_path: Path) -> None:
    with Journal.open(tmp_path, format=2, segment_bytes=256) as journal:
        for i in range(100):
            journal.append(payload(i))
            journal.commit()
    first = segments(tmp_path)[0]
    first.write_bytes(first.read_bytes()[:-3])
    with pytest.raises(JournalCorrupt, match=first.name):
        read_journal(tmp_path)
    assert read_journal(tmp_path, salvage=True).last_seq == 100


def test_open_cuts_a_torn_group_and_continues(tmp_path: Path) -> None:
    write_groups(tmp_path, [[payload(0), payload(1)], [payload(2), payload(3)]])
    (segment,) = segments(tmp_path)
    start, end = group_spans(segment)[-1]
    segment.write_bytes(segment.read_bytes()[: end - 2])
    with Journal.open(tmp_path, format=2) as journal:
        assert journal.take_recovered().torn_bytes == end - 2 - start
        assert segment.stat().st_size == start
        assert journal.append(b"fresh") == 3
    assert list(read_journal(tmp_path).records) == [(1, payload(0)), (2, payload(1)), (3, b"fresh")]


# --------------------------------------------------------------------------
# round trip and replay


@settings(max_examples=100, deadline=None)
@given(
    sizes=st.lists(st.integers(min_value=1, max_value=300), min_size=1, max_size=80),
    segment_bytes=st.integers(min_value=HEADER_SIZE + 1, max_value=2048),
    commits=st.lists(st.booleans(), min_size=1, max_size=80),
    formats=st.lists(st.sampled_from([1, 2]), min_size=1, max_size=3),
)
def test_round_trip_any_sizes_commits_rotations_and_formats(
    sizes: list[int], segment_bytes: int, commits: list[bool], formats: list[int]
) -> None:
    expected = [(i + 1, payload(i, size)) for i, size in enumerate(sizes)]
    share = -(-len(expected) // len(formats))  # each writer in turn appends a share
    with tempfile.TemporaryDirectory() as tmp:
        for turn, journal_format in enumerate(formats):
            with Journal.open(tmp, segment_bytes=segment_bytes, format=journal_format) as journal:
                for index in range(turn * share, min(len(expected), (turn + 1) * share)):
                    assert journal.append(expected[index][1]) == index + 1
                    if commits[index % len(commits)]:
                        journal.commit()
        contents = read_journal(tmp)
        assert list(contents.records) == expected
        assert contents.torn_at is None and not contents.damage
        _, unchecked = read_unchecked(tmp)
        assert list(unchecked) == expected


LAYOUT = EngineLayout("prefill-0", (GroupLayout(GroupKind.ATTENTION, 1 << 20),))


def lifecycles(path: Path, journal_format: int, requests: int) -> None:
    registry = Registry()
    with Journal.open(path, fsync=FsyncPolicy.NEVER, format=journal_format) as journal:
        ledger = Ledger(journal, registry, node="prefill-a", clock=lambda: 1000.0)
        ledger.append(registry.check_attach(LAYOUT))
        for i in range(requests):
            rid = f"req-{i}"
            base = i * 4
            blocks = [list(range(base, base + 4))]
            ledger.append(registry.check_register(rid, 1, Role.PUSHER, "prefill-0", "d", blocks))
            ledger.append(registry.check_peer_registration(rid, 1, "d", "d-0", ((7, 8),), 1))
            ledger.append(KvReady(rid, 1))
            ledger.append(registry.plan_trim(rid, 1))
            ledger.append(WriteStarted(rid, 1, 2, 2 * 65536))
            if i % 3:
                journal.commit()
            ledger.append(WriteDone(rid, 1))
            for event in registry.plan_release(rid, 1):
                ledger.append(event)
            if i % 2:
                journal.commit()


@pytest.mark.parametrize("parallel", [False, True])
def test_replay_of_format_2_equals_format_1(tmp_path: Path, parallel: bool) -> None:
    lifecycles(tmp_path / "one", 1, 40)
    lifecycles(tmp_path / "two", 2, 40)
    one = replay(tmp_path / "one", parallel=parallel)
    two = replay(tmp_path / "two", parallel=parallel)
    assert (two.records, two.last_seq, two.first_ts, two.last_ts) == (
        one.records, one.last_seq, one.first_ts, one.last_ts
    )  # fmt: skip
    assert two.registry.snapshot(two.last_seq) == one.registry.snapshot(one.last_seq)
    seen: list[int] = []
    replay(tmp_path / "two", on_record=lambda record, touched: seen.append(record.seq))
    assert seen == list(range(1, one.last_seq + 1))


@pytest.mark.parametrize("journal_format", [1, 2])
def test_on_batch_sees_what_on_record_sees(tmp_path: Path, journal_format: int) -> None:
    lifecycles(tmp_path, journal_format, 200)
    one_by_one: list[tuple[int, object]] = []
    batched: list[tuple[int, object]] = []

    def on_batch(records: list[Record], touched: list[object]) -> None:
        assert 0 < len(records) == len(touched)
        batched.extend((record.seq, t) for record, t in zip(records, touched, strict=True))

    contents = read_journal(tmp_path)
    fold_contents(contents, on_record=lambda r, t: one_by_one.append((r.seq, t)))
    fold_contents(contents, on_batch=on_batch)
    assert batched == one_by_one and len(batched) == contents.last_seq


@pytest.mark.parametrize("journal_format", [1, 2])
def test_a_header_only_segment_file_joins_its_node(tmp_path: Path, journal_format: int) -> None:
    """A rotation right before close leaves a segment with a header alone: it
    names no node, yet belongs to the node whose segments it follows."""
    lifecycles(tmp_path / "j", journal_format, 30)
    last = read_journal(tmp_path / "j").last_seq
    empty = tmp_path / "j" / segment_name(last + 1)
    empty.write_bytes(pack_file_header(b"KVPJ", last + 1, journal_format))
    files = sorted((tmp_path / "j").glob("seg-*.kvj"), reverse=True)
    (source,) = group_sources(files)
    assert source.node == "prefill-a" and source.paths == tuple(sorted(files))
    assert [s.node for s in group_sources([empty])] == [f"?{empty}"]
