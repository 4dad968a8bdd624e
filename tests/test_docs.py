"""The docs point at things that exist: relative links, and the unit's Documentation=."""

from __future__ import annotations

import re
from pathlib import Path

from tests.support import REPO

DOCS = [*REPO.glob("*.md"), *(REPO / "docs").glob("*.md"), *(REPO / "bench").glob("*.md")]


def test_relative_links_in_the_docs_resolve():
    broken = []
    for doc in DOCS:
        for match in re.finditer(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
            target = match[1]
            if re.match(r"[a-z]+:", target):
                continue  # a URL
            if not (doc.parent / target).exists():
                broken.append(f"{doc.relative_to(REPO)}: {target}")
    assert broken == []


def test_unit_documentation_is_installed_by_the_readme():
    unit = (REPO / "systemd" / "kvpushd.service").read_text()
    (urls,) = re.findall(r"^Documentation=(.*)$", unit, flags=re.M)
    readme = (REPO / "README.md").read_text()
    operations = readme[readme.index("\n## Operations\n") :]
    (install,) = re.findall(r"^install -D -m 0644 -t (\S+) (.*?)(?:\s+#.*)?$", operations, re.M)
    for url in urls.split():
        if not url.startswith("file://"):
            assert re.match(r"(https?|man|info):", url), url
            continue
        path = Path(url.removeprefix("file://"))
        # A file the README's install steps put there, from this repository.
        assert str(path.parent) == install[0], url
        assert path.name in install[1].split(), url
        assert (REPO / path.name).exists(), url


# ---------------------------------------------- the tables and recipes pinned to the code


def _section(text: str, heading: str) -> str:
    """A markdown section's text, from its heading to the next heading of its level or above."""
    level = heading.split(" ")[0]
    start = text.index(heading + "\n")
    rest = text[start + len(heading) + 1 :]
    stop = re.search(rf"^#{{1,{len(level)}}} ", rest, re.M)
    return rest[: stop.start()] if stop else rest


def _first_column_names(section: str) -> set[str]:
    """Every `name` in the first cell of the section's table rows (a cell may list several)."""
    names: set[str] = set()
    for line in section.splitlines():
        if line.startswith("| `"):
            names.update(re.findall(r"`([^`]+)`", line.split("|")[1]))
    return names


def _config_keys() -> set[str]:
    """Every key of schemas/config.py's Config, its tables' keys as ``table.key``."""
    import msgspec

    from schemas.config import Config

    keys: set[str] = set()
    for field in msgspec.structs.fields(Config):
        default = field.default
        if isinstance(default, msgspec.Struct):
            keys.update(f"{field.name}.{f.name}" for f in msgspec.structs.fields(default))
        else:
            keys.add(field.name)
    return keys


def test_the_readmes_config_table_names_every_config_key() -> None:
    table = _first_column_names(_section((REPO / "README.md").read_text(), "## Configuration"))
    named = set(table)
    # A row may name a table's later keys without the prefix (`journal.segment_mb`,
    # `snapshot_every`) or all of a table's keys at once (`deadlines.*`).
    for name in table:
        prefix = name.split(".")[0] + "." if "." in name else ""
        named.update(f"{prefix}{other}" for other in table if "." not in other and prefix)
    missing = {
        key for key in _config_keys() if key not in named and f"{key.split('.')[0]}.*" not in named
    }
    assert not missing, f"README.md's config table lacks {sorted(missing)}"


def test_the_readmes_troubleshooting_table_names_every_reason() -> None:
    from schemas.reasons import Reason

    section = _section((REPO / "README.md").read_text(), "## Troubleshooting by reason code")
    missing = {r.value for r in Reason} - _first_column_names(section)
    assert not missing, f"README.md's troubleshooting table lacks {sorted(missing)}"


def test_each_how_to_add_recipe_names_files_that_exist() -> None:
    text = (REPO / "ARCHITECTURE.md").read_text()
    recipes = [h for h in re.findall(r"^## How to add .*$", text, re.M)]
    assert recipes
    for heading in recipes:
        paths = re.findall(
            r"`((?:schemas|statemachine|daemon|tests)/[\w/.]+\.py)`", _section(text, heading)
        )
        assert paths, heading
        for path in paths:
            assert (REPO / path).is_file(), f"{heading}: {path} does not exist"


def test_the_node_parts_table_names_every_part_the_runtime_builds() -> None:
    section = _section((REPO / "ARCHITECTURE.md").read_text(), "## The node's parts")
    named = set(re.findall(r"`(\w+)\.py`", section))
    for name in named:
        assert (REPO / "daemon" / "node" / f"{name}.py").is_file(), name
    runtime = (REPO / "daemon" / "node" / "runtime.py").read_text()
    built = set(re.findall(r"^from daemon\.node\.(\w+) import", runtime, re.M))
    # The peer links are the service's, handed over by attach_peers; the
    # engine server's Handler is a type: neither is a part the runtime builds.
    assert built - {"peerlink", "engine_server"} <= named, sorted(built - named)
