"""One request's life across nodes, step by step, in corrected time order."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from daemon.postmortem.analyse import RequestSummary, restarts, summarize
from daemon.postmortem.merge import Merged
from daemon.postmortem.vocab import (
    K_DAEMON_STARTED,
    K_REGISTERED,
    KIND_NAMES,
    STATE_LABELS,
    RequestKey,
)
from schemas.events import (
    Event,
    Failed,
    KvMismatch,
    PeerRegistered,
    PeerSettled,
    Refused,
    Registered,
    Trimmed,
    WriteStarted,
)


@dataclass(frozen=True, slots=True)
class Step:
    """One line of a request's merged timeline."""

    ts: float  # reference clock
    raw_ts: float  # the node's own clock
    node: str
    seq: int
    event: str
    before: str  # state on this node before the step ('' if none yet)
    after: str  # state after ('' when the step changed none)
    blocks: str
    nbytes: int | None
    detail: str
    since_previous: float | None = None


@dataclass(frozen=True, slots=True)
class Timeline:
    summary: RequestSummary
    steps: tuple[Step, ...]


def _join(counts: Iterable[int]) -> str:
    return "+".join(map(str, counts))


def _describe(event: Event | None) -> tuple[str, int | None, str]:
    """(blocks, bytes, detail text) of a step, from its record's event."""
    if type(event) is Registered:
        text = f"{event.role.value} on engine {event.engine_id}"
        if event.peer:
            text += f", peer {event.peer}"
        if event.offload_slots:
            text += f", offload slots {','.join(map(str, event.offload_slots))}"
        return _join(map(len, event.blocks)), None, text
    if type(event) is PeerRegistered:
        counts = _join(map(len, event.blocks))
        return f"recv {counts}", None, f"receiver engine {event.engine_id} on {event.peer}"
    if type(event) is Trimmed:
        src, dst = _join(map(len, event.src)), _join(map(len, event.dst))
        before = f"src {_join(event.src_before)} -> {src}, dst {_join(event.dst_before)} -> {dst}"
        return before, None, ""
    if type(event) is WriteStarted:
        return str(event.num_blocks), event.nbytes, ""
    if type(event) is Failed:
        settled = " [settled]" if event.settled else ""
        return "", None, f"{event.reason.value}: {event.message}{settled}"
    if type(event) is Refused:
        return "", None, f"refused {event.reason.value}: {event.message}"
    if type(event) is KvMismatch:
        peer = f"{event.peer}/{event.peer_engine}" if event.peer_engine else event.peer
        return (
            "",
            None,
            (
                f"kv mismatch ({event.role.value}, engine {event.engine_id}, peer {peer}): layer "
                f"{event.layer} position {event.position} differs by {event.difference:.4g} > "
                f"{event.tolerance:.4g}" + (f" ({event.detail})" if event.detail else "")
            ),
        )
    if type(event) is PeerSettled:
        return (
            "",
            None,
            "fenced: the peer was declared dead" if event.fenced else "pusher's final word",
        )
    return "", None, ""


def timeline(merged: Merged, r: int) -> Timeline:
    """Every step of request ``r`` on every node, in corrected time order."""
    key = merged.keys[r]
    steps = list(_recorded_steps(merged, r))
    steps += _rejected_steps(merged, key)
    steps += _restart_steps(merged, key)
    order = {name: i for i, name in enumerate(merged.names)}
    steps.sort(key=lambda s: (s.ts, order[s.node], s.seq))
    timed = []
    previous: float | None = None
    for step in steps:
        gap = None if previous is None else step.ts - previous
        timed.append(dataclasses.replace(step, since_previous=gap))
        previous = step.ts
    return Timeline(summarize(merged, r), tuple(timed))


def _recorded_steps(merged: Merged, r: int) -> Iterator[Step]:
    key = merged.keys[r]
    state: dict[int, str] = {}
    for i, node in enumerate(merged.nodes):
        if key in node.at_snapshot:
            state[i] = STATE_LABELS[node.at_snapshot[key].state]
    for j in range(int(merged.start[r]), int(merged.start[r + 1])):
        i = int(merged.step_node[j])
        node = merged.nodes[i]
        local = int(merged.step_local[j])
        kind = int(merged.step_kind[j])
        code = int(merged.step_state[j])
        before = state.get(i, "")
        after = STATE_LABELS[code] if code >= 0 else ""
        if after:
            state[i] = after
        blocks, nbytes, detail = _describe(node.event(local))
        yield Step(
            ts=float(merged.step_ts[j]),
            raw_ts=float(node.ts[local]),
            node=node.node,
            seq=int(node.seq[local]),
            event=KIND_NAMES[kind],
            before=before,
            after="" if after == before and kind != K_REGISTERED else after,
            blocks=blocks,
            nbytes=nbytes,
            detail=detail,
        )


def _rejected_steps(merged: Merged, key: RequestKey) -> list[Step]:
    return [
        Step(
            ts=float(merged.corrected(i, item.ts)),
            raw_ts=item.ts,
            node=item.node,
            seq=item.seq,
            event=KIND_NAMES[item.kind],
            before="",
            after="",
            blocks="",
            nbytes=None,
            detail=f"REJECTED by the core on replay: {item.message}",
        )
        for i, node in enumerate(merged.nodes)
        for item in node.rejected
        if item.key == key
    ]


def _restart_steps(merged: Merged, key: RequestKey) -> list[Step]:
    return [
        Step(
            ts=restart.ts,
            raw_ts=restart.ts + merged.clocks.offsets[restart.node],
            node=restart.node,
            seq=restart.seq,
            event=KIND_NAMES[K_DAEMON_STARTED],
            before="",
            after="",
            blocks="",
            nbytes=None,
            detail=f"daemon restarted (pid {restart.pid}, boot {restart.boot_id})",
        )
        for restart in restarts(merged)
        if any(k == key for k, _ in restart.failed)
    ]
