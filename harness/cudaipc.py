"""Stand-in CUDA IPC handles, and the VRAM RegionSpec an engine sends for a handle.

For tests that check what the daemon would open or refuse without a GPU
(tests/test_vram.py) and for the GPU check that shares a real tensor
(bench/gpu_vram_test.py): :func:`fake_handle` is well-formed in torch's
shape but names no GPU memory; :func:`fake_spec` wraps any handle, fake or
real, the way an engine registers it.
"""

from __future__ import annotations

from typing import Any, Final

import msgspec

from daemon.dataplane.vram import HANDLE_VERSION, CudaIpcHandle, encode_handle
from schemas.kvlayout import MemoryKind, RegionSpec

MIB: Final = 1 << 20


def fake_handle(**changes: Any) -> CudaIpcHandle:
    """A well-formed handle in torch's shape that names no real GPU memory."""
    fields: dict[str, Any] = {
        "version": HANDLE_VERSION,
        "device": 0,
        "mem_handle": b"\x02c" + bytes(64),  # torch's versioned cudaMalloc handle layout
        "storage_bytes": 4 * MIB,
        "storage_offset": 0,
        "ref_counter": b"/torch_1234_5678_0",
        "ref_counter_offset": 0,
        "event_handle": bytes(64),
        "event_sync_required": False,
        "offset": MIB,
        "nbytes": 2 * MIB,
    }
    return CudaIpcHandle(**(fields | changes))


def fake_spec(handle: CudaIpcHandle | None = None, **changes: Any) -> RegionSpec:
    """The VRAM RegionSpec an engine would send for ``handle`` (default: fake_handle())."""
    handle = handle or fake_handle()
    spec = RegionSpec(
        "kv",
        handle.nbytes,
        MemoryKind.VRAM,
        device=handle.device,
        ipc_handle=encode_handle(handle),
    )
    return msgspec.structs.replace(spec, **changes)
