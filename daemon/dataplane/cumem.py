"""GPU memory passed by descriptor: cuMem allocations exported as POSIX file descriptors.

Memory a daemon opens through legacy CUDA IPC (:mod:`daemon.dataplane.vram`)
cannot be exported again for UCX's ``cuda_ipc``, so UCX moved it between
two daemons by software emulation over TCP (0.3 GB/s on an H200 against
bare NIXL's 1.4 TB/s, bench/RESULTS.md). Memory made with the driver's
virtual memory API and handed over as a POSIX file descriptor is imported
by the daemon as an allocation of its own: it maps it into its address
space, and UCX sees device memory this process mapped.

Engine side: :meth:`ExportedVram.create` makes the allocation
(``cuMemCreate`` with ``CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR``, and
GPUDirect RDMA capable where the device offers it), maps it for the engine
and exports its descriptor, which goes to the daemon with the Hello
(``EngineClient.connect(descriptors=...)``); a registration names it
``RegionSpec(memory=VRAM, descriptor=i)``. Daemon side:
:func:`import_vram` (``cuMemImportFromShareableHandle``, ``cuMemMap``,
``cuMemSetAccess``) returns the mapping, which :mod:`daemon.dataplane.vram`
wraps as a region like any other.

Only the CUDA driver (``libcuda.so.1``) is called, through ctypes; torch
makes the device's primary context current and views the mapping as a
tensor. Without a driver, every entry point raises :class:`CumemError`
saying so.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from collections.abc import Callable
from typing import Any, Final

CU_MEM_ALLOCATION_TYPE_PINNED: Final = 1
CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR: Final = 1
CU_MEM_LOCATION_TYPE_DEVICE: Final = 1
CU_MEM_ACCESS_FLAGS_PROT_READWRITE: Final = 3
CU_MEM_ALLOC_GRANULARITY_MINIMUM: Final = 0
CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED: Final = 103
CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED: Final = 110
NO_DRIVER: Final = "no CUDA driver (libcuda.so.1) in this process"


class CumemError(RuntimeError):
    """A cuMem call failed, or there is no driver to call; the message names the call."""


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class _Prop(ctypes.Structure):
    """CUmemAllocationProp (32 bytes on 64-bit Linux)."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", _Location),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", _AllocFlags),
    ]


class _Access(ctypes.Structure):
    """CUmemAccessDesc."""

    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


_u64 = ctypes.c_uint64
_size = ctypes.c_size_t
_SIGNATURES: Final[dict[str, list[Any]]] = {
    "cuInit": [ctypes.c_uint],
    "cuGetErrorString": [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)],
    "cuDeviceGet": [ctypes.POINTER(ctypes.c_int), ctypes.c_int],
    "cuDeviceGetAttribute": [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int],
    "cuMemGetAllocationGranularity": [
        ctypes.POINTER(_size),
        ctypes.POINTER(_Prop),
        ctypes.c_int,
    ],
    "cuMemCreate": [ctypes.POINTER(_u64), _size, ctypes.POINTER(_Prop), _u64],
    "cuMemExportToShareableHandle": [ctypes.c_void_p, _u64, ctypes.c_int, _u64],
    "cuMemImportFromShareableHandle": [ctypes.POINTER(_u64), ctypes.c_void_p, ctypes.c_int],
    "cuMemGetAllocationPropertiesFromHandle": [ctypes.POINTER(_Prop), _u64],
    "cuMemAddressReserve": [ctypes.POINTER(_u64), _size, _size, _u64, _u64],
    "cuMemAddressFree": [_u64, _size],
    "cuMemMap": [_u64, _size, _size, _u64, _u64],
    "cuMemUnmap": [_u64, _size],
    "cuMemSetAccess": [_u64, _size, ctypes.POINTER(_Access), _size],
    "cuMemRelease": [_u64],
}
_driver: ctypes.CDLL | None = None
_driver_lock = threading.Lock()


def _cuda() -> ctypes.CDLL:
    """The driver library, loaded and initialized once (CumemError if there is none)."""
    global _driver
    with _driver_lock:
        if _driver is None:
            try:
                lib = ctypes.CDLL("libcuda.so.1")
            except OSError as exc:
                raise CumemError(f"{NO_DRIVER}: {exc}") from None
            for name, argtypes in _SIGNATURES.items():
                function = getattr(lib, name)
                function.argtypes, function.restype = argtypes, ctypes.c_int
            _call(lib, "cuInit", 0)
            _driver = lib
        return _driver


def _call(lib: ctypes.CDLL, name: str, *args: Any) -> None:
    """Call the driver's ``name``; CumemError naming it unless it returned CUDA_SUCCESS."""
    result = getattr(lib, name)(*args)
    if result == 0:
        return
    text = ctypes.c_char_p()
    lib.cuGetErrorString(result, ctypes.byref(text))
    said = text.value.decode() if text.value else "unknown error"
    raise CumemError(f"{name} failed: CUDA error {result} ({said})")


def _device_attribute(lib: ctypes.CDLL, device: int, attribute: int) -> int:
    handle, value = ctypes.c_int(), ctypes.c_int()
    _call(lib, "cuDeviceGet", ctypes.byref(handle), device)
    _call(lib, "cuDeviceGetAttribute", ctypes.byref(value), attribute, handle)
    return value.value


def _access(device: int) -> _Access:
    return _Access(
        _Location(CU_MEM_LOCATION_TYPE_DEVICE, device), CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    )


def _exportable(device: int) -> _Prop:
    """Pinned memory on ``device`` that can be exported as a POSIX file descriptor."""
    prop = _Prop(type=CU_MEM_ALLOCATION_TYPE_PINNED)
    prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    prop.location = _Location(CU_MEM_LOCATION_TYPE_DEVICE, device)
    return prop


