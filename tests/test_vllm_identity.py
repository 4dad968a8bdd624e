"""Identity up front (issue 47 item 2): what the weights, the rope table and an adapter hold.

The connector's parts that name an instance's KV by what it holds rather
than by a path: the weights digest (daemon/client/vllm/weights.py), the
rope as vLLM resolved it (rope.py), a LoRA adapter's content key
(adapters.py) and the multimodal counters check (inputs.py). No vLLM: torch
modules and config objects of vLLM's shape.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from daemon.client.vllm.adapters import TAG, adapter_digest, adapter_key
from daemon.client.vllm.inputs import MULTIMODAL, counts_inputs, local_only
from daemon.client.vllm.rope import rope_identity
from daemon.client.vllm.weights import SAMPLES, calling_model, model_digest, weights_digest
from harness.tinyllama import TinyLlama


def _loaded(seed: int = 0) -> dict[str, torch.Tensor]:
    """The tiny llama's weights as a process would hold them after loading (fresh tensors)."""
    return {name: t.clone() for name, t in TinyLlama(seed=seed).weights().items()}


# ------------------------------------------------------------------ weights


def test_the_same_weights_loaded_twice_give_the_same_digest() -> None:
    first, second = _loaded(), _loaded()
    assert first["model.embed_tokens.weight"].data_ptr() != (
        second["model.embed_tokens.weight"].data_ptr()
    )
    digest = weights_digest(first.items())
    assert digest == weights_digest(second.items())
    # Order of the parameters and LoRA's wrapper do not matter; names do.
    wrapped = {n.replace("q_proj.", "q_proj.base_layer."): t for n, t in second.items()}
    assert weights_digest(reversed(list(wrapped.items()))) == digest
    renamed = dict(first)
    renamed["model.norm.w"] = renamed.pop("model.norm.weight")
    assert weights_digest(renamed.items()) != digest


def test_other_weights_or_one_sampled_element_changed_change_the_digest() -> None:
    base = _loaded()
    digest = weights_digest(base.items())
    # A rewritten checkpoint (another seed: the case of issue 47).
    assert weights_digest(_loaded(seed=1).items()) != digest
    # A fine-tune's small change to every element of one tensor.
    tuned = _loaded()
    tuned["model.layers.1.mlp.down_proj.weight"] += 1e-4
    assert weights_digest(tuned.items()) != digest
    # One element of one tensor, where a sample falls: the first and the last always do.
    for index in (0, -1):
        one = _loaded()
        one["model.layers.0.self_attn.k_proj.weight"].view(-1)[index] += 1.0
        assert weights_digest(one.items()) != digest, index
    # Another dtype or shape of the same values.
    halves = dict(base, **{"model.norm.weight": base["model.norm.weight"].half()})
    assert weights_digest(halves.items()) != digest


def test_the_sample_reads_a_bounded_number_of_elements_of_any_dtype() -> None:
    big = torch.arange(10 * SAMPLES, dtype=torch.float32).reshape(10, SAMPLES)
    # Between samples (stride ~10): the sampled digest does not see it (kvcheck.py does).
    moved = big.clone()
    moved.view(-1)[5] += 1.0
    assert weights_digest([("w", big)]) == weights_digest([("w", moved)])
    # Any dtype, a 0-dim tensor, a transposed (non-contiguous) one, an empty one.
    odd = [
        ("bf16", torch.ones(3, 5, dtype=torch.bfloat16)),
        ("int8", torch.arange(7, dtype=torch.int8)),
        ("bool", torch.tensor([True, False])),
        ("scalar", torch.tensor(2.5)),
        ("t", big.t()),
        ("empty", torch.empty(0, 4)),
    ]
    if hasattr(torch, "float8_e4m3fn"):
        odd.append(("fp8", torch.ones(4, 4).to(torch.float8_e4m3fn)))
    assert len(weights_digest(odd)) == 32
    assert weights_digest(odd) == weights_digest(odd)


def test_the_model_is_found_up_the_calling_frames_of_vllms_worker() -> None:
    model = torch.nn.Linear(4, 4)

    class Runner:
        def get_model(self) -> torch.nn.Module:
            return model

    class Worker:
        def __init__(self) -> None:
            self.model_runner = Runner()

        def initialize_from_config(self) -> Any:
            return ensure_kv_transfer_initialized()

    def ensure_kv_transfer_initialized() -> Any:
        return calling_model()

    assert Worker().initialize_from_config() is model
    assert model_digest(model) == weights_digest(model.named_parameters())
    assert calling_model() is None  # no worker above this test


# --------------------------------------------------------------------- rope


def _phi3(max_model_len: int, rope_type: str = "longrope") -> Any:
    rope = {
        "rope_type": rope_type,
        "rope_theta": 10000.0,
        "short_factor": [1.0] * 32,
        "long_factor": [4.0] * 32,
        "original_max_position_embeddings": 64,
    }
    text = SimpleNamespace(rope_parameters=rope, max_position_embeddings=512)
    return SimpleNamespace(hf_text_config=text, max_model_len=max_model_len)


