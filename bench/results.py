"""Keeps bench/RESULTS.md: one section per benchmark, replaced on each run."""

from __future__ import annotations

import os
import platform
import re
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path

RESULTS = Path(__file__).with_name("RESULTS.md")


def write_section(title: str, context: str, body: str) -> None:
    text = RESULTS.read_text() if RESULTS.exists() else "# Benchmark results\n"
    section = f"## {title}\n\n{context}\n\n{body.rstrip()}\n"
    pattern = re.compile(rf"^## {re.escape(title)}\n.*?(?=^## |\Z)", re.S | re.M)
    if pattern.search(text):
        text = pattern.sub(lambda _: section + "\n", text)
    else:
        text = text.rstrip() + "\n\n" + section
    RESULTS.write_text(text.rstrip() + "\n")


def machine() -> str:
    """The machine line every section's context starts from."""
    return (
        f"nproc {os.cpu_count()}, Python {platform.python_version()}, "
        f"{platform.system()} {platform.release()}"
    )


def load_average() -> str:
    """The 1, 5 and 15 minute load averages, as a section's context gives them."""
    return ", ".join(f"{x:.1f}" for x in os.getloadavg())


def spread(values: Sequence[float], fmt: Callable[[float], str] = "{:.1f}".format) -> str:
    """An interleaved A/B table's cell: the median of the runs, then their range."""
    if not values:
        return "-"
    return f"{fmt(statistics.median(values))} ({fmt(min(values))}-{fmt(max(values))})"
