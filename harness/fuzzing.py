"""Fuzzing kvpushd's surfaces: hostile input generators, raw clients and the oracle.

Each surface is a function of one generated case, run by tests/test_fuzz.py
(with Hypothesis, at CI scale) and by ``tools/fuzz_soak.py`` (at a larger
scale, with per-surface counts):

``rpc_stream``     random bytes, truncated frames, oversized and zero lengths,
                   each on a fresh engine connection
``rpc_frames``     well-framed hostile bodies (garbage, wrong types, unknown
                   tags, requests about unknown engines and requests, huge
                   block lists) pipelined on one long-lived connection
``rpc_sequence``   valid requests out of order (kv_ready before register,
                   release twice, abort after release...) from a connection
                   that owns a real engine
``peer_stream``    random bytes to a daemon's peer port
``peer_frames``    well-formed peer messages before authentication, answers
                   with bad MACs, unknown nodes, oversized pre-auth frames
``journal_bytes``  segment and snapshot files damaged byte-wise: bit flips,
                   truncation, splices, zeroed runs, garbage
``journal_records`` intact framing (CRCs recomputed) around mutated or random
                   record payloads, so decoding and the core's fold are reached

The oracle, for every case: each input gets an error reply or a closed
connection, never an ``internal`` error or an undecodable frame; the daemons
stay up; invalid input leaves the registry as it was (status and a replay of
the journal agree, before and after); the journal readers either succeed or
report damage (``JournalError``/``ReplayError``, ``journal verify`` exit 1-2).
A case that breaks it raises :class:`FuzzFailure`.

The daemons are real processes (:mod:`daemon.sim.launcher`). Needs
Hypothesis (the ``test`` extra). ``KVPUSHD_FUZZ_SCALE`` multiplies the case
counts the tests ask for (:func:`scaled`); cases are derandomized unless
``KVPUSHD_FUZZ_RANDOM=1`` or a seed is given.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import os
import shutil
import socket
import struct
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import msgspec
import msgspec.inspect as mi
from crc32c import crc32c
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from daemon import cli
from daemon.dataplane.memory import create_shm_file
from daemon.framing import FrameEncoder, frame_bytes
from daemon.journal.format import FRAME_OVERHEAD, HEADER_SIZE, JournalError
from daemon.journal.replay import ReplayError, replay
from daemon.journal.writer import FsyncPolicy, Journal
from daemon.nativelog import from_library
from daemon.node.ledger import Ledger
from daemon.node.peerauth import NONCE_BYTES, PREAUTH_FRAME_BYTES
from daemon.sim.engine import Expectation, SimEngine, SimGroup, tail_pairs
from daemon.sim.launcher import Daemon, start_pair
from harness.lifecycle import PREFILL, FakeClock, run_mix
from schemas import peer as pm
from schemas import rpc
from schemas.events import FORMAT_VERSION, Event, Record, encode_record
from schemas.kvlayout import GroupSpec, LayerSpec
from schemas.layout import GroupKind, Role
from schemas.reasons import Reason
from statemachine import Registry

SCALE: Final = float(os.environ.get("KVPUSHD_FUZZ_SCALE", "1"))
RANDOM: Final = os.environ.get("KVPUSHD_FUZZ_RANDOM", "") not in ("", "0")

# Error codes a daemon may answer hostile input with. "internal" and
# "shutting_down" are not among them: either means the input reached a path
# that failed instead of refusing.
ALLOWED_CODES: Final = frozenset(r.value for r in Reason) | {
    rpc.BAD_FRAME,
    rpc.BAD_REQUEST,
    rpc.FRAME_TOO_LARGE,
    rpc.BAD_REGION,
    "bad_slot",
    "offload_exhausted",
    rpc.NO_OFFLOAD_TIER,  # an offload call to a daemon whose [offload] tier is off
}
# Goodbye reasons a daemon may send a client that has not authenticated.
PREAUTH_GOODBYES: Final = frozenset(
    {"auth_failed", "unknown_node", "wrong_direction", "protocol_error", "bad_frame"}
)
MAX_FRAME: Final = rpc.MAX_FRAME_BYTES  # the launcher keeps the default limit
IO_TIMEOUT_S: Final = 20.0  # generous: a loaded 2-core CI box must not flake


class FuzzFailure(AssertionError):
    """A case broke the oracle."""


# ---------------------------------------------------------------- raw clients


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    """``n`` bytes, or None at EOF before the first byte; EOF mid-way is a failure."""
    chunks: list[bytes] = []
    got = 0
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            if got:
                raise FuzzFailure(f"connection closed mid-frame ({got} of {n} bytes)")
            return None
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _recv_frame(sock: socket.socket) -> bytes | None:
    header = _recv_exact(sock, 4)
    if header is None:
        return None
    (length,) = struct.unpack(">I", header)
    body = _recv_exact(sock, length)
    if body is None:
        raise FuzzFailure("connection closed after a frame header")
    return body


class RpcConn:
    """A raw engine connection: bytes out, strictly decoded server messages in.

    Sending runs in a thread while the caller reads, because the daemon stops
    reading a client whose replies pile up unread (backpressure), and a
    client that only writes would then wait on it forever.
    """

    def __init__(self, path: str, timeout: float = IO_TIMEOUT_S) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.sock.connect(path)
        self.events: list[rpc.Event] = []
        self._ids = itertools.count(1_000_000)
        self._decoder = msgspec.msgpack.Decoder(rpc.ServerMessage)

    def next_id(self) -> int:
        return next(self._ids)

    def recv(self) -> rpc.ServerMessage | None:
        """The next message, or None at EOF; a frame that does not decode fails the case."""
        body = _recv_frame(self.sock)
        if body is None:
            return None
        try:
            return self._decoder.decode(body)
        except msgspec.MsgspecError as exc:
            raise FuzzFailure(f"daemon sent an undecodable frame: {exc}: {body[:200]!r}") from exc

    def recv_reply(self) -> rpc.Reply | None:
        """The next reply (events are kept aside), or None at EOF."""
        while True:
            message = self.recv()
            if isinstance(message, rpc.Events):
                self.events.extend(message.events)  # protocol 2: one frame of events
            elif message is None or not isinstance(message, rpc.Event):
                return message
            else:
                self.events.append(message)

    def exchange(self, data: bytes, n_replies: int) -> list[rpc.Reply]:
        """Send ``data`` and read ``n_replies`` replies while it is being sent."""
        sender = _Sender(self.sock, data)
        try:
            replies: list[rpc.Reply] = []
            for _ in range(n_replies):
                reply = self.recv_reply()
                if reply is None:
                    raise FuzzFailure(f"connection closed after {len(replies)} replies")
                replies.append(reply)
        finally:
            sender.join()
        return replies

    def call(self, request: rpc.Request) -> rpc.Reply:
        (reply,) = self.exchange(bytes(FrameEncoder().encode(request)), 1)
        if reply.id != request.id:
            raise FuzzFailure(f"reply {reply} does not answer {type(request).__name__}")
        return reply

    def status(self) -> dict:
        reply = self.call(rpc.Status(self.next_id()))
        assert isinstance(reply, rpc.StatusReply), reply
        return msgspec.to_builtins(reply.status)

    def drain_to_eof(self) -> list[rpc.ServerMessage]:
        messages = []
        while (message := self.recv()) is not None:
            messages.append(message)
        return messages

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> RpcConn:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Sender:
    """sendall() in a thread; errors other than a closed peer are re-raised by join()."""

    def __init__(self, sock: socket.socket, data: bytes) -> None:
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(sock, data), daemon=True)
        self._thread.start()

    def _run(self, sock: socket.socket, data: bytes) -> None:
        try:
            sock.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the daemon closed the connection: the reader sees why
        except BaseException as exc:
            self._error = exc

    def join(self) -> None:
        self._thread.join(IO_TIMEOUT_S)
        if self._thread.is_alive():
            raise FuzzFailure("sending did not finish: the daemon stopped reading")
        if self._error is not None:
            raise self._error


class PeerConn:
    """A raw TCP client of a daemon's peer port; daemon frames decode strictly."""

    def __init__(self, port: int, timeout: float = IO_TIMEOUT_S) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self._decoder = msgspec.msgpack.Decoder(pm.PeerMessage)

    def recv(self) -> pm.PeerMessage | None:
        body = _recv_frame(self.sock)
        if body is None:
            return None
        try:
            return self._decoder.decode(body)
        except msgspec.MsgspecError as exc:
            raise FuzzFailure(f"daemon sent an undecodable peer frame: {exc}") from exc

    def challenge(self) -> pm.Challenge:
        message = self.recv()
        if not isinstance(message, pm.Challenge):
            raise FuzzFailure(f"expected a Challenge first, got {message!r}")
        return message

    def send(self, data: bytes) -> None:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            self.sock.sendall(data)

    def finish(self) -> list[pm.PeerMessage]:
        """Half-close, then everything the daemon sends until it closes."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_WR)
        messages = []
        try:
            while (message := self.recv()) is not None:
                messages.append(message)
        except ConnectionResetError:
            pass  # closed with unread input: as good as EOF
        return messages

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> PeerConn:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ------------------------------------------------------------ registry views


@dataclass(frozen=True)
class RegistryView:
    """What must not change under invalid input: live requests, pending, engines."""

    requests: frozenset[tuple[str, int, str]]
    pending: int
    engines: frozenset[str]


def status_view(status: dict) -> RegistryView:
    requests = frozenset(
        (r["request_id"], r["incarnation"], r["state"]) for r in status["requests"]
    )
    assert status["live"] == len(requests), "status lists at most 200 requests; keep fewer live"
    assert sum(status["by_state"].values()) == status["live"]
    return RegistryView(
        requests, status["pending_peer_registrations"], frozenset(status["engines"])
    )


def journal_view(daemon: Daemon) -> RegistryView:
    """The registry a replay of the daemon's journal rebuilds (ARCHITECTURE.md, invariant 8)."""
    registry = replay(daemon.journal).registry
    requests = frozenset(
        (r.request_id, r.incarnation, r.state.value) for r in registry.live.values()
    )
    return RegistryView(requests, len(registry.pending), frozenset(registry.engines))


