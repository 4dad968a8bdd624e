"""KV memory handed to the daemon as a descriptor (issue 38): a sealed memfd, no file.

An engine passes its memfds with its Hello (SCM_RIGHTS); a region names one
by index; the daemon maps its own duplicate and registers it with NIXL.
Real daemons on loopback, simulated engines over real NIXL writes, every
byte verified; the refusals are each one clear error that changes nothing.
"""

from __future__ import annotations

import array
import asyncio
import fcntl
import mmap
import os
import re
import socket
import struct
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import pytest

from daemon.client import EngineClient
from daemon.client.errors import RpcError
from daemon.client.memfd import create_kv_memfd
from daemon.framing import frame_bytes
from daemon.node.descriptors import MAX_DESCRIPTORS
from daemon.sim.engine import SimEngine, SimGroup
from daemon.sim.launcher import Daemon, fd_count, mapped_files, start_pair, wait_idle
from harness.crashrounds import CrashEngine
from schemas import rpc
from schemas.kvlayout import GroupSpec, KvPlacement, LayerSpec, MemoryKind, MemoryNote, RegionSpec
from schemas.layout import GroupKind, Role
from tests.support import REPO
from tests.support.fixtures import stop_cleanly
from tests.support.pushes import push

LAYOUT = [SimGroup(num_blocks=32, block_bytes=1024, layers=2)]
SIZE = 2 * 32 * 1024
GROUPS = (
    GroupSpec(GroupKind.ATTENTION, 32, 1024, (LayerSpec("kv", 0), LayerSpec("kv", 32 * 1024))),
)


def _tag() -> str:
    return uuid.uuid4().hex[:8]


def _shm_names(tag: str) -> list[str]:
    return [name for name in os.listdir("/dev/shm") if tag in name]


@pytest.fixture
def fds() -> Iterator[Callable[[int], int]]:
    """Descriptors this test made; closed afterwards."""
    made: list[int] = []

    def keep(fd: int) -> int:
        made.append(fd)
        return fd

    yield keep
    for fd in made:
        os.close(fd)


# ------------------------------------------------------------ pushes, bytes


@pytest.mark.parametrize(
    ("prefill_memory", "decode_memory"),
    [("descriptor", "descriptor"), ("file", "descriptor"), ("descriptor", "file")],
)
async def test_a_push_into_and_out_of_memory_passed_by_descriptor_lands_byte_exact(
    peered_pair: tuple[Daemon, Daemon], prefill_memory: str, decode_memory: str
) -> None:
    prefill, decode = peered_pair
    tag = _tag()
    pe = await SimEngine.create(
        f"p-{tag}", Role.PUSHER, LAYOUT, prefill.socket, memory=prefill_memory
    )
    de = await SimEngine.create(
        f"d-{tag}", Role.RECEIVER, LAYOUT, decode.socket, memory=decode_memory
    )
    try:
        for i in range(3):
            await push(
                pe, de, prefill, f"fd-{tag}-{i}", [[i, i + 1, i + 2]], [[5, 6, 7]], on_demand=False
            )
        # A region shared by descriptor has no file: nothing of this engine's under /dev/shm.
        files = _shm_names(tag)
        assert all(f"p-{tag}" not in f for f in files) or prefill_memory == "file", files
        assert all(f"d-{tag}" not in f for f in files) or decode_memory == "file", files
        assert len(files) == [prefill_memory, decode_memory].count("file")
        lines = {**prefill.status()["engines"], **decode.status()["engines"]}
        assert lines[f"p-{tag}"]["memory"] == prefill_memory
        assert lines[f"d-{tag}"]["memory"] == decode_memory
    finally:
        await pe.close()
        await de.close()


