"""Device check for GPU KV caches: VRAM pushed through two daemons, verified on the GPU.

Needs one CUDA GPU; run it through ``bench/gpu_check.sh`` on the device machine.

1. Starts a prefill and a decode daemon (real processes, real NIXL over UCX,
   ``UCX_PROTO_INFO=y``) and two engine processes whose KV caches are GPU
   memory shared with their daemons: by default cuMem allocations exported
   as file descriptors and passed with each engine's Hello, which the
   daemons import and map as their own (:mod:`daemon.dataplane.cumem`);
   ``--memory ipc``: CUDA tensors shared by legacy CUDA IPC handles
   (:mod:`daemon.dataplane.vram`).
2. Pushes requests covering no hit, partial hit, full hit and a batch of
   concurrent ones. After each, the decode engine compares its whole cache ON
   THE GPU with the expected tensors (every destination block byte for byte,
   every other byte unchanged) and the prefill engine checks its own cache did
   not change. Block contents are random bytes from a seeded CUDA generator,
   regenerated on the decode side, so a block in the wrong place never matches.
3. Pushes ``--total-mib`` (1 GiB) through the daemons (kv_ready ->
   BlocksFreeable, as bench/daemon_bench.py) and with bare NIXL agents in the
   engine processes on the same VRAM (make_prepped_xfer -> DONE, as
   bench/nixl_bare.py), 64 KiB and 1 MiB blocks, contiguous and scattered
   destinations; every run's bytes are verified on the GPU. Prints a table
   last, then the UCX transports the daemons' logs name (``cuda_ipc`` is the
   fast path; ``tcp`` between two daemons on one GPU is the emulation).

    python3 -m bench.gpu_check [--total-mib 1024] [--runs 5] [--logs DIR] [--memory ipc]

Exit status: 0 passed, 1 a check failed, 2 no GPU here (or the stack is missing).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import multiprocessing
import os
import re
import shutil
import statistics
import sys
import tempfile
import threading
import time
import traceback
import uuid
import zlib
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

KIB = 1 << 10
MIB = 1 << 20
GAP = 4096  # bytes around layers that share a region: a stray write there shows up
POLL_S = 5e-5
CALL_TIMEOUT_S = 120.0
BENCH_BLOCKS = (64 * KIB, MIB)


class CheckFailed(Exception):
    """A step of the check went wrong; the message says which and why."""


# --------------------------------------------------------------------------
# layouts (the same on both engines)


@dataclass(frozen=True)
class Group:
    """One KV-cache group; ``one_region``: its layers share one tensor, with gaps."""

    num_blocks: int
    block_bytes: int
    layers: int
    per_logical: int = 1
    one_region: bool = False


# Group 0 like vLLM (one tensor per layer), group 1 with two kernel blocks per
# logical block and its layers in one tensor with guard gaps between them.
CHECK_LAYOUT = (
    Group(256, 16 * KIB, 4),
    Group(128, 64 * KIB, 2, per_logical=2, one_region=True),
)


def sim_layout(layout: Sequence[Group]) -> Any:
    """The same layout as sim_engine sees it (its expand/tail_pairs are the oracle)."""
    from daemon.sim.engine import SimGroup

    return tuple(
        SimGroup(g.num_blocks, g.block_bytes, layers=g.layers, per_logical=g.per_logical)
        for g in layout
    )


def bench_layout(total: int, block_bytes: int) -> tuple[Group, ...]:
    return (Group(total // block_bytes, block_bytes, 1),)


def request_seed(request_id: str) -> int:
    return zlib.crc32(request_id.encode())


# --------------------------------------------------------------------------
# engine side: a KV cache in CUDA tensors (runs in the engine processes)


class GpuCache:
    """One engine's KV cache as CUDA tensors, and a reference of what every byte should hold.

    ``dram``: the harness's own dry run without a GPU: the cache lives in
    /dev/shm files shared as DRAM regions instead (``--dram``).
    """

    def __init__(
        self,
        torch: Any,
        layout: Sequence[Group],
        background_seed: int,
        *,
        dram: bool = False,
        descriptor: bool = False,
    ) -> None:
        self.torch = torch
        self.dram = dram
        # Memory passed by descriptor: a cuMem export on the GPU, a memfd in a dry run.
        self.descriptor = descriptor
        self.held: list[Any] = []  # ExportedVram, or memfd descriptors: closed at unlink()
        self.device = torch.device("cpu") if dram else torch.device("cuda", 0)
        self.layout = tuple(layout)
        self.regions: dict[str, Any] = {}
        self.shm_paths: list[str] = []
        self.layer_at: list[list[tuple[str, int]]] = []
        for g, group in enumerate(self.layout):
            self.layer_at.append(self._allocate(g, group))
        for n, tensor in enumerate(self.regions.values()):
            tensor.copy_(self._random(background_seed + n, tensor.numel()))
        self.reference = {name: t.clone() for name, t in self.regions.items()}
        self.synchronize()

    def synchronize(self) -> None:
        if not self.dram:
            self.torch.cuda.synchronize()

    def _allocate(self, g: int, group: Group) -> list[tuple[str, int]]:
        span = group.num_blocks * group.block_bytes
        if not group.one_region:
            for layer in range(group.layers):
                self.regions[f"g{g}l{layer}"] = self._empty(span)
            return [(f"g{g}l{layer}", 0) for layer in range(group.layers)]
        self.regions[f"g{g}"] = self._empty(GAP + group.layers * (span + GAP))
        return [(f"g{g}", GAP + layer * (span + GAP)) for layer in range(group.layers)]

    def _empty(self, n: int) -> Any:
        if self.descriptor and not self.dram:
            from daemon.dataplane.cumem import ExportedVram

            exported = ExportedVram.create(n, 0)  # rounded up to the device's granularity
            self.held.append(exported)
            return exported.tensor()
        if self.descriptor:
            from daemon.client import create_kv_memfd

            fd = create_kv_memfd(f"kvpushd-gpu-check-{os.getpid()}", n)
            self.held.append(fd)
            return self.torch.from_file(
                f"/proc/self/fd/{fd}", shared=True, size=n, dtype=self.torch.uint8
            )
        if not self.dram:
            return self.torch.empty(n, dtype=self.torch.uint8, device=self.device)
        from daemon.dataplane.memory import SHM_ROOT, create_shm_file

        path = os.path.join(SHM_ROOT, f"kvpushd-gpu-check-{os.getpid()}-{uuid.uuid4().hex[:12]}")
        self.shm_paths.append(create_shm_file(path, n).path)
        return self.torch.from_file(path, shared=True, size=n, dtype=self.torch.uint8)

    def unlink(self) -> None:
        for path in self.shm_paths:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        self.regions.clear()
        self.reference.clear()
        for held in self.held:
            with contextlib.suppress(Exception):
                held.close() if hasattr(held, "close") else os.close(held)
        self.held.clear()

    def descriptors(self) -> tuple[int, ...]:
        """The descriptors to pass with the Hello, in the order share() names them."""
        return tuple(getattr(held, "fd", held) for held in self.held)

    def _random(self, seed: int, n: int) -> Any:
        gen = self.torch.Generator(device=self.device)
        gen.manual_seed(seed % (1 << 63))
        return self.torch.randint(
            0, 256, (n,), dtype=self.torch.uint8, device=self.device, generator=gen
        )

    def layer(self, tensors: dict[str, Any], g: int, layer: int) -> Any:
        """Blocks of one layer as a (num_blocks, block_bytes) view into ``tensors``."""
        name, offset = self.layer_at[g][layer]
        group = self.layout[g]
        span = group.num_blocks * group.block_bytes
        return tensors[name][offset : offset + span].view(group.num_blocks, group.block_bytes)

    def content(self, seed: int, g: int, layer: int) -> Any:
        """What a request's blocks of one layer hold on the prefill side (all blocks)."""
        group = self.layout[g]
        n = group.num_blocks * group.block_bytes
        return self._random(seed * 1_000_003 + g * 1009 + layer, n).view(
            group.num_blocks, group.block_bytes
        )

    def fill(self, seed: int, kernel: Sequence[Sequence[int]]) -> None:
        """Prefill: write the request's blocks, in the cache and the reference."""
        for g, ids in enumerate(kernel):
            if not ids:
                continue
            idx = self.torch.tensor(list(ids), device=self.device)
            for layer in range(self.layout[g].layers):
                src = self.content(seed, g, layer)[idx]
                self.layer(self.regions, g, layer)[idx] = src
                self.layer(self.reference, g, layer)[idx] = src
        # The daemons copy on NIXL's streams: the KV must be complete before kv_ready.
        self.synchronize()

    def expect(self, seed: int, pairs: Sequence[tuple[Sequence[int], Sequence[int]]]) -> int:
        """Decode: the reference gets the source blocks; returns blocks expected."""
        n = 0
        for g, (dst, src) in enumerate(pairs):
            if not dst:
                continue
            d = self.torch.tensor(list(dst), device=self.device)
            s = self.torch.tensor(list(src), device=self.device)
            for layer in range(self.layout[g].layers):
                self.layer(self.reference, g, layer)[d] = self.content(seed, g, layer)[s]
                n += len(dst)
        return n

    def problems(self, limit: int = 8) -> list[str]:
        """Every difference from the reference, compared on the GPU; then adopt what is there."""
        self.synchronize()
        found: list[str] = []
        for g, group in enumerate(self.layout):
            for layer in range(group.layers):
                now, want = self.layer(self.regions, g, layer), self.layer(self.reference, g, layer)
                bad = (now != want).any(dim=1).nonzero().flatten()
                if bad.numel():
                    found.append(
                        f"group {g} layer {layer}: {bad.numel()} blocks differ,"
                        f" first {bad[:limit].tolist()}"
                    )
        for name, tensor in self.regions.items():
            if not self.torch.equal(tensor, self.reference[name]) and not found:
                found.append(f"region {name}: bytes outside every block changed")
        for name, tensor in self.regions.items():
            self.reference[name].copy_(tensor)  # one fault is reported once, not forever
        return found

    def share(self) -> tuple[Any, Any]:
        """GroupSpecs and RegionSpecs (descriptors, CUDA IPC handles, files) to register."""
        from daemon.dataplane.vram import share_cuda_tensor
        from schemas.kvlayout import GroupSpec, LayerSpec, MemoryKind, RegionSpec
        from schemas.layout import GroupKind

        groups = tuple(
            GroupSpec(
                GroupKind.ATTENTION,
                group.num_blocks,
                group.block_bytes,
                tuple(LayerSpec(name, offset) for name, offset in self.layer_at[g]),
                group.per_logical,
            )
            for g, group in enumerate(self.layout)
        )
        if self.descriptor:
            kind = MemoryKind.DRAM if self.dram else MemoryKind.VRAM
            regions = tuple(
                RegionSpec(n, t.numel(), kind, device=0, descriptor=i)
                for i, (n, t) in enumerate(self.regions.items())
            )
        elif self.dram:
            regions = tuple(
                RegionSpec(n, t.numel(), MemoryKind.DRAM, path=path)
                for (n, t), path in zip(self.regions.items(), self.shm_paths, strict=True)
            )
        else:
            regions = tuple(share_cuda_tensor(t, name=n) for n, t in self.regions.items())
        return groups, regions


