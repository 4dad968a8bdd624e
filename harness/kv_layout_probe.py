"""Where vLLM's CPU attention writes a token's keys and values inside a block (a measurement).

Run in .venv-vllm: ``.venv-vllm/bin/python -m harness.kv_layout_probe``.
It writes keys and values whose every element names its (token, channel)
through vLLM's own cache-write op (``cpu_attn_reshape_and_cache``, the op
the CPU backend calls), into a cache shaped as the backend allocates it
(``[blocks, kv_heads, block_size, 2 * head_size]``), and prints, per block
size, which element of the block each (token, channel) landed at, and
whether the first half of a block's tokens is one run of bytes per head
(what pairing two instances of different block sizes would need:
docs/block-sizes-on-vllm-cpu.md).
"""

from __future__ import annotations

import argparse

import torch


def landing(block_size: int, head_size: int, dtype: torch.dtype) -> tuple[str, dict, dict]:
    """The kernel family, and where each (token, channel) of K and of V landed in one block."""
    import vllm._custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    isa = _get_attn_isa(dtype, block_size, head_size)
    cache = torch.zeros(2, 1, block_size, 2 * head_size, dtype=dtype)
    keys, values = cache.view(2, 1, 2 * block_size, head_size).chunk(2, dim=2)
    # Element value 1 + token * head_size + channel.
    marks = torch.arange(block_size * head_size, dtype=torch.float32) + 1
    written = marks.view(block_size, 1, head_size).to(dtype)
    slots = torch.arange(block_size, 2 * block_size)  # block 1
    ops.cpu_attn_reshape_and_cache(written, written.clone(), keys, values, slots, isa)
    half = block_size * head_size
    flat = cache[1, 0].float().flatten().tolist()
    k = {int(x) - 1: i for i, x in enumerate(flat[:half]) if x > 0}
    v = {int(x) - 1: i for i, x in enumerate(flat[half:]) if x > 0}
    return isa, k, v


def first_half_is_one_run(where: dict[int, int], block_size: int, head_size: int) -> bool:
    """Whether tokens 0 .. block_size / 2 - 1 fill one contiguous run, in token order."""
    half = block_size // 2
    offsets = [where[t * head_size + c] for t in range(half) for c in range(head_size)]
    return offsets == list(range(min(offsets), min(offsets) + half * head_size))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block-sizes", default="32,64")
    parser.add_argument("--head-size", type=int, default=64)
    args = parser.parse_args(argv)
    # float32 only: each element names its (token, channel), exact up to 2**24.
    dtype = torch.float32
    hs = args.head_size
    print(f"AMX: {torch.cpu._is_amx_tile_supported()}, AVX-512: {torch.cpu._is_avx512_supported()}")
    for block_size in (int(b) for b in args.block_sizes.split(",")):
        isa, k, v = landing(block_size, hs, dtype)
        probe = [(t, c) for t in (0, 1) for c in (0, 1, 16)]
        print(f"block {block_size} (float32, head {hs}): kernels {isa!r}")
        for name, where in (("keys", k), ("values", v)):
            at = ", ".join(f"t{t}c{c}->{where[t * hs + c]}" for t, c in probe)
            one = first_half_is_one_run(where, block_size, hs)
            print(f"  {name}: {at}; first {block_size // 2} tokens one run: {one}")


if __name__ == "__main__":
    main()
