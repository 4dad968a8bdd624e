"""Real daemon processes for end-to-end tests: configs, start, readiness, kill."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from daemon.framing import PREFIX_BYTES, FrameEncoder
from daemon.sim.demo import free_port
from schemas import rpc

REPO = Path(__file__).resolve().parents[1]


def cpu_seconds(pid: int) -> float:
    """User + system CPU a process has used so far, from /proc."""
    # The state and counters follow the command name, which may hold spaces.
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def status(sock_path: str, timeout: float = 5.0) -> dict:
    """One blocking status round trip over the engine socket."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(sock_path)
        s.sendall(FrameEncoder().encode(rpc.Status(id=1)))
        header = _recv_exact(s, PREFIX_BYTES)
        body = _recv_exact(s, int.from_bytes(header, "big"))
    reply = msgspec.msgpack.decode(body, type=rpc.ServerMessage)
    assert isinstance(reply, rpc.StatusReply), reply
    return reply.status


def _recv_exact(s: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = s.recv(n - len(data))
        if not chunk:
            raise ConnectionError("daemon closed the connection")
        data += chunk
    return data


@dataclass
class Daemon:
    node: str
    workdir: Path
    port: int
    peers: list[tuple[str, int]] = field(default_factory=list)
    extra: str = ""
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None
    # More keys for the [journal] table (a second [journal] in `extra` would be a TOML error).
    journal_extra: str = ""

    @property
    def socket(self) -> str:
        return str(self.workdir / f"{self.node}.sock")

    @property
    def journal(self) -> Path:
        return self.workdir / f"{self.node}-journal"

    @property
    def log_path(self) -> Path:
        return self.workdir / f"{self.node}.log"

    def write_config(self) -> Path:
        secret = self.workdir / "secret"
        if not secret.exists():
            secret.write_text("test-secret-0123456789abcdef\n")
            secret.chmod(0o600)
        lines = [
            f'node = "{self.node}"',
            f'socket = "{self.socket}"',
            f'listen = "127.0.0.1:{self.port}"',
            f'secret_file = "{secret}"',
            "heartbeat_s = 0.2",
            # Generous: a loaded 2-core CI box must not declare a live peer dead.
            "peer_ttl_s = 3.0",
            "drain_s = 2.0",
            'log_level = "info"',
        ]
        # Top-level keys from `extra` must come before the first table.
        lines += [self.extra]
        for node, port in self.peers:
            lines += ["[[peers]]", f'node = "{node}"', f'address = "127.0.0.1:{port}"']
        lines += ["[journal]", f'dir = "{self.journal}"', 'fsync = "batch"', self.journal_extra]
        path = self.workdir / f"{self.node}.toml"
        path.write_text("\n".join(lines) + "\n")
        return path

    def start(self, *, wait: bool = True) -> Daemon:
        config = self.write_config()
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
        log = open(self.log_path, "ab")  # noqa: SIM115 - owned by the child
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "daemon.cli", "run", "--config", str(config)],
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        log.close()
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self, timeout: float = 30.0) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"{self.node} exited {self.proc.returncode}:\n{self.logs()}")
            try:
                return status(self.socket, timeout=2.0)
            except (OSError, ConnectionError):
                time.sleep(0.05)
        raise TimeoutError(f"{self.node} not ready:\n{self.logs()}")

    def wait_peer(self, peer: str, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(p["node"] == peer and p["up"] for p in status(self.socket)["peers"]):
                return
            time.sleep(0.05)
        raise TimeoutError(f"{self.node} never saw {peer} up:\n{self.logs()}")

    def status(self) -> dict:
        return status(self.socket)

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self, timeout: float = 15.0) -> int:
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


def daemon_pair(tmp_path: Path, *, extra: str = "") -> tuple[Daemon, Daemon]:
    """A prefill and a decode daemon that peer with each other (not started)."""
    p_port, d_port = free_port(), free_port()
    prefill = Daemon("prefill", tmp_path, p_port, [("decode", d_port)], extra)
    decode = Daemon("decode", tmp_path, d_port, [("prefill", p_port)], extra)
    return prefill, decode
