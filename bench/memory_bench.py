"""KV memory passed by descriptor (a sealed memfd) against a named /dev/shm file, interleaved.

Both are shmem pages the daemon maps and registers with NIXL; what differs
is how the memory is made and handed over. Each round runs both modes, one
right after the other (the order alternates between rounds), through the
same two daemons (``kvpushd run`` processes, started once), with engines
that are raw clients made fresh for each mode and round:

1. make: the engine makes its memory (``create_kv_memfd`` against
   ``create_kv_file``, every page allocated up front), per engine;
2. attach: connect and ``register_engine`` (the descriptor travels with the
   Hello; the daemon opens, checks, maps and registers the memory with
   NIXL), per engine;
3. push: a whole-cache push (every block of every layer) from the prefill
   engine to the decode engine, timed from ``kv_ready`` until KvArrived and
   BlocksFreeable, median of ``--runs`` after one warm-up; every byte of the
   last run compared.

The table gives each figure's median and min-max over the rounds, and the
descriptor/file ratio of the medians per round.

    .venv/bin/python -m bench.memory_bench [--rounds 5] [--runs 3] [--no-record]
    .venv/bin/python -m bench.memory_bench --quick   # smoke run, never recorded
"""

from __future__ import annotations

import argparse
import asyncio
import mmap
import os
import statistics
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.results import load_average, machine, spread, write_section
from daemon.client import EngineClient, create_kv_memfd
from daemon.client.kvfile import create_kv_file
from daemon.sim.launcher import Daemon, start_pair
from schemas import rpc
from schemas.kvlayout import GroupSpec, LayerSpec, RegionSpec
from schemas.layout import GroupKind, Role

MIB = 1 << 20
LAYERS = 2
MODES = ("descriptor", "file")


@dataclass(frozen=True)
class Settings:
    rounds: int = 5
    runs: int = 3
    block_bytes: int = MIB
    blocks: int = 128  # per layer: 2 layers x 128 x 1 MiB = 256 MiB a cache


QUICK = Settings(rounds=2, runs=1, blocks=16)


class Engine:
    """One engine's cache (made in one mode) and its connection."""

    def __init__(self, name: str, mode: str, s: Settings) -> None:
        self.name, self.mode, self.s = name, mode, s
        self.size = LAYERS * s.blocks * s.block_bytes
        self.path = Path(f"/dev/shm/kvpushd-bench-{name}")
        started = time.perf_counter()
        if mode == "descriptor":
            self.fd = create_kv_memfd(f"kvpushd-bench-{name}", self.size)
        else:
            self.fd = create_kv_file(self.path, self.size)
        self.made_s = time.perf_counter() - started
        self._map = mmap.mmap(self.fd, self.size)
        self.kv = np.frombuffer(self._map, dtype=np.uint8)
        self.client: EngineClient | None = None
        self.attach_s = 0.0

    def region(self) -> RegionSpec:
        if self.mode == "descriptor":
            return RegionSpec("kv", self.size, descriptor=0)
        return RegionSpec("kv", self.size, path=str(self.path))

    async def attach(self, socket: str) -> None:
        s = self.s
        layer_bytes = s.blocks * s.block_bytes
        layers = tuple(LayerSpec("kv", layer * layer_bytes) for layer in range(LAYERS))
        groups = (GroupSpec(GroupKind.ATTENTION, s.blocks, s.block_bytes, layers),)
        fds = (self.fd,) if self.mode == "descriptor" else ()
        started = time.perf_counter()
        self.client = await EngineClient.connect(socket, descriptors=fds)
        await self.client.register_engine(self.name, groups, (self.region(),))
        self.attach_s = time.perf_counter() - started

    async def wait(self, request_id: str, kind: type) -> None:
        assert self.client is not None
        while True:
            event = await self.client.next_event(timeout=60)
            if isinstance(event, rpc.RequestFailed):
                raise RuntimeError(f"{request_id} failed: {event.reason}: {event.message}")
            if isinstance(event, kind) and event.request_id == request_id:
                return

    async def release(self, request_id: str) -> None:
        assert self.client is not None
        if isinstance(await self.client.release(request_id), rpc.Deferred):
            await self.wait(request_id, rpc.Released)

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()
        del self.kv
        self._map.close()
        os.close(self.fd)
        self.path.unlink(missing_ok=True)


async def push(prefill: Engine, decode: Engine, peer: str) -> float:
    """One whole-cache push; seconds from kv_ready to both events."""
    assert prefill.client is not None and decode.client is not None
    request_id = f"bench-{uuid.uuid4().hex[:8]}"
    blocks = [list(range(prefill.s.blocks))]
    await decode.client.register_request(decode.name, request_id, Role.RECEIVER, blocks, peer=peer)
    await prefill.client.register_request(prefill.name, request_id, Role.PUSHER, blocks)
    started = time.perf_counter()
    await prefill.client.kv_ready(request_id)
    await asyncio.gather(
        decode.wait(request_id, rpc.KvArrived), prefill.wait(request_id, rpc.BlocksFreeable)
    )
    elapsed = time.perf_counter() - started
    await decode.release(request_id)
    await prefill.release(request_id)
    return elapsed


