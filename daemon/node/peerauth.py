"""One peer connection before it is a link: its frames and its authentication.

The challenge-response handshake is described in daemon/node/peerlink.py
(step 1); :class:`Wire` carries frames in and out of one connection and
knows nothing of the protocol. Also here: the errors and close reasons of
peer links, and the cluster secret.
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
import hmac
import os
import secrets
import stat
import struct
from collections.abc import Callable
from typing import Final, TypeVar

import msgspec
import structlog

from daemon.framing import EmptyFrame, FrameReader, FrameTooLarge, FrameWriter
from schemas.peer import (
    PEER_PROTOCOL,
    Answer,
    Challenge,
    Goodbye,
    PeerMessage,
    Welcome,
)

NONCE_BYTES: Final = 32
# After close, how long buffered bytes (the Goodbye) may take to drain before
# the socket is aborted; a peer that is not reading must not pin the fd.
_CLOSE_GRACE_S: Final = 1.0
_SHORT_SECRET_BYTES: Final = 16
# Before authentication only Challenge/Answer/Welcome travel, all tiny: an
# anonymous connection must not make us buffer max_frame_bytes.
PREAUTH_FRAME_BYTES: Final = 16 * 1024

_log = structlog.get_logger("kvpushd.peer")
_DECODER: Final = msgspec.msgpack.Decoder(PeerMessage)
_FIELD_LENGTH: Final = struct.Struct(">I")
_M = TypeVar("_M")


class LinkReason(enum.StrEnum):
    """Goodbye reasons this module sends and ``on_down`` reasons it reports.

    ``on_down`` also reports ``"peer:" + reason`` when the peer said Goodbye,
    and whatever reason the daemon passed to :meth:`PeerLink.close`.
    """

    AUTH_FAILED = "auth_failed"  # a MAC did not verify: the secrets differ
    UNKNOWN_NODE = "unknown_node"  # the dialer is not a configured peer (or names us)
    UNEXPECTED_NODE = "unexpected_node"  # the acceptor is not the peer we dialed
    WRONG_DIRECTION = "wrong_direction"  # the dialer's name sorts after ours
    PROTOCOL_MISMATCH = "protocol_mismatch"
    PROTOCOL_ERROR = "protocol_error"  # a valid message at the wrong time
    HANDSHAKE_TIMEOUT = "handshake_timeout"
    BAD_FRAME = "bad_frame"  # oversized, empty, undecodable, unknown tag
    PEER_TTL = "peer_ttl"  # nothing heard for peer_ttl_s
    PEER_CLOSED = "peer_closed"  # EOF or a socket error
    REPLACED = "replaced"  # a newer connection from the same peer took over
    BACKPRESSURE = "backpressure"  # the peer stopped reading
    INTERNAL_ERROR = "internal_error"  # a daemon callback raised
    SHUTDOWN = "shutdown"  # PeerManager.close()
    BUSY = "busy"  # too many inbound connections authenticating at once
    IDLE = "idle"  # an on-demand link no live request needed for idle_close_s
    DUPLICATE = "duplicate"  # both sides dialed at once: the lower name's connection stays
    CONNECT_FAILED = "connect_failed"  # an on-demand dial found nobody at the address


class Direction(enum.StrEnum):
    DIALED = "dialed"
    ACCEPTED = "accepted"


class PeerLinkError(Exception):
    """Base of this module's errors."""


class SecretFileError(PeerLinkError, ValueError):
    """The shared secret file is missing, empty or readable by others."""


class LinkAborted(PeerLinkError):
    """A connection must end; ``notify_peer``: say Goodbye(reason, message) first."""

    def __init__(self, reason: str, message: str, *, notify_peer: bool = True) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.message = message
        self.notify_peer = notify_peer


class PeerAuthError(LinkAborted):
    """The peer failed authentication (or we could not authenticate to it)."""


class PeerUnreachable(PeerLinkError):
    """An on-demand dial did not give an authenticated link (see PeerManager.connect).

    ``reason`` is a :class:`LinkReason` value (``connect_failed``,
    ``handshake_timeout``, ``auth_failed``...), ``"peer:" + reason`` when the
    peer refused us, or the reason the daemon's ``on_up`` refused the peering.
    """

    def __init__(self, node: str, address: str, reason: str, message: str) -> None:
        super().__init__(f"cannot link to peer {node!r} at {address}: {reason}: {message}")
        self.node = node
        self.address = address
        self.reason = reason
        self.message = message


