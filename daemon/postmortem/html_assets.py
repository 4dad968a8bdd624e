"""The HTML report's inline CSS and script.

The script draws the charts (requests over time, latency histograms) from
the JSON block of :func:`daemon.postmortem.chart.chart_data`, and sets
``<html data-status>`` to ``ok`` when it is done (``error``, with the error
in ``#errors``, otherwise).
"""

from __future__ import annotations

from typing import Final

CSS: Final = """
:root { --done: #2e8b57; --failed: #e08a1e; --refused: #8a8f98; --stuck: #c0392b;
        --ink: #1d2330; --muted: #5d6675; --line: #d8dde6; --bg: #ffffff; --band: #f4f6f9; }
* { box-sizing: border-box; }
body { font: 13px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; color: var(--ink);
       background: var(--bg); margin: 0 auto; padding: 16px 24px 64px; max-width: 1400px; }
h1 { font-size: 20px; margin: 0 0 4px; } h2 { font-size: 16px; margin: 28px 0 8px; }
h3 { font-size: 14px; margin: 16px 0 6px; }
.meta, .none { color: var(--muted); margin: 4px 0; }
table { border-collapse: collapse; margin: 4px 0 8px; }
th, td { text-align: left; padding: 2px 10px 2px 0; border-bottom: 1px solid var(--line);
         vertical-align: top; }
th { color: var(--muted); font-weight: 600; }
td { font-variant-numeric: tabular-nums; }
table.steps td:nth-child(8), table.rejected td:nth-child(5) { max-width: 560px; }
a { color: #1f5fbf; text-decoration: none; } a:hover { text-decoration: underline; }
ul.clocks { margin: 6px 0; padding-left: 18px; color: var(--muted); }
.errors { background: #fdecea; color: #7a1b12; border: 1px solid #f5c2bc; padding: 8px 12px;
          white-space: pre-wrap; font-family: ui-monospace, monospace; margin: 12px 0; }
.swatch { display: inline-block; width: 10px; height: 10px; border-radius: 2px;
          margin-right: 6px; vertical-align: -1px; }
.st-done { background: var(--done); fill: var(--done); }
.st-failed { background: var(--failed); fill: var(--failed); }
.st-refused { background: var(--refused); fill: var(--refused); }
.st-stuck { background: var(--stuck); fill: var(--stuck); }
.legend { display: flex; gap: 16px; flex-wrap: wrap; color: var(--muted); }
.legend-item { display: inline-flex; align-items: center; }
.mark-refusal { color: #b03a2e; margin-right: 4px; font-size: 10px; }
.mark-restart { color: #6a2c91; margin-right: 4px; font-weight: 700; }
.chart-box { overflow-x: auto; border: 1px solid var(--line); border-radius: 4px; }
svg text { font: 11px system-ui, sans-serif; fill: var(--muted); }
svg .lane { fill: var(--band); } svg .bar { cursor: pointer; }
svg .bar.linked:hover { stroke: var(--ink); stroke-width: 1; }
svg .refusal { fill: #b03a2e; } svg .restart { stroke: #6a2c91; stroke-dasharray: 4 3; }
svg .axis { stroke: var(--line); }
.histograms { display: flex; flex-wrap: wrap; gap: 12px; margin-bottom: 8px; }
.histogram { border: 1px solid var(--line); border-radius: 4px; padding: 4px 6px; }
.histogram .title { font-weight: 600; font-size: 12px; }
.histogram rect { fill: #4a78c2; }
section.anomaly h3 .count { color: var(--muted); font-weight: 400; }
section.timeline { border-top: 1px solid var(--line); padding-top: 4px; }
section.timeline:target { background: #fff8e1; }
a.top { font-weight: 400; font-size: 12px; margin-left: 8px; }
"""

