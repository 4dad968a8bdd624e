"""The router parameters protocol: what travels in a request's ``kv_transfer_params``.

A prefill instance answers a finished request with a ``PrefillAnswer``:
the fields a decode instance needs to load its KV, under ``kvpushd_*``
keys, with the protocol's version. A router copies them into the decode
leg, and the decode reads them back through the same Struct
(``read_leg``): a missing, mistyped or other-version field is a clear
reason to compute the prompt, never a guess. A router may instead send
both legs at once (vLLM's push-mode proxy), naming the transfer and the
prefill's daemon in vLLM's own fields (``Dispatch``); ``adopt_dispatch``
reads those and records a ``Dispatched`` leg in the same params. The
prefill leg's hints (the decode's TP and PP sizes, a router's transfer
id) stay tolerant: an unreadable hint means the prefill's own sizes, or
the request's id. Before any of that, ``bound_params`` makes what a client
sent typed and bounded (the connector puts it in place of the client's
dict, the one vLLM pickles with each step): every field read here, of its
type and size, and any other only when plain JSON of bounded depth and
size. Pure: no vLLM, no torch, no I/O.
"""

from __future__ import annotations

from typing import Annotated, Any, Final, Literal, NamedTuple

import msgspec

from daemon.client.vllm.layout import Blocks
from daemon.client.vllm.specs import ReceiveSpec
from schemas.fingerprint import MAX_RANKS, MAX_WORD, Fingerprint

# The version of the fields below. A decode reads only its own: a prefill of
# another version computes the prompt there (both sides upgrade together).
PARAMS_VERSION: Final = 1
MAX_TRANSFER_ID: Final = 200

# A host name (a DNS name is 253 characters at most), and a host and port.
MAX_HOST: Final = 256
MAX_ADDRESS: Final = MAX_HOST + len(":65535")
MAX_PROMPT: Final = 1 << 31

RankCount = Annotated[int, msgspec.Meta(ge=1, le=MAX_RANKS)]
TransferId = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_TRANSFER_ID)]
NonEmpty = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_WORD)]
Address = Annotated[str, msgspec.Meta(max_length=MAX_ADDRESS)]
HostName = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_HOST)]


def _kvpushd_key(name: str) -> str:
    return f"kvpushd_{name}"


class PrefillAnswer(msgspec.Struct, frozen=True, rename=_kvpushd_key):
    """What a prefill request that pushed hands its router for the decode leg.

    ``split_tp``/``split_pp``: the TP and PP sizes the prefill named its
    shares by (the decode's, when the router named them and the ranks map;
    its own otherwise). ``prompt_len``/``prompt_digest``: which prompt the
    KV is of; the decode checks it is its own.
    """

    version: Annotated[int, msgspec.Meta(ge=0, le=1 << 16)]
    transfer_id: TransferId
    node: NonEmpty
    address: Address
    fingerprint: Fingerprint
    split_tp: RankCount
    split_pp: RankCount
    prompt_len: Annotated[int, msgspec.Meta(ge=0, le=MAX_PROMPT)]
    prompt_digest: Annotated[str, msgspec.Meta(max_length=MAX_WORD)]

    def to_params(self) -> dict[str, Any]:
        """The answer as kv_transfer_params: a decode leg that loads it."""
        fields: dict[str, Any] = msgspec.to_builtins(self)
        return {"do_remote_prefill": True, "do_remote_decode": False, **fields}


class Dispatched(msgspec.Struct, frozen=True, rename=_kvpushd_key):
    """A decode leg sent at once with the prefill's, as the connector took it.

    The prefill has not answered: no fingerprint or prompt to compare here
    (the daemon checks both at the pairing); the prefill's sizes are the
    ones the router named.
    """

    concurrent: Literal[True]
    transfer_id: TransferId
    node: NonEmpty
    address: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ADDRESS)]
    source_tp: RankCount
    source_pp: RankCount


class Dispatch(msgspec.Struct, frozen=True):
    """The fields vLLM's push-mode proxy sends on a decode leg (vLLM's names)."""

    transfer_id: TransferId
    remote_engine_id: NonEmpty
    remote_host: HostName
    remote_port: Annotated[int, msgspec.Meta(gt=0, lt=65536)]
    # The prefill's sizes: unsaid means 1; said, they must be sizes.
    tp_size: RankCount = 1
    pp_size: RankCount = 1


# What a decode leg names: the prefill's answer, or a dispatched leg.
Leg = PrefillAnswer | Dispatched


def router_transfer_id(params: dict[str, Any]) -> str | None:
    """The transfer id a router named on a leg (``transfer_id``), if it is a usable one."""
    named = params.get("transfer_id")
    if isinstance(named, str) and 0 < len(named) <= MAX_TRANSFER_ID and "@" not in named:
        return named
    return None


def adopt_dispatch(params: dict[str, Any]) -> str | None:
    """Take a decode leg sent at once with the prefill's (vLLM's push-mode proxy).

    It names the transfer (``transfer_id``), the prefill daemon's node
    (``remote_engine_id``) and peer address (``remote_host``,
    ``remote_port``), and the prefill's TP and PP sizes (``tp_size``,
    ``pp_size``; 1 when unsaid, never a guess when unreadable); no block
    ids. In place, it becomes a ``Dispatched`` leg. Returns why not,
    changing nothing, if the leg is not usable.
    """
    if router_transfer_id(params) is None:
        return f"the router's transfer_id {params.get('transfer_id')!r} is not usable"
    try:
        sent = msgspec.convert(params, Dispatch)
    except msgspec.ValidationError as exc:
        return f"the router's push-mode fields are not usable ({exc})"
    leg = Dispatched(
        True,
        sent.transfer_id,
        sent.remote_engine_id,
        f"{sent.remote_host}:{sent.remote_port}",
        sent.tp_size,
        sent.pp_size,
    )
    params.update(msgspec.to_builtins(leg))
    return None


