"""bench/postmortem_stages.py and replay_bench's journal pair: a smoke run, no figure judged."""

from __future__ import annotations

from pathlib import Path

from bench.postmortem_stages import stages
from bench.replay_bench import write_pair
from daemon.journal.format import parse_header


def test_stages_of_a_small_format_2_pair(tmp_path: Path) -> None:
    paths = write_pair(tmp_path, 20_000)
    for path in paths.values():
        (segment,) = path.glob("seg-*.kvj")
        assert parse_header(segment.read_bytes()[:18], b"KVPJ")[1] == 2
    rows = stages(tmp_path)
    assert len(rows) == 8 and all(seconds > 0 for _, seconds in rows)
