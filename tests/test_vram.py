"""GPU KV caches (daemon/dataplane/vram.py and the VRAM paths of the data plane and node).

Without a GPU (CI) everything up to the first CUDA call is tested for real:
handle validation, the reference-counter file checks on real /dev/shm files,
the data plane's layout checks and the memory type and device it hands NIXL,
and the refusal when CUDA is absent, through a real daemon process too. Tests
that use a stand-in say so in their names (``fake_handle``: a well-formed
handle that names no GPU memory; ``fake_region``, ``fake_agent``): they check
what would be opened or registered, never that GPU bytes moved.

The GPU-side test lives in bench/gpu_vram_test.py (run by bench/gpu_check.sh);
bench/gpu_check.sh runs them on the device machine before its end-to-end check.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from daemon.client import BlockingEngineClient, RpcError
from daemon.dataplane import vram
from daemon.dataplane.geometry import (
    NIXL_MEM,
    check_remote_engine,
    descriptor_rows,
    local_remote_engine,
)
from daemon.dataplane.memory import (
    SHM_ROOT,
    MappedRegion,
    RegionError,
    create_shm_file,
    map_dram_region,
)
from daemon.dataplane.plane import DataPlaneError
from daemon.dataplane.vram import (
    HANDLE_VERSION,
    NO_CUDA,
    REF_COUNTER_SLOTS,
    CudaIpcHandle,
    check_ref_counter,
    decode_handle,
    encode_handle,
    open_vram_region,
    share_cuda_tensor,
)
from daemon.dataplane.worker import Worker
from daemon.sim.launcher import Daemon
from harness.cudaipc import MIB, fake_handle, fake_spec
from schemas.kvlayout import EngineSpec, GroupSpec, LayerSpec, MemoryKind, RegionSpec
from schemas.layout import GroupKind


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


HAS_CUDA = _has_cuda()
without_cuda = pytest.mark.skipif(HAS_CUDA, reason="checks the refusal on machines without CUDA")


# --------------------------------------------------------------------------
# stand-ins


@dataclass
class FakeVramRegion:
    """Quacks like an opened VramRegion (address, size, device); no GPU memory behind it."""

    name: str
    size: int
    device: int = 0
    base: int = 0x7F00_0000_0000
    memory: MemoryKind = MemoryKind.VRAM
    closed: bool = False

    def close(self) -> None:
        self.closed = True


@dataclass
class FakeAgent:
    """Records the NIXL calls the data-plane worker makes; moves nothing."""

    calls: list[tuple[str, Any, str]] = field(default_factory=list)

    def register_memory(self, rows: np.ndarray, mem: str) -> str:
        self.calls.append(("register_memory", rows.copy(), mem))
        return f"reg{len(self.calls)}"

    def prep_xfer_dlist(self, agent: str, rows: np.ndarray, mem: str) -> str:
        self.calls.append((f"prep_xfer_dlist:{agent}", rows.copy(), mem))
        return "dlist"


def _refused(spec: RegionSpec) -> str:
    with pytest.raises(RegionError) as info:
        decode_handle(spec)
    assert info.value.code == "bad_region"
    return str(info.value)


# --------------------------------------------------------------------------
# message validation: no CUDA needed


def test_handle_round_trips_through_region_spec_with_fake_handle_without_cuda() -> None:
    handle = fake_handle(device=3, device_uuid="GPU-x")
    spec = fake_spec(handle)
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(spec), type=RegionSpec)
    assert decode_handle(wire) == handle
    assert len(spec.ipc_handle) < 512  # a plain cudaMalloc handle stays small on the wire


@pytest.mark.parametrize(
    ("ipc_handle", "expect"),
    [
        (b"", "carries no ipc_handle"),
        (b"\xc1garbage", "not a valid CUDA IPC handle"),
        (b"\x92\x01\x02", "not a valid CUDA IPC handle"),  # an array, not a map
        (encode_handle(fake_handle())[:-3], "not a valid CUDA IPC handle"),  # truncated
        (msgspec.msgpack.encode({"version": 1}), "not a valid CUDA IPC handle"),  # fields missing
        (
            msgspec.msgpack.encode(msgspec.structs.asdict(fake_handle()) | {"extra": 1}),
            "not a valid CUDA IPC handle",
        ),
        (b"\x00" * (vram.MAX_HANDLE_BYTES + 1), "too large"),
    ],
)
def test_bad_handle_bytes_are_refused_with_fake_handle_without_cuda(
    ipc_handle: bytes, expect: str
) -> None:
    assert expect in _refused(fake_spec(ipc_handle=ipc_handle))


@pytest.mark.parametrize(
    ("changes", "expect"),
    [
        ({"device": -1}, "`$.device`"),
        ({"storage_bytes": 0}, "`$.storage_bytes`"),
        ({"offset": -1}, "`$.offset`"),
        ({"nbytes": 0}, "`$.nbytes`"),
        ({"mem_handle": b""}, "`$.mem_handle`"),
        ({"event_handle": bytes(63)}, "`$.event_handle`"),
        ({"ref_counter_offset": REF_COUNTER_SLOTS}, "`$.ref_counter_offset`"),
        ({"storage_offset": 2**63}, "`$.storage_offset`"),
    ],
)
def test_handle_fields_out_of_range_are_refused_with_fake_handle_without_cuda(
    changes: dict[str, Any], expect: str
) -> None:
    # Encode past the Struct's own checks, as a hostile or buggy engine could.
    raw = msgspec.structs.asdict(fake_handle()) | changes
    message = _refused(fake_spec(ipc_handle=msgspec.msgpack.encode(raw)))
    assert "not a valid CUDA IPC handle" in message and expect in message


@pytest.mark.parametrize(
    ("spec_changes", "handle_changes", "expect"),
    [
        ({"device": -1}, {}, "device -1 is not a CUDA device index"),
        ({"device": 1}, {}, "the spec says device 1, its ipc_handle device 0"),
        ({"size": 3 * MIB}, {}, f"the spec says {3 * MIB} bytes, its ipc_handle {2 * MIB}"),
        ({"size": 0}, {}, "must be positive"),
        ({}, {"offset": 3 * MIB}, "do not fit in its storage"),
        ({}, {"version": HANDLE_VERSION + 1}, "format version"),
        ({}, {"ref_counter": b"/../../etc/passwd"}, "not a torch counter file name"),
        ({}, {"ref_counter": b"/torch_1_2_3\x00x"}, "not a torch counter file name"),
        ({"memory": MemoryKind.DRAM}, {}, "not VRAM"),
    ],
)
def test_inconsistent_specs_are_refused_with_fake_handle_without_cuda(
    spec_changes: dict[str, Any], handle_changes: dict[str, Any], expect: str
) -> None:
    spec = fake_spec(fake_handle(**handle_changes), **spec_changes)
    assert expect in _refused(spec)


@given(st.binary(max_size=400))
def test_arbitrary_handle_bytes_are_refused_cleanly_without_cuda(data: bytes) -> None:
    try:
        decode_handle(fake_spec(ipc_handle=data))
    except RegionError as exc:
        assert exc.code == "bad_region"


# --------------------------------------------------------------------------
# the reference-counter file, on real /dev/shm files


@pytest.fixture
def counter_file() -> Iterator[Path]:
    """A real file where torch would put a counter file; removed afterwards."""
    name = f"torch_{os.getpid()}_{uuid.uuid4().int % 10**9}_0"
    path = Path(SHM_ROOT) / name
    yield path
    if path.is_symlink() or path.exists():
        path.unlink()


def _spec_for(path: Path) -> tuple[RegionSpec, CudaIpcHandle]:
    handle = fake_handle(ref_counter=b"/" + path.name.encode())
    return fake_spec(handle), handle


def test_ref_counter_file_is_checked_with_fake_handle_without_cuda(counter_file: Path) -> None:
    spec, handle = _spec_for(counter_file)
    with pytest.raises(RegionError, match="No such file"):
        check_ref_counter(spec, handle, os.getuid())
    counter_file.write_bytes(bytes(8 * REF_COUNTER_SLOTS - 8))
    with pytest.raises(RegionError, match="too small"):
        check_ref_counter(spec, handle, os.getuid())
    counter_file.write_bytes(bytes(8 * REF_COUNTER_SLOTS))
    with pytest.raises(RegionError, match=f"not by the engine's uid {os.getuid() + 1}"):
        check_ref_counter(spec, handle, os.getuid() + 1)
    check_ref_counter(spec, handle, os.getuid())
    check_ref_counter(spec, handle, None)


def test_ref_counter_symlink_is_refused_with_fake_handle_without_cuda(
    counter_file: Path, tmp_path: Path
) -> None:
    target = tmp_path / "elsewhere"
    target.write_bytes(bytes(8 * REF_COUNTER_SLOTS))
    counter_file.symlink_to(target)
    spec, handle = _spec_for(counter_file)
    with pytest.raises(RegionError, match="not a regular file"):
        check_ref_counter(spec, handle, None)


# --------------------------------------------------------------------------
# refusal when CUDA is absent


@without_cuda
def test_open_refuses_without_cuda_with_fake_handle() -> None:
    with pytest.raises(RegionError) as info:
        open_vram_region(fake_spec(), owner_uid=os.getuid())
    assert info.value.code == "bad_region"
    assert str(info.value) == f"region 'kv': {NO_CUDA}"


def test_open_refuses_when_torch_is_missing_with_fake_handle_without_cuda(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(__import__("sys").modules, "torch", None)  # import torch -> ImportError
    with pytest.raises(RegionError, match=NO_CUDA) as info:
        open_vram_region(fake_spec())
    assert info.value.code == "bad_region"


@without_cuda
def test_message_checks_come_before_the_cuda_check_with_fake_handle() -> None:
    with pytest.raises(RegionError, match="its ipc_handle"):
        open_vram_region(fake_spec(size=MIB))


def test_sharing_a_cpu_tensor_is_refused_without_cuda() -> None:
    torch = pytest.importorskip("torch")
    with pytest.raises(ValueError, match="not on a CUDA device"):
        share_cuda_tensor(torch.zeros(16, dtype=torch.uint8), name="kv")


# --------------------------------------------------------------------------
# data plane: layout checks and what NIXL is told


def _vram_engine(
    regions: dict[str, Any], *, block_bytes: int = 4096, num_blocks: int = 64
) -> EngineSpec:
    return EngineSpec(
        "gpu-engine",
        (
            GroupSpec(
                GroupKind.ATTENTION,
                num_blocks,
                block_bytes,
                tuple(LayerSpec(name) for name in regions),
            ),
        ),
        tuple(RegionSpec(name, r.size, r.memory, device=r.device) for name, r in regions.items()),
    )


def test_vram_engine_rows_carry_its_device_with_fake_region_without_cuda() -> None:
    regions = {
        "l0": FakeVramRegion("l0", 64 * 4096, device=1, base=0x7000_0000),
        "l1": FakeVramRegion("l1", 64 * 4096, device=1, base=0x9000_0000),
    }
    remote = local_remote_engine(_vram_engine(regions), regions)
    assert (remote.memory, remote.device) == (MemoryKind.VRAM, 1)
    assert NIXL_MEM[remote.memory] == "VRAM"
    rows = descriptor_rows(remote)
    assert rows.shape == (128, 3)
    assert set(rows[:, 2].tolist()) == {1}
    assert rows[0, 0] == 0x7000_0000 and rows[64, 0] == 0x9000_0000
    assert rows[1, 0] - rows[0, 0] == 4096
    check_remote_engine(remote)  # a peer accepts it


def test_vram_layout_errors_are_refused_with_fake_region_without_cuda(tmp_path: Path) -> None:
    size = 64 * 4096
    two_gpus = {
        "l0": FakeVramRegion("l0", size, device=0),
        "l1": FakeVramRegion("l1", size, device=1),
    }
    with pytest.raises(DataPlaneError, match="all VRAM on one device") as info:
        local_remote_engine(_vram_engine(two_gpus), two_gpus)
    assert info.value.code == "bad_layout"

    dram = create_shm_file(os.path.join(SHM_ROOT, f"kvpushd-test-vram-{uuid.uuid4().hex}"), size)
    mapped: MappedRegion = map_dram_region(dram, owner_uid=os.getuid())
    try:
        mixed: dict[str, Any] = {"l0": FakeVramRegion("l0", size), "l1": mapped}
        spec = msgspec.structs.replace(
            _vram_engine(mixed),
            regions=(
                RegionSpec("l0", size, MemoryKind.VRAM),
                msgspec.structs.replace(dram, name="l1"),
            ),
        )
        with pytest.raises(DataPlaneError, match="must all be DRAM or all VRAM"):
            local_remote_engine(spec, mixed)
    finally:
        mapped.close()
        os.unlink(dram.path)

    lying = {"l0": FakeVramRegion("l0", size)}
    declared_dram = msgspec.structs.replace(
        _vram_engine(lying), regions=(RegionSpec("l0", size, MemoryKind.DRAM),)
    )
    with pytest.raises(DataPlaneError, match="declared dram, opened as vram"):
        local_remote_engine(declared_dram, lying)

    small = {"l0": FakeVramRegion("l0", size - 1)}
    with pytest.raises(DataPlaneError, match="do not fit"):
        local_remote_engine(_vram_engine(small), small)


def test_remote_engine_with_negative_device_is_refused_with_fake_region_without_cuda() -> None:
    regions = {"l0": FakeVramRegion("l0", 64 * 4096)}
    remote = msgspec.structs.replace(local_remote_engine(_vram_engine(regions), regions), device=-1)
    with pytest.raises(DataPlaneError, match="unsupported memory") as info:
        check_remote_engine(remote)
    assert info.value.code == "bad_layout"


def test_worker_registers_vram_with_its_device_with_fake_agent_without_cuda() -> None:
    regions = {"l0": FakeVramRegion("l0", 64 * 4096, device=2, base=0x5000_0000)}
    remote = local_remote_engine(_vram_engine(regions), regions)
    loop = asyncio.new_event_loop()
    try:
        worker = Worker("w", "UCX", loop, 1e-4, None, lambda notifs: None)
        agent = FakeAgent()
        worker.st.agent = agent
        # Without a GPU the device binding is recorded instead of made current.
        worker.use_device = lambda device: agent.calls.append(("use_device", device, ""))
        worker.add_local(remote, list(regions.values()))
        worker.add_remote_engine("peer", remote)
    finally:
        loop.close()
    bound, *calls = agent.calls
    # The device's context is current on the worker's thread before NIXL sees VRAM.
    assert bound == ("use_device", 2, "")
    (reg, reg_rows, reg_mem), (local, local_rows, local_mem), (peer, peer_rows, peer_mem) = calls
    assert (reg, reg_mem) == ("register_memory", "VRAM")
    assert reg_rows.tolist() == [[0x5000_0000, 64 * 4096, 2]]
    assert (local, local_mem) == ("prep_xfer_dlist:NIXL_INIT_AGENT", "VRAM")
    assert (peer, peer_mem) == ("prep_xfer_dlist:peer", "VRAM")
    assert set(local_rows[:, 2].tolist()) == set(peer_rows[:, 2].tolist()) == {2}


# --------------------------------------------------------------------------
# a real daemon process


@pytest.fixture(scope="module")
def daemon(solo_daemon: Daemon) -> Daemon:
    """This module's daemon, shared by its tests (it must exit 0 at the end)."""
    return solo_daemon


