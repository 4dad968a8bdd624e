"""The router parameters protocol: what travels in a request's ``kv_transfer_params``.

A prefill instance answers a finished request with the fields a decode
instance needs to load its KV (``prefill_answer``); a router copies them
into the decode leg. A router may instead send both legs at once (vLLM's
push-mode proxy), naming the transfer and the prefill's daemon itself
(``adopt_dispatch`` turns that into the same fields). ``receive_spec``
reads them on the decode side. Pure: no vLLM, no torch, no I/O.
"""

from __future__ import annotations

from typing import Any, Final

from daemon.client.vllm.layout import Blocks, rank_count
from daemon.client.vllm.specs import ReceiveSpec

# A decode leg sent at once with the prefill's, as the connector took it
# (adopt_dispatch): the prefill's sizes the router named.
CONCURRENT: Final = "kvpushd_concurrent"
SOURCE_TP: Final = "kvpushd_source_tp"
SOURCE_PP: Final = "kvpushd_source_pp"
# In the prefill's answer: the TP and PP sizes its shares are named by.
TP_SPLIT: Final = "kvpushd_split_tp"
PP_SPLIT: Final = "kvpushd_split_pp"
MAX_TRANSFER_ID: Final = 200


def prefill_answer(
    transfer_id: str,
    node: str,
    address: str,
    fingerprint: Any,
    splits: tuple[int, int],
    prompt_len: int,
    digest: str,
) -> dict[str, Any]:
    """What a prefill request that pushes hands its router for the decode leg."""
    by_tp, by_pp = splits
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "kvpushd_transfer_id": transfer_id,
        "kvpushd_node": node,
        "kvpushd_address": address,
        "kvpushd_fingerprint": fingerprint,
        TP_SPLIT: by_tp,
        PP_SPLIT: by_pp,
        # Which prompt the KV is of: the decode side checks it is its own.
        "kvpushd_prompt_len": prompt_len,
        "kvpushd_prompt_digest": digest,
    }


def split_of(params: dict[str, Any], key: str) -> int | None:
    """The TP or PP size the prefill named its shares by (None: unsaid or unreadable, its own)."""
    return rank_count(params.get(key))


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
    ``remote_port``), and the prefill's TP and PP sizes; no block ids. In
    place, it becomes the kvpushd fields the rest reads. Returns why not,
    if the leg is not usable.
    """
    transfer_id = router_transfer_id(params)
    node, host, port = (params.get(k) for k in ("remote_engine_id", "remote_host", "remote_port"))
    if transfer_id is None:
        return f"the router's transfer_id {params.get('transfer_id')!r} is not usable"
    if not isinstance(node, str) or not node or not isinstance(host, str) or not host:
        return "the router named no prefill node (remote_engine_id) or address (remote_host)"
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        return f"the router named no usable prefill port (remote_port {port!r})"
    params.update(
        {
            "kvpushd_transfer_id": transfer_id,
            "kvpushd_node": node,
            "kvpushd_address": f"{host}:{port}",
            CONCURRENT: True,
            SOURCE_TP: rank_count(params.get("tp_size")) or 1,
            SOURCE_PP: rank_count(params.get("pp_size")) or 1,
        }
    )
    return None


def receive_spec(
    request_id: str,
    params: dict[str, Any],
    block_ids: Blocks,
    *,
    paired: bool = True,
    content: str = "",
) -> ReceiveSpec:
    """The load a decode request's params describe, into ``block_ids``."""
    sent = params.get("kvpushd_fingerprint")
    if params.get(CONCURRENT):
        ranks, stages = params[SOURCE_TP], params[SOURCE_PP]
    else:
        sizes = [sent.get(k, 1) if isinstance(sent, dict) else 1 for k in ("tp_size", "pp_size")]
        ranks, stages = (rank_count(n) or 1 for n in sizes)
    return ReceiveSpec(
        request_id,
        str(params["kvpushd_transfer_id"]),
        block_ids,
        str(params["kvpushd_node"]),
        str(params.get("kvpushd_address", "")),
        ranks,
        paired=paired,
        # Shares split for this instance's stages look like a prefill of its PP.
        source_stages=split_of(params, PP_SPLIT) or stages,
        split_tp=split_of(params, TP_SPLIT) or ranks,
        content=content,
    )
