"""The KV cache file an engine shares with its daemon: allocated for real, swept by its lock.

Real files, a real tmpfs too small for the cache, and a real owner in
another PID namespace (``unshare --pid``: the case of containers sharing an
IPC namespace but not a PID namespace, where judging by the pid in the file
name removed a live engine's KV).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from daemon.client.kvfile import KvFileError, create_kv_file, sweep_stale_kv_files

PREFIX = "kvpushd-vllm-"


def test_a_file_too_big_for_its_tmpfs_is_one_clear_error_at_creation(small_tmpfs: Path) -> None:
    with pytest.raises(KvFileError) as refused:
        create_kv_file(small_tmpfs / f"{PREFIX}1-e", 4 << 20)
    message = str(refused.value)
    assert f"({4 << 20} bytes)" in message and "bytes are free there" in message, message
    assert "--shm-size" in message and "--kv-cache-memory-bytes" in message
    assert list(small_tmpfs.iterdir()) == []  # neither the file nor its temporary name


def test_a_file_that_fits_is_allocated_zeroed_and_locked(small_tmpfs: Path) -> None:
    path = small_tmpfs / f"{PREFIX}1-e"
    fd = create_kv_file(path, 512 << 10)
    try:
        # Every page is allocated now (not sparse): the tmpfs counts them.
        assert os.stat(path).st_blocks * 512 >= 512 << 10
        assert path.read_bytes() == bytes(512 << 10)
        assert sweep_stale_kv_files(small_tmpfs, PREFIX) == []  # held: kept
    finally:
        os.close(fd)
    assert sweep_stale_kv_files(small_tmpfs, PREFIX) == [path]  # released: swept
    assert not path.exists()


_HOLDER = """
import sys, time
from pathlib import Path
from daemon.client.kvfile import create_kv_file
fd = create_kv_file(Path(sys.argv[1]), 4096)
print("held", flush=True)
time.sleep(600)
"""


def test_a_live_owner_in_another_pid_namespace_keeps_its_file(tmp_path: Path) -> None:
    # Named after a pid that does not exist in this namespace: the old sweep,
    # which judged by the name, removed such a file while its owner lived.
    gone_pid = _a_dead_pid()
    path = tmp_path / f"{PREFIX}{gone_pid}-other-container"
    holder = subprocess.Popen(
        ["unshare", "--pid", "--fork", "--kill-child", sys.executable, "-c", _HOLDER, str(path)],
        stdout=subprocess.PIPE,
        cwd=Path(__file__).resolve().parents[1],
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"held\n"
        assert sweep_stale_kv_files(tmp_path, PREFIX) == []
        assert path.exists()
    finally:
        holder.kill()  # and, --kill-child, the owner inside the namespace
        holder.wait(10)
    # The lock goes with the owner's exit, moments after unshare's.
    deadline = time.monotonic() + 10
    while not (swept := sweep_stale_kv_files(tmp_path, PREFIX)):
        assert time.monotonic() < deadline, "the owner's lock outlived it"
        time.sleep(0.05)
    assert swept == [path]


def test_an_unlocked_file_is_stale_whatever_pid_its_name_carries(tmp_path: Path) -> None:
    # A live pid in the name (ours) does not keep a file nobody holds.
    path = tmp_path / f"{PREFIX}{os.getpid()}-left"
    path.write_bytes(b"\0" * 4096)
    other = tmp_path / "not-a-kv-file"
    other.write_bytes(b"x")
    assert sweep_stale_kv_files(tmp_path, PREFIX) == [path]
    assert other.exists()


def _a_dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    assert not os.path.exists(f"/proc/{child.pid}")
    return child.pid
