"""The project's small P/D router: a prompt to the prefill server, then to the decode server.

The contract, the same for KvpushdConnector and vLLM's NixlPushConnector:

1. the prefill server gets the prompt with ``max_tokens=1`` and
   ``kv_transfer_params={"do_remote_decode": true}``, plus the decode
   server's TP and PP sizes as ``kvpushd_decode_tp`` and
   ``kvpushd_decode_pp`` (KvpushdConnector splits its push for a decode
   with more TP ranks or stages only when told; other connectors ignore
   the keys);
2. its answer's ``kv_transfer_params`` go unchanged to the decode server with
   the same prompt and the real ``max_tokens``;
3. both requests carry the same ``X-Request-Id`` (NixlPushConnector pairs the
   two sides by it; KvpushdConnector ignores it and uses the transfer id it
   put in the parameters).

TTFT of a routed request is the prefill's whole answer plus the decode's
first streamed token, as a client behind this router sees it.

:func:`route_concurrent` is the other contract, vLLM's push-mode proxy's:
both legs at once under a transfer id the router makes (``xfer-<uuid>``);
the prefill leg as above plus ``transfer_id``, the decode leg with
``do_remote_prefill``, ``remote_engine_id`` / ``remote_host`` /
``remote_port`` (here: the prefill daemon's node and peer address), the
prefill's ``tp_size`` and ``pp_size``, ``remote_request_id`` and
``transfer_id``, and no block ids. The decode allocates while the prefill
computes; TTFT is the decode's first streamed token from the dispatch.
"""

from __future__ import annotations

import statistics
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from harness.vllm_servers import Completion, VllmServer, VllmServerError


@dataclass(frozen=True)
class Routed:
    token_ids: list[int]
    ttft_s: float
    elapsed_s: float
    params: dict[str, Any]
    # Of ttft_s, the prefill leg's part (sequential routing only; 0 otherwise).
    prefill_s: float = 0.0


def route(
    prefill: VllmServer,
    decode: VllmServer,
    prompt: Sequence[int],
    max_tokens: int,
    *,
    timeout_s: float = 120.0,
) -> Routed:
    """One request through the pair; the decode side's tokens and the TTFT."""
    request_id = f"pd-{uuid.uuid4().hex}"
    started = time.monotonic()
    first = _prefill(prefill, prompt, request_id, timeout_s, decode.tp, decode.pp)
    params = _params_of(prefill, first)
    second = decode.stream(
        prompt, max_tokens, request_id=request_id, kv_transfer_params=params, timeout_s=timeout_s
    )
    return Routed(
        second.token_ids,
        first.elapsed_s + second.first_token_s,
        time.monotonic() - started,
        params,
        prefill_s=first.elapsed_s,
    )


def route_concurrent(
    prefill: VllmServer,
    decode: VllmServer,
    prompt: Sequence[int],
    max_tokens: int,
    *,
    prefill_node: str,
    prefill_address: str,
    decode_prompt: Sequence[int] | None = None,
    timeout_s: float = 120.0,
) -> Routed:
    """One request with both legs sent at once (vLLM's push-mode proxy's contract).

    ``prefill_node`` and ``prefill_address`` (``host:port``) name the prefill
    daemon, as that proxy's ``--prefill-engine-id`` and ``--prefill-kv-host``
    / port name the prefill side. ``decode_prompt`` sends the decode leg
    another prompt (a router's bug, for tests). The decode leg cannot learn
    that the prefill split its push (a decode with more TP ranks or stages),
    so no split is asked for: such a pair computes on the decode side.
    """
    request_id = f"pd-{uuid.uuid4().hex}"
    transfer_id = f"xfer-{uuid.uuid4()}"
    host, _, port = prefill_address.rpartition(":")
    prefill_params = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
        "transfer_id": transfer_id,
    }
    decode_params = {
        "do_remote_decode": False,
        "do_remote_prefill": True,
        "remote_engine_id": prefill_node,
        "remote_host": host,
        "remote_port": int(port),
        "tp_size": prefill.tp,
        "pp_size": prefill.pp,
        "remote_request_id": request_id,
        "transfer_id": transfer_id,
    }
    started = time.monotonic()
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(
            prefill.complete,
            prompt,
            1,
            request_id=request_id,
            kv_transfer_params=prefill_params,
            timeout_s=timeout_s,
        )
        second = pool.submit(
            decode.stream,
            decode_prompt if decode_prompt is not None else prompt,
            max_tokens,
            request_id=request_id,
            kv_transfer_params=decode_params,
            timeout_s=timeout_s,
        )
        answer = second.result()
        first.result()
    return Routed(answer.token_ids, answer.first_token_s, time.monotonic() - started, decode_params)