def both_views(daemon: Daemon) -> RegistryView:
    """The live registry, checked against the journal's."""
    live = status_view(daemon.status())
    replayed = journal_view(daemon)
    if live != replayed:
        raise FuzzFailure(f"{daemon.node}: status {live} but the journal replays to {replayed}")
    return live


def check_reply_code(reply: rpc.Reply) -> None:
    if isinstance(reply, rpc.Error) and reply.code not in ALLOWED_CODES:
        raise FuzzFailure(f"daemon answered {reply}")


# ------------------------------------------------------------- the target


@dataclass
class FuzzTarget:
    """Two real daemons that peer with each other, and what the fuzzers share."""

    prefill: Daemon
    decode: Daemon
    workdir: Path
    counts: Counter[str] = field(default_factory=Counter)
    frames: RpcConn | None = None
    sequence: SequenceEngine | None = None
    serial: Iterator[int] = field(default_factory=itertools.count)
    baseline: RegistryView | None = None

    def frames_conn(self) -> RpcConn:
        if self.frames is None:
            self.frames = RpcConn(self.prefill.socket)
        return self.frames

    def sequence_engine(self) -> SequenceEngine:
        if self.sequence is None:
            self.sequence = SequenceEngine.create(self.prefill.socket)
        return self.sequence

    def reset_frames(self) -> None:
        if self.frames is not None:
            self.frames.close()
            self.frames = None

    def close(self) -> None:
        self.reset_frames()
        if self.sequence is not None:
            self.sequence.close()
            self.sequence = None

    def alive(self) -> None:
        """Both daemons run, answer status, and still see each other."""
        for daemon, peer in ((self.prefill, "decode"), (self.decode, "prefill")):
            assert daemon.proc is not None
            if daemon.proc.poll() is not None:
                raise FuzzFailure(f"{daemon.node} exited {daemon.proc.returncode}")
            peers = {p["node"]: p for p in daemon.status()["peers"]}
            if not peers[peer]["up"]:
                raise FuzzFailure(f"{daemon.node} lost its link to {peer}")

    def link_identity(self) -> tuple[str, str]:
        """Who the prefill daemon's link to decode is: a replaced link changes this."""
        (link,) = [p for p in self.prefill.status()["peers"] if p["node"] == "decode"]
        return link["boot_id"], link["peername"]


