"""Host staging's block copies, timed: vLLM-shaped KV cache <-> the /dev/shm mirror.

The copies ``KvpushdConnector`` makes with ``kv_buffer = "host"``
(daemon/client/vllm/staging.py): a prefill step's finished requests,
cache -> mirror (``out``), and a decode step's landed loads, mirror ->
cache (``in``), each one batched call. The cache is laid out as vLLM lays
it: on a GPU FlashAttention's ``[2, blocks, block_size, heads, head_dim]``
per layer (its keys and values become two block-major layers), on a CPU the
CPU attention's ``[blocks, heads, block_size, 2 * head_dim]``. On a GPU the
mirror is pinned and the copy runs on the staging's side stream; the time is
until its event completed.

Two block placements: ``contiguous`` (each request's blocks consecutive, as
a fresh block pool hands them out: one copy per layer and request) and
``scattered`` (ids drawn at random: a copy per block, the worst case). Each
placement is moved both ways the staging knows (``--copies``): ``runs``, a
copy per run of consecutive ids, and ``gather``, one ``index_select`` and
``index_copy_`` per layer (on a GPU through the pinned mirror's device
mapping); ``auto`` picks per step.
Every round checks the bytes: the mirror's blocks equal the cache's after
``out``, and the cache's blocks, zeroed, equal the mirror's after ``in``.

    python -m bench.staging_copy                 # cuda when torch sees a GPU, else cpu
    python -m bench.staging_copy --device cpu --no-record

bench/gpu_check.sh runs it on a GPU machine; on this CPU machine it gives
what a CPU build's staging costs (``make bench``).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.results import load_average, machine, write_section
from daemon.client.vllm.sharedmemory import FILE, SharedMemory
from daemon.client.vllm.staging import AUTO, GATHER, RUNS, Staging, block_major

TITLE = "Host staging's block copies (bench/staging_copy.py)"
Step = list[tuple[tuple[int, ...]]]  # one step's requests, each one group's block ids


def vllm_cache(
    device: str, layers: int, blocks: int, block_size: int, heads: int, head_dim: int
) -> dict[str, torch.Tensor]:
    """A KV cache shaped as vLLM's attention backend on ``device`` lays it out, random bytes."""
    shape = (
        (2, blocks, block_size, heads, head_dim)  # FlashAttention
        if device == "cuda"
        else (blocks, heads, block_size, 2 * head_dim)  # vLLM's CPU attention
    )
    generator = torch.Generator(device=device).manual_seed(0)
    return {
        f"model.layers.{i}.self_attn.attn": torch.randn(
            shape, dtype=torch.bfloat16, device=device, generator=generator
        )
        for i in range(layers)
    }


def step_blocks(
    rng: random.Random, blocks: int, requests: int, per_request: int, scattered: bool
) -> Step:
    """One step's requests, each one group's block ids."""
    if scattered:
        ids = rng.sample(range(1, blocks), requests * per_request)
    else:
        start = rng.randrange(1, blocks - requests * per_request)
        ids = list(range(start, start + requests * per_request))
    return [(tuple(ids[r * per_request : (r + 1) * per_request]),) for r in range(requests)]


def timed(staging: Staging, direction: str, step: Step, device: str) -> tuple[int, float]:
    if device == "cuda":
        torch.cuda.synchronize()  # time the copy alone, not a queued forward
    began = time.perf_counter()
    copy = staging.copy_out(step) if direction == "out" else staging.copy_in(step)
    copy.wait()
    return copy.nbytes, time.perf_counter() - began


def check(staging: Staging, step: Step, direction: str) -> None:
    ids = torch.tensor([b for (blocks,) in step for b in blocks])
    for name, cache in staging.cache.items():
        mirrored = staging.mirror[name][ids]
        if not torch.equal(cache[ids.to(cache.device)].cpu(), mirrored):
            raise SystemExit(f"staging_copy: {direction}: layer {name}'s blocks differ")


Row = tuple[str, str, str, float, float, int]  # placement, copies, direction, GB/s...