def granularity(device: int) -> int:
    """The size every allocation and mapping on ``device`` is a multiple of."""
    lib = _cuda()
    prop = _exportable(device)
    size = _size()
    _call(
        lib,
        "cuMemGetAllocationGranularity",
        ctypes.byref(size),
        ctypes.byref(prop),
        CU_MEM_ALLOC_GRANULARITY_MINIMUM,
    )
    return int(size.value)


class Mapping:
    """Device memory mapped into this process at ``base``; undone in reverse by :meth:`close`."""

    def __init__(self, device: int, size: int) -> None:
        self.device, self.size = device, size
        self.base = 0
        self.handle = 0
        self._undo: list[Callable[[], None]] = []

    def _then_undo(self, undo: Callable[[], None]) -> None:
        self._undo.append(undo)

    def adopt(self, lib: ctypes.CDLL, handle: int) -> None:
        """``handle`` is this mapping's allocation: released last by :meth:`close`."""
        self.handle = handle
        self._then_undo(lambda: _call(lib, "cuMemRelease", handle))

    def map(self, lib: ctypes.CDLL, handle: int, alignment: int) -> None:
        """Reserve an address range, map ``handle`` there and open it to this device."""
        base = _u64()
        _call(lib, "cuMemAddressReserve", ctypes.byref(base), self.size, alignment, 0, 0)
        self.base = int(base.value)
        self._then_undo(lambda: _call(lib, "cuMemAddressFree", self.base, self.size))
        _call(lib, "cuMemMap", self.base, self.size, 0, handle, 0)
        self._then_undo(lambda: _call(lib, "cuMemUnmap", self.base, self.size))
        access = _access(self.device)
        _call(lib, "cuMemSetAccess", self.base, self.size, ctypes.byref(access), 1)

    def tensor(self) -> Any:
        """A flat uint8 torch tensor over the mapping (it keeps no hold on the memory)."""
        import torch

        return torch.as_tensor(_ArrayInterface(self.base, self.size), device=f"cuda:{self.device}")

    def close(self) -> None:
        """Unmap, free the address range, release the handle; idempotent, best effort."""
        undo, self._undo = self._undo, []
        errors = []
        for step in reversed(undo):
            try:
                step()
            except (CumemError, OSError) as exc:
                errors.append(str(exc))
        if errors:
            raise CumemError("; ".join(errors))


class _ArrayInterface:
    """What torch.as_tensor reads to view device memory it did not allocate."""

    def __init__(self, base: int, size: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (size,),
            "typestr": "|u1",
            "data": (base, False),
            "version": 3,
            "strides": None,
        }


class ExportedVram(Mapping):
    """Engine side: a cuMem allocation on ``device``, mapped here, its descriptor exported."""

    def __init__(self, device: int, size: int) -> None:
        super().__init__(device, size)
        self.fd = -1
        self.rdma_capable = False

    @classmethod
    def create(cls, size: int, device: int = 0) -> ExportedVram:
        """At least ``size`` bytes (rounded up to the device's granularity); CumemError if refused.

        The caller makes the device's context current first (``torch.cuda.set_device``).
        """
        lib = _cuda()
        if not _device_attribute(
            lib, device, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED
        ):
            raise CumemError(f"CUDA device {device} cannot export memory as a file descriptor")
        step = granularity(device)
        made = cls(device, -(-size // step) * step)
        prop = _exportable(device)
        made.rdma_capable = bool(
            _device_attribute(
                lib, device, CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED
            )
        )
        # NICs may read and write it directly where the driver offers that.
        prop.allocFlags.gpuDirectRDMACapable = int(made.rdma_capable)
        handle = _u64()
        try:
            _call(lib, "cuMemCreate", ctypes.byref(handle), made.size, ctypes.byref(prop), 0)
            made.adopt(lib, int(handle.value))
            made.map(lib, made.handle, step)
            fd = ctypes.c_int(-1)
            _call(
                lib,
                "cuMemExportToShareableHandle",
                ctypes.byref(fd),
                made.handle,
                CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                0,
            )
            made.fd = fd.value
            made._then_undo(lambda: os.close(made.fd))
        except BaseException:
            with contextlib.suppress(CumemError):
                made.close()  # what the failure left half made; the failure is the news
            raise
        return made


def import_vram(fd: int, device: int, size: int) -> Mapping:
    """Daemon side: map ``size`` bytes of the allocation ``fd`` exports, on ``device``.

    The caller makes the device's context current first. CumemError when the
    descriptor is no cuMem export, the allocation lies on another device, or
    it is smaller than ``size`` (the driver refuses a mapping past its end).
    """
    lib = _cuda()
    step = granularity(device)
    if size <= 0 or size % step:
        raise CumemError(
            f"{size} bytes is not a positive multiple of the device's {step}-byte granularity"
        )
    mapping = Mapping(device, size)
    handle = _u64()
    _call(
        lib,
        "cuMemImportFromShareableHandle",
        ctypes.byref(handle),
        ctypes.c_void_p(fd),
        CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
    )
    mapping.adopt(lib, int(handle.value))
    try:
        prop = _Prop()
        _call(lib, "cuMemGetAllocationPropertiesFromHandle", ctypes.byref(prop), mapping.handle)
        if prop.location.id != device:
            raise CumemError(
                f"the allocation lies on CUDA device {prop.location.id}, the region names {device}"
            )
        mapping.map(lib, mapping.handle, step)
    except BaseException:
        with contextlib.suppress(CumemError):
            mapping.close()
        raise
    return mapping
