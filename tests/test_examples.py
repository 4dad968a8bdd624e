"""Docs that run: the README's engine walkthrough, its configs and its example.

Two daemons are started from the README's own TOML (paths moved into a
temporary folder, ports made free), the example runs against them exactly as
the README says, and every line of code the walkthrough quotes must be a line
of the example, so the two cannot drift apart.
"""

from __future__ import annotations

import ast
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from daemon.ops.status import fetch_status
from daemon.sim.launcher import STATUS_ERRORS, free_port, write_secret
from tests.support import REPO

EXAMPLE = REPO / "examples" / "engine_pair.py"


def _section(title: str) -> str:
    text = (REPO / "README.md").read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end]


def _blocks(section: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", section, flags=re.S)


def _swap(text: str, pairs: dict[str, str]) -> str:
    """Replace each key by its value at once (so a<->b swaps do not collide)."""
    pattern = re.compile("|".join(re.escape(k) for k in pairs))
    return pattern.sub(lambda m: pairs[m[0]], text)


def _wait_peered(socket: str, peer: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"daemon exited {proc.returncode}"
        try:
            status = fetch_status(socket, 2.0)
        except STATUS_ERRORS:
            status = {}
        if any(p["node"] == peer and p["up"] for p in status.get("peers", [])):
            return
        time.sleep(0.05)
    raise TimeoutError(f"{socket} never saw {peer} up")


@pytest.fixture
def readme_daemons(tmp_path: Path) -> Iterator[dict[str, str]]:
    (toml,) = _blocks(_section("Integrating an engine"), "toml")
    port_a, port_b = free_port(), free_port()
    a = _swap(toml, {"/tmp/": f"{tmp_path}/", ":7701": f":{port_a}", ":7702": f":{port_b}"})
    b = _swap(
        a,
        {
            '"a"': '"b"',
            '"b"': '"a"',
            "kvpushd-a": "kvpushd-b",
            "kvpushd-b": "kvpushd-a",
            f":{port_a}": f":{port_b}",
            f":{port_b}": f":{port_a}",
        },
    )
    write_secret(tmp_path / "kvpushd-secret")
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for name, config in (("a", a), ("b", b)):
            path = tmp_path / f"{name}.toml"
            path.write_text(config)
            with open(tmp_path / f"{name}.log", "wb") as log:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "daemon.cli", "run", "--config", str(path)],
                        cwd=REPO,
                        stdin=subprocess.DEVNULL,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                    )
                )
        sockets = {"a": f"{tmp_path}/kvpushd-a.sock", "b": f"{tmp_path}/kvpushd-b.sock"}
        _wait_peered(sockets["a"], "b", procs[0])
        _wait_peered(sockets["b"], "a", procs[1])
        yield sockets
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for name, proc in zip("ab", procs, strict=True):
            assert proc.wait(30) == 0, (tmp_path / f"{name}.log").read_text()
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_engine_pair_example_runs_against_the_readme_daemons(readme_daemons):
    (command,) = (
        line
        for block in _blocks(_section("Integrating an engine"), "sh")
        for line in block.splitlines()
        if line.startswith("python examples/engine_pair.py")
    )
    args = _swap(command, {"/tmp/": f"{Path(readme_daemons['a']).parent}/"}).split()[2:]
    assert args == [readme_daemons["a"], "a", readme_daemons["b"], "b"]
    regions_before = _example_regions()
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines() == [
        "req-a-to-b: engine-a -> engine-b, 6 blocks checked",
        "req-b-to-a: engine-b -> engine-a, 6 blocks checked",
    ]
    # Its KV memory is a memfd: no file under /dev/shm, before or after.
    assert _example_regions() <= regions_before


def _example_regions() -> set[str]:
    return {name for name in os.listdir("/dev/shm") if name.startswith("example-engine-")}


def test_walkthrough_quotes_only_lines_of_the_example():
    example = {line.strip() for line in EXAMPLE.read_text().splitlines()}
    quoted = [
        line.strip()
        for block in _blocks(_section("Integrating an engine"), "python")
        for line in block.splitlines()
        if line.strip()
    ]
    assert len(quoted) >= 10
    assert [line for line in quoted if line not in example] == []


def test_walkthrough_says_what_an_integrator_must_know():
    text = " ".join(_section("Integrating an engine").split())
    for said in (
        "examples/engine_pair.py",
        "sealed memfd",
        "descriptors=(fd,)",
        "/dev/shm",
        "0660",
        "owned by the engine's user",
        "`peer=` is the node name of the prefill engine's daemon",
        "Either side may register first",
        "*still to fill*",
        "asyncio.run(main())",
    ):
        assert said in text, said
    assert "512 MiB" not in text


def test_example_uses_only_the_public_client_library():
    imported = set()
    for node in ast.walk(ast.parse(EXAMPLE.read_text())):
        if isinstance(node, ast.Import):
            imported |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module)
    first_party = {m for m in imported if m.split(".")[0] in ("daemon", "schemas", "statemachine")}
    assert first_party, imported
    assert all(m == "daemon.client" or m.split(".")[0] == "schemas" for m in first_party), imported
    third_party = imported - first_party - set(sys.stdlib_module_names) - {"__future__"}
    assert third_party == {"torch"}, third_party
