"""A tiny llama checkpoint, written deterministically from a seed, for real-vLLM tests.

vLLM's ``load_format="dummy"`` weights are equal across processes, but a
model with them ignores its context: a decode instance fed wrong KV would
still produce the same tokens, so they cannot tell right KV from wrong. The
checkpoint written here has seeded random weights scaled so that attention
carries the context: a linear layer's weights have standard deviation
``gain/sqrt(fan_in)`` with a gain of 2 for the queries and keys (sharper
attention) and 3 for the values and the output projection (attention
outweighs the current token's embedding), 1 elsewhere; embeddings N(0, 1),
norms 1. Measured with Hugging Face's reference llama on random prompts:
changing one token at a random position of a 64- or 200-token prompt changes
the 8 greedy tokens that follow in about 95 % of cases (with every gain 1:
45 % at 64 tokens), and a wrong KV block (32 tokens) far more surely. Two
writes with the same seed are byte-equal.

The folder holds what vLLM's llama loader reads, and no tokenizer (serve it
with ``skip_tokenizer_init`` and send prompts as token ids)::

    config.json          LlamaForCausalLM, float32 (:class:`TinyLlama` gives the shape)
    model.safetensors    every weight under its Hugging Face name

The safetensors file is written here by hand (an 8-byte little-endian header
length, a JSON header of dtype, shape and byte offsets sorted by name, then
the raw little-endian tensors), so this module needs only torch and the
standard library: it never imports vLLM, and the main environment, which has
neither vLLM nor the ``safetensors`` package, can write and read it too.

Used by tests_vllm/ and by benches: ``write_tinyllama(folder)``, or
``python -m harness.tinyllama FOLDER [--seed N]``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import struct
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Final

import torch

WEIGHTS: Final = "model.safetensors"
CONFIG: Final = "config.json"
# The header's alignment: tensor data then starts at a multiple of 8 bytes.
_ALIGN: Final = 8
# Standard deviation times sqrt(fan_in), by projection (see the docstring).
_GAINS: Final = {"q_proj": 2.0, "k_proj": 2.0, "v_proj": 3.0, "o_proj": 3.0}


@dataclass(frozen=True)
class TinyLlama:
    """The model's shape: the defaults fit vLLM's CPU attention (head_dim 64) and load fast."""

    hidden_size: int = 256
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    num_hidden_layers: int = 2
    intermediate_size: int = 512
    vocab_size: int = 512
    max_position_embeddings: int = 2048
    seed: int = 0
    # Layers that attend to the last ``sliding_window`` tokens only (a hybrid
    # model: vLLM's hybrid allocator gives them their own KV cache group).
    # The weights do not depend on it: the same seed draws the same tensors.
    sliding_layers: tuple[int, ...] = ()
    sliding_window: int = 0

    def config(self) -> dict[str, Any]:
        """The ``config.json`` document (Hugging Face's llama keys)."""
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "num_hidden_layers": self.num_hidden_layers,
            "intermediate_size": self.intermediate_size,
            "vocab_size": self.vocab_size,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu",
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "attention_bias": False,
            "mlp_bias": False,
            "tie_word_embeddings": False,
            # Token ids only: 0 and 1 are never special in a prompt, and the
            # tests send ignore_eos so generation always runs max_tokens.
            "bos_token_id": 0,
            "eos_token_id": 1,
            "torch_dtype": "float32",
            "kvpushd_tinyllama": asdict(self),
            **self._attention(),
        }

    def _attention(self) -> dict[str, Any]:
        """Hugging Face's per-layer attention keys, for a model with sliding layers."""
        if not self.sliding_layers:
            return {}
        if self.sliding_window < 1 or not set(self.sliding_layers) <= set(
            range(self.num_hidden_layers)
        ):
            raise ValueError("sliding_layers must be layer indices and sliding_window >= 1")
        return {
            "layer_types": [
                "sliding_attention" if i in self.sliding_layers else "full_attention"
                for i in range(self.num_hidden_layers)
            ],
            "sliding_window": self.sliding_window,
        }

    def shapes(self) -> Iterator[tuple[str, tuple[int, ...]]]:
        """Every weight's name and shape, in the order they are drawn from the generator."""
        hidden, inter = self.hidden_size, self.intermediate_size
        q_out = self.num_attention_heads * self.head_dim
        kv_out = self.num_key_value_heads * self.head_dim
        yield "model.embed_tokens.weight", (self.vocab_size, hidden)
        for i in range(self.num_hidden_layers):
            layer = f"model.layers.{i}"
            yield f"{layer}.input_layernorm.weight", (hidden,)
            yield f"{layer}.self_attn.q_proj.weight", (q_out, hidden)
            yield f"{layer}.self_attn.k_proj.weight", (kv_out, hidden)
            yield f"{layer}.self_attn.v_proj.weight", (kv_out, hidden)
            yield f"{layer}.self_attn.o_proj.weight", (hidden, q_out)
            yield f"{layer}.post_attention_layernorm.weight", (hidden,)
            yield f"{layer}.mlp.gate_proj.weight", (inter, hidden)
            yield f"{layer}.mlp.up_proj.weight", (inter, hidden)
            yield f"{layer}.mlp.down_proj.weight", (hidden, inter)
        yield "model.norm.weight", (hidden,)
        yield "lm_head.weight", (self.vocab_size, hidden)

    def weights(self) -> dict[str, torch.Tensor]:
        """The seeded float32 weights: norms 1, embeddings N(0, 1), linear std gain/sqrt(fan_in)."""
        gen = torch.Generator().manual_seed(self.seed)
        out = {}
        for name, shape in self.shapes():
            if name.endswith("norm.weight"):
                out[name] = torch.ones(shape, dtype=torch.float32)
                continue
            if name == "model.embed_tokens.weight":
                std = 1.0
            else:
                gain = _GAINS.get(name.split(".")[-2], 1.0)
                std = gain / math.sqrt(shape[1])
            out[name] = torch.randn(shape, generator=gen, dtype=torch.float32) * std
        return out


