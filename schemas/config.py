"""Daemon configuration, decoded from TOML into these Structs.

Every field has a default that works for local use, so ``kvpushd run`` needs
no config file on a developer machine (README.md, "Configuration").

Ranges are declared here, beside each field, so that a file with a port of
70000 or a negative duration is refused at load, naming the field, instead
of being carried out; rules that relate fields live in ``daemon/config.py``.
"""

from __future__ import annotations

import enum
from typing import Annotated, Final, Literal

import msgspec

from schemas.state import Deadlines

Seconds = Annotated[float, msgspec.Meta(gt=0)]
Positive = Annotated[int, msgspec.Meta(ge=1)]
NonNegative = Annotated[int, msgspec.Meta(ge=0)]
# uid_t and gid_t are 32-bit; (uid_t)-1 means "no change" to the kernel, never a user.
PosixId = Annotated[int, msgspec.Meta(ge=0, le=2**32 - 2)]

DEFAULT_LISTEN: Final = "127.0.0.1:7700"

# The journal format new segments are written in, the one default of both
# the daemon's `journal.format` and `Journal.open` when it is not told
# (daemon/journal/format.py imports it). 2, a frame per group commit: what
# the daemon has written since format 2 landed, and what replays fastest (one
# CRC pass and one decode per commit). 1, a frame per record, is what a
# kvpushd from before format 2 can replay: a deployment that may still roll
# back to one sets `journal.format = 1`; every kvpushd since reads both.
DEFAULT_JOURNAL_FORMAT: Final = 2


class LogLevel(enum.StrEnum):
    DEBUG = "debug"
    INFO = "info"
    WARNING = "warning"
    ERROR = "error"


class FsyncPolicy(enum.StrEnum):
    ALWAYS = "always"
    BATCH = "batch"
    NEVER = "never"


class VerifyMode(enum.StrEnum):
    OFF = "off"
    SAMPLE = "sample"  # requests chosen by their id at `sample_rate`
    ALL = "all"


class IntegrityConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """End-to-end checksums of pushed blocks (README.md, "Integrity").

    Both daemons of a pair must agree: each decides from the request id
    alone whether a request is checked (statemachine/integrity.py).
    """

    verify: VerifyMode = VerifyMode.SAMPLE
    sample_rate: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.01


class PeerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    node: str
    address: str  # host:port of the peer's listen address (port checked in daemon/config.py)


class JournalConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    dir: str = ""  # empty: $STATE_DIRECTORY/NODE, else ~/.local/state/kvpushd/NODE
    fsync: FsyncPolicy = FsyncPolicy.BATCH
    # 0: commit as soon as the loop is idle; appends made while a sync is in
    # flight ride the next one, which is what groups them.
    commit_window_ms: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    segment_mb: Positive = 64
    snapshot_every: NonNegative = 100_000  # records between snapshots; 0: never
    retain_segments: NonNegative = 2
    # The on-disk format of the segments this daemon creates (1 or 2; see
    # DEFAULT_JOURNAL_FORMAT above: keep 1 while a rollback to a kvpushd from
    # before format 2 may still happen). Either is read.
    format: Literal[1, 2] = DEFAULT_JOURNAL_FORMAT


class NixlConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    backend: Annotated[str, msgspec.Meta(min_length=1)] = "UCX"
    # Seconds the data-plane thread sleeps between polls while transfers or
    # notifications are outstanding; it blocks when there are none.
    poll_interval_s: Seconds = 0.00005


class LimitsConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    # A frame's length prefix is 4 bytes; below 1 KiB not even a status fits.
    max_frame_bytes: Annotated[int, msgspec.Meta(ge=1024, le=2**32 - 1)] = 4 * 1024 * 1024
    max_live_per_engine: Positive = 4096
    # Released ids remembered to refuse stale messages (invariant 4): never none.
    tombstones: Positive = 100_000


