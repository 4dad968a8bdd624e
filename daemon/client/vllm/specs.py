"""What the connector's two sides hand each other, and what the daemon's answers become.

The scheduler side names each push and load as a spec (``PushSpec``,
``ReceiveSpec``); the worker side carries them out. ``Freed``, ``GaveUp``
and ``DaemonLost`` are the connector's own events: they travel from the
link's loop thread to vLLM's thread in the same queue as the daemon's.
Pure: no vLLM, no torch, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final, NamedTuple

from daemon.client.vllm.layout import Blocks
from schemas import rpc
from schemas.fingerprint import Fingerprint
from schemas.kvlayout import GroupSpec
from statemachine.ranks import HeadSource


class SliceEngine(NamedTuple):
    """Head or layer slice of a rank's blocks, registered as an engine of its own.

    Its groups lie over the rank's own memory; its fingerprint names the
    heads and layers it holds. A spec on a slice carries it, so the link's
    loop thread registers the slice from what it was handed, never from
    vLLM's thread's bookkeeping.
    """

    groups: tuple[GroupSpec, ...]
    fingerprint: Fingerprint


@dataclass(frozen=True)
class PushSpec:
    """A finished prefill request whose blocks the daemon pushes.

    ``split_tp``/``split_pp``: the TP and PP sizes naming the shares (the
    decode's when this instance splits its push for a decode with more
    ranks or stages; 0: its own).
    ``engine_id``: the engine (this rank's, or a head slice of it) the
    worker registers the pusher on; "" until the worker chose. ``slice``:
    that engine, where it is a slice.
    """

    request_id: str
    transfer_id: str
    block_ids: Blocks  # per KV cache group; () for none in any
    split_tp: int = 0
    split_pp: int = 0
    engine_id: str = ""
    content: str = ""  # the prompt's digest: the daemon pairs only equal ones
    slice: SliceEngine | None = None


@dataclass(frozen=True)
class ReceiveSpec:
    """A decode request waiting for its prompt's KV in ``block_ids``.

    ``source_ranks``: the prefill instance's TP size (from its fingerprint),
    which names its ranks' shares of the transfer. ``paired``: the two
    instances' KV pairs (each decode rank ends its own sources' pushes);
    False: rank 0 ends every prefill rank's push (the prefill daemon refuses
    the pairing). ``engine_id``: the engine (this rank's, or a head slice of
    it) the worker registers the receiver on; "" until the worker chose.
    ``slice``: that engine, where it is a slice.
    """

    request_id: str
    transfer_id: str
    block_ids: Blocks  # per KV cache group; () for none in any
    peer: str
    peer_address: str
    source_ranks: int = 1
    paired: bool = True
    engine_id: str = ""
    source_stages: int = 1  # the prefill's pipeline stages, as source_ranks
    # The TP size naming the prefill's shares: source_ranks, or this
    # instance's when the prefill split its push for it (0: source_ranks).
    split_tp: int = 0
    content: str = ""  # this request's prompt digest: the daemon pairs only equal ones
    slice: SliceEngine | None = None
    # The blocks (group, block id) holding the prompt's last token, which the
    # decode computes itself, and that token's position: its own K/V there
    # checks the pushed one (daemon/client/vllm/kvcheck.py). (): unchecked.
    check: tuple[tuple[int, int], ...] = ()
    position: int = -1
    # Loaded from the prefill's answer (it finished the request and registers
    # its push within a step or two), not a leg sent with the prefill's: a
    # transfer that prefill never had fails within its daemon's
    # ``[deadlines] answered``, and vLLM computes the prompt at once.
    answered: bool = False

    @property
    def shares_tp(self) -> int:
        """The TP size the prefill's shares of this transfer are named by."""
        return self.split_tp or self.source_ranks


class Source(NamedTuple):
    """A prefill rank a decode rank loads from: its stage, and its heads' slice."""

    stage: int
    heads: HeadSource


@dataclass(frozen=True)
class Freed:
    """The daemon released a receiver whose load failed: its blocks are vLLM's again."""

    request_id: str


@dataclass(frozen=True)
class GaveUp:
    """A transfer the daemon will never report on (refused, or the daemon is gone)."""

    request_id: str
    reason: str
    message: str


@dataclass(frozen=True)
class DaemonLost:
    """The connection of ``generation`` ended: what it held will never be reported on."""

    generation: int


# What the link's loop thread hands vLLM's thread, in order.
WorkerEvent = rpc.Event | GaveUp | Freed | DaemonLost


def outcome(event: Any, ok: str) -> str:
    """How a transfer ended, as the stats name it."""
    if isinstance(event, rpc.RequestFailed):
        return f"failed:{event.reason}"
    if isinstance(event, GaveUp):
        return f"gave_up:{event.reason}"
    if isinstance(event, rpc.Released):
        return "released"
    return ok


def per_group(block_ids: Blocks, groups: int) -> list[list[int]]:
    """Block ids as the daemon takes them: one list per group (() is none in any)."""
    if not block_ids:
        return [[] for _ in range(groups)]
    return [list(ids) for ids in block_ids]


# Both sides remember recent request and transfer ids, up to this many each.
MAX_SEEN: Final = 65536


def remember(memory: dict[str, Any], key: str, value: Any) -> None:
    """Note ``key`` in a memory bounded to MAX_SEEN entries (the oldest go first)."""
    memory[key] = value
    if len(memory) > MAX_SEEN:
        del memory[next(iter(memory))]
