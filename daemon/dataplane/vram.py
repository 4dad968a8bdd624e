"""Engine KV caches in GPU memory (VRAM), shared with the daemon through CUDA IPC.

Engine side: :func:`share_cuda_tensor` turns a contiguous CUDA tensor into a
:class:`RegionSpec` with ``memory=VRAM``. Daemon side: :func:`open_vram_region`
opens that region in the daemon's process, on the engine's GPU, and returns a
:class:`VramRegion`, which the data plane registers with NIXL as "VRAM". The
daemon's mapping is the engine's memory itself: bytes a peer writes there are
seen by the engine, and nothing is copied.

The handle. ``RegionSpec.ipc_handle`` holds a msgpack-encoded
:class:`CudaIpcHandle`: the eight fields of torch's
``UntypedStorage._share_cuda_()`` (what ``torch.multiprocessing.reductions.
reduce_tensor`` sends for a CUDA tensor), plus where the region lies in that
storage. The daemon rebuilds the storage with torch's own
``rebuild_cuda_tensor``, so CUDA IPC, torch's handle formats (plain
``cudaMalloc`` segments and expandable segments) and torch's cross-process
reference counting all stay torch's business.

Trust. The handle arrives over the RPC socket, so it is untrusted, like a DRAM
region's path. Before any CUDA call the daemon checks the message itself
(field types, ranges, the region inside its storage, the spec and the handle
agreeing); then that it has CUDA at all, that the device index exists here
(and is the same GPU as the engine's, by UUID), and that the reference-counter
file torch will decrement on close is a torch counter file owned by the
engine's uid; after opening, that the CUDA allocation really holds the whole
region (``cuMemGetAddressRange``): torch believes the sizes it is given, and
NIXL must never register bytes beyond what the engine shared. Every refusal is
a :class:`RegionError` with code ``bad_region``.

Lifetime. The engine must keep the tensor alive while the daemon may use it
(for the engine's whole registration), and must make its KV writes complete
(synchronize the stream that wrote them) before ``kv_ready``: the daemon's
copies run on NIXL's own streams, which are not ordered after the engine's.
:meth:`VramRegion.close` drops the rebuilt storage (torch closes the IPC
mapping and releases the engine's reference) and runs ``torch.cuda.ipc_collect``.
Offload pools stay in host memory (:mod:`daemon.dataplane.memory`).

Without CUDA (CI, machines without a GPU), torch is imported only once a
message has passed its checks, and :func:`open_vram_region` refuses with
:data:`NO_CUDA` in its message.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import os
import re
import stat
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Annotated, Final

import msgspec

from daemon.dataplane.cumem import CumemError, import_vram
from daemon.dataplane.memory import SHM_ROOT, MappedRegion, RegionError, descriptor_of
from schemas.kvlayout import MemoryKind, RegionSpec

if TYPE_CHECKING:
    import torch

HANDLE_VERSION: Final = 1
NO_CUDA: Final = "this daemon has no CUDA device: VRAM regions cannot be opened"

# An encoded handle is ~300 bytes for a cudaMalloc segment; expandable
# segments carry one handle per 2 MiB page, so leave room, but bound it.
MAX_HANDLE_BYTES: Final = 256 * 1024
CUDA_IPC_HANDLE_SIZE: Final = 64  # cudaIpcEventHandle_t / cudaIpcMemHandle_t
# torch's CUDA_IPC_REF_COUNTER_FILE_SIZE: int64 counters per counter file.
REF_COUNTER_SLOTS: Final = 10000
# torch names counter files with at::NewProcessWideShmHandle(): /torch_<pid>_<rand>_<n>.
_REF_COUNTER_NAME: Final = re.compile(rb"/torch_[0-9]+_[0-9]+_[0-9]+")
_MAX_INT: Final = 2**62  # far above any GPU, far below what torch's C++ side overflows on

_NonNegative = Annotated[int, msgspec.Meta(ge=0, le=_MAX_INT)]
_Positive = Annotated[int, msgspec.Meta(gt=0, le=_MAX_INT)]


class CudaIpcHandle(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """What the daemon needs to open an engine's CUDA tensor; lives in ``RegionSpec.ipc_handle``.

    Fields from ``UntypedStorage._share_cuda_()``, in its order:
    ``device``, ``mem_handle`` (torch's shareable handle of the CUDA
    allocation holding the storage), ``storage_bytes``, ``storage_offset``
    (the storage's byte offset in that allocation), ``ref_counter`` and
    ``ref_counter_offset`` (torch's cross-process reference counter: a
    /dev/shm file name and an int64 slot in it), ``event_handle`` and
    ``event_sync_required`` (an IPC event the opener waits on, so the
    producer's pending work on the storage is ordered first).

    Added here: ``version`` of this format, ``device_uuid`` of the engine's
    GPU (an index means another GPU under another CUDA_VISIBLE_DEVICES), and
    the region inside the storage: ``offset`` bytes in, ``nbytes`` long.
    """

    version: int
    device: _NonNegative
    device_uuid: str = ""
    mem_handle: Annotated[bytes, msgspec.Meta(min_length=1, max_length=MAX_HANDLE_BYTES)]
    storage_bytes: _Positive
    storage_offset: _NonNegative
    ref_counter: Annotated[bytes, msgspec.Meta(min_length=1, max_length=255)]
    ref_counter_offset: Annotated[int, msgspec.Meta(ge=0, lt=REF_COUNTER_SLOTS)]
    event_handle: Annotated[
        bytes, msgspec.Meta(min_length=CUDA_IPC_HANDLE_SIZE, max_length=CUDA_IPC_HANDLE_SIZE)
    ]
    event_sync_required: bool
    offset: _NonNegative
    nbytes: _Positive


def encode_handle(handle: CudaIpcHandle) -> bytes:
    return msgspec.msgpack.encode(handle)


# --------------------------------------------------------------------------
# engine side


def share_cuda_tensor(tensor: torch.Tensor, *, name: str = "vram") -> RegionSpec:
    """Share a contiguous CUDA tensor with the daemon as the VRAM region ``name``.

    The region is the tensor's bytes, in memory order; layers and blocks are
    placed in it by the engine's :class:`~schemas.kvlayout.LayerSpec` offsets.
    Keep the tensor alive for as long as the engine is registered. Sharing
    puts the storage under torch's IPC reference counting: once the daemon has
    closed it and the engine dropped the tensor, ``torch.cuda.ipc_collect()``
    in the engine gives the memory back.
    """
    if tensor.device.type != "cuda":
        raise ValueError(f"region {name!r}: tensor is on {tensor.device}, not on a CUDA device")
    if not tensor.is_contiguous():
        # A region is one flat byte range; a strided view would expose bytes in between.
        raise ValueError(f"region {name!r}: tensor is not contiguous")
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        raise ValueError(f"region {name!r}: tensor is empty")
    shared = tensor.untyped_storage()._share_cuda_()
    device, mem_handle, storage_bytes, storage_offset = shared[:4]
    ref_counter, ref_counter_offset, event_handle, event_sync_required = shared[4:]
    handle = CudaIpcHandle(
        version=HANDLE_VERSION,
        device=int(device),
        device_uuid=_device_uuid(int(device)),
        mem_handle=bytes(mem_handle),
        storage_bytes=int(storage_bytes),
        storage_offset=int(storage_offset),
        ref_counter=bytes(ref_counter),
        ref_counter_offset=int(ref_counter_offset),
        event_handle=bytes(event_handle),
        event_sync_required=bool(event_sync_required),
        offset=int(tensor.storage_offset()) * tensor.element_size(),
        nbytes=nbytes,
    )
    return RegionSpec(
        name, nbytes, MemoryKind.VRAM, device=int(device), ipc_handle=encode_handle(handle)
    )


def _device_uuid(device: int) -> str:
    import torch

    # str() of torch's _CUuuid; older builds lack the field: then unchecked.
    return str(getattr(torch.cuda.get_device_properties(device), "uuid", ""))


# --------------------------------------------------------------------------
# daemon side: checks that need no CUDA


def decode_handle(spec: RegionSpec) -> CudaIpcHandle:
    """The spec's handle, if the message is well formed and consistent; else RegionError."""
    where = f"region {spec.name!r}"
    if spec.memory is not MemoryKind.VRAM:
        raise RegionError(f"{where} is {spec.memory.value}, not VRAM")
    _check_size_and_device(where, spec)
    if not spec.ipc_handle:
        raise RegionError(f"{where} is VRAM but carries no ipc_handle")
    if len(spec.ipc_handle) > MAX_HANDLE_BYTES:
        raise RegionError(f"{where}: ipc_handle of {len(spec.ipc_handle)} bytes is too large")
    try:
        handle = msgspec.msgpack.decode(spec.ipc_handle, type=CudaIpcHandle)
    except msgspec.MsgspecError as exc:
        raise RegionError(f"{where}: ipc_handle is not a valid CUDA IPC handle: {exc}") from None
    _check_handle(where, spec, handle)
    return handle


def _check_size_and_device(where: str, spec: RegionSpec) -> None:
    if spec.size <= 0:
        raise RegionError(f"{where} has size {spec.size}; it must be positive")
    if spec.device < 0:
        raise RegionError(f"{where}: device {spec.device} is not a CUDA device index")


def _check_handle(where: str, spec: RegionSpec, handle: CudaIpcHandle) -> None:
    if handle.version != HANDLE_VERSION:
        raise RegionError(
            f"{where}: ipc_handle format version {handle.version}, this daemon reads"
            f" {HANDLE_VERSION}"
        )
    if handle.device != spec.device:
        raise RegionError(
            f"{where}: the spec says device {spec.device}, its ipc_handle device {handle.device}"
        )
    if handle.nbytes != spec.size:
        raise RegionError(
            f"{where}: the spec says {spec.size} bytes, its ipc_handle {handle.nbytes}"
        )
    if handle.offset + handle.nbytes > handle.storage_bytes:
        raise RegionError(
            f"{where}: bytes [{handle.offset}, {handle.offset + handle.nbytes}) do not fit"
            f" in its storage of {handle.storage_bytes} bytes"
        )
    if not _REF_COUNTER_NAME.fullmatch(handle.ref_counter):
        # torch decrements an int64 in this file when the region is closed.
        raise RegionError(
            f"{where}: ref_counter {handle.ref_counter[:64]!r} is not a torch counter file name"
        )


def check_ref_counter(spec: RegionSpec, handle: CudaIpcHandle, owner_uid: int | None) -> None:
    """The counter file torch will write into on close is a plain file of the engine's uid.

    The name was checked by :func:`decode_handle`; here the file itself:
    present under /dev/shm, not a symlink, owned by the engine's uid when
    that is known, and big enough for torch's counter slots.
    """
    where = f"region {spec.name!r}"
    path = os.path.join(SHM_ROOT, handle.ref_counter.decode("ascii").lstrip("/"))
    try:
        st = os.lstat(path)
    except OSError as exc:
        raise RegionError(f"{where}: ref_counter file {path}: {exc.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise RegionError(f"{where}: ref_counter {path} is not a regular file")
    if owner_uid is not None and st.st_uid != owner_uid:
        raise RegionError(
            f"{where}: ref_counter {path} is owned by uid {st.st_uid}, not by the engine's"
            f" uid {owner_uid}"
        )
    if st.st_size < 8 * REF_COUNTER_SLOTS:
        raise RegionError(f"{where}: ref_counter {path} is too small ({st.st_size} bytes)")


# --------------------------------------------------------------------------
# daemon side: opening


class VramRegion:
    """An engine's CUDA memory opened in this process; the VRAM peer of ``MappedRegion``.

    ``base`` is the region's device address in this process and ``device``
    the CUDA device index here; both stay valid until :meth:`close`. As for
    DRAM, deregister from NIXL (and fence writes) before closing.
    """

    memory: Final = MemoryKind.VRAM

    def __init__(
        self,
        name: str,
        tensor: torch.Tensor,
        device: int,
        release: Callable[[], None] | None = None,
    ) -> None:
        self.name = name
        self.device = device
        self.size = tensor.numel()  # a flat uint8 view: elements are bytes
        self.base: int = int(tensor.data_ptr())
        self._tensor: torch.Tensor | None = tensor
        # Memory imported by descriptor (daemon/dataplane/cumem.py) is unmapped
        # here once the view is gone; CUDA IPC memory is torch's to close.
        self._release = release

    @property
    def closed(self) -> bool:
        return self._tensor is None

    def tensor(self) -> torch.Tensor:
        """A flat uint8 CUDA tensor over the region (for checks; the daemon moves bytes by NIXL)."""
        if self._tensor is None:
            raise RegionError(f"region {self.name!r} is closed")
        return self._tensor

    def close(self) -> None:
        """Drop the rebuilt storage and collect; idempotent.

        Dropping the last reference runs torch's deleter: it synchronizes the
        device, releases the engine's reference counter and closes the IPC
        mapping (torch shares one mapping per allocation between regions).
        """
        if self._tensor is None:
            return
        self._tensor = None
        if self._release is not None:
            release, self._release = self._release, None
            release()
            return
        _ipc_collect()

    def __enter__(self) -> VramRegion:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"base=0x{self.base:x}"
        return f"VramRegion({self.name!r}, size={self.size}, device={self.device}, {state})"


def open_vram_region(spec: RegionSpec, *, owner_uid: int | None = None) -> VramRegion:
    """Validate and open an engine's VRAM region on its device; RegionError if refused."""
    handle = decode_handle(spec)
    torch = _cuda_torch(spec)
    _check_device(torch, spec, handle)
    check_ref_counter(spec, handle, owner_uid)
    tensor = _rebuild(torch, spec, handle)
    problem = _size_problem(torch, spec, handle, tensor)
    if problem is not None:
        # Close the mapping again before refusing: no frame of the raise may hold it.
        del tensor
        _ipc_collect()
        raise RegionError(f"region {spec.name!r}: {problem}")
    return VramRegion(spec.name, tensor, spec.device)


def open_vram_descriptor(
    spec: RegionSpec, descriptors: Sequence[int], *, owner_uid: int | None = None
) -> VramRegion:
    """Validate and import a VRAM region an engine passed as a cuMem descriptor; RegionError.

    The daemon maps the allocation itself (daemon/dataplane/cumem.py): UCX
    sees device memory this process mapped, not memory opened through
    legacy CUDA IPC. ``owner_uid`` is checked by the socket's credentials
    alone: an exported allocation's descriptor names no file owner.
    """
    where = f"region {spec.name!r}"
    if spec.ipc_handle or spec.path:
        raise RegionError(f"{where} names a descriptor and also an ipc_handle or a path")
    _check_size_and_device(where, spec)
    fd = descriptor_of(spec, descriptors)
    torch = _cuda_torch(spec)
    _check_device_count(torch, spec)
    with torch.cuda.device(spec.device):
        try:
            mapping = import_vram(fd, spec.device, spec.size)
        except CumemError as exc:
            raise RegionError(f"{where}: cannot import the engine's GPU memory: {exc}") from None
        try:
            tensor = mapping.tensor()
        except BaseException:
            with contextlib.suppress(CumemError):
                mapping.close()
            raise
    return VramRegion(spec.name, tensor, spec.device, release=mapping.close)


def load_cuda_before_nixl() -> bool:
    """Prepare this process for NIXL to register VRAM; True if torch is a CUDA build and sees a GPU.

    Call it before the NIXL agent exists: UCX reads its settings and picks its
    CUDA transports when its context starts. Two things made the regions that
    engines share through CUDA IPC registrable on the H200 device machine
    (bench/RESULTS.md, "Direct VRAM and host staging's copies on an H200"):
    torch's CUDA build loaded first (the nixl wheels do not ship the CUDA
    runtime UCX's transports load), and UCX's memory-type cache off. That
    cache learns device memory by hooking the allocations of its own
    process; a region opened through CUDA IPC was allocated in the engine,
    so the cache takes it for host memory and NIXL refuses it ("VRAM memory
    is detected as host by UCX"). With the cache off UCX asks the driver
    once per registration, which is rare (one per engine region) and off the
    write path. An operator's own UCX_MEMTYPE_CACHE wins. A CPU build of
    torch has no ``libtorch_cuda.so``: a DRAM-only daemon never imports
    torch here.
    """
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        return False
    if not (Path(spec.origin).parent / "lib" / "libtorch_cuda.so").exists():
        return False
    import torch

    if not torch.cuda.is_available():
        return False
    os.environ.setdefault("UCX_MEMTYPE_CACHE", "n")
    return True


def use_device_here(device: int) -> None:
    """Make ``device``'s primary CUDA context current on the calling thread (NIXL's worker).

    CUDA contexts are current per thread, and the regions are opened on the
    event loop's thread while NIXL registers and moves them on its worker
    thread: there the driver calls UCX makes must run on the engine's GPU,
    not on whichever device a fresh thread defaults to (device 0).
    """
    import torch

    torch.cuda.set_device(device)


def _cuda_torch(spec: RegionSpec) -> ModuleType:
    # Imported here, not at module level: a DRAM-only daemon never pays for torch.
    try:
        import torch
    except ImportError as exc:
        raise RegionError(f"region {spec.name!r}: {NO_CUDA} (torch: {exc})") from None
    if not torch.cuda.is_available():
        raise RegionError(f"region {spec.name!r}: {NO_CUDA}")
    return torch


def _check_device_count(torch: ModuleType, spec: RegionSpec) -> None:
    count = torch.cuda.device_count()
    if spec.device >= count:
        raise RegionError(
            f"region {spec.name!r}: CUDA device {spec.device} does not exist here (this daemon"
            f" sees {count}; do the engine and the daemon see the same CUDA_VISIBLE_DEVICES?)"
        )


def _check_device(torch: ModuleType, spec: RegionSpec, handle: CudaIpcHandle) -> None:
    where = f"region {spec.name!r}"
    _check_device_count(torch, spec)
    here = _device_uuid(spec.device)
    if handle.device_uuid and here and here != handle.device_uuid:
        raise RegionError(
            f"{where}: CUDA device {spec.device} is GPU {here} here but GPU"
            f" {handle.device_uuid} in the engine (different CUDA_VISIBLE_DEVICES?)"
        )


def _rebuild(torch: ModuleType, spec: RegionSpec, handle: CudaIpcHandle) -> torch.Tensor:
    """torch's own rebuild, as a flat uint8 tensor over exactly the region's bytes."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    try:
        # torch opens the IPC handle on the *current* device: make it the engine's.
        with torch.cuda.device(spec.device):
            return rebuild_cuda_tensor(
                torch.Tensor,
                (handle.nbytes,),
                (1,),
                handle.offset,  # in elements of uint8, i.e. bytes
                torch.UntypedStorage,
                torch.uint8,
                spec.device,
                handle.mem_handle,
                handle.storage_bytes,
                handle.storage_offset,
                False,
                handle.ref_counter,
                handle.ref_counter_offset,
                handle.event_handle,
                handle.event_sync_required,
            )
    except Exception as exc:  # torch reports CUDA failures as RuntimeError subclasses
        raise RegionError(
            f"region {spec.name!r}: cannot open its CUDA IPC handle on device {spec.device}:"
            f" {type(exc).__name__}: {exc}"
        ) from None


def _size_problem(
    torch: ModuleType, spec: RegionSpec, handle: CudaIpcHandle, tensor: torch.Tensor
) -> str | None:
    """Why the opened memory cannot hold the region, or None when it can."""
    storage_bytes = tensor.untyped_storage().nbytes()
    if storage_bytes < handle.offset + spec.size:
        return (
            f"the opened storage has {storage_bytes} bytes, fewer than"
            f" {handle.offset} + {spec.size}"
        )
    start = int(tensor.data_ptr())
    with torch.cuda.device(spec.device):
        found = _allocation_range(start)
    if isinstance(found, str):
        return found
    base, length = found
    if start < base or start + spec.size > base + length:
        return (
            f"[0x{start:x}, +{spec.size}) is not inside its CUDA allocation"
            f" [0x{base:x}, +{length}): the handle claims more memory than the engine shared"
        )
    return None


def _allocation_range(address: int) -> tuple[int, int] | str:
    """Base and size of the CUDA allocation holding ``address``, or why they are unknown.

    Driver API on the current context: torch believes the sizes a handle
    states, the driver knows what was allocated.
    """
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
        get_range = libcuda.cuMemGetAddressRange_v2
    except (OSError, AttributeError) as exc:
        return f"cannot check its size: no CUDA driver API ({exc})"
    get_range.argtypes = [
        ctypes.POINTER(ctypes.c_uint64),
        ctypes.POINTER(ctypes.c_size_t),
        ctypes.c_uint64,
    ]
    get_range.restype = ctypes.c_int
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    result = get_range(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(address))
    if result != 0:
        return f"cuMemGetAddressRange failed with CUresult {result}"
    return base.value, size.value


def _ipc_collect() -> None:
    """Let torch free what closed IPC mappings released (best effort: never fails a close)."""
    with contextlib.suppress(Exception):
        import torch

        if torch.cuda.is_available():
            torch.cuda.ipc_collect()


# ---------------------------------------------------------------- checksums

# End-to-end checksums of blocks on the device (daemon/dataplane/digest.py):
# crc32c has no torch op, so VRAM blocks get a position-weighted sum instead,
# computed where the blocks are, with exact integer arithmetic so a GPU and a
# CPU give the same value for the same bytes. Each block's little-endian
# uint32 words w_i are split into 16-bit halves; S_lo = sum(lo_i * (2i + 1)),
# S_hi = sum(hi_i * (2i + 1)) in int64 (no overflow for blocks up to 8 MiB),
# and the checksum is (S_lo + S_hi * 0x9E3779B1) mod 2^32. A changed word
# changes one half by d != 0 times an odd weight, which is never 0 mod 2^32
# for |d| < 2^16: one changed word always shows; two words moved shows too.
WSUM_ALGORITHM: Final = "wsum32"
WSUM_MAX_BLOCK: Final = 8 * 1024 * 1024
_WSUM_CHUNK_BYTES: Final = 16 * 1024 * 1024  # source bytes per batch: temporaries are 4x this
_GOLDEN: Final = 0x9E3779B1


def wsum_supported(block_bytes: int) -> bool:
    return 0 < block_bytes <= WSUM_MAX_BLOCK and block_bytes % 4 == 0


def region_wsums(
    region: object, offset: int, block_bytes: int, num_blocks: int, ids: list[int]
) -> list[int]:
    """:func:`block_wsums` of one layer at ``offset`` of a VRAM region (on its
    device) or of a mapped DRAM region (on the CPU, over the mapping: no copy)."""
    span = num_blocks * block_bytes
    if isinstance(region, VramRegion):
        layer = region.tensor()[offset : offset + span]
    else:
        import torch

        assert isinstance(region, MappedRegion)
        layer = torch.from_numpy(region.view()[offset : offset + span])
    return block_wsums(layer, block_bytes, ids)


def block_wsums(layer: torch.Tensor, block_bytes: int, ids: list[int]) -> list[int]:
    """The wsum32 checksum of each block ``ids`` of ``layer`` (flat uint8, any device).

    ``layer`` holds the layer's blocks back to back, block ``b`` at
    ``b * block_bytes``; the result is in the order of ``ids``.
    """
    import torch

    if not wsum_supported(block_bytes):
        raise ValueError(
            f"wsum32 needs a block size that is a multiple of 4 up to 8 MiB: {block_bytes}"
        )
    blocks = layer[: (layer.numel() // block_bytes) * block_bytes].view(-1, block_bytes)
    words = block_bytes // 4
    weights = torch.arange(words, dtype=torch.int64, device=layer.device) * 2 + 1
    per_chunk = max(1, _WSUM_CHUNK_BYTES // block_bytes)
    out: list[int] = []
    for start in range(0, len(ids), per_chunk):
        index = torch.tensor(ids[start : start + per_chunk], dtype=torch.int64, device=layer.device)
        chosen = blocks.index_select(0, index).view(torch.int32).to(torch.int64) & 0xFFFFFFFF
        lo = ((chosen & 0xFFFF) * weights).sum(dim=1)
        hi = ((chosen >> 16) * weights).sum(dim=1)
        out.extend(
            (a + b * _GOLDEN) & 0xFFFFFFFF for a, b in zip(lo.tolist(), hi.tolist(), strict=True)
        )
    return out
