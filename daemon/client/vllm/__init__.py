"""KvpushdConnector: vLLM's KV cache moved by kvpushd (a vLLM V1 KV connector).

Loaded the out-of-tree way::

    --kv-transfer-config '{"kv_connector": "KvpushdConnector",
        "kv_connector_module_path": "daemon.client.vllm",
        "kv_role": "kv_producer" | "kv_consumer" | "kv_both",
        "kv_connector_extra_config": {"socket": "/run/kvpushd/NODE.sock",
                                      "node": "NODE", "address": "HOST:PORT"}}'

``socket`` is this node's daemon; ``node`` and ``address`` name that daemon
to a decode instance (they travel in ``kv_transfer_params``).

vLLM runs a connector twice: in the scheduler (decides) and in each worker
(talks to memory). Only the worker talks to the daemon: the daemon ties an
engine's requests to the connection that registered the engine, and the
worker is the one that owns the KV memory. The scheduler hands the worker
what to register through the per-step connector metadata; the worker reports
back through ``get_transfer_results`` (failed loads by request id). No call
on vLLM's step path waits for the daemon: requests go out on a background
thread, and events come back through a queue drained once per step.

- Prefill (``do_remote_decode``): when the request finishes, its blocks stay
  allocated (``delay_free``) and the worker registers a pusher request with
  the blocks that cover the prompt (never those of tokens generated after
  it) and says the KV is ready; ``blocks_freeable`` (or a failure)
  ends the send and the blocks go back to vLLM.
- Decode (``do_remote_prefill``): the prompt's tokens are external and load
  asynchronously; after allocation the worker registers a receiver with the
  blocks vLLM still has to fill (not those its own prefix cache already
  holds: the daemon's tail trim pairs them with the prefill's last blocks).
  ``kv_arrived`` ends the load; a failure ends it as a failed receive
  (``failed_recving``, the form vLLM takes for any number of KV cache
  groups), so vLLM's ``kv_load_failure_policy`` applies.
- Right blocks only: both sides name each block with its content hash
  (vLLM's own chained prefix-cache hash, daemon/client/vllm/hashes.py); the
  prefill daemon writes a decode block only from the prefill block of
  equal hash at the position the tail trim pairs, and refuses the transfer
  (``content_mismatch``, naming the first block) otherwise.
- Same model only: the engine registers with a fingerprint of what makes
  its KV interchangeable (daemon/client/vllm/layout.py), and the prefill's
  ``kv_transfer_params`` carry it; a decode instance whose fingerprint
  differs reports no external tokens (it computes the prompt) and sends an
  empty receiver, which the prefill daemon refuses as
  ``fingerprint_mismatch`` and so ends the push at once.
- Same prompt only: the params carry the prompt's length and digest; a
  decode request whose prompt differs computes it. One request per
  transfer: a second request with the same params (a retry) computes its
  prompt, and a second live prefill request with the same router
  ``transfer_id`` pushes nothing (the first push goes on). A prefill
  request that ended by abort pushes nothing.
- Shapes: TP ranks (each prefill rank's share is its own daemon request,
  statemachine/ranks.py), and one group per vLLM KV cache group
  (``SupportsHMA``: full attention and sliding window; a sliding-window
  group moves only its blocks inside the window, hashes.prompt_blocks).
  Equal TP sizes pair rank to rank; a prefill with k times the decode's ranks writes each decode
  rank's blocks from k prefill ranks, each into the head slice that holds
  its heads (a slice engine over the same memory), and the decode rank's
  load ends only when every one has landed (any failure fails the load
  once all are released). A decode with more ranks than the prefill
  computes the prompt. Pipeline stages pair the same way by their layers
  (``T@pp<s>`` shares, layer-slice engines). Each DP engine is an engine of
  its own; context parallel is refused when vLLM builds the connector
  (``check_supported``).
- Recurrent state (Mamba/SSM groups, TP 1, prefix caching off): the prefill
  computes the prompt but its last token (``new_request``) and pushes each
  Mamba layer's one state block beside the attention blocks; the decode
  loads N-1 tokens and applies the last one itself, so the state takes it
  once (docs/mamba-on-vllm-cpu.md).
- No daemon yet: vLLM starts anyway and serves without remote KV (its
  pushes and loads end at once) until the daemon is up, then registers.
- Memory: ``get_mem_pool_context`` makes vLLM's one KV buffer memory the
  daemon maps: a sealed memfd passed with the link's Hello (``kv_memory =
  "descriptor"``, the default; no file, nothing to sweep) or a named
  /dev/shm file (``kv_memory = "file"``); ``register_kv_caches`` derives
  the layout (blocks, layers, block bytes) from vLLM's tensors and
  registers the engine. The memory lives while vLLM runs (a restarted
  daemon maps it again: the memfd goes with every new Hello, the file
  keeps its name) and goes at shutdown; a file left by a vLLM killed with
  SIGKILL is removed by the next connector that starts on the machine in
  that mode (the owner holds a lock on it for its life,
  daemon/client/kvfile.py, so a live one is never removed).
- Daemon restarts: the worker notices the connection end at once and
  reconnects with backoff, registering the engine again. A lost connection
  is not an answer: what it held ends (sends: blocks back to vLLM; loads:
  load errors) only once its daemon is known gone (nobody listens on the
  socket, or another daemon process answers: its boot id differs). When the
  same daemon answers, it lived: it says again what became of each
  transfer, calls whose answers were lost are asked again, and no block
  goes back while a write can still touch it. Calls that register or say
  kv_ready wait as long as the connection lives (no time limit).

The parts, each owning one thing (what imports vLLM, only vLLM loads):

- ``connector``: the facade vLLM calls, nothing else.
- ``scheduler``: which requests push, which load, from where (vLLM's scheduler).
- ``worker``: each step's pushes and loads, on vLLM's thread.
- ``link``: the event loop thread, the connection to the daemon, reconnection.
- ``calls``: the daemon calls and what the loop thread remembers of them.
- ``sharedmemory``: the region shared with the daemon (a memfd, or a file).
- ``memory``: vLLM's KV memory made into that region, and its layout as groups of layers.
- ``shares``, ``loads``, ``params``, ``specs``: pure (no vLLM, no torch):
  which shares a TP/PP transfer is and on which slice each lies, a load's
  all-or-nothing end, the router parameters, what the sides hand each other.
- ``layout``, ``hashes``: vLLM's config and block hashes read without
  importing vLLM (hashes calls vLLM's own hash lazily).
- ``staging``: host staging (a host mirror of vLLM's cache); ``stats``:
  the connector's stats in vLLM's metrics.

``KvpushdConnector`` is imported on first use, so the pure parts import
without vLLM (they are unit-tested where vLLM is not installed).
"""

from __future__ import annotations

from typing import Any

__all__ = ["KvpushdConnector", "KvpushdConnectorMetadata"]


def __getattr__(name: str) -> Any:
    # vLLM loads the connector by this package's path and takes the class by name.
    if name in __all__:
        from daemon.client.vllm import connector

        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