class PeerRejected(PeerLinkError):
    """Raised by the daemon's ``on_up`` to refuse a peering (e.g. incompatible layouts).

    The link sends ``Goodbye(reason, message)`` and closes; ``on_down`` is not
    called for it. A dialer backs off before trying again.
    """

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.message = message


# --------------------------------------------------------------------------
# secret and MACs


def load_secret(path: str | os.PathLike[str]) -> bytes:
    """The shared secret in ``path``, trailing CR/LF stripped.

    Refuses a file that group or other may access (the secret is the only
    thing between the network and the peer link) and an empty secret.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise SecretFileError(f"cannot open peer secret file {path}: {exc.strerror}") from exc
    with os.fdopen(fd, "rb") as file:
        # fstat the open file, not the path, so a swap between check and read
        # cannot slip a different file in.
        info = os.fstat(file.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise SecretFileError(f"peer secret file {path} is not a regular file")
        mode = stat.S_IMODE(info.st_mode)
        if mode & 0o077:
            raise SecretFileError(
                f"peer secret file {path} has mode {mode:04o}: group/other may access it; "
                f"chmod 600 it"
            )
        secret = file.read().rstrip(b"\r\n")
    if not secret:
        raise SecretFileError(f"peer secret file {path} is empty")
    if len(secret) < _SHORT_SECRET_BYTES:
        _log.warning("peer_secret_short", path=str(path), length=len(secret))
    return secret


def auth_mac(secret: bytes, label: bytes, nonce: bytes, first: str, second: str) -> bytes:
    """HMAC-SHA256 over label, nonce and two node names.

    Each field is prefixed with its 4-byte big-endian length, so no two
    different (label, nonce, first, second) tuples share an encoding: names
    like ("ab", "c") and ("a", "bc") cannot be confused.
    """
    mac = hmac.new(secret, digestmod=hashlib.sha256)
    for field in (label, nonce, first.encode(), second.encode()):
        mac.update(_FIELD_LENGTH.pack(len(field)))
        mac.update(field)
    return mac.digest()


def node_name(node: str) -> str:
    """A node name for logs and Goodbyes; an unauthenticated one may be huge."""
    return repr(node if len(node) <= 64 else node[:64] + "...")


def parse_host_port(address: str) -> tuple[str, int]:
    """``"host:port"`` or ``"[v6]:port"`` -> (host, port); port 0 is allowed."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"expected host:port, got {address!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


# --------------------------------------------------------------------------
# one TCP connection, before and after authentication


class Wire:
    """Frames in and out of one connection; knows nothing of the protocol.

    Frames sent in one loop iteration leave together, in order, in one
    socket write (daemon/framing.py ``FrameWriter``); frames that arrive
    together are read with one await (``FrameReader``).
    """

    __slots__ = (
        "_frames",
        "_in",
        "_reader",
        "_writer",
        "max_frame_bytes",
        "peername",
        "recv_limit",
    )

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, max_frame_bytes: int
    ) -> None:
        self._reader = reader
        self._writer = writer
        self._frames = FrameWriter(writer)
        self._in = FrameReader(reader)
        self.max_frame_bytes = max_frame_bytes
        self.recv_limit = min(PREAUTH_FRAME_BYTES, max_frame_bytes)  # raised after auth
        peer = writer.get_extra_info("peername")
        self.peername = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)

    @property
    def closing(self) -> bool:
        return self._writer.transport.is_closing()

    @property
    def buffered(self) -> int:
        """Bytes sent and not yet on the socket: the transport's, and this iteration's frames."""
        return self._writer.transport.get_write_buffer_size() + self._frames.pending

    async def recv(self) -> PeerMessage:
        """The next message; EOF and socket errors propagate as OSError/IncompleteReadError."""
        try:
            body = await self._in.read(self.recv_limit)
        except (FrameTooLarge, EmptyFrame) as exc:
            raise LinkAborted(LinkReason.BAD_FRAME, str(exc)) from exc
        try:
            return _DECODER.decode(body)
        except msgspec.DecodeError as exc:  # ValidationError (unknown tag...) included
            raise LinkAborted(LinkReason.BAD_FRAME, f"undecodable peer message: {exc}") from exc

    def send(self, message: PeerMessage) -> bool:
        """Queue ``message``; False if the connection is closing.

        A message over ``max_frame_bytes`` raises FrameTooLarge (the peer
        would refuse it and drop the link), queued or not.
        """
        if self.closing:
            length = len(msgspec.msgpack.encode(message))
            if length > self.max_frame_bytes:
                raise FrameTooLarge(length, self.max_frame_bytes)
            return False
        self._frames.send(message, self.max_frame_bytes)
        return True

    def close(self, goodbye: Goodbye | None) -> None:
        """Say goodbye if asked and possible, then close; idempotent, never blocks."""
        transport = self._writer.transport
        if not transport.is_closing():
            if goodbye is not None:
                self._frames.send(goodbye)
            self._frames.flush()  # what was sent, then the goodbye, before the close
            transport.close()
            if transport.get_write_buffer_size():
                asyncio.get_running_loop().call_later(_CLOSE_GRACE_S, transport.abort)
        # Wake a reader blocked on this connection now, rather than when the
        # transport gets round to connection_lost (which waits for the flush).
        self._reader.feed_eof()


