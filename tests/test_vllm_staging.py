"""Host staging's mirror and its batched block copies, on CPU tensors shaped like vLLM's.

daemon/client/vllm/staging.py never imports vLLM, so its rules are pinned
here without it: the mirror holds each storage vLLM's layers view at the
same offsets (so a block id names the same block in both), copies move
exactly the blocks asked for in both directions, and the modes are chosen
and refused by where the cache lives. tests_vllm/ proves the same on a
real vLLM (test_pd_kvpushd.py stages on both sides, test_pd_hybrid.py on
the decode side, with a lost copy as the negative control).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from daemon.client.vllm.sharedmemory import DESCRIPTOR, FILE, SharedMemory
from daemon.client.vllm.staging import (
    AUTO,
    GATHER,
    HOST,
    RUNS,
    SHARED,
    Staging,
    StagingError,
    block_major,
    kv_buffer,
    runs,
)

BLOCKS, HEADS, BLOCK_SIZE, WIDTH = 12, 2, 4, 8


def _cache(hybrid: bool = False) -> dict[str, torch.Tensor]:
    """Two layers viewing one flat int8 allocation, as vLLM's CPU worker lays them out."""
    per_layer = BLOCKS * HEADS * BLOCK_SIZE * WIDTH
    flat = torch.zeros(per_layer * (1 if hybrid else 2), dtype=torch.float32)
    shape = (BLOCKS, HEADS, BLOCK_SIZE, WIDTH)
    first = flat[:per_layer].view(shape)
    second = first if hybrid else flat[per_layer:].view(shape)
    torch.manual_seed(0)
    flat.copy_(torch.randn_like(flat))
    return {"model.layers.0.attn": first, "model.layers.1.attn": second}


@pytest.fixture
def make_staging(tmp_path: Path):
    """Stagings made in the test (mirrors in memfds, as by default), closed after it."""
    made: list[tuple[Staging, SharedMemory]] = []

    def make(cache: dict[str, torch.Tensor], groups, copies: str = AUTO) -> Staging:
        memory = SharedMemory(DESCRIPTOR, tmp_path / f"mirror-{len(made)}")
        s = Staging.create(cache, groups, memory, copies=copies)
        made.append((s, memory))
        return s

    yield make
    for s, memory in made:
        s.close()
        memory.close()


@pytest.fixture(params=[RUNS, GATHER])
def staging(make_staging, request: pytest.FixtureRequest):
    """Both ways of moving a step's blocks: a copy per run, and a gather per layer."""
    return lambda cache, groups: make_staging(cache, groups, request.param)


def test_the_mirror_lays_each_layer_at_its_offset_in_the_cache(staging) -> None:
    cache = _cache()
    s = staging(cache, [list(cache)])
    base = s.buffer.data_ptr()
    cache_base = cache["model.layers.0.attn"].untyped_storage().data_ptr()
    for name, tensor in cache.items():
        view = s.mirror[name]
        assert (view.shape, view.stride(), view.dtype) == (
            tensor.shape,
            tensor.stride(),
            tensor.dtype,
        )
        assert view.data_ptr() - base == tensor.data_ptr() - cache_base
    assert s.buffer.numel() >= cache["model.layers.1.attn"].untyped_storage().nbytes()
    assert not s.buffer.any()  # a new mirror holds nothing until a copy


def test_copy_out_moves_exactly_the_blocks_asked_for(staging) -> None:
    cache = _cache()
    s = staging(cache, [list(cache)])
    assert s.copy_out([((3, 4, 9),), ((5,),)]).done()
    for name, tensor in cache.items():
        moved = [b for b in range(BLOCKS) if s.mirror[name][b].any()]
        assert moved == [3, 4, 5, 9], name
        assert torch.equal(s.mirror[name][[3, 4, 5, 9]], tensor[[3, 4, 5, 9]])


def test_layers_of_separate_allocations_each_get_their_own_place_in_the_mirror(
    staging,
) -> None:
    """A GPU backend allocates each layer apart: one storage per layer, one mirror place each."""
    torch.manual_seed(1)
    cache = {
        f"model.layers.{i}.attn": torch.randn(BLOCKS, HEADS, BLOCK_SIZE, WIDTH) for i in range(3)
    }
    s = staging(cache, [list(cache)])
    starts = sorted(view.data_ptr() for view in s.mirror.values())
    assert len(set(starts)) == 3 and starts[0] == s.buffer.data_ptr()
    assert s.copy_out([((2, 7),)]).nbytes == 3 * 2 * cache["model.layers.0.attn"][0].nbytes
    for name, tensor in cache.items():
        assert torch.equal(s.mirror[name][[2, 7]], tensor[[2, 7]]), name
        assert not s.mirror[name][[0, 1, 3]].any(), name


def test_copy_in_fills_the_cache_from_the_mirror_and_nothing_else(staging) -> None:
    cache = _cache()
    before = {name: t.clone() for name, t in cache.items()}
    s = staging(cache, [list(cache)])
    for view in s.mirror.values():
        view[7].fill_(1.5)
        view[8].fill_(2.5)  # landed in the mirror, not part of this load
    s.copy_in([((7,),)])
    for name, tensor in cache.items():
        assert (tensor[7] == 1.5).all(), name
        others = [b for b in range(BLOCKS) if b != 7]
        assert torch.equal(tensor[others], before[name][others]), name


