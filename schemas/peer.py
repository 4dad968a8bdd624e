"""Peer link between daemons: authentication, layouts, request coordination.

Same framing as the engine RPC. The connecting side (the dialer) and the
accepting side authenticate each other with HMAC-SHA256 over fresh nonces
before anything else is accepted:

1. accept -> dial: ``Challenge(node, nonce_a)``
2. dial -> accept: ``Answer(node, nonce_b, mac=H(secret, "dial", nonce_a, dialer, acceptor))``
3. accept -> dial: ``Welcome(mac=H(secret, "accept", nonce_b, acceptor, dialer))``

Both nonces are fresh per connection, so a recorded answer cannot be
replayed. Then each side sends ``Hello`` with its NIXL agent metadata and
engines; incompatible layouts end the link with ``Goodbye``.
"""

from __future__ import annotations

from typing import Annotated, Final

import msgspec

from schemas.events import (
    MAX_REPORTED_ID,
    Detail,
    Difference,
    Incarnation,
    Layer,
    Position,
    ReportedId,
)
from schemas.fingerprint import Fingerprint
from schemas.kvlayout import RemoteEngine
from schemas.reasons import Reason

PEER_PROTOCOL: Final = 1


class _Peer(msgspec.Struct, frozen=True, tag_field="t", array_like=True):
    pass


class Challenge(_Peer, frozen=True, tag="challenge"):
    node: str
    nonce: bytes
    protocol: int = PEER_PROTOCOL


class Answer(_Peer, frozen=True, tag="answer"):
    node: str
    nonce: bytes
    mac: bytes


class Welcome(_Peer, frozen=True, tag="welcome"):
    mac: bytes


class Hello(_Peer, frozen=True, tag="hello"):
    """After authentication: who I am on the data plane, and my engines."""

    node: str
    boot_id: str
    agent_name: str
    agent_metadata: bytes
    engines: tuple[RemoteEngine, ...]


class Engines(_Peer, frozen=True, tag="engines"):
    """An engine registered or changed after the link came up.

    Carries the agent metadata again: NIXL's metadata names the registered
    memory, so a peer must reload it before it can prepare the new engine.
    """

    engines: tuple[RemoteEngine, ...]
    agent_metadata: bytes


class Goodbye(_Peer, frozen=True, tag="goodbye"):
    reason: str
    message: str


class Heartbeat(_Peer, frozen=True, tag="heartbeat"):
    ts: float


class Forward(_Peer, frozen=True, tag="forward"):
    """Receiver -> pusher: a decode engine registered a request (kernel block ids)."""

    request_id: str
    incarnation: int
    engine_id: str
    blocks: tuple[tuple[int, ...], ...]
    per_logical: int
    # The decode engine's fingerprint, from its own daemon (never from a router).
    fingerprint: Fingerprint | None = None
    # What the decode engine said its blocks are for (Registered.content).
    content: str = ""
    # Registered from the prefill's answer (Registered.answered); an older
    # daemon neither sends nor reads it (False: the receiver waits as before).
    answered: bool = False


class Writing(_Peer, frozen=True, tag="writing"):
    """Pusher -> receiver: the write for this request is posted."""

    request_id: str
    incarnation: int
    num_blocks: int
    nbytes: int


class WriteDone(_Peer, frozen=True, tag="write_done"):
    request_id: str
    incarnation: int


class WriteFailed(_Peer, frozen=True, tag="write_failed"):
    """Pusher -> receiver: the request failed on the pusher; no write is in flight."""

    request_id: str
    incarnation: int
    reason: Reason
    message: str


class Digests(_Peer, frozen=True, tag="digests"):
    """Pusher -> receiver: checksums of a sampled request's source blocks.

    Taken before the write is posted, over the blocks the trim paired (the
    journaled ``Trimmed.src``), for the receiver's blocks ``dst``
    (``Trimmed.dst``). ``digests`` holds one little-endian uint32 per
    (group, layer, block), group by group, layer by layer, then block by
    block in pairing order (statemachine/integrity.py); ``algorithm`` names
    how they were computed (daemon/dataplane/digest.py), ``"none"`` when the
    pusher could not (the request goes unchecked).
    """

    request_id: str
    incarnation: int
    algorithm: str
    digests: bytes
    dst: tuple[tuple[int, ...], ...]


class Hold(_Peer, frozen=True, tag="hold"):
    """Receiver -> pusher: the decode engine will register this request once it has blocks."""

    request_id: str
    incarnation: int


class Cancel(_Peer, frozen=True, tag="cancel"):
    """Receiver -> pusher: the decode engine gave the request up."""

    request_id: str
    incarnation: int


class KvMismatch(_Peer, frozen=True, tag="kv_mismatch"):
    """Receiver -> pusher: the decode engine found the pushed KV is not its own.

    Its engine's report (rpc.KvMismatch), journaled on the decode node first;
    ``engine_id`` is the decode engine. The pusher's daemon journals its own
    ``kv_mismatch`` and quarantines the pairing (statemachine/quarantine.py).
    """

    request_id: ReportedId
    incarnation: Incarnation
    engine_id: Annotated[str, msgspec.Meta(max_length=MAX_REPORTED_ID)]
    layer: Layer
    position: Position
    difference: Difference
    tolerance: Difference
    detail: Detail = ""


PeerMessage = (
    Challenge
    | Answer
    | Welcome
    | Hello
    | Engines
    | Goodbye
    | Heartbeat
    | Forward
    | Writing
    | WriteDone
    | WriteFailed
    | Cancel
    | Digests
    | Hold
    | KvMismatch
)
