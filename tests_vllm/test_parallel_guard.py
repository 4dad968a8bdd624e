"""A vLLM instance whose parallel layout KvpushdConnector cannot pair does not start.

Measured before this guard: a TP 2 prefill and a TP 2 decode both came up
and every P/D request then failed with an opaque 500 (each rank registered
the same transfer id; the pairs that formed were rank 1 into rank 0). TP
ranks now pair (tests_vllm/test_pd_tp.py); a layout still not served, here
two pipeline stages (each holds only some layers), is refused at start-up
with one error naming the setting, before the connector registers anything
with its daemon: vLLM exits, the daemon never sees an engine, so no request
can ever report external tokens that not every rank could fill.
"""

from __future__ import annotations

import os
from pathlib import Path

from daemon.sim.launcher import Daemon, free_port
from daemon.sim.vllm_servers import (
    VllmServer,
    kvpushd_connector_config,
    remove_vllm_shm_segments,
    vllm_shm_segments,
)

REFUSAL = (
    "KvpushdConnector: pipeline_parallel_size = 2 (--pipeline-parallel-size 2) is not supported"
)


def test_a_pp2_instance_refuses_to_start_with_one_error_naming_the_setting(
    tiny_model: Path, tmp_path: Path
) -> None:
    daemon = Daemon("node", tmp_path, free_port()).start()
    core = sorted(os.sched_getaffinity(0))[0]
    server = VllmServer(
        "pp2",
        tiny_model,
        tmp_path,
        core=core,
        # Both stages' OpenMP threads on the one core (one list per rank).
        env={"VLLM_CPU_OMP_THREADS_BIND": f"{core}|{core}"},
        extra_args=[
            "--pipeline-parallel-size",
            "2",
            "--kv-transfer-config",
            kvpushd_connector_config("kv_both", daemon),
        ],
    )
    shm_before = vllm_shm_segments()
    try:
        server.start()
        assert server.proc is not None
        code = server.proc.wait(240)
        log = server.log.read_text(errors="replace")
        assert code != 0, log[-4000:]
        assert REFUSAL in log, log[-4000:]
        # Refused before the worker spoke to the daemon: nothing was registered.
        status = daemon.status()
        assert status["engines"] == {} and status["live"] == 0, status
        assert "engine registered" not in daemon.logs()
    finally:
        server.stop()
        # A TP instance leaves its shared-memory all-reduce segments behind.
        remove_vllm_shm_segments(vllm_shm_segments() - shm_before)
        assert daemon.stop() == 0
