"""Tests of the authenticated peer link (daemon/node/peerlink.py).

Real TCP on 127.0.0.1 (port 0), real asyncio; raw sockets play attackers and
broken peers; one test SIGSTOPs a peer running in a subprocess.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import uvloop

import daemon.node.peerlink
from daemon.framing import FrameEncoder, FrameTooLarge, frame_bytes, read_frame
from daemon.node.peerauth import (
    NONCE_BYTES,
    PREAUTH_FRAME_BYTES,
    LinkReason,
    PeerRejected,
    PeerUnreachable,
    SecretFileError,
    auth_mac,
    load_secret,
    parse_host_port,
)
from daemon.node.peerlink import PeerLink, PeerManager
from schemas.config import PeerConfig
from schemas.peer import (
    PEER_PROTOCOL,
    Answer,
    Challenge,
    Forward,
    Goodbye,
    Heartbeat,
    Hello,
    PeerMessage,
    Welcome,
)

SECRET = b"test-secret-0123456789abcdef"
HB = 0.05
TTL = 0.5
FAST: dict[str, Any] = {
    "heartbeat_s": HB,
    "peer_ttl_s": TTL,
    "handshake_timeout_s": 1.0,
    "backoff_s": (0.05, 0.3),
}
NOWHERE = "127.0.0.1:1"  # address of a peer that dials us: never used
REPO = Path(__file__).resolve().parent.parent
DECODER = msgspec.msgpack.Decoder(PeerMessage)


# --------------------------------------------------------------------------
# helpers


def hello_for(node: str, boot_id: str) -> Hello:
    return Hello(
        node=node, boot_id=boot_id, agent_name=f"agent-{node}", agent_metadata=b"md", engines=()
    )


def forward(i: int) -> Forward:
    return Forward(request_id=f"r{i}", incarnation=i, engine_id="e", blocks=((i,),), per_logical=1)


class Recorder:
    """The daemon side of a PeerManager: records every callback."""

    def __init__(self, reject: PeerRejected | None = None) -> None:
        self.ups: list[tuple[str, str]] = []  # (node, boot_id)
        self.downs: list[tuple[str, str]] = []
        self.messages: list[tuple[str, PeerMessage]] = []
        self.links: list[PeerLink] = []
        self.reject = reject

    def on_up(self, node: str, hello: Hello, link: PeerLink) -> None:
        self.ups.append((node, hello.boot_id))
        self.links.append(link)
        if self.reject is not None:
            raise self.reject

    def on_message(self, node: str, message: PeerMessage) -> None:
        self.messages.append((node, message))

    def on_down(self, node: str, reason: str) -> None:
        self.downs.append((node, reason))


async def eventually(predicate: Callable[[], bool], timeout: float = 3.0) -> None:
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.01)


class Cluster:
    """Creates PeerManagers and closes them all at the end of a test."""

    def __init__(self) -> None:
        self.managers: list[PeerManager] = []

    async def start(
        self,
        node: str,
        peers: list[PeerConfig],
        *,
        recorder: Recorder | None = None,
        secret: bytes = SECRET,
        boot_id: str | None = None,
        listen: str = "127.0.0.1:0",
        **overrides: Any,
    ) -> tuple[PeerManager, Recorder]:
        rec = recorder or Recorder()
        boot = boot_id or f"{node}-boot-1"
        manager = PeerManager(
            node,
            secret,
            listen,
            peers,
            hello=lambda peer: hello_for(node, boot),
            on_up=rec.on_up,
            on_message=rec.on_message,
            on_down=rec.on_down,
            **{**FAST, **overrides},
        )
        await manager.start()
        self.managers.append(manager)
        return manager, rec

    async def pair(self, **overrides: Any) -> tuple[PeerManager, Recorder, PeerManager, Recorder]:
        """'a' dials 'b' (a sorts lower); returns once both saw on_up."""
        b, rb = await self.start("b", [PeerConfig("a", NOWHERE)], **overrides)
        a, ra = await self.start("a", [PeerConfig("b", f"127.0.0.1:{b.listen_port}")], **overrides)
        await eventually(lambda: bool(ra.ups and rb.ups))
        return a, ra, b, rb

    async def close(self) -> None:
        for manager in self.managers:
            await manager.close()
        while Raw.opened:
            Raw.opened.pop().close()


@pytest.fixture
async def cluster() -> AsyncIterator[Cluster]:
    c = Cluster()
    try:
        yield c
    finally:
        await c.close()


class Raw:
    """A raw TCP client or server-side connection: no protocol logic at all."""

    opened: list[Raw] = []  # closed by the cluster fixture: no ResourceWarnings

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.encoder = FrameEncoder()
        Raw.opened.append(self)

    @classmethod
    async def connect(cls, port: int) -> Raw:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        return cls(reader, writer)

    def send(self, message: PeerMessage) -> None:
        self.writer.write(self.encoder.encode(message))

    def send_raw(self, data: bytes) -> None:
        self.writer.write(data)

    async def recv(self, timeout: float = 2.0) -> PeerMessage:
        async with asyncio.timeout(timeout):
            return DECODER.decode(await read_frame(self.reader, 1 << 20))

    async def recv_all(self, timeout: float = 2.0) -> list[PeerMessage]:
        """Every message until the other side closes the connection."""
        out: list[PeerMessage] = []
        async with asyncio.timeout(timeout):
            while True:
                try:
                    out.append(DECODER.decode(await read_frame(self.reader, 1 << 20)))
                except (asyncio.IncompleteReadError, ConnectionError):
                    return out

    async def dial_auth(self, me: str, acceptor: str, secret: bytes = SECRET) -> Answer:
        """Act as a correct dialer; returns the Answer sent (for replays)."""
        challenge = await self.recv()
        assert isinstance(challenge, Challenge)
        answer = Answer(
            node=me,
            nonce=secrets.token_bytes(NONCE_BYTES),
            mac=auth_mac(secret, b"dial", challenge.nonce, me, acceptor),
        )
        self.send(answer)
        welcome = await self.recv()
        assert isinstance(welcome, Welcome)
        assert welcome.mac == auth_mac(secret, b"accept", answer.nonce, acceptor, me)
        return answer

    def close(self) -> None:
        self.writer.close()


async def goodbye_reason(raw: Raw) -> str:
    """The reason of the Goodbye the other side sent before closing."""
    messages = await raw.recv_all()
    assert messages, "connection closed without a Goodbye"
    last = messages[-1]
    assert isinstance(last, Goodbye), messages
    return last.reason


class FakeAcceptor:
    """A raw server that plays the acceptor's part with a script."""

    def __init__(self, script: Callable[[Raw], Any]) -> None:
        self.script = script
        self.outcomes: asyncio.Queue[Any] = asyncio.Queue()
        self.server: asyncio.Server | None = None
        self.port = 0

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        raw = Raw(reader, writer)
        try:
            await self.outcomes.put(await self.script(raw))
        except Exception as exc:
            await self.outcomes.put(exc)
        finally:
            raw.close()

    async def close(self) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()


