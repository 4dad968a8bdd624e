"""The per-key serializer shared by the engine server and the peer messages."""

from __future__ import annotations

import asyncio

from daemon.node.serializer import KeyedSerializer


class Trace:
    """Handlers that append their name when they run, some held until a gate opens."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.ran: list[str] = []

    async def step(self, name: str, wait: bool = False) -> None:
        if wait:
            await self.gate.wait()
        self.ran.append(name)


async def finished(order: KeyedSerializer) -> None:
    await asyncio.wait(list(order.inflight))


async def test_a_handler_cancelled_while_it_waits_is_never_dispatched():
    # The engine server's old per-connection serializer suppressed every
    # BaseException around shield(predecessor), its own cancellation too: a
    # request cancelled while it waited (connection closed, shutdown) was
    # dispatched anyway once its predecessor finished.
    order = KeyedSerializer()
    gate = asyncio.Event()
    ran: list[str] = []

    async def first() -> None:
        await gate.wait()
        ran.append("first")

    async def second() -> None:
        ran.append("second")

    order.submit(first(), "r1")
    waiting = order.submit(second(), "r1")
    await asyncio.sleep(0)
    waiting.cancel()
    await asyncio.sleep(0)
    gate.set()
    await asyncio.wait(list(order.inflight) or [waiting])
    await asyncio.sleep(0.01)
    assert ran == ["first"]
    assert waiting.cancelled()


async def test_same_key_in_order_other_keys_concurrently():
    order = KeyedSerializer()
    t = Trace()

    order.submit(t.step("a1", wait=True), "a")
    order.submit(t.step("a2"), "a")
    order.submit(t.step("b1"), "b")
    await asyncio.sleep(0.01)
    assert t.ran == ["b1"]  # b did not wait for a
    t.gate.set()
    await finished(order)
    assert t.ran == ["b1", "a1", "a2"]


async def test_a_barrier_waits_for_all_before_and_holds_all_after():
    order = KeyedSerializer()
    t = Trace()

    order.submit(t.step("a", wait=True), "a")
    order.submit(t.step("barrier"), None)
    order.submit(t.step("b"), "b")
    await asyncio.sleep(0.01)
    assert t.ran == []
    t.gate.set()
    await finished(order)
    assert t.ran == ["a", "barrier", "b"]


async def test_after_orders_a_request_behind_its_peers_own_handling():
    order = KeyedSerializer()
    t = Trace()

    order.submit(t.step("peer up", wait=True), ("peer", "p"))
    order.submit(t.step("message"), ("request", "r"), after=("peer", "p"))
    await asyncio.sleep(0.01)
    assert t.ran == []
    t.gate.set()
    await finished(order)
    assert t.ran == ["peer up", "message"]


async def test_a_failed_predecessor_does_not_stop_its_successor():
    order = KeyedSerializer()
    ran: list[str] = []

    async def boom() -> None:
        raise RuntimeError("boom")

    async def after() -> None:
        ran.append("after")

    failed = order.submit(boom(), "k")
    order.submit(after(), "k")
    await asyncio.wait(list(order.inflight))
    assert ran == ["after"]
    assert isinstance(failed.exception(), RuntimeError)


async def test_a_batch_runs_after_each_of_its_keys_and_before_what_follows_on_them():
    # An engine's batch (EngineServer._submit_batch) is one task for several
    # request ids: it waits for what came before on any of them, and what
    # comes after on any of them waits for it; other ids run beside it.
    order = KeyedSerializer()
    t = Trace()

    order.submit(t.step("a-before", wait=True), "a")
    batch = order.submit_many(t.step("batch"), {"a", "b"})
    order.submit(t.step("b-after"), "b")
    order.submit(t.step("c-beside"), "c")
    await asyncio.sleep(0.01)
    assert t.ran == ["c-beside"]  # the batch waits for a-before, b-after for the batch
    t.gate.set()
    await finished(order)
    assert t.ran == ["c-beside", "a-before", "batch", "b-after"]
    assert batch.done() and not order.inflight
    # Its keys are free again: nothing waits on the finished batch.
    order.submit(t.step("a-later"), "a")
    await finished(order)
    assert t.ran[-1] == "a-later"


async def test_a_barrier_waits_for_a_batch():
    order = KeyedSerializer()
    t = Trace()
    order.submit_many(t.step("batch", wait=True), {"a", "b"})
    order.submit(t.step("status"), None)
    await asyncio.sleep(0.01)
    assert t.ran == []
    t.gate.set()
    await finished(order)
    assert t.ran == ["batch", "status"]