@contextlib.contextmanager
def fuzz_pair(workdir: Path) -> Iterator[FuzzTarget]:
    prefill, decode = start_pair(workdir)
    target = FuzzTarget(prefill, decode, workdir)
    try:
        yield target
    finally:
        target.close()
        prefill.stop()
        decode.stop()


def error_log_lines(daemon: Daemon) -> list[str]:
    """Log lines at error level or above: each is a path that failed rather than refused."""
    return [
        line
        for line in daemon.logs().splitlines()
        if ('"level": "error"' in line or '"level": "critical"' in line) and not from_library(line)
    ]


# -------------------------------------------------------------- strategies

INT_EDGES: Final = [0, 1, -1, 2**31 - 1, 2**31, 2**32, 2**63 - 1, -(2**63), 2**64 - 1]
ints = st.one_of(st.integers(-3, 70), st.sampled_from(INT_EDGES), st.integers(-(2**63), 2**64 - 1))
STRING_POOL: Final = ["", "r0", "r1", "decode", "prefill", "fz-seq", "e0", "x" * 300, "\x00", "é"]
strings = st.one_of(st.sampled_from(STRING_POOL), st.text(max_size=16))
scalars = st.one_of(st.none(), st.booleans(), ints, st.floats(), strings, st.binary(max_size=24))
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(strings, inner, max_size=4)
    ),
    max_leaves=12,
)


def strategy_for(t: mi.Type) -> st.SearchStrategy[Any]:
    """Values of a msgspec type: well-typed, hostile in content (edge ints, odd strings)."""
    match t:
        case mi.BoolType():
            return st.booleans()
        case mi.IntType():
            return ints
        case mi.FloatType():
            return st.floats()
        case mi.StrType():
            return strings
        case mi.BytesType():
            return st.binary(max_size=48)
        case mi.NoneType():
            return st.none()
        case mi.EnumType(cls=cls):
            return st.sampled_from(list(cls))
        case mi.VarTupleType(item_type=item):
            return st.lists(strategy_for(item), max_size=6).map(tuple)
        case mi.TupleType(item_types=items):
            return st.tuples(*(strategy_for(i) for i in items))
        case mi.UnionType(types=types):
            return st.one_of(*(strategy_for(u) for u in types))
        case mi.StructType(cls=cls, fields=fields):
            kwargs = {f.name: strategy_for(f.type) for f in fields}
            return st.builds(cls, **kwargs)
        case mi.DictType() | mi.AnyType():
            return st.dictionaries(strings, scalars, max_size=3)
    raise TypeError(f"no strategy for {t}")


def typed(tp: Any) -> st.SearchStrategy[Any]:
    return strategy_for(mi.type_info(tp))


