"""A decode request's load: one daemon receiver per prefill rank that feeds it, ended all at once.

A load ends when every share has landed, or, once one failed, when every
share is settled: arrived, or released by the daemon (no write can reach
the blocks any more). Then, and only then, vLLM gets the blocks back.
Owned by vLLM's thread (the worker side). Pure: no vLLM, no torch, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from daemon.client.vllm.layout import Blocks


@dataclass
class Load:
    """A decode request's load the worker waits for (vLLM's thread)."""

    request_id: str
    blocks: Blocks  # per group, for host staging's copy
    nbytes: int  # the KV it loads, for the stats
    generation: int  # the daemon connection it was posted under
    posted_at: float  # time.monotonic(), for its time in the stats
    shares: tuple[str, ...]
    pending: set[str] = field(default_factory=set)  # no outcome yet
    holding: set[str] = field(default_factory=set)  # a write may still reach the blocks
    failed: bool = False

    def __post_init__(self) -> None:
        self.pending = set(self.shares)
        self.holding = set(self.shares)

    def landed(self, share: str) -> None:
        """The share's KV arrived: its write is over."""
        self.pending.discard(share)
        self.holding.discard(share)

    def share_failed(self, share: str) -> tuple[str, ...]:
        """The share failed, its blocks still held; returns the shares to give up too."""
        self.pending.discard(share)
        return self.fail()

    def share_ended(self, share: str) -> tuple[str, ...]:
        """The share ended without its KV and nothing holds its blocks (given up, or freed)."""
        self.pending.discard(share)
        self.holding.discard(share)
        return self.fail()

    def fail(self) -> tuple[str, ...]:
        """All or nothing: on the first failure, the shares still pending are given up.

        Their writes may still come: the daemon cancels them or quarantines
        the blocks, and the release that follows frees them.
        """
        if self.failed:
            return ()
        self.failed = True
        return tuple(self.pending)

    @property
    def settled(self) -> bool:
        """Every share has an outcome and no write can reach the blocks."""
        return not self.pending and not self.holding
