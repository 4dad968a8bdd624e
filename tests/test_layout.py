"""The wings stay apart: who may import what, checked statically and transitively.

ARCHITECTURE.md draws the package in wings (node, journal, dataplane, client,
postmortem, ops, sim) around the pure core. These rules pin the edges that
keep it so. Each is checked on the import graph of the repository's own
sources (tests/support/imports.py: parsed, never executed; lazy and
type-only imports count), following imports through the package's own
modules, so a forbidden module reached two hops away is caught like a direct
import, and each violation names the chain that reaches it.

The core's purity (statemachine/ imports no I/O, clock or shell module)
is pinned in one place, tests/test_purity.py, with the same scanner.

Every rule is also shown to fail: fed a small synthetic tree that breaks it
through a middle module, it reports exactly the chains that reach the
offending import; with the offending module emptied, it reports nothing.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from tests.support import REPO
from tests.support.imports import DYNAMIC, ImportGraph, chain_text, is_stdlib, is_under

PACKAGE = ("daemon", "schemas", "statemachine")
# The package vLLM loads as KvpushdConnector: the only modules that import vllm.
CONNECTOR = ("daemon.client.vllm",)
# Its pure parts: the rank and slice map, a load's end, the router
# parameters, the specs, the config reading, the offload tier's slot
# geometry and namespace. Unit-tested without vLLM.
CONNECTOR_PURE = tuple(
    f"daemon.client.vllm.{part}"
    for part in ("shares", "loads", "params", "specs", "layout", "tier.geometry")
)
# The most lines a module of the connector may have: each owns one thing.
CONNECTOR_MODULE_LINES = 500


@dataclass(frozen=True)
class Rule:
    """Modules matching ``sources`` may reach only names that ``allowed`` accepts.

    ``through``: modules reached but not followed (their imports are not the
    source's).
    """

    name: str
    says: str
    sources: Callable[[str], bool]
    allowed: Callable[[str], bool]
    through: tuple[str, ...] = ()


def _client_may_use(name: str) -> bool:
    return (
        name in ("daemon", "daemon.framing")
        or is_under(name, ("daemon.client", "schemas", "msgspec"))
        or (name != DYNAMIC and is_stdlib(name))
        # The one exception: the blocking client runs its loop on uvloop when
        # it is installed (an ImportError falls back to asyncio's), as the
        # daemon does; an event loop is not the runtime, NIXL or torch.
        or name == "uvloop"
    )


RULES = (
    Rule(
        "schemas",
        "schemas/ imports only msgspec and the standard library",
        lambda m: is_under(m, ("schemas",)),
        lambda n: is_under(n, ("schemas", "msgspec")) or (n != DYNAMIC and is_stdlib(n)),
    ),
    Rule(
        "journal",
        "daemon/journal/ reaches no other part of the package than schemas, statemachine"
        " and daemon.failpoints",
        lambda m: is_under(m, ("daemon.journal",)),
        lambda n: (
            not is_under(n, PACKAGE)
            or n in ("daemon", "daemon.failpoints")
            or is_under(n, ("daemon.journal", "schemas", "statemachine"))
        ),
    ),
    Rule(
        "client",
        "daemon/client/ imports only schemas, daemon.framing, msgspec and the standard library"
        " (and uvloop if installed)",
        lambda m: is_under(m, ("daemon.client",)) and not is_under(m, CONNECTOR),
        _client_may_use,
    ),
    Rule(
        "vllm-connector",
        "daemon/client/vllm/ (loaded inside vLLM) imports what the client may, plus vllm,"
        " torch, the pure core (the fingerprint rule, the rank map), the failpoints (the"
        " negative control's planted mis-mapping), numpy and crc32c (the offload tier's"
        " copies and digests): never the runtime, the data plane or nixl",
        lambda m: is_under(m, CONNECTOR),
        lambda n: (
            _client_may_use(n)
            or n == "daemon.failpoints"
            or is_under(n, ("vllm", "torch", "statemachine", "numpy", "crc32c"))
        ),
    ),
    Rule(
        "connector-pure",
        "the connector's pure parts (shares, loads, params, specs, layout) reach neither"
        " vllm, torch, nixl, an event loop nor a thread. Importing them runs the packages'"
        " __init__s, which are not followed: daemon/client/'s exports the clients, and"
        " daemon/client/vllm/'s the connector, on first use only",
        lambda m: m in CONNECTOR_PURE,
        lambda n: (
            not (
                is_under(n, ("vllm", "torch", "nixl", "asyncio", "threading", "uvloop"))
                or n == DYNAMIC
            )
        ),
        through=("daemon.client", *CONNECTOR),
    ),
    Rule(
        "postmortem-ops",
        "daemon/postmortem/ and daemon/ops/ reach neither the runtime, the data plane,"
        " the simulator, nixl nor torch",
        lambda m: is_under(m, ("daemon.postmortem", "daemon.ops")),
        lambda n: (
            not is_under(n, ("daemon.node", "daemon.dataplane", "daemon.sim", "nixl", "torch"))
        ),
    ),
    Rule(
        "node-parts",
        "no part of daemon/node/ holds the Node: only the runtime imports daemon.node.runtime"
        " (type-only imports count); each part is given what it uses",
        lambda m: is_under(m, ("daemon.node",)) and m != "daemon.node.runtime",
        lambda n: n != "daemon.node.runtime",
    ),
    Rule(
        "sim-leaf",
        "nothing in the package reaches daemon.sim but daemon/sim itself and daemon/cli.py"
        " (the demo command, the one thing daemon/sim is shipped for)",
        lambda m: is_under(m, PACKAGE) and not is_under(m, ("daemon.sim", "daemon.cli")),
        lambda n: not is_under(n, ("daemon.sim",)),
    ),
    Rule(
        "vllm-apart",
        "nothing in the package imports vllm but the connector vLLM loads (daemon/client/vllm/);"
        " tests_vllm/ and harness/vllm_servers.py run vLLM as a process",
        lambda m: is_under(m, PACKAGE) and not is_under(m, CONNECTOR),
        lambda n: not is_under(n, ("vllm",)),
    ),
    Rule(
        "package-alone",
        "the package imports neither the harness, tests, bench nor tools (none is installed):"
        " never the test-only modules of harness/ (the tiny checkpoints, the vLLM servers,"
        " router and demo, the engine process), which the wheel does not ship",
        lambda m: is_under(m, PACKAGE),
        lambda n: not is_under(n, ("harness", "tests", "bench", "tools")),
    ),
    Rule(
        "bench-tools",
        "harness/, bench/ and tools/ never import tests",
        lambda m: is_under(m, ("harness", "bench", "tools")),
        lambda n: not is_under(n, ("tests",)),
    ),
    Rule(
        "tests-apart",
        "no module under tests/ imports a test module: what tests share is in tests/support",
        lambda m: is_under(m, ("tests",)),
        lambda n: not (n.startswith("tests.test_") or n == "tests.conftest"),
    ),
)


def violations(graph: ImportGraph, rule: Rule) -> list[str]:
    found = []
    for module in sorted(m for m in graph.modules if rule.sources(m)):
        for name, chain in graph.reach(module, through=rule.through).items():
            if not rule.allowed(name):
                found.append(chain_text(chain))
    return sorted(found)


@pytest.fixture(scope="module")
def graph() -> ImportGraph:
    return ImportGraph.of_tree(REPO)


@pytest.mark.parametrize("rule", RULES, ids=[r.name for r in RULES])
def test_rule_holds(graph: ImportGraph, rule: Rule) -> None:
    assert violations(graph, rule) == [], rule.says


@pytest.mark.parametrize("rule", RULES, ids=[r.name for r in RULES])
def test_rule_applies_to_real_modules(graph: ImportGraph, rule: Rule) -> None:
    """A rule whose sources matched nothing would hold vacuously."""
    assert any(rule.sources(m) for m in graph.modules), rule.says


def test_the_graph_holds_every_wing(graph: ImportGraph) -> None:
    for wing in ("client", "node", "journal", "dataplane", "postmortem", "ops", "sim"):
        assert f"daemon.{wing}" in graph.modules, wing
    assert {
        "tests.support",
        "tests.test_layout",
        "bench.daemon_bench",
        "tools.soak",
        "harness.crashrounds",
    } <= graph.modules


def sim_modules_kvpushd_never_reaches(graph: ImportGraph) -> list[str]:
    """Modules of daemon/sim that ``kvpushd`` (daemon/cli.py, the demo) never reaches.

    daemon/sim ships in the wheel for ``kvpushd demo`` alone; a module only
    tests, benches or tools import is test code in the wheel, and belongs in
    harness/ (not installed).
    """
    reached = graph.reach("daemon.cli")
    return sorted(m for m in graph.modules if is_under(m, ("daemon.sim",)) and m not in reached)


def test_daemon_sim_holds_only_what_kvpushd_runs(graph: ImportGraph) -> None:
    assert {"daemon.sim.demo", "daemon.sim.launcher", "daemon.sim.engine"} <= graph.modules
    assert sim_modules_kvpushd_never_reaches(graph) == []


def test_a_test_only_module_in_daemon_sim_is_reported() -> None:
    tree = _package(
        {
            "daemon.cli": "def demo():\n    from daemon.sim import demo\n",
            "daemon.sim.__init__": "",
            "daemon.sim.demo": "from daemon.sim.engine import SimEngine\n",
            "daemon.sim.engine": "",
            # Used by tests only (and using the package): shipped for nothing.
            "daemon.sim.tinyllama": "from daemon.sim.engine import SimEngine\n",
            "tests.test_vllm_harness": "from daemon.sim.tinyllama import write_tinyllama\n",
        }
    )
    assert sim_modules_kvpushd_never_reaches(tree) == ["daemon.sim.tinyllama"]


def node_cycles(graph: ImportGraph) -> list[str]:
    """Pairs of daemon/node/ modules that reach each other (type-only imports count)."""
    parts = sorted(m for m in graph.modules if is_under(m, ("daemon.node",)) and m != "daemon.node")
    found = []
    for module in parts:
        for name in graph.reach(module):
            if name > module and name in parts and module in graph.reach(name):
                found.append(f"{module} <-> {name}")
    return found


def test_the_parts_of_the_node_form_no_import_cycle(graph: ImportGraph) -> None:
    # Each part is given the parts it uses; none reaches back to one that uses it.
    assert node_cycles(graph) == []


def test_a_node_cycle_is_reported() -> None:
    tree = _package(
        {
            "daemon.node.engines": "from daemon.node.windows import Windows\n",
            "daemon.node.windows": "if TYPE_CHECKING:\n    from daemon.node.engines import E\n",
        }
    )
    assert node_cycles(tree) == ["daemon.node.engines <-> daemon.node.windows"]


# ------------------------------------------------------- the rules can fail


def _package(files: dict[str, str]) -> ImportGraph:
    """A synthetic tree: module name -> source (names ending in __init__ are packages)."""
    sources = {}
    for name, text in files.items():
        is_package = name.endswith(".__init__")
        sources[name.removesuffix(".__init__")] = (text, is_package)
    return ImportGraph(sources)


# Rule name -> (a tree that breaks it, every violation it must report). A
# violation is reported from each source module that reaches it, for the
# module and for the packages above it (importing a.b runs a/__init__.py).
BROKEN: dict[str, tuple[dict[str, str], list[str]]] = {
    "schemas": (
        {
            "schemas.rpc": "from schemas.status import StatusDocument\n",
            "schemas.status": "import numpy as np\n",
        },
        ["schemas.rpc:1 -> schemas.status:1 -> numpy", "schemas.status:1 -> numpy"],
    ),
    "journal": (
        {
            "daemon.journal.replay": "from daemon import failpoints\nfrom . import stats\n",
            "daemon.journal.stats": "from daemon.node import metrics\n",
            "daemon.failpoints": "",
        },
        [
            # daemon.node.metrics is no module of this tree: the import names the package.
            "daemon.journal.replay:2 -> daemon.journal.stats:1 -> daemon.node",
            "daemon.journal.stats:1 -> daemon.node",
        ],
    ),
    "client": (
        {
            "daemon.client.__init__": "from daemon.client.engine_client import EngineClient\n",
            "daemon.client.engine_client": "import asyncio\nfrom daemon.framing import x\n",
            "daemon.framing": "import struct\nfrom . import config\n",
            "daemon.config": "import tomllib\n",
        },
        [
            "daemon.client.engine_client:2 -> daemon.framing:2 -> daemon.config",
            "daemon.client:1 -> daemon.client.engine_client:2 -> daemon.framing:2 -> daemon.config",
        ],
    ),
    "vllm-connector": (
        {
            "daemon.client.vllm.worker": "import torch\nimport vllm\nfrom daemon.node import x\n",
            "daemon.client.engine_client": "from daemon.framing import x\n",
        },
        ["daemon.client.vllm.worker:3 -> daemon.node"],
    ),
    "connector-pure": (
        {
            "daemon.client.vllm.__init__": "def __getattr__(n):\n    from . import connector\n",
            "daemon.client.vllm.connector": "import vllm\n",  # allowed: not followed
            "daemon.client.vllm.shares": "from daemon.client.vllm.specs import PushSpec\n",
            "daemon.client.vllm.specs": "import torch\n",
        },
        [
            "daemon.client.vllm.shares:1 -> daemon.client.vllm.specs:1 -> torch",
            "daemon.client.vllm.specs:1 -> torch",
        ],
    ),
    "postmortem-ops": (
        {
            "daemon.ops.status": "from daemon import config\n",
            "daemon.config": "\n\nimport torch\n",
        },
        ["daemon.ops.status:1 -> daemon.config:3 -> torch"],
    ),
    "node-parts": (
        {
            "daemon.node.peers": "from daemon.node.windows import Windows\n",
            "daemon.node.windows": (
                "from typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n"
                "    from daemon.node.runtime import Node\n"
            ),
            "daemon.node.runtime": "from daemon.node.peers import Peers\n",  # allowed
        },
        [
            "daemon.node.peers:1 -> daemon.node.windows:3 -> daemon.node.runtime",
            "daemon.node.windows:3 -> daemon.node.runtime",
        ],
    ),
    "sim-leaf": (
        {
            "daemon.node.runtime": "from daemon.journal import replay\n",
            "daemon.journal.replay": "def f():\n    from daemon.sim.engine import SimEngine\n",
            "daemon.cli": "from daemon.sim import demo\n",  # allowed: the demo command
        },
        [
            "daemon.journal.replay:2 -> daemon.sim",
            "daemon.journal.replay:2 -> daemon.sim.engine",
            "daemon.node.runtime:1 -> daemon.journal.replay:2 -> daemon.sim",
            "daemon.node.runtime:1 -> daemon.journal.replay:2 -> daemon.sim.engine",
        ],
    ),
    "vllm-apart": (
        {
            "daemon.sim.demo": "from daemon.sim import engine\n",
            "daemon.sim.engine": "import torch\nimport vllm.config\n",
            "daemon.client.vllm.link": "from vllm.distributed import kv_transfer\n",  # allowed
        },
        [
            "daemon.sim.demo:1 -> daemon.sim.engine:2 -> vllm",
            "daemon.sim.demo:1 -> daemon.sim.engine:2 -> vllm.config",
            "daemon.sim.engine:2 -> vllm",
            "daemon.sim.engine:2 -> vllm.config",
        ],
    ),
    "package-alone": (
        {
            # The demo importing back a module that moved out of the package.
            "daemon.cli": "from daemon.sim import demo\n",
            "daemon.sim.demo": (
                "import bench.results\nfrom harness.vllm_servers import kvpushd_pd\n"
            ),
            "statemachine.registry": "from schemas import events\n",  # allowed
        },
        [
            "daemon.cli:1 -> daemon.sim.demo:1 -> bench",
            "daemon.cli:1 -> daemon.sim.demo:1 -> bench.results",
            "daemon.cli:1 -> daemon.sim.demo:2 -> harness",
            "daemon.cli:1 -> daemon.sim.demo:2 -> harness.vllm_servers",
            "daemon.sim.demo:1 -> bench",
            "daemon.sim.demo:1 -> bench.results",
            "daemon.sim.demo:2 -> harness",
            "daemon.sim.demo:2 -> harness.vllm_servers",
        ],
    ),
    "bench-tools": (
        {
            "tools.soak": "from harness.crashrounds import run_rounds\n",
            "harness.crashrounds": "from tests.test_crash import Summary\n",
        },
        [
            "harness.crashrounds:1 -> tests",
            "harness.crashrounds:1 -> tests.test_crash",
            "tools.soak:1 -> harness.crashrounds:1 -> tests",
            "tools.soak:1 -> harness.crashrounds:1 -> tests.test_crash",
        ],
    ),
    "tests-apart": (
        {
            "tests.test_report": "from tests.support.journals import read_records\n",
            "tests.support.journals": "from tests.test_postmortem import _write\n",
            "tests.test_postmortem": "",
        },
        [
            "tests.support.journals:1 -> tests.test_postmortem",
            "tests.test_report:1 -> tests.support.journals:1 -> tests.test_postmortem",
        ],
    ),
}


@pytest.mark.parametrize("rule", RULES, ids=[r.name for r in RULES])
def test_rule_reports_a_synthetic_violation(rule: Rule) -> None:
    files, expected = BROKEN[rule.name]
    assert violations(_package(files), rule) == expected


@pytest.mark.parametrize("rule", RULES, ids=[r.name for r in RULES])
def test_rule_passes_the_synthetic_tree_once_the_violation_is_gone(rule: Rule) -> None:
    """The same tree with the offending module emptied: nothing left to report."""
    files, expected = BROKEN[rule.name]
    culprit = expected[0].split(" -> ")[-2].split(":")[0]
    fixed = {name: "" if name == culprit else text for name, text in files.items()}
    assert violations(_package(fixed), rule) == []


def test_every_rule_has_a_synthetic_violation() -> None:
    assert set(BROKEN) == {r.name for r in RULES}


def test_scanner_resolves_relative_submodule_parent_and_dynamic_imports() -> None:
    graph = _package(
        {
            "pkg.__init__": "",
            "pkg.sub.__init__": "from . import leaf\nfrom .. import other\n",
            "pkg.sub.leaf": "from .sibling import name\nimport importlib\n"
            "importlib.import_module('x')\n",
            "pkg.sub.sibling": "",
            "pkg.other": "def f():\n    import os.path\n",
        }
    )
    assert sorted({e.target for e in graph.imports("pkg.sub")}) == [
        "pkg",
        "pkg.other",
        "pkg.sub",
        "pkg.sub.leaf",
    ]
    assert sorted({e.target for e in graph.imports("pkg.sub.leaf")}) == [
        DYNAMIC,
        "importlib",
        "pkg",
        "pkg.sub",
        "pkg.sub.sibling",
    ]
    reached = graph.reach("pkg.sub")
    assert {"os.path", "os", DYNAMIC, "pkg.sub.sibling"} <= set(reached)
    assert chain_text(reached["os.path"]) == "pkg.sub:2 -> pkg.other:2 -> os.path"


# ------------------------------------------------ the connector's small parts


def connector_module_problems(sources: dict[str, str]) -> list[str]:
    """Modules of the connector over CONNECTOR_MODULE_LINES lines, or whose opening
    docstring does not say what they own."""
    found = []
    for name, text in sorted(sources.items()):
        lines = len(text.splitlines())
        if lines > CONNECTOR_MODULE_LINES:
            found.append(f"{name}: {lines} lines")
        if not (ast.get_docstring(ast.parse(text)) or "").strip():
            found.append(f"{name}: no docstring")
    return found


def test_the_connector_is_a_package_of_small_parts_that_say_what_they_own() -> None:
    folder = REPO / "daemon" / "client" / "vllm"
    sources = {path.name: path.read_text() for path in folder.glob("*.py")}
    assert {"connector.py", "scheduler.py", "worker.py", "link.py", "shares.py"} <= set(sources)
    assert connector_module_problems(sources) == []


def test_a_large_or_unexplained_connector_module_is_reported() -> None:
    planted = {
        "big.py": '"""Owns too much."""\n' + "x = 1\n" * CONNECTOR_MODULE_LINES,
        "bare.py": "x = 1\n",
        "fine.py": '"""Owns one thing."""\n',
    }
    assert connector_module_problems(planted) == [
        "bare.py: no docstring",
        f"big.py: {CONNECTOR_MODULE_LINES + 1} lines",
    ]


# ------------------------------------- the node's parts take no Node in disguise


def _members(cls: ast.ClassDef) -> set[str]:
    """What a class declares: its methods, annotated fields and ``self.x =`` attributes."""
    names = set()
    for statement in cls.body:
        if isinstance(statement, ast.FunctionDef | ast.AsyncFunctionDef):
            names.add(statement.name)
        elif isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
            names.add(statement.target.id)
    for node in ast.walk(cls):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name)
            and node.value.id == "self"
        ):
            names.add(node.attr)
    return names


def _is_protocol(cls: ast.ClassDef) -> bool:
    return any(
        (isinstance(base, ast.Name) and base.id == "Protocol")
        or (isinstance(base, ast.Attribute) and base.attr == "Protocol")
        for base in cls.bases
    )


def node_protocol_problems(runtime: str, sources: dict[str, str], parts: set[str]) -> list[str]:
    """Parts of the node that name a Protocol the Node implements (every member of the
    Protocol is one of the Node's): the Node handed over under another type's name."""
    classes = [c for c in ast.walk(ast.parse(runtime)) if isinstance(c, ast.ClassDef)]
    node_members = _members(next(c for c in classes if c.name == "Node"))
    disguises = {
        cls.name
        for text in sources.values()
        for cls in ast.walk(ast.parse(text))
        if isinstance(cls, ast.ClassDef) and _is_protocol(cls)
        if (members := _members(cls)) and members <= node_members
    }
    return [
        f"{name}: {protocol}"
        for name in sorted(parts)
        for protocol in sorted(disguises)
        # A word match, not a walk of the names: string annotations count too.
        if re.search(rf"\b{protocol}\b", sources[name])
    ]


def test_no_part_of_the_node_takes_a_protocol_the_node_implements() -> None:
    sources = {
        str(path.relative_to(REPO)): path.read_text() for path in (REPO / "daemon").rglob("*.py")
    }
    parts = {
        name
        for name in sources
        if name.startswith("daemon/node/") and name != "daemon/node/runtime.py"
    }
    assert len(parts) > 10
    runtime = sources["daemon/node/runtime.py"]
    assert node_protocol_problems(runtime, sources, parts) == []


def test_a_protocol_the_node_implements_is_reported() -> None:
    runtime = (
        "class Node:\n"
        "    def __init__(self):\n        self.status_doc = {}\n"
        "    def status(self): ...\n"
        "    def engine_disconnected(self, session): ...\n"
    )
    server = (
        "from typing import Protocol\n"
        "class EngineApi(Protocol):\n"
        "    def status(self): ...\n"
        "    def engine_disconnected(self, session): ...\n"
        "class Other(Protocol):\n"
        "    def status(self): ...\n"
        "    def handlers(self): ...\n"
        "class EngineServer:\n"
        "    def __init__(self, api: EngineApi, other: Other): ...\n"
    )
    quoted = "class Windows:\n    def __init__(self, api: 'EngineApi'): ...\n"
    sources = {"server.py": server, "windows.py": quoted, "fine.py": "x = 1\n"}
    parts = {"server.py", "windows.py", "fine.py"}
    assert node_protocol_problems(runtime, sources, parts) == [
        "server.py: EngineApi",
        "windows.py: EngineApi",
    ]
