"""``kvpushd status`` against a real daemon, a missing one and a silent one."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator

import pytest

from daemon.cli import main
from daemon.ops.status import EXIT_NOT_RUNNING, EXIT_UNAVAILABLE, age
from daemon.sim.engine import SimEngine, SimGroup
from daemon.sim.launcher import Daemon, free_port
from schemas.layout import Role
from tests.support import REPO

LAYOUT = [SimGroup(num_blocks=64, block_bytes=1024, layers=1)]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    solo = Daemon("solo", tmp_path_factory.mktemp("status"), free_port())
    solo.start()
    yield solo
    assert solo.stop() == 0, solo.logs()


@pytest.fixture
async def live_request(daemon: Daemon) -> AsyncIterator[str]:
    """A pusher request that stays registered: no decode side ever forwards."""
    rid = f"st-{uuid.uuid4().hex[:6]}"
    engine = await SimEngine.create(f"e-{rid}", Role.PUSHER, LAYOUT, daemon.socket)
    try:
        await engine.prefill(rid, [[1, 2, 3]], kv_ready=False)
        yield rid
        await engine.abort(rid)
        await engine.release(rid)
    finally:
        await engine.close()


def test_human_output_shows_the_live_request(daemon, live_request, capsys):
    assert main(["status", "--socket", daemon.socket]) == 0
    out = capsys.readouterr().out
    print(out)  # shown on failure: the whole rendering
    assert out.startswith("node     solo  pid ")
    assert f"oldest   {live_request} registered for " in out
    assert "oldest requests (1 of 1)" in out
    row = next(line for line in out.splitlines() if line.startswith(live_request))
    assert row.split()[:4] == [live_request, "1", "pusher", "registered"]
    assert "journal  next seq " in out
    assert "peers: none configured" in out
    engine_row = next(line for line in out.splitlines() if line.startswith(f"e-{live_request}"))
    assert engine_row.split()[1:3] == ["yes", "1"]  # connected, one live request


def test_json_output_is_the_raw_status(daemon, live_request, capsys):
    assert main(["status", "--socket", daemon.socket, "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    direct = daemon.status()
    assert shown.keys() == direct.keys()
    assert shown["node"] == "solo" and shown["pid"] == daemon.proc.pid
    assert shown["by_state"] == {"registered": 1}
    (request,) = shown["requests"]
    assert request["request_id"] == live_request and request["state"] == "registered"


def test_config_names_the_socket(daemon, capsys):
    assert main(["status", "--config", str(daemon.workdir / "solo.toml"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["node"] == "solo"


def test_no_daemon_exits_3_naming_the_socket(tmp_path):
    missing = tmp_path / "gone.sock"
    # Through the real entry point, as scripts run it.
    result = subprocess.run(
        [sys.executable, "-m", "daemon.cli", "status", "--socket", str(missing)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == EXIT_NOT_RUNNING == 3
    assert result.stdout == ""
    assert result.stderr.strip() == (
        f"kvpushd status: no kvpushd is running at {missing} (No such file or directory)"
    )


def test_stale_socket_exits_3(tmp_path, capsys):
    # What a killed daemon leaves behind: the socket file, with nobody listening.
    stale = tmp_path / "stale.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(stale))
    assert main(["status", "--socket", str(stale)]) == EXIT_NOT_RUNNING
    err = capsys.readouterr().err
    assert str(stale) in err and "Connection refused" in err


def test_silent_listener_exits_4(tmp_path, capsys):
    # Something accepts connections but never answers: not "no daemon".
    path = tmp_path / "silent.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path))
        s.listen()
        assert main(["status", "--socket", str(path), "--timeout", "0.2"]) == EXIT_UNAVAILABLE
    assert "no reply within 0.2 s" in capsys.readouterr().err


def test_bad_config_exits_2(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text("this is = not toml =\n")
    assert main(["status", "--config", str(bad)]) == 2
    assert "invalid configuration" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(None, "-"), (0.0123, "12ms"), (12.34, "12.3s"), (245, "4m05s"), (7380, "2h03m")],
)
def test_age_format(seconds, text):
    assert age(seconds) == text


def test_help_documents_exit_codes():
    result = subprocess.run(
        [sys.executable, "-m", "daemon.cli", "status", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 0
    assert "3  no daemon is running" in result.stdout
