"""Request records for table tests of the core: one request "r"#1 of engine "e", peer "peer"."""

from __future__ import annotations

from typing import Any

from schemas.layout import Role
from schemas.state import RequestRecord, State


def record(role: Role, state: State = State.DONE, **flags: Any) -> RequestRecord:
    """A live record in ``state`` with ``flags`` (kv_ready, settled, release_pending...) set."""
    return RequestRecord("r", 1, role, "e", "peer", state, ((4, 5),), 0.0, 10.0, **flags)
