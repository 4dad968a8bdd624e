"""Starting the daemon, as an operator meets it: each refusal is one line and changes nothing.

Every start-up failure (secret file, log level, a port in use, the journal
directory, the engine socket) exits 2 with ``kvpushd: cannot start: ...`` as
its one line on stderr, no traceback, no engine socket left behind, and no
DaemonStarted record added to the journal. The engine socket has an owner: a
second daemon on a live daemon's socket refuses to start and the first stays
reachable; a daemon removes only the socket it bound. A connection whose
credentials are not allowed gets a ``not_allowed`` error frame, which the
client raises as RpcError.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from daemon.client import EngineClient, RpcError
from daemon.sim.launcher import Daemon, free_port, start_daemons, toml_string, write_secret
from schemas import rpc
from schemas.events import DaemonStarted
from tests.support import REPO
from tests.support.fixtures import stop_cleanly
from tests.support.journals import read_records

PREFIX = "kvpushd: cannot start: "


def kvpushd_run(config: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "daemon.cli", "run", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )


def refusal(proc: subprocess.CompletedProcess[str]) -> str:
    """The one line a failed start said; asserts how it said it."""
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    said = [line for line in lines if line.startswith("kvpushd:")]
    assert len(said) == 1 and lines[-1] == said[0], proc.stderr
    assert said[0].startswith(PREFIX), said
    return said[0].removeprefix(PREFIX)


def starts(journal: Path) -> int:
    return sum(isinstance(r.event, DaemonStarted) for r in read_records(journal))


def write_config(workdir: Path, journal: Path, lines: dict[str, str], tail: str = "") -> Path:
    """A config with its own socket, secret and journal; ``lines`` replaces top-level keys."""
    secret = workdir / "secret"
    if not secret.exists():
        write_secret(secret)
    keys = {
        "node": toml_string("starter"),
        "socket": toml_string(str(workdir / "s.sock")),
        "secret_file": toml_string(str(secret)),
        "listen": f'"127.0.0.1:{free_port()}"',
        **lines,
    }
    body = "".join(f"{key} = {value}\n" for key, value in keys.items())
    path = workdir / "kvpushd.toml"
    path.write_text(f"{body}{tail}\n[journal]\ndir = {toml_string(str(journal))}\n")
    return path


@pytest.fixture(scope="module")
def started_once(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A journal a daemon started (and stopped) in once: one DaemonStarted record."""
    workdir = tmp_path_factory.mktemp("seed")
    (seed,) = start_daemons(lambda: [Daemon("starter", workdir, free_port())])
    stop_cleanly(seed)
    assert starts(seed.journal) == 1
    return seed.journal


