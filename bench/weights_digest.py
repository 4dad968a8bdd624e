"""What the weights digest costs at start-up (daemon/client/vllm/weights.py), extrapolated to 70B.

The digest samples SAMPLES elements of every parameter, so its cost is per
tensor, not per byte of the model: measured on the tiny llama the real-vLLM
tests serve, and on tensors of a 70B model's size (bfloat16, 8192 wide),
then scaled by a 70B Llama's tensor count as vLLM holds it (80 layers of
fused qkv, o, fused gate_up, down and two norms, plus embeddings, final
norm and lm_head: 483 per TP rank, whatever the TP size).

    python -m bench.weights_digest [--write]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.results import load_average, machine, write_section
from daemon.client.vllm.weights import SAMPLES, weights_digest
from harness.tinyllama import TinyLlama

LLAMA_70B_TENSORS = 80 * 6 + 3
ROUNDS = 7


def _time(named: list[tuple[str, torch.Tensor]]) -> float:
    runs = []
    for _ in range(ROUNDS):
        started = time.perf_counter()
        weights_digest(named)
        runs.append(time.perf_counter() - started)
    return statistics.median(runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--write", action="store_true", help="write bench/RESULTS.md's section")
    args = parser.parse_args()
    tiny = list(TinyLlama().weights().items())
    tiny_s = _time(tiny)
    # Tensors of a 70B model's width (bfloat16), fresh memory each: 64 MiB apiece.
    big = [(f"t{i}", torch.randn(4096, 8192).to(torch.bfloat16)) for i in range(16)]
    per_tensor = _time(big) / len(big)
    per_tensor_tiny = tiny_s / len(tiny)
    sample_bytes = SAMPLES * 2
    rows = [
        "| model | tensors | digest (median of 7) | per tensor | bytes read |",
        "|---|---|---|---|---|",
        f"| tiny llama (float32, the tests' model) | {len(tiny)} | {tiny_s * 1e3:.1f} ms | "
        f"{per_tensor_tiny * 1e6:.0f} us | {len(tiny) * SAMPLES * 4 / 1024:.0f} KiB |",
        f"| 16 tensors of 4096 x 8192 bf16 (1 GiB) | 16 | {per_tensor * 16 * 1e3:.1f} ms | "
        f"{per_tensor * 1e6:.0f} us | {16 * sample_bytes / 1024:.0f} KiB |",
        f"| Llama 70B, one TP rank (extrapolated) | {LLAMA_70B_TENSORS} | "
        f"{per_tensor * LLAMA_70B_TENSORS * 1e3:.0f} ms | {per_tensor * 1e6:.0f} us | "
        f"{LLAMA_70B_TENSORS * sample_bytes / 1024:.0f} KiB |",
    ]
    body = "\n".join(rows)
    print(body)
    if args.write:
        write_section(
            "Weights digest at start-up (issue 47 item 2)",
            f"{machine()}; load {load_average()}. `python -m bench.weights_digest --write`. "
            f"weights.py samples {SAMPLES} elements of every parameter, so the cost is per "
            "tensor, not per byte: a 70B rank reads about 1 MB of its weights whatever "
            "their size. CPU tensors here; on a GPU each device's samples come back in "
            "one copy.",
            body,
        )


if __name__ == "__main__":
    main()
