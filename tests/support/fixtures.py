"""Real daemons as fixtures: started, and checked to stop cleanly at the end."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from daemon.sim.launcher import Daemon, free_port, start_daemons, start_pair


def stop_cleanly(*daemons: Daemon) -> None:
    """SIGTERM every daemon, then check each exited 0 (its log says why not)."""
    codes = [(daemon, daemon.stop()) for daemon in daemons]
    for daemon, code in codes:
        assert code == 0, daemon.logs()


@pytest.fixture(scope="module")
def peered_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Daemon, Daemon]]:
    """A prefill and a decode daemon that see each other; both must exit 0 at the end."""
    pair = start_pair(tmp_path_factory.mktemp("pair"))
    yield pair
    stop_cleanly(*pair)


@pytest.fixture(scope="module")
def solo_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """One daemon named "solo", without peers; it must exit 0 at the end."""
    workdir = tmp_path_factory.mktemp("solo")
    (solo,) = start_daemons(lambda: [Daemon("solo", workdir, free_port())])
    yield solo
    stop_cleanly(solo)


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs, like a container's small /dev/shm."""
    mount = tmp_path / "shm"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)
