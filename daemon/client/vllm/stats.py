"""KvpushdConnector's stats in vLLM's own metrics: what ended how, bytes, latency, refusals.

vLLM gathers a connector's stats from every worker and from the scheduler
each step (``get_kv_connector_stats``), sums them (``aggregate``), logs a
summary (``reduce``) and hands the data to the connector's Prometheus
metrics (``build_prom_metrics``), which its ``/metrics`` endpoint shows
beside its own:

- ``vllm:kvpushd_transfers_ended_total{outcome}``: ``pushed`` and
  ``loaded``, or ``failed:<reason>`` (the daemon's reason code) and
  ``gave_up:<reason>`` (refused, or no daemon);
- ``vllm:kvpushd_loaded_bytes_total``: the KV bytes that landed in this
  instance's blocks;
- ``vllm:kvpushd_load_seconds``: a load's time, from its registration to
  ``kv_arrived``;
- ``vllm:kvpushd_staged_bytes_total{direction}``: with host staging
  (``kv_buffer = "host"``), the KV bytes copied from vLLM's cache to the
  daemon's host mirror (``out``, a prefill) and back (``in``, a decode);
- ``vllm:kvpushd_not_loaded_total{why}``: decode requests that computed
  their prompt instead (``fingerprint``, ``prompt``, ``duplicate``,
  ``params``), prefill requests that pushed nothing (``not_needed``:
  aborted), either for the connector's own error that it swallowed
  (``error``), and requests whose params lost fields the connector does not
  read, unplain or too large (``params_dropped``: they go on).

The data is plain dicts and lists: it crosses from vLLM's workers to its
API process.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.metrics.utils import create_metric_per_engine

# Why a request's own inputs compute its prompt: prompt logprobs, counted multimodal inputs.
from daemon.client.vllm.inputs import LOGPROBS as LOGPROBS
from daemon.client.vllm.inputs import MULTIMODAL as MULTIMODAL

ENDED = "ended"
LOADED_BYTES = "loaded_bytes"
LOAD_SECONDS = "load_seconds"
NOT_LOADED = "not_loaded"
STAGED = "staged"  # bytes copied by host staging, per direction
# Loads checked by behaviour (daemon/client/vllm/kvcheck.py): their count by
# result, and each check's relative difference (the healthy spread).
CHECKS = "checks"
CHECK_DIFFERENCES = "check_differences"
AGREE = "agree"
KV_MISMATCH = "kv_mismatch"  # also a NOT_LOADED reason: the request recomputes

# Why a request did not use remote KV (NOT_LOADED's keys).
FINGERPRINT = "fingerprint"
PROMPT = "prompt"
DUPLICATE = "duplicate"
NOT_NEEDED = "not_needed"
PARAMS = "params"  # a router's kv_transfer_params the connector cannot use
WINDOW = "window"  # the prefill no longer holds the sliding window the decode needs
ERROR = "error"  # the connector's own error, swallowed: the request computes locally
DROPPED = "params_dropped"  # params fields the connector does not read, dropped (unplain, large)

_DIFFERENCE_BUCKETS = (1e-7, 1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 0.03, 0.1, 0.3, 1.0, 3.0)
_LOAD_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def _empty() -> dict[str, Any]:
    return {
        ENDED: {},
        LOADED_BYTES: 0,
        LOAD_SECONDS: [],
        NOT_LOADED: {},
        STAGED: {},
        CHECKS: {},
        CHECK_DIFFERENCES: [],
    }


@dataclass
class KvpushdStats(KVConnectorStats):
    """One interval's observations of one connector (or their sum)."""

    data: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.data:
            self.data = _empty()

    def ended(self, outcome: str) -> None:
        _bump(self.data[ENDED], outcome)

    def loaded(self, nbytes: int, seconds: float) -> None:
        self.ended("loaded")
        self.data[LOADED_BYTES] += nbytes
        self.data[LOAD_SECONDS].append(seconds)

    def not_loaded(self, why: str) -> None:
        _bump(self.data[NOT_LOADED], why)

    def staged(self, direction: str, nbytes: int) -> None:
        """Host staging copied ``nbytes`` cache -> mirror (``out``) or mirror -> cache (``in``)."""
        if nbytes:
            _bump(self.data[STAGED], direction, nbytes)

    def checked(self, difference: float, agreed: bool) -> None:
        """A load checked by behaviour: its relative difference, and whether it agreed."""
        _bump(self.data[CHECKS], AGREE if agreed else KV_MISMATCH)
        self.data[CHECK_DIFFERENCES].append(difference)
        if not agreed:
            self.not_loaded(KV_MISMATCH)

    def reset(self) -> None:
        self.data = _empty()

    def aggregate(self, other: KVConnectorStats) -> KvpushdStats:
        theirs = other.data
        for key in (ENDED, NOT_LOADED, STAGED, CHECKS):
            for name, count in theirs.get(key, {}).items():
                _bump(self.data[key], name, count)
        self.data[LOADED_BYTES] += theirs.get(LOADED_BYTES, 0)
        self.data[LOAD_SECONDS].extend(theirs.get(LOAD_SECONDS, ()))
        self.data[CHECK_DIFFERENCES].extend(theirs.get(CHECK_DIFFERENCES, ()))
        return self

    def reduce(self) -> dict[str, int | float]:
        seconds = sorted(self.data[LOAD_SECONDS])
        summary: dict[str, int | float] = {
            f"ended_{outcome}": count for outcome, count in sorted(self.data[ENDED].items())
        }
        summary |= {f"not_loaded_{why}": n for why, n in sorted(self.data[NOT_LOADED].items())}
        summary["loaded_bytes"] = self.data[LOADED_BYTES]
        summary |= {f"staged_{way}_bytes": n for way, n in sorted(self.data[STAGED].items())}
        summary |= {f"checks_{result}": n for result, n in sorted(self.data[CHECKS].items())}
        if self.data[CHECK_DIFFERENCES]:
            summary["check_difference_max"] = max(self.data[CHECK_DIFFERENCES])
        if seconds:
            summary["load_p50_ms"] = round(seconds[len(seconds) // 2] * 1000, 3)
            summary["load_max_ms"] = round(seconds[-1] * 1000, 3)
        return summary

    def is_empty(self) -> bool:
        return not (
            self.data[ENDED]
            or self.data[NOT_LOADED]
            or self.data[LOAD_SECONDS]
            or self.data[STAGED]
            or self.data[CHECKS]
        )

    def take(self) -> KvpushdStats | None:
        """This interval's stats (None if nothing happened); the next interval starts empty."""
        if self.is_empty():
            return None
        taken = KvpushdStats(self.data)
        self.reset()
        return taken


def _bump(counts: dict[str, int], name: str, by: int = 1) -> None:
    counts[name] = counts.get(name, 0) + by


class KvpushdPromMetrics(KVConnectorPromMetrics):
    """The connector's families on vLLM's ``/metrics``, one child per engine and label."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._ended = self._counter_cls(
            name="vllm:kvpushd_transfers_ended",
            documentation="KvpushdConnector transfers ended, by outcome (and reason).",
            labelnames=[*labelnames, "outcome"],
        )
        self._not_loaded = self._counter_cls(
            name="vllm:kvpushd_not_loaded",
            documentation="Requests that used no remote KV although they asked, by why.",
            labelnames=[*labelnames, "why"],
        )
        self._staged = self._counter_cls(
            name="vllm:kvpushd_staged_bytes",
            documentation="Host staging's KV bytes: cache -> mirror (out), mirror -> cache (in).",
            labelnames=[*labelnames, "direction"],
        )
        self._checks = self._counter_cls(
            name="vllm:kvpushd_kv_checks",
            documentation="Loads checked by the decode's own K/V of the prompt's last token, "
            "by result (agree, kv_mismatch).",
            labelnames=[*labelnames, "result"],
        )
        self._differences = create_metric_per_engine(
            self._histogram_cls(
                name="vllm:kvpushd_kv_check_difference",
                documentation="Each checked load's relative K/V difference, decode vs prefill.",
                buckets=list(_DIFFERENCE_BUCKETS),
                labelnames=labelnames,
            ),
            per_engine_labelvalues,
        )
        self._bytes = create_metric_per_engine(
            self._counter_cls(
                name="vllm:kvpushd_loaded_bytes",
                documentation="KV bytes that landed in this instance's blocks.",
                labelnames=labelnames,
            ),
            per_engine_labelvalues,
        )
        self._seconds = create_metric_per_engine(
            self._histogram_cls(
                name="vllm:kvpushd_load_seconds",
                documentation="A load's time, from its registration to kv_arrived.",
                buckets=list(_LOAD_BUCKETS),
                labelnames=labelnames,
            ),
            per_engine_labelvalues,
        )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues[engine_idx]
        for outcome, count in transfer_stats_data.get(ENDED, {}).items():
            self._ended.labels(*labels, outcome).inc(count)
        for why, count in transfer_stats_data.get(NOT_LOADED, {}).items():
            self._not_loaded.labels(*labels, why).inc(count)
        for direction, nbytes in transfer_stats_data.get(STAGED, {}).items():
            self._staged.labels(*labels, direction).inc(nbytes)
        for result, count in transfer_stats_data.get(CHECKS, {}).items():
            self._checks.labels(*labels, result).inc(count)
        for difference in transfer_stats_data.get(CHECK_DIFFERENCES, ()):
            self._differences[engine_idx].observe(difference)
        if transfer_stats_data.get(LOADED_BYTES):
            self._bytes[engine_idx].inc(transfer_stats_data[LOADED_BYTES])
        for seconds in transfer_stats_data.get(LOAD_SECONDS, ()):
            self._seconds[engine_idx].observe(seconds)
