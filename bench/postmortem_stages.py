"""The two-node postmortem stage by stage, each timed alone (best of 3, seconds).

Reads the journal pair bench/replay_bench.py keeps with ``--dir`` and times
what `kvpushd journal replay` does to it, one stage at a time: the prefill
node's read, core fold, columns and fold_node, the decode node's fold_node,
merge, analyse, and both nodes loaded in parallel. Prints a table.

    .venv/bin/python -m bench.replay_bench --no-write --dir /tmp/rb   # writes the pair once
    .venv/bin/python -m bench.postmortem_stages /tmp/rb
"""

from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Callable
from pathlib import Path

from daemon.journal.reader import read_journal
from daemon.journal.replay import fold_contents
from daemon.postmortem.analyse import analyse
from daemon.postmortem.fold import _KEEP_FOR_ANALYSIS, _Columns, fold_node, no_request
from daemon.postmortem.load import load
from daemon.postmortem.merge import merge
from daemon.postmortem.sources import group_sources


def _best(fn: Callable[[], object]) -> float:
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def stages(directory: Path) -> list[tuple[str, float]]:
    pre, dec = directory / "prefill-journal", directory / "decode-journal"
    contents = read_journal(pre, salvage=True)

    def with_columns() -> None:
        on_batch = _Columns(_KEEP_FOR_ANALYSIS).batch_callback()
        fold_contents(contents, salvage=True, on_batch=on_batch)

    rows = [
        (
            "prefill: read_journal with salvage (CRC pass)",
            _best(lambda: read_journal(pre, salvage=True)),
        ),
        (
            "prefill: core fold (contents read)",
            _best(lambda: fold_contents(contents, salvage=True)),
        ),
        ("prefill: core fold + columns (on_batch)", _best(with_columns)),
        (
            "prefill: fold_node (read, fold, columns, arrays)",
            _best(lambda: fold_node(group_sources([pre])[0], details=no_request)),
        ),
        (
            "decode: fold_node",
            _best(lambda: fold_node(group_sources([dec])[0], details=no_request)),
        ),
    ]
    folds = load([pre, dec], jobs=1, details=no_request)
    merged = merge(folds)
    rows += [
        ("merge (both nodes)", _best(lambda: merge(folds))),
        ("analyse", _best(lambda: analyse(merged))),
        (
            "load, both nodes, in parallel (jobs=2)",
            _best(lambda: load([pre, dec], jobs=2, details=no_request)),
        ),
    ]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dir", type=Path, help="the --dir of bench/replay_bench.py")
    args = parser.parse_args()
    gc.disable()  # as `kvpushd journal replay` runs
    print("| stage | seconds |\n|---|---|")
    for name, seconds in stages(args.dir):
        print(f"| {name} | {seconds:.2f} |")


if __name__ == "__main__":
    main()
