"""Test hosts: network namespaces joined by a bridge, so daemons talk over a real network stack.

Every other test runs its daemons on one loopback, where UCX moves data by
shared memory. :class:`Hosts` gives each simulated host a network namespace
of its own with one interface (``eth0``, a veth pair whose other end sits
on a bridge in the root namespace) and one address in a private /24. The
bridge has no address: the range exists only inside the namespaces made
here, and nothing of the machine's own networks is touched.

Namespaces still share /dev/shm, the PID space and the file system, so
Unix sockets (the engines' and the operator's) keep working from the
test process, and UCX would happily pick a shared-memory transport between
two "hosts". :data:`UCX_OVER_THE_NETWORK` forces the network path: UCX's
TCP transport only, on ``eth0`` only, with its protocol selection printed
(``UCX_PROTO_INFO``), so a test can read from UCX's own output which
transport carried a write (:func:`remote_writes`).

Faults, as a cluster has them:

- :meth:`Hosts.cut` / :meth:`Hosts.mend`: the host's link down and up (its
  veth's root end), a partition of that host from every other;
- :meth:`Hosts.partition` / :meth:`Hosts.heal`: two hosts stop reaching
  each other (blackhole routes both ways), every other path stays;
- :meth:`Hosts.drop_inbound`: packets *to* the host dropped (blackhole
  routes on the other hosts; this kernel has neither ``netem`` nor a ``tc``
  drop action), its own packets still arrive: loss in one direction only;
- :meth:`Hosts.lose`: every process of the host killed (SIGKILL) and its
  namespace deleted, as a machine that vanishes.

Everything made is removed on :meth:`Hosts.close` (a ``with`` block calls
it, also after a failure), and namespaces a crashed earlier run left behind
(their creator's pid is gone) are swept when a new :class:`Hosts` starts.
Needs root and ``ip`` (iproute2).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

PREFIX: Final = "kvp"  # every namespace, bridge and veth made here starts with it
NETNS_DIR: Final = Path("/var/run/netns")
CLONE_NEWNET: Final = 0x40000000

# UCX between two hosts: the network, never shared memory (see the module doc).
UCX_TCP: Final = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "eth0"}
# The same, printing which protocol and transport UCX chose for each operation.
UCX_OVER_THE_NETWORK: Final = {**UCX_TCP, "UCX_PROTO_INFO": "y"}


class HostsError(RuntimeError):
    """The namespaces could not be made (not root, no iproute2)."""


@dataclass
class Host:
    """One simulated host: its namespace, address and the root end of its link."""

    name: str
    netns: str
    address: str
    link: str  # the veth's end in the root namespace (on the bridge)
    alive: bool = True
    inbound_dropped: bool = False

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside this host's namespace."""
        return ["ip", "netns", "exec", self.netns, *argv]

    def pids(self) -> list[int]:
        """Every process in the namespace."""
        out = _ip("netns", "pids", self.netns, check=False)
        return [int(p) for p in out.split()]