async def test_a_restarted_daemon_maps_the_memory_again_from_the_engines_new_hello(
    tmp_path: Path,
) -> None:
    prefill, decode = start_pair(tmp_path)
    tag = _tag()
    pe = de = None
    try:
        pe = await CrashEngine.launch(f"p-{tag}", Role.PUSHER, prefill.socket, "descriptor")
        de = await CrashEngine.launch(f"d-{tag}", Role.RECEIVER, decode.socket, "descriptor")
        # The crash engines' layout has two groups: one block list each.
        await push(pe, de, prefill, f"before-{tag}", [[1, 2]] * 2, [[3, 4]] * 2, on_demand=False)
        wait_idle(prefill, decode)
        decode.kill()  # SIGKILL: nothing of the daemon's is left to clean up
        assert not _shm_names(tag)
        decode.start()
        decode.wait_peer(prefill.node)
        await de.reconnect(decode.socket)
        assert decode.status()["engines"][f"d-{tag}"]["memory"] == "descriptor"
        await push(
            pe, de, prefill, f"after-{tag}", [[5, 6, 7]] * 2, [[8, 9, 10]] * 2, on_demand=False
        )
        assert not _shm_names(tag)
    finally:
        for engine in (pe, de):
            if engine is not None:
                await engine.close()
        stop_cleanly(prefill, decode)


async def test_the_daemon_lets_go_of_the_memory_once_the_engine_is_gone(
    solo_daemon: Daemon,
) -> None:
    assert solo_daemon.proc is not None
    pid = solo_daemon.proc.pid
    label = f"kvpushd-let-go-{_tag()}"
    fd = create_kv_memfd(label, SIZE)
    client = await EngineClient.connect(solo_daemon.socket, descriptors=(fd,))
    region = RegionSpec("kv", SIZE, descriptor=0)
    await client.register_engine(f"e-{label}", GROUPS, (region,))
    os.close(fd)  # the engine's own hold goes; the daemon's mapping keeps the memory
    assert any(label in path for path in mapped_files(pid))
    await client.close()
    deadline = time.monotonic() + 10
    while any(label in path for path in mapped_files(pid)):
        assert time.monotonic() < deadline, "the daemon still maps a gone engine's memory"
        await asyncio.sleep(0.05)


# ------------------------------------------------------------- refusals


def _unsealed() -> int:
    fd = os.memfd_create("kvpushd-unsealed", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, SIZE)
    return fd


def _write_sealed() -> int:
    fd = _unsealed()
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_WRITE)
    return fd


def _read_only() -> int:
    fd = create_kv_memfd("kvpushd-read-only", SIZE)
    try:
        return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY)  # the same memfd, read-only
    finally:
        os.close(fd)


def _pipe() -> int:
    read, write = os.pipe()
    os.close(write)
    return read


def _disk_file(tmp_path: Path) -> int:
    path = tmp_path / "kv"
    path.write_bytes(bytes(SIZE))
    return os.open(path, os.O_RDWR)


