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

The install is also checked for what it holds: exactly the checkout's
modules of daemon/, statemachine/ and schemas/ (nothing missing, nothing
extra), none of the test-only modules that live in harness/ (the tiny
checkpoints, the vLLM server harness, router and demo, the engine process),
and no text holding the launcher's old fixed test secret or the checkout's
absolute path. Each check is a small pure function, shown to fail on a
planted violation.
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
TOPS = ("daemon", "statemachine", "schemas")
# Modules tests, benches, tools and the Makefile use, `kvpushd` never: they
# live in harness/ and no module of these names may ship.
TEST_ONLY = (
    "engine_process",
    "tinydeepseek",
    "tinyllama",
    "tinynemotron",
    "vllm_demo",
    "vllm_router",
    "vllm_servers",
)
# The fixed secret daemon/sim/launcher.py once wrote for every daemon.
OLD_TEST_SECRET = b"test-secret-0123456789abcdef"
# The connector's parts that import vLLM (its pure parts, and the package
# itself, import without it: the package exports the connector lazily).
CONNECTOR = tuple(
    f"daemon.client.vllm.{part}"
    for part in (
        "connector",
        "guard",
        "identity",
        "metadata",
        "scheduler",
        "stats",
        "worker",
        "tier.connector",
        "tier.copier",
        "tier.jobs",
        "tier.manager",
        "tier.spec",
    )
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


def modules_under(root: Path) -> set[str]:
    """The dotted names of every ``.py`` module under ``root`` (``a/b/c.py`` -> ``a.b.c``).

    Bytecode caches and an install's metadata (``*.dist-info``, ``bin/``) are
    not modules.
    """
    found = set()
    for path in root.rglob("*.py"):
        parts = path.relative_to(root).with_suffix("").parts
        if "__pycache__" in parts or parts[0].endswith(".dist-info") or parts[0] == "bin":
            continue
        found.add(".".join(parts))
    return found


def package_modules(checkout: Path) -> set[str]:
    """The checkout's modules of the installed package (daemon/, statemachine/, schemas/)."""
    return {module for module in modules_under(checkout) if module.split(".")[0] in TOPS}


def install_problems(installed: set[str], checkout: set[str]) -> list[str]:
    """What is wrong with an install's modules, given the package's modules in the checkout."""
    problems = [f"missing from the install: {m}" for m in sorted(checkout - installed)]
    problems += [f"installed, not in the package: {m}" for m in sorted(installed - checkout)]
    for module in sorted(installed | checkout):
        if module.split(".")[-1] in TEST_ONLY:
            problems.append(f"test-only, belongs in harness/: {module}")
        if module.split(".")[0] in NOT_INSTALLED:
            problems.append(f"from a folder that is never installed: {module}")
    return problems


def text_leaks(root: Path, needles: dict[str, bytes]) -> list[str]:
    """``path: what`` for each file under ``root`` (bytecode aside) holding a needle."""
    found = []
    for path in sorted(root.rglob("*")):
        if not path.is_file() or "__pycache__" in path.parts or path.suffix == ".pyc":
            continue
        data = path.read_bytes()
        found += [f"{path.relative_to(root)}: {what}" for what, n in needles.items() if n in data]
    return found


def _needles() -> dict[str, bytes]:
    """What no installed file may hold: the old test secret and where the checkout lies."""
    return {"the old test secret": OLD_TEST_SECRET, "the checkout's path": str(REPO).encode()}


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
    # Exactly the package's modules: nothing missing, nothing extra, no test-only one.
    assert install_problems(modules_under(target), package_modules(REPO)) == []
    # No installed file of the package holds a fixed secret or the checkout's
    # path (bin/kvpushd's first line names this interpreter, in the checkout's
    # .venv: pip's doing, not the package's).
    assert [leak for top in TOPS for leak in text_leaks(target / top, _needles())] == []
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


def test_the_package_holds_none_of_the_test_only_modules() -> None:
    checkout = package_modules(REPO)
    assert {"daemon.cli", "daemon.sim.demo", "daemon.sim.launcher"} <= checkout
    assert install_problems(checkout, checkout) == []
    for name in TEST_ONLY:
        assert (REPO / "harness" / f"{name}.py").is_file(), name


def _tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_a_missing_extra_or_test_only_module_is_reported(tmp_path: Path) -> None:
    package = {"daemon/__init__.py": "", "daemon/sim/__init__.py": "", "daemon/sim/demo.py": ""}
    checkout = package_modules(_tree(tmp_path / "checkout", {**package, "harness/x.py": ""}))
    assert checkout == {"daemon.__init__", "daemon.sim.__init__", "daemon.sim.demo"}
    # An install of exactly that: nothing to say.
    fine = modules_under(_tree(tmp_path / "fine", {**package, "kvpushd-0.1.dist-info/x.py": ""}))
    assert install_problems(fine, checkout) == []
    # A test-only module planted in the install (a stale build, say) and a module lost.
    planted = {**package, "daemon/sim/tinyllama.py": "", "harness/fuzzing.py": ""}
    del planted["daemon/sim/demo.py"]
    installed = modules_under(_tree(tmp_path / "planted", planted))
    assert install_problems(installed, checkout) == [
        "missing from the install: daemon.sim.demo",
        "installed, not in the package: daemon.sim.tinyllama",
        "installed, not in the package: harness.fuzzing",
        "test-only, belongs in harness/: daemon.sim.tinyllama",
        "from a folder that is never installed: harness.fuzzing",
    ]
    # Moved back into the checkout's package too: shipped, and still reported.
    both = checkout | {"daemon.sim.vllm_servers"}
    assert install_problems(both, both) == [
        "test-only, belongs in harness/: daemon.sim.vllm_servers"
    ]


def test_a_secret_or_the_checkout_path_in_an_installed_file_is_reported(tmp_path: Path) -> None:
    site = _tree(
        tmp_path,
        {
            "daemon/sim/launcher.py": f"SECRET = {OLD_TEST_SECRET!r}\n",
            "daemon/paths.py": f"ROOT = {str(REPO)!r}\n",
            "daemon/clean.py": "SECRET = None\n",
            "daemon/__pycache__/paths.cpython-311.pyc": str(REPO),  # bytecode: not read
        },
    )
    assert text_leaks(site, _needles()) == [
        "daemon/paths.py: the checkout's path",
        "daemon/sim/launcher.py: the old test secret",
    ]


def test_the_launcher_makes_a_secret_per_daemon_and_shares_one_within_a_pair(
    tmp_path: Path,
) -> None:
    from daemon.sim.launcher import Daemon, daemon_pair

    lone = [Daemon(f"n{i}", tmp_path / f"w{i}", 1) for i in range(2)]
    assert lone[0].secret != lone[1].secret and len(lone[0].secret) >= 32
    assert Daemon("given", tmp_path, 1, secret=b"s" * 32).secret == b"s" * 32
    prefill, decode = daemon_pair(tmp_path / "pair")
    assert prefill.secret == decode.secret
    (tmp_path / "pair").mkdir()
    for daemon in (decode, prefill):
        daemon.write_config()
    assert prefill.secret_path == decode.secret_path
    assert prefill.secret_path.read_bytes() == prefill.secret + b"\n"
    assert prefill.secret_path.stat().st_mode & 0o777 == 0o600
    assert OLD_TEST_SECRET not in prefill.secret_path.read_bytes()
