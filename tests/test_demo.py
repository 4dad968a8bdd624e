"""``kvpushd demo``: the whole demo as a user runs it, plus its plan and its output helpers.

The process tests start the demo as a subprocess (it starts two real daemons
itself) and read its summary the way a user would; the expected counts come
from the plan, which depends only on ``--requests`` and ``--seed``.
"""

from __future__ import annotations

import argparse
import io
import os
import re
import subprocess
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import pytest

import daemon.sim.demo as demo
import daemon.sim.demo_push as demo_push
from daemon.sim.demo_plan import (
    DELIVERED_KINDS,
    PROBE_KINDS,
    REFUSED_KINDS,
    SLOT_BLOCKS,
    WINDOW,
    Kind,
    make_plan,
    refusals_per_kind,
)
from daemon.sim.demo_push import SHM_PREFIX, Outcome
from daemon.sim.demo_report import Progress
from daemon.sim.engine import SimLayout

Blocks = Sequence[int]

REPO = Path(__file__).resolve().parents[1]
OUTCOME_ROW = re.compile(r"^\s+(delivered|refused), (.+?)\s+(\d+)\s+(\d+)$")
REFUSAL_ROW = re.compile(r"^\s+([a-z_]+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)$")
JOURNAL_LINE = re.compile(r"^\s+(prefill|decode) journal\s+(\S+)\s+\((\d+) records\)$")


