"""Real ``kvpushd run`` processes on loopback: config, start, readiness, stop, kill.

The one way tests, benches, tools and ``kvpushd demo`` run real daemons.
A :class:`Daemon` writes its own config into a work folder (a node name, an
engine socket, a loopback listen port, a shared secret, its peers and a
journal folder), starts ``python -m daemon.cli run`` with its output in a
log file there, and asks it for its status over the engine socket
(:func:`daemon.ops.status.fetch_status`) until it answers.

Files of a daemon named ``N`` in its work folder ``W``::

    W/N.toml       the config it was started with
    W/N.log        what it wrote to stdout and stderr
    W/N-journal/   its journal
    W/secret       the shared secret of every daemon in W (0600)
    S/N.sock       its engine socket (S: ``socket_dir``, default W)

The secret: a config names ``W/secret``; when that file does not exist yet,
:meth:`Daemon.write_config` writes the daemon's ``secret`` there: the one
it was given, else a fresh random one of its own. Daemons of one work folder
share that file (the first to write its config writes it), so a pair in one
folder always authenticates each other; :func:`daemon_pair` also gives both
the same one. Daemons in different folders that must peer are given one
``secret`` (a secret nobody gave is never the same twice). The demo writes a
random one first (:func:`write_secret`).

A daemon runs in its work folder (its working directory), never in a
checkout: ``python -m daemon.cli`` imports the package the environment
holds (installed, or put on ``PYTHONPATH`` through ``env``).

Also here: the probes tests and tools read a daemon process with
(CPU time, RSS, open descriptors, mapped files, all from ``/proc``).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from daemon.ops.status import NotRunning, StatusUnavailable, fetch_status

# What a status poll raises while a daemon is not (or no longer) serving.
STATUS_ERRORS: Final = (NotRunning, StatusUnavailable)


@dataclass(frozen=True)
class Timing:
    """The liveness settings of a generated config."""

    heartbeat_s: float
    peer_ttl_s: float
    drain_s: float


# Generous: a loaded 2-core CI box must not declare a live peer dead.
TEST_TIMING: Final = Timing(heartbeat_s=0.2, peer_ttl_s=3.0, drain_s=2.0)


# ------------------------------------------------------------------ helpers

# Below the kernel's ephemeral range (32768-60999 here): a port the kernel
# hands out with bind(0) can be taken again as the local port of any outgoing
# connection before the daemon binds it; one chosen here cannot.
_PORTS = range(20000, 32000)


def free_port() -> int:
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.choice(_PORTS)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below the ephemeral range")


def new_secret() -> bytes:
    """A fresh random peer secret (64 hex digits: 256 bits, no line break to strip)."""
    return secrets.token_hex(32).encode()


def write_secret(path: Path, secret: bytes | None = None) -> None:
    """A secret file, created 0600 (never world-readable, not even briefly).

    ``secret`` defaults to a fresh random one. The file appears whole or not
    at all (written aside, then linked into place), so a daemon started
    meanwhile never reads it half written; FileExistsError if it exists.
    """
    aside = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
    fd = os.open(aside, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write((secret or new_secret()) + b"\n")
        os.link(aside, path)
    finally:
        os.unlink(aside)


def toml_string(text: str) -> str:
    """A TOML basic string (paths may hold quotes or backslashes)."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the parent dies (Linux prctl PR_SET_PDEATHSIG)."""
    pr_set_pdeathsig = 1
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


# ------------------------------------------------------------------ daemons


