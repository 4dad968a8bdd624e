"""Loading the daemon's TOML configuration into ``schemas.config.Config``."""

from __future__ import annotations

import grp
import math
import os
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec

from schemas.config import DEFAULT_LISTEN, OFFLOAD_SLOT_ALIGN, Config, OffloadConfig
from schemas.state import Deadlines

# sun_path is 108 bytes on Linux, the terminating NUL included.
MAX_SOCKET_PATH_BYTES = 107


class ConfigError(Exception):
    """The configuration is unusable; the message names the field."""


def _check_address(field: str, address: str) -> None:
    """``host:port`` with a port a peer can dial (1-65535)."""
    host, _, port = address.rpartition(":")
    if not host:
        raise ConfigError(f"{field}: expected host:port, got {address!r}")
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ConfigError(f"{field}: port must be 1-65535, got {address!r}")


def _floats(value: object, prefix: str = "") -> Iterator[tuple[str, float]]:
    """Every float field of a config, by its dotted TOML name."""
    if isinstance(value, msgspec.Struct):
        for name in value.__struct_fields__:
            yield from _floats(getattr(value, name), f"{prefix}{name}.")
    elif isinstance(value, float):
        yield prefix.rstrip("."), value


def _check(config: Config) -> None:
    if not config.node:
        raise ConfigError("node: must not be empty")
    if "/" in config.node or config.node in (".", ".."):
        # The node names the journal directory and the default socket file.
        raise ConfigError(f"node: must be usable as a file name, got {config.node!r}")
    for name, value in _floats(config):
        # TOML has inf and nan; an infinite deadline is a request that never ends.
        if not math.isfinite(value):
            raise ConfigError(f"{name}: must be a finite number, got {value}")
    if config.peers and not config.secret_file:
        raise ConfigError("secret_file: required when peers are configured")
    if config.listen:
        if not config.secret_file:
            raise ConfigError(
                f"listen: a peer listener ({config.listen}) needs secret_file, the peer "
                f'link\'s shared secret; set secret_file, or listen = "" to not listen'
            )
        _check_address("listen", config.listen)
    for i, peer in enumerate(config.peers):
        _check_address(f"peers[{i}].address", peer.address)
        if peer.node == config.node:
            raise ConfigError(f"peers[{i}].node: a node cannot peer with itself")
    if len(os.fsencode(config.socket)) > MAX_SOCKET_PATH_BYTES:
        raise ConfigError(
            f"socket: {config.socket!r} is longer than the {MAX_SOCKET_PATH_BYTES} bytes "
            f"a Unix socket path may have; choose a shorter path"
        )
    for name in Deadlines.__struct_fields__:  # every deadline, ``answered`` too
        if getattr(config.deadlines, name) <= 0:
            raise ConfigError(f"deadlines.{name}: must be > 0 seconds")
    if config.heartbeat_s <= 0 or config.peer_ttl_s <= config.heartbeat_s:
        raise ConfigError("peer_ttl_s: must be greater than heartbeat_s (both > 0)")
    if config.peer_connect_timeout_s <= 0:
        raise ConfigError("peer_connect_timeout_s: must be > 0 seconds")
    if config.peer_idle_close_s < 0:
        raise ConfigError("peer_idle_close_s: must be >= 0 seconds (0: never close)")
    _check_offload(config.offload)


def _check_offload(offload: OffloadConfig) -> None:
    """The [offload] tier's rules that relate its fields (ranges: schemas/config.py)."""
    if not offload.enabled:
        if offload.slot_bytes or offload.path or offload.reserve:
            raise ConfigError("offload.slots: set it (> 0) to turn the tier on, or drop [offload]")
        return
    if offload.slot_bytes < OFFLOAD_SLOT_ALIGN or offload.slot_bytes % OFFLOAD_SLOT_ALIGN:
        raise ConfigError(
            f"offload.slot_bytes: must be a multiple of {OFFLOAD_SLOT_ALIGN} (whole pages) and "
            f"hold one offloaded block, got {offload.slot_bytes}"
        )
    if offload.reserve > offload.slots:
        raise ConfigError(
            f"offload.reserve: {offload.reserve} is more than the {offload.slots} slots"
        )
    if offload.path:
        # The same rule as an engine's region paths (daemon/dataplane/memory.py).
        real = os.path.realpath(offload.path)
        shm = os.path.realpath("/dev/shm")
        if not os.path.isabs(offload.path) or real == shm or os.path.commonpath([real, shm]) != shm:
            raise ConfigError(
                f'offload.path: {offload.path!r} must be a file under /dev/shm (or "" '
                f"for a pool that dies with the daemon)"
            )


def resolve_group(group: int | str) -> int:
    """A gid, from a gid or a group name; ConfigError for a name this host does not know."""
    if isinstance(group, int):
        return group
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise ConfigError(
            f"allowed_groups: no group named {group!r} on this host; create it "
            f"(groupadd {group}) or give a gid"
        ) from None


def _resolve_groups(config: Config) -> Config:
    """Names to gids, now: the engine server compares gids, and a typo must stop the start."""
    if config.allowed_groups is None:
        # The daemon's own group: under the unit (Group=kvpushd) the socket's group.
        groups: tuple[int | str, ...] = (os.getgid(),)
    else:
        groups = tuple(resolve_group(g) for g in config.allowed_groups)
    return msgspec.structs.replace(config, allowed_groups=groups)


def _local_defaults(config: Config, given: dict[str, Any]) -> Config:
    """Fill the paths a systemd unit would provide, for local use without one.

    A listener is the default only with a secret to authenticate peers by:
    without one, `kvpushd run` with no config starts with no peer link.
    """
    changes: dict[str, Any] = {}
    if "listen" not in given:
        changes["listen"] = DEFAULT_LISTEN if config.secret_file else ""
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
    if "allowed_gids" in data:
        raise ConfigError("allowed_gids: renamed allowed_groups, which takes group names or gids")
    try:
        config = msgspec.convert(data, Config)
    except msgspec.ValidationError as exc:
        raise ConfigError(_field_first(str(exc))) from exc
    config = _local_defaults(config, data)
    _check(config)
    return _resolve_groups(config)


def _field_first(message: str) -> str:
    """msgspec's "Expected `int` <= 65535 - at `$.metrics_port`" as "metrics_port: ...".

    Every other ConfigError starts with the TOML name of the field; so do these.
    """
    problem, sep, where = message.rpartition(" - at `$.")
    if not sep:
        return message.replace("`$.", "`")
    return f"{where.rstrip('`')}: {problem[0].lower()}{problem[1:]}"
