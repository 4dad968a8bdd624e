"""``kvpushd journal report``: the HTML page, checked in a real headless browser.

The page is written from real demo journals (with a restart planted in the
prefill one, so the anomaly tables and markers have something to show) and
loaded by Debian's chromium with ``--dump-dom``. The page's script sets
``<html data-status>`` to ``ok`` at the end of its ``try`` (``error`` and a
visible ``#errors`` otherwise), and leaves counts of what it drew in data
attributes; both are compared with ``journal replay --json``. On a failure
a screenshot is kept next to the page in the test's tmp dir.

CI installs chromium (``apt-get install -y chromium``); where it is missing
the test installs it, and skips only when that is impossible.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from html.parser import HTMLParser
from pathlib import Path

import pytest

from daemon.postmortem import chart
from daemon.postmortem import html as report
from daemon.postmortem.analyse import analyse
from daemon.postmortem.formatting import key_text
from daemon.postmortem.load import load
from daemon.postmortem.merge import merge
from schemas.events import FORMAT_VERSION, DaemonStarted, Failed, Record
from schemas.reasons import Reason
from statemachine.registry import fold
from tests.support.journals import read_records as _records
from tests.support.journals import write_records as _write

REPO = Path(__file__).resolve().parents[1]
UTC = {**os.environ, "TZ": "UTC"}
APT_LINE = "apt-get update && apt-get install -y chromium"


# ---------------------------------------------------------------- the browser


def _find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser"):
        found = shutil.which(name)
        if found:
            return found
    return None


def _install_chromium() -> str:
    """Debian's chromium, installed if missing; the reason it cannot be, otherwise."""
    if shutil.which("apt-get") is None:
        return "no apt-get on this machine"
    if os.geteuid() != 0:
        return "not root, cannot apt-get install"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for command in (["apt-get", "update"], ["apt-get", "install", "-y", "chromium"]):
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=900, env=env)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"{' '.join(command)}: {exc}"
        if done.returncode != 0:
            return f"{' '.join(command)} failed: {done.stderr.strip()[-500:]}"
    return ""


@pytest.fixture(scope="session")
def chromium() -> str:
    found = _find_chromium()
    if found is None:
        why = _install_chromium()
        found = _find_chromium()
        if found is None:
            pytest.skip(f"chromium cannot be installed ({why}); CI runs: {APT_LINE}")
    return found


def _browser_args(chromium: str, profile: Path) -> list[str]:
    return [
        chromium, "--headless", "--no-sandbox", "--disable-gpu",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        "--no-first-run", f"--user-data-dir={profile}",
    ]  # fmt: skip


