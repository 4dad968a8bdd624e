"""Loading the daemon's TOML configuration into ``schemas.config.Config``."""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any

import msgspec

from schemas.config import Config


class ConfigError(Exception):
    """The configuration is unusable; the message names the field."""


def _check(config: Config) -> None:
    if not config.node:
        raise ConfigError("node: must not be empty")
    if config.peers and not config.secret_file:
        raise ConfigError("secret_file: required when peers are configured")
    if config.listen and config.listen.rpartition(":")[0] == "":
        raise ConfigError(f"listen: expected host:port, got {config.listen!r}")
    for i, peer in enumerate(config.peers):
        if peer.address.rpartition(":")[0] == "":
            raise ConfigError(f"peers[{i}].address: expected host:port, got {peer.address!r}")
        if peer.node == config.node:
            raise ConfigError(f"peers[{i}].node: a node cannot peer with itself")
    for name in ("registered", "trimmed", "writing", "done", "failed"):
        if getattr(config.deadlines, name) <= 0:
            raise ConfigError(f"deadlines.{name}: must be > 0 seconds")
    if config.heartbeat_s <= 0 or config.peer_ttl_s <= config.heartbeat_s:
        raise ConfigError("peer_ttl_s: must be greater than heartbeat_s (both > 0)")
    if config.peer_connect_timeout_s <= 0:
        raise ConfigError("peer_connect_timeout_s: must be > 0 seconds")
    if config.peer_idle_close_s < 0:
        raise ConfigError("peer_idle_close_s: must be >= 0 seconds (0: never close)")
    if config.journal.segment_mb < 1:
        raise ConfigError("journal.segment_mb: must be >= 1")
    if config.limits.max_frame_bytes < 1024:
        raise ConfigError("limits.max_frame_bytes: must be >= 1024")


def _local_defaults(config: Config) -> Config:
    """Fill the paths a systemd unit would provide, for local use without one."""
    changes: dict[str, Any] = {}
    if not config.socket:
        runtime = os.environ.get("RUNTIME_DIRECTORY") or f"/tmp/kvpushd-{os.getuid()}"
        changes["socket"] = str(Path(runtime) / f"{config.node}.sock")
    if not config.journal.dir:
        state = os.environ.get("STATE_DIRECTORY") or str(
            Path.home() / ".local" / "state" / "kvpushd"
        )
        journal = msgspec.structs.replace(config.journal, dir=str(Path(state) / config.node))
        changes["journal"] = journal
    return msgspec.structs.replace(config, **changes) if changes else config


def load_config(path: Path | None, overrides: dict[str, Any] | None = None) -> Config:
    """Read ``path`` (None: defaults only), apply ``overrides``, validate."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            data = tomllib.loads(path.read_text())
        except OSError as exc:
            raise ConfigError(f"cannot read {path}: {exc.strerror}") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: not valid TOML: {exc}") from exc
    for key, value in (overrides or {}).items():
        if value is not None:
            data[key] = value
    try:
        config = msgspec.convert(data, Config)
    except msgspec.ValidationError as exc:
        # msgspec names the field as `$.journal.fsync`; say it the TOML way.
        raise ConfigError(str(exc).replace("`$.", "`")) from exc
    config = _local_defaults(config)
    _check(config)
    return config
