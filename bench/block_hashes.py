"""What naming every block by its content hash costs: before (one prompt digest) and after.

Before (protocol 3): each side hashed its whole prompt once
(``client.vllm.layout.prompt_digest``, BLAKE2b-128) and the core compared two
strings. After (protocol 4): each side hashes every prompt block with vLLM's
own chained block hash (``client.vllm.hashes.block_hashes``: ``hash_block_tokens``
with SHA-256 over CBOR, and ``generate_block_hash_extra_keys``) and encodes
them (``client.vllm.hashes.content``), in vLLM's scheduler; the prefill daemon's
core decodes both sides' hashes and checks the tail-trim pairing
(``statemachine.content.check_pairing``). Real ``vllm.v1.request.Request``
objects; needs the vLLM environment::

    .venv-vllm/bin/python -m bench.block_hashes
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

from bench.results import load_average, machine, write_section
from daemon.client.vllm.hashes import block_hashes, content, prompt_block_count
from daemon.client.vllm.layout import prompt_digest
from statemachine.content import check_pairing

CASES = ((256, 16), (2048, 16), (2048, 32), (16384, 32))


def _best_us(fn: Callable[[], object], repeat: int) -> float:
    """The median of ``repeat`` timed calls, in microseconds."""
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e6


def measure(tokens: int, block: int, repeat: int) -> tuple[float, float, float, int]:
    """(before, hashing on one side, the core's check) in us for one prompt, and its blocks."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    prompt = [random.Random(tokens).randrange(2, 50_000) for _ in range(tokens)]
    request = Request("r", prompt, SamplingParams(max_tokens=1), None)
    count = prompt_block_count(tokens, block)
    named = ((0, tuple(range(count))),)
    before = _best_us(lambda: prompt_digest(prompt), repeat)
    side = _best_us(lambda: content(named, block_hashes(request, block, count)), repeat)
    prefill = content(named, block_hashes(request, block, count))
    hit = count // 2  # a decode prefix hit of half the prompt
    decode = content(((hit, tuple(range(hit, count))),), block_hashes(request, block, count))
    check = _best_us(lambda: check_pairing("r", prefill, decode), repeat)
    return before, side, check, count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args()
    rows = [
        "| prompt tokens | block size | blocks | before: prompt digest, one side (us) "
        "| after: block hashes, one side (us) | after, per block (us) "
        "| core's pairing check (us) | per block (us) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for tokens, block in CASES:
        before, side, check, count = measure(tokens, block, args.repeat)
        rows.append(
            f"| {tokens} | {block} | {count} | {before:.1f} | {side:.0f} | {side / count:.2f} "
            f"| {check:.0f} | {check / count:.2f} |"
        )
    body = "\n".join(rows)
    print(body)
    if not args.no_record:
        context = (
            f"{machine()}; load {load_average()}; median of {args.repeat} runs per cell. "
            "Both sides hash (the prefill in `request_finished`, the decode in "
            "`update_state_after_alloc`, on vLLM's scheduler thread); the check runs in the "
            "prefill daemon's core at the pairing, with a decode prefix hit of half the blocks. "
            "`python -m bench.block_hashes` in `.venv-vllm`."
        )
        write_section("Block hashes: what naming every block costs", context, body)


if __name__ == "__main__":
    main()