def test_the_rope_of_a_longrope_model_names_the_table_its_max_model_len_chose() -> None:
    long, short = rope_identity(_phi3(256)), rope_identity(_phi3(64))
    assert long.startswith("longrope:long:") and short.startswith("longrope:short:")
    assert long != short
    assert rope_identity(_phi3(65)) == long and rope_identity(_phi3(32)) == short
    # Another factor is another rope, whatever the table.
    other = _phi3(256)
    other.hf_text_config.rope_parameters["long_factor"] = [2.0] * 32
    assert rope_identity(other) != long
    # A rope with one table does not depend on max_model_len.
    assert rope_identity(_phi3(256, "default")) == rope_identity(_phi3(64, "default"))
    assert rope_identity(_phi3(256, "default")).startswith("default:-:")


def test_nested_and_legacy_rope_configs_and_none() -> None:
    flat = {"rope_type": "default", "rope_theta": 1e4}
    by_layer = {"full_attention": flat, "sliding_attention": dict(flat, rope_theta=1e6)}
    nested = SimpleNamespace(
        hf_text_config=SimpleNamespace(rope_parameters=by_layer),
        max_model_len=128,
    )
    assert rope_identity(nested).startswith("default:-:")
    legacy = SimpleNamespace(
        hf_text_config=SimpleNamespace(rope_scaling=None, rope_theta=1e4), max_model_len=128
    )
    assert rope_identity(legacy).startswith("default:-:")
    none = SimpleNamespace(hf_text_config=SimpleNamespace(), max_model_len=128)
    assert rope_identity(none) == ""


# ----------------------------------------------------------------- adapters


def _adapter(folder: Path, weights: bytes) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text('{"r": 8}')
    (folder / "adapter_model.safetensors").write_bytes(weights)
    (folder / "README.md").write_text("not read")
    return folder


def _request(path: Path | None, int_id: int = 1) -> Any:
    lora = (
        None
        if path is None
        else SimpleNamespace(lora_name="a", lora_int_id=int_id, lora_path=str(path))
    )
    return SimpleNamespace(lora_request=lora)


def test_an_adapter_rewritten_in_place_changes_its_key_for_an_instance_that_loads_it_after(
    tmp_path: Path,
) -> None:
    folder = _adapter(tmp_path / "a", b"\x01" * 4096)
    key = adapter_key(_request(folder))
    assert key is not None and key[0] == TAG
    assert adapter_key(_request(_adapter(tmp_path / "b", b"\x01" * 4096))) == key
    # Same name, same path, same size, other weights: a rolling upgrade.
    (folder / "adapter_model.safetensors").write_bytes(b"\x02" * 4096)
    # This instance loaded the old weights and still holds them: it names them.
    assert adapter_key(_request(folder)) == key
    # An instance that sees the adapter after the rewrite (here: vLLM loading
    # it again under a new id) names the new ones.
    assert adapter_key(_request(folder, int_id=2)) not in (None, key)
    # Files vLLM does not read leave the digest.
    changed = adapter_digest(str(folder))
    (folder / "README.md").write_text("edited")
    assert adapter_digest(str(folder)) == changed


def test_no_adapter_or_none_readable_adds_no_key(tmp_path: Path) -> None:
    assert adapter_key(_request(None)) is None
    assert adapter_key(SimpleNamespace()) is None
    assert adapter_key(_request(tmp_path / "hub-org/adapter")) is None


def test_an_adapter_is_read_once_when_first_seen(tmp_path: Path) -> None:
    folder = _adapter(tmp_path / "big", os.urandom(1 << 20))
    key = adapter_key(_request(folder, int_id=7))
    (folder / "adapter_model.safetensors").unlink()  # read again, it would differ
    assert adapter_key(_request(folder, int_id=7)) == key
    assert adapter_key(_request(folder, int_id=8)) not in (None, key)


# --------------------------------------------------------------- multimodal


def _mm(identifier: str) -> Any:
    feature = SimpleNamespace(identifier=identifier, mm_hash=identifier)
    return SimpleNamespace(mm_features=[feature], get_skip_reading_prefix_cache=lambda: False)


def test_multimodal_inputs_named_by_counters_compute_here() -> None:
    counter = _mm("renderer0-mm-7-image-0")
    assert local_only(counter, counts=False)[0] == MULTIMODAL  # type: ignore[index]
    assert local_only(_mm("adapter:renderer3-mm-12-audio-1"), counts=False) is not None
    # A content hash: loaded, unless the instance's config says it counts.
    content = _mm("9f" * 32)
    assert local_only(content, counts=False) is None
    assert local_only(content, counts=True)[0] == MULTIMODAL  # type: ignore[index]
    # No multimodal input: the config does not matter.
    text = SimpleNamespace(mm_features=[], get_skip_reading_prefix_cache=lambda: False)
    assert local_only(text, counts=True) is None


@pytest.mark.parametrize(
    ("cache_gb", "prefix", "counts"),
    [(0, False, True), (0, True, False), (4, False, False), (None, False, False)],
)
def test_an_instance_counts_its_inputs_with_both_caches_off(
    cache_gb: float | None, prefix: bool, counts: bool
) -> None:
    multimodal = None if cache_gb is None else SimpleNamespace(mm_processor_cache_gb=cache_gb)
    config = SimpleNamespace(
        model_config=SimpleNamespace(multimodal_config=multimodal),
        cache_config=SimpleNamespace(enable_prefix_caching=prefix),
    )
    assert counts_inputs(config) is counts
