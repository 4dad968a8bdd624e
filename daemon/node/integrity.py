"""End-to-end integrity: checksums of pushed blocks, taken on both sides.

Which requests are checked is the core's pure rule
(``statemachine.integrity.sampled``: the request id and ``[integrity]``),
so both daemons agree without a word.

Pusher (:meth:`Integrity.before_write`, :meth:`Integrity.send`): before
the WRITE is posted, the checksums of the trimmed source blocks
(``daemon/dataplane/digest.py``: crc32c over DRAM, wsum32 on the device
for VRAM) are taken; once ``write_started`` is
durable they go to the receiver's daemon in a ``Digests`` message, with the
destination blocks they are for, right behind the ``writing`` notice and
ahead of ``write_done`` on the link. They are data about the bytes, not a
claim about the request's state, so they travel beside the ledger's
notices (as the WRITE itself does), but never before the record they
follow is durable. A push that writes nothing (a full prefix hit) sends
empty digests, so its receiver does not wait for any.

Receiver (:meth:`Integrity.landed`): before a checked request's data
landing (the NIXL notification, or the pusher's ``write_done``) is reacted
to, the receiver's checksums of its destination blocks are compared with
the pusher's. Equal: the reaction goes on (``kv_arrived``). Different: the
core's ``INTEGRITY_MISMATCH`` reaction journals the blocks and fails the
request, so the decode engine hears ``request_failed`` and never
``kv_arrived``. A notification that beats the digests waits for them; the
pusher's ``write_done`` without digests before it (a reconnect lost them)
fails the request, as does the deadline if neither comes.

Offload pools (:meth:`Integrity.check_slots`): when a checked request is
granted offload slots, each must still be zero, as the pool left it when it
was released (invariant 5). A slot that is not (an engine wrote into a slot
it no longer held, say) is zeroed there and then, and the registration is
refused ``integrity_mismatch``: caught before the request uses it, not after
the wrong token; the engine's next registration gets a clean slot.

Large checksums run in a thread (crc32c drops the GIL), so the loop keeps
serving while a big push is read.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import TYPE_CHECKING, Final

import structlog

from daemon import failpoints
from daemon.dataplane import digest
from daemon.dataplane.errors import DataPlaneError
from daemon.dataplane.geometry import blocks_nbytes
from daemon.node.counters import IntegrityCounters
from daemon.node.ledger import Ledger
from daemon.node.peerport import PeerPort
from schemas import peer as pm
from schemas.config import IntegrityConfig
from schemas.events import Blocks, Registered
from schemas.reasons import Reason
from schemas.state import RequestRecord
from statemachine import Refusal
from statemachine.integrity import digests_fit, mismatches, sampled
from statemachine.reactions import Stimulus, Why, awaiting_data

if TYPE_CHECKING:
    from daemon.node.engine_state import EngineState

log = structlog.get_logger("kvpushd.node")
# Checksums of more bytes than this run in a thread, not on the loop
# (bench/RESULTS.md, "Integrity checks (verify)": 0.1-0.3 ms per MiB on 2 cores).
INLINE_BYTES: Final = 1 << 20
_Key = tuple[str, int]


class Integrity:
    def __init__(
        self,
        config: IntegrityConfig,
        *,
        ledger: Ledger,
        engines: Mapping[str, EngineState],
        port: PeerPort,
        max_frame_bytes: int,
    ) -> None:
        self._ledger = ledger
        self._engines = engines
        self._port = port
        self._max_frame_bytes = max_frame_bytes
        self.verify, self.rate = config.verify, config.sample_rate
        self.counters = IntegrityCounters()
        # Receiver: the pusher's digests of requests still awaiting data, and
        # the requests whose data landed before their digests did.
        self.expected: dict[_Key, pm.Digests] = {}
        self.waiting: set[_Key] = set()
        # Checks in progress: the notification and the pusher's write_done
        # may both ask while a large check runs in its thread; the second
        # waits for the first instead of reading the blocks again.
        self.running: dict[_Key, asyncio.Future[None]] = {}

    def checks(self, request_id: str) -> bool:
        return sampled(request_id, self.verify, self.rate)

    def forget(self, request_id: str, incarnation: int) -> None:
        """A checked receiver no longer awaits data: what it left here goes (Transfers.observe)."""
        key = (request_id, incarnation)
        self.expected.pop(key, None)
        self.waiting.discard(key)

    async def _digests(self, engine: EngineState, blocks: Blocks, algorithm: str) -> bytes:
        spec, regions = engine.spec, engine.regions
        if blocks_nbytes(spec, blocks) <= INLINE_BYTES:
            return digest.digests(spec, regions, blocks, algorithm)
        return await asyncio.to_thread(digest.digests, spec, regions, blocks, algorithm)

    # ---------------------------------------------------------- offload pool

    def check_slots(self, engine: EngineState, event: Registered) -> None:
        """Refuse (``Refusal``) a checked request's grant of a slot that is not zero."""
        pool = engine.offload
        if not event.offload_slots or pool is None or not self.checks(event.request_id):
            return
        self.counters.integrity_slots_checked += len(event.offload_slots)
        dirty = [slot for slot in event.offload_slots if pool.slot_view(slot).any()]
        if not dirty:
            return
        for slot in dirty:  # free (the core never grants a busy one): nobody's data
            pool.slot_view(slot).fill(0)
        self.counters.integrity_dirty_slots += len(dirty)
        log.error(
            "offload slots not zero at grant",
            request_id=event.request_id,
            engine_id=engine.spec.engine_id,
            slots=dirty,
        )
        raise Refusal(
            Reason.INTEGRITY_MISMATCH,
            f"offload slots {dirty} of engine {engine.spec.engine_id} were not zero when "
            "granted (written after their release?); zeroed now, register again",
        )

    # --------------------------------------------------------------- pusher

    async def before_write(self, record: RequestRecord) -> pm.Digests:
        """Pusher: the digests of a checked request's source blocks (Transfers asks
        only for those).

        Taken before the WRITE is posted; :meth:`send` sends them once
        ``write_started`` is durable.
        """
        engine = self._engines.get(record.engine_id)
        assert record.src is not None and record.dst is not None
        if engine is None:
            raise DataPlaneError(f"engine {record.engine_id} is gone", code="unknown_engine")
        algorithm, data = digest.algorithm_for(engine.spec, engine.regions), b""
        layers = [len(g.layers) for g in engine.spec.groups]
        if not digests_fit(record.src, layers, self._max_frame_bytes):
            algorithm = digest.UNCHECKED  # one frame cannot carry them: unchecked, not failed
            self.counters.integrity_unchecked += 1
        if algorithm != digest.UNCHECKED:
            data = await self._digests(engine, record.src, algorithm)
        return pm.Digests(record.request_id, record.incarnation, algorithm, data, record.dst)

    def send(self, record: RequestRecord, message: pm.Digests) -> None:
        """Pusher: ``write_started`` is durable; the receiver's daemon gets the digests."""
        if self._port.tell(record.peer, message):
            self.counters.integrity_digests_sent += 1

    # ------------------------------------------------------------- receiver

    async def on_digests(self, message: pm.Digests) -> None:
        """Receiver: the pusher's digests; check now if the data already landed."""
        key = (message.request_id, message.incarnation)
        record = self._ledger.current(*key)
        if record is None or not awaiting_data(record):
            return
        self.expected[key] = message
        if key in self.waiting:
            current = await self._verified(record, final=False)
            if current is not None:
                await self._ledger.react(current, Stimulus.DATA_LANDED, failpoint="node.kv_arrived")

    async def landed(self, record: RequestRecord, *, final: bool) -> RequestRecord | None:
        """Receiver: the data of ``record`` landed (``final``: the pusher said so).

        Returns the record to react to (checked and equal, not checked, or
        failed meanwhile), or None when the reaction must wait for digests.
        """
        if not awaiting_data(record):
            return record
        key = (record.request_id, record.incarnation)
        engine = self._engines.get(record.engine_id)
        first = key not in self.waiting  # not a data landing already waiting for digests
        if first and engine is not None and failpoints.corrupts("integrity.flip_dst"):
            digest.flip_first(engine.spec, engine.regions, record.blocks)
        return await self._verified(record, final=final)

    async def _verified(self, record: RequestRecord, *, final: bool) -> RequestRecord | None:
        ledger = self._ledger
        key = (record.request_id, record.incarnation)
        engine = self._engines.get(record.engine_id)
        # Only a checked request comes here (Transfers and Peers ask first).
        if not any(record.blocks):
            return record  # nothing to check (a full prefix hit)
        message = self.expected.get(key)
        if message is None:
            if not final:
                self.waiting.add(key)
                return None
            why = Why(
                Reason.TRANSFER_ERROR,
                "checked for integrity, but the pusher's digests never came "
                "(do both daemons have the same [integrity] setting?)",
            )
            await ledger.react(record, Stimulus.FAILURE, why)
            return ledger.current(*key)
        self.waiting.discard(key)
        if engine is None:
            return record  # gone: the engine hears nothing either way
        running = self.running.get(key)
        if running is not None:
            await running  # the other check failed the request, or found it equal
            return ledger.current(*key)
        self.running[key] = done = asyncio.get_running_loop().create_future()
        try:
            found = await self._compare(engine, record, message)
            current = ledger.current(*key)
            if found is None or current is None:
                return current
            self.counters.integrity_mismatches += 1
            log.warning(
                "integrity mismatch",
                request_id=record.request_id,
                incarnation=record.incarnation,
                blocks=len(found.blocks),
                checked=found.num_blocks,
            )
            await ledger.react(current, Stimulus.INTEGRITY_MISMATCH, found)
            return ledger.current(*key)
        finally:
            del self.running[key]
            done.set_result(None)

    async def _compare(
        self, engine: EngineState, record: RequestRecord, message: pm.Digests
    ) -> Why | None:
        """None if equal (or nothing can be compared), else the mismatch."""
        counters = self.counters
        layers = [len(g.layers) for g in engine.spec.groups]
        dst = message.dst
        owned = len(dst) == len(record.blocks) and all(
            set(ids) <= set(own) for ids, own in zip(dst, record.blocks, strict=True)
        )
        if not owned:
            dst = record.blocks  # name this request's own blocks, never another's
            text = "the pusher's digests are for blocks this request does not hold"
            every = tuple(mismatches(b"", b"", dst, layers))
            return Why(Reason.INTEGRITY_MISMATCH, text, 0, 0, every)
        if not digest.can_compute(engine.spec, engine.regions, message.algorithm):
            counters.integrity_unchecked += 1
            return None
        actual = await self._digests(engine, dst, message.algorithm)
        counters.integrity_checked += 1
        listed = mismatches(message.digests, actual, dst, layers)
        checked = len(actual) // 4
        if not listed:
            counters.integrity_blocks_verified += checked
            return None
        first = ", ".join(f"g{g}/l{layer}/b{b}" for g, layer, b in listed[:4])
        text = f"{len(listed)} of {checked} blocks differ from the pusher's ({first})"
        return Why(Reason.INTEGRITY_MISMATCH, text, checked, 0, tuple(listed))
