"""vLLM starts while its kvpushd daemon is down, serves, and uses the daemon once it is up.

Before: the connector's worker failed vLLM's start (or held it up to 30 s)
when no daemon answered. Now it says so once, vLLM serves without remote KV
(a push ends at once and its blocks go back), and the connector registers
its engine as soon as the daemon comes up.
"""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

from daemon.sim.launcher import Daemon, free_port
from harness.vllm_servers import VllmServer, kvpushd_connector_config, running

NOTICE = "serving without remote KV until it is up"


def test_vllm_serves_before_its_daemon_and_registers_once_it_is_up(
    tiny_model: Path, tmp_path: Path
) -> None:
    daemon = Daemon("late", tmp_path, free_port())  # configured, not started
    server = VllmServer(
        "early",
        tiny_model,
        tmp_path,
        core=sorted(os.sched_getaffinity(0))[0],
        extra_args=["--kv-transfer-config", kvpushd_connector_config("kv_both", daemon)],
    )
    rng = random.Random(31)
    with running(server):
        prompt = [rng.randrange(2, 512) for _ in range(64)]
        assert len(server.complete(prompt, 4).token_ids) == 4
        # A prefill leg with no daemon: answered, and its blocks go back at once.
        pushed = server.complete(prompt, 1, kv_transfer_params={"do_remote_decode": True})
        assert pushed.raw["kv_transfer_params"]["kvpushd_transfer_id"]
        _until(lambda: server.metrics().total("vllm:num_requests_running") == 0)
        daemon.start()
        try:
            _until(lambda: len(daemon.status()["engines"]) == 1, timeout=20)
            (engine,) = daemon.status()["engines"].values()
            assert engine["connected"] and engine["fingerprint"]["model"] == str(tiny_model)
        finally:
            assert daemon.stop() == 0
    assert server.log.read_text(errors="replace").count(NOTICE) == 1


def _until(check, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)