@dataclass
class Daemon:
    """One ``kvpushd run`` subprocess and the files it uses."""

    node: str
    workdir: Path
    port: int
    peers: list[tuple[str, int]] = field(default_factory=list)  # on this loopback
    # Config lines: top-level keys first, then tables (not [journal]: see journal_extra).
    extra: str = ""
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None
    # More keys for the [journal] table (a second [journal] in `extra` would be a TOML error).
    journal_extra: str = ""
    timing: Timing = TEST_TIMING
    socket_dir: Path | None = None  # default: the work folder
    # A session of its own (a Ctrl-C in the terminal does not reach it) and a
    # SIGTERM when the process that started it dies. Only for a starter that
    # starts daemons from its main thread: the kernel sends that SIGTERM when
    # the starting *thread* ends.
    detached: bool = False
    # Run the daemon under cProfile (harness/profiled.py), collecting
    # between profile(True) and profile(False), written here when it exits
    # (SIGTERM: ``stop``; a killed daemon writes none). For benches only
    # (bench/profile_lifecycle.py, which puts the harness on the daemon's
    # PYTHONPATH through ``env``): it profiles the loop thread alone.
    profile_to: Path | None = None
    profile_wall: bool = False  # the wall clock rather than the loop thread's CPU clock
    # Record the hand-overs inside the package to this file (harness.hoptrace).
    trace_to: Path | None = None
    # A host of its own (daemon/sim/hosts.py): the network namespace it runs
    # in and the address it listens on there; peers elsewhere by address.
    netns: str | None = None
    host: str = "127.0.0.1"
    peer_addresses: list[tuple[str, str]] = field(default_factory=list)  # (node, "ip:port")
    # Written to the work folder's secret file if it has none yet (else that
    # file's, shared by the folder's daemons, is the one used). Default: a
    # fresh random one, this daemon's own.
    secret: bytes = field(default_factory=new_secret, repr=False)

    def __post_init__(self) -> None:
        # Absolute: the daemon runs in its work folder, and reads these paths there.
        self.workdir = self.workdir.absolute()
        if self.socket_dir is not None:
            self.socket_dir = self.socket_dir.absolute()

    @property
    def socket(self) -> str:
        return str((self.socket_dir or self.workdir) / f"{self.node}.sock")

    @property
    def address(self) -> str:
        """Where its peers reach it: ``ip:port``."""
        return f"{self.host}:{self.port}"

    @property
    def journal(self) -> Path:
        return self.workdir / f"{self.node}-journal"

    @property
    def log_path(self) -> Path:
        return self.workdir / f"{self.node}.log"

    @property
    def config_path(self) -> Path:
        return self.workdir / f"{self.node}.toml"

    @property
    def secret_path(self) -> Path:
        return self.workdir / "secret"

    def write_config(self) -> Path:
        if not self.secret_path.exists():
            # Daemons of one folder may be started from several threads at once:
            # the first one writes its secret, which the others then share.
            with contextlib.suppress(FileExistsError):
                write_secret(self.secret_path, self.secret)
        lines = [
            f"node = {toml_string(self.node)}",
            f"socket = {toml_string(self.socket)}",
            f'listen = "{self.address}"',
            f"secret_file = {toml_string(str(self.secret_path))}",
            f"heartbeat_s = {self.timing.heartbeat_s}",
            f"peer_ttl_s = {self.timing.peer_ttl_s}",
            f"drain_s = {self.timing.drain_s}",
            'log_level = "info"',
        ]
        # Top-level keys from `extra` must come before the first table.
        lines += [self.extra] if self.extra else []
        peers = [(node, f"127.0.0.1:{port}") for node, port in self.peers] + self.peer_addresses
        for node, address in peers:
            lines += ["[[peers]]", f"node = {toml_string(node)}"]
            lines += [f"address = {toml_string(address)}"]
        lines += ["[journal]", f"dir = {toml_string(str(self.journal))}", 'fsync = "batch"']
        lines += [self.journal_extra] if self.journal_extra else []
        path = self.config_path
        path.write_text("\n".join(lines) + "\n")
        return path

    def start(self, *, wait: bool = True) -> Daemon:
        """Write the config and start the process; with ``wait``, until it serves."""
        config = self.write_config()
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
        detached: dict[str, Any] = {}
        if self.detached:
            detached = {
                "start_new_session": True,
                "preexec_fn": _die_with_parent if sys.platform.startswith("linux") else None,
            }
        with open(self.log_path, "ab") as log:
            entry = ["daemon.cli"]
            if self.profile_to is not None:
                clock = ["--wall"] if self.profile_wall else []
                entry = ["harness.profiled", *clock, str(self.profile_to)]
            elif self.trace_to is not None:
                entry = ["harness.hoptrace", str(self.trace_to)]
            argv = [sys.executable, "-m", *entry, "run", "--config", str(config)]
            if self.netns is not None:
                # `ip netns exec` execs the daemon: the pid is the daemon's.
                argv = ["ip", "netns", "exec", self.netns, *argv]
            self.proc = subprocess.Popen(
                argv,
                cwd=self.workdir,  # its own folder, whatever the caller's or a checkout's
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                **detached,
            )
        if wait:
            self.wait_ready()
        return self

    def profile(self, on: bool) -> None:
        """Start (or stop) collecting the profile (or trace) of a daemon started with
        ``profile_to`` (``trace_to``)."""
        if (self.profile_to is None and self.trace_to is None) or self.proc is None:
            raise RuntimeError(f"{self.node} was not started with profile_to or trace_to")
        self.proc.send_signal(signal.SIGUSR1 if on else signal.SIGUSR2)

    def exited(self) -> int | None:
        """The exit status once the process has ended; None while it runs (or never ran)."""
        return None if self.proc is None else self.proc.poll()

    def wait_ready(self, timeout: float = 30.0) -> dict:
        """Poll status until the daemon answers; RuntimeError if it exits first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"{self.node} exited {self.proc.returncode}:\n{self.logs()}")
            try:
                return self.status(timeout=2.0)
            except STATUS_ERRORS:
                time.sleep(0.05)
        raise TimeoutError(f"{self.node} not ready:\n{self.logs()}")

    def wait_peer(self, peer: str, timeout: float = 20.0) -> None:
        """Until this daemon sees ``peer`` up."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(p["node"] == peer and p["up"] for p in self.status()["peers"]):
                return
            time.sleep(0.05)
        raise TimeoutError(f"{self.node} never saw {peer} up:\n{self.logs()}")

    def status(self, timeout: float = 5.0) -> dict:
        """One status round trip; raises one of :data:`STATUS_ERRORS` if none comes."""
        return fetch_status(self.socket, timeout)

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def quarantine(self, action: str = "list", timeout: float = 15.0) -> dict[str, Any]:
        """``kvpushd quarantine list`` (or ``clear --all``) on this daemon, as an operator runs it.

        Returns its ``--json`` document: ``quarantined`` (the pairings left)
        and ``cleared`` (their ids).
        """
        argv = [sys.executable, "-m", "daemon.cli", "quarantine", action, "--json"]
        argv += ["--all"] if action == "clear" else []
        argv += ["--socket", self.socket]
        if self.netns is not None:
            argv = ["ip", "netns", "exec", self.netns, *argv]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=True)
        document: dict[str, Any] = json.loads(done.stdout)
        return document

    def clear_quarantine(self, timeout: float = 15.0) -> list[str]:
        """Wait for a pairing to be quarantined here, then clear every one; the ids cleared.

        For tests whose negative control plants wrong KV on purpose: the
        decode's own K/V check catches it, and the report reaches this
        (prefill) daemon a moment after the request ended.
        """
        deadline = time.monotonic() + timeout
        while not self.quarantine()["quarantined"]:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.node}: no pairing was quarantined")
            time.sleep(0.1)
        cleared: list[str] = self.quarantine("clear")["cleared"]
        return cleared

    def journal_events(self, request_id: str) -> list[Any]:
        """The journaled events of one request, in order (read while the daemon runs)."""
        from daemon.journal.replay import replay

        events: list[Any] = []

        def collect(record: Any, touched: object) -> None:
            if getattr(record.event, "request_id", None) == request_id:
                events.append(record.event)

        replay(self.journal, on_record=collect)
        return events

    def stop(self, timeout: float = 15.0) -> int:
        """SIGTERM and wait for the exit status; a daemon that hangs is killed, then re-raised."""
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def wait_idle(*daemons: Daemon, timeout: float = 30.0) -> None:
    """Wait until no daemon holds a live request (releases go out asynchronously)."""
    deadline = time.monotonic() + timeout
    while any(daemon.status()["live"] for daemon in daemons):
        if time.monotonic() > deadline:
            raise AssertionError(
                f"still live after {timeout:.0f} s: "
                f"{[daemon.status()['requests'] for daemon in daemons]}"
            )
        time.sleep(0.1)


