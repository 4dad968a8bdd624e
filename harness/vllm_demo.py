"""``make demo-vllm``: a real vLLM prefill and decode pair exchanging KV through kvpushd.

What it does, in order (each step prints what it did):

1. writes a tiny llama with a fixed random checkpoint (no download);
2. starts two kvpushd daemons (no ``[[peers]]``: the decode daemon dials the
   prefill's on demand) and two vLLM OpenAI servers with KvpushdConnector,
   each pinned to its own core;
3. routes a batch of prompts (shared prefixes, mixed lengths) through the
   pair with the project's router, a progress bar meanwhile;
4. asks the prefill server the same prompts alone (the single instance) and
   compares the decode side's tokens with them, token for token;
5. prints the TTFT table (single instance and P/D) and what the daemons did
   (requests, blocks and bytes moved, refusals, where the journals are).

It exits 0 when every P/D answer equals the single instance's, 1 otherwise.
Runs in .venv-vllm (the Makefile builds it on first use).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, TextIO

from harness.tinyllama import write_tinyllama
from harness.vllm_router import Routed, percentile, route, single
from harness.vllm_servers import EXTERNAL_TOKENS, kvpushd_pd

BAR_WIDTH = 32


def progress(done: int, total: int, out: TextIO = sys.stderr) -> None:
    """One line, redrawn in place: how far the batch is."""
    filled = BAR_WIDTH * done // max(total, 1)
    bar = "#" * filled + "." * (BAR_WIDTH - filled)
    out.write(f"\r  [{bar}] {done}/{total} requests")
    if done == total:
        out.write("\n")
    out.flush()


def prompts(count: int, seed: int) -> list[list[int]]:
    """Prompts of 33-260 tokens; a third share a 64-token prefix, a third a 96-token one."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(2, 512) for _ in range(n)] for n in (0, 64, 96)]
    return [
        [*prefixes[i % 3], *(rng.randrange(2, 512) for _ in range(rng.randrange(33, 165)))]
        for i in range(count)
    ]


def _ms(values: list[float]) -> str:
    ms = [1000 * v for v in values]
    return f"{statistics.median(ms):8.1f} {percentile(ms, 0.99):8.1f}"


def run(args: argparse.Namespace, work: Path) -> int:
    say = print
    started = time.monotonic()
    model = write_tinyllama(work / "model")
    say(f"model: tiny llama, fixed random weights, in {model}")
    say("starting 2 kvpushd daemons and 2 vLLM servers (one core each; ~30-120 s) ...")
    batch = prompts(args.requests, args.seed)
    with kvpushd_pd(model, work / "pd") as (p, d, prefill, decode):
        say(f"  up after {time.monotonic() - started:.0f} s: prefill {p.url}, decode {d.url}")
        say(f"routing {len(batch)} prompts: prefill (1 token) -> decode ({args.tokens} tokens)")
        external_before = d.metrics().total(EXTERNAL_TOKENS, source="external_kv_transfer")
        routed: list[Routed] = []
        progress(0, len(batch))
        for prompt in batch:
            routed.append(route(p, d, prompt, args.tokens))
            progress(len(routed), len(batch))
        external = d.metrics().total(EXTERNAL_TOKENS, source="external_kv_transfer")
        say("asking the prefill server alone (the single instance) for the same prompts ...")
        singles = [single(p, prompt, args.tokens) for prompt in batch]
        fresh = [single(p, prompt, args.tokens) for prompt in prompts(args.requests, args.seed + 1)]
        wrong = [i for i, (a, b) in enumerate(zip(routed, singles, strict=True))
                 if a.token_ids != b.token_ids]  # fmt: skip
        counters = [_daemon_figures(x.status()) for x in (prefill, decode)]
        journals = (prefill.journal, decode.journal)
    say("")
    say("token comparison (decode side through kvpushd vs single instance)")
    say(f"  {len(batch) - len(wrong)} / {len(batch)} token-exact")
    for i in wrong[:5]:
        say(f"  prompt {i}: P/D {routed[i].token_ids} != single {singles[i].token_ids}")
    if not wrong:
        say(f"  e.g. prompt 0 ({len(batch[0])} tokens) -> {routed[0].token_ids} on both")
    loaded = external - external_before
    say(f"  prompt tokens the decode server loaded instead of computing: {loaded:.0f}")
    say("")
    say("TTFT, ms (P/D: prefill answer + decode's first streamed token)")
    say(f"  {'setup':32} {'p50':>8} {'p99':>8}")
    say(f"  {'single instance (fresh prompts)':32} {_ms([r.ttft_s for r in fresh])}")
    say(f"  {'P/D through kvpushd':32} {_ms([r.ttft_s for r in routed])}")
    say("")
    say("what the daemons did")
    for node, figures, journal in zip(("prefill", "decode"), counters, journals, strict=True):
        say(f"  {node:8} {figures}; journal {journal}")
    if args.keep is not None:
        say(f"postmortem: .venv-vllm/bin/kvpushd journal replay {journals[0]} {journals[1]}")
    else:
        say("(the journals go with the work folder: --keep DIR keeps them for a postmortem)")
    return 1 if wrong else 0


def _daemon_figures(status: dict[str, Any]) -> str:
    plane = status.get("dataplane", {})
    counters = status.get("counters", {})
    return (
        f"{plane.get('writes', 0)} writes, {plane.get('bytes_written', 0) / 2**20:.1f} MiB, "
        f"{counters.get('refusals', 0)} refusals, {status.get('live', 0)} live"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="demo-vllm", description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=24, help="prompts routed (default 24)")
    parser.add_argument("--tokens", type=int, default=8, help="tokens decoded per prompt")
    parser.add_argument("--seed", type=int, default=1, help="prompt seed")
    parser.add_argument("--keep", type=Path, help="work folder to keep (journals, logs)")
    args = parser.parse_args(argv)
    if args.keep is not None:
        args.keep.mkdir(parents=True, exist_ok=True)
        return run(args, args.keep)
    with tempfile.TemporaryDirectory(prefix="kvpushd-vllm-demo-") as tmp:
        return run(args, Path(tmp))


if __name__ == "__main__":
    raise SystemExit(main())