@pytest.fixture
def client(daemon: Daemon) -> Iterator[BlockingEngineClient]:
    with BlockingEngineClient.connect(daemon.socket, client_name="test-vram") as c:
        yield c


def _groups(size: int) -> tuple[GroupSpec, ...]:
    return (GroupSpec(GroupKind.ATTENTION, size // 4096, 4096, (LayerSpec("kv"),)),)


def _register_refused(client: BlockingEngineClient, engine_id: str, **kwargs: Any) -> str:
    with pytest.raises(RpcError) as info:
        client.register_engine(engine_id, timeout=60, **kwargs)
    assert info.value.code == "bad_region", info.value
    return info.value.message


def _still_serving(daemon: Daemon, client: BlockingEngineClient, refused: list[str]) -> None:
    """The daemon answers, holds none of the refused engines, and still takes a DRAM one."""
    assert daemon.proc is not None and daemon.proc.poll() is None
    engines = client.status()["engines"]
    assert not set(refused) & set(engines)
    dram = create_shm_file(os.path.join(SHM_ROOT, f"kvpushd-test-vram-{uuid.uuid4().hex}"), MIB)
    try:
        engine_id = f"dram-{uuid.uuid4().hex[:6]}"
        client.register_engine(engine_id, _groups(MIB), (msgspec.structs.replace(dram, name="kv"),))
        assert engine_id in client.status()["engines"]
    finally:
        os.unlink(dram.path)


@without_cuda
def test_daemon_refuses_vram_without_cuda_and_keeps_serving_with_fake_handle(
    daemon: Daemon, client: BlockingEngineClient
) -> None:
    spec = fake_spec()
    message = _register_refused(client, "gpu-0", groups=_groups(spec.size), regions=(spec,))
    assert message == f"region 'kv': {NO_CUDA}"
    # Twice: the first refusal left nothing behind that the second trips over.
    assert _register_refused(client, "gpu-0", groups=_groups(spec.size), regions=(spec,)) == message
    _still_serving(daemon, client, ["gpu-0"])


def test_daemon_refuses_malformed_vram_regions_and_keeps_serving_with_fake_handle(
    daemon: Daemon, client: BlockingEngineClient
) -> None:
    cases = {
        "bad-bytes": (fake_spec(ipc_handle=b"\xc1nope"), "not a valid CUDA IPC handle"),
        "neg-device": (fake_spec(device=-1), "device -1 is not a CUDA device index"),
        "size": (fake_spec(size=3 * MIB), "its ipc_handle"),
    }
    for engine_id, (spec, expect) in cases.items():
        message = _register_refused(client, engine_id, groups=_groups(spec.size), regions=(spec,))
        assert expect in message, message
    dram = create_shm_file(os.path.join(SHM_ROOT, f"kvpushd-test-vram-{uuid.uuid4().hex}"), MIB)
    try:
        message = _register_refused(
            client,
            "vram-offload",
            groups=_groups(MIB),
            regions=(msgspec.structs.replace(dram, name="kv"),),
            offload=fake_spec(),
            offload_slots=1,
        )
    finally:
        os.unlink(dram.path)
    assert "offload pools are DRAM only" in message
    _still_serving(daemon, client, [*cases, "vram-offload"])


# --------------------------------------------------------------------------
# UCX's CUDA transports: the runtime is loaded before the NIXL agent exists

_PROBE = (
    "import os, sys; from daemon.dataplane.vram import load_cuda_before_nixl as f;"
    " print(f(), 'torch' in sys.modules, os.environ.get('UCX_MEMTYPE_CACHE'))"
)


def _probe(pythonpath: str | None = None, **env_vars: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "UCX_MEMTYPE_CACHE"} | env_vars
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run(
        [sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_torch_is_loaded_before_nixl_exactly_where_it_is_a_cuda_build() -> None:
    # A CPU build (CI) is never imported: a DRAM-only daemon starts without paying
    # for it. On a GPU machine torch is loaded and sees the GPU.
    assert _probe() == ("True True n" if HAS_CUDA else "False False None")


def test_a_cuda_build_of_torch_is_loaded_before_nixl_with_fake_torch(tmp_path: Path) -> None:
    # Stand-in for torch's CUDA build (the H200 check runs the real one): the marker
    # library makes the data plane import torch, and the answer is torch's own.
    fake = tmp_path / "torch"
    (fake / "lib").mkdir(parents=True)
    (fake / "lib" / "libtorch_cuda.so").write_bytes(b"")
    (fake / "__init__.py").write_text(
        "class cuda:\n    @staticmethod\n    def is_available():\n        return True\n"
    )
    # UCX's memory-type cache is turned off (it takes IPC-opened VRAM for host
    # memory), unless the operator chose otherwise.
    assert _probe(str(tmp_path)) == "True True n"
    assert _probe(str(tmp_path), UCX_MEMTYPE_CACHE="y") == "True True y"
