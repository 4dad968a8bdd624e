"""Replay and the `kvpushd journal` commands on journals written by the recorder."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from daemon.journal.replay import ReplayError, replay
from daemon.journal.writer import FsyncPolicy, Journal
from daemon.node.ledger import Ledger
from harness.lifecycle import FakeClock, push_one, run_mix
from schemas.events import FORMAT_VERSION, Record, Released, encode_record
from statemachine import Registry

N = 60


def _kvpushd(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "daemon.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).resolve().parents[1],
    )


@pytest.fixture
def journal_dir(tmp_path: Path) -> tuple[Path, Registry, dict[str, int]]:
    path = tmp_path / "journal"
    registry = Registry()
    with Journal.open(path, fsync=FsyncPolicy.NEVER, segment_bytes=16 * 1024) as journal:
        counts = run_mix(Ledger(journal, registry, node="prefill-a", clock=FakeClock()), N)
    return path, registry, counts


def _segments(path: Path) -> list[Path]:
    return sorted(path.glob("seg-*.kvj"))


def test_replay_reproduces_live_registry(journal_dir):
    path, live, _ = journal_dir
    assert len(_segments(path)) > 1, "the fixture must rotate segments"
    result = replay(path)
    assert result.torn_bytes == 0 and not result.damage
    assert result.registry.snapshot(0) == live.snapshot(0)
    assert result.registry.owned_blocks() == live.owned_blocks()


def test_replay_after_snapshot_and_prune_reproduces_live(tmp_path: Path):
    path = tmp_path / "j"
    registry = Registry()
    with Journal.open(path, fsync=FsyncPolicy.NEVER, segment_bytes=8 * 1024) as journal:
        rec = Ledger(journal, registry, node="p", clock=FakeClock())
        run_mix(rec, 40)
        rec.snapshot()
        before = len(_segments(path))
        push_one(rec, "after-snap", prefill_blocks=[[1, 2, 3], [1, 2, 3]], decode_blocks=[[9], [9]])
    result = replay(path)
    assert result.snapshot_seq > 0
    assert result.registry.snapshot(0) == registry.snapshot(0)
    assert before < 10  # old segments were pruned away
    assert result.records > 0  # records after the snapshot were folded too


def test_replay_refuses_illegal_sequence(tmp_path: Path):
    path = tmp_path / "j"
    registry = Registry()
    with Journal.open(path, fsync=FsyncPolicy.NEVER) as journal:
        run_mix(Ledger(journal, registry, node="p", clock=FakeClock()), 5)
        # A release of a request that was already released: intact bytes, illegal history.
        bad = Record(FORMAT_VERSION, "p", journal.next_seq, 1.0, Released("req-0", 1))
        journal.append(encode_record(bad))
    with pytest.raises(ReplayError, match="req-0"):
        replay(path)
    salvaged = replay(path, salvage=True)
    assert len(salvaged.damage) == 1
    proc = _kvpushd("journal", "verify", str(path))
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and "req-0" in proc.stderr


def test_verify_clean(journal_dir):
    path, _, _ = journal_dir
    proc = _kvpushd("journal", "verify", str(path))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("OK:")


def test_verify_torn_tail_reports_bytes(journal_dir):
    path, _, _ = journal_dir
    last = _segments(path)[-1]
    size = last.stat().st_size
    os.truncate(last, size - 3)
    proc = _kvpushd("journal", "verify", str(path))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "TORN TAIL" in proc.stdout and "bytes cut" in proc.stdout
    assert "Traceback" not in proc.stderr


def test_verify_corruption_before_tail(journal_dir):
    path, _, _ = journal_dir
    first = _segments(path)[0]
    data = bytearray(first.read_bytes())
    data[len(data) // 2] ^= 0x40
    first.write_bytes(bytes(data))
    proc = _kvpushd("journal", "verify", str(path))
    assert proc.returncode == 2
    assert "CORRUPT" in proc.stderr and "Traceback" not in proc.stderr


def test_verify_garbage_file_never_tracebacks(tmp_path: Path):
    junk = tmp_path / "seg-00000000000000000001.kvj"
    junk.write_bytes(os.urandom(4096))
    proc = _kvpushd("journal", "verify", str(tmp_path))
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr


def test_show_filters_by_request(journal_dir):
    path, _, _ = journal_dir
    proc = _kvpushd("journal", "show", str(path), "--request", "req-1")
    assert proc.returncode == 0
    lines = proc.stdout.splitlines()
    assert lines, "req-1 has events"
    assert all("request_id=req-1 " in line for line in lines)
    kinds = [line.split()[3] for line in lines]
    assert kinds == [
        "Registered",
        "PeerRegistered",
        "KvReady",
        "Trimmed",
        "WriteStarted",
        "WriteDone",
        "Released",
    ]


def test_stats_counts(journal_dir):
    path, _, counts = journal_dir
    proc = _kvpushd("journal", "stats", str(path), "--json")
    assert proc.returncode == 0, proc.stderr
    stats = json.loads(proc.stdout)
    assert stats["reached"]["done"] == counts["done"]
    assert stats["refusals"]["decode_longer_than_prefill"] == counts["refused"]
    assert stats["failures"]["transfer_error"] == counts["failed"]
    assert stats["reached"]["released"] == N
    assert stats["live"] == 0
    assert stats["latency_s"]["writing->done"]["count"] == counts["done"]
    human = _kvpushd("journal", "stats", str(path))
    assert "writing->done" in human.stdout and "decode_longer_than_prefill" in human.stdout


def test_show_copied_segment(journal_dir, tmp_path: Path):
    path, _, _ = journal_dir
    copy = tmp_path / "copied.kvj"
    shutil.copy(_segments(path)[0], copy)
    proc = _kvpushd("journal", "show", str(copy))
    assert proc.returncode == 0
    assert "DaemonStarted" in proc.stdout.splitlines()[0]
