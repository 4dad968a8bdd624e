"""The daemon as a service: configuration errors and ranges, defaults, systemd notify, SIGTERM."""

from __future__ import annotations

import grp
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from daemon.config import ConfigError, load_config
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
        ("metrics_port = 70000", "metrics_port"),
        ("drain_s = -5", "drain_s"),
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
    assert proc.stderr.startswith(f"kvpushd: cannot start: invalid configuration in {config}: ")


SECRET_LINE = 'secret_file = "/etc/kvpushd/secret"'


@pytest.mark.parametrize(
    ("toml", "field"),
    [
        ("metrics_port = 70000", "metrics_port"),
        ("metrics_port = -1", "metrics_port"),
        (f'{SECRET_LINE}\nlisten = "127.0.0.1:0"', "listen"),
        (f'{SECRET_LINE}\nlisten = "127.0.0.1:65536"', "listen"),
        (f'{SECRET_LINE}\nlisten = "127.0.0.1:http"', "listen"),
        ('listen = "127.0.0.1:7700"', "listen"),  # a listener without a secret
        (f'{SECRET_LINE}\n[[peers]]\nnode = "b"\naddress = "10.0.0.2:0"', "peers[0].address"),
        ("drain_s = -5", "drain_s"),
        ("drain_s = 0", "drain_s"),
        ("heartbeat_s = nan", "heartbeat_s"),
        ("peer_connect_timeout_s = 0", "peer_connect_timeout_s"),
        ("peer_idle_close_s = -1", "peer_idle_close_s"),
        ("peer_idle_close_s = inf", "peer_idle_close_s"),
        ("[deadlines]\nwriting = inf", "deadlines.writing"),
        ("[deadlines]\ndone = 0", "deadlines.done"),
        ("[deadlines]\nanswered = 0", "deadlines.answered"),
        ("[deadlines]\nanswered = nan", "deadlines.answered"),
        ("[journal]\nsegment_mb = 0", "journal.segment_mb"),
        ("[journal]\ncommit_window_ms = -1", "journal.commit_window_ms"),
        ("[journal]\nsnapshot_every = -1", "journal.snapshot_every"),
        ("[journal]\nretain_segments = -1", "journal.retain_segments"),
        ("[limits]\nmax_live_per_engine = 0", "limits.max_live_per_engine"),
        ("[limits]\nmax_frame_bytes = 100", "limits.max_frame_bytes"),
        ("[limits]\nmax_frame_bytes = 5000000000", "limits.max_frame_bytes"),
        ("[limits]\ntombstones = 0", "limits.tombstones"),
        ("[nixl]\npoll_interval_s = 0", "nixl.poll_interval_s"),
        ('[nixl]\nbackend = ""', "nixl.backend"),
        ('log_level = "loud"', "log_level"),
        ("allowed_uids = [-1]", "allowed_uids[0]"),
        ("allowed_groups = [-3]", "allowed_groups[0]"),
        ('allowed_groups = ["no-such-group-kvpushd-test"]', "allowed_groups"),
        ("allowed_gids = [0]", "allowed_gids: renamed allowed_groups"),
        ('node = "a/b"', "node"),
        (f'socket = "/tmp/{"s" * 120}.sock"', "socket"),
    ],
)
def test_config_values_are_range_checked_at_load(toml: str, field: str, tmp_path: Path):
    config = tmp_path / "bad.toml"
    config.write_text(toml + "\n")
    with pytest.raises(ConfigError) as info:
        load_config(config)
    assert str(info.value).startswith(field if ":" in field else f"{field}: "), info.value


def test_groups_by_name_or_gid_are_resolved_at_load(tmp_path: Path):
    root_group = grp.getgrgid(0).gr_name
    config = tmp_path / "groups.toml"
    config.write_text(f'allowed_groups = ["{root_group}", 4242]\n')
    assert load_config(config).allowed_groups == (0, 4242)
    # Left out: the daemon's own group (Group=kvpushd under the unit); [] admits no group.
    assert load_config(None).allowed_groups == (os.getgid(),)
    config.write_text("allowed_groups = []\n")
    assert load_config(config).allowed_groups == ()


def test_without_a_secret_there_is_no_listener_and_with_one_the_default_listens(tmp_path: Path):
    assert load_config(None).listen == ""
    config = tmp_path / "secret.toml"
    config.write_text(f"{SECRET_LINE}\n")
    assert load_config(config).listen == "127.0.0.1:7700"


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
        # No config and no --listen: the defaults start without a secret (no peer link).
        [sys.executable, "-m", "daemon.cli", "run", "--node", "solo"],
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
        status = fetch_status(str(sock_path))
        assert status["node"] == "solo" and status["peers"] == []
        assert (tmp_path / "state" / "solo").is_dir()  # the journal lives in StateDirectory
        # The watchdog is pinged from the event loop at half of WATCHDOG_USEC.
        later = _recv_all(sd, time.monotonic() + 1.0)
        assert sum(m == "WATCHDOG=1" for m in later) >= 3, later
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
        tail = _recv_all(sd, time.monotonic() + 1.0)
        assert any(m.startswith("STOPPING=1") for m in tail), tail
        assert not sock_path.exists(), "the socket is removed on exit"
        logged = proc.stderr.read().decode()
        assert logged.count("peer link off: no secret_file configured") == 1, logged
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        sd.close()


async def test_a_drain_that_raises_still_closes_the_links_the_socket_and_the_metrics(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Shutdown's steps run in reverse whatever raises (daemon/service.py ``_shutdown_steps``).

    In this process, not a subprocess: the only way to make the drain raise
    is to replace it. Afterwards the engine socket is gone and the peer and
    metrics ports can be bound again.
    """
    import asyncio

    from daemon.node.runtime import Node
    from daemon.service import serve
    from daemon.sim.launcher import STATUS_ERRORS, free_port, write_secret

    listen, metrics = free_port(), free_port()
    write_secret(tmp_path / "secret")
    sock = tmp_path / "d.sock"
    (tmp_path / "d.toml").write_text(
        f'node = "d"\nsocket = "{sock}"\nlisten = "127.0.0.1:{listen}"\n'
        f'secret_file = "{tmp_path / "secret"}"\nmetrics_port = {metrics}\n'
        f'[journal]\ndir = "{tmp_path / "journal"}"\n'
    )
    config = load_config(tmp_path / "d.toml")

    async def broken_drain(self: Node) -> None:
        raise RuntimeError("the drain broke")

    monkeypatch.setattr(Node, "drain", broken_drain)
    running = asyncio.ensure_future(serve(config))
    deadline = time.monotonic() + 30
    while True:
        assert not running.done(), running.exception()
        try:
            await asyncio.to_thread(fetch_status, str(sock), 2.0)
            break
        except STATUS_ERRORS:
            assert time.monotonic() < deadline, "the daemon did not come up"
            await asyncio.sleep(0.05)
    signal.raise_signal(signal.SIGTERM)
    with pytest.raises(RuntimeError, match="the drain broke"):
        await asyncio.wait_for(running, 30)
    assert not sock.exists()
    for port in (listen, metrics):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", port))  # released: the step after the failure ran
