"""Deterministic KV-block contents that name the block they belong to.

The daemon's worst failures are silent: the right bytes in the wrong block (a
front-trim), a write landing in a block that was freed and reused, residue of
one request read by the next. To see them, the simulated engine fills every
prefill block with bytes that identify exactly one (engine, request, group,
layer, block) tuple, and the decode side checks that each destination block
holds the bytes of exactly the prefill block it should, and that no other
byte of its cache changed.

A block's pattern is a 32-byte BLAKE2b header of the tuple followed by a
pseudo-random chunk (seeded by the header) repeated to the block's length.
The chunk is :data:`PERIOD` bytes, a prime, so the pattern never repeats on a
page boundary: a block whose 4 KiB pages were swapped or shifted does not
compare equal. Filling a MiB block costs one small generator draw and a few
doubling memcpys.

Everything here is pure numpy over caller-provided buffers; the shared-memory
plumbing lives in :mod:`daemon.sim.engine_shm`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Final

import numpy as np

from schemas.kvlayout import GroupSpec

HEADER_BYTES: Final = 32
PERIOD: Final = 4099  # prime, and not a divisor of any page size
_COMPARE_CHUNK: Final = 16 * 1024 * 1024  # bytes compared per numpy call

Blocks = Sequence[Sequence[int]]  # kernel block ids, per group
Pairs = Sequence[Sequence[tuple[int, int]]]  # (destination, source) kernel ids, per group


class LayoutError(ValueError):
    """A layout does not fit the memory it is said to describe."""


# ------------------------------------------------------------------ patterns


def pattern_header(engine_tag: str, request_tag: str, group: int, layer: int, block: int) -> bytes:
    """The 32 bytes a block's pattern starts with: a hash of the whole tuple.

    Tags are length-prefixed so that ("a|b", "c") and ("a", "b|c") differ.
    """
    key = f"{len(engine_tag)}:{engine_tag}|{len(request_tag)}:{request_tag}|{group}|{layer}|{block}"
    return hashlib.blake2b(key.encode(), digest_size=HEADER_BYTES, person=b"kvpattern").digest()


def _body_chunk(header: bytes) -> np.ndarray:
    seed = int.from_bytes(header[:16], "little")
    return np.frombuffer(np.random.default_rng(seed).bytes(PERIOD), dtype=np.uint8)


def _tile_into(dest: np.ndarray, chunk: np.ndarray) -> None:
    """Repeat ``chunk`` over ``dest`` with O(log n) memcpys, no temporary."""
    n = dest.shape[0]
    first = min(n, chunk.shape[0])
    dest[:first] = chunk[:first]
    filled = first
    while filled < n:
        step = min(filled, n - filled)
        dest[filled : filled + step] = dest[:step]
        filled += step


def write_pattern(
    dest: np.ndarray, engine_tag: str, request_tag: str, group: int, layer: int, block: int
) -> None:
    """Write the pattern of the tuple over the whole of ``dest`` (a uint8 view)."""
    header = np.frombuffer(
        pattern_header(engine_tag, request_tag, group, layer, block), dtype=np.uint8
    )
    head = min(dest.shape[0], HEADER_BYTES)
    dest[:head] = header[:head]
    if dest.shape[0] > HEADER_BYTES:
        _tile_into(dest[HEADER_BYTES:], _body_chunk(header.tobytes()))


def block_pattern(
    engine_tag: str, request_tag: str, group: int, layer: int, block: int, nbytes: int
) -> np.ndarray:
    """The ``nbytes`` bytes that identify exactly this (engine, request, group, layer, block)."""
    out = np.empty(nbytes, dtype=np.uint8)
    write_pattern(out, engine_tag, request_tag, group, layer, block)
    return out


# -------------------------------------------------------------------- views


@dataclass(frozen=True)
class LayerExtent:
    """Where one layer of one group lies: ``num_blocks * block_bytes`` bytes at ``offset``."""

    group: int
    layer: int
    region: str
    offset: int
    num_blocks: int
    block_bytes: int

    @property
    def end(self) -> int:
        return self.offset + self.num_blocks * self.block_bytes


class KvView:
    """An engine's KV cache as numpy: regions by name plus the group layout.

    Block ``b`` of layer ``l`` of group ``g`` is
    ``regions[layer.region][layer.offset + b * block_bytes :][:block_bytes]``,
    as in :mod:`schemas.kvlayout`. The constructor checks that every layer
    fits its region, so a wrong layout fails here and not as a confusing
    mismatch later.
    """

    def __init__(self, groups: Sequence[GroupSpec], regions: Mapping[str, np.ndarray]) -> None:
        self.groups: tuple[GroupSpec, ...] = tuple(groups)
        self.regions: dict[str, np.ndarray] = dict(regions)
        self.extents: tuple[LayerExtent, ...] = tuple(self._extents())

    def _extents(self) -> Iterator[LayerExtent]:
        for g, spec in enumerate(self.groups):
            for li, layer in enumerate(spec.layers):
                ext = LayerExtent(
                    g, li, layer.region, layer.offset, spec.num_blocks, spec.block_bytes
                )
                region = self.regions.get(layer.region)
                if region is None:
                    raise LayoutError(f"group {g} layer {li}: no region named {layer.region!r}")
                if region.dtype != np.uint8 or region.ndim != 1:
                    raise LayoutError(f"region {layer.region!r} must be a 1-D uint8 array")
                if ext.offset < 0 or ext.end > region.shape[0]:
                    raise LayoutError(
                        f"group {g} layer {li}: bytes {ext.offset}..{ext.end} do not fit "
                        f"region {layer.region!r} of {region.shape[0]} bytes"
                    )
                yield ext

    def block(self, group: int, layer: int, block: int) -> np.ndarray:
        """A writable view of one block of one layer."""
        spec = self.groups[group]
        if not 0 <= block < spec.num_blocks:
            raise IndexError(f"group {group} has no block {block} (0..{spec.num_blocks - 1})")
        where = spec.layers[layer]
        start = where.offset + block * spec.block_bytes
        return self.regions[where.region][start : start + spec.block_bytes]

    def layer_blocks(self, extent: LayerExtent, regions: Mapping[str, np.ndarray]) -> np.ndarray:
        """The layer as a (num_blocks, block_bytes) array over ``regions``.

        ``regions`` is this view's or a snapshot's, so both compare row by row.
        """
        flat = regions[extent.region][extent.offset : extent.end]
        return flat.reshape(extent.num_blocks, extent.block_bytes)


# --------------------------------------------------------------- fill / check


def fill_blocks(view: KvView, engine_tag: str, request_tag: str, blocks: Blocks) -> int:
    """Write each listed kernel block (every layer) with its own pattern; returns bytes written."""
    _check_group_count(view, len(blocks))
    written = 0
    for g, ids in enumerate(blocks):
        for li in range(len(view.groups[g].layers)):
            for b in ids:
                dest = view.block(g, li, b)
                write_pattern(dest, engine_tag, request_tag, g, li, b)
                written += dest.shape[0]
    return written


@dataclass(frozen=True)
class Mismatch:
    """A destination block that does not hold the pattern of its source block.

    ``holds`` says what it holds instead when that can be told: "zeros", the
    source block (and layer) whose pattern it carries, or "unknown".
    """

    group: int
    layer: int
    dst_block: int
    src_block: int
    first_bad_offset: int
    bad_bytes: int
    holds: str

    def __str__(self) -> str:
        return (
            f"group {self.group} layer {self.layer}: destination block {self.dst_block} "
            f"should hold source block {self.src_block} but holds {self.holds} "
            f"({self.bad_bytes} bytes differ, first at offset {self.first_bad_offset})"
        )


def check_blocks(
    view: KvView,
    engine_tag: str,
    request_tag: str,
    pairs: Pairs,
    source_blocks: Sequence[int] | None = None,
) -> list[Mismatch]:
    """Compare every destination block with the pattern of its paired source block.

    ``engine_tag``/``request_tag`` are the *source* engine's tags: a destination
    block is right only if it carries exactly what the source engine wrote
    into the paired source block, for this request and incarnation.
    ``source_blocks`` are the source block ids a wrong block is matched
    against to say where it came from (default: ids 0 up to the larger of
    the group's size and the highest paired source id).
    """
    _check_group_count(view, len(pairs))
    mismatches: list[Mismatch] = []
    for g, group_pairs in enumerate(pairs):
        candidates = source_blocks
        if candidates is None:
            top = max((src for _, src in group_pairs), default=-1)
            candidates = range(max(view.groups[g].num_blocks, top + 1))
        identify = _Identifier(engine_tag, request_tag, g, view.groups[g], candidates)
        for li in range(len(view.groups[g].layers)):
            for dst, src in group_pairs:
                found = _compare_block(view, engine_tag, request_tag, g, li, dst, src, identify)
                if found is not None:
                    mismatches.append(found)
    return mismatches


def _compare_block(
    view: KvView,
    engine_tag: str,
    request_tag: str,
    g: int,
    li: int,
    dst: int,
    src: int,
    identify: _Identifier,
) -> Mismatch | None:
    actual = view.block(g, li, dst)
    expected = block_pattern(engine_tag, request_tag, g, li, src, actual.shape[0])
    differ = np.flatnonzero(actual != expected)
    if differ.size == 0:
        return None
    return Mismatch(g, li, dst, src, int(differ[0]), int(differ.size), identify(actual))


class _Identifier:
    """Names the source block a wrong destination block came from, if any.

    Built lazily: headers of the group's candidate source blocks are hashed
    (about a microsecond each) only when a mismatch has to be explained.
    """

    def __init__(
        self,
        engine_tag: str,
        request_tag: str,
        group: int,
        spec: GroupSpec,
        candidates: Iterable[int],
    ) -> None:
        self._args = (engine_tag, request_tag, group)
        self._layers = len(spec.layers)
        self._sources = candidates
        self._table: dict[bytes, tuple[int, int]] | None = None

    def __call__(self, actual: np.ndarray) -> str:
        if not actual.any():
            return "zeros"
        if self._table is None:
            self._table = {
                pattern_header(*self._args, li, b): (li, b)
                for li in range(self._layers)
                for b in self._sources
            }
        hit = self._table.get(actual[:HEADER_BYTES].tobytes())
        if hit is None:
            return "unknown"
        return f"source block {hit[1]} layer {hit[0]}"


def _check_group_count(view: KvView, n: int) -> None:
    if n > len(view.groups):
        raise LayoutError(f"{n} groups given, the layout has {len(view.groups)}")


# -------------------------------------------------------- unchanged elsewhere


class Snapshot:
    """A copy of a view's regions: what every byte is expected to hold.

    The simulated decode engine keeps one as its reference and refreshes the
    blocks of a request once it has verified them, so later checks compare
    against the last accepted contents.
    """

    def __init__(self, view: KvView) -> None:
        self.regions: dict[str, np.ndarray] = {
            name: array.copy() for name, array in view.regions.items()
        }

    def refresh(self, view: KvView, group: int, blocks: Iterable[int]) -> None:
        """Accept the current contents of these blocks (every layer) as expected."""
        spec = view.groups[group]
        for layer in spec.layers:
            dst = self.regions[layer.region]
            src = view.regions[layer.region]
            for b in blocks:
                start = layer.offset + b * spec.block_bytes
                dst[start : start + spec.block_bytes] = src[start : start + spec.block_bytes]


def snapshot(view: KvView) -> Snapshot:
    """Copy the view's regions, to compare against after a transfer."""
    return Snapshot(view)


@dataclass(frozen=True)
class Change:
    """Bytes that changed where nothing was allowed to change.

    Inside a block: ``group``, ``layer``, ``block`` are set. Outside every
    block (padding or a guard between layers): they are None and ``offset``
    is the first changed byte in ``region``.
    """

    region: str
    offset: int
    group: int | None = None
    layer: int | None = None
    block: int | None = None

    def __str__(self) -> str:
        if self.block is None:
            return f"region {self.region!r} changed at offset {self.offset}, outside every block"
        return f"group {self.group} layer {self.layer} block {self.block} changed"


def changed_blocks(
    before: Snapshot, view: KvView, except_blocks: Sequence[Iterable[int]] | None = None
) -> list[Change]:
    """Every block, and every byte outside blocks, that differs from ``before``.

    ``except_blocks`` lists, per group, the kernel blocks allowed to change
    (all their layers).
    """
    allowed = [set(ids) for ids in (except_blocks or ())]
    changes: list[Change] = []
    for ext in view.extents:
        skip = allowed[ext.group] if ext.group < len(allowed) else set()
        for b in _changed_rows(
            view.layer_blocks(ext, before.regions), view.layer_blocks(ext, view.regions)
        ):
            if b not in skip:
                offset = ext.offset + b * ext.block_bytes
                changes.append(Change(ext.region, offset, ext.group, ext.layer, b))
    changes.extend(_changed_gaps(before, view))
    return changes


def blocks_unchanged(before: Snapshot, view: KvView, except_blocks: Blocks | None = None) -> bool:
    """True when nothing changed since ``before`` except the allowed blocks."""
    return not changed_blocks(before, view, except_blocks)


def _changed_rows(before: np.ndarray, now: np.ndarray) -> list[int]:
    """Indices of rows that differ, comparing at most ~16 MiB per step."""
    rows_per_step = max(1, _COMPARE_CHUNK // max(1, before.shape[1]))
    changed: list[int] = []
    for start in range(0, before.shape[0], rows_per_step):
        stop = start + rows_per_step
        differ = (before[start:stop] != now[start:stop]).any(axis=1)
        changed.extend(int(i) + start for i in np.flatnonzero(differ))
    return changed


def _changed_gaps(before: Snapshot, view: KvView) -> list[Change]:
    changes: list[Change] = []
    for name, region in view.regions.items():
        for lo, hi in _gaps(view, name, region.shape[0]):
            for start in range(lo, hi, _COMPARE_CHUNK):
                stop = min(hi, start + _COMPARE_CHUNK)
                differ = np.flatnonzero(before.regions[name][start:stop] != region[start:stop])
                if differ.size:
                    changes.append(Change(name, start + int(differ[0])))
                    break
    return changes


def _gaps(view: KvView, region: str, size: int) -> list[tuple[int, int]]:
    """Byte ranges of a region that no layer covers."""
    covered = sorted((e.offset, e.end) for e in view.extents if e.region == region)
    gaps: list[tuple[int, int]] = []
    cursor = 0
    for lo, hi in covered:
        if lo > cursor:
            gaps.append((cursor, lo))
        cursor = max(cursor, hi)
    if cursor < size:
        gaps.append((cursor, size))
    return gaps
