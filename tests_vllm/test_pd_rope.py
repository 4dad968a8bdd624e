"""A LongRoPE model served with two max_model_len values: refused up front, naming ``rope``.

vLLM's LongRoPE (Phi-3 style) rotates keys with the long factors when
``max_model_len > original_max_position_embeddings`` and with the short
ones otherwise. A prefill at ``--max-model-len 256`` and a decode at 128 of
one checkpoint (original 128) hold keys rotated by two tables: before the
fingerprint named the rope, 12/12 of such loads served wrong tokens. Now the
decode's scheduler sees the prefill's ``rope`` differ from its own
(daemon/client/vllm/rope.py), computes the prompt itself, says so in one
line naming the field, and the prefill's daemon refuses the push naming it
too. The same pair shows the weights digest equal across two processes
that loaded one checkpoint (each worker logs it).
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from daemon.sim.launcher import Daemon, wait_idle
from harness.tinyllama import CONFIG, write_tinyllama
from harness.vllm_router import external_tokens, prefill_leg
from harness.vllm_servers import VllmServer, kvpushd_pd

TOKENS = 8
ORIGINAL = 128  # the decode's max_model_len (the harness warms up with 64 + 4 tokens)
PD = tuple[VllmServer, VllmServer, Daemon, Daemon]


def _longrope(folder: Path) -> Path:
    """The tiny llama with a LongRoPE whose long factors are far from its short ones."""
    write_tinyllama(folder)
    config = json.loads((folder / CONFIG).read_text())
    half = config["head_dim"] // 2
    config["rope_scaling"] = {
        "rope_type": "longrope",
        "short_factor": [1.0] * half,
        "long_factor": [1.0 + 7.0 * i / (half - 1) for i in range(half)],
        "original_max_position_embeddings": ORIGINAL,
    }
    config["original_max_position_embeddings"] = ORIGINAL
    (folder / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return folder


@pytest.fixture(scope="module")
def rope_pd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PD]:
    with kvpushd_pd(
        _longrope(tmp_path_factory.mktemp("longrope")),
        tmp_path_factory.mktemp("pd-rope"),
        prefill_args=["--max-model-len", "256"],
        decode_args=["--max-model-len", str(ORIGINAL)],
    ) as pd:
        yield pd


def test_a_longrope_pair_with_two_max_model_lens_is_refused_naming_rope(rope_pd: PD) -> None:
    p, d, prefill, decode = rope_pd
    rng = random.Random(47)
    loaded = external_tokens(d)
    differ = 0
    for length in (40, 70, 100):
        prompt = [rng.randrange(2, 512) for _ in range(length)]
        own = d.complete(prompt, TOKENS).token_ids
        # The oracle: the two tables compute other tokens (loaded, they would be served).
        differ += p.complete(prompt, TOKENS).token_ids != own
        sent = prefill_leg(p, prompt)
        assert sent["kvpushd_fingerprint"]["rope"].startswith("longrope:long:")
        served = d.complete(prompt, TOKENS, kv_transfer_params=sent).token_ids
        assert served == own, length
        wait_idle(prefill, decode)
        events = prefill.journal_events(sent["kvpushd_transfer_id"])
        assert any("rope" in repr(e) for e in events), events
    assert differ == 3
    assert external_tokens(d) == loaded  # nothing loaded
    log = d.log.read_text(errors="replace")
    assert "fingerprint differs in rope (prefill 'longrope:long:" in log
    assert "this instance 'longrope:short:" in log


def test_two_processes_loading_one_checkpoint_digest_its_weights_alike(rope_pd: PD) -> None:
    p, d, _, _ = rope_pd
    digests = [
        re.findall(r"weights digest ([0-9a-f]{32})", server.log.read_text(errors="replace"))
        for server in (p, d)
    ]
    assert digests[0] and digests[0] == digests[1], digests