def daemon_pair(
    workdir: Path, *, extra: str = "", secret: bytes | None = None
) -> tuple[Daemon, Daemon]:
    """A prefill and a decode daemon that peer with each other (not started).

    Both hold one secret, ``secret`` or a fresh random one (and share their
    folder's secret file besides, which holds it unless it existed before).
    """
    p_port, d_port = free_port(), free_port()
    secret = secret or new_secret()
    prefill = Daemon("prefill", workdir, p_port, [("decode", d_port)], extra, secret=secret)
    decode = Daemon("decode", workdir, d_port, [("prefill", p_port)], extra, secret=secret)
    return prefill, decode


def start_daemons(make: Callable[[], Sequence[Daemon]], tries: int = 4) -> list[Daemon]:
    """Start daemons from ``make``; new ports and again if one lost its port to a race.

    free_port() only finds a port that was free a moment ago: other tests on
    the machine may take it before the daemon binds.
    """
    for attempt in range(tries):
        daemons = list(make())
        try:
            for daemon in daemons:
                daemon.start()
            return daemons
        except RuntimeError as exc:
            for daemon in daemons:
                daemon.kill()
            if "address already in use" not in str(exc) or attempt == tries - 1:
                raise
    raise AssertionError("unreachable")


def start_pair(
    workdir: Path,
    *,
    extra: str = "",
    prepare: Callable[[Daemon], None] | None = None,
    secret: bytes | None = None,
) -> tuple[Daemon, Daemon]:
    """A prefill and a decode daemon, started and peered.

    ``prepare`` is called on each daemon before it starts (and before each
    retry on a port clash), to set what its config does not say. ``secret``:
    the pair's (default: a fresh random one), for a test that speaks the
    peer protocol itself.
    """
    # One secret for every try: the folder's secret file outlives a try.
    secret = secret or new_secret()

    def make() -> tuple[Daemon, Daemon]:
        pair = daemon_pair(workdir, extra=extra, secret=secret)
        if prepare is not None:
            for daemon in pair:
                prepare(daemon)
        return pair

    prefill, decode = start_daemons(make)
    try:
        decode.wait_peer("prefill")
        prefill.wait_peer("decode")
    except BaseException:
        prefill.kill()
        decode.kill()
        raise
    return prefill, decode