SCRIPT: Final = r"""
(function () {
  "use strict";
  var root = document.documentElement;
  var errors = document.getElementById("errors");
  var NS = "http://www.w3.org/2000/svg";
  function fail(message) {
    errors.hidden = false;
    errors.textContent += message + "\n";
    root.setAttribute("data-status", "error");
  }
  window.addEventListener("error", function (e) { fail("script error: " + e.message); });

  function el(tag, attrs, parent, text) {
    var node = document.createElementNS(NS, tag);
    Object.keys(attrs || {}).forEach(function (k) { node.setAttribute(k, attrs[k]); });
    if (text !== undefined) { node.textContent = text; }
    if (parent) { parent.appendChild(node); }
    return node;
  }
  function pad(n, w) { var s = String(n); while (s.length < w) { s = "0" + s; } return s; }
  function clock(ts, offset, withMs) {
    var d = new Date((ts + offset) * 1000);  // shifted: read back as UTC = local time
    var text = pad(d.getUTCHours(), 2) + ":" + pad(d.getUTCMinutes(), 2) + ":" +
      pad(d.getUTCSeconds(), 2);
    return withMs ? text + "." + pad(d.getUTCMilliseconds(), 3) : text;
  }
  function niceStep(span, target) {
    var raw = span / target, mag = Math.pow(10, Math.floor(Math.log10(raw)));
    var steps = [1, 2, 5, 10];
    for (var i = 0; i < steps.length; i++) { if (steps[i] * mag >= raw) { return steps[i] * mag; } }
    return 10 * mag;
  }
  function ms(seconds) { return (seconds * 1e3).toFixed(3) + " ms"; }

  // Greedy interval packing: each bar takes the first row free at its start.
  function packRows(bars, maxRows) {
    var rowsEnd = [];
    bars.forEach(function (bar) {
      var row = -1;
      for (var i = 0; i < rowsEnd.length; i++) { if (rowsEnd[i] < bar.start) { row = i; break; } }
      if (row < 0) {
        if (rowsEnd.length < maxRows) { row = rowsEnd.length; rowsEnd.push(0); }
        else { row = bar.index % maxRows; }
      }
      rowsEnd[row] = Math.max(rowsEnd[row], bar.end);
      bar.row = row;
    });
    return Math.max(1, rowsEnd.length);
  }

  function drawTimeline(data) {
    var svg = document.getElementById("timeline-chart");
    var width = 1300, left = 110, right = 20, rowH = 5, laneGap = 18, top = 10;
    var span = Math.max(data.t1 - data.t0, 1e-3);
    var x = function (ts) { return left + (ts - data.t0) / span * (width - left - right); };
    var lanes = data.nodes.map(function () { return []; });
    data.bars.forEach(function (b, i) {
      lanes[b[0]].push({ index: i, start: b[1], end: Math.max(b[2], b[1]), css: b[3],
        label: b[4], state: b[5], anchor: b[6] });
    });
    var y = top, laneTops = [], drawn = 0;
    lanes.forEach(function (bars, n) {
      bars.sort(function (a, b) { return a.start - b.start; });
      var rows = packRows(bars, 60);
      var height = rows * rowH + 8;
      laneTops.push([y, height]);
      el("rect", { class: "lane", x: left, y: y, width: width - left - right, height: height },
        svg);
      el("text", { x: 6, y: y + Math.min(height, 24) / 2 + 4 }, svg, data.nodes[n]);
      bars.forEach(function (bar) {
        var x0 = x(bar.start), w = Math.max(1.5, x(bar.end) - x0);
        var rect = el("rect", { class: "bar " + bar.css + (bar.anchor ? " linked" : ""),
          x: x0, y: y + 4 + bar.row * rowH, width: w, height: rowH - 1,
          "data-request": bar.label }, svg);
        el("title", {}, rect, bar.label + " on " + data.nodes[n] + ": " + bar.state + ", " +
          clock(bar.start, data.utcOffset, true) + " .. " + clock(bar.end, data.utcOffset, true));
        if (bar.anchor) {
          rect.addEventListener("click", function () { location.hash = bar.anchor; });
        }
        drawn++;
      });
      y += height + laneGap;
    });
    data.refusals.forEach(function (r) {
      var lane = laneTops[r[0]], cx = x(r[1]);
      var tip = "M" + (cx - 4) + " " + (lane[0] - 6) + " h8 l-4 6 z";
      var mark = el("path", { class: "refusal", d: tip }, svg);
      el("title", {}, mark,
        "refused " + r[2] + ": " + r[3] + " at " + clock(r[1], data.utcOffset, true));
    });
    data.restarts.forEach(function (r) {
      var lane = laneTops[r[0]], rx = x(r[1]);
      var line = el("line", { class: "restart", x1: rx, x2: rx, y1: lane[0] - 6,
        y2: lane[0] + lane[1] + 4 }, svg);
      el("title", {}, line, r[2] + " at " + clock(r[1], data.utcOffset, true));
    });
    var axisY = y - laneGap + 6, step = niceStep(span, 8);
    el("line", { class: "axis", x1: left, x2: width - right, y1: axisY, y2: axisY }, svg);
    for (var t = Math.ceil(data.t0 / step) * step; t <= data.t1 + 1e-9; t += step) {
      el("line", { class: "axis", x1: x(t), x2: x(t), y1: axisY, y2: axisY + 4 }, svg);
      el("text", { x: x(t) - 24, y: axisY + 16 }, svg, clock(t, data.utcOffset, step < 1));
    }
    svg.setAttribute("viewBox", "0 0 " + width + " " + (axisY + 24));
    svg.setAttribute("width", width);
    svg.setAttribute("height", axisY + 24);
    svg.setAttribute("data-bars", String(drawn));
    svg.setAttribute("data-refusals", String(data.refusals.length));
    svg.setAttribute("data-restarts", String(data.restarts.length));
    var requests = {};
    data.bars.forEach(function (b) { requests[b[4]] = true; });
    document.getElementById("chart-caption").textContent =
      Object.keys(requests).length + " of " + data.requests + " requests drawn" +
      (data.sampled ? " (a sample: anomalies first)" : "") + ", " + drawn + " bars, " +
      data.refusals.length + " refusals, " + data.restarts.length + " restarts";
  }

  function drawHistograms(data) {
    var box = document.getElementById("histograms");
    var w = 260, h = 70, left = 4, bottom = 16;
    data.histograms.forEach(function (hist) {
      var card = document.createElement("div");
      card.className = "histogram";
      var title = document.createElement("div");
      title.className = "title";
      title.textContent = hist.title;
      var meta = document.createElement("div");
      meta.className = "meta";
      meta.textContent = "n=" + hist.count + ", p50 " + ms(hist.p50) + ", p99 " + ms(hist.p99) +
        ", max " + ms(hist.max);
      card.appendChild(title);
      card.appendChild(meta);
      var svg = el("svg", { width: w, height: h + bottom, viewBox: "0 0 " + w + " " + (h + bottom),
        "data-count": hist.count }, card);
      var peak = Math.max.apply(null, hist.bins.concat([1]));
      var bw = (w - left) / hist.bins.length;
      hist.bins.forEach(function (count, i) {
        if (!count) { return; }
        var bh = Math.max(1, count / peak * h);
        var bar = el("rect", { x: left + i * bw, y: h - bh, width: bw - 1, height: bh }, svg);
        el("title", {}, bar, count + " in " + ms(data.edges[i]) + " .. " + ms(data.edges[i + 1]));
      });
      ["10us", "1ms", "100ms", "10s", "1000s"].forEach(function (label, k) {
        var anchor = k === 0 ? "start" : k === 4 ? "end" : "middle";
        el("text", { x: left + k * 8 * bw, y: h + 12, "text-anchor": anchor }, svg, label);
      });
      box.appendChild(card);
    });
    box.setAttribute("data-histograms", String(data.histograms.length));
  }

  try {
    var data = JSON.parse(document.getElementById("report-data").textContent);
    drawTimeline(data);
    drawHistograms(data);
    root.setAttribute("data-status", "ok");
  } catch (e) {
    fail("the report script failed: " + (e && e.stack ? e.stack : e));
  }
})();
"""