class BareAgent:
    """A plain NIXL agent in an engine process over that engine's VRAM (the reference path)."""

    def __init__(self, name: str) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        # No progress thread, polled as in nixl_bare.py and the daemon.
        self.agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        self.regs: dict[int, Any] = {}  # by base address: register each tensor once
        self.prepped: tuple[Any, Any, np.ndarray, np.ndarray] | None = None
        self.poller: threading.Thread | None = None
        self.seen: list[bytes] = []

    def register(self, tensor: Any) -> int:
        base = int(tensor.data_ptr())
        if base not in self.regs:
            rows = np.array([[base, tensor.numel(), _device_id(tensor)]], np.uint64)
            self.regs[base] = self.agent.register_memory(rows, _mem_type(tensor))
        return base

    def prep(self, tensor: Any, remote_name: str, remote: int, bs: int, dst: list[int]) -> None:
        """Block descriptors for both sides (the peer's memory is of the same kind here)."""
        self.release_prepped()
        n, device, mem = len(dst), _device_id(tensor), _mem_type(tensor)
        lrows = _block_rows(int(tensor.data_ptr()), bs, n, device)
        rrows = _block_rows(remote, bs, n, device)
        self.prepped = (
            self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", lrows, mem),
            self.agent.prep_xfer_dlist(remote_name, rrows, mem),
            np.arange(n, dtype=np.int32),
            np.asarray(dst, dtype=np.int32),
        )

    def push(self, message: bytes, timeout: float = 60.0) -> float:
        assert self.prepped is not None
        local, remote, lidx, ridx = self.prepped
        t0 = time.perf_counter()
        handle = self.agent.make_prepped_xfer("WRITE", local, lidx, remote, ridx, notif_msg=message)
        state = self.agent.transfer(handle)
        while state == "PROC" and time.perf_counter() - t0 < timeout:
            time.sleep(POLL_S)
            state = self.agent.check_xfer_state(handle)
        elapsed = time.perf_counter() - t0
        self.agent.release_xfer_handle(handle)
        if state != "DONE":
            raise CheckFailed(f"bare NIXL write ended in {state}")
        return elapsed

    def expect(self, message: bytes, timeout: float = 60.0) -> None:
        """Poll notifications on a thread: the sender's DONE needs our progress."""

        def poll() -> None:
            deadline = time.monotonic() + timeout
            while message not in self.seen and time.monotonic() < deadline:
                for messages in self.agent.get_new_notifs().values():
                    self.seen.extend(bytes(m) for m in messages)
                time.sleep(POLL_S)

        self.poller = threading.Thread(target=poll, daemon=True)
        self.poller.start()

    def wait(self, message: bytes) -> None:
        if self.poller is not None:
            self.poller.join()
        if message not in self.seen:
            raise CheckFailed(f"bare NIXL notification {message!r} never came")

    def release_prepped(self) -> None:
        if self.prepped is not None:
            self.agent.release_dlist_handle(self.prepped[0])
            self.agent.release_dlist_handle(self.prepped[1])
            self.prepped = None

    def close(self) -> None:
        self.release_prepped()
        for reg in self.regs.values():
            self.agent.deregister_memory(reg)
        self.regs.clear()