# ===================================================================== RPC


def encode_body(message: Any) -> bytes:
    return msgspec.msgpack.encode(message)


# ---- rpc_stream: raw bytes on a fresh connection


@st.composite
def rpc_streams(draw: st.DrawFn) -> tuple[str, bytes]:
    """(kind, bytes) written to a fresh connection before it is half-closed."""
    kind = draw(st.sampled_from(["random", "truncated", "oversized", "zero", "mixed"]))
    valid = _encode_frame(draw(typed(rpc.Request)))
    if kind == "random":
        data = draw(st.binary(min_size=1, max_size=300))
    elif kind == "truncated":
        data = valid[: draw(st.integers(1, len(valid) - 1))]
    elif kind == "oversized":
        length = draw(st.integers(MAX_FRAME + 1, 2**32 - 1))
        data = struct.pack(">I", length) + draw(st.binary(max_size=64))
    elif kind == "zero":
        data = struct.pack(">I", 0) * draw(st.integers(1, 3)) + valid
    else:
        pieces = draw(st.lists(st.sampled_from([valid, b"\x00\x00\x00\x03abc"]), max_size=3))
        data = b"".join(pieces) + draw(st.binary(min_size=1, max_size=40))
    return kind, data


def _encode_frame(message: Any) -> bytes:
    return frame_bytes(encode_body(message))


def rpc_stream_case(target: FuzzTarget, case: tuple[str, bytes]) -> int:
    """Anything may come back, as long as it decodes, and the daemon closes the connection."""
    kind, data = case
    with RpcConn(target.prefill.socket) as conn:
        if kind == "oversized":
            # Refused from the length alone: an error and a close, without our EOF.
            _Sender(conn.sock, data).join()
            messages = conn.drain_to_eof()
            if not any(
                isinstance(m, rpc.Error) and m.code == rpc.FRAME_TOO_LARGE for m in messages
            ):
                raise FuzzFailure(f"oversized frame answered {messages}")
        else:
            _Sender(conn.sock, data).join()
            with contextlib.suppress(OSError):
                conn.sock.shutdown(socket.SHUT_WR)
            messages = conn.drain_to_eof()
    for message in messages:
        if isinstance(message, rpc.Error):
            check_reply_code(message)
    target.counts["rpc_stream"] += 1
    return 1


# ---- rpc_frames: hostile bodies, well framed, one long-lived connection

RPC_OPS: Final = [
    "hello",
    "register_engine",
    "register_request",
    "kv_ready",
    "release",
    "abort",
    "hold",
    "status",
]
RPC_FIELDS: Final = [
    "id",
    "op",
    "engine_id",
    "request_id",
    "role",
    "blocks",
    "incarnation",
    "peer",
    "offload",
    "offload_slots",
    "groups",
    "regions",
    "client",
    "protocol",
]


@st.composite
def wrong_typed(draw: st.DrawFn) -> bytes:
    """A valid request with one field replaced, removed, or an unknown one added."""
    request = msgspec.to_builtins(draw(typed(rpc.Request)))
    key = draw(st.sampled_from(sorted(request)))
    action = draw(st.sampled_from(["replace", "remove", "add"]))
    if action == "replace":
        request[key] = draw(values)
    elif action == "remove":
        del request[key]
    else:
        request[draw(strings)] = draw(values)
    return encode_body(request)


@st.composite
def huge_blocks(draw: st.DrawFn) -> bytes:
    """A registration with a block list near the frame limit, or very many groups."""
    n = draw(st.sampled_from([10_000, 100_000, 600_000]))
    blocks = ((draw(ints),) * n,) if draw(st.booleans()) else ((),) * n
    request = rpc.RegisterRequest(
        draw(ints), draw(strings), draw(strings), draw(st.sampled_from(list(Role))), blocks
    )
    return encode_body(request)


rpc_bodies = st.one_of(
    st.binary(min_size=0, max_size=64),  # garbage (b"": a zero-length frame)
    st.builds(
        lambda op, fields: encode_body({**fields, "op": op}),
        st.one_of(st.sampled_from(RPC_OPS), strings, values),
        st.dictionaries(st.one_of(st.sampled_from(RPC_FIELDS), strings), values, max_size=6),
    ),
    wrong_typed(),
    typed(rpc.Request).map(encode_body),  # well typed, about nothing that exists
    st.builds(lambda rid, op: encode_body({"op": op, "id": rid}), ints, strings),  # unknown tags
    st.binary(max_size=16).map(lambda tail: encode_body({"op": "status", "id": 1}) + tail),
)
rpc_batches = st.lists(
    st.one_of(rpc_bodies, huge_blocks()).filter(lambda b: len(b) <= MAX_FRAME),
    min_size=1,
    max_size=6,
)


