"""One whole push between simulated engines through their daemons, checked end to end."""

from __future__ import annotations

import uuid
from collections.abc import Sequence

from daemon.sim.engine import Expectation, SimEngine, SimGroup, tail_pairs
from daemon.sim.launcher import Daemon
from schemas import rpc
from schemas.layout import Role


async def engine_pair(
    pair: Sequence[Daemon], layout: Sequence[SimGroup]
) -> tuple[SimEngine, SimEngine]:
    """A fresh pusher on the pair's prefill daemon and receiver on its decode daemon."""
    prefill, decode = pair
    tag = uuid.uuid4().hex[:8]
    pe = await SimEngine.create(f"p-{tag}", Role.PUSHER, layout, prefill.socket)
    de = await SimEngine.create(f"d-{tag}", Role.RECEIVER, layout, decode.socket)
    return pe, de


async def push(
    pe: SimEngine,
    de: SimEngine,
    prefill: Daemon,
    rid: str,
    src: list[list[int]],
    dst: list[list[int]],
    *,
    on_demand: bool,
    timeout: float = 30.0,
) -> None:
    """Register both sides, kv_ready, both events, the decode engine's byte check, release both.

    ``on_demand``: the receiver names the prefill daemon by its address (a
    peer on demand), else by its node name alone (a configured peer).
    """
    pairs = tail_pairs(pe.layout, src, de.layout, dst)
    await de.decode_register(
        rid,
        dst,
        prefill.node,
        expect=Expectation(pe.engine_id, pairs),
        peer_address=prefill.address if on_demand else "",
    )
    await pe.prefill(rid, src)
    arrived = await de.wait_event(rid, (rpc.KvArrived, rpc.RequestFailed), timeout=timeout)
    freed = await pe.wait_event(rid, (rpc.BlocksFreeable, rpc.RequestFailed), timeout=timeout)
    assert isinstance(arrived, rpc.KvArrived), arrived
    assert isinstance(freed, rpc.BlocksFreeable), freed
    report = de.reports[(rid, 1)]
    assert report.ok, report.problems()
    assert report.blocks_checked == sum(len(p) for p in pairs)
    await de.release(rid)
    await pe.release(rid)
