"""On a GPU only (run by bench/gpu_check.sh, never by CI): CUDA IPC sharing end to end.

Kept out of tests/ on purpose: CI has no GPU, and a test that can only skip
there proves nothing.
"""

from __future__ import annotations

import multiprocessing
import os
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import pytest

from daemon.dataplane.memory import RegionError
from daemon.dataplane.vram import decode_handle, open_vram_region, share_cuda_tensor
from harness.cudaipc import MIB, fake_spec
from schemas.kvlayout import MemoryKind, RegionSpec

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.exit("bench/gpu_vram_test.py needs a CUDA device", returncode=2)


# --------------------------------------------------------------------------
# on a GPU (skipped without CUDA; bench/gpu_check.sh runs these)


def _pattern(torch: Any, n: int, salt: int) -> Any:
    return ((torch.arange(n, device="cuda", dtype=torch.int64) * 131 + salt) % 251).to(torch.uint8)


def _engine_child(conn: Connection) -> None:
    """An engine: a region in the middle of a bigger CUDA tensor, shared; checks a write."""
    import torch

    cache = torch.zeros(4 * MIB, dtype=torch.uint8, device="cuda")
    region = cache[MIB : 3 * MIB]
    region.copy_(_pattern(torch, region.numel(), 7))
    torch.cuda.synchronize()
    conn.send(share_cuda_tensor(region, name="kv"))
    conn.recv()  # the daemon side wrote 0x5A over the region
    torch.cuda.synchronize()
    untouched = bool((cache[:MIB] == 0).all() and (cache[3 * MIB :] == 0).all())
    conn.send(bool((region == 0x5A).all()) and untouched)
    conn.recv()  # keep the tensor alive until the other side is done


def test_share_and_open_in_another_process_on_gpu() -> None:
    import torch

    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_engine_child, args=(child,), daemon=True)
    proc.start()
    try:
        assert parent.poll(120), "engine process did not share its tensor"
        spec: RegionSpec = parent.recv()
        assert (spec.memory, spec.size) == (MemoryKind.VRAM, 2 * MIB)
        handle = decode_handle(spec)
        assert handle.offset == MIB and handle.storage_bytes >= 4 * MIB

        region = open_vram_region(spec, owner_uid=os.getuid())
        assert (region.size, region.device, region.memory) == (2 * MIB, 0, MemoryKind.VRAM)
        assert torch.equal(region.tensor(), _pattern(torch, 2 * MIB, 7))  # compared on the GPU
        region.tensor().fill_(0x5A)
        torch.cuda.synchronize()
        parent.send("written")
        assert parent.recv() is True, "the engine did not see the write, or bytes outside moved"
        region.close()
        assert region.closed
        region.close()  # idempotent

        wrong_device = fake_spec(
            msgspec.structs.replace(handle, device=torch.cuda.device_count()),
            device=torch.cuda.device_count(),
        )
        with pytest.raises(RegionError, match="does not exist here"):
            open_vram_region(wrong_device)
        huge = 1 << 40  # the handle lies about its storage: the driver knows better
        inflated = msgspec.structs.replace(handle, storage_bytes=huge, nbytes=huge - MIB)
        with pytest.raises(RegionError, match=r"not inside its CUDA allocation|cannot open"):
            open_vram_region(fake_spec(inflated), owner_uid=os.getuid())
        garbage = msgspec.structs.replace(handle, mem_handle=b"\x02c" + os.urandom(64))
        with pytest.raises(RegionError, match="cannot open its CUDA IPC handle"):
            open_vram_region(fake_spec(garbage), owner_uid=os.getuid())
        parent.send("done")
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    assert proc.exitcode == 0


def _cumem_engine_child(conn: Connection, path: str) -> None:
    """An engine: a cuMem allocation exported as a descriptor, passed over a Unix socket."""
    import array
    import socket

    import torch

    from daemon.dataplane.cumem import ExportedVram

    torch.cuda.set_device(0)
    exported = ExportedVram.create(3 * MIB, 0)  # rounded up to the granularity
    view = exported.tensor()
    view.copy_(_pattern(torch, exported.size, 11))
    torch.cuda.synchronize()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(path)
        fds = array.array("i", [exported.fd])
        sock.sendmsg([b"x"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
    conn.send((exported.size, exported.rdma_capable))
    conn.recv()  # the daemon side wrote 0x3C over the first MiB
    torch.cuda.synchronize()
    rest = _pattern(torch, exported.size, 11)[MIB:]
    conn.send(bool((view[:MIB] == 0x3C).all()) and bool(torch.equal(view[MIB:], rest)))
    conn.recv()
    del view
    exported.close()


def test_cumem_memory_passed_by_descriptor_is_the_engines_own_on_gpu(tmp_path) -> None:
    """Another process's cuMem export, received with SCM_RIGHTS, imported and mapped here."""
    import socket

    from daemon.dataplane.vram import open_vram_descriptor

    path = str(tmp_path / "fd.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_cumem_engine_child, args=(child, path), daemon=True)
    proc.start()
    try:
        conn, _ = listener.accept()
        _, fds, _, _ = socket.recv_fds(conn, 1, 1)
        conn.close()
        assert parent.poll(120), "engine process did not export its memory"
        size, rdma = parent.recv()
        print(f"cuMem export: {size} bytes, GPUDirect RDMA capable: {rdma}")
        spec = RegionSpec("kv", size, MemoryKind.VRAM, device=0, descriptor=0)
        region = open_vram_descriptor(spec, fds, owner_uid=os.getuid())
        assert torch.equal(region.tensor(), _pattern(torch, size, 11))  # the engine's bytes
        region.tensor()[:MIB].fill_(0x3C)
        torch.cuda.synchronize()
        parent.send("written")
        assert parent.recv() is True, "the engine did not see the write, or bytes beyond moved"
        region.close()
        region.close()  # idempotent
        too_big = RegionSpec("kv", size * 2, MemoryKind.VRAM, device=0, descriptor=0)
        with pytest.raises(RegionError, match="cannot import the engine's GPU memory"):
            open_vram_descriptor(too_big, fds)
        parent.send("done")
    finally:
        for fd in fds if "fds" in locals() else ():
            os.close(fd)
        listener.close()
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    assert proc.exitcode == 0