def rpc_frames_case(target: FuzzTarget, bodies: Sequence[bytes]) -> int:
    """Every frame gets exactly one reply; nothing that is refused changes the registry."""
    conn = target.frames_conn()
    data = b"".join(frame_bytes(body) for body in bodies)
    replies = conn.exchange(data, len(bodies))
    for reply in replies:
        check_reply_code(reply)
    # A barrier on this connection: every earlier frame has been answered.
    view = status_view(conn.status())
    if view != target_baseline(target):
        raise FuzzFailure(f"registry changed under invalid input: {view}")
    target.counts["rpc_frames"] += len(bodies)
    return len(bodies)


def target_baseline(target: FuzzTarget) -> RegistryView:
    assert target.baseline is not None, "set_baseline() first"
    return target.baseline


def set_baseline(target: FuzzTarget) -> RegistryView:
    """What the prefill registry must return to after every case."""
    target.baseline = both_views(target.prefill)
    return target.baseline


# ---- rpc_sequence: valid requests in any order, from an engine's own connection

SEQ_LAYOUT: Final = (  # two groups; the second spans 2 kernel blocks per logical block
    (GroupKind.ATTENTION, 64, 1),
    (GroupKind.ATTENTION, 64, 2),
)


@dataclass
class SequenceEngine:
    """A connection that owns a real engine (real shm files), for out-of-order requests."""

    conn: RpcConn
    engine_id: str
    paths: list[str]

    @classmethod
    def create(cls, socket_path: str) -> SequenceEngine:
        tag = uuid.uuid4().hex[:8]
        engine_id = f"fz-seq-{tag}"
        groups, regions, paths = [], [], []
        for g, (kind, num_blocks, per_logical) in enumerate(SEQ_LAYOUT):
            region = create_shm_file(f"/dev/shm/kvpushd-fuzz-{tag}-g{g}", num_blocks * 256)
            paths.append(region.path)
            regions.append(region)
            groups.append(GroupSpec(kind, num_blocks, 256, (LayerSpec(region.name),), per_logical))
        conn = RpcConn(socket_path)
        reply = conn.call(
            rpc.RegisterEngine(conn.next_id(), engine_id, tuple(groups), tuple(regions))
        )
        assert isinstance(reply, rpc.Ok), reply
        return cls(conn, engine_id, paths)

    def close(self) -> None:
        self.conn.close()
        for path in self.paths:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


# Weighted by repetition: most requests should meet a live request of theirs.
OPS: Final = ["register"] * 3 + ["kv_ready", "release", "abort"] * 2 + ["hold", "status"]
good_logical = st.lists(st.integers(0, 31), max_size=4, unique=True)
good_blocks = st.tuples(good_logical, good_logical)  # in range (may collide: blocks_owned)
sequence_blocks = st.one_of(
    good_blocks,
    good_blocks,
    good_blocks,
    st.tuples(good_logical, st.lists(ints, max_size=3)),  # out of range, negative, huge
    st.lists(good_logical, max_size=3).map(tuple),  # wrong group count
    st.just(((5, 5), ())),  # a block listed twice
    st.just(((), ())),  # nothing to write
)
op_tuples = st.tuples(
    st.sampled_from(OPS),
    st.integers(0, 1),  # which request id
    st.sampled_from([1] * 6 + [2, 0, -1]),  # incarnation
    st.sampled_from(list(Role)),
    sequence_blocks,
    st.sampled_from(["decode"] * 4 + ["", "nowhere"]),  # a receiver's peer
)
# Each case opens with a valid registration of both request ids, so that the
# random requests after it mostly meet a live request in some state.
openers = st.tuples(
    st.just("register"),
    st.just(0),
    st.just(1),
    st.sampled_from(list(Role)),
    good_blocks,
    st.just("decode"),
)
sequence_ops = st.builds(
    lambda first, second, rest: [first, (*second[:1], 1, *second[2:]), *rest],
    openers,
    openers,
    st.lists(op_tuples, min_size=1, max_size=10),
)


def _sequence_request(conn: RpcConn, engine_id: str, rid: str, op: tuple) -> rpc.Request:
    kind, _, inc, role, blocks, peer = op
    rid_ = conn.next_id()
    if kind == "register":
        return rpc.RegisterRequest(rid_, engine_id, rid, role, blocks, inc, peer)
    if kind == "kv_ready":
        return rpc.KvReady(rid_, rid, inc)
    if kind == "release":
        return rpc.Release(rid_, rid, inc)
    if kind == "abort":
        return rpc.Abort(rid_, rid, inc)
    if kind == "hold":
        return rpc.Hold(rid_, rid, peer, "", inc)
    return rpc.Status(rid_)


EXPECTED_REPLY: Final[dict[type, tuple[type, ...]]] = {
    rpc.RegisterRequest: (rpc.RequestAccepted, rpc.Error),
    rpc.KvReady: (rpc.Ok, rpc.Error),
    rpc.Release: (rpc.Ok, rpc.Deferred, rpc.Error),
    rpc.Abort: (rpc.Ok, rpc.Error),
    rpc.Hold: (rpc.Ok, rpc.Error),
    rpc.Status: (rpc.StatusReply,),
}