def _demo(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "daemon.cli", "demo", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def _outcome_table(stdout: str) -> dict[str, tuple[int, int]]:
    """kind label -> (planned, as planned), from the 'requests by outcome' table."""
    rows = {}
    for line in stdout.splitlines():
        match = OUTCOME_ROW.match(line)
        if match:
            rows[match[2]] = (int(match[3]), int(match[4]))
    return rows


def _refusal_table(stdout: str) -> dict[str, tuple[int, ...]]:
    """reason -> (planned, engines told, prefill journal, decode journal)."""
    section = stdout.split("refusal reason", 1)[1].split("\n\n", 1)[0]
    rows = {}
    for line in section.splitlines():
        match = REFUSAL_ROW.match(line)
        if match:
            rows[match[1]] = tuple(int(match[i]) for i in range(2, 6))
    return rows


def _journals(stdout: str) -> dict[str, tuple[Path, int]]:
    found = {}
    for line in stdout.splitlines():
        match = JOURNAL_LINE.match(line)
        if match:
            found[match[1]] = (Path(match[2]), int(match[3]))
    return found


def _demo_shm_files() -> list[str]:
    return [p for p in os.listdir("/dev/shm") if p.startswith(SHM_PREFIX)]


def _check_summary(stdout: str, requests: int, seed: int) -> None:
    """The summary lists exactly the planned counts, every one as planned."""
    kinds = make_plan(requests, seed).kinds()
    table = _outcome_table(stdout)
    for kind in (*DELIVERED_KINDS, *REFUSED_KINDS):
        assert table[kind.value] == (kinds[kind], kinds[kind]), (kind, table)
    refusals = _refusal_table(stdout)
    for kind in REFUSED_KINDS:
        planned, told, _, _ = refusals[kind.value]
        assert planned == told == kinds[kind], (kind, refusals)
    # The trim refusal happens on the prefill node, which journals it.
    assert refusals[Kind.TOO_LONG.value][2] == kinds[Kind.TOO_LONG]
    assert re.search(r"^\s+total\s+(\d+)\s+\1$", stdout, re.M), stdout
    assert "prefill exited 0, decode exited 0" in stdout
    # verify = "all": every delivered request was checked end to end, none differed.
    checked = re.search(r'verify = "all": (\d+) requests? checked .*?, ([\d,]+) block', stdout)
    assert checked, stdout
    assert int(checked[1]) > 0 and int(checked[2].replace(",", "")) > 0
    assert " 0 mismatches" in stdout
    assert f"demo OK: {requests} requests ended as planned" in stdout
    # The engines' caches went to the daemons as memfds: no file under /dev/shm.
    shared = re.search(r"shared memory\s+(\d+) regions passed to the daemons as sealed memfds"
                       r" \(SCM_RIGHTS\), 0 files created", stdout)  # fmt: skip
    assert shared and int(shared[1]) > 0, stdout


@pytest.mark.slow
def test_demo_keeps_verifiable_journals(tmp_path: Path) -> None:
    workdir = tmp_path / "work"
    result = _demo("--requests", "60", "--seed", "7", "--keep", "--workdir", str(workdir))
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "\r" not in out  # not a terminal: plain progress lines, no bar
    assert "pushed 100%  60/60 requests  0 problems" in out
    # 60 requests: one of each refusal among them.
    assert refusals_per_kind(60) == 1
    _check_summary(out, 60, 7)

    journals = _journals(out)
    assert set(journals) == {"prefill", "decode"}
    for node, (path, records) in journals.items():
        assert path == workdir / f"{node}-journal" and path.is_dir()
        assert records > 60
        verify = subprocess.run(
            [sys.executable, "-m", "daemon.cli", "journal", "verify", str(path)],
            cwd=REPO,
            capture_output=True,
            text=True,
        )
        assert verify.returncode == 0, verify.stdout + verify.stderr
        assert "0 live requests" in verify.stdout
        assert f"journal stats {path}" in out
        assert f"journal show {path} --request r" in out
    # The shared secret the daemons used is private.
    assert (workdir / "secret").stat().st_mode & 0o777 == 0o600
    assert not [p for p in _demo_shm_files() if f"{SHM_PREFIX}{os.getpid()}" in p]


@pytest.mark.slow
def test_demo_other_seed_cleans_up(tmp_path: Path) -> None:
    workdir = tmp_path / "fresh"  # does not exist: the demo creates it and removes it
    before = set(_demo_shm_files())
    result = _demo("--requests", "30", "--seed", "11", "--workdir", str(workdir))
    assert result.returncode == 0, result.stdout + result.stderr
    _check_summary(result.stdout, 30, 11)
    assert "removed; run with --keep" in result.stdout
    assert not workdir.exists()
    assert set(_demo_shm_files()) <= before


def test_demo_across_hosts_runs_each_daemon_in_its_own_network_namespace(tmp_path: Path) -> None:
    workdir = tmp_path / "hosts"
    result = _demo("--hosts", "--requests", "30", "--workdir", str(workdir), "--keep")
    assert result.returncode == 0, result.stdout + result.stderr
    _check_summary(result.stdout, 30, 0)
    hosts = re.search(r"hosts: prefill at (\S+), decode at (\S+) \(", result.stdout)
    assert hosts, result.stdout
    # Each daemon listened on its host's address, and the decode daemon's
    # peer link came from the prefill host's.
    prefill_log = (workdir / "prefill.log").read_text()
    assert f'"host": "{hosts[1]}"' in prefill_log
    assert f'"remote": "{hosts[2]}:' in prefill_log
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "kvp" not in namespaces  # removed with the daemons


@pytest.mark.slow
def test_wrong_bytes_fail_the_demo(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """In process, with an oracle that expects a front-trim: partial hits must be caught.

    The daemon tail-aligns (correctly); the demo, told to expect the decode
    blocks to hold the prefill side's *first* blocks, finds other bytes there.
    That is what the demo reports when a daemon writes into the wrong blocks.
    """

    def front_pairs(
        src_layout: SimLayout, src: Sequence[Blocks], dst_layout: SimLayout, dst: Sequence[Blocks]
    ) -> tuple[tuple[tuple[int, int], ...], ...]:
        return tuple(tuple(zip(d, s[: len(d)], strict=True)) for s, d in zip(src, dst, strict=True))

    monkeypatch.setattr(demo_push, "tail_pairs", front_pairs)  # the pusher's oracle
    workdir = tmp_path / "w"
    args = argparse.Namespace(
        requests=20, block_size=4096, workdir=workdir, keep=False, seed=1, hosts=False
    )
    assert demo.main(args) == 1
    out, err = capsys.readouterr()
    partial = make_plan(20, 1).kinds()[Kind.PARTIAL]
    assert partial > 0
    assert re.search(rf"^\s+NOT AS PLANNED\s+0\s+{partial}$", out, re.M), out
    assert "demo FAILED" in out and "wrong bytes on the decode side" in out
    assert "FAILED with" in err
    # A failed run still stops its daemons cleanly and removes what it created.
    assert "prefill exited 0, decode exited 0" in out
    assert not workdir.exists()


def test_refuses_a_workdir_that_holds_a_journal(tmp_path: Path) -> None:
    (tmp_path / "prefill-journal").mkdir()
    result = _demo("--workdir", str(tmp_path), timeout=30)
    assert result.returncode == 2
    assert "already holds a demo journal" in result.stderr
    assert (tmp_path / "prefill-journal").exists()  # what it did not create it leaves alone


@pytest.mark.parametrize("args", [["--requests", "0"], ["--block-size", "8"]])
def test_bad_options_exit_2(args: list[str]) -> None:
    result = _demo(*args, timeout=30)
    assert result.returncode == 2
    assert "kvpushd demo:" in result.stderr


# ------------------------------------------------------------------ plan


def test_plan_is_a_function_of_requests_and_seed() -> None:
    assert make_plan(200, 3) == make_plan(200, 3)
    assert make_plan(200, 3) != make_plan(200, 4)


@pytest.mark.parametrize(("n", "seed"), [(1, 0), (9, 1), (10, 2), (60, 7), (200, 0), (1000, 5)])
def test_plan_mix_and_counts(n: int, seed: int) -> None:
    plan = make_plan(n, seed)
    kinds = plan.kinds()
    assert plan.size == n == sum(kinds.values())
    for kind in REFUSED_KINDS:
        assert kinds[kind] == refusals_per_kind(n)
    assert len(set(plan.expected())) == n  # every request has its own id
    if n >= 200:
        assert all(kinds[k] > 0 for k in DELIVERED_KINDS)


def test_plan_blocks_stay_in_their_slot_and_tail_align() -> None:
    plan = make_plan(400, 9)
    assert {t.decode_first for t in plan.transfers} == {True, False}  # both orders
    for i, t in enumerate(plan.transfers):
        assert t.slot == i % WINDOW
        base = t.slot * SLOT_BLOCKS
        for ids in (*t.src, *t.dst):
            assert len(set(ids)) == len(ids)
            assert all(base <= b < base + SLOT_BLOCKS for b in ids)
        p_len, d_len = len(t.src[0]), len(t.dst[0])
        if t.kind is Kind.NO_HIT:
            assert d_len == p_len >= 1
        elif t.kind is Kind.PARTIAL:
            assert 1 <= d_len < p_len
        elif t.kind is Kind.FULL_HIT:
            assert t.dst == ((), ())
        elif t.kind is Kind.TOO_LONG:
            assert d_len > p_len
        # Other groups never ask for more than the prefill side holds.
        assert len(t.dst[1]) <= len(t.src[1])
        if t.probe is not None:
            # A probe needs a live destination block of its host to collide with.
            assert t.probe.kind in PROBE_KINDS and t.dst[0]


def test_probes_ride_on_the_request_before_them() -> None:
    plan = make_plan(200, 0)
    for t in plan.transfers:
        if t.probe is not None:
            assert int(t.probe.request_id[1:]) == int(t.request_id[1:]) + 1
    assert Counter(p.kind for p in plan.probes) == {
        Kind.BLOCKS_OWNED: refusals_per_kind(200),
        Kind.DUPLICATE: refusals_per_kind(200),
    }


# -------------------------------------------------------------- progress


def _outcome(ok: bool) -> Outcome:
    return Outcome("r0000", Kind.NO_HIT, "delivered" if ok else "error: x")


def test_progress_plain_lines_every_tenth_without_carriage_returns() -> None:
    out = io.StringIO()
    progress = Progress(25, out, tty=False)
    for i in range(25):
        progress.advance(_outcome(ok=i != 3))
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert len(lines) == 10
    assert lines[-1].startswith("  pushed 100%  25/25 requests  1 problem  ")


def test_progress_bar_on_a_terminal_ends_with_a_newline() -> None:
    out = io.StringIO()
    progress = Progress(5, out, tty=True)
    for _ in range(5):
        progress.advance(_outcome(ok=True))
    text = out.getvalue()
    assert text.startswith("\r  pushing [")
    assert "[" + "#" * 30 + "] 5/5 requests  0 problems" in text
    assert text.endswith(" s\n")