def dump_dom(chromium: str, page: Path, tmp: Path) -> str:
    done = subprocess.run(
        [*_browser_args(chromium, tmp / "profile-dom"), "--dump-dom", page.as_uri()],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def screenshot(chromium: str, page: Path, tmp: Path) -> Path:
    png = page.with_suffix(".png")
    subprocess.run(
        [*_browser_args(chromium, tmp / "profile-shot"), "--window-size=1400,2400",
         f"--screenshot={png}", page.as_uri()],
        capture_output=True, timeout=120, check=False,
    )  # fmt: skip
    return png


@contextmanager
def screenshot_on_failure(chromium: str, page: Path, tmp: Path) -> Iterator[None]:
    try:
        yield
    except AssertionError as exc:
        png = screenshot(chromium, page, tmp)
        raise AssertionError(f"{exc}\n(screenshot of the page: {png})") from exc


# ---------------------------------------------------------------- the DOM


class _Dom(HTMLParser):
    """What the tests read back: attributes by id, ids, links, element counts."""

    def __init__(self) -> None:
        super().__init__()
        self.by_id: dict[str, dict[str, str | None]] = {}
        self.ids: set[str] = set()
        self.links: list[str] = []
        self.html: dict[str, str | None] = {}
        self.text_of: dict[str, str] = {}
        self._capture: list[str] = []
        self.rows: dict[str, list[list[str]]] = {}
        self._table: str | None = None
        self._row: list[str] | None = None
        self._cell: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = dict(attrs)
        if tag == "html":
            self.html = found
        if found.get("id"):
            self.by_id[str(found["id"])] = found
            self.ids.add(str(found["id"]))
            if tag in ("p", "div"):
                self._capture.append(str(found["id"]))
                self.text_of[str(found["id"])] = ""
        if tag == "a" and (found.get("href") or "").startswith("#"):
            self.links.append(str(found["href"])[1:])
        if tag == "table":
            self._table = (found.get("class") or "").strip()
            self.rows.setdefault(self._table, [])
        elif tag == "tr" and self._table is not None:
            self._row = []
        elif tag == "td" and self._row is not None:
            self._cell = []

    def handle_endtag(self, tag: str) -> None:
        if tag in ("p", "div") and self._capture:
            self._capture.pop()
        if tag == "td" and self._cell is not None and self._row is not None:
            self._row.append("".join(self._cell).strip())
            self._cell = None
        elif tag == "tr" and self._row is not None and self._table is not None:
            if self._row:
                self.rows[self._table].append(self._row)
            self._row = None
        elif tag == "table":
            self._table = None

    def handle_data(self, data: str) -> None:
        if self._capture:
            self.text_of[self._capture[-1]] += data
        if self._cell is not None:
            self._cell.append(data)


def parse(dom: str) -> _Dom:
    parser = _Dom()
    parser.feed(dom)
    return parser


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def journals(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A real demo run, with a restart of the prefill daemon planted halfway."""
    base = tmp_path_factory.mktemp("report")
    done = subprocess.run(
        [sys.executable, "-m", "daemon.cli", "demo", "--requests", "60", "--keep",
         "--workdir", str(base / "w")],
        cwd=REPO, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    records = _records(base / "w" / "prefill-journal")
    # Plant the restart at the middle record nearest to the halfway mark that
    # has requests in flight (how many are, there, depends on the run's timing).
    middle = len(records) // 2
    for cut in sorted(
        range(len(records) // 4, 3 * len(records) // 4), key=lambda i: abs(i - middle)
    ):
        live = fold((r.event, r.ts) for r in records[:cut])
        caught = sorted(
            r.request_id
            for r in live.live.values()
            if r.state.value in ("registered", "trimmed", "writing")
        )
        if caught:
            break
    head = records[:cut]
    seq, ts = head[-1].seq, head[-1].ts
    tail = [Record(FORMAT_VERSION, "prefill", seq + 1, ts + 1, DaemonStarted(7, "0.1.0", "b2"))]
    tail += [
        Record(FORMAT_VERSION, "prefill", seq + 2 + n, ts + 1.001,
               Failed(rid, 1, Reason.DAEMON_RESTART, "daemon restarted"))
        for n, rid in enumerate(caught)
    ]  # fmt: skip
    return {
        "prefill": _write(base / "prefill-journal", head + tail),
        "decode": base / "w" / "decode-journal",
    }


def _kvpushd(*args: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "daemon.cli", *map(str, args)],
        cwd=REPO, capture_output=True, text=True, timeout=120, env=UTC,
    )  # fmt: skip


@pytest.fixture(scope="module")
def expected(journals: dict[str, Path]) -> dict:
    done = _kvpushd("journal", "replay", journals["prefill"], journals["decode"], "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def page(journals: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("page") / "report.html"
    done = _kvpushd("journal", "report", journals["prefill"], journals["decode"], "-o", out)
    assert done.returncode == 0, done.stderr
    return out


# ---------------------------------------------------------------- tests


def test_page_is_self_contained(page):
    text = page.read_text()
    assert "<link" not in text and "@import" not in text and "url(" not in text
    for attr, value in re.findall(r'\b(src|href)="([^"]*)"', text):
        assert value.startswith("#"), (attr, value)
    assert not re.search(r"(?<![\w.])(https?:)?//[\w-]+\.[\w.-]+/", text.replace(
        "http://www.w3.org/2000/svg", ""))  # fmt: skip


def test_page_loads_and_draws_what_the_journals_hold(chromium, page, expected, tmp_path):
    dom = parse(dump_dom(chromium, page, tmp_path))
    with screenshot_on_failure(chromium, page, tmp_path):
        assert dom.html.get("data-status") == "ok", dom.text_of.get("errors")
        assert "hidden" in dom.by_id["errors"] and not dom.text_of["errors"].strip()
        # The summary table, as journal replay counts it.
        rows = {label: int(n) for label, n in dom.rows["final-states"]}
        assert rows == expected["by_final_state"]
        # What the script drew: a bar per request per node, every refusal, the restart.
        chart = dom.by_id["timeline-chart"]
        sides = sum(len(r["sides"]) for r in expected["requests"])
        refusals = sum(r["count"] for r in expected["refusals"])
        restarts = [r for r in expected["restarts"] if r["restart"]]
        assert int(chart["data-bars"] or 0) == sides
        assert int(chart["data-refusals"] or 0) == refusals
        assert int(chart["data-restarts"] or 0) == len(restarts) == 1
        total = expected["requests_total"]
        assert dom.text_of["chart-caption"].startswith(f"{total} of {total} requests drawn")
        histograms = dom.by_id["histograms"]
        assert int(histograms["data-histograms"] or 0) == len(expected["latency"]) > 5


def test_anomaly_tables_link_to_timelines(chromium, page, expected, tmp_path):
    dom = parse(dump_dom(chromium, page, tmp_path))
    with screenshot_on_failure(chromium, page, tmp_path):
        assert dom.links, "the anomaly tables link to request timelines"
        missing = [link for link in dom.links if link not in dom.ids]
        assert not missing, missing
        (restart,) = [r for r in expected["restarts"] if r["restart"]]
        failed = [tuple(k) for k, _ in restart["failed"]]
        assert failed, "the planted restart failed requests in flight"
        for rid, inc in failed:
            assert chart.anchor((rid, inc)) in dom.ids
            assert chart.anchor((rid, inc)) in dom.links
        assert len(dom.rows["restarts"]) == 1
        assert len(dom.rows["never-released"]) == len(expected["never_released"])
        assert len(dom.rows["refusals"]) == len(expected["refusals"])
        for stuck in expected["never_released"]:
            assert chart.anchor((stuck["request_id"], stuck["incarnation"])) in dom.links


def test_script_failure_is_shown(chromium, page, tmp_path):
    """A broken page says so, visibly: the ok status above is not vacuous."""
    broken = tmp_path / "broken.html"
    text = page.read_text()
    start = text.index('<script id="report-data" type="application/json">')
    broken.write_text(text[:start] + '<script id="report-data" type="application/json">{"nodes":'
                      + text[text.index("</script>", start):])  # fmt: skip
    dom = parse(dump_dom(chromium, broken, tmp_path))
    assert dom.html.get("data-status") == "error"
    assert "hidden" not in dom.by_id["errors"]
    assert "the report script failed" in dom.text_of["errors"]


def test_render_limits_and_escaping(journals):
    analysis = analyse(merge(load([journals["prefill"], journals["decode"]])))
    small = report.render(analysis, max_timelines=3)
    assert small.count('<section class="timeline"') == 3
    assert f"3 of {len(analysis.selected)} requests written out" in small
    # Anomalies come first among the timelines written out.
    first = analysis.never_released[0].key
    assert f'id="{chart.anchor(first)}"' in small
    assert chart.anchor(("a b<c>", 2)) == "req-a_20_b_3c_c_3e_-2"
    block = report._data_block({"x": "</script><script>alert(1)</script>"})
    assert "</script><script>" not in block.removesuffix("</script>")


def test_chart_samples_many_requests_anomalies_first(journals, monkeypatch):
    monkeypatch.setattr(chart, "MAX_BARS", 8)
    analysis = analyse(merge(load([journals["prefill"], journals["decode"]])))
    anomalous = chart.anomalous_requests(analysis)
    assert len(anomalous) >= 3
    data = chart.chart_data(analysis, set(), anomalous[:3])
    drawn = {bar[4] for bar in data["bars"]}
    assert data["sampled"] and len(drawn) == 8
    assert {key_text(analysis.merged.keys[r]) for r in anomalous[:3]} <= drawn
