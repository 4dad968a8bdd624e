"""How an engine's KV memory is laid out: regions, layers, groups.

Block ``b`` of layer ``l`` of group ``g`` lives at
``region(layers[l].region).base + layers[l].offset + b * stride`` and is
``block_bytes`` long, where ``stride`` is ``block_stride`` or, when that is 0,
``block_bytes``: blocks of one layer are contiguous, so runs of consecutive
block ids merge into one NIXL descriptor.

A stride above ``block_bytes`` describes a *head slice*: the same memory as
another engine's blocks, seen as only some KV heads of each block. vLLM's
CPU cache is head-major inside a block (``[heads, block_size, 2 * head_size]``),
so a range of heads is one contiguous run of every block; a decode rank that
holds the heads of two prefill ranks registers one slice engine per prefill
rank, and each prefill rank's whole blocks pair with its slice's
(statemachine/ranks.py).
"""

from __future__ import annotations

import enum
from typing import Annotated, Final

import msgspec

from schemas.fingerprint import Fingerprint
from schemas.layout import EngineLayout, GroupKind, GroupLayout


class MemoryKind(enum.StrEnum):
    DRAM = "dram"
    VRAM = "vram"


# omit_defaults: a client that shares memory the way an older daemon knows
# sends nothing that daemon would refuse as an unknown field.
class RegionSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """A memory region the engine shares with its daemon.

    DRAM: either ``descriptor``, the index of a sealed memfd among the
    descriptors the connection's Hello carried (no file name at all), or
    ``path``, a POSIX shared-memory file under /dev/shm.
    VRAM: ``ipc_handle`` is a CUDA IPC handle for ``device``.
    """

    name: str
    size: int
    memory: MemoryKind = MemoryKind.DRAM
    path: str = ""
    device: int = 0
    ipc_handle: bytes = b""
    descriptor: int = -1

    @property
    def shared_as(self) -> SharedAs:
        """How the daemon gets this region's memory."""
        if self.memory is MemoryKind.VRAM:
            return SharedAs.CUDA_IPC
        return SharedAs.DESCRIPTOR if self.descriptor >= 0 else SharedAs.FILE


class SharedAs(enum.StrEnum):
    """How an engine hands a region's memory to its daemon (``kvpushd status``)."""

    DESCRIPTOR = "descriptor"  # a sealed memfd passed over the engine socket
    FILE = "file"  # a named file under /dev/shm the daemon opens
    CUDA_IPC = "cuda_ipc"  # a CUDA IPC handle the daemon opens on its GPU


class KvPlacement(enum.StrEnum):
    """Whose bytes the shared memory is."""

    CACHE = "cache"  # the engine's KV cache itself: the daemon reads and writes it in place
    STAGING = "staging"  # a host mirror of a cache the daemon cannot map; the engine copies


MAX_WHY_CHARS: Final = 400  # one line in kvpushd status, not a log


class MemoryNote(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The engine's word on its shared memory: whose bytes, and why so (one line)."""

    placement: KvPlacement = KvPlacement.CACHE
    why: Annotated[str, msgspec.Meta(max_length=MAX_WHY_CHARS)] = ""


class LayerSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    region: str
    offset: int = 0


class GroupSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    kind: GroupKind
    num_blocks: int
    block_bytes: int
    layers: tuple[LayerSpec, ...]
    per_logical: int = 1
    block_stride: int = 0  # bytes from one block to the next; 0: block_bytes

    @property
    def stride(self) -> int:
        return self.block_stride or self.block_bytes

    @property
    def layer_span(self) -> int:
        """Bytes from a layer's first block to the end of its last."""
        return (self.num_blocks - 1) * self.stride + self.block_bytes


class EngineSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """An engine's full KV layout, as it registers with its daemon."""

    engine_id: str
    groups: tuple[GroupSpec, ...]
    regions: tuple[RegionSpec, ...]
    fingerprint: Fingerprint | None = None

    def layout(self, offload_slots: int = 0, overlays: tuple[int, ...] = ()) -> EngineLayout:
        """The part of the layout the core reasons about (with the offload pool's size).

        ``overlays``: for each group, the group whose memory it lies over, or
        -1 (statemachine/overlay.py finds them); () when none does.
        """
        under = overlays or (-1,) * len(self.groups)
        return EngineLayout(
            self.engine_id,
            tuple(
                GroupLayout(g.kind, g.num_blocks, g.per_logical, o)
                for g, o in zip(self.groups, under, strict=True)
            ),
            offload_slots,
            self.fingerprint,
        )


class RemoteGroup(msgspec.Struct, frozen=True):
    """A group as a peer daemon sees it: addresses in that daemon's mapping."""

    kind: GroupKind
    num_blocks: int
    block_bytes: int
    layer_addrs: tuple[int, ...]
    per_logical: int = 1
    block_stride: int = 0  # as GroupSpec.block_stride

    @property
    def stride(self) -> int:
        return self.block_stride or self.block_bytes


class RemoteEngine(msgspec.Struct, frozen=True):
    engine_id: str
    memory: MemoryKind
    device: int
    groups: tuple[RemoteGroup, ...]


def model_signature(groups: tuple[GroupSpec, ...] | tuple[RemoteGroup, ...]) -> tuple:
    """What two engines must agree on for one to push into the other."""
    return tuple(
        (
            g.kind.value,
            g.block_bytes,
            len(g.layers) if isinstance(g, GroupSpec) else len(g.layer_addrs),
        )
        for g in groups
    )
