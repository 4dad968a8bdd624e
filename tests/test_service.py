"""The daemon as a service: configuration errors, defaults, systemd notify, SIGTERM."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from daemon.ops.status import fetch_status
from tests.support import REPO


def _run(*args: str, env: dict[str, str] | None = None, timeout: float = 30):
    return subprocess.run(
        [sys.executable, "-m", "daemon.cli", "run", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env={**os.environ, **(env or {})},
    )


@pytest.mark.parametrize(
    ("toml", "field"),
    [
        ('node = ""', "node"),
        ('[journal]\nfsync = "sometimes"', "journal.fsync"),
        ("[deadlines]\nwriting = -1", "deadlines.writing"),
        ("frobnicate = 3", "frobnicate"),
        ('heartbeat_s = "fast"', "heartbeat_s"),
        ('[[peers]]\nnode = "b"\naddress = "127.0.0.1:1"', "secret_file"),
        ('listen = "nocolon"', "listen"),
    ],
)
def test_invalid_config_names_the_field_and_exits_2(tmp_path: Path, toml: str, field: str):
    config = tmp_path / "bad.toml"
    config.write_text(toml + "\n")
    proc = _run("--config", str(config))
    assert proc.returncode == 2, proc.stderr
    assert field in proc.stderr
    assert "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_unreadable_and_malformed_config(tmp_path: Path):
    proc = _run("--config", str(tmp_path / "missing.toml"))
    assert proc.returncode == 2 and "cannot read" in proc.stderr
    broken = tmp_path / "broken.toml"
    broken.write_text("node = \n")
    proc = _run("--config", str(broken))
    assert proc.returncode == 2 and "not valid TOML" in proc.stderr


def _recv_all(sock: socket.socket, until: float) -> list[str]:
    messages = []
    while time.monotonic() < until:
        try:
            messages.append(sock.recv(4096).decode())
        except TimeoutError:
            break
    return messages


def test_defaults_without_config_and_systemd_notify(tmp_path: Path):
    """No config file; systemd's directories and notify socket from the environment."""
    notify_path = tmp_path / "notify.sock"
    sd = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sd.bind(str(notify_path))
    sd.settimeout(0.5)
    env = {
        **os.environ,
        "RUNTIME_DIRECTORY": str(tmp_path / "run"),
        "STATE_DIRECTORY": str(tmp_path / "state"),
        "NOTIFY_SOCKET": str(notify_path),
        "WATCHDOG_USEC": "300000",
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "daemon.cli", "run", "--node", "solo", "--listen", ""],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        sock_path = tmp_path / "run" / "solo.sock"
        messages: list[str] = []
        deadline = time.monotonic() + 30
        while not any("READY=1" in m for m in messages) and time.monotonic() < deadline:
            messages += _recv_all(sd, time.monotonic() + 0.5)
            assert proc.poll() is None, proc.stderr.read().decode()
        ready = next(m for m in messages if "READY=1" in m)
        assert "STATUS=" in ready and f"MAINPID={proc.pid}" in ready
        assert oct(sock_path.stat().st_mode & 0o777) == "0o660"
        assert fetch_status(str(sock_path))["node"] == "solo"
        assert (tmp_path / "state" / "solo").is_dir()  # the journal lives in StateDirectory
        # The watchdog is pinged from the event loop at half of WATCHDOG_USEC.
        later = _recv_all(sd, time.monotonic() + 1.0)
        assert sum(m == "WATCHDOG=1" for m in later) >= 3, later
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
        tail = _recv_all(sd, time.monotonic() + 1.0)
        assert any(m.startswith("STOPPING=1") for m in tail), tail
        assert not sock_path.exists(), "the socket is removed on exit"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        sd.close()