def read_leg(params: dict[str, Any]) -> Leg | str:
    """The leg a decode request's params name, or why they name none usable."""
    try:
        if params.get(_kvpushd_key("concurrent")):
            return msgspec.convert(params, Dispatched)
        answer = msgspec.convert(params, PrefillAnswer)
    except msgspec.ValidationError as exc:
        return f"the prefill's answer is not readable ({exc})"
    if answer.version != PARAMS_VERSION:
        return (
            f"the prefill answered in params version {answer.version}; "
            f"this connector reads version {PARAMS_VERSION}"
        )
    return answer


# What of a client's kv_transfer_params the connector keeps beyond its own
# fields (vLLM's, another connector's): plain JSON, this deep and this large
# in all. Params of over MAX_KEYS keys are not looked at: the request
# computes its prompt.
MAX_KEYS: Final = 64
MAX_ITEMS: Final = 4096
MAX_DEPTH: Final = 4
MAX_TEXT: Final = 1 << 16
_INT64: Final = 1 << 63
# The params of a request that computes locally, whatever it was sent.
LOCAL: Final = {"do_remote_prefill": False, "do_remote_decode": False}


def _fields(*structs: type[msgspec.Struct]) -> dict[str, Any]:
    return {f.encode_name: f.type for s in structs for f in msgspec.structs.fields(s)}


# Every field the connector reads, with its type and bounds (a leg's fields
# as its Struct reads them; the prefill leg's hints as sizes).
_READ: Final[dict[str, Any]] = {
    "do_remote_prefill": bool,
    "do_remote_decode": bool,
    **_fields(Dispatch, Dispatched, PrefillAnswer),
    "kvpushd_decode_tp": RankCount,
    "kvpushd_decode_pp": RankCount,
}


class Bounded(NamedTuple):
    """A client's params as the connector keeps them, and what it dropped (by key)."""

    params: dict[str, Any]
    # Each dropped field's key (cut short) and why; never its value.
    dropped: list[str]
    # A field the connector reads was dropped: a decode leg cannot load.
    unread: bool


def bound_params(params: object) -> Bounded:
    """``params`` typed and bounded, for the connector to put in their place.

    Each field the connector reads is kept in the form its type reads back
    (a fingerprint as a fingerprint's fields; None as None, which reads as
    it did) or dropped if it does not read; any other field is kept only
    as plain JSON within MAX_DEPTH, and all of them within MAX_ITEMS values
    and MAX_TEXT characters. Params that are no dict, or have too many keys
    to look at, become ``LOCAL``. Nothing nests deeper than a few levels,
    so vLLM's own pickling of the step never meets a client's structure.
    """
    if not isinstance(params, dict):
        return Bounded(dict(LOCAL), [f"kv_transfer_params: {type(params).__name__}"], True)
    if len(params) > MAX_KEYS:
        return Bounded(dict(LOCAL), [f"kv_transfer_params: {len(params)} keys"], True)
    kept: dict[str, Any] = {}
    dropped: list[str] = []
    unread = False
    budget = [MAX_ITEMS, MAX_TEXT]
    for key, value in params.items():
        name = repr(key)[:60]
        if key in _READ and value is not None:
            try:
                kept[key] = msgspec.to_builtins(msgspec.convert(value, _READ[key]))
            except msgspec.ValidationError as exc:
                dropped.append(f"{name}: {str(exc)[:200]}")
                unread = True
        elif isinstance(key, str) and _plain(key, left := list(budget)) and _plain(value, left):
            kept[key] = value
            budget = left
        else:
            dropped.append(f"{name}: not plain JSON of bounded size")
    return Bounded(kept, dropped, unread)


def _plain(value: object, budget: list[int]) -> bool:
    """Whether ``value`` is plain JSON within the bounds: budget is [values, characters] left.

    Walked with a stack, never recursion: a value nested a thousand deep is
    refused at MAX_DEPTH, a list of a million at the budget's end.
    """
    stack: list[tuple[object, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        budget[0] -= 1
        if budget[0] < 0 or depth > MAX_DEPTH:
            return False
        if item is None or isinstance(item, (bool, float)):
            continue
        if isinstance(item, int):
            if not -_INT64 <= item < _INT64:
                return False
        elif isinstance(item, str):
            budget[1] -= len(item)
            if budget[1] < 0:
                return False
        elif isinstance(item, (list, dict)) and len(item) <= budget[0]:
            if isinstance(item, dict):
                if not all(isinstance(k, str) and _plain(k, budget) for k in item):
                    return False
                item = item.values()
            stack.extend((v, depth + 1) for v in item)
        else:
            return False
    return True


def receive_spec(
    request_id: str,
    leg: Leg,
    block_ids: Blocks,
    *,
    paired: bool = True,
    content: str = "",
) -> ReceiveSpec:
    """The load a decode request's leg describes, into ``block_ids``."""
    if isinstance(leg, Dispatched):
        ranks, stages, split_tp = leg.source_tp, leg.source_pp, leg.source_tp
    else:
        ranks, stages = leg.fingerprint.tp_size, leg.fingerprint.pp_size
        # Shares split for this instance's ranks or stages look like a prefill of its sizes.
        split_tp, stages = leg.split_tp, leg.split_pp
    return ReceiveSpec(
        request_id,
        leg.transfer_id,
        block_ids,
        leg.node,
        leg.address,
        ranks,
        paired=paired,
        source_stages=stages,
        split_tp=split_tp,
        content=content,
        answered=isinstance(leg, PrefillAnswer),
    )
