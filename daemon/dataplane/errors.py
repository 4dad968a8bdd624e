"""The data plane's public errors, shared by every module of it.

They are part of :mod:`daemon.dataplane.plane`'s API (import them from
there); they live here because the geometry checks and the worker raise them
too, and plane.py imports both.
"""

from __future__ import annotations

__all__ = ["DataPlaneError", "TransferError"]


class DataPlaneError(Exception):
    """A data-plane request was refused or NIXL failed; ``code`` is stable."""

    def __init__(self, message: str, *, code: str = "dataplane") -> None:
        super().__init__(message)
        self.code = code


class TransferError(DataPlaneError):
    """A posted WRITE did not complete.

    Codes: ``xfer_err`` (NIXL reported ERR), ``peer_disconnected`` (the
    remote agent's process is gone), ``nixl`` (another NIXL failure while
    posting), ``fenced`` (its remote agent was removed), ``removed`` (its
    local or remote engine was removed), ``closed`` (the data plane closed).
    In every case the transfer handle is released (aborted) before the error
    is raised, so nothing of it lands afterwards; bytes may already have
    landed (with cma the copy completes inside ``transfer()``), so the
    destination blocks hold undefined content.
    """