@pytest.mark.parametrize(
    ("make", "region", "message"),
    [
        (_unsealed, RegionSpec("kv", SIZE, descriptor=0), "not sealed against shrinking"),
        (_pipe, RegionSpec("kv", SIZE, descriptor=0), "is not a memfd"),
        (_write_sealed, RegionSpec("kv", SIZE, descriptor=0), "cannot map memfd"),
        (_read_only, RegionSpec("kv", SIZE, descriptor=0), "cannot map memfd"),
        ("disk", RegionSpec("kv", SIZE, descriptor=0), "is not a memfd"),
        (None, RegionSpec("kv", SIZE // 2, descriptor=0), f"is {SIZE} bytes, the engine declared"),
        (None, RegionSpec("kv", SIZE, descriptor=2), "names descriptor 2; the connection.s"),
        (None, RegionSpec("kv", SIZE, descriptor=0, path="/dev/shm/x"), "both a descriptor"),
    ],
    ids=["unsealed", "pipe", "write-sealed", "read-only", "disk-file", "size", "index", "path-too"],
)
async def test_memory_the_daemon_could_not_trust_is_refused_and_the_connection_serves_on(
    solo_daemon: Daemon,
    tmp_path: Path,
    fds: Callable[[int], int],
    make: object,
    region: RegionSpec,
    message: str,
) -> None:
    good = fds(create_kv_memfd("kvpushd-good", SIZE))
    if make is None:
        bad = good
    elif make == "disk":
        bad = fds(_disk_file(tmp_path))
    else:
        assert callable(make)
        bad = fds(make())
    engine_id = f"refused-{_tag()}"
    async with await EngineClient.connect(solo_daemon.socket, descriptors=(bad, good)) as client:
        with pytest.raises(RpcError, match=message) as refused:
            await client.register_engine(engine_id, GROUPS, (region,))
        assert refused.value.code == rpc.BAD_REGION
        assert engine_id not in solo_daemon.status()["engines"]
        # The same connection registers good memory next.
        await client.register_engine(engine_id, GROUPS, (RegionSpec("kv", SIZE, descriptor=1),))
        assert solo_daemon.status()["engines"][engine_id]["memory"] == "descriptor"


def _hello_with(sock_path: str, declared: int, passed: list[int]) -> rpc.Reply:
    """A raw Hello that says ``declared`` descriptors and carries ``passed``; its reply."""
    hello = frame_bytes(msgspec.msgpack.encode(rpc.Hello(1, "raw", 2, descriptors=declared)))
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(sock_path)
        ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", passed))]
        sock.sendmsg([hello], ancillary if passed else [])
        (length,) = struct.unpack(">I", sock.recv(4, socket.MSG_WAITALL))
        body = sock.recv(length, socket.MSG_WAITALL)
    return msgspec.msgpack.decode(body, type=rpc.ServerMessage)  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("declared", "passed", "message"),
    [
        (2, 1, "says it carries 2 descriptors and 1 arrived"),
        (0, 1, "says it carries 0 descriptors and 1 arrived"),
        (1, 0, "says it carries 1 descriptors and 0 arrived"),
        (
            MAX_DESCRIPTORS + 1,
            MAX_DESCRIPTORS + 1,
            f"and more than {MAX_DESCRIPTORS} arrived",
        ),
    ],
)
def test_a_hello_whose_descriptors_do_not_match_its_word_is_refused_and_nothing_is_kept(
    solo_daemon: Daemon, fds: Callable[[int], int], declared: int, passed: int, message: str
) -> None:
    assert solo_daemon.proc is not None
    before = fd_count(solo_daemon.proc.pid)
    memfd = fds(create_kv_memfd("kvpushd-hello", 4096))
    reply = _hello_with(solo_daemon.socket, declared, [memfd] * passed)
    assert isinstance(reply, rpc.Error), reply
    assert reply.code == rpc.BAD_REQUEST
    assert message in reply.message
    # The connection is gone and so is every descriptor it passed.
    assert fd_count(solo_daemon.proc.pid) == before


def test_descriptors_sent_after_the_hello_are_dropped_unread(
    solo_daemon: Daemon, fds: Callable[[int], int]
) -> None:
    assert solo_daemon.proc is not None
    before = fd_count(solo_daemon.proc.pid)
    memfd = fds(create_kv_memfd("kvpushd-late", 4096))
    hello = frame_bytes(msgspec.msgpack.encode(rpc.Hello(1, "late", 2)))
    status = frame_bytes(msgspec.msgpack.encode(rpc.Status(2)))
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(solo_daemon.socket)
        sock.sendall(hello)
        (length,) = struct.unpack(">I", sock.recv(4, socket.MSG_WAITALL))
        sock.recv(length, socket.MSG_WAITALL)
        sock.sendmsg([status], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [memfd]))])
        (length,) = struct.unpack(">I", sock.recv(4, socket.MSG_WAITALL))
        reply = msgspec.msgpack.decode(
            sock.recv(length, socket.MSG_WAITALL), type=rpc.ServerMessage
        )
        assert isinstance(reply, rpc.StatusReply), reply
        assert fd_count(solo_daemon.proc.pid) == before + 1  # the connection alone
    assert fd_count(solo_daemon.proc.pid) == before


# -------------------------------------------------- registering again


