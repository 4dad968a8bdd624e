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
