"""Daemon configuration, decoded from TOML into these Structs.

Every field has a default that works for local use, so ``kvpushd run`` needs
no config file on a developer machine.
"""

from __future__ import annotations

import enum

import msgspec

from schemas.state import Deadlines


class FsyncPolicy(enum.StrEnum):
    ALWAYS = "always"
    BATCH = "batch"
    NEVER = "never"


class PeerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    node: str
    address: str  # host:port of the peer's listen address


class JournalConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    dir: str = ""  # empty: $STATE_DIRECTORY/NODE, else ~/.local/state/kvpushd/NODE
    fsync: FsyncPolicy = FsyncPolicy.BATCH
    # 0: commit as soon as the loop is idle; appends made while a sync is in
    # flight ride the next one, which is what groups them.
    commit_window_ms: float = 0.0
    segment_mb: int = 64
    snapshot_every: int = 100_000  # records between snapshots
    retain_segments: int = 2


class NixlConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    backend: str = "UCX"
    # Seconds the data-plane thread sleeps between polls while transfers or
    # notifications are outstanding; it blocks when there are none.
    poll_interval_s: float = 0.00005


class LimitsConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    max_frame_bytes: int = 4 * 1024 * 1024
    max_live_per_engine: int = 4096
    tombstones: int = 100_000


class Config(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    node: str = "kvpushd"
    socket: str = ""  # empty: $RUNTIME_DIRECTORY/NODE.sock, else /tmp/kvpushd-UID/NODE.sock
    listen: str = "127.0.0.1:7700"  # peer link; empty string: do not listen
    peers: tuple[PeerConfig, ...] = ()
    secret_file: str = ""  # shared secret for the peer link; required when peers exist
    heartbeat_s: float = 1.0
    peer_ttl_s: float = 5.0
    # Peers on demand (README.md): accept an authenticated dialer that is not
    # in `peers`, and dial the pusher's daemon a receiver registration names by
    # `peer_address`. Off: only `peers` ever link, and addresses are ignored.
    on_demand_peers: bool = True
    # How long dialing an on-demand peer (TCP connect, handshake, Hello) may
    # take before the registration that needed it is refused peer_unreachable.
    peer_connect_timeout_s: float = 5.0
    # An on-demand link this node dialed is closed once no live request has
    # referenced the peer for this long (0: never); it is dialed again when a
    # registration needs it, never in a loop.
    peer_idle_close_s: float = 60.0
    drain_s: float = 10.0
    allowed_uids: tuple[int, ...] = ()  # empty: the daemon's own uid and root
    allowed_gids: tuple[int, ...] = ()
    log_level: str = "info"
    metrics_port: int = 0  # 0: no metrics endpoint
    journal: JournalConfig = JournalConfig()
    deadlines: Deadlines = Deadlines()
    nixl: NixlConfig = NixlConfig()
    limits: LimitsConfig = LimitsConfig()
