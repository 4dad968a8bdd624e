"""No request's params can take vLLM's engine down: the connector's scheduler side, fuzzed.

Arbitrary JSON as ``kv_transfer_params`` (Hypothesis), on real
``vllm.v1.request.Request`` objects, through each scheduler-side call
vLLM's scheduler makes of a request, in its order: ``on_new_request``,
``get_num_new_matched_tokens``, ``update_state_after_alloc``,
``build_connector_meta``, ``update_connector_output``,
``request_finished``. Valid prefill answers of the request's own prompt
are mixed in with a field made hostile (a fingerprint TP size of 0 once
raised ``ZeroDivisionError`` inside vLLM's ``schedule()``; a dict nested
500 deep, ``RecursionError`` as vLLM pickled the step). For each: nothing
raises, a leg that does not read computes locally, and what is left in the
params vLLM pickles is small and shallow (pickled at the default recursion
limit). A connector error that would have reached vLLM is swallowed the
same way, and a load already promised ends failed through the workers.
"""

from __future__ import annotations

import logging
import pickle
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, example, given, reject, settings
from hypothesis import strategies as st
from vllm import SamplingParams
from vllm.exceptions import VLLMValidationError
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request, RequestStatus

from daemon.client.vllm import stats as vs
from daemon.client.vllm.connector import KvpushdConnector
from daemon.client.vllm.layout import prompt_digest
from daemon.client.vllm.metadata import KvpushdConnectorMetadata
from daemon.client.vllm.params import PARAMS_VERSION, PrefillAnswer, read_leg
from daemon.client.vllm.scheduler import ACROSS_RANKS, SchedulerSide
from harness.hostile_params import BAD_VALUES, DEEP, json_like, made
from schemas.fingerprint import Fingerprint
from statemachine.fingerprint import first_difference

BLOCK = 16
PROMPT = list(range(2, 42))  # 3 blocks, the last partial
OURS = Fingerprint(
    "/models/tiny", dtype="float32", block_size=BLOCK, num_layers=2, num_kv_heads=2,
    head_size=8, kv_layout="cpu:auto", engine="vllm 0.32.0", protocol=4,
)  # fmt: skip
ANSWER = PrefillAnswer(
    PARAMS_VERSION, "T", "p", "127.0.0.1:9", OURS, 1, 1, len(PROMPT), prompt_digest(PROMPT)
).to_params()
# The most a request's params may pickle to once the connector has them.
MOST_BYTES = 256 << 10


def _connector() -> KvpushdConnector:
    """The facade vLLM calls, on its scheduler side (vLLM's config left out: nothing reads it)."""
    connector = object.__new__(KvpushdConnector)
    connector._scheduler = SchedulerSide("d", "127.0.0.1:1", BLOCK, OURS)
    connector._worker = None
    return connector


def _hostile_answers() -> st.SearchStrategy[dict[str, Any]]:
    """The prompt's own answer with one field, or one of its fingerprint's, made hostile."""
    answer_key = st.sampled_from(sorted(ANSWER))
    print_key = st.sampled_from([*sorted(msgspec.structs.asdict(OURS)), "unknown"])
    value = st.one_of(st.sampled_from(BAD_VALUES), json_like(8))

    def top(key: str, bad: Any) -> dict[str, Any]:
        return {**ANSWER, key: bad}

    def inner(key: str, bad: Any) -> dict[str, Any]:
        return {**ANSWER, "kvpushd_fingerprint": {**ANSWER["kvpushd_fingerprint"], key: bad}}

    return st.one_of(st.builds(top, answer_key, value), st.builds(inner, print_key, value))


PARAMS = st.one_of(
    _hostile_answers(),
    st.dictionaries(st.sampled_from([*ANSWER, "transfer_id", "tp_size"]) | st.text(), json_like()),
    json_like(),
)


def _depth(value: object) -> int:
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, depth = stack.pop()
        deepest = max(deepest, depth)
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list | tuple):
            stack.extend((v, depth + 1) for v in item)
    return deepest