def rpc_sequence_case(target: FuzzTarget, ops: Sequence[tuple]) -> int:
    """Pipelined valid requests in any order: one fitting reply each, and all can be ended."""
    engine = target.sequence_engine()
    conn = engine.conn
    prefix = f"s{next(target.serial)}"
    requests = [_sequence_request(conn, engine.engine_id, f"{prefix}-{op[1]}", op) for op in ops]
    replies = conn.exchange(b"".join(bytes(FrameEncoder().encode(r)) for r in requests), len(ops))
    by_id = {reply.id: reply for reply in replies}
    for request in requests:
        reply = by_id.get(request.id)
        if reply is None or not isinstance(reply, EXPECTED_REPLY[type(request)]):
            raise FuzzFailure(f"{request} answered {reply}")
        check_reply_code(reply)
        target.counts[f"rpc_sequence:{type(request).__name__}:{_outcome(reply)}"] += 1
    _end_all(target, conn, prefix)
    target.counts["rpc_sequence"] += len(ops)
    return len(ops)


def _outcome(reply: rpc.Reply) -> str:
    return reply.code if isinstance(reply, rpc.Error) else type(reply).__name__


def _end_all(target: FuzzTarget, conn: RpcConn, prefix: str) -> None:
    """Abort and release whatever a case left live; both daemons must get back to empty."""
    end_requests(target, conn, [f"{prefix}-{k}" for k in range(3)])


def end_requests(target: FuzzTarget, conn: RpcConn, request_ids: Sequence[str]) -> None:
    cleanup = [
        request(conn.next_id(), rid, inc)
        for rid in request_ids
        for inc in (-1, 0, 1, 2)
        for request in (rpc.Abort, rpc.Release)
    ]
    data = b"".join(bytes(FrameEncoder().encode(r)) for r in cleanup)
    for reply in conn.exchange(data, len(cleanup)):
        check_reply_code(reply)
    wait_settled(target, lambda: f"requests {list(request_ids)}")


def wait_settled(target: FuzzTarget, what: Callable[[], str], timeout: float = 20.0) -> None:
    """Wait until both registries are back to their baselines (peer replies take a moment)."""
    deadline = time.monotonic() + timeout
    want = target_baseline(target)
    while True:
        prefill = status_view(target.prefill.status())
        decode = target.decode.status()
        if prefill == want and decode["live"] == 0 and decode["pending_peer_registrations"] == 0:
            return
        if time.monotonic() > deadline:
            raise FuzzFailure(
                f"{what()}: not settled: prefill {prefill}, decode live/pending "
                f"{decode['live']}/{decode['pending_peer_registrations']}"
            )
        time.sleep(0.01)


# ================================================================ peer link


def peer_frame(message: pm.PeerMessage) -> bytes:
    return frame_bytes(encode_body(message))


peer_streams = st.binary(min_size=1, max_size=300)


def peer_stream_case(target: FuzzTarget, data: bytes, *, port: int | None = None) -> int:
    """Random bytes after the Challenge: at most a Goodbye comes back, then the close."""
    with PeerConn(port or target.prefill.port) as conn:
        conn.challenge()
        conn.send(data)
        _check_preauth_end(conn.finish())
    target.counts["peer_stream"] += 1
    return 1


def _check_preauth_end(messages: Sequence[pm.PeerMessage]) -> None:
    for message in messages:
        if not isinstance(message, pm.Goodbye) or message.reason not in PREAUTH_GOODBYES:
            raise FuzzFailure(f"an unauthenticated client got {message!r}")


@st.composite
def bad_answers(draw: st.DrawFn) -> pm.Answer:
    node = draw(st.sampled_from(["decode", "decode", "prefill", "zzz"]) | strings)
    nonce = draw(st.binary(min_size=NONCE_BYTES, max_size=NONCE_BYTES) | st.binary(max_size=64))
    return pm.Answer(node, nonce, draw(st.binary(min_size=32, max_size=32) | st.binary()))


peer_messages = st.one_of(
    typed(pm.PeerMessage).map(peer_frame),  # anything well-formed, before auth
    bad_answers().map(peer_frame),
    st.builds(lambda tag, rest: frame_bytes(encode_body([tag, *rest])), strings, st.lists(values)),
    st.builds(  # over the pre-auth limit
        lambda n: struct.pack(">I", PREAUTH_FRAME_BYTES + n) + b"\x00" * 64,
        st.integers(1, 2**31),
    ),
    st.just(struct.pack(">I", 0)),
)
peer_batches = st.lists(peer_messages, min_size=1, max_size=4)


def peer_frames_case(
    target: FuzzTarget, frames: Sequence[bytes], *, port: int | None = None
) -> int:
    """Nothing is accepted before authentication: a Goodbye at most, never a Welcome."""
    with PeerConn(port or target.prefill.port) as conn:
        conn.challenge()
        conn.send(b"".join(frames))
        _check_preauth_end(conn.finish())
    target.counts["peer_frames"] += len(frames)
    return len(frames)


# ================================================================== journal

JOURNAL_OK: Final = (JournalError, ReplayError)  # JournalCorrupt is a JournalError