@pytest.fixture
def listening_port() -> Iterator[int]:
    """A loopback port something else listens on."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        yield taken.getsockname()[1]


def _secret(mode: int, content: bytes) -> Callable[[Path, int], dict[str, str]]:
    def make(workdir: Path, port: int) -> dict[str, str]:
        path = workdir / "peer-secret"
        path.write_bytes(content)
        path.chmod(mode)
        return {"secret_file": toml_string(str(path))}

    return make


def _missing_secret(workdir: Path, port: int) -> dict[str, str]:
    return {"secret_file": toml_string(str(workdir / "absent-secret"))}


def _journal_is_a_file(workdir: Path, port: int) -> dict[str, str]:
    (workdir / "plain-file").write_text("not a directory\n")
    return {}


# (case, config keys from (workdir, a port in use), the journal.dir under workdir, words said)
CASES: list[tuple[str, Callable[[Path, int], dict[str, str]], str, tuple[str, ...]]] = [
    ("secret missing", _missing_secret, "journal", ("absent-secret", "secret_file")),
    ("secret empty", _secret(0o600, b"\n"), "journal", ("peer-secret", "empty")),
    ("secret world-readable", _secret(0o644, b"s" * 32), "journal", ("0644", "chmod 600")),
    ("bad log level", lambda w, p: {"log_level": '"loud"'}, "journal", ("log_level", "loud")),
    (
        "peer port in use",
        lambda w, p: {"listen": f'"127.0.0.1:{p}"'},
        "journal",
        ("127.0.0.1:{port}", "in use", "listen"),
    ),
    (
        "metrics port in use",
        lambda w, p: {"metrics_port": str(p)},
        "journal",
        ("metrics port", "{port}", "in use", "metrics_port"),
    ),
    (
        "unknown NIXL backend",
        lambda w, p: {"nixl.backend": '"NOPE"'},
        "journal",
        ("nixl.backend", "NOPE", "UCX"),
    ),
    ("journal is a file", _journal_is_a_file, "plain-file", ("plain-file", "journal.dir")),
    ("journal under a file", _journal_is_a_file, "plain-file/sub", ("plain-file/sub", "journal")),
]


@pytest.mark.parametrize(("case", "keys", "journal_dir", "words"), CASES, ids=[c[0] for c in CASES])
def test_a_failed_start_is_one_line_exit_2_and_journals_nothing(
    tmp_path: Path,
    started_once: Path,
    listening_port: int,
    case: str,
    keys: Callable[[Path, int], dict[str, str]],
    journal_dir: str,
    words: tuple[str, ...],
) -> None:
    journal = tmp_path / journal_dir
    if journal_dir == "journal":
        shutil.copytree(started_once, journal)
    config = write_config(tmp_path, journal, keys(tmp_path, listening_port))
    said = refusal(kvpushd_run(config))
    for word in words:
        assert word.format(port=listening_port) in said, said
    assert not (tmp_path / "s.sock").exists(), "a failed start leaves no engine socket"
    if journal_dir == "journal":
        assert starts(journal) == 1, "a failed start must not journal DaemonStarted"


def test_the_journal_and_socket_of_a_live_daemon_are_refused_and_it_stays_reachable(
    tmp_path: Path,
) -> None:
    live_dir = tmp_path / "live"
    live_dir.mkdir()
    (live,) = start_daemons(lambda: [Daemon("live", live_dir, free_port())])
    try:
        pid = live.status()["pid"]
        # Its socket, with a journal of our own.
        on_socket = write_config(
            tmp_path, tmp_path / "own-journal", {"socket": toml_string(live.socket)}
        )
        said = refusal(kvpushd_run(on_socket))
        assert live.socket in said and f"pid {pid}" in said and "running kvpushd" in said
        # Its journal, with a socket of our own.
        on_journal = write_config(tmp_path, live.journal, {})
        said = refusal(kvpushd_run(on_journal))
        assert str(live.journal) in said and "in use by another kvpushd" in said
        assert not (tmp_path / "s.sock").exists()
        # The live daemon never noticed: same process, same socket, one start journaled.
        assert live.status()["pid"] == pid
        assert Path(live.socket).is_socket()
        assert starts(live.journal) == 1
    finally:
        stop_cleanly(live)
    assert not Path(live.socket).exists(), "the owner removes its socket on exit"


def test_a_daemon_removes_only_the_socket_it_bound(tmp_path: Path) -> None:
    (daemon,) = start_daemons(lambda: [Daemon("owner", tmp_path, free_port())])
    aside = tmp_path / "moved.sock"
    stranger = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        # Someone else's socket now sits at the path (an operator moved the daemon's away).
        os.rename(daemon.socket, aside)
        stranger.bind(daemon.socket)
        stop_cleanly(daemon)
        assert Path(daemon.socket).is_socket(), "the daemon removed a socket it did not bind"
    finally:
        stranger.close()
        daemon.kill()


def test_a_dead_daemons_socket_is_replaced_and_other_files_are_left_alone(tmp_path: Path) -> None:
    (daemon,) = start_daemons(lambda: [Daemon("phoenix", tmp_path, free_port())])
    daemon.kill()  # SIGKILL: the socket file stays, its lock dies with the process
    assert Path(daemon.socket).is_socket()
    daemon.start()  # the leftover is replaced
    stop_cleanly(daemon)
    # A file that is not a socket at the path is someone's data: refused, untouched.
    other = tmp_path / "other"
    other.mkdir()
    not_a_socket = other / "s.sock"
    not_a_socket.write_text("keep me\n")
    said = refusal(kvpushd_run(write_config(other, other / "journal", {})))
    assert str(not_a_socket) in said and "not a socket" in said
    assert not_a_socket.read_text() == "keep me\n"


def test_run_help_says_what_the_defaults_are() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "daemon.cli", "run", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert proc.returncode == 0
    assert "no peer listener until secret_file is set" in proc.stdout
    assert "kvpushd: cannot start:" in proc.stdout and "exits 2" in proc.stdout


# ------------------------------------------------------------------ access


def _wait_logged(daemon: Daemon, event: str) -> None:
    """Until the daemon's log has ``event`` (its status, refused to us, cannot tell)."""
    while f'"event": "{event}"' not in daemon.logs():
        assert daemon.exited() is None, daemon.logs()
        time.sleep(0.05)


async def test_a_refused_connection_gets_not_allowed_which_the_client_raises(
    tmp_path: Path,
) -> None:
    # Nobody but uid 4249 (not us, root or not) and no group.
    extra = "allowed_uids = [4249]\nallowed_groups = []"
    daemon = Daemon("closed", tmp_path, free_port(), extra=extra).start(wait=False)
    try:
        _wait_logged(daemon, "ready")
        for _ in range(3):  # each time, whatever the client sent first
            with pytest.raises(RpcError) as info:
                await EngineClient.connect(daemon.socket, timeout=30)
            assert info.value.code == rpc.NOT_ALLOWED, info.value
            assert f"uid {os.getuid()}" in info.value.message
        status = subprocess.run(
            [sys.executable, "-m", "daemon.cli", "status", "--socket", daemon.socket],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=REPO,
        )
        assert status.returncode == 4 and "not_allowed" in status.stderr, status.stderr
        assert "Traceback" not in status.stderr
        assert "credentials not allowed" in daemon.logs()
        assert daemon.exited() is None, "a refusal does not stop the daemon"
    finally:
        assert daemon.stop() == 0, daemon.logs()
