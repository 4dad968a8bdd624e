"""structlog set-up: JSON lines to stderr (journald), a console view on a terminal.

For ``kvpushd run`` (``node`` given) every line names the node, Python's
stdlib logging (the data plane's loggers, warnings) is rendered the same
way, and what native code prints (NIXL, UCX) is captured into JSON lines by
:mod:`daemon.nativelog`, so journald gets one JSON object per line and
nothing else.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import MutableMapping
from typing import Any, TextIO

import structlog

_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}


def configure(
    level: str = "info",
    *,
    force_json: bool = False,
    node: str | None = None,
    capture_native: bool = False,
) -> None:
    if level not in _LEVELS:
        raise ValueError(f"log level must be one of {', '.join(_LEVELS)}, got {level!r}")
    as_json = force_json or not sys.stderr.isatty()
    out: TextIO = sys.stderr
    if as_json and capture_native and node is not None:
        from daemon.nativelog import capture

        out = capture(node, level)
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer() if as_json else structlog.dev.ConsoleRenderer()
    )
    processors: list[structlog.typing.Processor] = [structlog.contextvars.merge_contextvars]
    if node is not None:
        processors.append(_NodeFirst(node))
    processors += [
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.format_exc_info,
        renderer,
    ]
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        logger_factory=structlog.PrintLoggerFactory(file=out),
        cache_logger_on_first_use=True,
    )
    if node is not None:
        _route_stdlib(_LEVELS[level])


class _NodeFirst:
    """Put ``node`` first on every line, so no line (``stopped``, ``draining``) lacks it."""

    def __init__(self, node: str) -> None:
        self.node = node

    def __call__(
        self, logger: Any, method: str, event_dict: MutableMapping[str, Any]
    ) -> MutableMapping[str, Any]:
        return {"node": event_dict.pop("node", self.node), **event_dict}


class _ToStructlog(logging.Handler):
    """A stdlib record as one structlog line (its traceback inside the line)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            log = structlog.get_logger(record.name)
            fields: dict[str, Any] = {"logger": record.name}
            if record.exc_info:
                fields["exc_info"] = record.exc_info
            method = record.levelname.lower()
            if method not in ("debug", "info", "warning", "error", "critical"):
                method = "warning" if record.levelno < logging.ERROR else "error"
            getattr(log, method)(record.getMessage(), **fields)
        except Exception:
            self.handleError(record)


def _route_stdlib(level: int) -> None:
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    root.addHandler(_ToStructlog())
    root.setLevel(level)
    logging.captureWarnings(True)
