"""Tests of mapped engine regions and offload slots (daemon/dataplane/memory.py), on /dev/shm."""

from __future__ import annotations

import mmap
import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from daemon.dataplane.memory import (
    SHM_ROOT,
    MappedRegion,
    OffloadPool,
    RegionError,
    create_shm_file,
    map_dram_region,
)
from schemas.kvlayout import MemoryKind, RegionSpec

ShmFactory = Callable[[int], RegionSpec]


@pytest.fixture
def shm_files() -> Iterator[list[str]]:
    """Paths under /dev/shm this test made; removed afterwards."""
    paths: list[str] = []
    yield paths
    for path in reversed(paths):
        p = Path(path)
        if p.is_symlink() or p.is_file():
            p.unlink()
        elif p.is_dir():
            p.rmdir()


def _shm_name(tag: str = "f") -> str:
    return os.path.join(SHM_ROOT, f"kvpushd-test-{tag}-{uuid.uuid4().hex[:12]}")


@pytest.fixture
def new_shm(shm_files: list[str]) -> ShmFactory:
    def make(size: int) -> RegionSpec:
        spec = create_shm_file(_shm_name(), size)
        shm_files.append(spec.path)
        return spec

    return make


@pytest.fixture
def mapped(new_shm: ShmFactory) -> Iterator[Callable[[int], MappedRegion]]:
    regions: list[MappedRegion] = []

    def make(size: int) -> MappedRegion:
        region = map_dram_region(new_shm(size), owner_uid=os.getuid())
        regions.append(region)
        return region

    yield make
    for region in regions:
        region.close()


def _refused(spec: RegionSpec, owner_uid: int | None = None) -> RegionError:
    with pytest.raises(RegionError) as info:
        map_dram_region(spec, owner_uid=owner_uid)
    assert info.value.code == "bad_region"
    return info.value


# --------------------------------------------------------------------------
# mapping


def test_map_is_shared_and_writable(new_shm: ShmFactory) -> None:
    spec = new_shm(1 << 16)
    with (
        map_dram_region(spec, owner_uid=os.getuid()) as a,
        map_dram_region(spec, owner_uid=None) as b,
    ):
        assert (a.name, a.size, a.memory, a.device) == (spec.name, 1 << 16, MemoryKind.DRAM, 0)
        view = a.view()
        assert view.flags.writeable and view.dtype == np.uint8
        assert a.base == view.ctypes.data  # base is this process's address of byte 0
        view[100:104] = [1, 2, 3, 4]
        assert b.view()[100:104].tolist() == [1, 2, 3, 4]  # another mapping sees it
        del view
    with open(spec.path, "rb") as f:  # and so does the file itself
        f.seek(100)
        assert f.read(4) == b"\x01\x02\x03\x04"


def test_region_in_subdirectory_and_symlink_inside_shm_accepted(
    shm_files: list[str],
) -> None:
    subdir = _shm_name("dir")
    os.mkdir(subdir)
    shm_files.append(subdir)
    spec = create_shm_file(os.path.join(subdir, "kv"), 4096)
    shm_files.append(spec.path)
    link = _shm_name("link")
    os.symlink(spec.path, link)
    shm_files.append(link)
    for path in (spec.path, link):
        with map_dram_region(RegionSpec("kv", 4096, path=path), owner_uid=None) as region:
            assert region.path == spec.path


def test_refuses_path_outside_shm(tmp_path: Path) -> None:
    outside = tmp_path / "kv"
    outside.write_bytes(b"\0" * 4096)
    err = _refused(RegionSpec("kv", 4096, path=str(outside)))
    assert "not under" in str(err)


def test_refuses_symlink_escaping_shm(tmp_path: Path, shm_files: list[str]) -> None:
    outside = tmp_path / "kv"
    outside.write_bytes(b"\0" * 4096)
    link = _shm_name("escape")
    os.symlink(outside, link)
    shm_files.append(link)
    assert "not under" in str(_refused(RegionSpec("kv", 4096, path=link)))


def test_refuses_dotdot_and_relative_paths(tmp_path: Path) -> None:
    (tmp_path / "kv").write_bytes(b"\0" * 4096)
    _refused(RegionSpec("kv", 4096, path=f"{SHM_ROOT}/../{tmp_path}/kv"))
    _refused(RegionSpec("kv", 4096, path="kv"))
    _refused(RegionSpec("kv", 4096, path=""))
    _refused(RegionSpec("kv", 4096, path=SHM_ROOT))


def test_refuses_wrong_size(new_shm: ShmFactory) -> None:
    spec = new_shm(8192)
    err = _refused(RegionSpec(spec.name, 4096, path=spec.path))
    assert "8192" in str(err)
    _refused(RegionSpec(spec.name, 0, path=spec.path))
    _refused(RegionSpec(spec.name, -1, path=spec.path))


def test_refuses_wrong_owner(new_shm: ShmFactory) -> None:
    spec = new_shm(4096)
    err = _refused(spec, owner_uid=os.getuid() + 1)
    assert "uid" in str(err)
    map_dram_region(spec, owner_uid=os.getuid()).close()