def prefill_leg(
    prefill: VllmServer,
    prompt: Sequence[int],
    *,
    decode_tp: int | None = None,
    decode_pp: int | None = None,
    timeout_s: float = 120.0,
    max_tokens: int = 1,
    transfer_id: str | None = None,
    dp_rank: int | None = None,
) -> dict[str, Any]:
    """Step 1 alone: the ``kv_transfer_params`` the prefill server answers with.

    ``decode_tp``, ``decode_pp``: the decode's sizes to name (None: unsaid,
    as vLLM's own proxies send the prefill leg). ``max_tokens``: the
    prefill leg's (routers that do not follow the contract send more than
    1); ``transfer_id``: a router-made transfer id on the leg; ``dp_rank``:
    the prefill's data-parallel engine to send it to (None: vLLM's choice).
    """
    answer = _prefill(
        prefill, prompt, None, timeout_s, decode_tp, decode_pp, max_tokens, transfer_id, dp_rank
    )
    return _params_of(prefill, answer)


# vLLM's count of prompt tokens by where they came from.
PROMPT_TOKENS_BY_SOURCE = "vllm:prompt_tokens_by_source_total"


def external_tokens(decode: VllmServer) -> float:
    """Prompt tokens ``decode`` loaded from a connector so far."""
    return decode.metrics().total(PROMPT_TOKENS_BY_SOURCE, source="external_kv_transfer")


def loads_token_exact(
    prefill: VllmServer, decode: VllmServer, prompt: Sequence[int], tokens: int
) -> None:
    """A P/D request whose decode loads the prompt's KV and answers as a single instance."""
    single = prefill.complete(prompt, tokens).token_ids
    before = external_tokens(decode)
    sent = prefill_leg(prefill, prompt)
    assert decode.complete(prompt, tokens, kv_transfer_params=sent).token_ids == single
    assert external_tokens(decode) - before >= len(prompt) - 1


def _prefill(
    prefill: VllmServer,
    prompt: Sequence[int],
    request_id: str | None,
    timeout_s: float,
    decode_tp: int | None,
    decode_pp: int | None,
    max_tokens: int = 1,
    transfer_id: str | None = None,
    dp_rank: int | None = None,
) -> Completion:
    params: dict[str, Any] = {"do_remote_decode": True}
    for key, size in (("kvpushd_decode_tp", decode_tp), ("kvpushd_decode_pp", decode_pp)):
        if size is not None:
            params[key] = size
    if transfer_id is not None:
        params["transfer_id"] = transfer_id
    return prefill.complete(
        prompt,
        max_tokens,
        request_id=request_id,
        kv_transfer_params=params,
        timeout_s=timeout_s,
        dp_rank=dp_rank,
    )


def _params_of(prefill: VllmServer, answer: Completion) -> dict[str, Any]:
    params = answer.raw.get("kv_transfer_params")
    if not params:
        raise VllmServerError(f"{prefill.name} returned no kv_transfer_params")
    return dict(params)


def single(server: VllmServer, prompt: Sequence[int], max_tokens: int) -> Routed:
    """The same request to one server alone (the oracle, and the TTFT baseline)."""
    started = time.monotonic()
    answer = server.stream(prompt, max_tokens)
    return Routed(answer.token_ids, answer.first_token_s, time.monotonic() - started, {})


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) by linear interpolation; NaN for no values."""
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    return cuts[min(98, max(0, round(q * 100) - 1))]
