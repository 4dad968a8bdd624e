"""The postmortem's vocabulary: request keys, and event kinds, states and roles as small ints.

Every later stage stores these codes in numpy columns (one byte per record)
instead of enums or strings; the tables here turn them back into names.
"""

from __future__ import annotations

import typing
from typing import Final

import numpy as np
import numpy.typing as npt

from schemas.events import (
    DaemonStarted,
    Event,
    Failed,
    IntegrityMismatch,
    KvMismatch,
    PeerRegistered,
    Refused,
    Registered,
    WriteDone,
    WriteStarted,
)
from schemas.state import State
from statemachine.transitions import TRANSITIONS

RequestKey = tuple[str, int]
FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]


# Event kinds as small ints (the columns store one byte per record), taken
# from the journal's event union so a kind added there is never a KeyError
# here; kinds that name no request (engine and daemon events) come first.
KINDS: Final[tuple[type[Event], ...]] = tuple(
    sorted(typing.get_args(Event), key=lambda kind: "request_id" in kind.__struct_fields__)
)
KIND_NAMES: Final[tuple[str, ...]] = tuple(str(k.__struct_config__.tag) for k in KINDS)
KIND_CODE: Final[dict[type[Event], int]] = {kind: code for code, kind in enumerate(KINDS)}
K_DAEMON_STARTED: Final = KIND_CODE[DaemonStarted]
K_REGISTERED: Final = KIND_CODE[Registered]
K_PEER_REGISTERED: Final = KIND_CODE[PeerRegistered]
K_WRITE_STARTED: Final = KIND_CODE[WriteStarted]
K_WRITE_DONE: Final = KIND_CODE[WriteDone]
K_FAILED: Final = KIND_CODE[Failed]
K_REFUSED: Final = KIND_CODE[Refused]
K_INTEGRITY_MISMATCH: Final = KIND_CODE[IntegrityMismatch]
K_KV_MISMATCH: Final = KIND_CODE[KvMismatch]
FIRST_REQUEST_KIND: Final = sum("request_id" not in k.__struct_fields__ for k in KINDS)

# States, ordered from least to most advanced: "the least advanced side"
# of a request is the one holding it up. ``pending`` is a pusher that heard
# of the request from its peer before its own engine registered it;
# ``refused`` is a side that only ever refused the request (never live).
STATES: Final = ("pending", "registered", "trimmed", "writing", "done", "failed", "released")
S_PENDING, S_REGISTERED, _, _, S_DONE, S_FAILED, S_RELEASED = range(7)
S_REFUSED: Final = 7
S_NONE: Final = -1  # the record changed no request state (a refusal, an engine event)
STATE_LABELS: Final = (*STATES, "refused")
STATE_CODE: Final[dict[State, int]] = {State(name): code for code, name in enumerate(STATES[1:], 1)}

ROLE_PUSHER, ROLE_RECEIVER = 1, 2  # 0: unknown (the node only refused the request)
ROLE_NAMES: Final = ("?", "pusher", "receiver")


def _state_after_kind() -> npt.NDArray[np.int8]:
    """The state a request is in after each kind of record (``S_NONE``: unchanged).

    Read off the core's transition table, so the two cannot drift apart: each
    kind leads to one state wherever the table lets it change the state. A
    peer registration parked as pending is the one exception, told apart by
    the fold (the core returns no record for it).
    """
    after = [S_NONE] * len(KINDS)
    after[K_REGISTERED] = S_REGISTERED
    for (_role, state), row in TRANSITIONS.items():
        for kind, following in row.items():
            if following is state:
                continue
            code = STATE_CODE[following]
            if after[KIND_CODE[kind]] not in (S_NONE, code):
                raise AssertionError(f"{kind.__name__} leads to more than one state")
            after[KIND_CODE[kind]] = code
    return np.array(after, np.int8)


KIND_STATE: Final = _state_after_kind()


class PostmortemError(Exception):
    """The inputs cannot be analysed (missing, unreadable, ambiguous)."""