async def test_an_engine_that_registers_again_must_bring_the_same_memory(
    solo_daemon: Daemon, fds: Callable[[int], int]
) -> None:
    first = fds(create_kv_memfd("kvpushd-first", SIZE))
    other = fds(create_kv_memfd("kvpushd-other", SIZE))
    engine_id = f"again-{_tag()}"
    region = RegionSpec("kv", SIZE, descriptor=0)
    note = MemoryNote(KvPlacement.STAGING, "a mirror: the cache is elsewhere")
    async with await EngineClient.connect(solo_daemon.socket, descriptors=(first,)) as client:
        await client.register_engine(engine_id, GROUPS, (region,), memory_note=note)
        line = solo_daemon.status()["engines"][engine_id]
        assert (line["kv"], line["memory_why"]) == ("staging", note.why)
        # Same layout, a new memfd: the daemon would write where the engine no longer reads.
        async with await EngineClient.connect(solo_daemon.socket, descriptors=(other,)) as again:
            with pytest.raises(RpcError, match="other memory in region 'kv'") as refused:
                await again.register_engine(engine_id, GROUPS, (region,))
            assert refused.value.code == "engine_in_use"
        # The same memfd on a new connection (a reconnect) takes the engine over.
        async with await EngineClient.connect(solo_daemon.socket, descriptors=(first,)) as again:
            await again.register_engine(engine_id, GROUPS, (region,))
            line = solo_daemon.status()["engines"][engine_id]
            assert (line["kv"], line["memory_why"]) == ("cache", "")


async def test_a_file_made_anew_under_the_old_name_is_other_memory(solo_daemon: Daemon) -> None:
    path = Path(f"/dev/shm/kvpushd-test-anew-{_tag()}")
    engine_id = f"anew-{_tag()}"
    region = RegionSpec("kv", SIZE, path=str(path))
    try:
        path.write_bytes(bytes(SIZE))
        async with await EngineClient.connect(solo_daemon.socket) as client:
            await client.register_engine(engine_id, GROUPS, (region,))
            path.unlink()
            path.write_bytes(bytes(SIZE))
            async with await EngineClient.connect(solo_daemon.socket) as again:
                with pytest.raises(RpcError, match="other memory"):
                    await again.register_engine(engine_id, GROUPS, (region,))
    finally:
        path.unlink(missing_ok=True)


# ------------------------------------------------------------ the memfd


def test_the_engines_memfd_is_sealed_allocated_and_zero() -> None:
    fd = create_kv_memfd("kvpushd-made", 3 * 4096)
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        assert (
            seals & fcntl.F_SEAL_SHRINK and seals & fcntl.F_SEAL_GROW and seals & fcntl.F_SEAL_SEAL
        )
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 4096)
        assert os.fstat(fd).st_blocks * 512 >= 3 * 4096  # allocated up front
        with mmap.mmap(fd, 3 * 4096) as view:
            assert view[:] == bytes(3 * 4096)
        assert os.get_inheritable(fd) is False
    finally:
        os.close(fd)


@pytest.mark.parametrize("how", ["two regions", "the offload pool"])
async def test_one_memory_named_as_two_regions_is_refused(
    solo_daemon: Daemon, fds: Callable[[int], int], how: str
) -> None:
    """A region maps its memory whole: the same memfd twice would alias their blocks."""
    fd = fds(create_kv_memfd("kvpushd-twice", SIZE))
    engine_id = f"twice-{_tag()}"
    kv = RegionSpec("kv", SIZE, descriptor=0)
    async with await EngineClient.connect(solo_daemon.socket, descriptors=(fd,)) as client:
        with pytest.raises(RpcError, match="are the same memory") as refused:
            if how == "two regions":
                half = GROUPS[0].layers[1]
                groups = (
                    GroupSpec(GroupKind.ATTENTION, 32, 1024, (LayerSpec("kv", 0),)),
                    GroupSpec(GroupKind.ATTENTION, 32, 1024, (LayerSpec("kv2", half.offset),)),
                )
                await client.register_engine(
                    engine_id, groups, (kv, RegionSpec("kv2", SIZE, descriptor=0))
                )
            else:
                # The daemon zeroes a freed slot: over the KV cache, that is live KV.
                offload = RegionSpec("pool", SIZE, descriptor=0)
                await client.register_engine(engine_id, GROUPS, (kv,), offload, offload_slots=4)
        assert refused.value.code == rpc.BAD_REGION
        assert engine_id not in solo_daemon.status()["engines"]