def test_hybrid_groups_over_one_tensor_copy_each_groups_blocks(staging) -> None:
    cache = _cache(hybrid=True)
    s = staging(cache, [["model.layers.0.attn"], ["model.layers.1.attn"]])
    # One storage, mirrored once: the two layers' mirror views are one memory too.
    assert s.mirror["model.layers.0.attn"].data_ptr() == s.mirror["model.layers.1.attn"].data_ptr()
    s.copy_out([((2, 3), (6,))])
    moved = [b for b in range(BLOCKS) if s.mirror["model.layers.0.attn"][b].any()]
    assert moved == [2, 3, 6]


def test_ids_merge_into_runs_of_consecutive_blocks() -> None:
    assert runs([9, 3, 4, 5, 3, 11]) == [(3, 6), (9, 10), (11, 12)]
    assert runs([]) == []


def test_the_mode_follows_the_cache_and_a_shared_gpu_cache_is_refused() -> None:
    assert kv_buffer(None, "cpu") == SHARED
    assert kv_buffer("", "cuda") == HOST
    assert kv_buffer("host", "cpu") == HOST
    with pytest.raises(ValueError, match="kv_buffer = 'host'"):
        kv_buffer("shared", "cuda")
    with pytest.raises(ValueError, match="choose one of shared, host"):
        kv_buffer("vram", "cpu")


def test_block_major_views_split_a_gpu_layout_into_keys_and_values() -> None:
    cpu = _cache()
    views, parts = block_major(cpu, BLOCKS)
    assert parts == {name: (name,) for name in cpu} and views == cpu
    # FlashAttention's [2, blocks, block_size, heads, head_size]: keys, then values.
    flash = torch.randn(2, BLOCKS, BLOCK_SIZE, HEADS, WIDTH)
    views, parts = block_major({"l0": flash}, BLOCKS)
    assert parts == {"l0": ("l0/k", "l0/v")}
    assert torch.equal(views["l0/k"][5], flash[0, 5]) and torch.equal(views["l0/v"][5], flash[1, 5])
    with pytest.raises(ValueError, match=r"neither \[12 blocks"):
        block_major({"odd": torch.zeros(3, BLOCKS, 4)}, BLOCKS)
    assert block_major({"any": flash}, None)[1] == {"any": ("any",)}  # not told: as it is


def test_a_mirror_too_big_for_dev_shm_is_one_clear_error_naming_its_size(small_tmpfs) -> None:
    width = 1 << 20  # two 4 MiB layers: 8 MiB of cache, in a 1 MiB tmpfs
    cache = {name: torch.zeros(width, dtype=torch.float32) for name in _cache()}
    with pytest.raises(StagingError) as refused:
        Staging.create(cache, [list(cache)], SharedMemory(FILE, small_tmpfs / "mirror"))
    message = str(refused.value)
    assert "host staging needs a mirror" in message, message
    assert "bytes are free there" in message and "--shm-size" in message, message
    assert list(small_tmpfs.iterdir()) == []


def test_a_cpu_cache_copies_runs_unless_told_and_an_unknown_mode_is_refused(
    make_staging, tmp_path: Path
) -> None:
    cache = _cache()
    auto = make_staging(cache, [list(cache)])
    assert auto.copies == AUTO
    # Scattered ids on a CPU: still a copy per run (no launch to save).
    assert not auto._gathers([(0, 1), (2, 3), (4, 5)])
    with pytest.raises(StagingError, match="copies must be"):
        Staging.create(
            cache, [list(cache)], SharedMemory(DESCRIPTOR, tmp_path / "other"), copies="scatter"
        )


def test_a_gather_moves_its_blocks_in_chunks_of_bounded_size(
    make_staging, monkeypatch: pytest.MonkeyPatch
) -> None:
    import daemon.client.vllm.staging as staging_module

    # Two blocks a chunk: a scattered step of five blocks takes three gathers
    # per layer, and every block still lands, and only those.
    cache = _cache()
    block = cache["model.layers.0.attn"][0].nbytes
    monkeypatch.setattr(staging_module, "GATHER_CHUNK_BYTES", 2 * block)
    s = make_staging(cache, [list(cache)], GATHER)
    ids = [1, 3, 4, 7, 10]
    copied = s.copy_out([[ids]])
    assert copied.nbytes == 2 * len(ids) * block
    for name, layer in cache.items():
        mirror = s.mirror[name]
        assert torch.equal(mirror[ids], layer[ids])
        others = [b for b in range(BLOCKS) if b not in ids]
        assert not mirror[others].any()


def test_a_mirror_passed_by_descriptor_is_no_file_and_a_file_mirror_is_one(tmp_path: Path) -> None:
    cache = _cache()
    by_descriptor = SharedMemory(DESCRIPTOR, tmp_path / "by-descriptor")
    by_file = SharedMemory(FILE, tmp_path / "by-file")
    try:
        for memory in (by_descriptor, by_file):
            staging = Staging.create(cache, [list(cache)], memory)
            staging.copy_out([(tuple(range(BLOCKS)),)]).wait()
            for name, tensor in cache.items():
                assert torch.equal(staging.mirror[name], tensor)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["by-file"]
        assert by_descriptor.region().descriptor == 0 and by_descriptor.region().path == ""
        assert len(by_descriptor.descriptors) == 1 and by_file.descriptors == ()
        assert by_file.region().path == str(tmp_path / "by-file")
        # What the daemon would map is what the mirror holds: the memfd's own bytes.
        (fd,) = by_descriptor.descriptors
        first = cache["model.layers.0.attn"]
        mirrored = os.pread(fd, first[0].nbytes, 0)
        assert mirrored == first[0].contiguous().view(torch.uint8).numpy().tobytes()
    finally:
        by_descriptor.close()
        by_file.close()
    assert list(tmp_path.iterdir()) == []  # a file mirror goes at close
