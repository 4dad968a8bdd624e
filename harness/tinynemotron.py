"""A tiny Nemotron-H (Mamba2 hybrid) checkpoint, written deterministically from a seed.

The hybrid sibling of :mod:`harness.tinyllama`: four layers after the
pattern ``"M*M-"`` (Mamba2 mixer, attention, Mamba2 mixer, MLP), hidden 256,
attention head_dim 64 (vLLM's CPU attention needs >= 32). vLLM gives such a
model two KV cache groups of ``MambaSpec`` (one per Mamba layer, each its
own group) and one ``FullAttentionSpec``: the model that tests moving a
hybrid model's SSM state beside its attention KV.

Nemotron-H's attention has no positional embedding: the order of the tokens
reaches the model through the Mamba layers only, and a Mamba layer carries
the whole prefix in its fixed-size state (conv state: the last
``conv_kernel - 1`` inputs; SSM state: ``[heads, head_dim, state]``). The
weights are seeded random, scaled so the outputs depend on the context and
the SSM state carries it over hundreds of tokens:

- linear weights ``N(0, (gain/sqrt(fan_in))^2)``, gain 2 for the queries and
  keys, 3 for the values and attention output, 2 for the Mamba output
  projection and for the ``dt`` rows of its input projection (the last
  ``mamba_num_heads`` rows: a token's step size varies about e^2-fold, so
  some tokens write the state far more than others), 1 elsewhere;
  embeddings N(0, 0.3^2) (the current token's embedding in the residual
  stream no longer drowns what the layers bring from the context); norms 1;
- Mamba ``A_log = log(A)``, A spread geometrically over [0.005, 0.5] by
  head, and ``dt_bias`` the inverse softplus of a dt spread over [0.001,
  0.1], large dt with small A: every head decays slowly (``exp(-A dt)`` per
  token, about 0.9995), so an early token's trace outlives a 200-token
  prompt; ``D`` 0 (a Mamba layer's output is read from its state only, no
  skip of the current token); conv1d weights ``N(0, 1/kernel)``, bias 0.

Measured with Hugging Face's reference Nemotron-H (harness/mamba_probe.py
``hf``, 40 random 200-token prompts, one token of the first 20 changed): the
8 greedy tokens that follow change in 40 of 40 (the first token in 21), and
in 40 of 40 with the attention layer's output projection zeroed, where only
the SSM state carries the early token (with D 1, embeddings N(0, 1) and one
dt gain: 1 of 10). vLLM's CPU build serves it deterministically, with HF's
greedy tokens, and a state one token off changes every output token
(docs/mamba-on-vllm-cpu.md).

The folder holds what vLLM's Nemotron-H loader reads, and no tokenizer
(serve it with ``skip_tokenizer_init``, ``--no-enable-prefix-caching`` on the
CPU build, prompts as token ids)::

    config.json          NemotronHForCausalLM, float32 (:class:`TinyNemotron` gives the shape)
    model.safetensors    every weight under Hugging Face's name (transformers 5 spelling)

Names and shapes are those of ``transformers``' ``NemotronHForCausalLM``
(``model.embeddings``, ``model.layers.N.mixer.*``, ``model.norm_f``); vLLM
maps ``embeddings`` to ``embed_tokens`` and ``A_log`` to ``A``. Only torch and
the standard library: ``write_tinynemotron(folder)``, or
``python -m harness.tinynemotron FOLDER [--seed N]``.
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

# Standard deviation times sqrt(fan_in), by projection (see the docstring).
_GAINS: Final = {"q_proj": 2.0, "k_proj": 2.0, "v_proj": 3.0, "o_proj": 3.0, "out_proj": 2.0}
_DT_GAIN: Final = 2.0  # the dt rows of in_proj
_EMBED_STD: Final = 0.3
# Layer kinds of the pattern, in Hugging Face's spelling.
_KINDS: Final = {"M": "mamba", "*": "attention", "-": "mlp"}


@dataclass(frozen=True)
class TinyNemotron:
    """The model's shape: Mamba2 + attention + MLP layers that vLLM's CPU build serves."""

    hybrid_override_pattern: str = "M*M-"
    hidden_size: int = 256
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 512
    vocab_size: int = 512
    max_position_embeddings: int = 2048
    mamba_num_heads: int = 8
    mamba_head_dim: int = 32
    n_groups: int = 2
    ssm_state_size: int = 16
    conv_kernel: int = 4
    chunk_size: int = 128
    # The spread of the Mamba heads' decay (see the docstring).
    a_range: tuple[float, float] = (0.005, 0.5)
    dt_range: tuple[float, float] = (0.001, 0.1)
    seed: int = 0

    def __post_init__(self) -> None:
        if set(self.hybrid_override_pattern) - set(_KINDS):
            raise ValueError("hybrid_override_pattern takes M (mamba), * (attention), - (mlp)")
        if self.mamba_num_heads % self.n_groups:
            raise ValueError("mamba_num_heads must be a multiple of n_groups")

    @property
    def mamba_intermediate(self) -> int:
        return self.mamba_num_heads * self.mamba_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the causal conv: x, then B and C of every group."""
        return self.mamba_intermediate + 2 * self.n_groups * self.ssm_state_size

    def config(self) -> dict[str, Any]:
        """The ``config.json`` document (Nemotron-H's keys, as its checkpoints spell them)."""
        return {
            "architectures": ["NemotronHForCausalLM"],
            "model_type": "nemotron_h",
            "hybrid_override_pattern": self.hybrid_override_pattern,
            "num_hidden_layers": len(self.hybrid_override_pattern),
            "hidden_size": self.hidden_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "vocab_size": self.vocab_size,
            "max_position_embeddings": self.max_position_embeddings,
            "mlp_hidden_act": "relu2",
            "mamba_num_heads": self.mamba_num_heads,
            "mamba_head_dim": self.mamba_head_dim,
            "mamba_hidden_act": "silu",
            "n_groups": self.n_groups,
            "ssm_state_size": self.ssm_state_size,
            "conv_kernel": self.conv_kernel,
            "chunk_size": self.chunk_size,
            "expand": self.mamba_intermediate // self.hidden_size or 1,
            "use_conv_bias": True,
            "use_bias": False,
            "mamba_proj_bias": False,
            "mlp_bias": False,
            "attention_bias": False,
            "layer_norm_epsilon": 1e-5,
            "residual_in_fp32": False,
            "mamba_ssm_cache_dtype": "float32",
            "tie_word_embeddings": False,
            # Token ids only (see tinyllama): 0 and 2 are never special in a prompt.
            "pad_token_id": 0,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "torch_dtype": "float32",
            "kvpushd_tinynemotron": asdict(self),
        }

    def shapes(self) -> Iterator[tuple[str, tuple[int, ...]]]:
        """Every weight's name and shape, in the order they are drawn from the generator."""
        hidden, heads = self.hidden_size, self.mamba_num_heads
        q_out = self.num_attention_heads * self.head_dim
        kv_out = self.num_key_value_heads * self.head_dim
        # in_proj: gate z and x (intermediate each), B and C (groups x state each), dt (heads).
        in_out = 2 * self.mamba_intermediate + 2 * self.n_groups * self.ssm_state_size + heads
        yield "model.embeddings.weight", (self.vocab_size, hidden)
        for i, kind in enumerate(self.hybrid_override_pattern):
            layer = f"model.layers.{i}"
            yield f"{layer}.norm.weight", (hidden,)
            mixer = f"{layer}.mixer"
            if kind == "M":
                yield f"{mixer}.dt_bias", (heads,)
                yield f"{mixer}.A_log", (heads,)
                yield f"{mixer}.D", (heads,)
                yield f"{mixer}.conv1d.weight", (self.conv_dim, 1, self.conv_kernel)
                yield f"{mixer}.conv1d.bias", (self.conv_dim,)
                yield f"{mixer}.in_proj.weight", (in_out, hidden)
                yield f"{mixer}.norm.weight", (self.mamba_intermediate,)
                yield f"{mixer}.out_proj.weight", (hidden, self.mamba_intermediate)
            elif kind == "*":
                yield f"{mixer}.q_proj.weight", (q_out, hidden)
                yield f"{mixer}.k_proj.weight", (kv_out, hidden)
                yield f"{mixer}.v_proj.weight", (kv_out, hidden)
                yield f"{mixer}.o_proj.weight", (hidden, q_out)
            else:
                yield f"{mixer}.up_proj.weight", (self.intermediate_size, hidden)
                yield f"{mixer}.down_proj.weight", (hidden, self.intermediate_size)
        yield "model.norm_f.weight", (hidden,)
        yield "lm_head.weight", (self.vocab_size, hidden)

    def weights(self) -> dict[str, torch.Tensor]:
        """The seeded float32 weights (see the module's docstring for each kind)."""
        gen = torch.Generator().manual_seed(self.seed)
        heads = self.mamba_num_heads
        spread = torch.linspace(0.0, 1.0, heads, dtype=torch.float64)
        a_lo, a_hi = self.a_range
        dt_lo, dt_hi = self.dt_range
        a_log = torch.log(a_lo * (a_hi / a_lo) ** spread).float()
        dt = dt_lo * (dt_hi / dt_lo) ** spread.flip(0)  # slow decay pairs small A with small dt
        dt_bias = (dt + torch.log(-torch.expm1(-dt))).float()  # inverse softplus
        out = {}
        for name, shape in self.shapes():
            leaf = name.split(".")[-1]
            if name.endswith("norm.weight") or name.endswith("norm_f.weight"):
                out[name] = torch.ones(shape, dtype=torch.float32)
            elif leaf == "D":
                out[name] = torch.zeros(shape, dtype=torch.float32)
            elif leaf == "A_log":
                out[name] = a_log.clone()
            elif leaf == "dt_bias":
                out[name] = dt_bias.clone()
            elif name.endswith("conv1d.bias"):
                out[name] = torch.zeros(shape, dtype=torch.float32)
            elif name.endswith("conv1d.weight"):
                std = 1.0 / math.sqrt(self.conv_kernel)
                out[name] = torch.randn(shape, generator=gen, dtype=torch.float32) * std
            elif name == "model.embeddings.weight":
                out[name] = torch.randn(shape, generator=gen, dtype=torch.float32) * _EMBED_STD
            else:
                gain = _GAINS.get(name.split(".")[-2], 1.0)
                std = gain / math.sqrt(shape[1])
                out[name] = torch.randn(shape, generator=gen, dtype=torch.float32) * std
                if name.endswith("in_proj.weight"):
                    out[name][-heads:] *= _DT_GAIN
        return out


def write_tinynemotron(folder: Path, model: TinyNemotron | None = None) -> Path:
    """Write the checkpoint of ``model`` (default: :class:`TinyNemotron`, seed 0) into ``folder``.

    Creates the folder if needed, overwrites the two files, returns the folder
    (what vLLM's ``--model`` takes). Byte-equal for equal ``model``.
    """
    model = model or TinyNemotron()
    folder.mkdir(parents=True, exist_ok=True)
    config = json.dumps(model.config(), indent=2, sort_keys=True) + "\n"
    (folder / CONFIG).write_text(config)
    write_safetensors(folder / WEIGHTS, model.weights())
    return folder


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="write the tiny seeded Nemotron-H checkpoint")
    parser.add_argument("folder", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    folder = write_tinynemotron(args.folder, TinyNemotron(seed=args.seed))
    print(f"{folder} {digest(folder)}")


if __name__ == "__main__":
    main()
