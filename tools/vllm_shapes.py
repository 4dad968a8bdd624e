"""One prefill/decode shape on real vLLM through kvpushd, token for token.

The real-vLLM test suite (tests_vllm/) runs the shapes that fit its time
budget: TP 1 and 2, PP 1 and 2, the hybrid model at TP 1. Instances with
four ranks take about two minutes to start on a 2-core machine (every vLLM
worker busy-polls), so the larger shapes are proven with this driver::

    .venv-vllm/bin/python tools/vllm_shapes.py --prefill-tp 4 --decode-tp 2
    .venv-vllm/bin/python tools/vllm_shapes.py --prefill-tp 2 --prefill-pp 2
    .venv-vllm/bin/python tools/vllm_shapes.py --prefill-tp 2 --hybrid
    .venv-vllm/bin/python tools/vllm_shapes.py --prefill-dp 2 --decode-dp 1
    .venv-vllm/bin/python tools/vllm_shapes.py --prefill-tp 2 --decode-tp 2 --mla

Two daemons and two vLLM servers (kvpushd_pd), the tiny seeded llama (with
``--hybrid``: its layer 0 a 48-token sliding window; ``--mla``: the tiny
DeepSeek-V2 instead, block 16, vLLM's pure-torch rope as
tests_vllm/test_pd_mla.py runs it). For each prompt
length, the decode instance's greedy tokens must equal the prefill
instance's own answer without transfer parameters, and the decode's
external-KV counter must move by the prompt (it loaded, not computed). A
decode with more ranks or stages than the prefill is named on the prefill
leg, as the project's router does. With data-parallel engines every
(prefill engine, decode engine) pair is tried for each prompt, each leg
sent to its engine with vLLM's ``X-data-parallel-rank`` header. Prints one
line per prompt and engine pair, and the
engines each daemon saw; exit status 1 if any prompt's tokens differ or
were not loaded.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from daemon.sim.launcher import wait_idle
from harness.tinydeepseek import SERVER_ARGS, write_tinydeepseek
from harness.tinyllama import TinyLlama, write_tinyllama
from harness.vllm_router import prefill_leg
from harness.vllm_servers import kvpushd_pd

EXTERNAL = "vllm:prompt_tokens_by_source_total"
TOKENS = 8


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for side in ("prefill", "decode"):
        parser.add_argument(f"--{side}-tp", type=int, default=1)
        parser.add_argument(f"--{side}-pp", type=int, default=1)
        parser.add_argument(f"--{side}-dp", type=int, default=1)
    parser.add_argument("--hybrid", action="store_true", help="a 48-token sliding-window layer")
    parser.add_argument("--mla", action="store_true", help="the tiny DeepSeek-V2 (MLA)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[40, 150, 300])
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="kvpushd-shapes-"))
    shape = TinyLlama(sliding_layers=(0,), sliding_window=48) if args.hybrid else TinyLlama()
    model = (
        write_tinydeepseek(work / "model") if args.mla else write_tinyllama(work / "model", shape)
    )
    # vLLM's CPU MLA backend takes blocks of 16 and mis-rotates with its own rope op.
    rope = SERVER_ARGS
    mla = (
        {
            "prefill_block_size": 16,
            "decode_block_size": 16,
            "prefill_args": rope,
            "decode_args": rope,
        }
        if args.mla
        else {}
    )
    started = time.monotonic()
    wrong = 0
    with kvpushd_pd(
        model,
        work / "pd",
        prefill_tp=args.prefill_tp,
        decode_tp=args.decode_tp,
        prefill_pp=args.prefill_pp,
        decode_pp=args.decode_pp,
        prefill_dp=args.prefill_dp,
        decode_dp=args.decode_dp,
        **mla,
    ) as (p, d, prefill, decode):
        print(f"servers up after {time.monotonic() - started:.0f} s", flush=True)
        named = {
            "decode_tp": args.decode_tp if args.decode_tp > args.prefill_tp else None,
            "decode_pp": args.decode_pp if args.decode_pp > args.prefill_pp else None,
        }
        rng = random.Random(args.seed)
        engines = [
            (pr, dr) if args.prefill_dp * args.decode_dp > 1 else (None, None)
            for pr in range(args.prefill_dp)
            for dr in range(args.decode_dp)
        ]
        tried = 0
        for length in args.lengths:
            for pr, dr in engines:
                # A fresh prompt per engine pair: the decode engine must load it, not hit it.
                prompt = [rng.randrange(2, 512) for _ in range(length)]
                single = p.complete(prompt, TOKENS, timeout_s=300, dp_rank=pr).token_ids
                before = d.metrics().total(EXTERNAL, source="external_kv_transfer")
                sent = prefill_leg(p, prompt, timeout_s=300, dp_rank=pr, **named)
                got = d.complete(
                    prompt, TOKENS, kv_transfer_params=sent, timeout_s=300, dp_rank=dr
                ).token_ids
                loaded = d.metrics().total(EXTERNAL, source="external_kv_transfer") - before
                ok = got == single and loaded >= length - 1
                wrong += not ok
                tried += 1
                where = "" if pr is None else f" prefill engine {pr} -> decode engine {dr}:"
                print(
                    f"{length:5d} tokens:{where} equal={got == single} loaded={loaded:.0f}",
                    flush=True,
                )
        wait_idle(prefill, decode, timeout=30)
        print("prefill engines:", " ".join(sorted(prefill.status()["engines"])))
        print("decode engines: ", " ".join(sorted(decode.status()["engines"])))
    print("OK" if not wrong else f"{wrong} of {tried} prompts wrong or not loaded")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