def _mem_type(tensor: Any) -> str:
    return "VRAM" if tensor.device.type == "cuda" else "DRAM"


def _device_id(tensor: Any) -> int:
    return tensor.device.index if tensor.device.type == "cuda" else 0


def _block_rows(base: int, block_bytes: int, n: int, device: int) -> np.ndarray:
    rows = np.empty((n, 3), dtype=np.uint64)
    rows[:, 0] = base + np.arange(n, dtype=np.uint64) * np.uint64(block_bytes)
    rows[:, 1] = block_bytes
    rows[:, 2] = device
    return rows


class Engine:
    """The command handlers of one engine process (``cmd_*``), driven over a pipe."""

    def __init__(self, name: str, socket_path: str, dram: bool, descriptor: bool) -> None:
        import torch

        if not dram:
            torch.cuda.set_device(0)
        self.torch = torch
        self.dram = dram
        self.descriptor = descriptor
        self.name = name
        self.socket_path = socket_path
        self.client = _connect(socket_path, f"gpu-check:{name}")
        # Memory by descriptor goes with a Hello: one connection per engine,
        # made when it registers; each request's calls go on its engine's.
        self.clients: dict[str, Any] = {}
        self.engine_of: dict[str, str] = {}
        self.caches: dict[str, GpuCache] = {}
        self.events: dict[str, list[Any]] = defaultdict(list)
        self.bare: BareAgent | None = None

    def cmd_alloc(self, engine_id: str, layout: Sequence[Group], seed: int) -> int:
        self.caches[engine_id] = GpuCache(
            self.torch, layout, seed, dram=self.dram, descriptor=self.descriptor
        )
        return sum(t.numel() for t in self.caches[engine_id].regions.values())

    def cmd_register(self, engine_id: str) -> None:
        cache = self.caches[engine_id]
        groups, regions = cache.share()
        client = self.client
        if self.descriptor:
            client = _connect(self.socket_path, f"gpu-check:{engine_id}", cache.descriptors())
            self.clients[engine_id] = client
        client.register_engine(engine_id, groups, regions, timeout=CALL_TIMEOUT_S)

    def _client(self, rid: str) -> Any:
        return self.clients.get(self.engine_of.get(rid, ""), self.client)

    def cmd_receive(self, engine_id: str, rid: str, blocks: list[list[int]], peer: str) -> None:
        from schemas.layout import Role

        self.engine_of[rid] = engine_id
        self._client(rid).register_request(engine_id, rid, Role.RECEIVER, blocks, peer=peer)

    def cmd_prefill(
        self, engine_id: str, rid: str, blocks: list[list[int]], kv_ready: bool = True
    ) -> None:
        from daemon.sim.engine import expand
        from schemas.layout import Role

        cache = self.caches[engine_id]
        cache.fill(request_seed(rid), expand(sim_layout(cache.layout), blocks))
        self.engine_of[rid] = engine_id
        self._client(rid).register_request(engine_id, rid, Role.PUSHER, blocks)
        if kv_ready:
            self._client(rid).kv_ready(rid)

    def cmd_push_timed(self, rid: str) -> float:
        """Seconds from kv_ready to BlocksFreeable: the whole push as the engine sees it."""
        t0 = time.perf_counter()
        self._client(rid).kv_ready(rid)
        self.cmd_wait(rid, "blocks_freeable")
        return time.perf_counter() - t0

    def cmd_wait(self, rid: str, kind: str, timeout: float = 60.0) -> None:
        from schemas import rpc

        want = {"kv_arrived": rpc.KvArrived, "blocks_freeable": rpc.BlocksFreeable}[kind]
        deadline = time.monotonic() + timeout
        while True:
            for event in self.events[rid]:
                if isinstance(event, rpc.RequestFailed):
                    raise CheckFailed(f"{rid} failed: {event.reason}: {event.message}")
                if isinstance(event, want):
                    return
            left = deadline - time.monotonic()
            if left <= 0:
                raise CheckFailed(f"no {kind} for {rid} within {timeout} s")
            with contextlib.suppress(TimeoutError):
                event = self._client(rid).next_event(timeout=left)
                self.events[event.request_id].append(event)

    def cmd_expect(self, engine_id: str, rid: str, pairs: list[tuple[list[int], list[int]]]) -> int:
        return self.caches[engine_id].expect(request_seed(rid), pairs)

    def cmd_verify(self, engine_id: str) -> list[str]:
        return self.caches[engine_id].problems()

    def cmd_release(self, rid: str) -> None:
        from schemas import rpc

        client = self._client(rid)
        if isinstance(client.release(rid), rpc.Deferred):
            deadline = time.monotonic() + 30
            while not any(isinstance(e, rpc.Released) for e in self.events[rid]):
                if time.monotonic() > deadline:
                    raise CheckFailed(f"deferred release of {rid} never completed")
                with contextlib.suppress(TimeoutError):
                    event = client.next_event(timeout=1.0)
                    self.events[event.request_id].append(event)
        self.events.pop(rid, None)
        self.engine_of.pop(rid, None)

    # ---- bare NIXL on the same tensors

    def cmd_bare_register(self, engine_id: str) -> tuple[bytes, int]:
        """Register the engine's (single) region with this process's bare agent."""
        if self.bare is None:
            self.bare = BareAgent(f"bare-{self.name}-{os.getpid()}")
        (tensor,) = self.caches[engine_id].regions.values()
        base = self.bare.register(tensor)
        return bytes(self.bare.agent.get_agent_metadata()), base

    def cmd_bare_prep(
        self, engine_id: str, metadata: bytes, remote_base: int, block_bytes: int, dst: list[int]
    ) -> None:
        assert self.bare is not None
        name = self.bare.agent.add_remote_agent(metadata)
        name = name.decode() if isinstance(name, bytes) else str(name)
        (tensor,) = self.caches[engine_id].regions.values()
        self.bare.prep(tensor, name, remote_base, block_bytes, dst)

    def cmd_bare_fill(self, engine_id: str, rid: str) -> None:
        cache = self.caches[engine_id]
        cache.fill(request_seed(rid), [list(range(cache.layout[0].num_blocks))])

    def cmd_bare_push(self, rid: str) -> float:
        assert self.bare is not None
        return self.bare.push(rid.encode())

    def cmd_bare_expect(self, rid: str) -> None:
        assert self.bare is not None
        self.bare.expect(rid.encode())

    def cmd_bare_wait(self, rid: str) -> None:
        assert self.bare is not None
        self.bare.wait(rid.encode())

    def close(self) -> None:
        if self.bare is not None:
            with contextlib.suppress(Exception):
                self.bare.close()
        for client in (*self.clients.values(), self.client):
            client.close()
        for cache in self.caches.values():
            cache.unlink()


