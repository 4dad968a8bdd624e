"""TTFT of a multi-turn workload on real vLLM with the node's offload tier, and without it.

    .venv-vllm/bin/python -m bench.tier_ttft [--talks 6] [--turns 6] [--no-record]

One daemon with a pool; two servers of the tiny seeded llama, each alone on
its core and each with an engine KV cache of 40 blocks (too small for the
conversations): T on the tier (KvpushdOffloadingConnector), N plain. The
conversations go round robin, each turn extending the last (its answer and
48 new tokens), so a turn's prefix has usually left the engine's own cache
by the time it comes back. Every request goes to T and then to N (one at a
time: the two never compete for a core), streamed; TTFT is dispatch to the
first token. Each answer of T is compared with N's (token-exact).

Cost per block: vLLM's own offloading metrics on T (bytes and seconds of
its store and load jobs: our worker's copies and digests), divided by the
chunks moved.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

from bench.results import load_average, machine, write_section
from daemon.sim.launcher import Daemon, free_port
from harness.tinyllama import write_tinyllama
from harness.vllm_router import percentile, single
from harness.vllm_servers import Metrics, VllmServer, kvpushd_tier_config, running

BLOCK_BYTES = 64 * 1024  # one 32-token block of the tiny llama, both layers
KV_CACHE_BYTES = 40 * BLOCK_BYTES
TOKENS = 8


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--talks", type=int, default=6)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--first-len", type=int, default=200)
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args(argv)
    rng = random.Random(20261207)
    ttft: dict[str, list[float]] = {"tier": [], "plain": []}
    by_turn: dict[str, dict[int, list[float]]] = {"tier": {}, "plain": {}}
    mismatches = 0
    with tempfile.TemporaryDirectory(prefix="tier-ttft-") as tmp:
        work = Path(tmp)
        model = write_tinyllama(work / "model")
        pool = f"[offload]\nslots = 1024\nslot_bytes = {BLOCK_BYTES}"
        daemon = Daemon("tier", work, free_port(), extra=pool).start()
        cores = sorted(os.sched_getaffinity(0))
        tier = VllmServer(
            "T", model, work, core=cores[0], kv_cache_bytes=KV_CACHE_BYTES,
            extra_args=["--kv-transfer-config", kvpushd_tier_config(daemon)],
        )  # fmt: skip
        plain = VllmServer("N", model, work, core=cores[-1], kv_cache_bytes=KV_CACHE_BYTES)
        try:
            with running(tier, plain):
                talks = [
                    [rng.randrange(2, 512) for _ in range(args.first_len)]
                    for _ in range(args.talks)
                ]
                for turn in range(args.turns):
                    for talk in talks:
                        got = {}
                        for name, server in (("tier", tier), ("plain", plain)):
                            routed = single(server, talk, TOKENS)
                            got[name] = routed.token_ids
                            ttft[name].append(routed.ttft_s)
                            by_turn[name].setdefault(turn, []).append(routed.ttft_s)
                        mismatches += got["tier"] != got["plain"]
                        talk += got["plain"] + [rng.randrange(2, 512) for _ in range(48)]
                costs = _costs(tier.metrics())
        finally:
            daemon.stop()
    rows = ["| | TTFT p50 ms | TTFT p99 ms | first turn p50 ms | later turns p50 ms |"]
    rows.append("|---|---|---|---|---|")
    for name in ("plain", "tier"):
        ms = [v * 1000 for v in ttft[name]]
        first = [v * 1000 for v in by_turn[name].get(0, [])]
        later = [v * 1000 for t, vs in by_turn[name].items() if t for v in vs]
        rows.append(
            f"| {name} | {statistics.median(ms):.1f} | {percentile(ms, 0.99):.1f} | "
            f"{statistics.median(first):.1f} | {statistics.median(later):.1f} |"
        )
    table = "\n".join(rows) + "\n\n" + costs + f"\n\nAnswers that differed: {mismatches}."
    print(table)
    if not args.no_record:
        write_section(
            "Offload tier on real vLLM: multi-turn TTFT (bench/tier_ttft.py)",
            f"{time.strftime('%Y-%m-%d')}, {machine()}, load {load_average()}: "
            f"`.venv-vllm/bin/python -m bench.tier_ttft`: {args.talks} conversations x "
            f"{args.turns} turns, round robin, first prompt {args.first_len} tokens, each turn "
            f"+{TOKENS} answer +48 new; each engine's KV cache 40 blocks of 32 tokens; "
            "every request to the tier server, then to the plain one.",
            table,
        )
    return 0


def _costs(metrics: Metrics) -> str:
    """Per block moved, from vLLM's offloading metrics: its store and load jobs' seconds.

    vLLM labels each job by ``transfer_type`` (its direction: to the tier or from it).
    """
    seconds: dict[str, float] = {}
    moved: dict[str, float] = {}
    for (name, labels), value in metrics.samples.items():
        if "offload" not in name or name.endswith(("_bucket", "_count", "_created")):
            continue
        kind = dict(labels).get("transfer_type")
        if kind is None:
            continue
        if "bytes" in name:
            moved[kind] = moved.get(kind, 0.0) + value
        elif "time" in name or "seconds" in name:
            seconds[kind] = seconds.get(kind, 0.0) + value
    lines = []
    for kind in sorted(moved):
        blocks = moved[kind] / BLOCK_BYTES
        if blocks and seconds.get(kind):
            lines.append(
                f"{kind}: {blocks:.0f} blocks, {seconds[kind] / blocks * 1e6:.0f} µs per block "
                f"({moved[kind] / seconds[kind] / 1e9:.2f} GB/s)"
            )
    return "Cost per block (vLLM's offload job metrics, T): " + ("; ".join(lines) or "none")


if __name__ == "__main__":
    raise SystemExit(main())