# ------------------------------------------------------------ process probes


def cpu_seconds(pid: int) -> float:
    """User + system CPU a process has used so far, from /proc."""
    # The state and counters follow the command name, which may hold spaces.
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def thread_cpu(pid: int) -> dict[int, tuple[str, float]]:
    """Each live thread's name and on-CPU seconds, from /proc (nanosecond resolution).

    ``schedstat``'s first field is the time the thread ran; :func:`cpu_seconds`
    counts in clock ticks (10 ms), too coarse for an idle daemon. A thread
    that ends between two readings takes its time with it.
    """
    threads = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            ran_ns = int((task / "schedstat").read_text().split()[0])
            threads[int(task.name)] = ((task / "comm").read_text().strip(), ran_ns / 1e9)
    return threads


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for {pid}")


def fd_count(pid: int, settle_s: float = 1.0) -> int:
    """Open descriptors, once those of connections that just ended are closed too.

    The daemon closes its end of a finished status connection a moment after
    the client does; the lowest count over a short quiet spell excludes it.
    """

    def count() -> int:
        return len(os.listdir(f"/proc/{pid}/fd"))

    counts = [count()]
    deadline = time.monotonic() + settle_s
    while time.monotonic() < deadline and (len(counts) < 3 or len(set(counts[-3:])) > 1):
        time.sleep(0.05)
        counts.append(count())
    return min(counts)


def mapped_files(pid: int) -> set[str]:
    """Paths of every file mapped into the process (" (deleted)" stripped)."""
    paths = set()
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) == 6:
            paths.add(parts[5].removesuffix(" (deleted)"))
    return paths