def write_tinyllama(folder: Path, model: TinyLlama | None = None) -> Path:
    """Write the checkpoint of ``model`` (default: :class:`TinyLlama`, seed 0) into ``folder``.

    Creates the folder if needed, overwrites the two files, returns the folder
    (what vLLM's ``--model`` takes). Byte-equal for equal ``model``.
    """
    model = model or TinyLlama()
    folder.mkdir(parents=True, exist_ok=True)
    config = json.dumps(model.config(), indent=2, sort_keys=True) + "\n"
    (folder / CONFIG).write_text(config)
    write_safetensors(folder / WEIGHTS, model.weights())
    return folder


LORA_RANK: Final = 8


def write_lora(folder: Path, model: TinyLlama | None = None, seed: int = 0) -> Path:
    """Write a PEFT LoRA adapter of ``model`` into ``folder``: rank 8 on the keys and values.

    It changes the KV itself (a LoRA on the queries alone would not): two
    seeds give two adapters a decode must not mix. ``lora_B`` is drawn,
    not zero as PEFT starts it, with the gain of the base projection, so
    the adapter moves the tokens. vLLM serves it with ``--enable-lora
    --max-lora-rank 8 --lora-modules NAME=FOLDER``.
    """
    model = model or TinyLlama()
    gen = torch.Generator().manual_seed(10_000 + seed)
    kv_out = model.num_key_value_heads * model.head_dim
    tensors = {}
    for i in range(model.num_hidden_layers):
        for proj in ("k_proj", "v_proj"):
            name = f"base_model.model.model.layers.{i}.self_attn.{proj}"
            a = torch.randn(LORA_RANK, model.hidden_size, generator=gen)
            b = torch.randn(kv_out, LORA_RANK, generator=gen)
            tensors[f"{name}.lora_A.weight"] = a / math.sqrt(model.hidden_size)
            tensors[f"{name}.lora_B.weight"] = b * _GAINS[proj] / math.sqrt(LORA_RANK)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": LORA_RANK,
        "lora_alpha": LORA_RANK,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": ["k_proj", "v_proj"],
        "base_model_name_or_path": "tiny",
    }
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    write_safetensors(folder / "adapter_model.safetensors", tensors)
    return folder


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """float32 tensors into one safetensors file, sorted by name."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    blobs = []
    offset = 0
    for name in sorted(tensors):
        tensor = tensors[name]
        if tensor.dtype != torch.float32:
            raise ValueError(f"{name}: only float32 is written, not {tensor.dtype}")
        blob = tensor.detach().contiguous().numpy().astype("<f4", copy=False).tobytes()
        header[name] = {
            "dtype": "F32",
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + len(blob)],
        }
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % _ALIGN)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for blob in blobs:
            f.write(blob)


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """The float32 tensors of a safetensors file (the inverse of :func:`write_safetensors`)."""
    data = path.read_bytes()
    (size,) = struct.unpack_from("<Q", data)
    header = json.loads(data[8 : 8 + size])
    header.pop("__metadata__", None)
    base = 8 + size
    out = {}
    for name, entry in header.items():
        if entry["dtype"] != "F32":
            raise ValueError(f"{name}: dtype {entry['dtype']} is not read here")
        begin, end = entry["data_offsets"]
        raw = bytearray(data[base + begin : base + end])
        out[name] = torch.frombuffer(raw, dtype=torch.float32).reshape(entry["shape"])
    return out


def digest(folder: Path) -> str:
    """SHA-256 over the checkpoint's two files: equal for byte-equal checkpoints."""
    h = hashlib.sha256()
    for name in (CONFIG, WEIGHTS):
        h.update((folder / name).read_bytes())
    return h.hexdigest()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="write the tiny seeded llama checkpoint")
    parser.add_argument("folder", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    folder = write_tinyllama(args.folder, TinyLlama(seed=args.seed))
    print(f"{folder} {digest(folder)}")


if __name__ == "__main__":
    main()