def _connect(
    socket_path: str, client_name: str, descriptors: Sequence[int] = (), wait_s: float = 90.0
) -> Any:
    """Connect once the daemon listens: engines start while their daemons come up."""
    from daemon.client import BlockingEngineClient, ConnectionLost

    deadline = time.monotonic() + wait_s
    while True:
        try:
            return BlockingEngineClient.connect(
                socket_path,
                client_name=client_name,
                timeout=CALL_TIMEOUT_S,
                descriptors=descriptors,
            )
        except ConnectionLost:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def engine_main(
    conn: Connection, name: str, socket_path: str, dram: bool, descriptor: bool
) -> None:
    """An engine process: answer (command, kwargs) from the pipe until "close"."""
    try:
        engine = Engine(name, socket_path, dram, descriptor)
    except Exception as exc:
        conn.send(("err", f"engine {name} did not start: {type(exc).__name__}: {exc}"))
        return
    conn.send(("ok", os.getpid()))
    try:
        while True:
            command, kwargs = conn.recv()
            if command == "close":
                break
            try:
                conn.send(("ok", getattr(engine, f"cmd_{command}")(**kwargs)))
            except Exception as exc:
                detail = "".join(traceback.format_exception_only(exc)).strip()
                conn.send(("err", detail))
    finally:
        engine.close()
        conn.send(("ok", None))


