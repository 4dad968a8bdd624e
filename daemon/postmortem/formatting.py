"""How the postmortem writes times, request keys and durations (text and HTML alike)."""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Iterable

from daemon.postmortem.vocab import RequestKey


def format_time(ts: float, *, date: bool = False) -> str:
    """Local wall-clock time with microseconds, as operators read logs."""
    if not math.isfinite(ts):
        return "-"
    moment = dt.datetime.fromtimestamp(ts).astimezone()
    return moment.strftime("%Y-%m-%d %H:%M:%S.%f" if date else "%H:%M:%S.%f")


def zone_label(ts: float) -> str:
    """The zone :func:`format_time` shows ``ts`` in: ``UTC``, or ``CET (UTC+01:00)``.

    The text reports, the HTML header and the HTML chart (which shifts its
    clock by the same offset) all name it through here, so they agree.
    """
    moment = dt.datetime.fromtimestamp(ts if math.isfinite(ts) else 0.0).astimezone()
    offset = moment.utcoffset() or dt.timedelta(0)
    if not offset:
        return "UTC"
    minutes = int(offset.total_seconds()) // 60
    sign = "+" if minutes >= 0 else "-"
    hours, mins = divmod(abs(minutes), 60)
    return f"{moment.strftime('%Z')} (UTC{sign}{hours:02d}:{mins:02d})"


def first_record_ts(node_first: Iterable[float]) -> float:
    """The earliest record of any node: the instant a report reads its zone at."""
    return min((float(t) for t in node_first), default=0.0)


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


def blocks_text(blocks: tuple[tuple[int, int, int], ...], count: int, shown: int = 8) -> str:
    """(group, layer, block) triples as ``g/l/b``, the first ``shown``, then how many more."""
    text = " ".join(f"{g}/{layer}/{b}" for g, layer, b in blocks[:shown])
    rest = count - min(shown, len(blocks))
    return text + (f" (+{rest} more)" if rest > 0 else "")
