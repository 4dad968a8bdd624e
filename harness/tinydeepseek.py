"""A tiny DeepSeek-V2 checkpoint, written deterministically from a seed, for MLA tests.

MLA (multi-head latent attention) caches one latent row per token (the
normed ``kv_lora_rank`` latent and the ``qk_rope_head_dim`` rope key, 576
floats) shared by every head, instead of per-head K and V: the KV bytes a
connector moves, and the kernels that read them, differ from the llama
ones, so a P/D test that passes on :mod:`harness.tinyllama` says nothing
about an MLA model. vLLM's CPU build serves MLA only through its reference
backend (``cpu_mla``), which takes exactly the DeepSeek latent width
(512 + 64) and forces block size 16; the shape here is the smallest that
fits it. Every layer's MLP is dense (``first_k_dense_replace`` above the
layer count), yet the MoE keys stay in the config because vLLM's and
Hugging Face's DeepSeek code read them as integers.

As for the tiny llama, ``load_format="dummy"`` weights would ignore the
context, so the weights are seeded random draws with standard deviation
``gain/sqrt(fan_in)``: gain 2 for the queries (``q_proj``), the latent and
rope key (``kv_a_proj_with_mqa``) and the key half of each head's rows in
``kv_b_proj``, 3 for the value half and ``o_proj``, 1 elsewhere;
embeddings N(0, 1), norms 1. The latent is RMS-normed before ``kv_b_proj``,
so its gain matters only through the rope key. Measured on vLLM-CPU:
changing one token of a 64-token prompt changed the 8 greedy tokens that
follow in 10 of 12 cases (12 of 12 with the shipped rope, below).

Mind the oracle (docs/mla-on-vllm-cpu.md): on vLLM's CPU build the rotary op
mis-indexes MLA's 3-D query and rope-key views, so as shipped the tokens
depend on how a prompt is split into forward batches, and a P/D decode
(which computes the last prompt token alone) differs from a single instance
for a reason that is not the KV transfer. Serve with
``--compilation-config '{"custom_ops": ["all", "-rotary_embedding"]}'``
(vLLM's own pure-torch rope): then tokens equal a float64 reference,
whatever the split, and logprobs differ from one split to another by about
1e-6 only.

The folder holds what vLLM's DeepSeek loader reads and no tokenizer::

    config.json          DeepseekV2ForCausalLM, float32 (:class:`TinyDeepSeek`)
    model.safetensors    every weight under its Hugging Face name

Used by tests and probes: ``write_tinydeepseek(folder)``, or
``python -m harness.tinydeepseek FOLDER [--seed N]``. Two writes with the
same seed are byte-equal; only torch and the standard library are needed.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Final

import torch

from harness.tinyllama import CONFIG, WEIGHTS, digest, write_safetensors

# Standard deviation times sqrt(fan_in), by projection (see the docstring);
# kv_b_proj is split per head into its key and value rows.
# What a vLLM server of this checkpoint is started with. vLLM's own rope
# (above). And its reference CPU MLA backend, named: on a CPU with AMX tiles
# vLLM picks AMX_MLA instead, whose kernels take bf16 weights only and
# refuse this float32 checkpoint at load ("expect weight to be bfloat16,
# ..."; seen on a CI machine with amx_tile).
SERVER_ARGS: Final = (
    "--compilation-config",
    json.dumps({"custom_ops": ["all", "-rotary_embedding"]}),
    "--attention-backend",
    "CPU_MLA",
)
_GAINS: Final = {"q_proj": 2.0, "kv_a_proj_with_mqa": 2.0, "o_proj": 3.0}
_KEY_GAIN: Final = 2.0
_VALUE_GAIN: Final = 3.0


@dataclass(frozen=True)
class TinyDeepSeek:
    """The model's shape: the defaults are what vLLM's CPU MLA backend accepts."""

    hidden_size: int = 256
    num_attention_heads: int = 4
    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64
    qk_nope_head_dim: int = 64
    v_head_dim: int = 64
    num_hidden_layers: int = 2
    intermediate_size: int = 512
    vocab_size: int = 512
    max_position_embeddings: int = 2048
    seed: int = 0

    def config(self) -> dict[str, Any]:
        """The ``config.json`` document (Hugging Face's deepseek_v2 keys)."""
        return {
            "architectures": ["DeepseekV2ForCausalLM"],
            "model_type": "deepseek_v2",
            "hidden_size": self.hidden_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_attention_heads,
            "q_lora_rank": None,
            "kv_lora_rank": self.kv_lora_rank,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "v_head_dim": self.v_head_dim,
            "head_dim": self.qk_rope_head_dim,
            "num_hidden_layers": self.num_hidden_layers,
            "intermediate_size": self.intermediate_size,
            "vocab_size": self.vocab_size,
            "max_position_embeddings": self.max_position_embeddings,
            # Dense MLPs only: no layer index reaches first_k_dense_replace,
            # but the MoE keys must still be integers.
            "first_k_dense_replace": self.num_hidden_layers + 1,
            "moe_layer_freq": 1,
            "n_routed_experts": 4,
            "n_shared_experts": 1,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 128,
            "n_group": 1,
            "topk_group": 1,
            "topk_method": "greedy",
            "norm_topk_prob": False,
            "routed_scaling_factor": 1.0,
            "scoring_func": "softmax",
            "hidden_act": "silu",
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
            "rope_scaling": None,
            "attention_bias": False,
            "tie_word_embeddings": False,
            # Token ids only: tests send ignore_eos, so 0 and 1 are inert.
            "bos_token_id": 0,
            "eos_token_id": 1,
            "torch_dtype": "float32",
            "kvpushd_tinydeepseek": asdict(self),
        }

    def shapes(self) -> Iterator[tuple[str, tuple[int, ...]]]:
        """Every weight's name and shape, in the order they are drawn from the generator."""
        hidden, inter, heads = self.hidden_size, self.intermediate_size, self.num_attention_heads
        qk_head = self.qk_nope_head_dim + self.qk_rope_head_dim
        yield "model.embed_tokens.weight", (self.vocab_size, hidden)
        for i in range(self.num_hidden_layers):
            layer = f"model.layers.{i}"
            yield f"{layer}.input_layernorm.weight", (hidden,)
            yield f"{layer}.self_attn.q_proj.weight", (heads * qk_head, hidden)
            yield (
                f"{layer}.self_attn.kv_a_proj_with_mqa.weight",
                (self.kv_lora_rank + self.qk_rope_head_dim, hidden),
            )
            yield f"{layer}.self_attn.kv_a_layernorm.weight", (self.kv_lora_rank,)
            yield (
                f"{layer}.self_attn.kv_b_proj.weight",
                (heads * (self.qk_nope_head_dim + self.v_head_dim), self.kv_lora_rank),
            )
            yield f"{layer}.self_attn.o_proj.weight", (hidden, heads * self.v_head_dim)
            yield f"{layer}.post_attention_layernorm.weight", (hidden,)
            yield f"{layer}.mlp.gate_proj.weight", (inter, hidden)
            yield f"{layer}.mlp.up_proj.weight", (inter, hidden)
            yield f"{layer}.mlp.down_proj.weight", (hidden, inter)
        yield "model.norm.weight", (hidden,)
        yield "lm_head.weight", (self.vocab_size, hidden)

    def _gains(self, name: str, rows: int) -> torch.Tensor | float:
        """A linear weight's gain: per row for kv_b_proj (key rows, then value rows, per head)."""
        projection = name.split(".")[-2]
        if projection != "kv_b_proj":
            return _GAINS.get(projection, 1.0)
        per_head = torch.cat(
            [
                torch.full((self.qk_nope_head_dim,), _KEY_GAIN),
                torch.full((self.v_head_dim,), _VALUE_GAIN),
            ]
        )
        return per_head.repeat(rows // per_head.numel()).unsqueeze(1)

    def weights(self) -> dict[str, torch.Tensor]:
        """The seeded float32 weights: norms 1, embeddings N(0, 1), linear std gain/sqrt(fan_in)."""
        gen = torch.Generator().manual_seed(self.seed)
        out = {}
        for name, shape in self.shapes():
            if name.endswith("norm.weight"):
                out[name] = torch.ones(shape, dtype=torch.float32)
                continue
            draw = torch.randn(shape, generator=gen, dtype=torch.float32)
            if name == "model.embed_tokens.weight":
                out[name] = draw
                continue
            out[name] = (draw * (self._gains(name, shape[0]) / math.sqrt(shape[1]))).contiguous()
        return out


def write_tinydeepseek(folder: Path, model: TinyDeepSeek | None = None) -> Path:
    """Write the checkpoint of ``model`` (default: :class:`TinyDeepSeek`, seed 0) into ``folder``.

    Creates the folder if needed, overwrites the two files, returns the folder
    (what vLLM's ``--model`` takes). Byte-equal for equal ``model``.
    """
    model = model or TinyDeepSeek()
    folder.mkdir(parents=True, exist_ok=True)
    config = json.dumps(model.config(), indent=2, sort_keys=True) + "\n"
    (folder / CONFIG).write_text(config)
    write_safetensors(folder / WEIGHTS, model.weights())
    return folder


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="write the tiny seeded DeepSeek-V2 checkpoint")
    parser.add_argument("folder", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    folder = write_tinydeepseek(args.folder, TinyDeepSeek(seed=args.seed))
    print(f"{folder} {digest(folder)}")


if __name__ == "__main__":
    main()
