"""The pure core of kvpushd: request lifecycle, refusal rules, prefix-cache trim.

No I/O, no clocks, no asyncio/nixl/torch: time enters only as values carried
by events, so the same code serves the live daemon and journal replay.
"""

from schemas.layout import GroupKind, Role
from schemas.reasons import Reason
from schemas.state import Deadlines, RequestRecord, State
from statemachine.errors import IllegalTransition, Refusal, TrimRefused
from statemachine.registry import Registry, fold
from statemachine.transitions import TRANSITIONS, apply, is_quarantined
from statemachine.trim import apply_prefix_caching, to_kernel_blocks

__all__ = [
    "TRANSITIONS",
    "Deadlines",
    "GroupKind",
    "IllegalTransition",
    "Reason",
    "Refusal",
    "Registry",
    "RequestRecord",
    "Role",
    "State",
    "TrimRefused",
    "apply",
    "apply_prefix_caching",
    "fold",
    "is_quarantined",
    "to_kernel_blocks",
]
