"""The per-key serializer shared by the engine server and the peer messages."""

from __future__ import annotations

import asyncio

from daemon.node.serializer import KeyedSerializer


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
    gate = asyncio.Event()
    ran: list[str] = []

    async def step(name: str, wait: bool = False) -> None:
        if wait:
            await gate.wait()
        ran.append(name)

    order.submit(step("a1", wait=True), "a")
    order.submit(step("a2"), "a")
    order.submit(step("b1"), "b")
    await asyncio.sleep(0.01)
    assert ran == ["b1"]  # b did not wait for a
    gate.set()
    await asyncio.wait(list(order.inflight))
    assert ran == ["b1", "a1", "a2"]


async def test_a_barrier_waits_for_all_before_and_holds_all_after():
    order = KeyedSerializer()
    gate = asyncio.Event()
    ran: list[str] = []

    async def step(name: str, wait: bool = False) -> None:
        if wait:
            await gate.wait()
        ran.append(name)

    order.submit(step("a", wait=True), "a")
    order.submit(step("barrier"), None)
    order.submit(step("b"), "b")
    await asyncio.sleep(0.01)
    assert ran == []
    gate.set()
    await asyncio.wait(list(order.inflight))
    assert ran == ["a", "barrier", "b"]


async def test_after_orders_a_request_behind_its_peers_own_handling():
    order = KeyedSerializer()
    gate = asyncio.Event()
    ran: list[str] = []

    async def step(name: str, wait: bool = False) -> None:
        if wait:
            await gate.wait()
        ran.append(name)

    order.submit(step("peer up", wait=True), ("peer", "p"))
    order.submit(step("message"), ("request", "r"), after=("peer", "p"))
    await asyncio.sleep(0.01)
    assert ran == []
    gate.set()
    await asyncio.wait(list(order.inflight))
    assert ran == ["peer up", "message"]


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
