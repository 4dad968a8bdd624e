"""The core stays pure: no I/O frameworks, no shell, no clocks, no randomness.

ARCHITECTURE.md, Wings: the core imports only schemas and the standard library,
never asyncio, nixl, torch or the daemon; time enters it as a value inside
events, and the shell owns clocks and deadlines.

This is the one place for that rule; tests/test_layout.py pins the other
wings' import rules with the same scanner (tests/support/imports.py).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.imports import DYNAMIC, is_under, statements

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "statemachine"
CORE_FILES = sorted(CORE.glob("*.py"))

# Must never be loaded by importing the core, directly or transitively.
FORBIDDEN_LOADED = ("asyncio", "nixl", "torch", "daemon", "uvloop")
# Must never be imported by a core source file (the clock, randomness and I/O
# modules are loaded by the interpreter or msgspec anyway, so these are checked
# on the sources, not on sys.modules).
FORBIDDEN_IMPORTS = (
    *FORBIDDEN_LOADED,
    "time",
    "datetime",
    "random",
    "secrets",
    "uuid",
    "os",
    "io",
    "socket",
    "select",
    "selectors",
    "signal",
    "subprocess",
    "threading",
    "multiprocessing",
    "concurrent",
    "pathlib",
    "logging",
    "structlog",
)
# Allowed roots besides the standard library: the vocabulary, the core itself,
# and msgspec (the vocabulary's Structs are msgspec Structs).
ALLOWED_THIRD_PARTY = ("schemas", "statemachine", "msgspec")
# Attribute reads that are clock or randomness reads whatever the import style.
CLOCK_ATTRS = {
    "now",
    "utcnow",
    "today",
    "time",
    "time_ns",
    "monotonic",
    "monotonic_ns",
    "perf_counter",
    "perf_counter_ns",
    "process_time",
    "random",
    "randint",
    "uniform",
    "urandom",
}


def test_core_files_found() -> None:
    names = {p.name for p in CORE_FILES}
    assert {"__init__.py", "transitions.py", "registry.py", "trim.py"} <= names


def test_importing_the_core_loads_no_shell_module() -> None:
    code = "import json, sys, statemachine; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert "statemachine.registry" in loaded  # the probe really imported the core
    bad = sorted(m for m in loaded if is_under(m, FORBIDDEN_LOADED))
    assert bad == []


def _imports(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, module) of each import: a relative one is the core's own, a dynamic one DYNAMIC."""
    return [
        (line, "statemachine" if level else module) for line, module, level, _ in statements(tree)
    ]


@pytest.mark.parametrize("path", CORE_FILES, ids=[p.name for p in CORE_FILES])
def test_core_source_imports_only_pure_modules(path: Path) -> None:
    tree = ast.parse(path.read_text(), filename=str(path))
    problems = []
    for lineno, name in _imports(tree):
        if name == "__future__":
            continue
        if name == DYNAMIC or is_under(name, FORBIDDEN_IMPORTS):
            problems.append(f"{path.name}:{lineno}: imports {name}")
            continue
        root = name.split(".")[0]
        if root not in sys.stdlib_module_names and root not in ALLOWED_THIRD_PARTY:
            problems.append(f"{path.name}:{lineno}: imports non-stdlib {name}")
    assert problems == []


@pytest.mark.parametrize("path", CORE_FILES, ids=[p.name for p in CORE_FILES])
def test_core_source_reads_no_clock_or_randomness(path: Path) -> None:
    tree = ast.parse(path.read_text(), filename=str(path))
    problems = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            base = node.value
            base_name = base.id if isinstance(base, ast.Name) else None
            if base_name in {"time", "datetime", "random", "secrets", "os"}:
                problems.append(f"{path.name}:{node.lineno}: reads {base_name}.{node.attr}")
            elif node.attr in CLOCK_ATTRS and isinstance(node.ctx, ast.Load):
                # e.g. datetime.datetime.now, date.today, loop.time
                problems.append(f"{path.name}:{node.lineno}: reads .{node.attr}")
        elif isinstance(node, ast.Name) and node.id in {"time", "datetime", "random"}:
            problems.append(f"{path.name}:{node.lineno}: uses name {node.id}")
    assert problems == []


def test_scanner_catches_forbidden_code() -> None:
    """The scans above can fail: they flag a sample of what they forbid."""
    sample = ast.parse(
        "import time\n"
        "from asyncio import sleep\n"
        "import numpy\n"
        "x = time.monotonic()\n"
        "y = datetime.datetime.now()\n"
        "__import__('torch')\n"
    )
    names = [name for _, name in _imports(sample)]
    assert names == ["time", "asyncio", "numpy", DYNAMIC]
    reads = [
        n.attr for n in ast.walk(sample) if isinstance(n, ast.Attribute) and n.attr in CLOCK_ATTRS
    ]
    assert sorted(reads) == ["monotonic", "now"]
