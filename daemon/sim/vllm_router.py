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
"""

from __future__ import annotations

import statistics
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from daemon.sim.vllm_servers import Completion, VllmServer, VllmServerError


@dataclass(frozen=True)
class Routed:
    token_ids: list[int]
    ttft_s: float
    elapsed_s: float
    params: dict[str, Any]


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
        second.token_ids, first.elapsed_s + second.first_token_s, time.monotonic() - started, params
    )


def prefill_leg(
    prefill: VllmServer,
    prompt: Sequence[int],
    *,
    decode_tp: int | None = None,
    decode_pp: int | None = None,
    timeout_s: float = 120.0,
) -> dict[str, Any]:
    """Step 1 alone: the ``kv_transfer_params`` the prefill server answers with.

    ``decode_tp``, ``decode_pp``: the decode's sizes to name (None: unsaid,
    as vLLM's own proxies send the prefill leg).
    """
    answer = _prefill(prefill, prompt, None, timeout_s, decode_tp, decode_pp)
    return _params_of(prefill, answer)


def _prefill(
    prefill: VllmServer,
    prompt: Sequence[int],
    request_id: str | None,
    timeout_s: float,
    decode_tp: int | None,
    decode_pp: int | None,
) -> Completion:
    params: dict[str, Any] = {"do_remote_decode": True}
    for key, size in (("kvpushd_decode_tp", decode_tp), ("kvpushd_decode_pp", decode_pp)):
        if size is not None:
            params[key] = size
    return prefill.complete(
        prompt, 1, request_id=request_id, kv_transfer_params=params, timeout_s=timeout_s
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
