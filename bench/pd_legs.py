"""Where a real vLLM P/D request's TTFT goes: the prefill leg, the decode leg, the daemons.

    .venv-vllm/bin/python -m bench.pd_legs [--prompts 24] [--no-record]

One kvpushd pair (bench/vllm_pd_bench.py's setup: tiny seeded llama,
prefill on the first core, decode on the last) answers fresh prompts one
after another, routed as harness/vllm_router.py routes them, and each
request's TTFT is split into:

- the prefill leg: the prefill server's whole answer (one token, the KV
  computed and its push registered);
- the decode leg: from the decode request to its first streamed token (the
  decode's scheduling, the wait for the KV, the KV's load, one forward);
- P/D: their sum, the TTFT the bench compares.

The single instance (the prefill server asked alone, streamed) is the
baseline the issue compares against. Medians and p90 in ms.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.results import write_section
from bench.vllm_pd_bench import Prompts
from harness.tinyllama import write_tinyllama
from harness.vllm_router import percentile, route, single
from harness.vllm_servers import VllmServer, kvpushd_pd


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--prompt-len", type=int, default=200)
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args(argv)
    prompts = Prompts(args.prompt_len, seed=20261204)
    legs: dict[str, list[float]] = {"single": [], "prefill leg": [], "decode leg": [], "P/D": []}
    with tempfile.TemporaryDirectory(prefix="pd-legs-") as tmp, contextlib.ExitStack() as stack:
        work = Path(tmp)
        model = write_tinyllama(work / "model")
        p, d, _, _ = stack.enter_context(kvpushd_pd(model, work / "pair"))
        for prompt in prompts.take(2):  # warm-up: the first requests compile and allocate
            _legs(p, d, prompt)
        for prompt in prompts.take(args.prompts):
            prefill_s, decode_s = _legs(p, d, prompt)
            legs["prefill leg"].append(prefill_s)
            legs["decode leg"].append(decode_s)
            legs["P/D"].append(prefill_s + decode_s)
        for prompt in prompts.take(args.prompts):
            legs["single"].append(single(p, prompt, 8).ttft_s)
    rows = ["| part | p50 ms | p90 ms |", "|---|---|---|"]
    for name, values in legs.items():
        ms = [v * 1000 for v in values]
        rows.append(f"| {name} | {statistics.median(ms):.1f} | {percentile(ms, 0.9):.1f} |")
    table = "\n".join(rows)
    print(table)
    if not args.no_record:
        command = "`.venv-vllm/bin/python -m bench.pd_legs`"
        write_section(
            "Real vLLM P/D: where the TTFT goes (bench/pd_legs.py)",
            f"{time.strftime('%Y-%m-%d')}, {command}: {args.prompts} fresh prompts of "
            f"{args.prompt_len} tokens, sequential, through one kvpushd pair; the single "
            "instance is the prefill server asked alone.",
            table,
        )
    return 0


def _legs(p: VllmServer, d: VllmServer, prompt: list[int]) -> tuple[float, float]:
    """One routed request: the prefill leg's and the decode leg's seconds to first token."""
    routed = route(p, d, prompt, 8)
    return routed.prefill_s, routed.ttft_s - routed.prefill_s


if __name__ == "__main__":
    sys.exit(main())
