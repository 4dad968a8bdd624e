"""A plain install of the package imports, every module of it, without the test extra.

The package is built and installed (``pip install --target``, no
dependencies: the runtime ones are this environment's) into a fresh folder,
and a fresh interpreter, started outside the checkout, imports every module
of it from there. What a plain install lacks is made missing: the ``test``
extra's distributions (hypothesis, pytest...), vLLM, and the checkout's
folders that are not installed (harness/, tests/, bench/, tools/). A module
that imports any of them fails the test, except the vLLM connector's, which
only vLLM loads (and which therefore need vllm, and nothing of the rest).
Why not a new virtual environment: installing torch and NIXL again would
cost minutes of every CI run for the same answer.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

from tests.support import REPO

NOT_INSTALLED = ("harness", "tests", "bench", "tools")
# The connector's parts that import vLLM (its pure parts, and the package
# itself, import without it: the package exports the connector lazily).
CONNECTOR = tuple(
    f"daemon.client.vllm.{part}"
    for part in ("connector", "metadata", "scheduler", "stats", "worker")
)

IMPORT_ALL = """
import importlib, importlib.abc, json, pkgutil, sys
target, blocked = sys.argv[1], tuple(json.loads(sys.argv[2]))
class Missing(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in blocked:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, Missing())
sys.path.insert(0, target)
failed, imported = {}, []
for top in ("daemon", "statemachine", "schemas"):
    package = importlib.import_module(top)
    assert package.__file__.startswith(target), package.__file__
    for info in pkgutil.walk_packages(package.__path__, top + "."):
        try:
            importlib.import_module(info.name)
            imported.append(info.name)
        except Exception as exc:
            failed[info.name] = f"{type(exc).__name__}: {exc}"
print(json.dumps({"imported": imported, "failed": failed}))
"""


def _test_extra() -> list[str]:
    """The import names of the ``test`` extra's distributions (pyseccomp -> seccomp too)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    names = [re.split(r"[<>=!~\[ ]", req)[0] for req in project["optional-dependencies"]["test"]]
    modules = [name.replace("-", "_") for name in names]
    return [*modules, "_pytest", "seccomp"]


def test_every_module_of_a_plain_install_imports(tmp_path: Path) -> None:
    # Built from a copy of what the package is made of: a build in the
    # checkout would reuse (and could ship) whatever an older build left there.
    source = tmp_path / "source"
    for name in ("daemon", "statemachine", "schemas"):
        shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    target = tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation"]
    subprocess.run(
        [*pip, "--target", str(target), str(source)],
        check=True,
        capture_output=True,
        cwd=tmp_path,
        timeout=300,
    )
    installed = {p.name for p in target.iterdir()}
    assert {"daemon", "statemachine", "schemas"} <= installed
    assert not installed & set(NOT_INSTALLED), installed  # the harness is not shipped
    blocked = [*_test_extra(), "vllm", *NOT_INSTALLED]
    done = subprocess.run(
        [sys.executable, "-c", IMPORT_ALL, str(target), json.dumps(blocked)],
        check=True,
        capture_output=True,
        text=True,
        cwd=tmp_path,  # not the checkout: nothing of it on the path
        timeout=300,
    )
    result = json.loads(done.stdout)
    assert len(result["imported"]) > 80, result
    failed = result["failed"]
    assert set(failed) == set(CONNECTOR), failed
    assert all("'vllm" in why for why in failed.values()), failed
