"""The postmortem's inputs: journal directories and copied segment files, grouped by node."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import msgspec

from daemon.journal.format import HEADER_SIZE, SEGMENT_MAGIC, Invalid, NoJournal, parse_header
from daemon.journal.reader import first_payload, require_journal
from daemon.postmortem.vocab import PostmortemError
from schemas.events import Record, decode_record


@dataclass(frozen=True, slots=True)
class NodeSource:
    """One node's journal: a directory, or its segment files in sequence order."""

    node: str
    paths: tuple[Path, ...]

    @property
    def nbytes(self) -> int:
        return sum(_journal_bytes(p) for p in self.paths)


def _journal_bytes(path: Path) -> int:
    if path.is_dir():
        return sum(p.stat().st_size for p in path.glob("seg-*.kvj"))
    return path.stat().st_size


def _first_record(segment: Path) -> Record | None:
    """The first record of a segment file, read without validating the rest.

    Grouping inputs by node must not cost a full read: the full read (with
    CRCs and salvage) happens once, in the fold. None if the first frame is
    unreadable; the fold will say why.
    """
    try:
        payload = first_payload(segment)
        return None if payload is None else decode_record(payload)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        return None


def _peek(path: Path) -> tuple[str | None, int]:
    """(node name, first seq) of a journal directory or segment file."""
    try:
        require_journal(path)
    except NoJournal as exc:
        raise PostmortemError(str(exc)) from exc
    except OSError as exc:
        raise PostmortemError(f"{path}: {exc.strerror or exc}") from exc
    if path.is_dir():
        segments = sorted(path.glob("seg-*.kvj"))
        if not segments:
            raise PostmortemError(f"{path}: no journal segments (seg-*.kvj) here")
        path = segments[0]
    first = _first_record(path)
    return (None, 0) if first is None else (first.node, first.seq)


def group_sources(paths: Sequence[Path]) -> list[NodeSource]:
    """Group inputs by the node their records name, in the order first given.

    Segment files copied out of one node's directory are folded together, in
    sequence order, through one registry: a later segment's records need the
    state the earlier ones built.
    """
    groups: dict[str, list[tuple[int, Path]]] = {}
    empty: list[Path] = []
    for path in paths:
        node, first_seq = _peek(path)
        if node is None and path.is_file() and _header_only(path) is not None:
            empty.append(path)  # names no node: placed below, by its sequence number
            continue
        name = node if node is not None else f"?{path}"
        members = groups.setdefault(name, [])
        if (path.is_dir() and members) or any(p.is_dir() for _, p in members):
            raise PostmortemError(
                f"{members[0][1]} and {path} both hold node {name}'s journal: give a node's "
                f"directory alone, or only segment files copied out of it"
            )
        if any(p.resolve() == path.resolve() for _, p in members):
            continue
        members.append((first_seq, path))
    for path in empty:
        _place_empty(groups, path)
    return [
        NodeSource(name, tuple(p for _, p in sorted(members, key=lambda m: m[0])))
        for name, members in groups.items()
    ]


def _header_only(segment: Path) -> int | None:
    """The first seq of a segment that holds an intact header and nothing after
    it (one a writer had just started when it closed), else None."""
    try:
        if segment.stat().st_size != HEADER_SIZE:
            return None
        return parse_header(segment.read_bytes(), SEGMENT_MAGIC)[0]
    except (OSError, Invalid):
        return None


def _place_empty(groups: dict[str, list[tuple[int, Path]]], path: Path) -> None:
    """A header-only segment joins the node whose segments it follows (the group
    with the highest first seq below its own), else stands alone, as before."""
    seq = _header_only(path) or 0
    below = [
        (max(first for first, _ in members), name)
        for name, members in groups.items()
        if not any(p.is_dir() for _, p in members) and min(f for f, _ in members) < seq
    ]
    name = max(below)[1] if below else f"?{path}"
    groups.setdefault(name, []).append((seq, path))
