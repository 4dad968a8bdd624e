"""``kvpushd journal replay|timeline`` on journals written by real daemons.

A module fixture runs ``kvpushd demo`` once (two daemon processes, real
NIXL, 60 requests) and keeps its prefill and decode journals. Each anomaly
the postmortem looks for is planted in a copy of them, the way it would
arise (a cut file, records lost from a rewritten copy, a failure journaled
on one side only, a release that never came), and must be found exactly
where it was planted; the untouched journals must show none. A restart is
made by killing a real daemon in a known state instead: see
tests/test_postmortem_restart.py.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import pytest

from daemon.journal.format import FRAME_OVERHEAD
from daemon.journal.writer import FsyncPolicy, Journal
from daemon.postmortem import progress
from daemon.postmortem.analyse import Analysis, RequestSummary, analyse, summarize
from daemon.postmortem.clocks import robust_midpoint
from daemon.postmortem.filters import FilterSpec, parse_time, resolve_filters, select
from daemon.postmortem.formatting import format_time
from daemon.postmortem.load import load
from daemon.postmortem.merge import Merged, merge
from daemon.postmortem.render_json import replay_json
from daemon.postmortem.timeline import Step, timeline
from daemon.postmortem.vocab import S_REGISTERED
from schemas.events import (
    FORMAT_VERSION,
    Failed,
    Record,
    Released,
)
from schemas.reasons import Reason
from tests.support.journals import frames
from tests.support.journals import read_records as _records
from tests.support.journals import write_records as _write

REPO = Path(__file__).resolve().parents[1]
REQUESTS = 60
UTC = {**os.environ, "TZ": "UTC"}


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The journals of one real demo run: {"prefill": dir, "decode": dir}."""
    workdir = tmp_path_factory.mktemp("demo") / "w"
    done = subprocess.run(
        [sys.executable, "-m", "daemon.cli", "demo", "--requests", str(REQUESTS), "--keep",
         "--workdir", str(workdir)],
        cwd=REPO, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return {node: workdir / f"{node}-journal" for node in ("prefill", "decode")}


@pytest.fixture(scope="module")
def clean(demo: dict[str, Path]) -> Merged:
    return merge(load([demo["prefill"], demo["decode"]]))


def _kvpushd(*args: object, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "daemon.cli", *map(str, args)],
        cwd=REPO, capture_output=True, text=True, timeout=120, env=env or UTC,
    )  # fmt: skip


