"""What compiling the pure core would buy: ``statemachine/`` built with mypyc, against this tree.

Replay through the core misses its target (1 M events/s) because
``Registry.apply`` alone costs about 1 us an event in CPython (bench/RESULTS.md,
"Journal format 2"). This measures the design change named for it without
making it: a copy of this tree whose ``statemachine/`` is compiled by mypyc
(which comes with mypy, already a test dependency), then

- the core's own tests run against the compiled copy (the same files: the
  transition table, the registry, its stateful model, the trim, the old
  journals), so a speed-up is only reported for a core that behaves the same;
- ``bench.core_bench --breakdown`` in the plain tree and in the compiled copy,
  interleaved (plain, compiled, compiled, plain, ...).

Nothing in the daemon changes: the compiled copy lives in a temporary
directory and is removed after.

    .venv/bin/python -m bench.compiled_core [--rounds 3] [--events 1000000] [--no-record]

Needs a C compiler and Python's headers. The table goes to stdout and to
bench/RESULTS.md (section "A compiled core, measured").
"""

from __future__ import annotations

import argparse
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.results import load_average, machine, write_section

REPO = Path(__file__).resolve().parents[1]
TITLE = "A compiled core, measured (bench/compiled_core.py)"
# What the copy needs: the core, what it imports, and what the tests and the bench import.
COPIED = ("statemachine", "schemas", "daemon", "harness", "bench", "tests", "pyproject.toml")
CORE_TESTS = (
    "tests/test_transitions.py",
    "tests/test_registry.py",
    "tests/test_registry_stateful.py",
    "tests/test_trim.py",
    "tests/test_reactions.py",
    "tests/test_notices.py",
    "tests/test_old_journals.py",
)
_ROW = re.compile(r"^\| (?P<name>[^|]+?) \| (?P<value>[0-9.,]+) ?(?P<unit>[^|]*?) ?\|$")


def compiled_copy(into: Path) -> None:
    """Copy what is needed into ``into`` and compile its ``statemachine/`` in place."""
    for name in COPIED:
        source = REPO / name
        if source.is_dir():
            shutil.copytree(source, into / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(source, into / name)
    mypyc = Path(sys.executable).with_name("mypyc")
    done = subprocess.run(
        [str(mypyc), "statemachine/"], cwd=into, capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise SystemExit(f"compiled_core: mypyc failed:\n{done.stdout[-3000:]}{done.stderr}")
    built = sorted(p.name for p in (into / "statemachine").glob("*.so"))
    if not built:
        raise SystemExit("compiled_core: mypyc built no extension modules")


def core_tests(where: Path) -> str:
    """Run the core's tests from ``where`` (its ``statemachine`` is the one imported)."""
    probe = subprocess.run(
        [sys.executable, "-c", "import statemachine.registry as r; print(r.__file__)"],
        cwd=where,
        capture_output=True,
        text=True,
        check=True,
    )
    if not probe.stdout.strip().endswith(".so"):
        raise SystemExit(f"compiled_core: the copy imports {probe.stdout.strip()}, not a build")
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *CORE_TESTS],
        cwd=where,
        capture_output=True,
        text=True,
        check=False,
    )
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr
    if done.returncode != 0:
        raise SystemExit(f"compiled_core: the core's tests fail compiled:\n{done.stdout[-3000:]}")
    return summary


def core_bench(where: Path, events: int) -> dict[str, float]:
    """``bench.core_bench --breakdown`` run in ``where``: {row: number}."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.core_bench",
            "--breakdown",
            "--no-write",
            "--events",
            str(events),
        ],
        cwd=where,
        capture_output=True,
        text=True,
        check=True,
    )
    out = {}
    for line in done.stdout.splitlines():
        m = _ROW.match(line)
        if m:
            unit = m["unit"].strip()
            name = m["name"].strip() + (f" ({unit})" if unit else "")
            out[name] = float(m["value"].replace(",", ""))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--no-record", action="store_true", help="do not write RESULTS.md")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kvpushd-compiled-") as tmp:
        copy = Path(tmp)
        began = time.monotonic()
        compiled_copy(copy)
        print(f"compiled in {time.monotonic() - began:.0f} s", file=sys.stderr)
        tests = core_tests(copy)
        print(f"the core's tests, compiled: {tests}", file=sys.stderr)
        runs: dict[str, list[dict[str, float]]] = {"plain": [], "compiled": []}
        for r in range(args.rounds):
            order = ("plain", "compiled") if r % 2 == 0 else ("compiled", "plain")
            for which in order:
                result = core_bench(REPO if which == "plain" else copy, args.events)
                runs[which].append(result)
                print(f"round {r + 1} {which}: {result}", file=sys.stderr, flush=True)
    rows = [key for key in runs["plain"][0] if all(key in run for run in runs["compiled"])]
    lines = [
        "| measurement | plain CPython | compiled core | compiled / plain |",
        "|---|---|---|---|",
    ]
    for key in rows:
        plain = statistics.median(run[key] for run in runs["plain"])
        built = statistics.median(run[key] for run in runs["compiled"])
        lines.append(f"| {key} | {plain:,.2f} | {built:,.2f} | {built / plain:.2f}x |")
    table = "\n".join(lines)
    print(table)
    if not args.no_record:
        context = (
            f"{machine()}; load {load_average()}. Medians of {args.rounds} interleaved runs of "
            f"`bench.core_bench --breakdown --events {args.events}`, plain and with "
            f"`statemachine/` compiled by mypyc (a temporary copy). The core's tests "
            f"({len(CORE_TESTS)} files) against the compiled copy: {tests}. "
            "`python -m bench.compiled_core`."
        )
        write_section(TITLE, context, table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
