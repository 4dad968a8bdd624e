"""The behavioural KV check's tolerance: the healthy spread, the drifted gap, and its cost.

    .venv-vllm/bin/python -m bench.kv_check_spread [--prompts 24] [--no-record]

For each KV dtype this CPU build serves (float32, bfloat16 weights and KV;
fp8 KV on float32 weights where the CPU has AVX-512 or AMX, which vLLM's
CPU fp8 cache requires: ``--dtypes``), one kvpushd pair on the tiny seeded llama answers
fresh prompts of several lengths, and the decode logs each check's relative
difference (its own K/V of the prompt's last token against the pushed one:
daemon/client/vllm/kvcheck.py). The healthy pair shares its weights; the
drifted pair's prefill holds other weights under the same ``model_id``, so
no fingerprint field tells them apart and only the check can. The table
gives the largest healthy difference, the smallest drifted one and the
tolerance the connector uses: the tolerance must sit far from both.

The cost: the check's own work per request (the copy of the checked blocks
when the load lands, the comparison after the forward), timed on tensors
shaped as the tiny llama's cache and as a 70B model's (80 layers, 8 KV
heads of 128, blocks of 16, bfloat16) on this CPU.
"""

from __future__ import annotations

import argparse
import re
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.results import load_average, machine, write_section
from bench.vllm_pd_bench import Prompts
from daemon.cli import main as kvpushd
from daemon.client.vllm.kvcheck import LoadChecks, Plan, Slot, tolerance_for
from harness.tinyllama import TinyLlama, write_tinyllama
from harness.vllm_router import route
from harness.vllm_servers import kvpushd_pd

_DIFFERENCE = re.compile(r"kv check: difference (\S+)")
# name -> (server flags, vLLM's dtype, kv cache dtype)
DTYPES = {
    "float32": ((), "float32", "auto"),
    "bfloat16": (("--dtype", "bfloat16"), "bfloat16", "auto"),
    "fp8 KV (float32 weights)": (("--kv-cache-dtype", "fp8"), "float32", "fp8"),
}


def differences(log: Path) -> list[float]:
    return [float(m.group(1)) for m in _DIFFERENCE.finditer(log.read_text(errors="replace"))]


def run_pair(
    work: Path, flags: tuple[str, ...], drifted: bool, prompts: list[list[int]]
) -> list[float]:
    model = write_tinyllama(work / "model")
    other = write_tinyllama(work / "other", TinyLlama(seed=1)) if drifted else None
    # One model id on both and no up-front identity (its weights digest would
    # refuse the drifted pair): what only the check can tell.
    same_id = {"model_id": "tiny-fine-tune", "identity": False}
    with kvpushd_pd(
        model,
        work / "pair",
        prefill_model=other,
        prefill_args=flags,
        decode_args=flags,
        prefill_extra_config=same_id,
        decode_extra_config=same_id,
        decode_server_env={"VLLM_LOGGING_LEVEL": "DEBUG"},
        kv_load_failure_policy="recompute",
    ) as (p, d, prefill, _):
        for prompt in prompts:
            route(p, d, prompt, 2)
            if drifted:  # each drifted request checked, not refused by the quarantine
                kvpushd(["quarantine", "clear", "--all", "--socket", prefill.socket])
        return differences(d.log)


def cost_us(
    layers: int, heads: int, block: int, head: int, dtype: torch.dtype
) -> tuple[float, float, int]:
    """(copy on landing, comparison after the forward) per request in µs, and the bytes kept.

    One torch thread: vLLM's CPU worker binds its OpenMP threads to its core.
    """
    torch.set_num_threads(1)
    cache = torch.randn(64, heads, block, 2 * head).to(dtype)
    views = tuple((i, f"layer{i}", cache) for i in range(layers))
    checks = LoadChecks((views,), tolerance=1.0)
    keep, compare = [], []
    for n in range(200):
        request = f"r{n}"
        checks.plan(request, Plan(5, (Slot(0, n % 64),), (0,), (), "prefill"))
        started = time.perf_counter()
        checks.landed({request}, set())
        keep.append(time.perf_counter() - started)
        cache[n % 64, 0, 5, 0] += 1e-3  # the decode's own token, a rounding away
        started = time.perf_counter()
        checks.after_forward([request])
        compare.append(time.perf_counter() - started)
    kept = layers * heads * block * 2 * head * cache.element_size()
    return statistics.median(keep) * 1e6, statistics.median(compare) * 1e6, kept


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--no-record", action="store_true")
    parser.add_argument(
        "--dtypes", default="float32,bfloat16", help="which of: " + ", ".join(DTYPES)
    )
    parser.add_argument("--keep", type=Path, help="keep the pairs' logs under this folder")
    args = parser.parse_args(argv)
    lengths = (33, 64, 100, 200)
    rows = []
    for name in args.dtypes.split(","):
        flags, model_dtype, kv_dtype = DTYPES[name]
        rng_prompts = [
            p for n in lengths for p in Prompts(n, seed=20261207 + n).take(args.prompts // 4)
        ]
        found = {}
        for drifted in (False, True):
            if args.keep is not None:
                work = args.keep / f"{name.split()[0]}-{'drifted' if drifted else 'healthy'}"
                found[drifted] = run_pair(work, flags, drifted, rng_prompts)
                continue
            with tempfile.TemporaryDirectory(prefix="kv-check-") as tmp:
                found[drifted] = run_pair(Path(tmp), flags, drifted, rng_prompts)
            print(name, "drifted" if drifted else "healthy", found[drifted], flush=True)
        healthy, drift = found[False], found[True]
        tolerance = tolerance_for(kv_dtype, model_dtype)
        rows.append(
            f"| {name} | {len(healthy)} | {max(healthy, default=float('nan')):.3g} | "
            f"{statistics.median(healthy) if healthy else float('nan'):.3g} | "
            f"{len(drift)} | {min(drift, default=float('nan')):.3g} | {tolerance:g} |"
        )
    costs = []
    for label, shape in (
        (
            "tiny llama (2 layers, 2 KV heads of 128, blocks of 32, fp32)",
            (2, 2, 32, 128, torch.float32),
        ),
        (
            "70B-like (80 layers, 8 KV heads of 128, blocks of 16, bf16)",
            (80, 8, 16, 128, torch.bfloat16),
        ),
    ):
        keep, compare, kept = cost_us(*shape)
        costs.append(f"| {label} | {kept / 1024:.0f} KiB | {keep:.0f} | {compare:.0f} |")
    body = (
        "Relative difference = max |decode - prefill| over the elements of the checked block "
        "that the decode's forward changed, over their largest magnitude "
        "(daemon/client/vllm/kvcheck.py). fp8 KV is not measured where vLLM's CPU build "
        "refuses it (no AVX-512 or AMX: `--dtypes` adds it elsewhere).\n\n"
        "| KV dtype | healthy checks | healthy max | healthy median | drifted checks | "
        "drifted min | tolerance |\n|---|---|---|---|---|---|---|\n"
        + "\n".join(rows)
        + "\n\nThe check's own cost per loaded request (median of 200, this CPU, one thread):\n\n"
        "| cache shape | kept per request | copy on landing µs | compare after forward µs |\n"
        "|---|---|---|---|\n" + "\n".join(costs)
    )
    print(body)
    if not args.no_record:
        write_section(
            "The behavioural KV check: healthy spread, drifted gap, cost (issue 47)",
            f"{machine()}; load {load_average()}; bench/kv_check_spread.py, "
            f"{args.prompts} prompts of {', '.join(map(str, lengths))} tokens per pair; "
            "drifted: the prefill on other weights under the same model_id.",
            body,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