async def one_mode(mode: str, pair: tuple[Daemon, Daemon], s: Settings) -> dict[str, float]:
    prefill_daemon, decode_daemon = pair
    tag = uuid.uuid4().hex[:6]
    prefill = Engine(f"p-{mode}-{tag}", mode, s)
    decode = Engine(f"d-{mode}-{tag}", mode, s)
    try:
        prefill.kv[:] = np.random.default_rng(1).integers(0, 256, prefill.size, dtype=np.uint8)
        await prefill.attach(prefill_daemon.socket)
        await decode.attach(decode_daemon.socket)
        await push(prefill, decode, prefill_daemon.node)  # warm-up: first touch, windows
        decode.kv[:] = 0
        times = [await push(prefill, decode, prefill_daemon.node) for _ in range(s.runs)]
        if not np.array_equal(prefill.kv, decode.kv):
            raise AssertionError(f"{mode}: the decode's cache differs from the prefill's")
        return {
            "make": (prefill.made_s + decode.made_s) / 2,
            "attach": (prefill.attach_s + decode.attach_s) / 2,
            "push": prefill.size / statistics.median(times) / 1e9,
        }
    finally:
        await prefill.close()
        await decode.close()


async def interleaved(s: Settings, workdir: Path) -> dict[str, list[dict[str, float]]]:
    rounds: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    pair = start_pair(workdir)
    try:
        for i in range(s.rounds):
            order = MODES if i % 2 == 0 else MODES[::-1]
            for mode in order:
                rounds[mode].append(await one_mode(mode, pair, s))
            d, f = rounds["descriptor"][-1], rounds["file"][-1]
            print(
                f"round {i + 1}: push GB/s descriptor {d['push']:.2f} file {f['push']:.2f}; "
                f"attach ms {d['attach'] * 1e3:.1f} / {f['attach'] * 1e3:.1f}; "
                f"make ms {d['make'] * 1e3:.1f} / {f['make'] * 1e3:.1f}",
                flush=True,
            )
    finally:
        for daemon in pair:
            daemon.stop()
    return rounds


def table(s: Settings, rounds: dict[str, list[dict[str, float]]]) -> str:
    mib = LAYERS * s.blocks * s.block_bytes // MIB

    def col(mode: str, key: str) -> list[float]:
        return [r[key] for r in rounds[mode]]

    def ratio(key: str) -> list[float]:
        return [d / f for d, f in zip(col("descriptor", key), col("file", key), strict=True)]

    ms = "{:.1f}".format

    def in_ms(x: float) -> str:
        return ms(x * 1e3)

    push = f"push, the whole {mib} MiB cache, {s.block_bytes // MIB} MiB blocks, GB/s"
    rows = [
        ("make the engine's memory (every page allocated), ms", "make", in_ms),
        ("attach: connect + register_engine (map, NIXL registration), ms", "attach", in_ms),
        (push, "push", "{:.2f}".format),
    ]
    lines = [
        "| per engine or push | descriptor (memfd) | file (/dev/shm) | descriptor / file |",
        "|---|---|---|---|",
    ]
    for label, key, fmt in rows:
        lines.append(
            f"| {label} | {spread(col('descriptor', key), fmt)} "
            f"| {spread(col('file', key), fmt)} | {spread(ratio(key), '{:.2f}'.format)} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short smoke run (never recorded)")
    parser.add_argument("--rounds", type=int, help=f"rounds (default {Settings.rounds})")
    parser.add_argument("--runs", type=int, help=f"timed pushes per mode (default {Settings.runs})")
    parser.add_argument("--no-record", action="store_true", help="do not update bench/RESULTS.md")
    args = parser.parse_args(argv)
    s = QUICK if args.quick else Settings()
    changes: dict[str, Any] = {}
    if args.rounds:
        changes["rounds"] = args.rounds
    if args.runs:
        changes["runs"] = args.runs
    s = Settings(**{**s.__dict__, **changes})
    with tempfile.TemporaryDirectory(prefix="kvpushd-memory-bench-") as workdir:
        rounds = asyncio.run(interleaved(s, Path(workdir)))
    body = table(s, rounds)
    print(body)
    if not args.quick and not args.no_record:
        write_section(
            "KV memory by descriptor against a /dev/shm file",
            f"`python -m bench.memory_bench --rounds {s.rounds} --runs {s.runs}`, {machine()}, "
            f"load {load_average()}; median (min-max) over rounds, modes interleaved",
            body,
        )


if __name__ == "__main__":
    main()
