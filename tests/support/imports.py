"""Static import scanning: what a source file imports, and the repository's import graph.

Used by tests/test_purity.py (the core's own files) and tests/test_layout.py
(the wings, transitively). Nothing is imported or executed: sources are
parsed with :mod:`ast`. Every import statement counts, wherever it stands
(inside functions, under ``if TYPE_CHECKING:``): a lazy or type-only import
is still a dependency.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

DYNAMIC: Final = "<dynamic import>"
# The repository's own top-level names; every other root is the standard
# library or a third-party distribution.
FIRST_PARTY: Final = ("daemon", "schemas", "statemachine", "harness", "tests", "bench", "tools")


def is_under(name: str, roots: Iterable[str]) -> bool:
    """``name`` is one of ``roots`` or inside one of them (``a.b`` is under ``a``)."""
    return any(name == root or name.startswith(root + ".") for root in roots)


def is_stdlib(name: str) -> bool:
    return name.split(".")[0] in sys.stdlib_module_names


def statements(tree: ast.AST) -> list[tuple[int, str, int, tuple[str, ...]]]:
    """(line, module, relative level, imported names) of every import; dynamic ones too.

    ``import a.b`` gives ``(line, "a.b", 0, ())``; ``from .x import y``
    gives ``(line, "x", 1, ("y",))``; ``__import__(...)`` and
    ``importlib.import_module(...)`` give ``(line, DYNAMIC, 0, ())``.
    """
    found: list[tuple[int, str, int, tuple[str, ...]]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name, 0, ()) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            names = tuple(alias.name for alias in node.names)
            found.append((node.lineno, node.module or "", node.level, names))
        elif isinstance(node, ast.Call) and (
            (isinstance(node.func, ast.Name) and node.func.id == "__import__")
            or (isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
        ):
            found.append((node.lineno, DYNAMIC, 0, ()))
    return sorted(found)


@dataclass(frozen=True)
class Edge:
    """``source`` imports ``target`` at ``line``."""

    source: str
    target: str
    line: int


class ImportGraph:
    """The import graph of a set of modules, by module name.

    Edges point to modules (``from a import b`` points to ``a.b`` when that
    is a module of the graph, else to ``a``) and, for a module inside
    packages, to each package above it too: importing ``a.b.c`` runs
    ``a/__init__.py`` and ``a/b/__init__.py`` first.
    """

    def __init__(self, sources: Mapping[str, tuple[str, bool]]) -> None:
        """``sources``: module name -> (source text, whether it is a package's __init__)."""
        self.modules = set(sources)
        self.edges: dict[str, list[Edge]] = {}
        for name, (text, is_package) in sources.items():
            tree = ast.parse(text, filename=name)
            self.edges[name] = [
                Edge(name, target, line)
                for line, module, level, names in statements(tree)
                for target in self._targets(name, is_package, module, level, names)
            ]

    @classmethod
    def of_tree(cls, root: Path, tops: Iterable[str] = FIRST_PARTY) -> ImportGraph:
        """Every ``.py`` file under the top-level folders ``tops`` of ``root``."""
        sources: dict[str, tuple[str, bool]] = {}
        for top in tops:
            for path in sorted((root / top).rglob("*.py")):
                parts = path.relative_to(root).with_suffix("").parts
                is_package = parts[-1] == "__init__"
                name = ".".join(parts[:-1] if is_package else parts)
                sources[name] = (path.read_text(), is_package)
        return cls(sources)

    def _targets(
        self, name: str, is_package: bool, module: str, level: int, names: tuple[str, ...]
    ) -> list[str]:
        if module == DYNAMIC:
            return [DYNAMIC]
        if level:
            package = name.split(".") if is_package else name.split(".")[:-1]
            base = package[: len(package) - (level - 1)]
            module = ".".join([*base, module] if module else base)
        targets = [module]
        targets += [f"{module}.{n}" for n in names if f"{module}.{n}" in self.modules]
        parts = module.split(".")
        targets += [".".join(parts[:k]) for k in range(1, len(parts))]
        return sorted(set(targets))

    def imports(self, name: str) -> list[Edge]:
        return self.edges.get(name, [])

    def reach(self, start: str, through: Iterable[str] = ()) -> dict[str, list[Edge]]:
        """Every name ``start`` imports, directly or through modules of the graph.

        Maps each reached name (a module of the graph, a third-party or
        standard module, or DYNAMIC) to the chain of imports that first
        reached it. Names outside the graph, and those in ``through``
        (reached, but their imports are not followed), are not followed.
        """
        stop = set(through)
        chains: dict[str, list[Edge]] = {start: []}
        queue = [start]
        while queue:
            current = queue.pop(0)
            for edge in self.imports(current):
                if edge.target in chains or edge.target == "__future__":
                    continue
                chains[edge.target] = [*chains[current], edge]
                if edge.target in self.modules and edge.target not in stop:
                    queue.append(edge.target)
        del chains[start]
        return chains


def chain_text(chain: list[Edge]) -> str:
    """``a:12 -> b:3 -> c``: who imported what, with the line of each import."""
    return " -> ".join(f"{e.source}:{e.line}" for e in chain) + f" -> {chain[-1].target}"
