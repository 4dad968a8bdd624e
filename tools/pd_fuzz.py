"""The differential P/D fuzzer on real vLLM (harness/pd_fuzz.py), from the command line.

For each shape: a single vLLM instance (the oracle) and a P/D pair through
kvpushd on the tiny seeded model, then ``--cases`` generated cases from
``--seed``. Every failure prints a line starting ``FUZZ FAIL`` with the
case's drawn fields and the command that reruns it, and then its shrunk
form (``SHRUNK``). ::

    .venv-vllm/bin/python tools/pd_fuzz.py --seed 1 --cases 200 --shapes tp1,small-kv
    .venv-vllm/bin/python tools/pd_fuzz.py --seed 1 --cases 200 --shapes tp1 --only 17

Shapes: tp1, small-kv (the decode's KV pool holds a few prompts: requests
queue and are preempted), staging (host mirrors on both sides), hybrid
(a sliding-window layer), tp2-1 (a prefill of 2 TP ranks). Exit status 0:
no finding; 1: at least one.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
from pathlib import Path

# After PYTHONPATH (a before/after run points it at another checkout's daemon).
sys.path.append(str(Path(__file__).resolve().parents[1]))

from harness.pd_cases import Model, draw_run, find_case
from harness.pd_fuzz import SHAPES, fuzz
from harness.tinyllama import TinyLlama, write_tinyllama
from harness.tinynemotron import write_tinynemotron
from harness.vllm_servers import VllmServer, start_servers, stop_servers


def _vocab(model: Path) -> int:
    return int(json.loads((model / "config.json").read_text())["vocab_size"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--cases", type=int, default=40, help="cases per shape")
    parser.add_argument("--shapes", default="tp1", help=f"comma-separated: {','.join(SHAPES)}")
    parser.add_argument(
        "--only", type=int, help="run this case alone (its batch's system fault kept)"
    )
    parser.add_argument("--only-batch", type=int, help="run this batch alone")
    parser.add_argument("--shrink-budget", type=int, default=12, help="reruns to shrink a failure")
    parser.add_argument("--workdir", type=Path, help="default: a new temp folder")
    parser.add_argument("--report", type=Path, help="append each shape's summary as a JSON line")
    parser.add_argument(
        "--hostile",
        action="store_true",
        help="a tampered prefill answer becomes a hostile leg (harness/hostile_params.py)",
    )
    args = parser.parse_args(argv)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="kvpushd-pd-fuzz-"))
    failed = False
    for name in args.shapes.split(","):
        shape = SHAPES[name]
        tiny = TinyLlama(sliding_layers=(0,), sliding_window=48) if shape.hybrid else TinyLlama()
        if shape.mamba:
            model = write_tinynemotron(workdir / f"model-{name}")
        else:
            model = write_tinyllama(workdir / f"model-{name}", tiny)
        cores = sorted(os.sched_getaffinity(0))
        oracle = VllmServer(
            "oracle", model, workdir / f"oracle-{name}", core=cores[0],
            extra_args=list(shape.server_args),
        )  # fmt: skip
        start_servers([oracle])
        try:
            batches = draw_run(
                args.seed,
                args.cases,
                Model(oracle.block_size, oracle.max_model_len, _vocab(model)),
            )
            if args.only is not None:
                batch, case = find_case(batches, args.only)
                batches = [dataclasses.replace(batch, cases=(case,))]
            elif args.only_batch is not None:
                batches = [batches[args.only_batch]]
            report = fuzz(
                model, workdir / name, shape, batches, oracle,
                seed=args.seed, total=args.cases, shrink_budget=args.shrink_budget,
                log=lambda line: print(line, flush=True), hostile=args.hostile,
            )  # fmt: skip
        finally:
            stop_servers([oracle])
        print(report.summary(), flush=True)
        if args.report:
            with args.report.open("a") as out:
                out.write(json.dumps(dataclasses.asdict(report)) + "\n")
        failed |= bool(report.findings)
    print(f"work folder: {workdir}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
