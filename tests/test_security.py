"""Security boundaries of a real daemon process, each checked from outside it.

* The engine socket is mode 0660; who reaches it is the group's business.
* SO_PEERCRED: a client whose uid and gid are not allowed is refused with
  ``not_allowed`` before anything it sends is read; ``allowed_uids``
  and ``allowed_groups`` admit, and by default the daemon's own group does.
  Clients run as other uids in forked children
  that drop root with setgid/setuid before connecting.
* Engine memory: a region must be a regular file under /dev/shm, owned by
  the connecting engine's uid, of exactly the declared size, holding the
  declared layout (``bad_region`` otherwise, with nothing mapped or leaked).
* Block ids outside an engine's declared range are refused at registration
  (``block_out_of_range``), before the data plane sees the request.
* The peer link refuses a wrong secret (a real daemon with another secret),
  a replayed challenge answer, and messages before authentication.
* Limits: live requests per engine and frame size give clear errors, and
  neither an over-limit client, nor one that never reads its replies, nor a
  crowd of unauthenticated peer connections makes the daemon grow.

The tests need root (to create clients with other uids); they skip otherwise.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import stat
import struct
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Final

import msgspec
import pytest

from daemon.dataplane.memory import create_shm_file
from daemon.framing import FrameEncoder, frame_bytes
from daemon.journal.replay import replay
from daemon.node.peerauth import NONCE_BYTES, auth_mac
from daemon.node.peerlink import MAX_PENDING_HANDSHAKES
from daemon.sim.launcher import (
    Daemon,
    fd_count,
    free_port,
    mapped_files,
    rss_kib,
    start_daemons,
    start_pair,
)
from harness.fuzzing import PeerConn, RpcConn, both_views
from schemas import peer as pm
from schemas import rpc
from schemas.events import Refused, Registered, WriteStarted
from schemas.kvlayout import GroupSpec, LayerSpec, RegionSpec
from schemas.layout import GroupKind, Role

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as other uids")

# The pair's secret, given by this test (it answers the peer handshake itself).
SECRET: Final = b"security-test-secret-0123456789abcdef"
ENGINE_GID: Final = 4242  # the group the socket is shared with
OTHER_UID: Final = 4243  # an engine's uid that is not allowed by uid
ADMITTED_UID: Final = 4244
STRANGER: Final = 4249  # neither uid nor gid allowed anywhere
BLOCK_BYTES: Final = 256


# ------------------------------------------------------------------ helpers


@contextlib.contextmanager
def open_workdir() -> Iterator[Path]:
    """A work folder other uids can traverse (pytest's tmp_path is 0700 root)."""
    path = Path(tempfile.mkdtemp(prefix="kvpushd-sec-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def run_as(
    uid: int,
    gid: int,
    sock_path: str,
    payload: bytes,
    replies: int,
    groups: tuple[int, ...] = (),
) -> list[bytes] | str:
    """Connect to ``sock_path`` as uid/gid from a forked child, send, read up to ``replies`` frames.

    Returns the frame bodies the daemon sent before closing or before
    ``replies`` arrived, or the name of the error connect() raised. The
    child only drops its ids, talks over the socket and writes to a pipe,
    so forking from a process with threads is safe here.
    """
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        result = b"?"
        try:
            os.close(read_end)
            os.setgroups(list(groups))
            os.setgid(gid)
            os.setuid(uid)
            result = _child_exchange(sock_path, payload, replies)
        except BaseException as exc:
            result = b"X" + type(exc).__name__.encode()
        finally:
            os.write(write_end, result)
            os._exit(0)
    os.close(write_end)
    chunks = []
    while chunk := os.read(read_end, 65536):
        chunks.append(chunk)
    os.close(read_end)
    os.waitpid(pid, 0)
    data = b"".join(chunks)
    if data[:1] != b"F":
        return data.decode()  # "C<error>": connect() failed; "X<error>": something else did
    return _split_frames(data[1:])


def _child_exchange(sock_path: str, payload: bytes, replies: int) -> bytes:  # pragma: no cover
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    try:
        s.connect(sock_path)
    except OSError as exc:
        return b"C" + type(exc).__name__.encode()
    with contextlib.suppress(OSError):
        s.sendall(payload)
    received = b""
    while len(_split_frames(received)) < replies:
        try:
            chunk = s.recv(65536)
        except OSError:
            break
        if not chunk:
            break
        received += chunk
    s.close()
    return b"F" + received


def _split_frames(data: bytes) -> list[bytes]:
    frames, offset = [], 0
    while offset + 4 <= len(data):
        (length,) = struct.unpack_from(">I", data, offset)
        if offset + 4 + length > len(data):
            break
        frames.append(data[offset + 4 : offset + 4 + length])
        offset += 4 + length
    return frames


def decode_replies(frames: list[bytes]) -> list[rpc.ServerMessage]:
    return [msgspec.msgpack.decode(f, type=rpc.ServerMessage) for f in frames]


def encode(*requests: rpc.Request) -> bytes:
    return b"".join(bytes(FrameEncoder().encode(r)) for r in requests)


def shm_region(size: int, *, uid: int = 0) -> RegionSpec:
    spec = create_shm_file(f"/dev/shm/kvpushd-sec-{uuid.uuid4().hex[:10]}", size)
    if uid:
        os.chown(spec.path, uid, -1)
    return spec


def groups_for(region: RegionSpec, num_blocks: int, per_logical: int = 1) -> tuple[GroupSpec, ...]:
    layer = LayerSpec(region.name)
    return (GroupSpec(GroupKind.ATTENTION, num_blocks, BLOCK_BYTES, (layer,), per_logical),)


# ----------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[Daemon, Daemon]]:
    with open_workdir() as workdir:
        prefill, decode = start_pair(workdir, secret=SECRET)
        try:
            yield prefill, decode
        finally:
            prefill.stop()
            decode.stop()


@pytest.fixture(scope="module")
def admitting() -> Iterator[Daemon]:
    """A daemon that admits uid ADMITTED_UID and gid ENGINE_GID (and root, to be managed)."""
    extra = f"allowed_uids = [0, {ADMITTED_UID}]\nallowed_groups = [{ENGINE_GID}]"
    with open_workdir() as workdir:
        (daemon,) = start_daemons(lambda: [Daemon("admitting", workdir, free_port(), extra=extra)])
        try:
            yield daemon
        finally:
            daemon.stop()


@pytest.fixture(scope="module")
def limited() -> Iterator[Daemon]:
    extra = "[limits]\nmax_live_per_engine = 8\nmax_frame_bytes = 65536"
    with open_workdir() as workdir:
        (daemon,) = start_daemons(lambda: [Daemon("limited", workdir, free_port(), extra=extra)])
        try:
            yield daemon
        finally:
            daemon.stop()


# ----------------------------------------------------------- engine socket


def test_engine_socket_is_0660_and_closed_to_other_users(pair: tuple[Daemon, Daemon]) -> None:
    prefill, _ = pair
    st = os.stat(prefill.socket)
    assert stat.S_ISSOCK(st.st_mode)
    assert stat.S_IMODE(st.st_mode) == 0o660
    # Not the owner, not in the group: the kernel refuses the connect itself.
    assert run_as(STRANGER, STRANGER, prefill.socket, b"", 0) == "CPermissionError"


def test_peercred_refuses_a_uid_and_gid_not_allowed(pair: tuple[Daemon, Daemon]) -> None:
    """The socket's group lets the client connect; the daemon still refuses it."""
    prefill, _ = pair
    before = both_views(prefill)
    os.chown(prefill.socket, -1, ENGINE_GID)
    try:
        hello = encode(rpc.Hello(1, "intruder"), rpc.Status(2))
        replies = decode_replies(run_as(OTHER_UID, ENGINE_GID, prefill.socket, hello, 3))
    finally:
        os.chown(prefill.socket, -1, 0)
    # One refusal, naming the credentials, then the connection is closed:
    # neither request was answered.
    assert len(replies) == 1, replies
    (refusal,) = replies
    assert isinstance(refusal, rpc.Error) and refusal.code == rpc.NOT_ALLOWED
    assert f"uid {OTHER_UID}" in refusal.message and f"gid {ENGINE_GID}" in refusal.message
    assert "credentials not allowed" in prefill.logs()
    assert both_views(prefill) == before


def test_allowed_groups_and_uids_admit(admitting: Daemon) -> None:
    sock = admitting.socket
    os.chown(sock, ADMITTED_UID, ENGINE_GID)
    try:
        request = encode(rpc.Hello(1, "engine"), rpc.Status(2))
        by_gid = decode_replies(run_as(OTHER_UID, ENGINE_GID, sock, request, 2))
        by_uid = decode_replies(run_as(ADMITTED_UID, STRANGER, sock, request, 2))
        # World-connectable by mistake: SO_PEERCRED is what still stops a stranger.
        os.chmod(sock, 0o666)
        stranger = decode_replies(run_as(STRANGER, STRANGER, sock, request, 2))
    finally:
        os.chmod(sock, 0o660)
        os.chown(sock, 0, 0)
    for replies in (by_gid, by_uid):
        assert [type(r) for r in replies] == [rpc.HelloOk, rpc.StatusReply], replies
    assert len(stranger) == 1 and stranger[0].code == rpc.NOT_ALLOWED, stranger


def test_the_daemons_own_group_is_admitted_by_default(pair: tuple[Daemon, Daemon]) -> None:
    """No allowed_groups: members of the daemon's group (kvpushd under the unit) may connect."""
    prefill, _ = pair
    own_gid = os.getgid()
    request = encode(rpc.Hello(1, "engine"), rpc.Status(2))
    primary = decode_replies(run_as(OTHER_UID, own_gid, prefill.socket, request, 2))
    os.chmod(prefill.socket, 0o666)  # let a supplementary member reach the credential check
    try:
        supplementary = decode_replies(
            run_as(OTHER_UID, STRANGER, prefill.socket, request, 2, groups=(own_gid,))
        )
    finally:
        os.chmod(prefill.socket, 0o660)
    for replies in (primary, supplementary):
        assert [type(r) for r in replies] == [rpc.HelloOk, rpc.StatusReply], replies


def test_a_supplementary_member_of_an_allowed_group_is_admitted(admitting: Daemon) -> None:
    # SO_PEERCRED names only the primary gid; SO_PEERGROUPS gives the rest.
    sock = admitting.socket
    os.chown(sock, ADMITTED_UID, ENGINE_GID)
    try:
        request = encode(rpc.Hello(1, "engine"), rpc.Status(2))
        member = decode_replies(
            run_as(OTHER_UID, STRANGER, sock, request, 2, groups=(STRANGER + 1, ENGINE_GID))
        )
        os.chmod(sock, 0o666)  # let the outsider reach the credential check
        outsider = decode_replies(
            run_as(OTHER_UID, STRANGER, sock, request, 2, groups=(STRANGER + 1,))
        )
    finally:
        os.chmod(sock, 0o660)
        os.chown(sock, 0, 0)
    assert [type(r) for r in member] == [rpc.HelloOk, rpc.StatusReply], member
    assert len(outsider) == 1 and outsider[0].code == rpc.NOT_ALLOWED, outsider


def test_regions_must_belong_to_the_connecting_uid(admitting: Daemon) -> None:
    """An admitted engine may share its own shm file, never root's."""
    sock = admitting.socket
    size = 16 * BLOCK_BYTES
    own, roots = shm_region(size, uid=OTHER_UID), shm_region(size)
    try:
        os.chown(sock, -1, ENGINE_GID)
        request = encode(
            rpc.RegisterEngine(1, "theft", groups_for(roots, 16), (roots,)),
            rpc.RegisterEngine(2, "mine", groups_for(own, 16), (own,)),
        )
        theft, mine = decode_replies(run_as(OTHER_UID, ENGINE_GID, sock, request, 2))
    finally:
        os.chown(sock, 0, 0)
        for spec in (own, roots):
            os.unlink(spec.path)
    assert isinstance(theft, rpc.Error) and theft.code == "bad_region", theft
    assert "owned by uid 0" in theft.message and f"engine's uid {OTHER_UID}" in theft.message
    assert isinstance(mine, rpc.Ok), mine


# ----------------------------------------------------------- engine memory


def _bad_regions(workdir: Path) -> Iterator[tuple[str, tuple[RegionSpec, ...], tuple]]:
    """(name, regions, groups) an engine must not get mapped; files are cleaned by the caller."""
    size = 16 * BLOCK_BYTES
    outside = workdir / "outside.bin"
    outside.write_bytes(bytes(size))
    link = f"/dev/shm/kvpushd-sec-link-{uuid.uuid4().hex[:8]}"
    os.symlink(outside, link)
    folder = f"/dev/shm/kvpushd-sec-dir-{uuid.uuid4().hex[:8]}"
    os.mkdir(folder)
    good = shm_region(size)
    foreign = shm_region(size, uid=OTHER_UID)

    def one(name: str, path: str, declared: int = size, blocks: int = 16) -> tuple:
        spec = RegionSpec("kv", declared, path=path)
        return name, (spec,), groups_for(spec, blocks)

    yield one("outside /dev/shm", str(outside))
    yield one("symlink out of /dev/shm", link)
    yield one("dot-dot escape", f"/dev/shm/../{outside.relative_to('/')}")
    yield one("relative path", "kvpushd-sec-relative")
    yield one("missing file", "/dev/shm/kvpushd-sec-missing")
    yield one("a directory", folder)
    yield one("/dev/shm itself", "/dev/shm")
    yield one("declared larger", good.path, declared=size + 4096)
    yield one("declared smaller", good.path, declared=size - BLOCK_BYTES)
    yield one("owned by another uid", foreign.path)
    yield one("layout past the region's end", good.path, blocks=17)
    os.unlink(link)
    os.rmdir(folder)
    os.unlink(good.path)
    os.unlink(foreign.path)


def test_bad_regions_are_refused_and_nothing_is_mapped_or_leaked(
    pair: tuple[Daemon, Daemon],
) -> None:
    prefill, _ = pair
    pid = prefill.proc.pid
    before = both_views(prefill)
    with open_workdir() as workdir, RpcConn(prefill.socket) as conn:
        conn.status()  # the connection's own fd exists before counting
        fds = fd_count(pid)
        paths = []
        for name, regions, groups in _bad_regions(workdir):
            paths += [r.path for r in regions]
            engine_id = f"bad-{uuid.uuid4().hex[:6]}"
            reply = conn.call(rpc.RegisterEngine(conn.next_id(), engine_id, groups, regions))
            assert isinstance(reply, rpc.Error) and reply.code == "bad_region", (name, reply)
        assert fd_count(pid) == fds, "a refused region left a file descriptor open"
    assert not {os.path.realpath(p) for p in paths if os.path.isabs(p)} & mapped_files(pid)
    assert both_views(prefill) == before


def test_out_of_range_blocks_are_refused_at_registration(pair: tuple[Daemon, Daemon]) -> None:
    """Refused by the core before the data plane sees them; no write ever starts."""
    prefill, decode = pair
    region = shm_region(16 * BLOCK_BYTES)
    # Kernel blocks 0..15; the second group spans 4 kernel blocks per logical one.
    groups = (*groups_for(region, 16), *groups_for(region, 16, per_logical=4))
    rid = f"oob-{uuid.uuid4().hex[:6]}"
    try:
        with RpcConn(prefill.socket) as conn:
            ok = conn.call(rpc.RegisterEngine(conn.next_id(), f"e-{rid}", groups, (region,)))
            assert isinstance(ok, rpc.Ok), ok
            started_before = conn.status()["counters"]["writes_started"]
            for blocks in (((16,), ()), ((-1,), ()), ((), (4,)), ((0, 2**63 - 1), ())):
                reply = conn.call(
                    rpc.RegisterRequest(conn.next_id(), f"e-{rid}", rid, Role.PUSHER, blocks)
                )
                assert isinstance(reply, rpc.Error), (blocks, reply)
                assert reply.code == "block_out_of_range", (blocks, reply)
            # The same on the receiving side: refused there, never forwarded.
            with RpcConn(decode.socket) as dconn:
                dconn.call(rpc.RegisterEngine(dconn.next_id(), f"d-{rid}", groups, (region,)))
                reply = dconn.call(
                    rpc.RegisterRequest(
                        dconn.next_id(), f"d-{rid}", rid, Role.RECEIVER, ((99,), ()), peer="prefill"
                    )
                )
                assert isinstance(reply, rpc.Error) and reply.code == "block_out_of_range"
            assert conn.status()["counters"]["writes_started"] == started_before
            assert conn.status()["pending_peer_registrations"] == 0
    finally:
        os.unlink(region.path)
    events = [r.event for r in _records(prefill) if getattr(r.event, "request_id", None) == rid]
    assert events and all(isinstance(e, Refused) for e in events), events
    assert not any(isinstance(e, Registered | WriteStarted) for e in events)


def _records(daemon: Daemon) -> list:
    out: list = []
    replay(daemon.journal, on_record=lambda record, touched: out.append(record))
    return out


# --------------------------------------------------------------- peer link


def test_peer_with_a_wrong_secret_never_comes_up(pair: tuple[Daemon, Daemon]) -> None:
    """A real daemon that calls itself "decode" but holds another secret."""
    prefill, _ = pair
    link_before = _link(prefill)
    with open_workdir() as workdir:
        (workdir / "secret").write_text("another-secret-0123456789abcdef\n")
        (workdir / "secret").chmod(0o600)
        impostor = Daemon("decode", workdir, free_port(), [("prefill", prefill.port)])
        impostor.start()
        try:
            deadline = time.monotonic() + 20
            while "auth_failed" not in impostor.logs() and time.monotonic() < deadline:
                time.sleep(0.1)
            assert "auth_failed" in impostor.logs(), impostor.logs()
            impostor_peers = impostor.status()["peers"]
            assert not any(p["up"] for p in impostor_peers), impostor_peers
        finally:
            impostor.stop()
    assert _link(prefill) == link_before, "the real link was disturbed"
    assert "auth_failed" in prefill.logs()


def _link(daemon: Daemon) -> tuple[str, str, str]:
    (link,) = [p for p in daemon.status()["peers"] if p["node"] == "decode"]
    assert link["up"], link
    return link["boot_id"], link["peername"], link["direction"]


def test_replayed_answer_is_refused_and_a_fresh_one_is_welcomed(
    pair: tuple[Daemon, Daemon],
) -> None:
    prefill, _ = pair
    before = both_views(prefill)
    with PeerConn(prefill.port) as first:
        nonce_a = first.challenge().nonce
        # A correct answer to the first challenge, recorded and never sent there.
        recorded = pm.Answer(
            "decode",
            os.urandom(NONCE_BYTES),
            auth_mac(SECRET, b"dial", nonce_a, "decode", "prefill"),
        )
    with PeerConn(prefill.port) as second:
        second.challenge()
        second.send(frame_bytes(msgspec.msgpack.encode(recorded)))
        replies = second.finish()
    assert [(type(m), m.reason) for m in replies] == [(pm.Goodbye, "auth_failed")], replies
    # Control: the same computation for this connection's nonce is accepted,
    # and the daemon proves the secret back (then we hang up before Hello).
    with PeerConn(prefill.port) as third:
        nonce_a = third.challenge().nonce
        nonce_b = os.urandom(NONCE_BYTES)
        mac = auth_mac(SECRET, b"dial", nonce_a, "decode", "prefill")
        third.send(frame_bytes(msgspec.msgpack.encode(pm.Answer("decode", nonce_b, mac))))
        welcome = third.recv()
        assert isinstance(welcome, pm.Welcome), welcome
        assert welcome.mac == auth_mac(SECRET, b"accept", nonce_b, "prefill", "decode")
    assert both_views(prefill) == before


def test_messages_before_authentication_are_refused(pair: tuple[Daemon, Daemon]) -> None:
    prefill, _ = pair
    before = both_views(prefill)
    forward = pm.Forward("unauth-1", 1, "some-engine", ((1, 2),), 1)
    for message in (
        forward,
        pm.Heartbeat(1.0),
        pm.WriteDone("unauth-1", 1),
        pm.Hello("decode", "boot", "agent", b"", ()),
    ):
        with PeerConn(prefill.port) as conn:
            conn.challenge()
            conn.send(frame_bytes(msgspec.msgpack.encode(message)))
            replies = conn.finish()
        assert [(type(m), m.reason) for m in replies] == [(pm.Goodbye, "protocol_error")], (
            message,
            replies,
        )
    assert both_views(prefill) == before  # no pending registration from the Forward


# ------------------------------------------------------------------- limits


def body_of_size(size: int) -> bytes:
    """A status request with an unknown field padding it to exactly ``size`` bytes."""
    pad = size
    while True:
        body = msgspec.msgpack.encode({"op": "status", "id": 5, "pad": "x" * pad})
        if len(body) == size:
            return body
        pad -= len(body) - size


def _engine(conn: RpcConn, engine_id: str) -> RegionSpec:
    region = shm_region(16 * BLOCK_BYTES)
    reply = conn.call(
        rpc.RegisterEngine(conn.next_id(), engine_id, groups_for(region, 16), (region,))
    )
    assert isinstance(reply, rpc.Ok), reply
    return region


def test_live_requests_per_engine_are_limited(limited: Daemon) -> None:
    pid = limited.proc.pid
    with RpcConn(limited.socket) as conn:
        region = _engine(conn, "busy")
        try:

            def register(rid: str) -> rpc.Reply:
                return conn.call(
                    rpc.RegisterRequest(conn.next_id(), "busy", rid, Role.PUSHER, ((1,),))
                )

            for i in range(8):
                assert isinstance(register(f"ok-{i}"), rpc.RequestAccepted)
            refused = register("ninth")
            assert isinstance(refused, rpc.Error) and refused.code == "engine_in_use"
            assert "8 live requests, the limit is 8" in refused.message
            # Hammering the limit costs nothing but refusals.
            rss = rss_kib(pid)
            flood = [
                rpc.RegisterRequest(conn.next_id(), "busy", f"x{i}", Role.PUSHER, ((1,),))
                for i in range(3000)
            ]
            for start in range(0, len(flood), 100):
                batch = flood[start : start + 100]
                for reply in conn.exchange(encode(*batch), len(batch)):
                    assert isinstance(reply, rpc.Error) and reply.code == "engine_in_use"
            assert rss_kib(pid) - rss < 16 * 1024, (rss, rss_kib(pid))
            # Room again once one ends.
            assert isinstance(conn.call(rpc.Abort(conn.next_id(), "ok-0")), rpc.Ok)
            assert isinstance(conn.call(rpc.Release(conn.next_id(), "ok-0")), rpc.Ok)
            assert isinstance(register("ninth"), rpc.RequestAccepted)
            for rid in [f"ok-{i}" for i in range(1, 8)] + ["ninth"]:
                conn.call(rpc.Abort(conn.next_id(), rid))
                conn.call(rpc.Release(conn.next_id(), rid))
            assert conn.status()["live"] == 0
        finally:
            os.unlink(region.path)


def test_frames_over_the_limit_close_the_connection(limited: Daemon) -> None:
    pid = limited.proc.pid
    with RpcConn(limited.socket) as conn:
        (reply,) = conn.exchange(frame_bytes(body_of_size(65536)), 1)  # at the limit
        assert isinstance(reply, rpc.Error) and reply.code == "bad_request", reply
        assert reply.id == 5 and "pad" in reply.message
        assert isinstance(conn.call(rpc.Status(conn.next_id())), rpc.StatusReply)
    rss = rss_kib(pid)
    for _ in range(200):
        with RpcConn(limited.socket) as conn:
            conn.sock.sendall(struct.pack(">I", 65537) + b"\x00" * 1024)
            messages = conn.drain_to_eof()
        assert [(type(m), m.code) for m in messages] == [(rpc.Error, "frame_too_large")]
    assert rss_kib(pid) - rss < 8 * 1024
    assert fd_count(pid) < 200  # every refused connection was closed


def test_a_client_that_never_reads_cannot_grow_the_daemon(pair: tuple[Daemon, Daemon]) -> None:
    """Replies back up into the daemon: it must stop reading that client, not buffer more.

    150 live requests make each status reply ~25 KiB for a 12-byte request:
    without backpressure the daemon grows by hundreds of MiB in seconds.
    """
    prefill, _ = pair
    pid = prefill.proc.pid
    with RpcConn(prefill.socket) as conn:
        region = shm_region(256 * BLOCK_BYTES)
        groups = groups_for(region, 256)
        assert isinstance(conn.call(rpc.RegisterEngine(1, "reader", groups, (region,))), rpc.Ok)
        rids = [f"reader-{i}" for i in range(150)]
        try:
            registrations = [
                rpc.RegisterRequest(conn.next_id(), "reader", rid, Role.PUSHER, ((i,),))
                for i, rid in enumerate(rids)
            ]
            for reply in conn.exchange(encode(*registrations), len(registrations)):
                assert isinstance(reply, rpc.RequestAccepted), reply
            samples = _flood_without_reading(prefill.socket, pid, seconds=6.0)
            # Others are still served while the flood is parked.
            assert isinstance(conn.call(rpc.Status(conn.next_id())), rpc.StatusReply)
        finally:
            ends = [r(conn.next_id(), rid) for rid in rids for r in (rpc.Abort, rpc.Release)]
            conn.exchange(encode(*ends), len(ends))
            os.unlink(region.path)
    growth = samples[-1][1] - samples[0][1]
    assert growth < 64 * 1024, samples
    # Once the socket buffers are full it stops growing. (It may shrink: the
    # allocator handing memory back once read a 14 MiB drop as "growth".)
    late = [kib for t, kib in samples if t > samples[0][0] + 3]
    assert max(late) - late[0] < 8 * 1024, samples


def _flood_without_reading(sock_path: str, pid: int, seconds: float) -> list[tuple[float, int]]:
    """Send status requests and never read; (time, daemon RSS KiB) about every 0.5 s."""
    frames = bytes(FrameEncoder().encode(rpc.Status(7))) * 512
    samples = [(time.monotonic(), rss_kib(pid))]
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as flood:
        flood.connect(sock_path)
        flood.setblocking(False)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            with contextlib.suppress(BlockingIOError):
                flood.send(frames)
            time.sleep(0.001)
            if time.monotonic() - samples[-1][0] > 0.5:
                samples.append((time.monotonic(), rss_kib(pid)))
    samples.append((time.monotonic(), rss_kib(pid)))
    return samples


def test_unauthenticated_peer_connections_are_bounded(pair: tuple[Daemon, Daemon]) -> None:
    prefill, _ = pair
    pid = prefill.proc.pid
    fds = fd_count(pid)
    conns = [PeerConn(prefill.port) for _ in range(MAX_PENDING_HANDSHAKES + 16)]
    try:
        busy = 0
        for conn in conns:
            first = conn.recv()
            if isinstance(first, pm.Goodbye):
                assert first.reason == "busy", first
                busy += 1
            else:
                assert isinstance(first, pm.Challenge), first
        assert busy >= 16
    finally:
        for conn in conns:
            conn.close()
    # All closed: a new client is challenged again, and no descriptor is left over.
    deadline = time.monotonic() + 10
    while fd_count(pid) > fds and time.monotonic() < deadline:
        time.sleep(0.05)
    assert fd_count(pid) <= fds
    with PeerConn(prefill.port) as conn:
        conn.challenge()
