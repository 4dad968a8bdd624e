"""How the postmortem writes times, request keys and durations (text and HTML alike)."""

from __future__ import annotations

import datetime as dt
import math

from daemon.postmortem.vocab import RequestKey


def format_time(ts: float, *, date: bool = False) -> str:
    """Local wall-clock time with microseconds, as operators read logs."""
    if not math.isfinite(ts):
        return "-"
    moment = dt.datetime.fromtimestamp(ts).astimezone()
    return moment.strftime("%Y-%m-%d %H:%M:%S.%f" if date else "%H:%M:%S.%f")


def key_text(key: RequestKey | None) -> str:
    return "-" if key is None else f"{key[0]}#{key[1]}"


def seconds(value: float) -> str:
    return f"{value:.3f}" if math.isfinite(value) else "-"


def ms(seconds: float | None) -> str:
    return "-" if seconds is None or not math.isfinite(seconds) else f"{seconds * 1e3:.3f}"


def signed_ms(seconds: float) -> str:
    return f"{seconds * 1e3:+.3f} ms"


def abs_ms(seconds: float) -> str:
    return f"{abs(seconds) * 1e3:.3f} ms"