# The offload pool's header page: the pool's slots start after it (daemon/dataplane/pool.py).
OFFLOAD_HEADER_BYTES: Final = 4096
# A slot is whole pages: slots stay page-aligned in every mapping (a GPU
# engine pins them for DMA) and are zeroed and checked a word at a time.
OFFLOAD_SLOT_ALIGN: Final = 4096
MAX_OFFLOAD_SLOTS: Final = 1 << 24
MAX_OFFLOAD_SLOT_BYTES: Final = 1 << 30


class OffloadConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The node's KV offload tier (README.md, "Offload tier").

    ``slots`` equal slots of ``slot_bytes`` bytes each, in one pool the
    daemon owns and hands to engines by descriptor. ``path`` "": an
    anonymous memfd that dies with the daemon (every key misses after a
    restart); a path under /dev/shm: a file that survives daemon restarts
    (its committed keys hit again). ``reserve``: slots kept reset and free
    ahead of grants (0: slots // 16, at least 1). Rules relating the fields
    (alignment, reserve <= slots, where path may be) are in daemon/config.py.
    """

    slots: Annotated[int, msgspec.Meta(ge=0, le=MAX_OFFLOAD_SLOTS)] = 0  # 0: no tier
    slot_bytes: Annotated[int, msgspec.Meta(ge=0, le=MAX_OFFLOAD_SLOT_BYTES)] = 0
    path: str = ""
    reserve: Annotated[int, msgspec.Meta(ge=0, le=MAX_OFFLOAD_SLOTS)] = 0

    @property
    def enabled(self) -> bool:
        return self.slots > 0

    @property
    def reserved(self) -> int:
        """The slots kept free ahead of grants (``reserve``, or its default)."""
        return self.reserve or max(1, self.slots // 16)


class Config(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    node: str = "kvpushd"
    socket: str = ""  # empty: $RUNTIME_DIRECTORY/NODE.sock, else /tmp/kvpushd-UID/NODE.sock
    # Peer link; "": do not listen. Left out of the file, it is DEFAULT_LISTEN
    # when secret_file is set and "" without one (daemon/config.py), so that
    # `kvpushd run` starts with no config at all.
    listen: str = DEFAULT_LISTEN
    peers: tuple[PeerConfig, ...] = ()
    secret_file: str = ""  # shared secret for the peer link; required to listen or peer
    heartbeat_s: Seconds = 1.0
    peer_ttl_s: Seconds = 5.0
    # Peers on demand (README.md): accept an authenticated dialer that is not
    # in `peers`, and dial the pusher's daemon a receiver registration names by
    # `peer_address`. Off: only `peers` ever link, and addresses are ignored.
    on_demand_peers: bool = True
    # How long dialing an on-demand peer (TCP connect, handshake, Hello) may
    # take before the registration that needed it is refused peer_unreachable.
    peer_connect_timeout_s: Seconds = 5.0
    # An on-demand link this node dialed is closed once no live request has
    # referenced the peer for this long (0: never); it is dialed again when a
    # registration needs it, never in a loop.
    peer_idle_close_s: Annotated[float, msgspec.Meta(ge=0)] = 60.0
    drain_s: Seconds = 10.0
    # Who may use the engine socket (SO_PEERCRED). Empty uids: the daemon's
    # own uid and root. Groups by name or gid, a primary or supplementary
    # membership; None (left out): the daemon's own group, which under the
    # systemd unit is `kvpushd`, the group that owns the socket. After load
    # (daemon/config.py) names are resolved, so only gids remain.
    allowed_uids: tuple[PosixId, ...] = ()
    allowed_groups: tuple[PosixId | str, ...] | None = None
    log_level: LogLevel = LogLevel.INFO
    metrics_port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 0  # 0: no metrics endpoint
    # The CPUs every thread of the daemon runs on (the event loop, the NIXL
    # worker, UCX's threads): cores the engines do not use. Empty: not pinned.
    # Checked against the machine at start-up (daemon/affinity.py).
    cpu_affinity: tuple[NonNegative, ...] = ()
    journal: JournalConfig = JournalConfig()
    deadlines: Deadlines = Deadlines()
    nixl: NixlConfig = NixlConfig()
    limits: LimitsConfig = LimitsConfig()
    integrity: IntegrityConfig = IntegrityConfig()
    offload: OffloadConfig = OffloadConfig()
