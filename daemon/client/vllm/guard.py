"""What no request may do to vLLM: raise inside its scheduler, or reach its pickling unparsed.

vLLM calls the connector's scheduler side from its own ``schedule()`` and
``update_from_output()``: an exception there ends its engine core, and every
request on the instance with it. And vLLM pickles a new request's sampling
params, the client's ``kv_transfer_params`` among them, into the step it
hands its workers: a dict nested a few hundred deep ends the engine core
too (``RecursionError``, vLLM's own: a plain vLLM dies the same way). So:

- ``bound``: as vLLM adds a request, its params become their typed and
  bounded form (daemon/client/vllm/params.py ``bound_params``), in place:
  the very dict vLLM pickles. A decode leg missing a field the connector
  reads computes its prompt; a field it does not read is kept only plain
  and small.
- ``Swallowed``: around each scheduler-side call the facade passes on. An
  exception is one log line (its type and message) and one count
  (``error``); the request computes locally (its params say so), and the
  facade answers vLLM as for a request that loads and pushes nothing.
"""

from __future__ import annotations

import logging
from types import TracebackType
from typing import TYPE_CHECKING, Any

from daemon.client.vllm import stats as vs
from daemon.client.vllm.params import LOCAL, bound_params

if TYPE_CHECKING:
    from daemon.client.vllm.scheduler import SchedulerSide

log = logging.getLogger(f"vllm.{__name__}")

# Characters of what was dropped, or of an exception's message, one log line shows.
_SHOWN = 1000


def bound(request: Any, side: SchedulerSide) -> None:
    """Put ``request``'s params, typed and bounded, in place of what the client sent."""
    sent = request.kv_transfer_params
    if sent is None:
        return
    kept, dropped, unread = bound_params(sent)
    loads = bool(kept.get("do_remote_prefill"))
    if unread and loads:
        kept["do_remote_prefill"] = False
    if isinstance(sent, dict):
        sent.clear()
        sent.update(kept)
    else:  # not a dict: vLLM's own copy, in its sampling params, goes too
        request.kv_transfer_params = kept
        extra = getattr(getattr(request, "sampling_params", None), "extra_args", None)
        if isinstance(extra, dict):
            extra["kv_transfer_params"] = kept
    if not dropped:
        return
    then = "computing the prompt here" if unread and loads else "going on without them"
    shown = "; ".join(dropped)[:_SHOWN]
    log.warning("kvpushd: %s: kv_transfer_params dropped %s: %s", request.request_id, shown, then)
    side.stats.not_loaded(vs.PARAMS if unread and loads else vs.DROPPED)


class Swallowed:
    """Keeps any exception of one scheduler-side call from vLLM; ``caught`` says whether it did.

    With a ``request``, it computes locally: its params say neither leg, and nothing more.
    """

    def __init__(self, side: SchedulerSide, call: str, request: Any = None) -> None:
        self._side = side
        self._call = call
        self._request = request
        self.caught = False

    def __enter__(self) -> Swallowed:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> bool:
        if not isinstance(exc, Exception):
            return False  # none, or one that stops the process (KeyboardInterrupt, SystemExit)
        self.caught = True
        request_id = getattr(self._request, "request_id", "-")
        try:
            message = str(exc)[:_SHOWN]
        except Exception:  # an exception whose message itself raises
            message = "?"
        log.error(
            "kvpushd: %s: %s raised %s: %s: the request computes locally",
            request_id,
            self._call,
            type(exc).__name__,
            message,
        )
        self._side.stats.not_loaded(vs.ERROR)
        params = getattr(self._request, "kv_transfer_params", None)
        if isinstance(params, dict):  # nothing of the client's is left to pickle either
            params.clear()
            params.update(LOCAL)
        return True
