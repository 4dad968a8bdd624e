"""The pure side of end-to-end integrity (statemachine/integrity.py): which
requests are checked, and which blocks a comparison of digests names."""

from __future__ import annotations

import struct

import pytest

from schemas.config import VerifyMode
from statemachine.integrity import MAX_LISTED, digest_count, digests_fit, mismatches, sampled


def _pack(*values: int) -> bytes:
    return struct.pack(f"<{len(values)}I", *values)


def test_off_checks_nothing_and_all_checks_everything():
    ids = [f"req-{i}" for i in range(500)]
    assert not any(sampled(i, VerifyMode.OFF, 1.0) for i in ids)
    assert all(sampled(i, VerifyMode.ALL, 0.0) for i in ids)


def test_sampling_is_a_function_of_the_id_at_about_the_rate():
    ids = [f"req-{i}" for i in range(20_000)]
    chosen = [i for i in ids if sampled(i, VerifyMode.SAMPLE, 0.01)]
    # The same answer every time (both daemons compute it apart).
    assert chosen == [i for i in ids if sampled(i, VerifyMode.SAMPLE, 0.01)]
    assert 100 <= len(chosen) <= 300  # 1 % of 20 000 is 200
    assert not any(sampled(i, VerifyMode.SAMPLE, 0.0) for i in ids)
    assert all(sampled(i, VerifyMode.SAMPLE, 1.0) for i in ids)
    # A higher rate keeps every id a lower one chose.
    assert set(chosen) <= {i for i in ids if sampled(i, VerifyMode.SAMPLE, 0.05)}


DST = ((7, 8, 9), (40,))
LAYERS = (2, 3)  # group 0: 2 layers x 3 blocks; group 1: 3 layers x 1 block


def test_digests_are_laid_out_group_layer_block():
    assert digest_count(DST, LAYERS) == 9
    expected = _pack(*range(9))
    assert mismatches(expected, expected, DST, LAYERS) == []
    # Index 4 is group 0, layer 1, the second block (8); index 7 is group 1, layer 1.
    actual = _pack(0, 1, 2, 3, 99, 5, 6, 98, 8)
    assert mismatches(expected, actual, DST, LAYERS) == [(0, 1, 8), (1, 1, 40)]


@pytest.mark.parametrize("short", ["expected", "actual"])
def test_digests_of_the_wrong_length_mismatch_everywhere(short):
    good, cut = _pack(*range(9)), _pack(*range(8))
    expected, actual = (cut, good) if short == "expected" else (good, cut)
    assert len(mismatches(expected, actual, DST, LAYERS)) == 9


def test_the_listed_bound_is_small():
    assert 0 < MAX_LISTED <= 256


def test_checksums_too_large_for_one_peer_frame_do_not_fit():
    # 9 digests of 4 bytes and 4 block ids: well inside 4 MiB.
    assert digests_fit(DST, LAYERS, 4 * 1024 * 1024)
    many = (tuple(range(100_000)),)
    # 100 000 blocks x 12 layers: 4.8 MB of digests and the ids: not in 4 MiB.
    assert not digests_fit(many, (12,), 4 * 1024 * 1024)
    assert digests_fit(many, (12,), 8 * 1024 * 1024)
