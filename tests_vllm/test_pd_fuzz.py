"""The differential P/D fuzzer at CI scale: 40 generated cases against a single instance.

Every defect that reached a wrong token or a stuck request so far was one
small variation of what the other tests do: a router ordering, a request
field, a fault. Here :mod:`harness.pd_cases` draws the variations from a
fixed seed (every router fault, every fault of the system, both dispatch
modes, prompt lengths at block boundaries, decode prefix hits, prefill legs
of 1, 2 and 5 tokens with other sampling fields, up to 24 in flight) and
:mod:`harness.pd_fuzz` runs them through a real P/D pair (two daemons, two
vLLM servers with KvpushdConnector) and judges each against the session's
single vLLM instance: every answer equals its greedy tokens, remote KV
where the case allows nothing else, and after each batch no KV block, no
live request, sound journals and no journal anomaly the batch did not cause.

On the code before block hashes (2428dca) this run finds the prefill
``max_tokens`` > 1 corruption (wrong tokens) and the reused
``transfer_id`` leak (the prefill's blocks held for good).
``make fuzz-vllm`` runs more seeds, cases and shapes.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.pd_cases import Model, SystemFault, draw_run
from harness.pd_fuzz import SHAPES, fuzz
from harness.vllm_servers import VllmServer

# The seed `tests/test_pd_cases.py` proves covers every kind in 40 cases.
SEED, CASES = 4518, 40


def test_forty_generated_pd_cases_answer_as_a_single_instance_and_leave_nothing_behind(
    tiny_model: Path,
    vllm_pair: tuple[VllmServer, VllmServer],
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    oracle = vllm_pair[0]
    batches = draw_run(SEED, CASES, Model(oracle.block_size, oracle.max_model_len, 512))
    lines: list[str] = []
    report = fuzz(
        tiny_model,
        tmp_path_factory.mktemp("pd-fuzz"),
        SHAPES["tp1"],
        batches,
        oracle,
        seed=SEED,
        total=CASES,
        shrink_budget=0,  # a failure's line names its rerun; shrinking is the tool's
        log=lines.append,
    )
    assert report.findings == [], "\n".join(report.findings)
    assert report.cases == CASES and report.batches == len(batches)
    # The run ran what it drew: remote KV where it was required, faults where drawn.
    assert report.outcomes.get("remote", 0) >= 15, report.summary()
    killed = {b.system for b in batches} & {
        SystemFault.KILL_PREFILL_DAEMON,
        SystemFault.KILL_DECODE_DAEMON,
    }
    assert len(killed) == 2, report.summary()
