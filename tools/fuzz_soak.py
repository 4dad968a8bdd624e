"""Fuzz soak: the surfaces of harness/fuzzing.py at scale, with per-surface counts.

Runs every surface (engine RPC, peer link, journal decoder) against two real
daemons for ``--cases`` inputs in total (default 100,000), in chunks; between
chunks it checks that both daemons are up and peered, that their registries
are where they started (status and journal replay agree), that the real peer
link was never replaced and that no daemon logged an error. At the end a
SimEngine pair pushes real bytes through both daemons.

With ``--atheris-runs N`` (and atheris installed) it also runs two
coverage-guided targets in-process for N runs each: the journal reader and
replay on arbitrary segment bytes, and the RPC decode-and-reply path on
arbitrary frame bodies (every reply must decode for the client).

    .venv/bin/python tools/fuzz_soak.py --cases 100000 --seed 1 --atheris-runs 200000

Exit status 0: every case held the oracle; 1: a case broke it (the failing,
shrunk input is printed by Hypothesis).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

if TYPE_CHECKING:
    from harness import fuzzing as tf
else:
    # Imported by main(), not here: the atheris child must import the daemon's
    # modules itself, inside atheris.instrument_imports(), to get coverage.
    tf = None

# Share of the total cases per surface, and the average inputs one generated
# example carries (so a chunk's example count lands near its case budget).
SURFACES: dict[str, tuple[float, float]] = {
    "rpc_frames": (0.30, 3.5),
    "rpc_stream": (0.12, 1.0),
    "rpc_sequence": (0.18, 7.5),
    "peer_stream": (0.10, 1.0),
    "peer_frames": (0.10, 2.5),
    "journal_bytes": (0.10, 1.0),
    "journal_records": (0.10, 1.0),
}
CHUNK_EXAMPLES = 1000


@dataclass
class SurfaceRun:
    name: str
    cases: int = 0
    examples: int = 0
    seconds: float = 0.0


def _runner(
    name: str, target: tf.FuzzTarget, sandbox: tf.JournalSandbox
) -> tuple[Any, Callable[[Any], int]]:
    """(strategy, case function) of one surface."""
    journal_counts = target.counts
    table: dict[str, tuple[Any, Callable[[Any], int]]] = {
        "rpc_frames": (tf.rpc_batches, lambda c: tf.rpc_frames_case(target, c)),
        "rpc_stream": (tf.rpc_streams(), lambda c: tf.rpc_stream_case(target, c)),
        "rpc_sequence": (tf.sequence_ops, lambda c: tf.rpc_sequence_case(target, c)),
        "peer_stream": (tf.peer_streams, lambda c: tf.peer_stream_case(target, c)),
        "peer_frames": (tf.peer_batches, lambda c: tf.peer_frames_case(target, c)),
        "journal_bytes": (
            tf.byte_mutations(),
            lambda m: tf.journal_bytes_case(sandbox, journal_counts, m),
        ),
        "journal_records": (
            tf.record_mutations(),
            lambda m: tf.journal_records_case(sandbox, journal_counts, m),
        ),
    }
    return table[name]


def check_health(target: tf.FuzzTarget, identity: tuple[str, str]) -> None:
    """Between chunks: up, peered, registries at baseline, same link, no error logged."""
    target.alive()
    tf.wait_settled(target, lambda: "between chunks")
    if tf.both_views(target.prefill) != tf.target_baseline(target):
        raise tf.FuzzFailure("the prefill registry moved away from its baseline")
    tf.both_views(target.decode)
    if target.link_identity() != identity:
        raise tf.FuzzFailure("the real peer link was replaced")
    for daemon in (target.prefill, target.decode):
        errors = tf.error_log_lines(daemon)
        if errors:
            raise tf.FuzzFailure(f"{daemon.node} logged errors:\n" + "\n".join(errors[:5]))


def soak(total: int, seed: int, surfaces: list[str], workdir: Path) -> dict[str, SurfaceRun]:
    runs = {name: SurfaceRun(name) for name in surfaces}
    sandbox = tf.JournalSandbox(workdir / "journal-fuzz")
    (workdir / "daemons").mkdir(exist_ok=True)
    with tf.fuzz_pair(workdir / "daemons") as target:
        target.sequence_engine()
        tf.set_baseline(target)
        identity = target.link_identity()
        chunk_seed = seed
        for name in surfaces:
            share, per_example = SURFACES[name]
            budget = max(1, round(total * share / sum(SURFACES[s][0] for s in surfaces)))
            strategy, case = _runner(name, target, sandbox)
            run = runs[name]
            while run.cases < budget:
                examples = min(CHUNK_EXAMPLES, math.ceil((budget - run.cases) / per_example))
                started = time.perf_counter()
                run.cases += tf.run_cases(strategy, case, examples, seed=chunk_seed)
                run.seconds += time.perf_counter() - started
                run.examples += examples
                chunk_seed += 1
                check_health(target, identity)
                print(
                    f"  {name}: {run.cases}/{budget} cases, {run.seconds:.0f} s",
                    file=sys.stderr,
                    flush=True,
                )
            if name.startswith("rpc_frames"):
                target.reset_frames()  # a fresh long-lived connection per surface
        asyncio.run(tf.push_once(target, "soak"))
        check_health(target, identity)
        outcomes = {k: v for k, v in sorted(target.counts.items()) if ":" in k}
    print(json.dumps({"outcomes": outcomes}, indent=1), file=sys.stderr)
    return runs


# ---------------------------------------------------------------- atheris


ATHERIS_CHILD = "--atheris-child"


def atheris_child(argv: list[str]) -> None:
    """Runs under libFuzzer: ``tools/fuzz_soak.py --atheris-child TARGET [libFuzzer args]``."""
    import atheris

    target = argv[0]
    with atheris.instrument_imports(include=["daemon", "schemas", "statemachine"]):
        import msgspec

        from daemon.journal.format import JournalError
        from daemon.journal.replay import ReplayError, replay
        from daemon.node import engine_server
        from schemas import rpc
        from statemachine import registry  # noqa: F401 - instrumented for coverage

    scratch = Path(tempfile.mkdtemp(prefix="kvpushd-atheris-"))
    segment = scratch / "seg-00000000000000000001.kvj"
    client = msgspec.msgpack.Decoder(rpc.ServerMessage)
    server = msgspec.msgpack.Decoder(rpc.Request)

    def journal(data: bytes) -> None:
        segment.write_bytes(data)
        for salvage in (False, True):
            with contextlib.suppress(JournalError, ReplayError):
                replay(scratch, salvage=salvage)

    def rpc_decode(data: bytes) -> None:
        # The engine server's decode path; whatever it answers must decode.
        try:
            server.decode(data)
            return
        except msgspec.ValidationError as exc:
            reply = rpc.Error(engine_server._request_id(data), rpc.BAD_REQUEST, str(exc))
        except msgspec.DecodeError as exc:
            reply = rpc.Error(0, rpc.BAD_FRAME, str(exc))
        client.decode(msgspec.msgpack.encode(reply))

    atheris.Setup([sys.argv[0], *argv[1:]], {"journal": journal, "rpc_decode": rpc_decode}[target])
    atheris.Fuzz()


def run_atheris(target: str, runs: int, corpus: Path) -> dict[str, Any]:
    command = [
        sys.executable,
        __file__,
        ATHERIS_CHILD,
        target,
        f"-runs={runs}",
        "-max_len=16384",
        "-rss_limit_mb=4096",
        str(corpus),
    ]
    started = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
    seconds = time.perf_counter() - started
    done = re.search(r"Done (\d+) runs", result.stderr)
    cov = re.findall(r"cov: (\d+) ft: (\d+)", result.stderr)
    outcome = {
        "target": target,
        "exit": result.returncode,
        "runs": int(done.group(1)) if done else 0,
        "seconds": round(seconds, 1),
        "coverage_edges": int(cov[-1][0]) if cov else 0,
        "features": int(cov[-1][1]) if cov else 0,
    }
    if result.returncode != 0:
        print(result.stderr[-6000:], file=sys.stderr)
    return outcome


def seed_corpus(workdir: Path) -> dict[str, Path]:
    """Real segment files for the journal target; real request bodies for the RPC one."""
    import msgspec

    from schemas import rpc
    from schemas.layout import Role

    journal_dir = workdir / "atheris-journal"
    tf.build_base_journal(workdir / "atheris-base")
    journal_dir.mkdir()
    for k, path in enumerate(tf.journal_files_of(workdir / "atheris-base", ".kvj")):
        (journal_dir / f"seed-{k}").write_bytes(path.read_bytes())
    rpc_dir = workdir / "atheris-rpc"
    rpc_dir.mkdir()
    seeds = [
        rpc.Hello(1, "x"),
        rpc.Status(2),
        rpc.KvReady(3, "r"),
        rpc.RegisterRequest(4, "e", "r", Role.PUSHER, ((1, 2), (3,))),
    ]
    for k, message in enumerate(seeds):
        (rpc_dir / f"seed-{k}").write_bytes(msgspec.msgpack.encode(message))
    return {"journal": journal_dir, "rpc_decode": rpc_dir}


# -------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == [ATHERIS_CHILD]:
        atheris_child(argv[1:])
        return 0
    global tf
    from harness import fuzzing as tf

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=100_000, help="inputs in total")
    parser.add_argument("--seed", type=int, default=int(time.time()) % 100_000)
    parser.add_argument("--surfaces", default=",".join(SURFACES), help="comma-separated")
    parser.add_argument("--atheris-runs", type=int, default=0, help="per atheris target")
    parser.add_argument("--workdir", type=Path, help="kept afterwards (default: a temp dir)")
    args = parser.parse_args(argv)
    surfaces = [s for s in args.surfaces.split(",") if s]
    unknown = set(surfaces) - set(SURFACES)
    if unknown:
        parser.error(f"unknown surfaces {sorted(unknown)}; known: {sorted(SURFACES)}")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="kvpushd-soak-"))
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"fuzz soak: {args.cases} cases, seed {args.seed}, in {workdir}", file=sys.stderr)
    started = time.perf_counter()
    try:
        runs = soak(args.cases, args.seed, surfaces, workdir)
    except tf.FuzzFailure as exc:
        print(f"FAILED: {exc}", file=sys.stderr)
        return 1
    atheris_results = []
    if args.atheris_runs:
        try:
            import atheris  # noqa: F401
        except ImportError:
            print("atheris is not installed: skipping the coverage-guided targets", file=sys.stderr)
        else:
            for target, corpus in seed_corpus(workdir).items():
                atheris_results.append(run_atheris(target, args.atheris_runs, corpus))
    report(runs, atheris_results, time.perf_counter() - started, args)
    failed = any(r["exit"] != 0 for r in atheris_results)
    return 1 if failed else 0


def report(
    runs: dict[str, SurfaceRun],
    atheris_results: list[dict[str, Any]],
    seconds: float,
    args: argparse.Namespace,
) -> None:
    total = sum(r.cases for r in runs.values())
    machine = f"Python {platform.python_version()}, nproc {os.cpu_count()}"
    print(f"\nkvpushd fuzz soak: seed {args.seed}, {machine}")
    print(f"{'surface':<16} {'cases':>9} {'examples':>9} {'seconds':>8} {'cases/s':>8}")
    for run in runs.values():
        rate = run.cases / run.seconds if run.seconds else 0.0
        print(f"{run.name:<16} {run.cases:>9,} {run.examples:>9,} {run.seconds:>8.1f} {rate:>8.0f}")
    print(f"{'total':<16} {total:>9,} {'':>9} {seconds:>8.1f}")
    for result in atheris_results:
        print(
            f"atheris {result['target']}: {result['runs']:,} runs in {result['seconds']} s, "
            f"{result['coverage_edges']} edges, exit {result['exit']}"
        )
    counts = Counter({r.name: r.cases for r in runs.values()})
    print(json.dumps({"cases": dict(counts), "total": total, "atheris": atheris_results}))


if __name__ == "__main__":
    sys.exit(main())