async def expect(wire: Wire, kind: type[_M]) -> _M:
    """The next message, which must be ``kind``; a Goodbye ends the handshake."""
    message = await wire.recv()
    if isinstance(message, Goodbye):
        raise LinkAborted(f"peer:{message.reason}", message.message, notify_peer=False)
    if not isinstance(message, kind):
        raise LinkAborted(
            LinkReason.PROTOCOL_ERROR,
            f"expected {kind.__name__}, got {type(message).__name__}",
        )
    return message


async def accept_auth(
    wire: Wire, me: str, secret: bytes, check_dialer: Callable[[str], None]
) -> str:
    """Acceptor side of the handshake; returns the authenticated dialer's name."""
    nonce_a = secrets.token_bytes(NONCE_BYTES)
    wire.send(Challenge(node=me, nonce=nonce_a))
    answer = await expect(wire, Answer)
    check_dialer(answer.node)
    if len(answer.nonce) != NONCE_BYTES:
        raise PeerAuthError(LinkReason.AUTH_FAILED, f"nonce must be {NONCE_BYTES} bytes")
    expected = auth_mac(secret, b"dial", nonce_a, answer.node, me)
    if not hmac.compare_digest(expected, answer.mac):
        raise PeerAuthError(LinkReason.AUTH_FAILED, "bad MAC: the shared secrets differ")
    wire.send(Welcome(mac=auth_mac(secret, b"accept", answer.nonce, me, answer.node)))
    return answer.node


async def dial_auth(wire: Wire, me: str, secret: bytes, expected_peer: str) -> None:
    """Dialer side of the handshake; returns once the acceptor proved the secret."""
    challenge = await expect(wire, Challenge)
    if challenge.protocol != PEER_PROTOCOL:
        raise PeerAuthError(
            LinkReason.PROTOCOL_MISMATCH,
            f"peer speaks protocol {challenge.protocol}, we speak {PEER_PROTOCOL}",
        )
    if challenge.node != expected_peer:
        raise PeerAuthError(
            LinkReason.UNEXPECTED_NODE,
            f"dialed {expected_peer!r} but {node_name(challenge.node)} answered",
        )
    if len(challenge.nonce) != NONCE_BYTES:
        raise PeerAuthError(LinkReason.AUTH_FAILED, f"nonce must be {NONCE_BYTES} bytes")
    nonce_b = secrets.token_bytes(NONCE_BYTES)
    mac = auth_mac(secret, b"dial", challenge.nonce, me, expected_peer)
    wire.send(Answer(node=me, nonce=nonce_b, mac=mac))
    welcome = await expect(wire, Welcome)
    expected = auth_mac(secret, b"accept", nonce_b, expected_peer, me)
    if not hmac.compare_digest(expected, welcome.mac):
        raise PeerAuthError(LinkReason.AUTH_FAILED, "bad MAC: the shared secrets differ")
