"""A real daemon with its Prometheus port open, and deltas between two scrapes.

Shared by the tests that count what daemons did (tests/test_metrics.py,
tests/test_fingerprint.py): a peered pair (:func:`metrics_pair`), scrape,
act, scrape again, compare.
"""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from daemon.sim.launcher import Daemon, free_port

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@dataclass
class MetricsDaemon(Daemon):
    """A daemon with ``metrics_port`` set."""

    metrics_port: int = 0

    def write_config(self) -> Path:
        self.extra = f"metrics_port = {self.metrics_port}"
        return super().write_config()

    def scrape(self) -> Samples:
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            text = response.read().decode()
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def delta(before: Samples, after: Samples, name: str, **labels: str) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


def metrics_pair(workdir: Path) -> Iterator[tuple[MetricsDaemon, MetricsDaemon]]:
    """A peered prefill and decode daemon with metrics ports, for a module fixture to yield.

    Both must stop with 0 at the end.
    """
    p_port, d_port = free_port(), free_port()
    prefill = MetricsDaemon(
        "prefill", workdir, p_port, [("decode", d_port)], metrics_port=free_port()
    )
    decode = MetricsDaemon(
        "decode", workdir, d_port, [("prefill", p_port)], metrics_port=free_port()
    )
    prefill.start()
    decode.start()
    decode.wait_peer("prefill")
    prefill.wait_peer("decode")
    yield prefill, decode
    assert prefill.stop() == 0, prefill.logs()
    assert decode.stop() == 0, decode.logs()