# --------------------------------------------------------------------------
# orchestrator side


class EngineProc:
    """A spawned engine process and its command pipe."""

    def __init__(self, ctx: Any, name: str, socket_path: str, dram: bool, descriptor: bool) -> None:
        self.name = name
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=engine_main, args=(child, name, socket_path, dram, descriptor), daemon=True
        )
        self.proc.start()

    def ready(self) -> None:
        self._reply("start")

    def call(self, command: str, timeout: float = CALL_TIMEOUT_S, **kwargs: Any) -> Any:
        self.conn.send((command, kwargs))
        return self._reply(command, timeout)

    def _reply(self, what: str, timeout: float = CALL_TIMEOUT_S) -> Any:
        if not self.conn.poll(timeout):
            alive = "alive" if self.proc.is_alive() else f"exited {self.proc.exitcode}"
            raise CheckFailed(f"engine {self.name}: no answer to {what} in {timeout} s ({alive})")
        status, value = self.conn.recv()
        if status == "err":
            raise CheckFailed(f"engine {self.name}: {what}: {value}")
        return value

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.call("close", timeout=30)
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()


@dataclass
class Outcome:
    name: str
    ok: bool
    detail: str


@dataclass
class BenchRow:
    path: str
    block_bytes: int
    layout: str
    total: int
    seconds: list[float] = field(default_factory=list)
    verified: int = 0
    runs: int = 0
    error: str = ""

    def cells(self, bare: BenchRow | None) -> str:
        size = f"{self.block_bytes // KIB} KiB" if self.block_bytes < MIB else "1 MiB"
        head = f"| {self.path} | {size} | {self.layout} | {self.total // self.block_bytes:,} |"
        if not self.seconds:
            return head + f" - | - | - | FAILED: {self.error[:80]} |"
        gbps = [self.total / s / 1e9 for s in self.seconds]
        median = statistics.median(self.seconds)
        vs = ""
        if bare is not None and bare.seconds:
            vs = f" ({statistics.median(bare.seconds) / median:.0%} of bare)"
        return (
            head + f" {median * 1e3:.2f} | {self.total / median / 1e9:.1f}{vs}"
            f" | {min(gbps):.1f}-{max(gbps):.1f} | {self.verified}/{self.runs} |"
        )


