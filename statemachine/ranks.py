"""How one transfer's tensor-parallel shares are named: one daemon request per rank.

A vLLM instance with TP ranks is one engine per rank, each holding its own
KV heads; the prefill and decode ranks of the same index hold the same heads
when both instances have the same TP size (the fingerprint guarantees it).
Rank ``r``'s share of transfer ``T`` is the daemon request ``T@tp<r>``, so
the two sides' shares pair by name, every invariant holds per share, and a
postmortem asked about ``T`` finds every share (:func:`transfer_of`). With
one rank the share is ``T`` itself.
"""

from __future__ import annotations

import re
from typing import Final

SEPARATOR: Final = "@tp"
# What share_id makes: the transfer, the separator, a rank without leading zeros.
_SHARE = re.compile(rf"^(?P<transfer>.+){re.escape(SEPARATOR)}(?:0|[1-9][0-9]*)$")


def share_id(transfer_id: str, rank: int, tp_size: int) -> str:
    """The daemon request id of TP rank ``rank``'s share of ``transfer_id``."""
    return transfer_id if tp_size == 1 else f"{transfer_id}{SEPARATOR}{rank}"


def transfer_of(request_id: str) -> str:
    """The transfer a daemon request is a share of (the id itself if it is no share)."""
    match = _SHARE.match(request_id)
    return match.group("transfer") if match else request_id
