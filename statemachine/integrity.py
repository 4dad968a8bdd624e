"""End-to-end integrity: which requests are checked, and how digests compare.

The pusher takes a checksum of every source block of a checked request
before posting its write and sends them to the receiver's daemon
(``schemas.peer.Digests``); the receiver takes the same checksums of its
destination blocks once the data landed and, before its engine hears
``kv_arrived``, compares them here. A difference fails the request
``integrity_mismatch`` (``Stimulus.INTEGRITY_MISMATCH`` in
:mod:`statemachine.reactions`).

Which requests are checked is a pure function of the request id and the
setting, so the two daemons agree without saying so. The digests are laid
out the same way on both sides: for each group, for each of its layers, one
little-endian uint32 per block of the trimmed pairing, in pairing order.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Final

from schemas.config import VerifyMode
from schemas.events import Blocks

DIGEST_BYTES: Final = 4
# How many mismatching blocks an IntegrityMismatch record names (it counts all).
MAX_LISTED: Final = 64
_SCALE: Final = 2**32


def sampled(request_id: str, verify: VerifyMode, rate: float) -> bool:
    """Whether ``request_id`` is checked: every daemon computes the same answer."""
    if verify is VerifyMode.OFF:
        return False
    if verify is VerifyMode.ALL:
        return True
    # crc32 of the id spreads ids evenly; below rate * 2^32 is the sample.
    return zlib.crc32(request_id.encode()) < rate * _SCALE


def digest_count(blocks: Blocks, layers: Sequence[int]) -> int:
    """The number of digests of a pairing side: blocks times layers, per group."""
    return sum(len(ids) * n for ids, n in zip(blocks, layers, strict=True))


# A Digests message beyond its digests: ids, names, the destination block
# list (msgpack ints of up to 9 bytes each) and the frame's own bytes.
_MESSAGE_OVERHEAD: Final = 1024
_BYTES_PER_BLOCK_ID: Final = 9


def digests_fit(src: Blocks, layers: Sequence[int], max_frame_bytes: int) -> bool:
    """Whether the Digests message of a pairing fits one peer frame.

    A push too large for its checksums to travel in one frame goes unchecked
    rather than failing for want of them.
    """
    blocks = sum(len(ids) for ids in src)
    size = digest_count(src, layers) * DIGEST_BYTES + blocks * _BYTES_PER_BLOCK_ID
    return size + _MESSAGE_OVERHEAD <= max_frame_bytes


def mismatches(
    expected: bytes, actual: bytes, dst: Blocks, layers: Sequence[int]
) -> list[tuple[int, int, int]]:
    """(group, layer, destination block) of every digest that differs.

    ``expected`` and ``actual`` are laid out as the module docstring says,
    over the same pairing; ``dst`` names the destination blocks and
    ``layers`` each group's layer count. Digests of a different length than
    the pairing needs are all counted as mismatches (the sides disagree on
    what was written).
    """
    need = digest_count(dst, layers) * DIGEST_BYTES
    whole = [
        (g, layer, block)
        for g, (ids, n) in enumerate(zip(dst, layers, strict=True))
        for layer in range(n)
        for block in ids
    ]
    if len(expected) != need or len(actual) != need:
        return whole
    if expected == actual:
        return []
    step = DIGEST_BYTES
    return [
        where
        for i, where in enumerate(whole)
        if expected[i * step : (i + 1) * step] != actual[i * step : (i + 1) * step]
    ]
