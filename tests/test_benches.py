"""The benches run and say something: a smoke run of each, no figure judged.

Speed goals never go into tests (a shared CI box is no place to time
anything); these only check that a bench runs end to end on real daemons and
bare NIXL and prints every row of its table with numbers in it, without
touching bench/RESULTS.md.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.support import REPO

RESULTS = REPO / "bench" / "RESULTS.md"
# "median (min-max)" over the pairs, e.g. "2.49 (2.43-2.55)" or "0.75x (0.67x-0.83x)".
SPREAD = re.compile(r"^-?[\d,]+\.?\d*x? \(-?[\d,]+\.?\d*x?--?[\d,]+\.?\d*x?\)$")

DAEMON_BENCH_ROWS = [
    ("push, 64 KiB blocks, contiguous", True),
    ("push, 64 KiB blocks, scattered", True),
    ("push, 1 MiB blocks, contiguous", True),
    ("push, 1 MiB blocks, scattered", True),
    ("full lifecycle rate", False),
    ("CPU per lifecycle, prefill daemon", False),
    ("CPU per lifecycle, decode daemon", False),
    ("request alone, kv_ready -> KvArrived + BlocksFreeable (bare: one WRITE", True),
    ("latency added over bare NIXL, p50", False),
    ("latency added over bare NIXL, p99", False),
    ("request alone, kv_ready -> KvArrived only", False),
    ("latency added over bare NIXL up to KvArrived, p50", False),
    ("latency added over bare NIXL up to KvArrived, p99", False),
    ("idle CPU, prefill daemon", False),
    ("idle CPU, decode daemon", False),
]


def _bench(*args: str, timeout: float) -> str:
    before = RESULTS.read_text()
    done = subprocess.run(
        [sys.executable, "-m", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert RESULTS.read_text() == before, "a smoke run must not record its figures"
    return done.stdout


def _rows(out: str) -> dict[str, list[str]]:
    rows = {}
    for line in out.splitlines():
        if line.startswith("| ") and not line.startswith("| measurement"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            rows[cells[0]] = cells[1:]
    return rows


@pytest.mark.slow
def test_daemon_bench_quick_prints_every_row_with_numbers() -> None:
    out = _bench("bench.daemon_bench", "--quick", "--no-record", timeout=600)
    rows = _rows(out)
    # Four rows are p50 and p99 of the lone request, to both events and to KvArrived.
    assert len(rows) == 17, rows
    for label, with_bare in DAEMON_BENCH_ROWS:
        matching = [cells for name, cells in rows.items() if label in name]
        assert matching, f"no row {label!r} in:\n{out}"
        for daemon, bare, ratio, _target in matching:
            assert SPREAD.match(daemon), (label, daemon)
            if with_bare:
                assert SPREAD.match(bare), (label, bare)
            if label.startswith("push"):
                assert SPREAD.match(ratio), (label, ratio)
    # One progress line per interleaved pair (the quick run has two).
    assert len(re.findall(r"^pair \d+: push GB/s daemon/bare ", out, re.M)) == 2


def test_memory_bench_quick_prints_both_modes_every_row_with_numbers() -> None:
    out = _bench("bench.memory_bench", "--quick", timeout=300)
    rows = {name: cells for name, cells in _rows(out).items() if not name.startswith("per ")}
    assert len(rows) == 3, rows
    labels = ("make the engine's memory", "attach: connect + register_engine", "push, the whole")
    for label in labels:
        (cells,) = [cells for name, cells in rows.items() if name.startswith(label)]
        assert all(SPREAD.match(cell) for cell in cells), (label, cells)
    # Each round ran both modes, and every push's bytes were compared (else it raised).
    assert len(re.findall(r"^round \d+: push GB/s descriptor [\d.]+ file [\d.]+;", out, re.M)) == 2


@pytest.mark.slow
def test_profile_lifecycle_prints_both_daemons_top_functions() -> None:
    out = _bench(
        "bench.profile_lifecycle", "--requests", "60", "--top", "5", "--no-record", timeout=300
    )
    for node in ("prefill", "decode"):
        section = out[out.index(f"### {node} daemon") :]
        assert re.search(r"loop thread \d+\.\d+", section), section
        for key in ("By own time", "By cumulative time"):
            table = section[section.index(key) :].split("\n\n")[1]
            rows = table.splitlines()[2:]
            assert len(rows) == 5, table
            for row in rows:
                cells = [c.strip() for c in row.strip("|").split("|")]
                assert cells[0].startswith("`") and cells[0].endswith("`"), row
                assert all(re.fullmatch(r"[\d,]+\.\d+", c) for c in cells[1:]), row
    # Some of the daemon's own code is among the cumulative top of each.
    assert out.count("daemon/node/") >= 2


@pytest.mark.slow
def test_ab_lifecycle_runs_a_checkout_and_prints_every_measurement() -> None:
    out = _bench(
        "bench.ab_lifecycle",
        *("--checkout", str(REPO), "--rounds", "1", "--requests", "60", "--single", "10"),
        *("--idle-s", "0.3"),
        timeout=300,
    )
    rows = _rows(out)
    for key in ("rate", "cpu_prefill", "cpu_decode", "cpu_decode_nixl", "p50", "p99"):
        assert key in rows and SPREAD.match(rows[key][0]), (key, out)
    # The worker names its thread, so its CPU shows apart from the rest.
    assert float(rows["cpu_decode_nixl"][0].split()[0]) > 0, out


def test_handoff_micro_prints_each_mechanism() -> None:
    out = _bench("bench.handoff_micro", "--n", "50", timeout=120)
    for what in ("call_soon_threadsafe", "eventfd", "one wake-up per burst", "time.sleep"):
        assert what in out, out
    assert len(re.findall(r"p50 +\d+\.\d us", out)) == 4, out


VERIFY_BENCH_ROWS = [
    "push, 64 KiB blocks, GB/s",
    "push throughput vs off",
    "lifecycle rate, one-block requests",
    "lifecycle rate vs off",
    "CPU per lifecycle, both daemons",
    "CPU per lifecycle vs off",
    "one 4 KiB request alone, p50",
    "one 4 KiB request alone, p99",
    "added p50 vs off",
    "added p99 vs off",
]


@pytest.mark.slow
def test_verify_bench_quick_prints_every_setting_with_numbers() -> None:
    out = _bench("bench.verify_bench", "--quick", timeout=600)
    rows = _rows(out)
    for size in ("4 KiB", "64 KiB", "1 MiB"):
        crc, _xxh3 = rows[size]
        assert re.fullmatch(r"[\d,]+", crc), (size, crc)
    for label in VERIFY_BENCH_ROWS:
        matching = [cells for name, cells in rows.items() if label in name]
        assert len(matching) == 1, f"no row {label!r} in:\n{out}"
        (cells,) = matching
        assert len(cells) == 3 and all(SPREAD.match(c) for c in cells), (label, cells)
    # "all" checked every request the decode daemon got; "off" none.
    (checked,) = [cells for name, cells in rows.items() if name.startswith("requests the decode")]
    off, _sample, every = (re.match(r"(\d+) of (\d+)", c) for c in checked)
    assert off is not None and off[1] == "0"
    assert every is not None and every[1] == every[2] != "0"
    assert len(re.findall(r"^round \d+: off ", out, re.M)) == 2


def test_vllm_ab_reads_the_p_d_bench_first_table_and_only_it() -> None:
    from bench.vllm_ab import parse

    output = (
        "| setup | TTFT p50 ms | TTFT p99 ms | TTFT p50 ms, loaded | TTFT p99 ms, loaded"
        " | req/s loaded, median (min-max) | wrong outputs |\n"
        "|---|---|---|---|---|---|---|\n"
        "| single instance | 11.7 | 32.8 | 248 | 349 | 61.2 (61.2-61.2) | 0 / 40 |\n"
        "| kvpushd | 35.2 | 145.1 | - | 478 | 44.1 (44.1-44.1) | 0 / 40 |\n"
        "\n"
        "| connector | decode clients that gave up | a | b | c | d | e |\n"
        "|---|---|---|---|---|---|---|\n"
        "| kvpushd | 0 / 0 | 0 | 0 | 0 | 0 | 0 |\n"
    )
    rows = parse(output)
    assert rows == {
        "single instance": {
            "TTFT p50 ms": 11.7,
            "TTFT p99 ms": 32.8,
            "TTFT p50 ms, loaded": 248.0,
            "req/s loaded": 61.2,
        },
        # A cell the bench left empty ("-") is absent, not zero.
        "kvpushd": {"TTFT p50 ms": 35.2, "TTFT p99 ms": 145.1, "req/s loaded": 44.1},
    }
    with pytest.raises(ValueError, match="no table"):
        parse("starting the kvpushd pair ...\n")
