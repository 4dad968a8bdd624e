"""What a registration's blocks hold, and the check that pairs a receiver's with a pusher's.

The trim (statemachine/trim.py) says WHICH blocks move; it rests on the two
block lists describing the same positions of the same tokens. The content a
registration names is the proof: each side names, per KV cache group, the
content hash of every block it registers (vLLM's own prefix-cache block hash,
chained from the first block, over the block's tokens and extra keys, with a
seed both sides share). At the pairing, every decode block must meet a
prefill block of equal hash at the position the tail trim pairs it with, or
the request is refused before a byte moves, naming the first block that
differs.

The wire form is one string (``content`` of a registration, journaled as it
came):

- ``""``: not named; a side that names nothing is not checked;
- ``"bh1:" + group + "/" + group ...``: block hashes, one field per KV cache
  group in the engine's group order; a field is ``POSITION.HEX`` (the prompt
  block index of the first block named, then each block's hash, 16 hex
  digits apiece, in the registration's block order), ``POSITION.`` for a
  group that names no block, or ``-`` for a group whose blocks carry no
  token hash (never checked);
- a state group (Mamba/SSM: one block, the state after every token it
  took) is a block-hash field like any other: the last prompt block its
  state took and that block's chain hash, which covers every token before
  it, so two states pair only if they took the same tokens. Connectors
  before issue 47 named a state ``-``: still read, and left unchecked (the
  form did not change, so no version: a daemon of either age reads both);
- anything else: a name (a prompt digest) the two sides must name alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from schemas.reasons import Reason
from statemachine.errors import Refusal, TrimRefused

TAG: Final = "bh1:"
# Hex digits of one block's hash (8 bytes: two different blocks of one
# position agree by chance with odds of 2**-64).
HASH_HEX: Final = 16
# A registration names at most this many characters of content: block hashes
# for 64k blocks in one group, well under a frame.
MAX_CONTENT: Final = 1 << 20
UNHASHED: Final = "-"


@dataclass(frozen=True, slots=True)
class GroupHashes:
    """One KV cache group's named blocks: the prompt block of the first, and each one's hash."""

    first: int
    hashes: tuple[str, ...]


# None: a group whose blocks carry no token hash (``-``: a state, from older connectors).
BlockHashes = tuple[GroupHashes | None, ...]


def encode(groups: BlockHashes) -> str:
    """The wire form of per-group block hashes (each hash HASH_HEX hex digits)."""
    return TAG + "/".join(
        UNHASHED if g is None else f"{g.first}.{''.join(g.hashes)}" for g in groups
    )


def decode(request_id: str, content: str) -> BlockHashes | None:
    """Block hashes named in ``content``, or None when it names none (or a digest).

    Raises :class:`Refusal` for a content that is too long or a block-hash
    form that does not parse: a registration that says it proves its blocks
    and cannot is refused, not taken as unproven.
    """
    if len(content) > MAX_CONTENT:
        raise Refusal(
            Reason.BLOCK_OUT_OF_RANGE,
            f"request {request_id}: content names {len(content)} characters, "
            f"over the {MAX_CONTENT} allowed",
        )
    if not content.startswith(TAG):
        return None
    groups: list[GroupHashes | None] = []
    for field in content[len(TAG) :].split("/"):
        if field == UNHASHED:
            groups.append(None)
            continue
        first, dot, digits = field.partition(".")
        if (
            not dot
            or not first.isdigit()
            or len(digits) % HASH_HEX
            or digits.strip("0123456789abcdef")
        ):
            raise Refusal(
                Reason.BLOCK_OUT_OF_RANGE,
                f"request {request_id}: a block-hash field of its content does not parse "
                f"({field[:40]!r})",
            )
        hashes = tuple(digits[i : i + HASH_HEX] for i in range(0, len(digits), HASH_HEX))
        groups.append(GroupHashes(int(first), hashes))
    return tuple(groups)


def check_counts(request_id: str, content: str, block_counts: tuple[int, ...]) -> None:
    """Refuse a registration whose block hashes do not name exactly its blocks.

    ``block_counts``: the logical blocks the registration lists, per group.
    """
    groups = decode(request_id, content)
    if groups is None:
        return
    if len(groups) != len(block_counts):
        raise Refusal(
            Reason.GROUP_COUNT_MISMATCH,
            f"request {request_id}: its content hashes {len(groups)} groups, it lists "
            f"{len(block_counts)}",
        )
    for index, (group, count) in enumerate(zip(groups, block_counts, strict=True)):
        if group is not None and len(group.hashes) != count:
            raise Refusal(
                Reason.BLOCK_COUNT_MISMATCH,
                f"request {request_id}: group {index} lists {count} blocks and hashes "
                f"{len(group.hashes)}",
            )


def check_pairing(request_id: str, prefill: str, decode_side: str) -> None:
    """Raise TrimRefused(CONTENT_MISMATCH) unless the decode's blocks hold what the prefill's do.

    Block hashes: each decode block is paired, as the tail trim pairs it,
    with one of the prefill's last blocks; their hashes must be equal, and
    so must the prompt positions both sides say they hold. A digest: both
    sides must name the same. A side that names nothing is not checked (an
    engine that does not hash), nor is a group either side leaves unhashed.
    """
    if not prefill or not decode_side:
        return
    theirs = decode(request_id, prefill)
    ours = decode(request_id, decode_side)
    if theirs is None or ours is None:
        if prefill != decode_side:
            raise TrimRefused(
                Reason.CONTENT_MISMATCH,
                f"the prefill engine's blocks hold {_short(prefill)!r}, the decode engine's "
                f"are for {_short(decode_side)!r}; nothing is written (the decode side must "
                f"compute this prompt)",
            )
        return
    if len(theirs) != len(ours):
        raise TrimRefused(
            Reason.CONTENT_MISMATCH,
            f"the prefill engine hashes {len(theirs)} KV cache groups, the decode engine "
            f"{len(ours)}; nothing is written",
        )
    for index, (p, d) in enumerate(zip(theirs, ours, strict=True)):
        if p is None or d is None:
            continue
        problem = first_unpaired(p, d)
        if problem is not None:
            raise TrimRefused(
                Reason.CONTENT_MISMATCH, f"group {index}: {problem}; nothing is written"
            )


def first_unpaired(prefill: GroupHashes, decode_side: GroupHashes) -> str | None:
    """Why the tail trim's pairing of one group's blocks is wrong, or None.

    The first decode block (in prompt order) whose paired prefill block
    holds another hash, or sits at another prompt position, is named with
    where the prefill holds that hash, if anywhere.
    """
    d, p = decode_side.hashes, prefill.hashes
    offset = len(p) - len(d)
    for i, wanted in enumerate(d):
        position = decode_side.first + i
        if offset + i < 0:
            return (
                f"the decode's block for prompt block {position} (hash {wanted}) has no "
                f"prefill block to pair with: the prefill names prompt blocks "
                f"{prefill.first} to {prefill.first + len(p) - 1}"
            )
        held = p[offset + i]
        paired_at = prefill.first + offset + i
        if held == wanted and position == paired_at:
            continue
        where = (
            f"the prefill holds that hash at prompt block {prefill.first + p.index(wanted)}"
            if wanted in p
            else "the prefill holds no block with that hash"
        )
        return (
            f"the decode's block for prompt block {position} (hash {wanted}) would receive the "
            f"prefill's prompt block {paired_at} (hash {held}): {where}"
        )
    return None


def _short(content: str) -> str:
    return content if len(content) <= 80 else content[:77] + "..."
