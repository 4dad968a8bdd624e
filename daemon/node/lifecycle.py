"""Where the node is in its life: serving, stopping, or failed (the journal could not be written).

The runtime owns it and is its only writer (:meth:`Lifecycle.stop`,
:meth:`Lifecycle.fail`); the parts that must know read it. A value, not
callables handed down from the runtime: no request's path runs code of
the runtime (ARCHITECTURE.md, "One request, both legs, hop by hop"); the
request's own path reads only the plain ``stopping`` field.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Lifecycle:
    stopping: bool = False  # SIGTERM: new registrations are refused, writes drain
    fatal: BaseException | None = None  # the journal failure that ends the node

    @property
    def failed(self) -> bool:
        """Nothing more is journaled; every engine call is refused."""
        return self.fatal is not None

    @property
    def closing(self) -> bool:
        """The data plane is closed or closing (its close unmapped every window)."""
        return self.failed or self.stopping

    def stop(self) -> None:
        self.stopping = True

    def fail(self, exc: BaseException) -> None:
        self.fatal = exc