def _ours(params: dict[str, Any]) -> bool:
    """The params name this prompt's KV of this model: all a decode may load (the ranks aside)."""
    leg = read_leg(params)
    return (
        isinstance(leg, PrefillAnswer)
        and first_difference(leg.fingerprint, OURS, ignore=ACROSS_RANKS) is None
        and (leg.prompt_len, leg.prompt_digest) == (len(PROMPT), prompt_digest(PROMPT))
    )


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(PARAMS)
@example({**ANSWER, "kvpushd_fingerprint": {**ANSWER["kvpushd_fingerprint"], "tp_size": 0}})
@example({**ANSWER, "kvpushd_fingerprint": DEEP})
@example({**ANSWER, "remote_block_ids": DEEP})
@example(DEEP)
def test_no_params_raise_into_vllm_and_what_is_left_is_bounded(drawn: Any) -> None:
    params = made(drawn)
    connector = _connector()
    side = connector._scheduler
    assert side is not None
    try:
        sampling = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": params})
    except VLLMValidationError:  # vLLM's API refuses it (integers past 64 bits): never added
        reject()
    request = Request("r", list(PROMPT), sampling, None)
    connector.on_new_request(request)
    left = request.sampling_params.extra_args["kv_transfer_params"]
    assert left is request.kv_transfer_params  # the dict vLLM pickles is the one the connector read
    # What vLLM pickles with the step: shallow, small, at the default recursion limit.
    assert _depth(left) <= 8
    assert len(pickle.dumps(request.sampling_params)) < MOST_BYTES
    count, asynchronous = connector.get_num_new_matched_tokens(request, 0)
    # It loads only what reads, whole, as this prompt's KV of this model; anything else
    # (a field that did not read was dropped) computes locally.
    loads = count != 0
    assert (count, asynchronous) == ((len(PROMPT), True) if loads else (0, False))
    if loads:
        assert _ours(left) and side.stats.data[vs.NOT_LOADED].get(vs.PARAMS) is None
    elif isinstance(params, dict) and params.get("do_remote_prefill") is True and _ours(params):
        assert left != params  # it read as ours: only what the connector dropped makes it local
    blocks = KVCacheBlocks(([KVCacheBlock(i) for i in range(3 if count else 0)],))
    connector.update_state_after_alloc(request, blocks, count or 0)
    metadata = connector.build_connector_meta(None)  # type: ignore[arg-type]
    assert isinstance(metadata, KvpushdConnectorMetadata)
    assert len(metadata.receive) == (1 if loads else 0)
    pickle.dumps(metadata)
    connector.update_connector_output(KVConnectorOutput(finished_recving={"r"} if loads else None))
    request.status = RequestStatus.FINISHED_STOPPED
    delay, answer = connector.request_finished(request, [0, 1, 2])
    if answer is not None:  # a prefill leg pushes, and answers with what a decode reads back
        assert delay and isinstance(read_leg(answer), PrefillAnswer)
    pickle.dumps(request.sampling_params)


class Boom(RuntimeError):
    pass


@pytest.mark.parametrize(
    "call",
    ["new_request", "matched_tokens", "after_alloc", "take_metadata", "finished", "sent"],
)
def test_an_error_of_the_connector_is_one_log_line_a_count_and_a_local_request(
    call: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Each scheduler-side call that raises: vLLM gets what a request that loads nothing gets.

    A load vLLM was already promised (``update_state_after_alloc`` with
    external tokens) ends failed through the workers, so vLLM recomputes it
    instead of waiting for good.
    """
    connector = _connector()
    side = connector._scheduler
    assert side is not None

    def boom(*args: object, **kwargs: object) -> None:
        raise Boom("planted")

    monkeypatch.setattr(side, call, boom)
    sampling = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": dict(ANSWER)})
    request = Request("r", list(PROMPT), sampling, None)
    with caplog.at_level(logging.ERROR):
        connector.on_new_request(request)
        count, _ = connector.get_num_new_matched_tokens(request, 0)
        blocks = KVCacheBlocks(([KVCacheBlock(i) for i in range(3)],))
        connector.update_state_after_alloc(request, blocks, count or 0)
        metadata = connector.build_connector_meta(None)  # type: ignore[arg-type]
        connector.update_connector_output(KVConnectorOutput(finished_recving={"r"}))
        request.status = RequestStatus.FINISHED_STOPPED
        assert connector.request_finished(request, [0, 1, 2]) == (False, None)
    (line,) = [r for r in caplog.records if "raised Boom: planted" in r.getMessage()]
    assert "the request computes locally" in line.getMessage() and line.exc_info is None
    assert side.stats.data[vs.NOT_LOADED].get(vs.ERROR) == 1
    if call in ("new_request", "matched_tokens"):
        assert count == 0 and request.kv_transfer_params == {
            "do_remote_prefill": False,
            "do_remote_decode": False,
        }
    if call == "after_alloc":  # promised: failed through the workers, nothing registered
        assert count == len(PROMPT)
        assert isinstance(metadata, KvpushdConnectorMetadata)
        assert metadata.unloaded == ["r"] and metadata.receive == []