def _replay_json(*args: object) -> dict:
    done = _kvpushd("journal", "replay", *args, "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def _renumber(records: list[Record]) -> list[Record]:
    return [msgspec.structs.replace(r, seq=i) for i, r in enumerate(records, 1)]


def _rid(record: Record) -> str | None:
    return getattr(record.event, "request_id", None)


def _delivered(records: list[Record]) -> list[str]:
    """Requests this node saw written and released, in journal order."""
    written = {_rid(r) for r in records if type(r.event).__name__ == "WriteDone"}
    return [_rid(r) for r in records if isinstance(r.event, Released) and _rid(r) in written]


def _analyse(*paths: Path, **filters: object) -> Analysis:
    merged = merge(load(list(paths)))
    spec = FilterSpec(**filters)  # type: ignore[arg-type]
    return analyse(merged, resolve_filters(spec, merged))


def _kinds(analysis: Analysis) -> dict[str, int]:
    """How many anomalies of each kind an analysis found."""
    return {
        "torn": len(analysis.torn),
        "gaps": len(analysis.gaps),
        "disagreements": len(analysis.disagreements),
        "never_released": len(analysis.never_released),
        "restarts": sum(r.restart for r in analysis.restarts),
        "rejected": len(analysis.rejected),
        "damage": len(analysis.damage),
    }


# ---------------------------------------------------------------- the clean run


def test_clean_demo_counts(demo):
    data = _replay_json(demo["prefill"], demo["decode"])
    # 60 planned requests; the duplicate_request probe reuses a live id.
    assert data["requests_total"] == REQUESTS - 1
    assert data["by_final_state"] == {
        "released after done": 57,
        "released after failed": 1,
        "refused (never live)": 1,
    }
    refusals = {r["reason"]: r for r in data["refusals"]}
    assert set(refusals) == {"blocks_owned", "decode_longer_than_prefill", "duplicate_request"}
    assert all(r["count"] == 1 for r in refusals.values())
    assert refusals["blocks_owned"]["first"]["node"] == "decode"
    assert refusals["decode_longer_than_prefill"]["first"]["node"] == "prefill"
    for kind in ("never_released", "disagreements", "sequence_gaps", "torn_tails", "rejected"):
        assert data[kind] == [], kind
    assert data["damage"] == []
    assert [r["restart"] for r in data["restarts"]] == [False, False]  # two first starts


def test_clean_demo_anomaly_free(demo):
    analysis = _analyse(demo["prefill"], demo["decode"])
    assert _kinds(analysis) == dict.fromkeys(_kinds(analysis), 0)


def test_clock_offset_is_estimated_and_said(demo, clean):
    (pair,) = clean.clocks.pairs
    assert (pair.pusher, pair.receiver) == ("prefill", "decode")
    delivered = len(_delivered(_records(demo["decode"])))
    assert pair.lower_bounds >= delivered and pair.upper_bounds >= delivered
    # Both daemons ran on this machine, one clock: the estimate sits between
    # its bounds, and so does the truth (0).
    assert pair.low <= pair.offset <= pair.high
    assert pair.low <= 0 <= pair.high and pair.trimmed == 0 and pair.contradicting == 0
    out = _kvpushd("journal", "replay", demo["prefill"], demo["decode"]).stdout
    assert "times are prefill's clock" in out
    said = " ".join(out.split())  # the text is wrapped
    assert f"robust midpoint of causal bounds from {pair.requests} request pairs" in said
    assert f"{pair.lower_bounds} lower bounds" in said
    assert f"{pair.upper_bounds} upper bounds" in said


def _first_time(steps: list[Step], node: str, event: str) -> float | None:
    times = [s.ts for s in steps if s.node == node and s.event == event]
    return times[0] if times else None


def assert_causal(merged: Merged) -> int:
    """Every request's merged timeline respects what the messages imply; returns pairs checked."""
    checked = 0
    for r in range(merged.requests):
        steps = list(timeline(merged, r).steps)
        assert [s.ts for s in steps] == sorted(s.ts for s in steps)
        for node in merged.names:  # each node's own order is kept
            seqs = [s.seq for s in steps if s.node == node]
            assert seqs == sorted(seqs)
        registered = _first_time(steps, "decode", "registered")
        forwarded = _first_time(steps, "prefill", "peer_registered")
        if registered is not None and forwarded is not None:
            assert registered <= forwarded, merged.keys[r]
            checked += 1
        writing = _first_time(steps, "prefill", "write_started")
        for event in ("write_started", "write_done"):
            seen = _first_time(steps, "decode", event)
            if writing is not None and seen is not None:
                assert writing <= seen, (merged.keys[r], event)
                checked += 1
    return checked


def test_merged_timelines_are_causal(clean):
    assert assert_causal(clean) > 100


def test_skewed_clock_is_corrected(demo, tmp_path):
    """The decode node's clock 7 s fast: found, and every timeline causal again."""
    skew = 7.0
    records = [msgspec.structs.replace(r, ts=r.ts + skew) for r in _records(demo["decode"])]
    skewed = _write(tmp_path / "decode-skewed", records)
    merged = merge(load([demo["prefill"], skewed]))
    (pair,) = merged.clocks.pairs
    assert pair.low <= skew <= pair.high
    assert abs(pair.offset - skew) <= (pair.high - pair.low) / 2 + 1e-9
    assert assert_causal(merged) > 100


# ---------------------------------------------------------------- planted anomalies


def test_torn_tail(demo, tmp_path):
    copy = tmp_path / "decode"
    shutil.copytree(demo["decode"], copy)
    (segment,) = sorted(copy.glob("seg-*.kvj"))
    intact = frames(segment)
    with_release = [o for o, _, rs in intact if any(isinstance(r.event, Released) for r in rs)]
    offset = with_release[-1]
    cut = offset + FRAME_OVERHEAD + 3  # a crash (or a copy) cut the last release short
    size = segment.stat().st_size
    os.truncate(segment, cut)
    analysis = _analyse(demo["prefill"], copy)
    (torn,) = analysis.torn
    assert (torn.node, Path(torn.path), torn.offset, torn.nbytes) == (
        "decode", segment, offset, cut - offset
    )  # fmt: skip
    assert size > cut
    # The releases in the torn frame (one record in format 1, its whole
    # commit in format 2) were lost: those requests never reached released.
    lost = {
        _rid(r)
        for at, _, records in intact
        if at >= offset
        for r in records
        if isinstance(r.event, Released)
    }
    assert lost
    assert {(s.key[0], s.node) for s in analysis.never_released} == {
        (rid, "decode") for rid in lost
    }
    assert _kinds(analysis) | {"torn": 0, "never_released": 0} == dict.fromkeys(_kinds(analysis), 0)


def test_sequence_gap(demo, tmp_path):
    records = _records(demo["decode"])
    # The decode side may skip `writing` (the notification can beat the
    # pusher's word), so dropping one leaves a legal history with a hole.
    dropped = next(
        r for r in records[len(records) // 2 :] if type(r.event).__name__ == "WriteStarted"
    )
    copy = _write(tmp_path / "decode", [r for r in records if r is not dropped])
    analysis = _analyse(demo["prefill"], copy)
    (gap,) = analysis.gaps
    assert (gap.node, gap.first_missing, gap.last_missing, gap.repeated) == (
        "decode", dropped.seq, dropped.seq, False
    )  # fmt: skip
    assert _kinds(analysis) | {"gaps": 0} == dict.fromkeys(_kinds(analysis), 0)
    out = _kvpushd("journal", "replay", demo["prefill"], copy).stdout
    assert f"decode  {dropped.seq}" in out.split("sequence gaps", 1)[1]


def test_sides_disagree(demo, tmp_path):
    records = _records(demo["decode"])
    victim = _delivered(records)[5]
    # The decode side journals a failure where it had journaled the data's
    # arrival: the prefill side still says done.
    planted = [
        msgspec.structs.replace(
            r, event=Failed(victim, 1, Reason.DEADLINE_EXCEEDED, "planted", settled=True)
        )
        if _rid(r) == victim and type(r.event).__name__ == "WriteDone"
        else r
        for r in records
    ]
    copy = _write(tmp_path / "decode", planted)
    analysis = _analyse(demo["prefill"], copy)
    (split,) = analysis.disagreements
    assert split.key == (victim, 1)
    sides = {s.node: (s.outcome, s.reason) for s in split.sides}
    assert sides == {"prefill": ("done", ""), "decode": ("failed", "deadline_exceeded")}
    assert _kinds(analysis) | {"disagreements": 0} == dict.fromkeys(_kinds(analysis), 0)


def test_a_transfer_whose_rank_shares_ended_differently_is_grouped(demo, tmp_path):
    # Four delivered requests become the two TP ranks' shares of two transfers
    # on both nodes; one share of the second fails on the decode side.
    pre, dec = _records(demo["prefill"]), _records(demo["decode"])
    chosen = [r for r in _delivered(dec) if r in set(_delivered(pre))][:4]
    names = {
        chosen[0]: "T-ok@tp0",
        chosen[1]: "T-ok@tp1",
        chosen[2]: "T-split@tp0",
        chosen[3]: "T-split@tp1",
    }

    def renamed(records: list, fail: str | None = None) -> list:
        out = []
        for r in records:
            rid = _rid(r)
            if rid in names:
                event = msgspec.structs.replace(r.event, request_id=names[rid])
                if names[rid] == fail and type(r.event).__name__ == "WriteDone":
                    event = Failed(names[rid], 1, Reason.DEADLINE_EXCEEDED, "planted", settled=True)
                r = msgspec.structs.replace(r, event=event)
            out.append(r)
        return out

    prefill = _write(tmp_path / "prefill", renamed(pre))
    decode = _write(tmp_path / "decode", renamed(dec, fail="T-split@tp1"))
    analysis = _analyse(prefill, decode)
    (split,) = analysis.split_transfers  # T-ok's shares both loaded: not listed
    assert split.transfer == "T-split"
    assert split.shares == (
        (("T-split@tp0", 1), "done"),
        (("T-split@tp1", 1), "failed (deadline_exceeded)"),
    )
    shown = _kvpushd("journal", "replay", prefill, decode).stdout
    assert "transfers whose rank shares ended differently" in shown
    assert "T-split@tp0#1: done; T-split@tp1#1: failed (deadline_exceeded)" in shown, shown


def test_request_never_released(demo, tmp_path):
    records = _records(demo["prefill"])
    victim = _delivered(records)[3]
    engine = next(r.event.engine_id for r in records if _rid(r) == victim and
                  type(r.event).__name__ == "Registered")  # fmt: skip
    # Its release never came, and so its engine could not detach at the stop.
    kept = [
        r
        for r in records
        if not (_rid(r) == victim and isinstance(r.event, Released))
        and not (type(r.event).__name__ == "EngineDetached" and r.event.engine_id == engine)
    ]
    copy = _write(tmp_path / "prefill", _renumber(kept))  # renumbered: no gap, just no release
    analysis = _analyse(copy, demo["decode"])
    (stuck,) = analysis.never_released
    assert (stuck.key, stuck.node, stuck.state, stuck.last_event) == (
        (victim, 1), "prefill", "done", "write_done"
    )  # fmt: skip
    assert stuck.age > 0
    assert _kinds(analysis) | {"never_released": 0} == dict.fromkeys(_kinds(analysis), 0)
    merged = analysis.merged
    assert merged.label(merged.keys.index((victim, 1))) == "done (not released)"


def test_record_the_core_rejects(demo, tmp_path):
    records = _records(demo["decode"])
    victim = _delivered(records)[0]
    last = records[-1]
    again = Record(FORMAT_VERSION, "decode", last.seq + 1, last.ts + 0.5, Released(victim, 1))
    copy = _write(tmp_path / "decode", [*records, again])
    analysis = _analyse(demo["prefill"], copy)
    (rejected,) = analysis.rejected
    assert (rejected.node, rejected.seq, rejected.key) == ("decode", again.seq, (victim, 1))
    assert "stale" in rejected.message or "released" in rejected.message
    steps = timeline(analysis.merged, analysis.merged.keys.index((victim, 1))).steps
    assert steps[-1].detail.startswith("REJECTED by the core on replay")
    assert _kinds(analysis) | {"rejected": 0} == dict.fromkeys(_kinds(analysis), 0)


# ---------------------------------------------------------------- filters


def _selected(merged: Merged, **filters: object) -> set[str]:
    spec = FilterSpec(**filters)  # type: ignore[arg-type]
    mask = select(merged, resolve_filters(spec, merged))
    return {merged.keys[r][0] for r in range(merged.requests) if mask[r]}


def _ids(merged: Merged, keep: Callable[[RequestSummary], bool]) -> set[str]:
    """The expected answer, from each request's summary (not the filter code)."""
    return {s.key[0] for s in (summarize(merged, r) for r in range(merged.requests)) if keep(s)}


def test_filter_request(clean):
    assert _selected(clean, requests=("r0002",)) == {"r0002"}
    assert _selected(clean, requests=("r0002#1", "r0005")) == {"r0002", "r0005"}
    assert _selected(clean, requests=("r0002#2",)) == set()
    assert _selected(clean, requests=("r001*",)) == {f"r001{i}" for i in range(10)}


def test_filter_state(clean):
    def by(state: str) -> set[str]:
        return _ids(clean, lambda s: any(state in (x.final, x.outcome) for x in s.sides))

    assert _selected(clean, states=("failed",)) == by("failed") == {"r0001"}
    assert _selected(clean, states=("refused",)) == by("refused") == {"r0013"}
    assert _selected(clean, states=("released",)) == by("released")
    assert len(by("released")) == REQUESTS - 2
    assert _selected(clean, states=("failed", "refused")) == {"r0001", "r0013"}
    assert _selected(clean, states=("writing",)) == set()


def test_filter_reason_and_node(clean):
    assert _selected(clean, reasons=("blocks_owned",)) == {"r0013"}
    assert _selected(clean, reasons=("duplicate_request", "decode_longer_than_prefill")) == {
        "r0033",
        "r0001",
    }
    assert _selected(clean, nodes=("prefill",)) == _ids(
        clean, lambda s: any(x.node == "prefill" for x in s.sides)
    )
    assert "r0013" not in _selected(clean, nodes=("prefill",))
    assert _selected(clean, nodes=("decode",), states=("released",),
                     reasons=("duplicate_request",)) == {"r0033"}  # fmt: skip


def _lives(merged: Merged) -> dict[str, tuple[float, float]]:
    """Each request's first and last step, from its timeline."""
    spans = {}
    for r in range(merged.requests):
        times = [s.ts for s in timeline(merged, r).steps]
        spans[merged.keys[r][0]] = (min(times), max(times))
    return spans


def test_filter_time_window(clean):
    lives = _lives(clean)
    middle = sorted(lives.values())[len(lives) // 2]
    # Relative times count from the journals' first and last record.
    start, end = float(clean.node_first.min()), float(clean.node_last.max())
    as_iso = format_time(middle[0], date=True).replace(" ", "T")  # local, no zone
    of_day = format_time(middle[0] + 0.05)
    since, until = parse_time(as_iso, start, end), parse_time(of_day, start, end)
    assert since == pytest.approx(middle[0], abs=1e-6)
    assert until == pytest.approx(middle[0] + 0.05, abs=1e-6)
    expected = {rid for rid, (a, b) in lives.items() if b >= since and a <= until}
    assert 1 < len(expected) < len(lives)
    assert _selected(clean, since=as_iso, until=of_day) == expected
    recent = {rid for rid, (_, b) in lives.items() if b >= end - 0.2}
    assert 0 < len(recent) < len(lives)
    assert _selected(clean, since="-200ms") == recent
    # Engines attach a while after the daemons start: count from the first request.
    after = round((min(a for a, _ in lives.values()) - start) * 1e3) + 100
    early = {rid for rid, (a, _) in lives.items() if a <= start + after / 1e3}
    assert 0 < len(early) < len(lives)
    assert _selected(clean, until=f"+{after}ms") == early


def test_parse_time_forms():
    start, end = 1_796_000_000.0, 1_796_000_000.0 + 3600
    assert parse_time("-15m", start, end) == end - 900
    assert parse_time("+90s", start, end) == start + 90
    assert parse_time("1796000123.5", start, end) == 1796000123.5
    assert parse_time("2026-11-29T02:10:00+00:00", start, end) == 1795918200.0
    day_start = parse_time(format_time(start), start, end)
    assert day_start == pytest.approx(start, abs=1e-6)
    with pytest.raises(ValueError, match="not a time"):
        parse_time("yesterday", start, end)


def test_cli_filters_and_errors(demo, clean):
    # A relative time written as the help shows it: a value starting with "-",
    # which argparse alone would take for an option.
    recent = _replay_json(demo["prefill"], demo["decode"], "--since", "-200ms", "--limit", "0")
    expected = _selected(clean, since="-200ms")
    assert expected and {r["request_id"] for r in recent["requests"]} == expected
    data = _replay_json(demo["prefill"], demo["decode"], "--state", "failed")
    assert [r["request_id"] for r in data["requests"]] == ["r0001"]
    assert data["requests_selected"] == 1 and data["requests_total"] == REQUESTS - 1
    bad = _kvpushd("journal", "replay", demo["prefill"], "--state", "lost")
    assert bad.returncode == 2 and "unknown state" in bad.stderr
    missing = _kvpushd("journal", "timeline", demo["prefill"], demo["decode"], "--request", "nope")
    assert missing.returncode == 1 and "no request nope" in missing.stderr


# ---------------------------------------------------------------- timeline


def test_timeline_command(demo):
    done = _kvpushd("journal", "timeline", demo["prefill"], demo["decode"], "--request", "r0002")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("r0002#1: released after done")
    header = lines[2].split()
    assert header == ["time", "+ms", "node", "event", "state", "blocks", "bytes", "detail"]
    rows = lines[4:]
    events = [(row.split()[2], row.split()[3]) for row in rows]
    assert events[0] == ("decode", "registered")
    assert ("prefill", "trimmed") in events and events[-1][1] == "released"
    trimmed = next(row for row in rows if " trimmed " in row)
    assert "registered -> trimmed" in trimmed and "src " in trimmed and " -> " in trimmed
    written = next(row for row in rows if "prefill  write_started" in row)
    assert "trimmed -> writing" in written
    times = [row.split()[0] for row in rows]
    assert times == sorted(times)
    as_json = json.loads(
        _kvpushd("journal", "timeline", demo["prefill"], demo["decode"], "--request", "r0002",
                 "--json").stdout
    )  # fmt: skip
    (item,) = as_json
    assert len(item["steps"]) == len(rows)
    assert item["steps"][0]["since_previous"] is None
    nbytes = [s["nbytes"] for s in item["steps"] if s["event"] == "write_started"]
    # The pusher always journals write_started; the receiver only when the
    # pusher's "writing" reaches it before the NIXL notification does (when
    # the data lands first it goes registered -> done). Both say the same size.
    assert nbytes[0] > 0 and len(nbytes) in (1, 2) and len(set(nbytes)) == 1


def test_timeline_of_refused_and_failed(clean):
    refused = timeline(clean, clean.keys.index(("r0013", 1)))
    assert [(s.node, s.event) for s in refused.steps] == [("decode", "refused")]
    assert "blocks_owned" in refused.steps[0].detail
    failed = timeline(clean, clean.keys.index(("r0001", 1)))
    assert failed.summary.label == "released after failed"
    assert any(
        "decode_longer_than_prefill" in s.detail for s in failed.steps if s.event == "failed"
    )


# ---------------------------------------------------------------- inputs


def test_segment_files_of_one_node_fold_together(demo, tmp_path):
    """Segment files copied out of a journal, given in any order, are one node."""
    split = _write(tmp_path / "prefill", _records(demo["prefill"]), segment_bytes=4096)
    segments = sorted(split.glob("seg-*.kvj"))
    assert len(segments) > 3
    copies = tmp_path / "copies"
    copies.mkdir()
    for segment in segments:
        shutil.copy(segment, copies / segment.name)
    files = sorted(copies.iterdir(), reverse=True)
    from_files = _replay_json(*files, demo["decode"])
    from_dir = _replay_json(demo["prefill"], demo["decode"])
    for name in ("by_final_state", "refusals", "never_released", "sequence_gaps", "requests"):
        assert from_files[name] == from_dir[name], name
    assert from_files["journals"][0]["sources"] == [str(p) for p in sorted(files)]


def test_parallel_and_sequential_agree(demo):
    paths = [demo["prefill"], demo["decode"]]
    one = replay_json(analyse(merge(load(paths, jobs=1))))
    two = replay_json(analyse(merge(load(paths, jobs=2))))
    assert one == two


def test_missing_journal_is_an_error(tmp_path):
    done = _kvpushd("journal", "replay", tmp_path / "nothing")
    assert done.returncode == 2 and "no such file" in done.stderr


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_only_on_a_terminal(tmp_path, monkeypatch):
    from bench.replay_bench import write_pair

    paths = write_pair(tmp_path, 60_000)
    monkeypatch.setattr(progress, "PROGRESS_MIN_RECORDS", 1)
    monkeypatch.setattr(progress, "PROGRESS_EVERY", 1024)
    monkeypatch.setattr(progress.ProgressBar, "INTERVAL_S", 0.01)
    terminal, pipe = _Terminal(), io.StringIO()
    load(list(paths.values()), progress=terminal, jobs=1)
    load(list(paths.values()), progress=pipe, jobs=1)
    assert "replaying [" in terminal.getvalue() and "records" in terminal.getvalue()
    assert terminal.getvalue().endswith("\r\x1b[2K")  # the bar is cleared at the end
    assert pipe.getvalue() == ""


def _iter_robust_cases() -> Iterator[tuple[list[float], list[float], float]]:
    yield [0.1, 0.2], [0.5, 0.4], 0.3
    yield [0.1], [], 0.1
    yield [], [0.4], 0.4


@pytest.mark.parametrize(("lower", "upper", "expected"), list(_iter_robust_cases()))
def test_robust_midpoint(lower, upper, expected):
    import numpy as np

    offset, *_, trimmed = robust_midpoint(np.array(lower), np.array(upper))
    assert offset == pytest.approx(expected) and trimmed == 0


def test_robust_midpoint_sets_aside_a_clock_step():
    import numpy as np

    # 100 consistent pairs around +2 ms, and two bounds from after a 1 s step.
    lower = np.r_[np.linspace(0.0010, 0.0019, 100), [1.0]]
    upper = np.r_[np.linspace(0.0021, 0.0030, 100), [-0.9]]
    offset, low, high, trimmed = robust_midpoint(lower, upper)
    assert 0 < trimmed <= 0.05 and low <= offset <= high
    assert offset == pytest.approx(0.002, abs=2e-4)


def test_journal_with_a_snapshot(tmp_path):
    """Old segments pruned behind a snapshot: requests live at the snapshot carry on."""
    from daemon.node.ledger import Ledger
    from harness.lifecycle import PREFILL, FakeClock, run_mix
    from schemas.events import KvReady, WriteDone, WriteStarted
    from schemas.layout import Role
    from statemachine import Registry

    path = tmp_path / "journal"
    registry = Registry()
    with Journal.open(path, fsync=FsyncPolicy.NEVER, segment_bytes=4096) as journal:
        rec = Ledger(journal, registry, node="prefill-a", clock=FakeClock())
        run_mix(rec, 30)
        for rid in ("carried", "stuck"):
            blocks = [[3000, 3001], [3000, 3001]]
            rec.append(registry.check_register(rid, 1, Role.PUSHER, PREFILL.engine_id, "d", blocks))
            rec.append(registry.check_peer_registration(rid, 1, "d", "decode-0", ((1,), (1,)), 1))
            rec.append(KvReady(rid, 1))
        snapshot_seq = rec.snapshot(retain_segments=0)
        rec.append(registry.plan_trim("carried", 1))
        rec.append(WriteStarted("carried", 1, 2, 8192))
        rec.append(WriteDone("carried", 1))
        for event in registry.plan_release("carried", 1):
            rec.append(event)
    assert not (path / "seg-00000000000000000001.kvj").exists(), "the snapshot pruned"
    analysis = _analyse(path)
    node = analysis.merged.nodes[0]
    assert node.snapshot_seq == snapshot_seq and node.records == 4
    assert {k: v.state for k, v in node.at_snapshot.items()} == {
        ("carried", 1): S_REGISTERED,
        ("stuck", 1): S_REGISTERED,
    }
    (stuck,) = analysis.never_released
    assert (stuck.key, stuck.state, stuck.last_event) == (
        ("stuck", 1), "registered", "(before the snapshot)"
    )  # fmt: skip
    # It entered its state before the snapshot, which says when.
    assert stuck.since == node.at_snapshot[("stuck", 1)].entered and stuck.age > 0
    assert summarize(analysis.merged, analysis.merged.keys.index(("stuck", 1))).sides[0].role == (
        "pusher"
    )
    merged = analysis.merged
    carried = timeline(merged, merged.keys.index(("carried", 1)))
    assert carried.summary.label == "released after done"
    assert carried.steps[0].before == "registered" and carried.steps[0].after == "trimmed"
    assert analysis.gaps == [] and analysis.rejected == []


def test_engine_holds_are_listed_apart_from_daemon_time(demo, tmp_path):
    records = _records(demo["prefill"])
    victim = _delivered(records)[-1]
    # Its engine kept the blocks 5 s after done: every record from its release
    # on is later (other requests done by then are held longer too).
    at = next(
        i for i, r in enumerate(records) if _rid(r) == victim and isinstance(r.event, Released)
    )
    held = records[:at] + [msgspec.structs.replace(r, ts=r.ts + 5.0) for r in records[at:]]
    copy = _write(tmp_path / "prefill", held)
    merged = merge(load([copy]))
    analysis = analyse(merged, resolve_filters(FilterSpec(), merged), top=REQUESTS * 10)
    holds = {t.key: t.seconds for t in analysis.longest_holds}
    assert holds[(victim, 1)] >= 5.0
    assert {t.name for t in analysis.longest_holds} == {"done->released"}
    assert "done->released" not in {t.name for t in analysis.slowest}
    assert analysis.slowest, "the daemon's own transitions are still listed"
    text = _kvpushd("journal", "replay", copy, "--top", REQUESTS * 10).stdout
    section = text[text.index("longest engine holds") :].split("\n\n")[0]
    assert f"{victim}#1" in section
    data = _replay_json(copy, "--top", REQUESTS * 10)
    assert victim in {t["request_id"] for t in data["longest_engine_holds"]}
    assert all(t["name"] != "done->released" for t in data["slowest_transitions"])


def test_report_and_cli_name_the_same_zone(demo, tmp_path):
    # A zone that is neither UTC nor whole hours (POSIX TZ: no tz database needed).
    india = {**os.environ, "TZ": "IST-5:30"}
    journals = (demo["prefill"], demo["decode"])
    text = _kvpushd("journal", "replay", *journals, env=india).stdout
    assert "times in IST (UTC+05:30), " in text
    html_path = tmp_path / "r.html"
    done = _kvpushd("journal", "report", *journals, "-o", html_path, env=india)
    assert done.returncode == 0, done.stderr
    html = html_path.read_text()
    assert "times in IST (UTC+05:30), " in html
    assert re.search(r'"utcOffset":\s*19800\b', html)  # the chart's clock: the same zone
    # The first record of the prefill journal reads the same in both.
    first = next(line for line in text.splitlines() if line.lstrip().startswith("prefill "))
    first = first.split()
    assert f"{first[4]} {first[5]}" in html
    utc = _kvpushd("journal", "replay", *journals).stdout
    assert "times in UTC, " in utc
