"""Hostile ``kv_transfer_params``: what a client may send a decode to take its engine down.

Each shape once killed (or could kill) a decode's engine core, or held its
request: a fingerprint with a TP size of 0 (``ZeroDivisionError`` in the
rank map, inside vLLM's ``schedule()``), a dict nested 500 deep
(``RecursionError`` as vLLM pickles the step for its workers), megabyte
strings, wrong types, negative and huge sizes, addresses nobody listens on,
a transfer the prefill never had. Shared by tests_vllm/ (the real decode
and the connector's scheduler side) and ``json_like``, Hypothesis's
arbitrary JSON for the property tests.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hypothesis import strategies as st

DEPTH = 500  # deeper than any pickle of vLLM's step survives at the default recursion limit
MEGABYTE = "x" * (1 << 20)


def deep(levels: int = DEPTH) -> dict[str, Any]:
    """A dict nested ``levels`` deep (built without recursion)."""
    top: dict[str, Any] = {}
    here = top
    for _ in range(levels):
        here["d"] = {}
        here = here["d"]
    return top


class Huge:
    """A value too large to print (Hypothesis prints what it drew): ``made`` makes it."""

    def __init__(self, name: str, make: Callable[[], Any]) -> None:
        self.name = name
        self.make = make

    def __repr__(self) -> str:
        return self.name


DEEP = Huge("deep()", deep)
LONG = Huge("MEGABYTE", lambda: MEGABYTE)


def made(value: Any) -> Any:
    """``value`` with each ``Huge`` in it made (a drawn value is shallow: recursion is fine)."""
    if isinstance(value, Huge):
        return value.make()
    if isinstance(value, dict):
        return {k: made(v) for k, v in value.items()}
    if isinstance(value, list):
        return [made(v) for v in value]
    return value


# Values no field of a fingerprint or a leg should take (``made`` makes the huge ones).
BAD_VALUES: tuple[Any, ...] = (0, -1, -(2**70), 2**70, 10**9, "2", None, True, 1.5, [], DEEP, LONG)


def _fingerprint(field: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def change(params: dict[str, Any]) -> None:
        params["kvpushd_fingerprint"] = {**params["kvpushd_fingerprint"], field: value}

    return change


def _set(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def change(params: dict[str, Any]) -> None:
        params[key] = value

    return change


def hostile_legs(
    own_node: str, own_address: str, closed_address: str
) -> list[tuple[str, Callable[[dict[str, Any]], None]]]:
    """Named changes to a real prefill answer that make it a hostile decode leg.

    ``own_node``/``own_address``: the decode's own daemon (a leg naming
    itself); ``closed_address``: a port nobody listens on.
    """
    changes: list[tuple[str, Callable[[dict[str, Any]], None]]] = []
    for field in ("tp_size", "pp_size", "num_kv_heads", "num_layers", "block_size", "head_size"):
        for value in (0, -1, 10**9, "2"):  # 0 and -1 read for the last four: they differ
            changes.append((f"fingerprint {field}={value!r}", _fingerprint(field, value)))
    changes += [
        ("fingerprint kv_head_range=(-1, 2)", _fingerprint("kv_head_range", [-1, 2])),
        ("fingerprint nested 500 deep", _fingerprint("model", deep())),
        ("fingerprint with an unknown field nested 500 deep", _fingerprint("extra", deep())),
        ("fingerprint model of a megabyte", _fingerprint("model", MEGABYTE)),
        ("fingerprint a list", _set("kvpushd_fingerprint", [1, 2])),
        ("a vLLM field nested 500 deep", _set("remote_block_ids", deep())),
        ("an unknown field nested 500 deep", _set("anything", deep())),
        ("an unknown field of a megabyte", _set("anything", MEGABYTE)),
        ("split_tp=0", _set("kvpushd_split_tp", 0)),
        ("split_pp=10**9", _set("kvpushd_split_pp", 10**9)),
        ("prompt_len=-1", _set("kvpushd_prompt_len", -1)),
        ("prompt_len=2**70", _set("kvpushd_prompt_len", 2**70)),
        ("prompt_digest of a megabyte", _set("kvpushd_prompt_digest", MEGABYTE)),
        ("transfer_id of a megabyte", _set("kvpushd_transfer_id", MEGABYTE)),
        ("transfer_id a number", _set("kvpushd_transfer_id", 7)),
        ("node of a megabyte", _set("kvpushd_node", MEGABYTE)),
        ("address closed", _set("kvpushd_address", closed_address)),
        ("address foreign", _set("kvpushd_address", "203.0.113.9:7")),
        ("address not an address", _set("kvpushd_address", "::::")),
        ("its own node", lambda p: p.update(kvpushd_node=own_node, kvpushd_address=own_address)),
        # The caller names a transfer its prefill never had on every leg: alone, that.
        ("a transfer its prefill never had", lambda p: None),
        ("version a dict", _set("kvpushd_version", {"v": 1})),
        ("do_remote_prefill a string", _set("do_remote_prefill", "yes")),
        (
            "a push-mode leg of TP 0",
            lambda p: p.update(transfer_id="tx", remote_engine_id="e", remote_host="h", tp_size=0),
        ),
    ]
    return changes


def json_like(max_leaves: int = 30) -> st.SearchStrategy[Any]:
    """Arbitrary JSON values, with the hostile ones above mixed in at any place (``made``)."""
    leaves = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(min_value=-(2**80), max_value=2**80),
        st.floats(allow_nan=False),
        st.text(max_size=8),
        st.sampled_from(BAD_VALUES),
    )
    return st.recursive(
        leaves,
        lambda inner: st.one_of(
            st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
        ),
        max_leaves=max_leaves,
    )