class Check:
    """Daemons, engines, scenarios and benches; records outcomes instead of stopping early."""

    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        self.args = args
        self.workdir = workdir
        self.outcomes: list[Outcome] = []
        self.rows: list[BenchRow] = []
        self.daemons: list[Any] = []
        self.prefill: EngineProc | None = None
        self.decode: EngineProc | None = None
        self.t0 = time.monotonic()
        # Say where bytes were checked: a DRAM dry run must never read as a GPU result.
        shared = "by descriptor" if args.memory == "descriptor" else "by CUDA IPC handle"
        if args.dram:
            shared = "by descriptor (memfd)" if args.memory == "descriptor" else "by /dev/shm file"
        self.kind = ("DRAM (dry run)" if args.dram else "VRAM") + f" {shared}"
        self.where = "in DRAM, NO GPU" if args.dram else "on the GPU"

    def log(self, message: str) -> None:
        print(f"[{time.monotonic() - self.t0:6.1f}s] {message}", flush=True)

    def record(self, name: str, ok: bool, detail: str) -> bool:
        self.outcomes.append(Outcome(name, ok, detail))
        self.log(f"{'ok  ' if ok else 'FAIL'} {name}: {detail}")
        return ok

    # ---- setup

    def start(self) -> None:
        from daemon.sim.launcher import daemon_pair

        prefill, decode = daemon_pair(self.workdir)
        self.daemons = [prefill, decode]
        for daemon in self.daemons:
            daemon.write_config = _relaxed_ttl(daemon.write_config)
            # Which transport UCX picks for each push, in the daemons' logs.
            daemon.env = {**daemon.env, "UCX_PROTO_INFO": "y"}
            daemon.start(wait=False)
        ctx = multiprocessing.get_context("spawn")
        # Engines import torch and start CUDA while the daemons come up.
        descriptor = self.args.memory == "descriptor"
        self.prefill = EngineProc(ctx, "prefill-engine", prefill.socket, self.args.dram, descriptor)
        self.decode = EngineProc(ctx, "decode-engine", decode.socket, self.args.dram, descriptor)
        for daemon in self.daemons:
            daemon.wait_ready(timeout=90)
        decode.wait_peer("prefill", timeout=60)
        prefill.wait_peer("decode", timeout=60)
        self.prefill.ready()
        self.decode.ready()
        self.log("daemons peered, engine processes up")

    def close(self) -> None:
        for engine in (self.prefill, self.decode):
            if engine is not None:
                engine.close()
        for daemon in self.daemons:
            try:
                rc = daemon.stop(timeout=20)
                if rc != 0:
                    self.record(f"{daemon.node} daemon exit", False, f"exit status {rc}")
            except Exception as exc:
                daemon.kill()
                self.record(f"{daemon.node} daemon exit", False, repr(exc))

    def engines(self) -> tuple[EngineProc, EngineProc]:
        assert self.prefill is not None and self.decode is not None
        return self.prefill, self.decode

    def register_pair(self, tag: str, layout: Sequence[Group]) -> bool:
        """Allocate the same layout in both engines and register both with their daemons."""
        pe, de = self.engines()
        pe.call("alloc", engine_id=f"p-{tag}", layout=layout, seed=1)
        de.call("alloc", engine_id=f"d-{tag}", layout=layout, seed=2)
        try:
            pe.call("register", engine_id=f"p-{tag}")
            de.call("register", engine_id=f"d-{tag}")
        except CheckFailed as exc:
            return self.record(f"register {self.kind} engines {tag}", False, str(exc))
        return self.record(
            f"register {self.kind} engines {tag}", True, "both daemons took the regions"
        )

    # ---- correctness

    def push_batch(
        self, name: str, requests: list[tuple[str, list[list[int]], list[list[int]]]]
    ) -> None:
        """Push (rid, prefill blocks, decode blocks) requests concurrently; verify on the GPU."""
        from daemon.sim.engine import tail_pairs

        pe, de = self.engines()
        layout = sim_layout(CHECK_LAYOUT)
        try:
            for rid, _, dst in requests:
                de.call("receive", engine_id="d-check", rid=rid, blocks=dst, peer="prefill")
            for rid, src, _ in requests:
                pe.call("prefill", engine_id="p-check", rid=rid, blocks=src)
            blocks = 0
            for rid, src, dst in requests:
                de.call("wait", rid=rid, kind="kv_arrived")
                pe.call("wait", rid=rid, kind="blocks_freeable")
                pairs = [
                    ([d for d, _ in group], [s for _, s in group])
                    for group in tail_pairs(layout, src, layout, dst)
                ]
                blocks += de.call("expect", engine_id="d-check", rid=rid, pairs=pairs)
            problems = de.call("verify", engine_id="d-check")
            problems += [f"prefill cache: {p}" for p in pe.call("verify", engine_id="p-check")]
            for rid, _, _ in requests:
                de.call("release", rid=rid)
                pe.call("release", rid=rid)
        except CheckFailed as exc:
            self.record(name, False, str(exc))
            return
        detail = (
            f"{len(requests)} request(s), {blocks} destination layer-blocks verified {self.where},"
            " rest of both caches unchanged"
        )
        self.record(name, not problems, "; ".join(problems) or detail)

    def correctness(self) -> bool:
        if not self.register_pair("check", CHECK_LAYOUT):
            return False
        self.push_batch(
            "no hit",
            [
                (
                    "nohit",
                    [list(range(10, 18)), [3, 4, 5, 6]],
                    [[100, 101, 50, 51, 200, 201, 7, 8], [20, 21, 22, 23]],
                )
            ],
        )
        self.push_batch(
            "partial hit",
            [
                (
                    "partial",
                    [list(range(30, 42)), [40, 41, 42, 43, 44, 45]],
                    [[120, 121, 122, 123, 124], [60, 61]],
                )
            ],
        )
        self.push_batch("full hit", [("fullhit", [list(range(60, 66)), [50, 51]], [[], []])])
        batch = []
        for i in range(8):
            src = [[4 * i + k for k in range(4)], [2 * i, 2 * i + 1]]
            dst0 = [255 - 4 * i - k for k in range(4)][: 4 if i % 2 == 0 else 2]
            batch.append((f"batch{i}", src, [dst0, [63 - 2 * i, 62 - 2 * i]]))
        self.push_batch("8 concurrent (no and partial hits)", batch)
        return True

    # ---- benches

    def bench(self, daemon_ok: bool) -> None:
        total = self.args.total_mib * MIB
        perm_seed = np.random.default_rng(7)
        for block_bytes in BENCH_BLOCKS:
            n = total // block_bytes
            tag = f"bench{block_bytes // KIB}k"
            pe, de = self.engines()
            if daemon_ok:
                registered = self.register_pair(tag, bench_layout(total, block_bytes))
            else:
                pe.call(
                    "alloc", engine_id=f"p-{tag}", layout=bench_layout(total, block_bytes), seed=1
                )
                de.call(
                    "alloc", engine_id=f"d-{tag}", layout=bench_layout(total, block_bytes), seed=2
                )
                registered = False
            for layout in ("contiguous", "scattered"):
                dst = (
                    list(range(n)) if layout == "contiguous" else perm_seed.permutation(n).tolist()
                )
                daemon_row = BenchRow("daemons", block_bytes, layout, total)
                bare_row = BenchRow("bare NIXL", block_bytes, layout, total)
                self.rows += [daemon_row, bare_row]
                if self.over_budget(f"{tag} {layout}", daemon_row, bare_row):
                    continue
                if registered:
                    self._bench_daemons(daemon_row, tag, dst)
                else:
                    daemon_row.error = "engines not registered"
                self._bench_bare(bare_row, tag, block_bytes, dst)

    def over_budget(self, what: str, *rows: BenchRow) -> bool:
        """Skip what is left once the time budget is spent, so the table still prints."""
        if time.monotonic() - self.t0 < self.args.budget_s:
            return False
        for row in rows:
            row.error = "skipped: time budget spent"
        self.record(f"bench {what}", False, f"skipped: over the {self.args.budget_s:.0f} s budget")
        return True

    def _bench_daemons(self, row: BenchRow, tag: str, dst: list[int]) -> None:
        pe, de = self.engines()
        src = list(range(len(dst)))
        for run in range(self.args.runs + 1):  # run 0 warms connections and caches up
            rid = f"{tag}-{row.layout}-{run}"
            try:
                de.call("receive", engine_id=f"d-{tag}", rid=rid, blocks=[dst], peer="prefill")
                pe.call("prefill", engine_id=f"p-{tag}", rid=rid, blocks=[src], kv_ready=False)
                seconds = pe.call("push_timed", rid=rid)
                de.call("wait", rid=rid, kind="kv_arrived")
                self._verify_bench(row, tag, rid, dst, src, run, seconds)
                de.call("release", rid=rid)
                pe.call("release", rid=rid)
            except CheckFailed as exc:
                row.error = str(exc)
                self.record(f"daemon push {tag} {row.layout}", False, str(exc))
                return
        self._bench_outcome(row, tag)

    def _bench_bare(self, row: BenchRow, tag: str, block_bytes: int, dst: list[int]) -> None:
        pe, de = self.engines()
        src = list(range(len(dst)))
        try:
            metadata, remote_base = de.call("bare_register", engine_id=f"d-{tag}")
            pe.call("bare_register", engine_id=f"p-{tag}")
            pe.call(
                "bare_prep",
                engine_id=f"p-{tag}",
                metadata=metadata,
                remote_base=remote_base,
                block_bytes=block_bytes,
                dst=dst,
            )
            for run in range(self.args.runs + 1):
                rid = f"bare-{tag}-{row.layout}-{run}"
                pe.call("bare_fill", engine_id=f"p-{tag}", rid=rid)
                de.call("bare_expect", rid=rid)
                seconds = pe.call("bare_push", rid=rid)
                de.call("bare_wait", rid=rid)
                self._verify_bench(row, tag, rid, dst, src, run, seconds)
        except CheckFailed as exc:
            row.error = str(exc)
            self.record(f"bare NIXL push {tag} {row.layout}", False, str(exc))
            return
        self._bench_outcome(row, tag)

    def _verify_bench(
        self,
        row: BenchRow,
        tag: str,
        rid: str,
        dst: list[int],
        src: list[int],
        run: int,
        seconds: float,
    ) -> None:
        de = self.engines()[1]
        de.call("expect", engine_id=f"d-{tag}", rid=rid, pairs=[(dst, src)])
        problems = de.call("verify", engine_id=f"d-{tag}")
        if run == 0:
            if problems:
                raise CheckFailed(f"warm-up run: {'; '.join(problems)}")
            return
        row.runs += 1
        row.verified += not problems
        row.seconds.append(seconds)
        if problems:
            self.log(f"FAIL {row.path} {tag} {row.layout} run {run}: {'; '.join(problems)}")

    def _bench_outcome(self, row: BenchRow, tag: str) -> None:
        ok = row.verified == row.runs
        detail = f"{row.verified}/{row.runs} runs verified {self.where}"
        self.record(f"{row.path} push {tag} {row.layout}", ok, detail)

    # ---- report

    def table(self) -> str:
        lines = [
            "| path | block | destination | descriptors | median ms | GB/s (median) |"
            " GB/s (min-max) | runs verified |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for i in range(0, len(self.rows), 2):
            daemon_row, bare_row = self.rows[i], self.rows[i + 1]
            lines += [daemon_row.cells(bare_row), bare_row.cells(None)]
        return "\n".join(lines)

    def transports(self) -> str:
        """The UCX protocols of the daemons' writes (UCX_PROTO_INFO tables in their logs).

        Only the "remote memory write" tables (what a push is), each with its
        rows of size ranges and transports: ``cuda_ipc`` is the fast path
        between two processes on one GPU, ``tcp`` there is the emulation.
        """
        row = re.compile(r"\|\s*[\d.]+(?:\.\.\S+)?\s*\|")
        shown: list[str] = []
        for daemon in self.daemons:
            with contextlib.suppress(OSError):
                in_write = False
                for line in daemon.logs().splitlines():
                    with contextlib.suppress(ValueError, KeyError, TypeError):
                        line = json.loads(line)["event"]
                    text = line.split("]", 2)[-1].strip()  # no UCX timestamp, host, pid
                    if "remote memory write" in text:
                        in_write = True
                    elif " cfg#" in text or "active message" in text or "memory read" in text:
                        in_write = False
                        continue
                    elif not (in_write and row.search(text)):
                        continue
                    if f"{daemon.node}: {text}" not in shown:
                        shown.append(f"{daemon.node}: {text}")
        listed = "\n".join(shown[:60]) or "(no UCX_PROTO_INFO write table in the daemons' logs)"
        return f"UCX protocols of the daemons' writes (UCX_PROTO_INFO=y):\n{listed}"

    def dump_logs(self, failed: bool) -> None:
        for daemon in self.daemons:
            if self.args.logs:
                with contextlib.suppress(OSError):
                    shutil.copy(daemon.log_path, Path(self.args.logs) / f"{daemon.node}.log")
            if failed:
                tail = daemon.logs().splitlines()[-25:]
                print(f"--- last lines of the {daemon.node} daemon's log", *tail, sep="\n")


def _relaxed_ttl(write_config: Callable[[], Path]) -> Callable[[], Path]:
    """The test config with a longer peer TTL: a GPU check is no liveness test.

    The first VRAM registration starts CUDA in the daemon (seconds); it runs
    off the event loop, but a loaded machine should not turn into a peer-death
    test here.
    """

    def write() -> Path:
        path = write_config()
        path.write_text(path.read_text().replace("peer_ttl_s = 3.0", "peer_ttl_s = 15.0"))
        return path

    return write


def preflight(dram: bool) -> str | None:
    """Why this machine cannot run the check, or None."""
    try:
        import torch
    except ImportError as exc:
        return f"torch is not importable ({exc})"
    if not dram and (not torch.cuda.is_available() or torch.cuda.device_count() < 1):
        return (
            f"no CUDA GPU visible to torch {torch.__version__} (built for CUDA"
            f" {torch.version.cuda}); this check needs one GPU"
        )
    for module in ("nixl", "msgspec", "structlog", "crc32c", "prometheus_client", "uvloop"):
        try:
            importlib.import_module(module)
        except ImportError as exc:
            return f"{module} is missing ({exc}); fetch the wheels with bench/gpu_wheels.sh"
    return None


def describe(dram: bool) -> str:
    import nixl
    import torch

    if dram:
        where = "DRAM DRY RUN of the harness: caches in /dev/shm, no GPU involved"
    else:
        props = torch.cuda.get_device_properties(0)
        where = f"GPU {props.name} ({props.total_memory / 2**30:.0f} GiB)"
    return (
        f"{where}, torch {torch.__version__},"
        f" CUDA {torch.version.cuda}, NIXL via {getattr(nixl, '_pkg', nixl).__name__},"
        f" UCX_TLS={os.environ.get('UCX_TLS', '(default)')}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--total-mib", type=int, default=1024)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--logs", default=None, help="copy the daemons' logs here")
    parser.add_argument(
        "--budget-s", type=float, default=200.0, help="start no bench config after this"
    )
    parser.add_argument(
        "--memory",
        choices=("descriptor", "ipc"),
        default="descriptor",
        help="how engines share their caches: cuMem descriptors (memfds with --dram), "
        "or legacy CUDA IPC handles (/dev/shm files with --dram)",
    )
    parser.add_argument(
        "--dram",
        action="store_true",
        help="dry-run this harness without a GPU (caches in /dev/shm); proves nothing about VRAM",
    )
    args = parser.parse_args(argv)
    reason = preflight(args.dram)
    if reason is not None:
        print(f"gpu_check: cannot run: {reason}", file=sys.stderr, flush=True)
        return 2
    print(f"gpu_check: {describe(args.dram)}", flush=True)
    workdir = Path(tempfile.mkdtemp(prefix="kvpushd-gpu-check-"))
    check = Check(args, workdir)
    try:
        check.start()
        daemon_ok = check.correctness()
        check.bench(daemon_ok)
    except Exception as exc:
        check.record("run", False, "".join(traceback.format_exception_only(exc)).strip())
    finally:
        check.close()
    failed = not check.outcomes or not all(o.ok for o in check.outcomes)
    check.dump_logs(failed)
    transports = check.transports()  # read from the daemons' logs, before they go
    shutil.rmtree(workdir, ignore_errors=True)
    print(summary(check, args), flush=True)
    print(check.table(), flush=True)
    print(transports, flush=True)
    return 1 if failed else 0


def summary(check: Check, args: argparse.Namespace) -> str:
    failed = [o.name for o in check.outcomes if not o.ok]
    mode = ("DRAM dry run, NO GPU" if args.dram else "VRAM") + f", memory by {args.memory}"
    verdict = "PASSED" if check.outcomes and not failed else "FAILED " + ", ".join(failed)
    passed = len(check.outcomes) - len(failed)
    return (
        f"\ngpu_check ({mode}): {passed}/{len(check.outcomes)} checks passed: {verdict}\n"
        f"{args.total_mib} MiB per push ({mode}), median of {args.runs} runs after a warm-up;"
        " daemons: kv_ready -> BlocksFreeable, bare NIXL: make_prepped_xfer -> DONE\n"
    )


if __name__ == "__main__":
    sys.exit(main())