def build_base_journal(path: Path) -> None:
    """A realistic journal: several segments, a snapshot mid-way, live requests at the end."""
    registry = Registry()
    with Journal.open(path, fsync=FsyncPolicy.NEVER, segment_bytes=6 * 1024) as journal:
        rec = Ledger(journal, registry, node="prefill", clock=FakeClock())
        run_mix(rec, 12)
        rec.snapshot(retain_segments=8)
        run_mix_more(rec)


def run_mix_more(rec: Ledger) -> None:
    """After the snapshot: a few more requests, two of them left live."""
    reg = rec.registry
    for i in range(4):
        rid = f"late-{i}"
        rec.append(reg.check_register(rid, 1, Role.PUSHER, PREFILL.engine_id, "decode", [[i], [i]]))
        if i < 2:
            for event in reg.plan_abort(rid, 1, Reason.ABORTED, "fuzz base"):
                rec.append(event)
            for event in reg.plan_release(rid, 1):
                rec.append(event)


def journal_files(path: Path) -> list[Path]:
    return sorted(p for p in path.iterdir() if p.suffix in (".kvj", ".kvs"))


@st.composite
def byte_mutations(draw: st.DrawFn) -> list[tuple]:
    """1-3 damages, each aimed at one file by index, at offsets chosen relative to its size."""
    kinds = ["flip", "truncate", "splice", "zero", "garbage", "append", "delete", "dup"]
    out = []
    for _ in range(draw(st.integers(1, 3))):
        out.append(
            (
                draw(st.sampled_from(kinds)),
                draw(st.integers(0, 63)),  # file index (modulo the count)
                draw(st.floats(0, 1)),  # where in the file
                draw(st.integers(1, 64)),  # how many bytes / bits
                draw(st.binary(min_size=1, max_size=64)),  # garbage to write
                draw(st.integers(0, 63)),  # second file (splices)
                draw(st.floats(0, 1)),  # where in the second file
            )
        )
    return out


