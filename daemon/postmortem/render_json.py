"""The ``--json`` output of ``journal replay`` and ``journal timeline``."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from daemon.postmortem.analyse import HIST_EDGES, Analysis
from daemon.postmortem.timeline import Timeline
from daemon.postmortem.vocab import KIND_NAMES


def _jsonable(item: Any) -> Any:
    """A dataclass as plain data; a request key becomes request_id and incarnation."""
    data = dataclasses.asdict(item)
    return _split_keys(data)


def _split_keys(data: Any) -> Any:
    if isinstance(data, dict):
        out: dict[str, object] = {}
        for name, value in data.items():
            if name == "key":
                out["request_id"], out["incarnation"] = (None, None) if value is None else value
            else:
                out[name] = _split_keys(value)
        return out
    if isinstance(data, list | tuple):
        return [_split_keys(v) for v in data]
    if isinstance(data, float) and not math.isfinite(data):
        return None
    return data


def replay_json(analysis: Analysis) -> dict[str, Any]:
    merged = analysis.merged
    filters = analysis.filters
    return {
        "journals": [
            {
                "node": node.node,
                "sources": list(node.sources),
                "records": node.records,
                "records_read": node.records_read,
                "first_seq": int(node.seq.min()) if node.records else None,
                "last_seq": int(node.seq.max()) if node.records else None,
                "snapshot_seq": node.snapshot_seq,
                "first_ts": _split_keys(float(merged.node_first[i])),
                "last_ts": _split_keys(float(merged.node_last[i])),
            }
            for i, node in enumerate(merged.nodes)
        ],
        "clocks": {
            "reference": merged.clocks.reference,
            "offsets_s": merged.clocks.offsets,
            "pairs": [_jsonable(p) for p in merged.clocks.pairs],
            "unpaired": list(merged.clocks.unpaired),
            "description": merged.clocks.describe(),
        },
        "filters": _split_keys(dataclasses.asdict(filters)),
        "requests_total": merged.requests,
        "requests_selected": len(analysis.selected),
        "by_final_state": dict(analysis.by_final),
        "refusals": [_jsonable(r) for r in analysis.refusals],
        "never_released": [_jsonable(s) for s in analysis.never_released],
        "disagreements": [_jsonable(d) for d in analysis.disagreements],
        "split_transfers": [_jsonable(t) for t in analysis.split_transfers],
        "integrity_mismatches": [_jsonable(m) for m in analysis.mismatches],
        "kv_mismatches": [_jsonable(m) for m in analysis.kv_mismatches],
        "slowest_transitions": [_jsonable(t) for t in analysis.slowest],
        "longest_engine_holds": [_jsonable(t) for t in analysis.longest_holds],
        "latency": [_jsonable(row) for row in analysis.latency],
        "latency_histogram_edges_s": [float(e) for e in HIST_EDGES],
        "restarts": [_jsonable(r) for r in analysis.restarts],
        "sequence_gaps": [_jsonable(g) for g in analysis.gaps],
        "torn_tails": [_jsonable(t) for t in analysis.torn],
        "damage": [{"node": n, "damage": d} for n, d in analysis.damage],
        "rejected": [_jsonable(r) | {"event": KIND_NAMES[r.kind]} for r in analysis.rejected],
        "requests": [_jsonable(s) for s in analysis.summaries()],
    }


def timeline_json(item: Timeline) -> dict[str, Any]:
    return {"request": _jsonable(item.summary), "steps": [_jsonable(s) for s in item.steps]}
