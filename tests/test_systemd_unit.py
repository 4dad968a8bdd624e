"""The systemd unit: it verifies with systemd-analyze and says what operators rely on."""

from __future__ import annotations

import configparser
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import REPO

UNIT = REPO / "systemd" / "kvpushd.service"


def _unit() -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # systemd keys are case-sensitive
    parser.read(UNIT)
    return parser


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze missing")
def test_unit_verifies(tmp_path: Path):
    # verify checks that ExecStart exists: point it at this checkout's kvpushd.
    kvpushd = Path(sys.executable).with_name("kvpushd")
    text = UNIT.read_text().replace("/opt/kvpushd/bin/kvpushd", str(kvpushd))
    unit = tmp_path / "kvpushd.service"
    unit.write_text(text)
    proc = subprocess.run(
        ["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "kvpushd.service" not in proc.stderr, proc.stderr


def test_unit_has_what_operations_rely_on():
    service = _unit()["Service"]
    assert service["Type"] == "notify"
    assert int(service["WatchdogSec"]) > 0
    assert service["Restart"] == "on-failure"
    assert service["RuntimeDirectory"] == "kvpushd"
    assert service["StateDirectory"] == "kvpushd"
    assert "run --config" in service["ExecStart"]
    for key in ("NoNewPrivileges", "ProtectHome", "PrivateTmp"):
        assert service[key] == "yes"
    assert service["ProtectSystem"] == "strict"
    # These would break shared memory, cma or CUDA; the unit must not set them.
    for key in ("PrivateDevices", "PrivateIPC", "MemoryDenyWriteExecute"):
        assert key not in service


def test_example_config_loads():
    from daemon.config import load_config

    config = load_config(REPO / "systemd" / "kvpushd.toml")
    assert config.node == "prefill-0"
    assert config.journal.fsync == "batch"
    assert config.peers[0].node == "decode-0"


def test_the_unit_says_how_to_pin_the_daemon_but_pins_nothing_itself():
    # The engines' cores differ per host: a fixed CPUAffinity= would be wrong
    # on most of them. The commented line shows where it goes and why.
    assert "CPUAffinity" not in _unit()["Service"]
    commented = [line for line in UNIT.read_text().splitlines() if line.startswith("#CPUAffinity=")]
    assert len(commented) == 1
    assert "cpu_affinity" in UNIT.read_text()
