"""``cpu_affinity``: every thread of a running daemon on the CPUs it names.

A real daemon is started pinned to one CPU its starter may also use, and
every thread it has once it serves (the event loop's, the NIXL worker, UCX's)
is read from /proc: each must be allowed that CPU alone. A CPU the machine
lacks stops the start with one line that names it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from daemon.affinity import affinity_problem, format_cpu_list, online_cpus, parse_cpu_list
from daemon.config import ConfigError, load_config
from daemon.sim.launcher import Daemon, free_port, start_daemons, toml_string
from tests.support import REPO
from tests.support.fixtures import stop_cleanly


def allowed_cpus(pid: int) -> dict[str, str]:
    """Each live thread of ``pid`` ("name/tid") and its Cpus_allowed_list."""
    out: dict[str, str] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            status = (task / "status").read_text().splitlines()
        except FileNotFoundError:
            continue  # the thread ended between the listing and the read
        (line,) = [s for s in status if s.startswith("Cpus_allowed_list:")]
        out[f"{name}/{task.name}"] = line.split(":", 1)[1].strip()
    return out


@pytest.mark.parametrize(
    ("text", "cpus"),
    [("0", {0}), ("0-3,6", {0, 1, 2, 3, 6}), ("2,0-1\n", {0, 1, 2}), ("", set())],
)
def test_kernel_cpu_lists_parse(text: str, cpus: set[int]) -> None:
    assert parse_cpu_list(text) == cpus


@pytest.mark.parametrize("text", ["3-1", "a", "-1"])
def test_a_malformed_cpu_list_is_refused(text: str) -> None:
    with pytest.raises(ValueError):
        parse_cpu_list(text)


def test_cpu_sets_are_written_as_ranges() -> None:
    assert format_cpu_list([6, 0, 1, 2, 3]) == "0-3,6"
    assert format_cpu_list([5]) == "5"
    assert parse_cpu_list(format_cpu_list({1, 3, 4, 5, 9})) == {1, 3, 4, 5, 9}


def test_only_cpus_the_machine_has_may_be_named() -> None:
    online = frozenset({0, 1})
    assert affinity_problem([1], online) is None
    problem = affinity_problem([1, 2, 3], online)
    assert problem is not None
    assert "CPU 2-3 does not exist" in problem and "CPUs online: 0-1" in problem


def test_a_negative_cpu_is_refused_at_load(tmp_path: Path) -> None:
    config = tmp_path / "k.toml"
    config.write_text("cpu_affinity = [-1]\n")
    with pytest.raises(ConfigError, match="cpu_affinity"):
        load_config(config)
    config.write_text("cpu_affinity = [0]\n")
    assert load_config(config).cpu_affinity == (0,)
    assert load_config(None).cpu_affinity == ()


def test_every_thread_of_a_running_daemon_is_on_its_cpus(tmp_path: Path) -> None:
    mine = sorted(os.sched_getaffinity(0))
    if len(mine) < 2:
        pytest.skip("needs two CPUs: pinned to the only one, nothing would differ")
    cpu = mine[-1]  # not the whole set the daemon would inherit from us
    (daemon,) = start_daemons(
        lambda: [Daemon("pinned", tmp_path, free_port(), extra=f"cpu_affinity = [{cpu}]")]
    )
    try:
        assert daemon.proc is not None
        threads = allowed_cpus(daemon.proc.pid)
        # It serves: the data plane's thread exists, and UCX's with it.
        assert any(name.startswith("nixl-worker/") for name in threads), threads
        assert len(threads) >= 3, threads
        assert set(threads.values()) == {str(cpu)}, threads
    finally:
        stop_cleanly(daemon)


def test_a_cpu_the_machine_lacks_stops_the_start(tmp_path: Path) -> None:
    absent = max(online_cpus()) + 1
    journal = tmp_path / "j"
    config = tmp_path / "kvpushd.toml"
    config.write_text(
        f"node = 'pinned'\nsocket = {toml_string(str(tmp_path / 's.sock'))}\n"
        f"cpu_affinity = [0, {absent}]\n[journal]\ndir = {toml_string(str(journal))}\n"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "daemon.cli", "run", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    # One line, exit 2 (systemd does not restart it), nothing journaled.
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    (said,) = [line for line in proc.stderr.splitlines() if line.startswith("kvpushd:")]
    assert said.startswith("kvpushd: cannot start: cpu_affinity: ")
    assert f"CPU {absent} does not exist on this machine" in said
    assert not journal.exists()
