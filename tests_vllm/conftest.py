"""Real vLLM servers on the tiny seeded llama, shared by the tests of a session.

Two servers (``a`` on the first core this process may use, ``b`` on the
last) start together, once per session: each loads on its own core, so two
cost the wall time of one (~25 s here). Tests that need other settings (a KV
connector) start their own with :mod:`harness.vllm_servers`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.tinyllama import write_tinyllama
from harness.vllm_servers import VllmServer, start_servers, stop_servers


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tinyllama(tmp_path_factory.mktemp("tinyllama"))


@pytest.fixture(scope="session")
def vllm_pair(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[VllmServer, VllmServer]]:
    cores = sorted(os.sched_getaffinity(0))
    workdir = tmp_path_factory.mktemp("vllm")
    pair = (
        VllmServer("a", tiny_model, workdir, core=cores[0]),
        VllmServer("b", tiny_model, workdir, core=cores[-1]),
    )
    start_servers(pair)
    try:
        yield pair
    finally:
        trees = [s.pids() for s in pair]
        stop_servers(pair)
    for server, pids in zip(pair, trees, strict=True):
        assert server.proc is not None and server.proc.returncode == 0, server.log
        left = [p for p in pids if os.path.exists(f"/proc/{p}")]
        assert left == [], f"{server.name}: processes left after stop: {left}"
