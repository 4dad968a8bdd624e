"""The status document: what a daemon says about itself (``kvpushd status``).

Sent in :class:`schemas.rpc.StatusReply`. Every field has a default and
unknown fields are ignored, so a client decodes the document of a daemon one
version older or newer than itself; the daemon builds it in
daemon/node/status.py.
"""

from __future__ import annotations

import msgspec

from schemas.fingerprint import Fingerprint


class _Part(msgspec.Struct, frozen=True, kw_only=True):
    pass


class OldestRequest(_Part, frozen=True):
    request_id: str = ""
    state: str = ""
    age_s: float = 0.0


class RequestLine(_Part, frozen=True):
    request_id: str = ""
    incarnation: int = 0
    role: str = ""
    state: str = ""
    engine: str = ""
    peer: str = ""
    age_s: float = 0.0


class EngineLine(_Part, frozen=True):
    connected: bool = False
    groups: int = 0
    live: int = 0
    offload_free: int | None = None
    # What produced the engine's KV (None: the engine declared none).
    fingerprint: Fingerprint | None = None
    # How the engine handed its memory over ("descriptor", "file", "cuda_ipc";
    # several, comma-separated, when its regions differ), whose bytes they are
    # ("cache": its KV cache itself, "staging": a mirror it copies through),
    # and the engine's one-line why ("" when it gave none).
    memory: str = ""
    kv: str = ""
    memory_why: str = ""


class PeerLine(_Part, frozen=True):
    node: str = ""
    address: str = ""
    up: bool = False
    direction: str = ""  # "dialed" / "accepted" when up
    boot_id: str = ""
    last_heard_age_s: float | None = None
    peername: str = ""
    on_demand: bool = False  # not in [[peers]]: linked because a registration needed it


class JournalLine(_Part, frozen=True):
    dir: str = ""
    next_seq: int = 0
    durable_seq: int = 0
    lag: int = 0  # records appended but not yet durable


class DataPlaneCounters(_Part, frozen=True):
    writes: int = 0
    write_errors: int = 0
    writes_cancelled: int = 0
    bytes_written: int = 0


class OffloadLine(_Part, frozen=True):
    """The node's KV offload tier (README.md, "Offload tier"); None when it is off."""

    slots: int = 0
    slot_bytes: int = 0
    pool_id: str = ""
    path: str = ""  # "": an anonymous memfd
    survived: bool = False  # the pool's memory outlived the last daemon
    reserve: int = 0  # slots kept free ahead of grants
    by_state: dict[str, int] = {}  # slots per state (schemas/state.py SlotState)
    holders: int = 0  # tier clients with a live connection
    # Since the daemon started: keys looked up (hit, miss), stored (committed,
    # duplicate: the first kept), slots reset, slots found not zero at grant,
    # slots readers condemned (their digest differed).
    hits: int = 0
    misses: int = 0
    committed: int = 0
    duplicates: int = 0
    resets: int = 0
    not_zero: int = 0
    condemned: int = 0


class StatusDocument(_Part, frozen=True):
    node: str = ""
    version: str = ""
    boot_id: str = ""
    pid: int = 0
    uptime_s: float = 0.0
    live: int = 0
    by_state: dict[str, int] = {}
    pending_peer_registrations: int = 0
    oldest: OldestRequest | None = None
    # The oldest requests first, at most daemon/node/status.py's MAX_LISTED.
    requests: list[RequestLine] = []
    engines: dict[str, EngineLine] = {}
    peers: list[PeerLine] = []
    journal: JournalLine = JournalLine()
    counters: dict[str, int] = {}
    peer_engines: dict[str, list[str]] = {}
    dataplane: DataPlaneCounters = DataPlaneCounters()
    writes_in_flight: int = 0
    metrics_port: int | None = None  # set when the daemon serves metrics
    offload: OffloadLine | None = None  # the offload tier, when configured
