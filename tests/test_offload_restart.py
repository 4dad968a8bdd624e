"""Offload slots across kill -9: a restarted daemon never grants a slot a live request holds.

Real daemon processes (daemon/sim/launcher.py) and a real engine client: an
engine registers an offload pool, a request takes slots and fills them, the
daemon is killed with SIGKILL and started again on the same journal, and the
engine registers again with the same pool. The request from before the
crash is still live (failed by the restart, not yet released by its
engine), so its slots must stay its own, untouched, until it is released,
and the journal must say who holds which slot.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Final

import numpy as np
import pytest

from daemon.cli import main
from daemon.client import EngineClient, RpcError
from daemon.dataplane.memory import create_shm_file
from daemon.journal.reader import read_journal
from daemon.journal.replay import replay
from daemon.sim.launcher import Daemon, free_port
from schemas import rpc
from schemas.events import Registered
from schemas.kvlayout import GroupSpec, LayerSpec
from schemas.layout import GroupKind, Role

SLOTS: Final = 8
SLOT_BYTES: Final = 4096


class Engine:
    """An engine's memory: a KV region and an offload pool, as shm files."""

    def __init__(self, tag: str) -> None:
        self.id = f"off-{tag}"
        self.data = create_shm_file(f"/dev/shm/kvpushd-test-kv-{tag}", 16 * 4096)
        self.pool = create_shm_file(f"/dev/shm/kvpushd-test-off-{tag}", SLOTS * SLOT_BYTES)
        self.groups = (GroupSpec(GroupKind.ATTENTION, 16, 4096, (LayerSpec(self.data.name),)),)
        self.slots = np.memmap(self.pool.path, dtype=np.uint8, mode="r+")

    def slot(self, index: int) -> np.ndarray:
        return self.slots[index * SLOT_BYTES : (index + 1) * SLOT_BYTES]

    async def attach(self, daemon: Daemon, offload_slots: int = SLOTS) -> EngineClient:
        client = await EngineClient.connect(daemon.socket)
        await client.register_engine(
            self.id, self.groups, (self.data,), offload=self.pool, offload_slots=offload_slots
        )
        return client

    def remove(self) -> None:
        del self.slots
        for spec in (self.data, self.pool):
            os.unlink(spec.path)


@pytest.fixture
def engine() -> Iterator[Engine]:
    made = Engine(uuid.uuid4().hex[:8])
    yield made
    made.remove()


def grants(journal: Path) -> dict[str, tuple[int, ...]]:
    """Request id -> offload slots, from every journaled registration."""
    found: dict[str, tuple[int, ...]] = {}

    def collect(record: object, touched: object) -> None:
        event = record.event  # type: ignore[attr-defined]
        if isinstance(event, Registered):
            found[event.request_id] = event.offload_slots

    replay(journal, on_record=collect)
    return found


async def wait_failed(client: EngineClient, request_id: str) -> rpc.RequestFailed:
    while True:
        event = await client.next_event(timeout=20)
        if isinstance(event, rpc.RequestFailed) and event.request_id == request_id:
            return event