@dataclass
class Hosts:
    """``names`` as hosts on one bridge; a context manager that removes all it made."""

    names: Sequence[str]
    subnet: int = 77  # addresses 10.<subnet>.<pid-derived>.<1..>
    hosts: dict[str, Host] = field(default_factory=dict)
    _bridge: str = ""

    def __post_init__(self) -> None:
        if os.geteuid() != 0:
            raise HostsError("test hosts need root (network namespaces, veth pairs)")
        sweep_stale()
        tag = f"{PREFIX}{os.getpid()}"
        self._bridge = f"{tag}br"
        third = os.getpid() % 250
        try:
            _ip("link", "add", self._bridge, "type", "bridge")
            _ip("link", "set", self._bridge, "up")
            for index, name in enumerate(self.names, start=1):
                self._add(name, f"{tag}n{index}", f"10.{self.subnet}.{third}.{index}", index)
        except BaseException:
            self.close()
            raise

    def _add(self, name: str, netns: str, address: str, index: int) -> None:
        link = f"{PREFIX}{os.getpid()}h{index}"
        inner = f"{PREFIX}{os.getpid()}i{index}"
        _ip("netns", "add", netns)
        host = self.hosts[name] = Host(name, netns, address, link)
        _ip("link", "add", link, "type", "veth", "peer", "name", inner)
        _ip("link", "set", inner, "netns", netns)
        _ip("link", "set", link, "master", self._bridge, "up")
        for argv in (
            ("link", "set", "lo", "up"),
            ("link", "set", inner, "name", "eth0"),
            ("addr", "add", f"{address}/24", "dev", "eth0"),
            ("link", "set", "eth0", "up"),
        ):
            _ip("-n", netns, *argv)
        del host

    def __enter__(self) -> Hosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    # ------------------------------------------------------------ faults

    def cut(self, name: str) -> None:
        """The host's link goes down: nothing reaches it, nothing leaves it."""
        _ip("link", "set", self.hosts[name].link, "down")

    def mend(self, name: str) -> None:
        """The host's link comes back (and inbound traffic flows again)."""
        host = self.hosts[name]
        if host.inbound_dropped:
            for other in self._others(name):
                _ip("-n", other.netns, "route", "del", "blackhole", f"{host.address}/32")
            host.inbound_dropped = False
        _ip("link", "set", host.link, "up")

    def drop_inbound(self, name: str) -> None:
        """Drop every packet to the host; its own packets still leave and arrive.

        The kernel here has no ``netem`` and no ``tc`` drop action, so every
        other host gets a blackhole route to this host's address: what they
        send it is discarded at their own IP layer, silently, as a lossy
        path would.
        """
        target = self.hosts[name]
        for host in self._others(name):
            _ip("-n", host.netns, "route", "replace", "blackhole", f"{target.address}/32")
        target.inbound_dropped = True

    def partition(self, a: str, b: str) -> None:
        """Hosts ``a`` and ``b`` stop reaching each other; each still reaches every other host."""
        for one, other in ((a, b), (b, a)):
            address = self.hosts[other].address
            _ip("-n", self.hosts[one].netns, "route", "replace", "blackhole", f"{address}/32")

    def heal(self, a: str, b: str) -> None:
        """Undo :meth:`partition`."""
        for one, other in ((a, b), (b, a)):
            address = self.hosts[other].address
            _ip("-n", self.hosts[one].netns, "route", "del", "blackhole", f"{address}/32")

    def _others(self, name: str) -> list[Host]:
        return [h for n, h in self.hosts.items() if n != name and h.alive]

    def lose(self, name: str) -> None:
        """The host vanishes: every process in it killed, its namespace and link gone.

        The link goes down first, as when a machine loses power: a killed
        process's sockets would otherwise send their FIN or RST, and the
        peers would learn of the loss at once instead of by silence.
        """
        host = self.hosts[name]
        self.cut(name)
        _kill_all(host)
        _ip("netns", "del", host.netns, check=False)
        _ip("link", "del", host.link, check=False)
        host.alive = False

    # ------------------------------------------------------------ cleanup

    def close(self) -> None:
        """Kill what runs in the namespaces, delete them, their links and the bridge."""
        for host in self.hosts.values():
            if host.alive:
                _kill_all(host)
                _ip("netns", "del", host.netns, check=False)
                _ip("link", "del", host.link, check=False)
                host.alive = False
        if self._bridge:
            _ip("link", "del", self._bridge, check=False)
            self._bridge = ""


def _kill_all(host: Host) -> None:
    pids = host.pids()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while host.pids() and time.monotonic() < deadline:
        time.sleep(0.02)


