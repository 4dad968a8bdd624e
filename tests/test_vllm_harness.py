"""The real-vLLM harness's parts that need no vLLM: the tiny checkpoint, the command, metrics.

tests_vllm/ runs them against real vLLM servers in .venv-vllm; here, in the
main environment (which has no vLLM), the checkpoint writer is shown
deterministic and readable, the server command and environment carry the
settings vLLM's CPU build needs, Prometheus text parses, and pinning a
process tree's threads works on a plain child process.
"""

from __future__ import annotations

import itertools
import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from harness.tinyllama import (
    CONFIG,
    WEIGHTS,
    TinyLlama,
    digest,
    read_safetensors,
    write_tinyllama,
)
from harness.vllm_servers import (
    Metrics,
    VllmServer,
    affinities,
    pin_threads,
    process_tree,
)


def test_the_checkpoint_is_byte_equal_for_a_seed_and_differs_across_seeds(tmp_path: Path) -> None:
    one = write_tinyllama(tmp_path / "one")
    two = write_tinyllama(tmp_path / "two")
    other = write_tinyllama(tmp_path / "other", TinyLlama(seed=1))
    assert digest(one) == digest(two)
    assert digest(one) != digest(other)


def test_the_checkpoint_holds_every_llama_weight_in_shape(tmp_path: Path) -> None:
    model = TinyLlama()
    folder = write_tinyllama(tmp_path, model)
    config = json.loads((folder / CONFIG).read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_key_value_heads"] * config["head_dim"] == 128
    assert config["torch_dtype"] == "float32"
    tensors = read_safetensors(folder / WEIGHTS)
    assert {n: tuple(t.shape) for n, t in tensors.items()} == dict(model.shapes())
    assert tensors["model.layers.1.self_attn.k_proj.weight"].shape == (128, 256)
    expected = model.weights()
    assert all(torch.equal(tensors[n], expected[n]) for n in expected)
    # The safetensors layout: header length, JSON header padded to 8 bytes, data.
    data = (folder / WEIGHTS).read_bytes()
    (size,) = struct.unpack_from("<Q", data)
    assert size % 8 == 0
    header = json.loads(data[8 : 8 + size])
    end = max(entry["data_offsets"][1] for n, entry in header.items() if n != "__metadata__")
    assert len(data) == 8 + size + end


def test_the_server_command_carries_the_cpu_builds_settings(tmp_path: Path) -> None:
    server = VllmServer("p", tmp_path / "model", tmp_path, core=1, port=20001, python="py")
    cmd = server.command()
    assert cmd[:3] == ["py", "-m", "vllm.entrypoints.openai.api_server"]
    args = dict(itertools.pairwise(cmd))
    assert args["--port"] == "20001" and args["--block-size"] == "32"
    assert args["--dtype"] == "float32" and args["--model"] == str(tmp_path / "model")
    assert {"--skip-tokenizer-init", "--enforce-eager", "--kv-cache-memory-bytes"} <= set(cmd)
    env = server.environment()
    assert env["HF_HUB_OFFLINE"] == "1" and env["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert "--enforce-eager" not in VllmServer("p", tmp_path, tmp_path, eager=False).command()
    with pytest.raises(ValueError, match="16"):
        VllmServer("p", tmp_path, tmp_path, block_size=40)


def test_metrics_parse_labels_and_sum_the_matching_samples() -> None:
    text = "\n".join(
        [
            "# HELP vllm:prompt_tokens_by_source_total Prompt tokens by source.",
            "# TYPE vllm:prompt_tokens_by_source_total counter",
            'vllm:prompt_tokens_by_source_total{engine="0",model_name="tiny",'
            'source="local_compute"} 96.0',
            'vllm:prompt_tokens_by_source_total{engine="0",model_name="tiny",'
            'source="external_kv_transfer"} 64.0',
            'odd{path="a\\"b,c"} 1',
            "plain_total 3 1700000000000",
        ]
    )
    m = Metrics.parse(text)
    name = "vllm:prompt_tokens_by_source_total"
    assert m.total(name) == 160.0
    assert m.total(name, source="local_compute") == 96.0
    assert m.total(name, source="local_cache_hit") == 0.0
    assert m.total("odd", path='a"b,c') == 1.0
    assert m.total("plain_total") == 3.0
    assert m.names() == {name, "odd", "plain_total"}


def test_pinning_reaches_every_thread_of_a_process_tree() -> None:
    core = max(os.sched_getaffinity(0))
    sleeper = "import time; time.sleep(30)"
    code = (
        f"import subprocess, sys; subprocess.Popen([sys.executable, '-c', {sleeper!r}]); {sleeper}"
    )
    child = subprocess.Popen([sys.executable, "-c", code])
    try:
        tree: list[int] = []
        for _ in range(100):
            tree = process_tree(child.pid)
            if len(tree) == 2:
                break
            time.sleep(0.05)
        assert tree[0] == child.pid and len(tree) == 2
        assert child.pid in process_tree(os.getpid())
        assert pin_threads(tree, core) >= 2
        assert set(map(frozenset, affinities(tree).values())) == {frozenset({core})}
    finally:
        for pid in reversed(process_tree(child.pid)):
            os.kill(pid, 9)
        child.wait()