def run(args: argparse.Namespace) -> list[Row]:
    cache = vllm_cache(
        args.device, args.layers, args.blocks, args.block_size, args.heads, args.head_dim
    )
    views, parts = block_major(cache, args.blocks)
    groups = [[part for name in cache for part in parts[name]]]
    directory = Path(tempfile.mkdtemp(prefix="kvpushd-staging-", dir="/dev/shm"))
    rows: list[Row] = []
    try:
        for copies in args.copies:
            rows += _run_copies(args, views, groups, directory / "mirror", copies)
    finally:
        directory.rmdir()
    return rows


def _run_copies(
    args: argparse.Namespace,
    views: dict[str, torch.Tensor],
    groups: list[list[str]],
    path: Path,
    copies: str,
) -> list[Row]:
    memory = SharedMemory(FILE, path)
    staging = Staging.create(views, groups, memory, copies=copies)
    rng = random.Random(1)
    rows: list[Row] = []
    # Map every mirror page once, as a serving instance's first steps do:
    # the timed steps measure copies, not first-touch page faults.
    staging.copy_out([(tuple(range(args.blocks)),)]).wait()
    try:
        for placement in ("contiguous", "scattered"):
            for direction in ("out", "in"):
                rates, nbytes = [], 0
                for _ in range(args.rounds):
                    step = step_blocks(
                        rng, args.blocks, args.requests, args.per_request, placement == "scattered"
                    )
                    if direction == "in":
                        staging.copy_out(step).wait()  # the mirror holds what lands
                        for tensor in views.values():
                            tensor[[b for (blocks,) in step for b in blocks]] = 0
                    nbytes, seconds = timed(staging, direction, step, args.device)
                    check(staging, step, direction)
                    rates.append(nbytes / seconds)
                rows.append(
                    (
                        placement,
                        copies,
                        direction,
                        statistics.median(rates) / 1e9,
                        min(rates) / 1e9,
                        nbytes,
                    )
                )
                print(
                    f"{placement:10} {copies:6} {direction:3} {rows[-1][3]:7.2f} GB/s median "
                    f"(min {rows[-1][4]:.2f}) {nbytes} B per step",
                    file=sys.stderr,
                )
    finally:
        staging.close()
        memory.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--blocks", type=int, default=1024, help="blocks per layer")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--heads", type=int, default=8, help="KV heads")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--requests", type=int, default=4, help="requests per step")
    parser.add_argument("--per-request", type=int, default=32, help="blocks per request")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument(
        "--copies",
        type=lambda text: text.split(","),
        default=[RUNS, GATHER],
        help=f"comma-separated: {RUNS}, {GATHER}, {AUTO} (default {RUNS},{GATHER})",
    )
    parser.add_argument("--no-record", action="store_true", help="do not write RESULTS.md")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no GPU")
    if not set(args.copies) <= {RUNS, GATHER, AUTO}:
        parser.error(f"--copies: {RUNS}, {GATHER} or {AUTO}, comma-separated")
    rows = run(args)
    if args.no_record:
        return 0
    per_block = 2 * args.block_size * args.heads * args.head_dim * 2
    context = (
        f"{machine()}; load {load_average()}. Device {args.device}"
        + (f" ({torch.cuda.get_device_name()})" if args.device == "cuda" else "")
        + f". {args.layers} layers of {args.blocks} blocks, {per_block} bytes per block and "
        f"layer (block size {args.block_size}, {args.heads} KV heads x {args.head_dim}, bf16); "
        f"a step is {args.requests} requests of {args.per_request} blocks; median and slowest "
        f"of {args.rounds} steps, each checked byte for byte. `python -m bench.staging_copy`."
    )
    head = (
        "| blocks | copies | direction | GB/s median | GB/s min | bytes per step |\n"
        "|---|---|---|---|---|---|\n"
    )
    body = "".join(
        f"| {placement} | {copies} | {'cache -> mirror' if d == 'out' else 'mirror -> cache'} "
        f"| {median:.2f} | {low:.2f} | {nbytes} |\n"
        for placement, copies, d, median, low, nbytes in rows
    )
    title = TITLE if args.device == "cpu" else f"{TITLE}, {args.device}"
    write_section(title, context, head + body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
