"""What an engine's KV cache looks like to the core: groups, kinds, ratios."""

from __future__ import annotations

import enum

import msgspec

from schemas.fingerprint import Fingerprint


class Role(enum.StrEnum):
    """Which side of a transfer a node plays for one request."""

    PUSHER = "pusher"  # prefill side: owns the source blocks, posts the WRITE
    RECEIVER = "receiver"  # decode side: owns the destination blocks


class GroupKind(enum.StrEnum):
    """KV-cache group kind; decides how a group is expanded and trimmed."""

    ATTENTION = "attention"
    SSM = "ssm"


class GroupLayout(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """One KV-cache group of an engine.

    ``num_blocks`` counts kernel (physical) blocks: the unit the memory is
    laid out in and the unit block ids refer to after expansion.
    ``per_logical`` is how many kernel blocks one logical block of the
    engine's scheduler spans (1 for most models).
    ``overlays``: the index of an earlier group whose memory this group's
    blocks are (vLLM's hybrid allocator lays its groups over one pool, a
    block id owned by one group at a time), so a block id has one owner
    across both; -1: memory of its own. Omitted when -1, so layouts of
    separate groups encode as they did before.
    """

    kind: GroupKind
    num_blocks: int
    per_logical: int = 1
    overlays: int = -1

    def pool(self, index: int) -> int:
        """The group whose block ids name this group's (``index``: this group's own)."""
        return index if self.overlays < 0 else self.overlays


class EngineLayout(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """The groups of one engine, in group order, and the size of its offload pool.

    ``offload_slots`` is how many offload slots the engine's pool has (0: no
    pool); the core hands them out (``Registry.check_register``). Omitted
    when 0, so layouts without a pool encode as they did before pools were
    the core's. ``fingerprint`` is what the prefill daemon compares before
    it pairs a push (statemachine/fingerprint.py).
    """

    engine_id: str
    groups: tuple[GroupLayout, ...]
    offload_slots: int = 0
    # What produced the engine's KV (schemas/fingerprint.py); omitted when
    # the engine declares none, so such layouts encode as they did before.
    fingerprint: Fingerprint | None = None
