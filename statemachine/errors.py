"""Typed refusals raised by the core.

Every refusal carries a stable :class:`schemas.reasons.Reason` code (what an
engine or an operator matches on) and a human message (what they read).
"""

from __future__ import annotations

from schemas.events import Refused
from schemas.reasons import Reason


class Refusal(Exception):
    """The core refused an input; nothing changed."""

    def __init__(self, reason: Reason, message: str) -> None:
        super().__init__(f"{reason.value}: {message}")
        self.reason = reason
        self.message = message

    def journaled(self, request_id: str, incarnation: int, engine_id: str) -> Refused:
        """The record that journals this refusal of a message about ``request_id``."""
        return Refused(request_id, incarnation, engine_id, self.reason, self.message)


class TrimRefused(Refusal):
    """The two sides' block lists cannot be paired safely."""


class IllegalTransition(Refusal):
    """An event the transition table does not allow in the record's state."""

    def __init__(self, message: str) -> None:
        super().__init__(Reason.ILLEGAL_TRANSITION, message)
