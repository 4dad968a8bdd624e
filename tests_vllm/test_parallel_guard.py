"""A vLLM instance whose parallel layout KvpushdConnector cannot pair does not start.

Measured before this guard: a TP 2 prefill and a TP 2 decode both came up
and every P/D request then failed with an opaque 500 (each rank registered
the same transfer id; the pairs that formed were rank 1 into rank 0). TP
ranks and pipeline stages now pair (tests_vllm/test_pd_tp.py,
test_pd_pp.py) by the heads and layers each rank holds, as vLLM splits
them; a layout still not served, here pipeline stages whose layers an
operator split unevenly (``VLLM_PP_LAYER_PARTITION``: the other side could
not tell which layers a stage holds), is refused at start-up with one error
naming the setting, before the connector registers anything with its
daemon: vLLM exits, the daemon never sees an engine, so no request can ever
report external tokens that not every rank could fill. (Data parallel
needs no guard for a dense model: vLLM runs each DP rank as an independent
engine, data_parallel_size 1 in its config, each its own kvpushd engine.)
"""

from __future__ import annotations

import os
from pathlib import Path

from daemon.sim.launcher import Daemon, free_port
from harness.tinyllama import TinyLlama, write_tinyllama
from harness.vllm_servers import (
    VllmServer,
    kvpushd_connector_config,
    remove_vllm_shm_segments,
    vllm_shm_segments,
)

# Each stage refuses (which one vLLM reports first is a race): "stage 0 holds layers
# [0, 1, 2], not (0, 2)", "stage 1 holds layers [3], not (2, 4)".
REFUSAL = "KvpushdConnector: pipeline stage "
SETTING = "VLLM_PP_LAYER_PARTITION is not supported"


def test_a_pp2_instance_split_unevenly_refuses_to_start_with_one_error_naming_the_setting(
    tmp_path: Path,
) -> None:
    # Four layers, so that a partition other than vLLM's even one exists.
    model = write_tinyllama(tmp_path / "model", TinyLlama(num_hidden_layers=4))
    daemon = Daemon("node", tmp_path, free_port()).start()
    core = sorted(os.sched_getaffinity(0))[0]
    server = VllmServer(
        "pp2",
        model,
        tmp_path,
        core=core,
        pp=2,
        env={"VLLM_PP_LAYER_PARTITION": "3,1"},
        extra_args=[
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
        assert REFUSAL in log and SETTING in log, log[-4000:]
        # Refused before the worker spoke to the daemon: nothing was registered.
        status = daemon.status()
        assert status["engines"] == {} and status["live"] == 0, status
        assert "engine registered" not in daemon.logs()
    finally:
        server.stop()
        # An instance of several ranks leaves its shared-memory segments behind.
        remove_vllm_shm_segments(vllm_shm_segments() - shm_before)
        assert daemon.stop() == 0
