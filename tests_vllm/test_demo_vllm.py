"""``make demo-vllm`` runs: real servers, real daemons, every answer token-exact."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_the_vllm_demo_routes_every_prompt_token_exact_and_says_so(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "harness.vllm_demo", "--requests", "6", "--keep", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "6 / 6 token-exact" in out, out
    assert "P/D through kvpushd" in out and "single instance" in out, out
    assert "[################################] 6/6 requests" in done.stderr
    # Both daemons moved the KV and ended with nothing live; the journals stay.
    assert out.count(" 0 live; journal ") == 2, out
    assert (tmp_path / "pd" / "prefill-journal").is_dir()
    loaded = next(line for line in out.splitlines() if "loaded instead of computing" in line)
    assert int(loaded.rsplit(":", 1)[1]) > 6 * 32, loaded