def sweep_stale() -> list[str]:
    """Delete namespaces and links of this module whose creating process is gone."""
    removed = []
    owner = re.compile(rf"^{PREFIX}(\d+)")
    names = _ip("netns", "list", check=False).split("\n")
    links = re.findall(rf"^\d+: ({PREFIX}\d+\w+)[@:]", _ip("-o", "link", "show"), re.M)
    for name in [line.split()[0] for line in names if line.strip()] + links:
        m = owner.match(name)
        if m is None or _alive(int(m[1])):
            continue
        if name in links:
            _ip("link", "del", name, check=False)
        else:
            stale = Host(name, name, "", "")
            _kill_all(stale)
            _ip("netns", "del", name, check=False)
        removed.append(name)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def entered(netns: str) -> Iterator[None]:
    """The calling thread inside ``netns`` (sockets it opens belong there), then back."""
    libc = ctypes.CDLL(None, use_errno=True)
    home = os.open(f"/proc/self/task/{threading.get_native_id()}/ns/net", os.O_RDONLY)
    target = os.open(NETNS_DIR / netns, os.O_RDONLY)
    try:
        if libc.setns(target, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {netns}")
        try:
            yield
        finally:
            if libc.setns(home, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "setns back")
    finally:
        os.close(target)
        os.close(home)


def enter_for_good(netns: str) -> None:
    """Move the calling thread into ``netns`` for the rest of its life (a child process's start)."""
    libc = ctypes.CDLL(None, use_errno=True)
    target = os.open(NETNS_DIR / netns, os.O_RDONLY)
    try:
        if libc.setns(target, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {netns}")
    finally:
        os.close(target)


@dataclass(frozen=True)
class UcxProtocol:
    """One of UCX's protocol tables (``UCX_PROTO_INFO=y``): what carries an operation to a peer."""

    scope: str  # "inter-node", "intra-node" or "self" (UCX's own judgement of the peer)
    operation: str  # e.g. "remote memory write by ucp_put* from host memory to host"
    transports: frozenset[str]  # e.g. {"tcp/eth0"}; shared memory shows as "cma/memory"...


_SCOPE: Final = re.compile(r"^\S+ (self|intra-node|inter-node) cfg#\d+$")


def ucx_protocols(lines: Iterable[str]) -> list[UcxProtocol]:
    """The protocol tables UCX printed, from raw or JSON-wrapped log lines.

    A table is a header cell naming the context and the peer's scope, a cell
    naming the operation, then rows of message-size range, protocol and
    transport(s).
    """
    tables: list[tuple[str, list[str], set[str]]] = []
    for raw in lines:
        line = _event(raw)
        if line.count("|") < 2:
            continue
        cells = [c.strip() for c in line[line.index("|") + 1 : line.rindex("|")].split("|")]
        if len(cells) == 1:
            scope = _SCOPE.match(cells[0])
            if scope:
                tables.append((scope[1], [], set()))
            elif tables and not tables[-1][1]:
                tables[-1][1].append(cells[0])
        elif tables and len(cells) >= 3:
            tables[-1][2].update(t for t in re.split(r"[\s,]+", cells[-1]) if "/" in t)
    return [
        UcxProtocol(scope, operation[0] if operation else "", frozenset(transports))
        for scope, operation, transports in tables
    ]


def remote_writes(lines: Iterable[str]) -> list[UcxProtocol]:
    """The tables of remote memory writes (NIXL's WRITE) to other agents (not to itself)."""
    return [
        p
        for p in ucx_protocols(lines)
        if p.operation.startswith("remote memory write") and p.scope != "self"
    ]


def _event(raw: str) -> str:
    """A log line's text: the ``event`` of a JSON line (the daemon's), else the line."""
    if raw.startswith("{"):
        with contextlib.suppress(ValueError):
            return str(json.loads(raw).get("event", ""))
    return raw


def _ip(*argv: str, check: bool = True) -> str:
    return _run(["ip", *argv], check)


def _run(argv: list[str], check: bool) -> str:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    except FileNotFoundError as exc:
        raise HostsError(f"{argv[0]} is not installed (iproute2)") from exc
    if check and done.returncode != 0:
        raise HostsError(f"{' '.join(argv)}: {done.stderr.strip() or done.returncode}")
    return done.stdout
