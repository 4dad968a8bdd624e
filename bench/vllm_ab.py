"""Two checkouts of kvpushd on real vLLM, interleaved: P/D TTFT and requests/s before and after.

For a change's before/after on real vLLM (issue 25): each round runs
``bench.vllm_pd_bench`` once from every checkout in turn, the order
alternating (A B, B A, ...). A run takes its checkout's daemons AND its
connector: the bench starts from the checkout's directory with the checkout
first on ``PYTHONPATH``, which the vLLM servers it starts inherit, so their
``KvpushdConnector`` is that checkout's and not the editable install's.
One-instance and NixlPushConnector rows come with every run: they show how
loaded the machine was when that run ran.

    .venv-vllm/bin/python -m bench.vllm_ab --checkout /tmp/before --checkout . [--rounds 3]

Each checkout needs a ``.venv-vllm`` (a link to this one's will do) and a
``bench/vllm_pd_bench.py`` that takes the flags below. Every run's own
output is kept in ``--out``; the driver prints a table of medians (min-max)
per checkout; nothing is recorded.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from bench.results import spread

# Columns of vllm_pd_bench's first table that this compares, by header.
COLUMNS = {
    "TTFT p50 ms": "TTFT p50 ms",
    "TTFT p99 ms": "TTFT p99 ms",
    "TTFT p50 ms, loaded": "TTFT p50 ms, loaded",
    "req/s loaded": "req/s loaded, median (min-max)",
}
SETUPS = ("single instance", "NixlPushConnector", "kvpushd")


def parse(table: str) -> dict[str, dict[str, float]]:
    """{setup: {column: value}} from vllm_pd_bench's first markdown table."""
    lines: list[str] = []
    for line in table.splitlines():
        if line.startswith("|"):
            lines.append(line)
        elif lines:
            break  # the first table ends at its first other line
    if len(lines) < 3:
        raise ValueError("no table in the bench's output")
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    out: dict[str, dict[str, float]] = {}
    for line in lines[2:]:
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        row = dict(zip(header, cells, strict=True))
        values = {}
        for key, column in COLUMNS.items():
            if column in row and row[column] not in ("", "-"):
                values[key] = float(row[column].split()[0])
        out[row["setup"]] = values
    return out


def run_once(
    checkout: Path, out: Path, concurrent: int, bench_rounds: int
) -> dict[str, dict[str, float]]:
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    argv = [
        str(checkout / ".venv-vllm" / "bin" / "python"),
        "-m",
        "bench.vllm_pd_bench",
        "--rounds",
        str(bench_rounds),
        "--concurrent",
        str(concurrent),
        "--aborts",
        "0",
        "--no-pull",
        "--no-record",
    ]
    with out.open("w") as stdout, out.with_suffix(".err").open("w") as stderr:
        subprocess.run(argv, cwd=checkout, env=env, stdout=stdout, stderr=stderr, check=True)
    return parse(out.read_text())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkout", action="append", type=Path, default=[])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrent", type=int, default=24)
    parser.add_argument(
        "--bench-rounds",
        type=int,
        default=1,
        help="rounds inside each run (its servers started once): more loaded samples per start",
    )
    parser.add_argument("--out", type=Path, default=Path("/tmp/kvpushd-vllm-ab"))
    args = parser.parse_args(argv)
    if len(args.checkout) < 2:
        parser.error("give two --checkout (before, after) or more")
    checkouts = [c.resolve() for c in args.checkout]
    args.out.mkdir(parents=True, exist_ok=True)
    runs: dict[Path, list[dict[str, dict[str, float]]]] = {c: [] for c in checkouts}
    for r in range(args.rounds):
        order = checkouts if r % 2 == 0 else checkouts[::-1]
        for i, checkout in enumerate(order):
            began = time.monotonic()
            result = run_once(
                checkout, args.out / f"r{r + 1}-{i + 1}.txt", args.concurrent, args.bench_rounds
            )
            runs[checkout].append(result)
            print(
                f"round {r + 1} {checkout}: {result} ({time.monotonic() - began:.0f} s,"
                f" load {os.getloadavg()[0]:.2f})",
                file=sys.stderr,
                flush=True,
            )
    print("| setup | measurement | " + " | ".join(str(c) for c in checkouts) + " |")
    print("|---|---|" + "---|" * len(checkouts))
    for setup in SETUPS:
        for key in COLUMNS:
            cells = [
                spread([run[setup][key] for run in runs[c] if key in run.get(setup, {})])
                for c in checkouts
            ]
            print(f"| {setup} | {key} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
