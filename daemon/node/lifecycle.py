"""Where the node is in its life: serving, stopping, or failed (the journal could not be written).

The runtime owns it and is its only writer (:meth:`Lifecycle.stop`,
:meth:`Lifecycle.fail`); the parts that must know read its plain fields.
A field, not a callable handed down from the runtime: reading it is no
hand-over, so no request's path runs code of the runtime
(ARCHITECTURE.md, "One request, both legs, hop by hop").
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Lifecycle:
    stopping: bool = False  # SIGTERM: new registrations are refused, writes drain
    fatal: BaseException | None = None  # the journal failure that ends the node
    failed: bool = False  # fatal is set: nothing more is journaled, every call is refused
    closing: bool = False  # stopping or failed: the data plane is closed or closing

    def stop(self) -> None:
        self.stopping = True
        self.closing = True

    def fail(self, exc: BaseException) -> None:
        self.fatal = exc
        self.failed = True
        self.closing = True