def test_refuses_missing_file_directory_and_vram(shm_files: list[str]) -> None:
    assert "does not exist" in str(_refused(RegionSpec("kv", 4096, path=_shm_name("none"))))
    subdir = _shm_name("dir")
    os.mkdir(subdir)
    shm_files.append(subdir)
    _refused(RegionSpec("kv", 4096, path=subdir))
    _refused(RegionSpec("kv", 4096, memory=MemoryKind.VRAM, path=subdir))


def test_close_is_idempotent_and_safe_with_live_views(new_shm: ShmFactory) -> None:
    region = map_dram_region(new_shm(4096), owner_uid=None)
    view = region.view()
    view[0] = 7
    region.close()  # a live view: the unmap waits for it, no crash
    region.close()
    assert region.closed
    assert view[0] == 7  # still a valid mapping while the view lives
    with pytest.raises(RegionError):
        region.view()


def test_create_refuses_existing_and_outside(new_shm: ShmFactory, tmp_path: Path) -> None:
    spec = new_shm(4096)
    with pytest.raises(FileExistsError):
        create_shm_file(spec.path, 4096)
    with pytest.raises(RegionError):
        create_shm_file(str(tmp_path / "x"), 4096)


# --------------------------------------------------------------------------
# offload pool


def test_pool_geometry_refusals(mapped: Callable[[int], MappedRegion]) -> None:
    region = mapped(4096 * 3)
    with pytest.raises(RegionError, match="equal slots"):
        OffloadPool(region, 5)
    with pytest.raises(RegionError):
        OffloadPool(region, 0)
    pool = OffloadPool(region, 3)
    assert (pool.slot_bytes, pool.free_count, pool.n_slots) == (4096, 3, 3)
    assert pool.slot_addr(2) == region.base + 2 * 4096
    with pytest.raises(RegionError) as info:
        pool.slot_view(3)
    assert info.value.code == "bad_slot"


def test_pool_take_is_all_or_nothing(mapped: Callable[[int], MappedRegion]) -> None:
    pool = OffloadPool(mapped(4096 * 4), 4)
    pool.take((0, 2))
    for bad in ((1, 2), (1, 1), (3, 4), (-1,)):  # busy, twice, out of range
        with pytest.raises(RegionError) as info:
            pool.take(bad)
        assert info.value.code == "bad_slot"
    assert set(pool.busy) == {0, 2} and pool.free_count == 2
    pool.take(())
    pool.take((1, 3))
    assert pool.free_count == 0 and pool.used_count == 4


def test_pool_release_zeroes_slots_and_nothing_else(mapped: Callable[[int], MappedRegion]) -> None:
    region = mapped(1024 * 4)
    pool = OffloadPool(region, 4)
    pool.take(range(4))
    for s in range(4):
        pool.slot_view(s)[:] = s + 1
    pool.release((0, 2))
    view = region.view()
    assert not view[0:1024].any() and not view[2048:3072].any()
    assert (view[1024:2048] == 2).all() and (view[3072:4096] == 4).all()  # still held
    assert pool.free_count == 2
    assert set(pool.busy) == {1, 3}


def test_pool_release_of_a_free_slot_raises_and_changes_nothing(
    mapped: Callable[[int], MappedRegion],
) -> None:
    pool = OffloadPool(mapped(1024 * 4), 4)
    a, b = 0, 1
    pool.take((a, b))
    pool.slot_view(a)[:] = 9
    for bad in ((a, 3), (a, a), (7,)):
        with pytest.raises(RegionError) as info:
            pool.release(bad)
        assert info.value.code == "bad_slot"
    assert (pool.slot_view(a) == 9).all()  # not zeroed: nothing was released
    assert pool.free_count == 2
    pool.release((a, b))
    with pytest.raises(RegionError):
        pool.release((a,))  # double release


def test_a_pool_opened_with_held_slots_zeroes_only_the_others(
    mapped: Callable[[int], MappedRegion],
) -> None:
    # After a restart, the slots live requests hold are theirs: in use, not residue.
    region = mapped(1024 * 4)
    region.view()[:] = 7
    pool = OffloadPool(region, 4, held={1, 3})
    view = region.view()
    assert not view[0:1024].any() and not view[2048:3072].any()
    assert (view[1024:2048] == 7).all() and (view[3072:4096] == 7).all()
    assert set(pool.busy) == {1, 3} and pool.free_count == 2
    with pytest.raises(RegionError) as info:
        pool.take((1,))
    assert info.value.code == "bad_slot"
    pool.release((1,))
    assert not view[1024:2048].any()
    with pytest.raises(RegionError) as out:
        OffloadPool(region, 4, held={4})
    assert out.value.code == "bad_slot"


def test_pool_zeroes_residue_of_a_previous_run(new_shm: ShmFactory) -> None:
    spec = new_shm(4096)
    with open(spec.path, "r+b") as f, mmap.mmap(f.fileno(), 4096) as m:
        m[:] = b"\xab" * 4096
    with map_dram_region(spec, owner_uid=None) as region:
        OffloadPool(region, 2)
        assert not region.view().any()
