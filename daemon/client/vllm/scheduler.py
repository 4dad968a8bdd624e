"""The connector's scheduler side: which requests push, which load, and from where.

It decides and never talks to the daemon: each step's decisions go to the
worker side in the connector metadata (daemon/client/vllm/metadata.py).
A prefill request that finishes pushes exactly its prompt's blocks, each
named by its content hash (daemon/client/vllm/hashes.py), and answers its
router with what the decode needs (daemon/client/vllm/params.py). A
decode request loads only KV that is its own: same weights and layout
(the fingerprint), same prompt (its length and digest), one request per
transfer; otherwise it computes the prompt.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Final

import msgspec
from vllm.v1.request import RequestStatus

from daemon import failpoints
from daemon.client.vllm import stats as vs
from daemon.client.vllm.checkplan import CheckPlan
from daemon.client.vllm.hashes import (
    NotOneRun,
    block_hashes,
    ids_of,
    prompt_block_count,
    prompt_blocks,
    unhashed_prompt_blocks,
)
from daemon.client.vllm.hashes import content as block_content
from daemon.client.vllm.inputs import local_only, reads_no_prefix
from daemon.client.vllm.layout import (
    prompt_backoff,
    prompt_digest,
    rank_map_problem,
    split_pp,
    split_tp,
    window_gap,
)
from daemon.client.vllm.metadata import KvpushdConnectorMetadata
from daemon.client.vllm.params import (
    PARAMS_VERSION,
    Dispatched,
    Leg,
    PrefillAnswer,
    adopt_dispatch,
    read_leg,
    receive_spec,
    router_transfer_id,
)
from daemon.client.vllm.specs import PushSpec, remember
from schemas.fingerprint import Fingerprint
from statemachine.fingerprint import first_difference

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger(f"vllm.{__name__}")

# A decode request queued for blocks holds the prefill's push this often
# (kv_connector_extra_config.hold_every_s); the prefill daemon's registered
# deadline must be longer.
HOLD_EVERY_S: Final = 5.0
# What two instances' fingerprints may differ in and still pair: where each
# rank sits (the rank map pairs their heads, and each engine's own
# fingerprint names its heads for the daemon to check).
ACROSS_RANKS: Final = ("tp_size", "pp_size", "kv_head_range", "layer_range")
# The content of a pusher that pushes nothing, before why (statemachine/content.py
# takes any content that is not block hashes as a name both sides must share).
NOT_PUSHED: Final = "not pushed: "
# The content of a receiver that loads nothing (a forgone transfer), before
# why: the prefill daemon refuses the pairing (content_mismatch) naming it, so
# both journals say why nothing was written.
NOT_LOADED: Final = "not loaded: "
# How a prefill request must have ended for its KV to be pushed: its prompt
# was computed (it stopped, or hit its length). An abort pushes nothing.
_COMPUTED = frozenset({RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED})


class SchedulerSide:
    counts_inputs = False  # names multimodal inputs by counters (the connector sets it)

    def __init__(
        self,
        node: str,
        address: str,
        block_size: int,
        fingerprint: Fingerprint,
        windows: tuple[int, ...] = (0,),
        *,
        hold_every_s: float = HOLD_EVERY_S,
        states: tuple[bool, ...] = (),
    ) -> None:
        self._node = node
        self._windows = windows
        self._states = states or (False,) * len(windows)
        # Prompt tokens the decode computes itself (1 with recurrent state),
        # and the prefill requests whose prompt was cut by as many (bounded).
        # By request, not in kv_transfer_params: vLLM's parallel sampling
        # (n > 1) shallow-copies the parent's params, so an in-process engine
        # sees one params dict for every child.
        self._backoff = prompt_backoff(self._states)
        self._cut: dict[str, None] = {}
        self._hold_every_s = hold_every_s
        # Transfer id -> when its push was last held (time.monotonic()), for
        # the requests queued for blocks (bounded).
        self._held: dict[str, float] = {}
        self._address = address
        self._block_size = block_size
        self._fingerprint = fingerprint
        self._pending = KvpushdConnectorMetadata()
        # Live pushes: request id -> its transfer id, and back (one live
        # push per transfer id).
        self._pushing: dict[str, str] = {}
        self._push_owners: dict[str, str] = {}
        self._loading: set[str] = set()
        # Transfer ids a receiver was registered for, oldest first (bounded).
        self._received: dict[str, None] = {}
        # Transfer id -> the one request that may load it, and the leg it read
        # (bounded): a second request with the same params (a retry, a hedge)
        # computes its prompt.
        self._claims: dict[str, tuple[str, Leg]] = {}
        # Loads checked by the decode's own K/V of the prompt's last token.
        self._checks = CheckPlan(block_size, self._states)
        self.stats = vs.KvpushdStats()

    def new_request(self, request: Request) -> None:
        """A prefill request of a model with recurrent state computes its prompt but the last token.

        The decode applies that token to the state itself; a state that had
        taken it on the prefill too would take it twice (the first token
        differed on 8 of 8 prompts, docs/mamba-on-vllm-cpu.md). Cut once
        (vLLM calls this when a request is added, not when a preempted one
        resumes), never to no token, and not for a request that reads no
        prefix (prompt logprobs: the decode computes its whole prompt). The
        prefill's own answer is then one token, of the shorter prompt (as
        with vLLM's NixlConnector): routers answer from the decode.
        """
        params = request.kv_transfer_params
        if not self._backoff or not params or not params.get("do_remote_decode"):
            return
        prompt = request.prompt_token_ids
        if request.request_id in self._cut or prompt is None or len(prompt) <= self._backoff:
            return
        if reads_no_prefix(request):
            return
        del prompt[-self._backoff :]
        del request._all_token_ids[-self._backoff :]
        request.num_prompt_tokens -= self._backoff
        request.max_tokens = 1
        remember(self._cut, request.request_id, None)

    def matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params or {}
        if not params.get("do_remote_prefill"):
            return 0, False
        if not params.get("kvpushd_transfer_id") and "transfer_id" in params:
            unusable = adopt_dispatch(params)
            if unusable is not None:
                self._compute_here(request, params, (vs.PARAMS, unusable))
                return 0, False
        if not params.get("kvpushd_transfer_id"):
            return 0, False
        transfer_id = str(params["kvpushd_transfer_id"])
        owner, claimed = self._claims.get(transfer_id, (None, None))
        if owner == request.request_id and claimed is not None:
            # Checked when it claimed the transfer (vLLM asks again every step
            # the request waits for blocks; the prompt's digest is not free).
            # Still waiting: the prefill's push must wait too.
            self._hold(transfer_id, request, claimed)
            return self._external_tokens(request, num_computed_tokens)
        if owner is not None:
            # The transfer is the other request's: nothing of it is this one's to end.
            self._compute_here(
                request, params, (vs.DUPLICATE, f"transfer {transfer_id} is loaded by {owner}")
            )
            return 0, False
        leg = read_leg(params)
        if isinstance(leg, str):
            # Nothing names the prefill's daemon for sure: nobody is told, and
            # its push ends at its deadline.
            self._compute_here(request, params, (vs.PARAMS, leg))
            return 0, False
        why = self._why_not(request, leg)
        if why is not None:
            # Never KV from other weights, another layout or another prompt:
            # this instance computes the prompt. A receiver with no block still
            # goes out, so the prefill's daemon ends the push now instead of at
            # its deadline: its pairing check refuses it (a fingerprint
            # mismatch naming the field, or content_mismatch naming why), and
            # both journals say why nothing was written.
            self._compute_here(request, params, why)
            if self._first_time(transfer_id):
                paired = why[0] != vs.FINGERPRINT
                self._pending.forgo.append(
                    receive_spec(
                        request.request_id, leg, (), paired=paired, content=NOT_LOADED + why[1]
                    )
                )
            return 0, False
        remember(self._claims, transfer_id, (request.request_id, leg))
        return self._external_tokens(request, num_computed_tokens)

    def _hold(self, transfer_id: str, request: Request, leg: Leg) -> None:
        """Keep the prefill's push of a transfer waiting while this request queues for blocks.

        Sent at most every ``hold_every_s`` (each hold lengthens the push's
        wait by the prefill daemon's ``registered`` deadline, which must be
        longer), and bounded there by its ``[deadlines] held``.
        """
        now = time.monotonic()
        last = self._held.get(transfer_id)
        if last is not None and now - last < self._hold_every_s:
            return
        remember(self._held, transfer_id, now)
        self._pending.hold.append(receive_spec(request.request_id, leg, ()))

    def _external_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        count = self._loaded_len(request) - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def _loaded_len(self, request: Request) -> int:
        """The prompt tokens a decode loads: all, or all but those it computes (state)."""
        return max(len(request.prompt_token_ids or ()) - self._backoff, 0)

    def _compute_here(self, request: Request, params: dict[str, Any], why: tuple[str, str]) -> None:
        kind, message = why
        log.warning("kvpushd: %s: %s: computing the prompt here", request.request_id, message)
        self.stats.not_loaded(kind)
        params["do_remote_prefill"] = False

    def _why_not(self, request: Request, leg: Leg) -> tuple[str, str] | None:
        """Why the prefill's KV (as its ``leg`` describes it) is not this request's, or None.

        (What kind of reason, for the stats; what happened, for the log.)
        """
        # Prompt logprobs, counted multimodal inputs (inputs.py): the push ends now.
        if (local := local_only(request, self.counts_inputs)) is not None:
            return local
        gap = window_gap(len(request.prompt_token_ids or ()), self._block_size, self._windows)
        if gap is not None:
            return vs.WINDOW, (
                f"the prefill no longer holds the first token of the last prompt token's "
                f"{gap}-token sliding window (it starts a block vLLM freed)"
            )
        if request.prompt_token_ids is not None and self._loaded_len(request) == 0:
            return vs.PROMPT, (
                f"a prompt of {len(request.prompt_token_ids)} token(s) on a model with "
                f"recurrent state: the decode computes its last token itself, and no state "
                f"of the tokens before it exists"
            )
        if isinstance(leg, Dispatched):
            # Both legs at once: the prefill has not answered, so there is no
            # fingerprint or prompt digest to compare here. The daemon checks
            # both at the pairing (the engines' fingerprints, the content
            # each side registers); this side checks only that the ranks map.
            sent_shape = msgspec.structs.replace(
                self._fingerprint, tp_size=leg.source_tp, pp_size=leg.source_pp
            )
            unmappable = rank_map_problem(sent_shape, self._fingerprint)
            if unmappable is not None:
                return vs.FINGERPRINT, f"the two instances' ranks do not pair: {unmappable}"
            return None
        sent = leg.fingerprint
        difference = first_difference(sent, self._fingerprint, ignore=ACROSS_RANKS)
        if difference is not None:
            field_name, theirs, ours = difference
            return vs.FINGERPRINT, (
                f"the prefill's KV fingerprint differs in {field_name} (prefill {theirs!r}, "
                f"this instance {ours!r})"
            )
        unmappable = rank_map_problem(sent, self._fingerprint, leg.split_tp, leg.split_pp)
        if unmappable is not None:
            return vs.FINGERPRINT, f"the two instances' ranks do not pair: {unmappable}"
        prompt = request.prompt_token_ids
        if prompt is None:
            return vs.PROMPT, "the request has no prompt token ids to compare with the prefill's"
        # With recurrent state the prefill computed all but the last token.
        loaded = self._loaded_len(request)
        if leg.prompt_len != loaded:
            return vs.PROMPT, (
                f"the prefill computed a prompt of {leg.prompt_len} tokens, "
                f"this request loads {loaded} of its {len(prompt)}"
            )
        if leg.prompt_digest != prompt_digest(prompt[:loaded]):
            return vs.PROMPT, "the prefill computed another prompt of the same length"
        return None

    def after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        params = request.kv_transfer_params or {}
        if not params.get("do_remote_prefill") or num_external_tokens <= 0:
            return
        # Only once: the second call (after the load) must not register again.
        params["do_remote_prefill"] = False
        loaded = self._loaded_len(request)
        count = prompt_block_count(loaded, self._block_size)
        try:
            named = unhashed_prompt_blocks(blocks.blocks, count, self._states)
            hashes = block_hashes(request, self._block_size, count, loaded)
            content = block_content(named, hashes, self._states)
        except NotOneRun as exc:
            # Never reached with vLLM's allocator (hits and nulls are a
            # prefix); if it were, the daemon refuses the pairing, the load
            # fails and vLLM computes the prompt.
            log.error("kvpushd: %s: %s", request.request_id, exc)
            named = tuple((0, tuple(ids)) for ids in blocks.get_unhashed_block_ids_all_groups())
            content = f"unpaired: {exc}"
        # The leg this request read when it claimed the transfer, in this step
        # (vLLM allocates right after it asks how many tokens are external).
        _, leg = self._claims[str(params["kvpushd_transfer_id"])]
        self._first_time(leg.transfer_id)
        self._held.pop(leg.transfer_id, None)
        self._loading.add(request.request_id)
        spec = receive_spec(request.request_id, leg, ids_of(named), content=content)
        # With recurrent state the prefill never computed the last token: nothing to check.
        prompt_len = 0 if self._backoff else len(request.prompt_token_ids or ())
        self._pending.receive.append(self._checks.plan(spec, prompt_len, blocks.get_block_ids()))

    def finished(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        cut = request.request_id in self._cut
        self._cut.pop(request.request_id, None)
        self._pending.uncheck += self._checks.forget((request.request_id,))
        if request.request_id in self._loading:
            # Finished while loading (an abort): vLLM keeps its blocks until the
            # worker reports the load over, which it does once the daemon
            # released them; the daemon is told to give the transfer up.
            self._loading.discard(request.request_id)
            self._pending.abort.append(request.request_id)
            return False, None
        params = request.kv_transfer_params or {}
        if params.get("do_remote_prefill") and params.get("kvpushd_transfer_id"):
            # Finished before vLLM gave it blocks (aborted while waiting, or
            # the pre-aborted copy vLLM's API server submits when a client
            # goes away): a receiver with no block lets the prefill's daemon
            # end its push now (nothing is written) instead of at its deadline.
            # Once per transfer: the copy also comes for a request that loaded.
            params["do_remote_prefill"] = False
            leg = read_leg(params)
            # An unreadable leg names no prefill daemon to tell: its push ends
            # at its deadline.
            if not isinstance(leg, str) and self._first_time(leg.transfer_id):
                why = f"the decode request ended {request.status.name} before it had blocks"
                self._pending.forgo.append(
                    receive_spec(request.request_id, leg, (), content=NOT_LOADED + why)
                )
            return False, None
        if not params.get("do_remote_decode"):
            return False, None
        if not any(block_ids) or request.status not in _COMPUTED:
            # Aborted, or ended before its prompt was computed: nobody needs
            # its KV, and its blocks go back to vLLM now.
            self.stats.not_loaded(vs.NOT_NEEDED)
            self._not_pushing(request, params, f"the prefill request ended {request.status.name}")
            return False, None
        if request.prompt_token_ids is None:
            self._not_pushing(request, params, "the prompt has no token ids (prompt embeddings)")
            return False, None
        if self._backoff and not cut:
            # Its state took the whole prompt: a decode would apply the last
            # token twice. It computes the prompt instead.
            log.warning("kvpushd: %s: whole prompt computed: not pushed", request.request_id)
            self._not_pushing(
                request, params, "the prefill computed the whole prompt into its recurrent state"
            )
            return False, None
        # A router dispatching both legs at once names the transfer itself.
        transfer_id = router_transfer_id(params) or request.request_id
        owner = self._push_owners.get(transfer_id)
        if owner is not None:
            # One live push per transfer id: a router's retry, or a client's
            # own id used twice. This request pushes nothing (its blocks go
            # back now); the first push goes on untouched.
            log.warning(
                "kvpushd: %s: transfer %s is already pushed by %s: not pushed",
                request.request_id,
                transfer_id,
                owner,
            )
            self.stats.not_loaded(vs.DUPLICATE)
            return False, None
        digest = prompt_digest(request.prompt_token_ids)
        # Exactly the prompt's blocks, whatever was computed beyond it, each
        # named with its content hash (daemon/client/vllm_hashes.py).
        count = prompt_block_count(len(request.prompt_token_ids), self._block_size)
        try:
            named = prompt_blocks(block_ids, self._windows, count, self._states)
        except NotOneRun as exc:
            log.error("kvpushd: %s: %s: not pushed", request.request_id, exc)
            self._not_pushing(request, params, str(exc))
            return False, None
        if failpoints.corrupts("connector.shift_push"):
            # The negative control: the push names one block less at its end,
            # so the tail trim pairs every decode block with the block before
            # its own; the block hashes must refuse it before any write.
            named = tuple((first, ids[:-1]) for first, ids in named)
        content = block_content(named, block_hashes(request, self._block_size, count), self._states)
        # A decode with more TP ranks or stages, named by the router: each
        # rank pushes one share per decode rank (and stage) it feeds
        # (statemachine/ranks.py).
        by_tp, by_pp = self._splits(params)
        self._pending.push.append(
            PushSpec(
                request.request_id,
                transfer_id,
                ids_of(named),
                split_tp=by_tp,
                split_pp=by_pp,
                content=content,
            )
        )
        self._pushing[request.request_id] = transfer_id
        self._push_owners[transfer_id] = request.request_id
        answer = PrefillAnswer(
            PARAMS_VERSION,
            transfer_id,
            self._node,
            self._address,
            self._fingerprint,
            by_tp,
            by_pp,
            len(request.prompt_token_ids),
            digest,
        )
        return True, answer.to_params()

    def _splits(self, params: dict[str, Any]) -> tuple[int, int]:
        """The decode's TP and PP sizes this instance splits its push for (0: its own)."""
        tp, pp = params.get("kvpushd_decode_tp"), params.get("kvpushd_decode_pp")
        return split_tp(self._fingerprint, tp), split_pp(self._fingerprint, pp)

    def _not_pushing(self, request: Request, params: dict[str, Any], why: str) -> None:
        """Say at once that a transfer a router named will not be pushed.

        A decode leg sent at the same time may already wait for it: a pusher
        with no block, whose content says why, makes the prefill daemon
        refuse that receiver now (``content_mismatch``, naming why) instead
        of at its ``registered`` deadline. A transfer named by the prefill
        (prefill-first) has no decode waiting: nothing is said.
        """
        transfer_id = router_transfer_id(params)
        if transfer_id is None or transfer_id in self._push_owners:
            return
        by_tp, by_pp = self._splits(params)
        self._pending.unpushed.append(
            PushSpec(
                request.request_id,
                transfer_id,
                (),
                split_tp=by_tp,
                split_pp=by_pp,
                content=f"{NOT_PUSHED}{why}",
            )
        )

    def _first_time(self, transfer_id: str) -> bool:
        """Note a receiving transfer; False if it was noted before."""
        if transfer_id in self._received:
            return False
        remember(self._received, transfer_id, None)
        return True

    def take_metadata(self, scheduled: SchedulerOutput | None = None) -> KvpushdConnectorMetadata:
        """This step's decisions (``scheduled`` None: as they are, its checks not named)."""
        if scheduled is not None:
            new, pending = scheduled.scheduled_new_reqs, self._pending
            self._checks.scheduled(new, pending.check, pending.uncheck)
        metadata, self._pending = self._pending, KvpushdConnectorMetadata()
        return metadata

    def salvage(self) -> KvpushdConnectorMetadata:
        """This step's decisions as they are, when ``take_metadata`` raised."""
        metadata, self._pending = self._pending, KvpushdConnectorMetadata()
        return metadata

    def unload(self, request_id: str) -> None:
        """Fail a load vLLM waits for that ``after_alloc`` raised in: the workers say it failed."""
        self._loading.discard(request_id)
        self._pending.receive = [r for r in self._pending.receive if r.request_id != request_id]
        self._pending.unloaded.append(request_id)

    def sent(self, request_ids: Any, received: Any, failed: Any = ()) -> None:
        self._pending.uncheck += self._checks.forget(failed)
        for request_id in request_ids:
            transfer_id = self._pushing.pop(request_id, None)
            if transfer_id is not None and self._push_owners.get(transfer_id) == request_id:
                del self._push_owners[transfer_id]
        self._loading.difference_update(received)

    def pushing(self) -> bool:
        return bool(self._pushing)