# --------------------------------------------- GPU memory by descriptor (cuMem)


async def test_gpu_memory_passed_by_descriptor_is_refused_with_why_where_there_is_no_cuda(
    solo_daemon: Daemon, fds: Callable[[int], int]
) -> None:
    """This machine has no GPU: the daemon says so, the connection serves on.

    The import itself runs on a GPU only (bench/gpu_vram_test.py, run by
    bench/gpu_check.sh on the device machine).
    """
    fd = fds(create_kv_memfd("kvpushd-not-vram", SIZE))
    engine_id = f"vram-{_tag()}"
    vram = RegionSpec("kv", SIZE, MemoryKind.VRAM, device=0, descriptor=0)
    async with await EngineClient.connect(solo_daemon.socket, descriptors=(fd,)) as client:
        with pytest.raises(RpcError, match="no CUDA device") as refused:
            await client.register_engine(engine_id, GROUPS, (vram,))
        assert refused.value.code == rpc.BAD_REGION
        both = RegionSpec("kv", SIZE, MemoryKind.VRAM, ipc_handle=b"x", descriptor=0)
        with pytest.raises(RpcError, match="names a descriptor and also an ipc_handle"):
            await client.register_engine(engine_id, GROUPS, (both,))
        await client.register_engine(engine_id, GROUPS, (RegionSpec("kv", SIZE, descriptor=0),))
        assert solo_daemon.status()["engines"][engine_id]["memory"] == "descriptor"


def test_an_engine_without_a_cuda_driver_is_told_so_when_it_exports_gpu_memory() -> None:
    from daemon.dataplane.cumem import NO_DRIVER, CumemError, ExportedVram

    with pytest.raises(CumemError, match=re.escape(NO_DRIVER)):
        ExportedVram.create(4096)


def test_the_cuda_driver_structs_have_the_drivers_sizes() -> None:
    """cuMemCreate and cuMemSetAccess read these as C structs (64-bit Linux layouts)."""
    import ctypes

    from daemon.dataplane import cumem

    assert ctypes.sizeof(cumem._Location) == 8
    assert ctypes.sizeof(cumem._Prop) == 32
    assert cumem._Prop.allocFlags.offset == 24 and cumem._Prop.location.offset == 8
    assert ctypes.sizeof(cumem._Access) == 12


async def test_kvpushd_status_shows_how_each_engine_shared_its_memory_and_why(
    solo_daemon: Daemon, fds: Callable[[int], int]
) -> None:
    fd = fds(create_kv_memfd("kvpushd-status", SIZE))
    engine_id = f"shown-{_tag()}"
    note = MemoryNote(KvPlacement.STAGING, "a host mirror of a cache on cuda:0")
    async with await EngineClient.connect(solo_daemon.socket, descriptors=(fd,)) as client:
        await client.register_engine(
            engine_id, GROUPS, (RegionSpec("kv", SIZE, descriptor=0),), memory_note=note
        )
        done = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "daemon.cli", "status", "--socket", solo_daemon.socket,
            stdout=asyncio.subprocess.PIPE, cwd=REPO,
        )  # fmt: skip
        out = (await done.communicate())[0].decode()
    assert done.returncode == 0, out
    lines = out.splitlines()
    header = next(line for line in lines if line.startswith("engine "))
    assert header.split()[-2:] == ["memory", "kv"], header
    row = next(line for line in lines if line.startswith(engine_id))
    assert row.split()[-2:] == ["descriptor", "staging"], row
    assert f"  {engine_id} memory: {note.why}" in lines, out