# --------------------------------------------------------------------------
# secret file and helpers


def test_load_secret_strips_newline(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    path.write_bytes(b"correct horse battery staple\n")
    path.chmod(0o600)
    assert load_secret(path) == b"correct horse battery staple"


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o644, 0o660])
def test_load_secret_refuses_group_or_other_access(tmp_path: Path, mode: int) -> None:
    path = tmp_path / "secret"
    path.write_bytes(b"correct horse battery staple")
    path.chmod(mode)
    with pytest.raises(SecretFileError, match=f"mode {mode:04o}"):
        load_secret(path)


@pytest.mark.parametrize("content", [b"", b"\n", b"\r\n"])
def test_load_secret_refuses_empty(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "secret"
    path.write_bytes(content)
    path.chmod(0o600)
    with pytest.raises(SecretFileError, match="empty"):
        load_secret(path)


def test_load_secret_missing_file_is_a_clear_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot open"):
        load_secret(tmp_path / "nope")


def test_mac_fields_are_length_prefixed() -> None:
    nonce = bytes(NONCE_BYTES)
    assert auth_mac(SECRET, b"dial", nonce, "ab", "c") != auth_mac(
        SECRET, b"dial", nonce, "a", "bc"
    )
    assert auth_mac(SECRET, b"dial", nonce, "a", "b") != auth_mac(
        SECRET, b"accept", nonce, "a", "b"
    )


def test_parse_host_port() -> None:
    assert parse_host_port("127.0.0.1:0") == ("127.0.0.1", 0)
    assert parse_host_port("[::1]:7700") == ("::1", 7700)
    for bad in ("nohost", ":80", "h:", "h:99999", "h:x"):
        with pytest.raises(ValueError):
            parse_host_port(bad)


def test_manager_refuses_bad_settings() -> None:
    def make(**kw: Any) -> PeerManager:
        args: dict[str, Any] = {
            "hello": lambda: hello_for("a", "x"),
            "on_up": lambda *_: None,
            "on_message": lambda *_: None,
            "on_down": lambda *_: None,
        }
        return PeerManager(kw.pop("node", "a"), kw.pop("secret", SECRET), "", [], **args, **kw)

    with pytest.raises(ValueError, match="secret"):
        make(secret=b"")
    with pytest.raises(ValueError, match="heartbeat_s"):
        make(heartbeat_s=5.0, peer_ttl_s=5.0)


# --------------------------------------------------------------------------
# handshake and delivery


async def _ordered_delivery(cluster: Cluster) -> None:
    a, ra, b, rb = await cluster.pair()
    assert ra.ups == [("b", "b-boot-1")]
    assert rb.ups == [("a", "a-boot-1")]
    assert ra.links[0].direction == "dialed" and rb.links[0].direction == "accepted"
    assert a.is_up("b") and b.is_up("a")

    count = 300
    for i in range(count):
        assert a.send("b", forward(i))
        assert b.send("a", forward(-i))
    await eventually(lambda: len(ra.messages) == count and len(rb.messages) == count)
    assert [m for _, m in rb.messages] == [forward(i) for i in range(count)]
    assert [m for _, m in ra.messages] == [forward(-i) for i in range(count)]
    assert {n for n, _ in rb.messages} == {"a"}

    (info,) = a.links
    assert info.node == "b" and info.up and info.boot_id == "b-boot-1"
    assert info.last_heard_age_s is not None and info.last_heard_age_s < TTL
    assert not a.send("nobody", forward(0))
    # Heartbeats keep an idle link up well past the TTL.
    await asyncio.sleep(TTL * 2)
    assert a.is_up("b") and b.is_up("a") and not ra.downs and not rb.downs


async def test_handshake_and_ordered_delivery_both_ways(cluster: Cluster) -> None:
    await _ordered_delivery(cluster)


def test_handshake_and_ordered_delivery_under_uvloop() -> None:
    """The daemon runs on uvloop: the same scenario on a uvloop event loop."""

    async def scenario() -> None:
        c = Cluster()
        try:
            await _ordered_delivery(c)
        finally:
            await c.close()

    uvloop.run(scenario())


async def test_send_refuses_oversized_message_and_down_link(cluster: Cluster) -> None:
    a, _, _, rb = await cluster.pair(max_frame_bytes=1024)
    huge = Forward("r", 1, "e", (tuple(range(2000)),), 1)
    with pytest.raises(FrameTooLarge):
        a.send("b", huge)
    assert a.is_up("b")  # refusing locally does not hurt the link
    link = rb.links[0]
    link.close("test", "closed by the test")
    assert not link.send(forward(1))
    assert rb.downs == [("a", "test")]


async def test_close_sends_goodbye_and_peer_reports_its_reason(cluster: Cluster) -> None:
    _, ra, _, rb = await cluster.pair()
    rb.links[0].close("draining", "bye")
    await eventually(lambda: bool(ra.downs))
    assert ra.downs == [("b", "peer:draining")]
    assert rb.downs == [("a", "draining")]
    # The dialer comes back on its own.
    await eventually(lambda: len(ra.ups) == 2 and len(rb.ups) == 2)


# --------------------------------------------------------------------------
# authentication failures


async def test_wrong_secret_refused_on_both_sides(cluster: Cluster) -> None:
    b, rb = await cluster.start("b", [PeerConfig("a", NOWHERE)])
    _, ra = await cluster.start(
        "a", [PeerConfig("b", f"127.0.0.1:{b.listen_port}")], secret=b"another-secret-entirely"
    )
    await asyncio.sleep(0.5)
    assert ra.ups == [] and rb.ups == []
    assert not b.is_up("a")

    # What the acceptor says to a dialer with the wrong secret.
    raw = await Raw.connect(b.listen_port)
    challenge = await raw.recv()
    assert isinstance(challenge, Challenge) and challenge.node == "b"
    raw.send(
        Answer("a", secrets.token_bytes(32), auth_mac(b"wrong", b"dial", challenge.nonce, "a", "b"))
    )
    assert await goodbye_reason(raw) == LinkReason.AUTH_FAILED
    assert rb.ups == []


async def test_dialer_refuses_acceptor_with_wrong_secret(cluster: Cluster) -> None:
    async def script(raw: Raw) -> list[PeerMessage]:
        raw.send(Challenge("b", secrets.token_bytes(32)))
        answer = await raw.recv()
        assert isinstance(answer, Answer)
        raw.send(Welcome(auth_mac(b"wrong", b"accept", answer.nonce, "b", "a")))
        return await raw.recv_all()

    fake = FakeAcceptor(script)
    await fake.start()
    try:
        _, ra = await cluster.start("a", [PeerConfig("b", f"127.0.0.1:{fake.port}")], listen="")
        replies = await asyncio.wait_for(fake.outcomes.get(), 3)
        assert replies == [Goodbye(LinkReason.AUTH_FAILED, "bad MAC: the shared secrets differ")]
        assert ra.ups == []
    finally:
        await fake.close()


@pytest.mark.parametrize(
    ("challenge", "reason"),
    [
        (Challenge("c", bytes(32)), LinkReason.UNEXPECTED_NODE),
        (Challenge("b", bytes(32), protocol=PEER_PROTOCOL + 1), LinkReason.PROTOCOL_MISMATCH),
        (Challenge("b", b"short"), LinkReason.AUTH_FAILED),
    ],
)
async def test_dialer_refuses_bad_challenge(
    cluster: Cluster, challenge: Challenge, reason: str
) -> None:
    async def script(raw: Raw) -> list[PeerMessage]:
        raw.send(challenge)
        return await raw.recv_all()

    fake = FakeAcceptor(script)
    await fake.start()
    try:
        _, ra = await cluster.start("a", [PeerConfig("b", f"127.0.0.1:{fake.port}")], listen="")
        replies = await asyncio.wait_for(fake.outcomes.get(), 3)
        assert [type(m) for m in replies] == [Goodbye]
        assert replies[0].reason == reason
        assert ra.ups == []
    finally:
        await fake.close()


@pytest.mark.parametrize(
    ("dialer", "reason"),
    [
        ("mallory", LinkReason.UNKNOWN_NODE),  # not configured at all
        ("c", LinkReason.WRONG_DIRECTION),  # configured, but sorts after "b": b dials c
        ("b", LinkReason.UNKNOWN_NODE),  # ourselves
    ],
)
async def test_acceptor_refuses_unexpected_node_name(
    cluster: Cluster, dialer: str, reason: str
) -> None:
    b, rb = await cluster.start("b", [PeerConfig("a", NOWHERE), PeerConfig("c", NOWHERE)])
    raw = await Raw.connect(b.listen_port)
    challenge = await raw.recv()
    assert isinstance(challenge, Challenge)
    # The MAC is right for the claimed name: only the name is at fault.
    mac = auth_mac(SECRET, b"dial", challenge.nonce, dialer, "b")
    raw.send(Answer(dialer, secrets.token_bytes(32), mac))
    assert await goodbye_reason(raw) == reason
    assert rb.ups == []


async def test_replayed_answer_refused(cluster: Cluster) -> None:
    b, rb = await cluster.start("b", [PeerConfig("a", NOWHERE)])
    # A good handshake, recorded by an eavesdropper.
    first = await Raw.connect(b.listen_port)
    recorded = await first.dial_auth("a", "b")
    first.close()
    # The recording replayed on a new connection: the nonce it signs is stale.
    second = await Raw.connect(b.listen_port)
    challenge = await second.recv()
    assert isinstance(challenge, Challenge)
    second.send(recorded)
    assert await goodbye_reason(second) == LinkReason.AUTH_FAILED
    assert rb.ups == [] and rb.messages == []


@pytest.mark.parametrize(
    "early", [forward(1), hello_for("a", "x"), Heartbeat(0.0), Welcome(b"x" * 32)]
)
async def test_message_before_auth_refused(cluster: Cluster, early: PeerMessage) -> None:
    b, rb = await cluster.start("b", [PeerConfig("a", NOWHERE)])
    raw = await Raw.connect(b.listen_port)
    assert isinstance(await raw.recv(), Challenge)
    raw.send(early)
    assert await goodbye_reason(raw) == LinkReason.PROTOCOL_ERROR
    assert rb.ups == [] and rb.messages == []


async def test_message_before_hello_refused(cluster: Cluster) -> None:
    b, rb = await cluster.start("b", [PeerConfig("a", NOWHERE)])
    raw = await Raw.connect(b.listen_port)
    await raw.dial_auth("a", "b")
    raw.send(forward(1))  # authenticated, but Hello must come first
    messages = await raw.recv_all()
    assert isinstance(messages[0], Hello) and messages[0].node == "b"
    assert messages[-1] == Goodbye(LinkReason.PROTOCOL_ERROR, "expected Hello, got Forward")
    assert rb.ups == [] and rb.messages == []


async def test_hello_must_name_the_authenticated_node(cluster: Cluster) -> None:
    b, rb = await cluster.start("b", [PeerConfig("a", NOWHERE)])
    raw = await Raw.connect(b.listen_port)
    await raw.dial_auth("a", "b")
    raw.send(hello_for("c", "x"))
    assert await goodbye_reason(raw) == LinkReason.PROTOCOL_ERROR
    assert rb.ups == []


async def test_silent_client_times_out(cluster: Cluster) -> None:
    b, rb = await cluster.start("b", [PeerConfig("a", NOWHERE)], handshake_timeout_s=0.3)
    raw = await Raw.connect(b.listen_port)
    messages = await raw.recv_all()
    assert isinstance(messages[0], Challenge)
    assert isinstance(messages[-1], Goodbye)
    assert messages[-1].reason == LinkReason.HANDSHAKE_TIMEOUT
    assert rb.ups == []


# --------------------------------------------------------------------------
# bad frames


BAD_FRAMES = {
    "oversized": (1 << 30).to_bytes(4, "big"),  # a 1 GiB length prefix, nothing behind
    "empty": frame_bytes(b""),
    "garbage": frame_bytes(b"\xc1\xc1\xc1"),  # 0xc1 is never valid msgpack
    "unknown_tag": frame_bytes(msgspec.msgpack.encode(["nope", 1, 2])),
    "bad_fields": frame_bytes(msgspec.msgpack.encode(["heartbeat", "not-a-float"])),
}


@pytest.mark.parametrize("bad", sorted(BAD_FRAMES))
async def test_bad_frame_closes_only_that_link(cluster: Cluster, bad: str) -> None:
    # z accepts from a (a PeerManager) and from c (a raw peer that knows the secret).
    z, rz = await cluster.start(
        "z", [PeerConfig("a", NOWHERE), PeerConfig("c", NOWHERE)], max_frame_bytes=4096
    )
    a, ra = await cluster.start(
        "a", [PeerConfig("z", f"127.0.0.1:{z.listen_port}")], max_frame_bytes=4096
    )
    await eventually(lambda: a.is_up("z") and z.is_up("a"))

    # Before authentication.
    stranger = await Raw.connect(z.listen_port)
    assert isinstance(await stranger.recv(), Challenge)
    stranger.send_raw(BAD_FRAMES[bad])
    assert await goodbye_reason(stranger) == LinkReason.BAD_FRAME

    # After authentication: the link is closed and the daemon told.
    c = await Raw.connect(z.listen_port)
    await c.dial_auth("c", "z")
    c.send(hello_for("c", "c-boot"))
    await eventually(lambda: z.is_up("c"))
    c.send_raw(BAD_FRAMES[bad])
    assert await goodbye_reason(c) == LinkReason.BAD_FRAME
    await eventually(lambda: bool(rz.downs))
    assert rz.downs == [("c", LinkReason.BAD_FRAME)]

    # The good peer never noticed.
    for i in range(10):
        assert a.send("z", forward(i))
    await eventually(lambda: len(rz.messages) == 10)
    assert [m for _, m in rz.messages] == [forward(i) for i in range(10)]
    assert ra.downs == [] and z.is_up("a")


async def test_preauth_frames_are_small_but_hello_may_be_large(cluster: Cluster) -> None:
    z, rz = await cluster.start("z", [PeerConfig("c", NOWHERE)])
    # Anonymous: a frame just over the pre-auth limit is refused unread.
    stranger = await Raw.connect(z.listen_port)
    assert isinstance(await stranger.recv(), Challenge)
    stranger.send_raw((PREAUTH_FRAME_BYTES + 1).to_bytes(4, "big"))
    assert await goodbye_reason(stranger) == LinkReason.BAD_FRAME
    # Authenticated: a Hello far over it is fine.
    c = await Raw.connect(z.listen_port)
    await c.dial_auth("c", "z")
    big = msgspec.structs.replace(hello_for("c", "c-boot"), agent_metadata=b"m" * 200_000)
    c.send(big)
    await eventually(lambda: rz.ups == [("c", "c-boot")])
    assert rz.links[0].hello.agent_metadata == big.agent_metadata


async def test_too_many_pending_handshakes_turned_away(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(daemon.node.peerlink, "MAX_PENDING_HANDSHAKES", 2)
    z, _ = await cluster.start("z", [PeerConfig("c", NOWHERE)])
    idle = [await Raw.connect(z.listen_port) for _ in range(2)]
    for raw in idle:
        assert isinstance(await raw.recv(), Challenge)
    extra = await Raw.connect(z.listen_port)
    assert await extra.recv_all() == [
        Goodbye(LinkReason.BUSY, "too many connections authenticating")
    ]
    # Once one finishes (here: fails), a slot frees up.
    idle[0].close()
    await asyncio.sleep(0.05)
    again = await Raw.connect(z.listen_port)
    assert isinstance(await again.recv(), Challenge)


async def test_on_message_failure_drops_the_link(cluster: Cluster) -> None:
    class Buggy(Recorder):
        def on_message(self, node: str, message: PeerMessage) -> None:
            raise RuntimeError("daemon bug")

    z, rz = await cluster.start("z", [PeerConfig("c", NOWHERE)], recorder=Buggy())
    c = await Raw.connect(z.listen_port)
    await c.dial_auth("c", "z")
    c.send(hello_for("c", "c-boot"))
    await eventually(lambda: z.is_up("c"))
    c.send(forward(1))
    assert await goodbye_reason(c) == LinkReason.INTERNAL_ERROR
    assert rz.downs == [("c", LinkReason.INTERNAL_ERROR)]


async def test_handshake_message_after_auth_is_a_protocol_error(cluster: Cluster) -> None:
    z, rz = await cluster.start("z", [PeerConfig("c", NOWHERE)])
    c = await Raw.connect(z.listen_port)
    await c.dial_auth("c", "z")
    c.send(hello_for("c", "c-boot"))
    await eventually(lambda: z.is_up("c"))
    c.send(Challenge("c", bytes(32)))
    assert await goodbye_reason(c) == LinkReason.PROTOCOL_ERROR
    assert rz.downs == [("c", LinkReason.PROTOCOL_ERROR)]


async def test_newer_connection_replaces_older(cluster: Cluster) -> None:
    z, rz = await cluster.start("z", [PeerConfig("c", NOWHERE)])
    old = await Raw.connect(z.listen_port)
    await old.dial_auth("c", "z")
    old.send(hello_for("c", "boot-1"))
    await eventually(lambda: len(rz.ups) == 1)
    new = await Raw.connect(z.listen_port)
    await new.dial_auth("c", "z")
    new.send(hello_for("c", "boot-2"))
    await eventually(lambda: len(rz.ups) == 2)
    assert await goodbye_reason(old) == LinkReason.REPLACED
    assert rz.ups == [("c", "boot-1"), ("c", "boot-2")]
    assert rz.downs == [("c", LinkReason.REPLACED)]
    assert z.links[0].boot_id == "boot-2"
    new.close()


# --------------------------------------------------------------------------
# the daemon refuses a peering


@pytest.mark.parametrize("refuser", ["acceptor", "dialer"])
async def test_rejected_peering_says_goodbye_and_dialer_backs_off(
    cluster: Cluster, refuser: str
) -> None:
    rejection = PeerRejected("incompatible_layout", "block_bytes differ")
    rb = Recorder(rejection if refuser == "acceptor" else None)
    ra = Recorder(rejection if refuser == "dialer" else None)
    refusing, other = (rb, ra) if refuser == "acceptor" else (ra, rb)
    # Production backoff (0.1 s doubling to 2 s).
    b, _ = await cluster.start("b", [PeerConfig("a", NOWHERE)], recorder=rb, backoff_s=(0.1, 2.0))
    await cluster.start(
        "a", [PeerConfig("b", f"127.0.0.1:{b.listen_port}")], recorder=ra, backoff_s=(0.1, 2.0)
    )
    await asyncio.sleep(1.2)
    attempts = len(refusing.ups)
    # 0, ~0.1, ~0.3, ~0.7 s (+ jitter): a handful, not hundreds.
    assert 2 <= attempts <= 6, refusing.ups
    assert refusing.downs == []  # a refused link is never announced, so never downed
    # The other side may have seen each attempt come up; each one went down
    # with the refuser's reason.
    assert len(other.ups) <= attempts
    assert len(other.ups) - 1 <= len(other.downs) <= len(other.ups)  # the last may be in flight
    assert all(reason == "peer:incompatible_layout" for _, reason in other.downs)


# --------------------------------------------------------------------------
# heartbeats and TTL


class FreezableProxy:
    """A TCP relay that can stop moving bytes (a network partition) and retarget."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.thawed = asyncio.Event()
        self.thawed.set()
        self.writers: list[asyncio.StreamWriter] = []
        self.tasks: set[asyncio.Task[None]] = set()
        self.port = 0
        self.server: asyncio.Server | None = None

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]

    def freeze(self) -> None:
        self.thawed.clear()

    def thaw(self) -> None:
        self.thawed.set()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self.thawed.is_set():
            writer.close()  # partitioned: new connections fail too
            return
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.close()
            return
        self.writers += [writer, up_writer]
        for src, dst in ((reader, up_writer), (up_reader, writer)):
            task = asyncio.get_running_loop().create_task(self._pump(src, dst))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        try:
            while data := await src.read(65536):
                await self.thawed.wait()
                dst.write(data)
        except OSError:
            pass
        finally:
            dst.close()

    async def close(self) -> None:
        assert self.server is not None
        self.server.close()
        for writer in self.writers:
            writer.close()
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


async def test_partition_ttl_then_reconnect_to_restarted_peer(cluster: Cluster) -> None:
    b, rb = await cluster.start("b", [PeerConfig("a", NOWHERE)])
    proxy = FreezableProxy(b.listen_port or 0)
    await proxy.start()
    try:
        _, ra = await cluster.start("a", [PeerConfig("b", f"127.0.0.1:{proxy.port}")])
        await eventually(lambda: bool(ra.ups and rb.ups))
        loop = asyncio.get_running_loop()

        proxy.freeze()
        frozen_at = loop.time()
        await eventually(lambda: bool(ra.downs and rb.downs), timeout=TTL + 1.0)
        assert loop.time() - frozen_at <= TTL + 0.3
        await asyncio.sleep(TTL)  # exactly once, even as time goes by
        assert ra.downs == [("b", LinkReason.PEER_TTL)]
        assert rb.downs == [("a", LinkReason.PEER_TTL)]

        # b restarts (new boot id, new port) while the network is still down.
        await b.close()
        b2, rb2 = await cluster.start("b", [PeerConfig("a", NOWHERE)], boot_id="b-boot-2")
        proxy.target_port = b2.listen_port or 0
        proxy.thaw()
        await eventually(lambda: bool(rb2.ups) and len(ra.ups) == 2)
        assert ra.ups == [("b", "b-boot-1"), ("b", "b-boot-2")]
        assert ra.downs == [("b", LinkReason.PEER_TTL)]
        assert rb.ups == [("a", "a-boot-1")] and rb2.ups == [("a", "a-boot-1")]
    finally:
        await proxy.close()


CHILD = """
import asyncio, os, sys
from daemon.node.peerlink import PeerManager
from schemas.config import PeerConfig
from schemas.peer import Hello

node, peer, port, boot_id, hb, ttl = sys.argv[1:7]

async def main() -> None:
    manager = PeerManager(
        node, os.environb[b"KVPUSHD_TEST_SECRET"], "", [PeerConfig(peer, f"127.0.0.1:{port}")],
        hello=lambda peer: Hello(node, boot_id, "agent", b"", ()),
        on_up=lambda *_: None, on_message=lambda *_: None, on_down=lambda *_: None,
        heartbeat_s=float(hb), peer_ttl_s=float(ttl), backoff_s=(0.05, 0.3),
    )
    await manager.start()
    await asyncio.Event().wait()

asyncio.run(main())
"""


def spawn_child(port: int, boot_id: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "KVPUSHD_TEST_SECRET": SECRET.decode(), "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, "a", "b", str(port), boot_id, str(HB), str(TTL)],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


async def test_sigstopped_peer_declared_dead_once_then_comes_back(cluster: Cluster) -> None:
    b, rb = await cluster.start("b", [PeerConfig("a", NOWHERE)])
    port = b.listen_port or 0
    children = [spawn_child(port, "a-boot-1")]
    loop = asyncio.get_running_loop()
    try:
        await eventually(lambda: rb.ups == [("a", "a-boot-1")], timeout=10)

        children[0].send_signal(signal.SIGSTOP)
        stopped_at = loop.time()
        await eventually(lambda: bool(rb.downs), timeout=TTL + 1.0)
        elapsed = loop.time() - stopped_at
        assert TTL - HB * 2 <= elapsed <= TTL + 0.3
        await asyncio.sleep(TTL)
        assert rb.downs == [("a", LinkReason.PEER_TTL)]  # once
        assert not b.is_up("a")

        # Resumed: it reads our Goodbye, redials and authenticates again.
        children[0].send_signal(signal.SIGCONT)
        await eventually(lambda: len(rb.ups) == 2, timeout=5)
        assert rb.ups[-1] == ("a", "a-boot-1")

        # Killed and restarted: a new boot id comes up.
        children[0].kill()
        await eventually(lambda: len(rb.downs) == 2)
        assert rb.downs[-1] == ("a", LinkReason.PEER_CLOSED)
        children.append(spawn_child(port, "a-boot-2"))
        await eventually(lambda: len(rb.ups) == 3, timeout=10)
        assert rb.ups[-1] == ("a", "a-boot-2")
        assert b.links[0].boot_id == "a-boot-2"
    finally:
        for child in children:
            child.kill()
            child.wait()


# --------------------------------------------------------------------------
# peers on demand: not configured, dialed by the side that needs the link

ON_DEMAND: dict[str, Any] = {"accept_unlisted": True, "connect_timeout_s": 1.0}


async def test_on_demand_dial_admitted_by_the_secret_alone(cluster: Cluster) -> None:
    # Neither lists the other; "z" dials "a" although it sorts higher.
    a, ra = await cluster.start("a", [], **ON_DEMAND)
    z, rz = await cluster.start("z", [], listen="", **ON_DEMAND)
    link = await z.connect("a", f"127.0.0.1:{a.listen_port}")
    assert link.node == "a" and z.is_up("a")
    await eventually(lambda: a.is_up("z") and bool(rz.ups))
    assert ra.ups == [("z", "z-boot-1")] and rz.ups == [("a", "a-boot-1")]
    (za,) = z.links
    assert (za.node, za.address, za.up, za.direction, za.on_demand) == (
        "a",
        f"127.0.0.1:{a.listen_port}",
        True,
        "dialed",
        True,
    )
    (az,) = a.links
    assert (az.node, az.address, az.direction, az.on_demand) == ("z", "", "accepted", True)
    # Messages flow both ways; a second connect reuses the link.
    assert z.send("a", forward(1)) and a.send("z", forward(2))
    await eventually(lambda: bool(ra.messages and rz.messages))
    assert await z.connect("a", "127.0.0.1:1") is link


async def test_unlisted_dialer_refused_without_accept_unlisted(cluster: Cluster) -> None:
    a, ra = await cluster.start("a", [])
    z, _ = await cluster.start("z", [], listen="", **ON_DEMAND)
    with pytest.raises(PeerUnreachable) as refused:
        await z.connect("a", f"127.0.0.1:{a.listen_port}")
    assert refused.value.reason == f"peer:{LinkReason.UNKNOWN_NODE}"
    assert ra.ups == [] and not z.is_up("a")


@pytest.mark.parametrize(
    ("dialer", "reason"),
    [
        ("c", LinkReason.WRONG_DIRECTION),  # configured: the static rule still holds
        ("b", LinkReason.UNKNOWN_NODE),  # ourselves
    ],
)
async def test_accept_unlisted_keeps_the_static_rules(
    cluster: Cluster, dialer: str, reason: str
) -> None:
    b, rb = await cluster.start("b", [PeerConfig("c", NOWHERE)], **ON_DEMAND)
    raw = await Raw.connect(b.listen_port)
    challenge = await raw.recv()
    assert isinstance(challenge, Challenge)
    raw.send(
        Answer(
            dialer, secrets.token_bytes(32), auth_mac(SECRET, b"dial", challenge.nonce, dialer, "b")
        )
    )
    assert await goodbye_reason(raw) == reason
    assert rb.ups == []


async def test_unlisted_dialer_with_a_wrong_mac_refused(cluster: Cluster) -> None:
    b, rb = await cluster.start("b", [], **ON_DEMAND)
    raw = await Raw.connect(b.listen_port)
    challenge = await raw.recv()
    assert isinstance(challenge, Challenge)
    mac = auth_mac(b"another-secret-0123456789", b"dial", challenge.nonce, "mallory", "b")
    raw.send(Answer("mallory", secrets.token_bytes(32), mac))
    assert await goodbye_reason(raw) == LinkReason.AUTH_FAILED
    assert rb.ups == []


async def test_on_demand_dial_with_a_wrong_secret_fails_typed(cluster: Cluster) -> None:
    a, ra = await cluster.start("a", [], **ON_DEMAND)
    z, rz = await cluster.start("z", [], listen="", secret=b"not-the-cluster-secret", **ON_DEMAND)
    with pytest.raises(PeerUnreachable) as refused:
        await z.connect("a", f"127.0.0.1:{a.listen_port}")
    assert refused.value.reason == f"peer:{LinkReason.AUTH_FAILED}"
    assert ra.ups == rz.ups == [] and not z.is_up("a")


async def test_on_demand_dial_to_nobody_fails_at_once(cluster: Cluster) -> None:
    z, _ = await cluster.start("z", [], listen="", **ON_DEMAND)
    with pytest.raises(PeerUnreachable) as refused:
        await z.connect("a", "127.0.0.1:1")
    assert refused.value.reason == LinkReason.CONNECT_FAILED
    with pytest.raises(PeerUnreachable) as bad:
        await z.connect("a", "no-port")
    assert bad.value.reason == "bad_address"
    with pytest.raises(PeerUnreachable) as itself:
        await z.connect("z", "127.0.0.1:1")
    assert itself.value.reason == LinkReason.UNKNOWN_NODE


async def test_on_demand_dial_to_a_silent_listener_is_bounded(cluster: Cluster) -> None:
    # Something accepts TCP at the address but never says Challenge.
    silent = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = silent.sockets[0].getsockname()[1]
    z, _ = await cluster.start("z", [], listen="", **{**ON_DEMAND, "connect_timeout_s": 0.3})
    loop = asyncio.get_running_loop()
    started = loop.time()
    try:
        with pytest.raises(PeerUnreachable) as refused:
            await z.connect("a", f"127.0.0.1:{port}")
    finally:
        silent.close()
    assert refused.value.reason == LinkReason.HANDSHAKE_TIMEOUT
    assert 0.25 <= loop.time() - started < 1.5


async def test_concurrent_connects_share_one_dial(cluster: Cluster) -> None:
    a, ra = await cluster.start("a", [], **ON_DEMAND)
    z, _ = await cluster.start("z", [], listen="", **ON_DEMAND)
    address = f"127.0.0.1:{a.listen_port}"
    links = await asyncio.gather(*(z.connect("a", address) for _ in range(5)))
    assert all(link is links[0] for link in links)
    await eventually(lambda: bool(ra.ups))
    await asyncio.sleep(0.1)
    assert len(ra.ups) == 1


async def test_idle_on_demand_link_closes_and_is_not_redialed(cluster: Cluster) -> None:
    needed = {"a": True}
    a, ra = await cluster.start("a", [], **ON_DEMAND)
    z, rz = await cluster.start(
        "z", [], listen="", idle_close_s=0.3, in_use=needed.__getitem__, **ON_DEMAND
    )
    await z.connect("a", f"127.0.0.1:{a.listen_port}")
    await eventually(lambda: a.is_up("z"))
    await asyncio.sleep(0.8)  # in use: kept well past idle_close_s
    assert z.is_up("a") and a.is_up("z")
    needed["a"] = False
    await eventually(lambda: not z.is_up("a") and not a.is_up("z"))
    assert rz.downs == [("a", LinkReason.IDLE)]
    assert ra.downs == [("z", f"peer:{LinkReason.IDLE}")]
    await asyncio.sleep(0.5)  # nobody redials
    assert len(ra.ups) == len(rz.ups) == 1 and z.links == ()
    # The next need dials again.
    await z.connect("a", f"127.0.0.1:{a.listen_port}")
    assert len(rz.ups) == 2


async def test_accepted_on_demand_link_is_not_closed_as_idle_by_the_acceptor(
    cluster: Cluster,
) -> None:
    a, ra = await cluster.start("a", [], idle_close_s=0.2, in_use=lambda node: False, **ON_DEMAND)
    z, _ = await cluster.start("z", [], listen="", idle_close_s=0, **ON_DEMAND)
    await z.connect("a", f"127.0.0.1:{a.listen_port}")
    await asyncio.sleep(0.8)
    assert a.is_up("z") and z.is_up("a") and ra.downs == []


async def test_both_sides_dialing_at_once_keep_the_lower_names_link(cluster: Cluster) -> None:
    a, ra = await cluster.start("a", [], **ON_DEMAND)
    b, rb = await cluster.start("b", [], **ON_DEMAND)
    await asyncio.gather(
        a.connect("b", f"127.0.0.1:{b.listen_port}"),
        b.connect("a", f"127.0.0.1:{a.listen_port}"),
    )
    await eventually(
        lambda: (
            (al := a.link("b")) is not None
            and al.direction.value == "dialed"
            and (bl := b.link("a")) is not None
            and bl.direction.value == "accepted"
        )
    )
    await asyncio.sleep(0.3)
    # Every link announced was also taken down once, except the one kept.
    assert len(ra.ups) - len(ra.downs) == 1 and len(rb.ups) - len(rb.downs) == 1
    assert a.is_up("b") and b.is_up("a")


# --------------------------------------------------------------------------
# shutdown


async def test_close_leaves_no_pending_tasks() -> None:
    before = asyncio.all_tasks()
    c = Cluster()
    a, ra, b, rb = await c.pair()
    # Also one connection stuck mid-handshake and one dial loop with nobody there.
    raw = await Raw.connect(b.listen_port or 0)
    assert isinstance(await raw.recv(), Challenge)
    lonely, _ = await c.start("a", [PeerConfig("x", "127.0.0.1:1")], listen="")
    await asyncio.sleep(0.2)

    await c.close()
    await asyncio.sleep(0)
    assert asyncio.all_tasks() == before
    # b closed first: a heard b's Goodbye before closing itself.
    assert rb.downs == [("a", LinkReason.SHUTDOWN)]
    assert ra.downs == [("b", "peer:shutdown")]
    assert not a.is_up("b") and not b.send("a", forward(1))
    # The half-done connection was closed too.
    assert await raw.recv_all() == [Goodbye(LinkReason.SHUTDOWN, "daemon shutting down")]
    await lonely.close()  # idempotent