@pytest.mark.parametrize("snapshots", [False, True], ids=["journal", "snapshot"])
async def test_slots_held_before_kill_9_are_never_granted_again_until_released(
    tmp_path: Path, engine: Engine, snapshots: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    # With a snapshot every two records the grants come back from the
    # snapshot as well as from the records after it.
    daemon = Daemon(
        "slots", tmp_path, free_port(), journal_extra="snapshot_every = 2" if snapshots else ""
    )
    daemon.start()
    try:
        client = await engine.attach(daemon)
        held = await client.register_request(engine.id, "a", Role.PUSHER, [[1]], offload_slots=5)
        assert held.offload_slots == (0, 1, 2, 3, 4)
        for slot in held.offload_slots:
            engine.slot(slot)[:] = 0xEE  # the request's staging data, in use
        # A request released before the crash gives its slot back for good.
        gone = await client.register_request(engine.id, "b", Role.PUSHER, [[2]], offload_slots=1)
        assert gone.offload_slots == (5,)
        engine.slot(5)[:] = 0xBB
        await client.abort("b")
        await client.release("b")
        await client.close()

        daemon.kill()
        daemon.start()

        # The pool's size is part of the engine's layout: with "a" live it
        # cannot come back with another, and the refusal changes nothing.
        client = await EngineClient.connect(daemon.socket)
        with pytest.raises(RpcError) as other:
            await client.register_engine(
                engine.id, engine.groups, (engine.data,), offload=engine.pool, offload_slots=4
            )
        assert other.value.code == "engine_in_use"
        await client.close()
        client = await engine.attach(daemon)
        assert (await wait_failed(client, "a")).reason == "daemon_restart"
        assert daemon.status()["engines"][engine.id]["offload_free"] == SLOTS - 5

        # Before the fix the new pool had every slot free and granted all 8.
        with pytest.raises(RpcError) as exhausted:
            await client.register_request(engine.id, "c", Role.PUSHER, [[3]], offload_slots=8)
        assert exhausted.value.code == "offload_exhausted"
        fresh = await client.register_request(engine.id, "c", Role.PUSHER, [[3]], offload_slots=3)
        assert fresh.offload_slots == (5, 6, 7)
        assert not any(engine.slot(s).any() for s in fresh.offload_slots)
        # Re-registration zeroed the free slots, not the ones "a" still holds.
        assert all((engine.slot(s) == 0xEE).all() for s in held.offload_slots)

        # Once "a" is released its slots are zeroed and granted again.
        await client.release("a")
        assert not any(engine.slot(s).any() for s in held.offload_slots)
        again = await client.register_request(engine.id, "d", Role.PUSHER, [[4]], offload_slots=5)
        assert again.offload_slots == (0, 1, 2, 3, 4)
        await client.close()

        # A second crash: grants made after the first one come back too.
        daemon.kill()
        daemon.start()
        client = await engine.attach(daemon)
        with pytest.raises(RpcError) as full:
            await client.register_request(engine.id, "e", Role.PUSHER, [[5]], offload_slots=1)
        assert full.value.code == "offload_exhausted"
        for request_id in ("c", "d"):
            await wait_failed(client, request_id)
            await client.release(request_id)
        last = await client.register_request(engine.id, "e", Role.PUSHER, [[5]], offload_slots=8)
        assert last.offload_slots == tuple(range(SLOTS))
        await client.abort("e")
        await client.release("e")
        await client.close()
    finally:
        assert daemon.stop() == 0, daemon.logs()

    if snapshots:
        # Old segments were pruned: the grants before the crashes came back
        # from a snapshot.
        assert read_journal(daemon.journal).snapshot is not None
    else:
        assert grants(daemon.journal) == {
            "a": (0, 1, 2, 3, 4),
            "b": (5,),
            "c": (5, 6, 7),
            "d": (0, 1, 2, 3, 4),
            "e": tuple(range(SLOTS)),
        }
        # The postmortem timeline shows a registration's slots.
        capsys.readouterr()
        assert main(["journal", "timeline", str(daemon.journal), "--request", "c"]) == 0
        shown = capsys.readouterr().out
        assert f"pusher on engine {engine.id}, offload slots 5,6,7" in shown
    result = replay(daemon.journal)
    assert not result.registry.live
    assert result.registry.slots_held(engine.id) == {}


async def test_bad_offload_pools_and_slot_counts_are_refused_and_change_nothing(
    tmp_path: Path, engine: Engine
) -> None:
    daemon = Daemon("noslots", tmp_path, free_port())
    daemon.start()
    try:
        client = await EngineClient.connect(daemon.socket)
        bad = [
            (engine.pool, 0),  # a pool of no slots
            (engine.pool, 3),  # 32 KiB does not split into 3
            (None, 2),  # slots without a region
        ]
        for offload, slots in bad:
            with pytest.raises(RpcError) as refused:
                await client.register_engine(
                    engine.id, engine.groups, (engine.data,), offload=offload, offload_slots=slots
                )
            assert refused.value.code == "bad_region", refused.value
        assert not daemon.status()["engines"]
        await client.register_engine(engine.id, engine.groups, (engine.data,))
        with pytest.raises(RpcError) as none:
            await client.register_request(engine.id, "x", Role.PUSHER, [[1]], offload_slots=1)
        assert none.value.code == "offload_exhausted"
        with pytest.raises(RpcError) as negative:
            await client.register_request(engine.id, "x", Role.PUSHER, [[1]], offload_slots=-1)
        assert negative.value.code == "bad_slot"
        assert daemon.status()["live"] == 0
        await client.close()
    finally:
        assert daemon.stop() == 0, daemon.logs()