def apply_byte_mutation(path: Path, mutation: tuple) -> None:
    kind, index, where, n, garbage, index2, where2 = mutation
    files = journal_files(path)
    if not files:
        return
    victim = files[index % len(files)]
    data = bytearray(victim.read_bytes())
    at = int(where * len(data))
    if kind == "flip" and data:
        for k in range(n):
            bit = (at * 8 + k * 37) % (len(data) * 8)
            data[bit // 8] ^= 1 << (bit % 8)
    elif kind == "truncate":
        del data[at:]
    elif kind == "splice":
        other = files[index2 % len(files)].read_bytes()
        start = int(where2 * len(other))
        data[at:at] = other[start : start + n * 16]
    elif kind == "zero":
        data[at : at + n * 8] = bytes(len(data[at : at + n * 8]))
    elif kind == "garbage":
        data[at : at + len(garbage)] = garbage
    elif kind == "append":
        data += garbage
    elif kind == "delete":
        victim.unlink()
        return
    elif kind == "dup":
        # A copy under a neighbouring sequence number: overlaps and gaps.
        stem, _, digits = victim.stem.partition("-")
        victim.with_name(f"{stem}-{int(digits) + n:020d}{victim.suffix}").write_bytes(data)
        return
    victim.write_bytes(bytes(data))


def check_journal(path: Path) -> str:
    """Every reader either succeeds or reports damage; returns the outcome for counting."""
    outcome = "ok"
    strict = None
    try:
        strict = replay(path)
    except JOURNAL_OK:
        outcome = "damage"
    try:
        salvaged = replay(path, salvage=True)
    except JOURNAL_OK:
        salvaged = None
    # Salvage reads past damage; where there is none it must agree exactly.
    if strict is not None and (
        salvaged is None or salvaged.registry.snapshot(0) != strict.registry.snapshot(0)
    ):
        raise FuzzFailure("a journal that replays cleanly salvages differently")
    code = verify_exit_code(path)
    want = {0, 1} if strict is not None else {2}
    if not journal_files(path):
        # Every file deleted: replay reads an empty journal (a first start),
        # while verify, given a directory without one, says there is no
        # journal there (exit 2). Neither is damage.
        want = {2}
    if code not in want:
        raise FuzzFailure(f"journal verify exited {code}, replay says {outcome}")
    return outcome


def verify_exit_code(path: Path) -> int:
    """``kvpushd journal verify`` in-process; an uncaught exception fails the case."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        return cli.main(["journal", "verify", str(path)])


class JournalSandbox:
    """A pristine base journal and a scratch copy of it per case."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.base = root / "base"
        build_base_journal(self.base)
        self.records = _read_frames(journal_files_of(self.base, ".kvj"))
        self._n = itertools.count()

    def scratch(self) -> Path:
        path = self.root / f"case-{next(self._n)}"
        shutil.copytree(self.base, path)
        return path


def journal_files_of(path: Path, suffix: str) -> list[Path]:
    return [p for p in journal_files(path) if p.suffix == suffix]


def _read_frames(segments: list[Path]) -> list[tuple[Path, int, bytes]]:
    """(segment, frame offset, payload) of every record frame."""
    frames = []
    for seg in segments:
        data = seg.read_bytes()
        offset = HEADER_SIZE
        while offset + FRAME_OVERHEAD <= len(data):
            (length,) = struct.unpack_from(">I", data, offset)
            frames.append(
                (seg, offset, data[offset + FRAME_OVERHEAD : offset + FRAME_OVERHEAD + length])
            )
            offset += FRAME_OVERHEAD + length
    return frames


def journal_bytes_case(sandbox: JournalSandbox, counts: Counter[str], mutations: list) -> int:
    path = sandbox.scratch()
    try:
        for mutation in mutations:
            apply_byte_mutation(path, mutation)
        counts[f"journal_bytes:{check_journal(path)}"] += 1
    finally:
        shutil.rmtree(path, ignore_errors=True)
    counts["journal_bytes"] += 1
    return 1


def _frame(payload: bytes) -> bytes:
    length = struct.pack(">I", len(payload))
    return length + struct.pack(">I", crc32c(length + payload)) + payload


random_records = st.builds(
    lambda event, v, seq, ts, node: encode_record(Record(v, node, seq, ts, event)),
    typed(Event),
    st.sampled_from([FORMAT_VERSION, FORMAT_VERSION, 0, FORMAT_VERSION + 1]),
    st.integers(0, 200),
    st.floats(allow_nan=False),
    strings,
)


@st.composite
def record_mutations(draw: st.DrawFn) -> tuple[int, str, bytes, int]:
    """(record index, how, data, position): the payload changes, its CRC is made right."""
    how = draw(st.sampled_from(["replace", "flip", "truncate", "random", "insert"]))
    data = draw(random_records) if how in ("replace", "insert") else draw(st.binary(max_size=40))
    return draw(st.integers(0, 10_000)), how, data, draw(st.integers(0, 10_000))


def journal_records_case(sandbox: JournalSandbox, counts: Counter[str], mutation: tuple) -> int:
    index, how, data, pos = mutation
    path = sandbox.scratch()
    try:
        seg, offset, payload = sandbox.records[index % len(sandbox.records)]
        target = path / seg.name
        content = bytearray(target.read_bytes())
        old = FRAME_OVERHEAD + len(payload)
        if how == "replace":
            new = _frame(data)
        elif how == "insert":
            new = _frame(data) + bytes(content[offset : offset + old])
        elif how == "flip":
            body = bytearray(payload)
            body[pos % len(body)] ^= 1 << (pos % 8)
            new = _frame(bytes(body))
        elif how == "truncate":
            new = _frame(payload[: pos % len(payload)] or b"\x90")
        else:
            new = _frame(data or b"\xc0")
        content[offset : offset + old] = new
        target.write_bytes(bytes(content))
        counts[f"journal_records:{check_journal(path)}"] += 1
    finally:
        shutil.rmtree(path, ignore_errors=True)
    counts["journal_records"] += 1
    return 1


# ================================================================ running


def run_cases(
    strategy: st.SearchStrategy[Any],
    case: Callable[[Any], int],
    examples: int,
    *,
    seed: int | None = None,
) -> int:
    """Run ``case`` on ``examples`` generated inputs; returns how many inputs ran.

    Hypothesis shrinks a failing input before re-raising, so a failure
    names a small case. ``seed`` (the soak tool's) makes a run repeatable;
    CI runs are derandomized unless KVPUSHD_FUZZ_RANDOM is set.
    """
    ran = 0

    @settings(
        max_examples=max(1, examples),
        deadline=None,
        database=None,
        derandomize=seed is None and not RANDOM,
        phases=(Phase.generate, Phase.shrink),
        suppress_health_check=list(HealthCheck),
        print_blob=True,
    )
    @given(strategy)
    def run(value: Any) -> None:
        nonlocal ran
        ran += case(value)

    if seed is not None:
        from hypothesis import seed as hypothesis_seed

        run = hypothesis_seed(seed)(run)
    run()
    return ran


def scaled(n: int) -> int:
    return max(1, int(n * SCALE))


# ============================================================ push check


async def push_once(target: FuzzTarget, tag: str) -> None:
    """A SimEngine pair pushes real bytes through both daemons, verified byte for byte."""
    layout = [SimGroup(num_blocks=64, block_bytes=1024, layers=2)]
    pe = await SimEngine.create(f"fzp-{tag}", Role.PUSHER, layout, target.prefill.socket)
    de = await SimEngine.create(f"fzd-{tag}", Role.RECEIVER, layout, target.decode.socket)
    try:
        src, dst = [[1, 2, 3, 4]], [[10, 11]]
        pairs = tail_pairs(pe.layout, src, de.layout, dst)
        await de.decode_register("push", dst, "prefill", expect=Expectation(pe.engine_id, pairs))
        await pe.prefill("push", src)
        arrived = await de.wait_event("push", (rpc.KvArrived, rpc.RequestFailed), timeout=30)
        assert isinstance(arrived, rpc.KvArrived), arrived
        assert de.reports[("push", 1)].ok, de.reports[("push", 1)].problems()
        await pe.wait_event("push", rpc.BlocksFreeable, timeout=30)
        await de.release("push")
        await pe.release("push")
    finally:
        await pe.close()
        await de.close()
