"""The run report's page: one self-contained HTML file (the data embedded as JSON, drawn by a
small script into SVG), the same in any browser and in headless Chromium.

Sections: a summary (steps, final loss, goodput, device-hours and cost, and how the job ended
and why), one timeline (lanes: rounds, faults, heals, hangs, checkpoints, stragglers, steps), the
loss, gradient-norm and throughput curves, a per-rank heatmap of busy time per step (the
straggler's row stands out), and tables of the device time by cause, what the control plane
decided, the rounds, the heals (where each round's state came from), the stragglers, the hangs
and the commits. Every lane and
table carries a ``data-lane`` / ``id`` the tests look for; ``body[data-rendered]`` counts the
lanes drawn.

What must stay true: every string in the data comes from logs that any worker, agent or fault
wrote, so nothing in it may end the JSON block early or change how the page is parsed:
:func:`embed_json` writes ``<``, ``>``, ``&``, U+2028 and U+2029 as ``\\uXXXX`` escapes (the
HTML parser then never sees a tag, a comment opener such as ``<!--`` or a character reference
inside the block; ``JSON.parse`` reads them back unchanged) and non-finite numbers as ``null``
(``NaN`` is not JSON: one would stop the whole page). The script writes every value with
``textContent`` or ``setAttribute``, never as markup.
"""

from __future__ import annotations

import html
import json
import math
import re
from typing import Any

#: what the pages' scripts share: SVG elements, and a timeline of lanes with marks (the chaos
#: report draws its own lanes with it)
TIMELINE_JS = """const NS = "http://www.w3.org/2000/svg";
function el(name, attrs, parent) {
  const e = document.createElementNS(NS, name);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  if (parent) parent.appendChild(e);
  return e;
}
// one SVG timeline over [t0, tEnd]: a labelled lane per name, an axis in seconds, marks
function timeline(container, lanes, t0, tEnd, LANE) {
  const W = 1100, LEFT = 90, TOP = 10, H = TOP + lanes.length * LANE + 24;
  const x = t => LEFT + (W - LEFT - 10) * (t - t0) / (tEnd - t0);
  const y = name => TOP + lanes.indexOf(name) * LANE;
  const svg = el("svg", {width: W, height: H, id: "timeline-svg"}, container);
  lanes.forEach((name, i) => {
    const g = el("g", {class: "lane", "data-lane": name}, svg);
    el("rect", {x: LEFT, y: y(name), width: W - LEFT - 10, height: LANE - 3, fill: i % 2 ? "#fafafa" : "#f0f0f0"}, g);
    el("text", {x: 4, y: y(name) + 15, class: "lane-label"}, g).textContent = name;
  });
  for (let s = 0; s <= 10; s++) {
    const t = t0 + (tEnd - t0) * s / 10;
    el("text", {x: x(t) - 8, y: H - 6, class: "lane-label"}, svg).textContent = (t - t0).toFixed(0) + "s";
  }
  function mark(lane, t, color, title, w) {
    const r = el("rect", {x: x(t), y: y(lane) + 2, width: w || 3, height: LANE - 7, fill: color, class: "mark"}, svg);
    el("title", {}, r).textContent = title;
  }
  return {svg, x, y, mark};
}"""

_PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>ftrain run: __TITLE__</title>
<style>
body { font: 13px system-ui, sans-serif; margin: 16px; color: #222; }
h1 { font-size: 18px; margin: 0 0 8px; } h2 { font-size: 15px; margin: 18px 0 6px; }
table { border-collapse: collapse; margin: 6px 0 14px; }
td, th { border: 1px solid #ccc; padding: 3px 8px; text-align: left; }
.lane-label, .axis { font-size: 11px; fill: #333; }
.charts { display: flex; flex-wrap: wrap; gap: 12px; }
</style></head>
<body>
<h1>ftrain run: <span id="title"></span></h1>
<div id="summary"></div>
<p id="final"></p>
<h2>Timeline</h2><div id="timeline"></div>
<h2>Training</h2><div class="charts" id="charts"></div>
<h2>Busy time per step, by rank</h2><div id="heatmap"></div>
<h2>Where the device time went</h2>
<table id="lost"><thead><tr><th>cause</th><th>device-hours</th><th>share</th><th>cost</th></tr></thead>
<tbody></tbody></table>
<h2>Decisions</h2>
<table id="decisions"><thead><tr><th>at s</th><th>what</th></tr></thead><tbody></tbody></table>
<h2>Rounds</h2>
<table id="rounds"><thead><tr><th>round</th><th>at s</th><th>reason</th><th>members</th><th>world size</th></tr></thead>
<tbody></tbody></table>
<h2>Heals</h2>
<table id="heals"><thead><tr><th>round</th><th>at s</th><th>state from (ranks)</th><th>from step</th>
<th>steps redone</th><th>slowest rank</th><th>its seconds</th><th>join / build / state s</th><th>refusals</th>
</tr></thead>
<tbody></tbody></table>
<h2>Stragglers</h2>
<table id="stragglers"><thead><tr><th>at s</th><th>node</th><th>rank</th><th>busy s/step</th><th>others s/step</th>
<th>policy</th></tr></thead><tbody></tbody></table>
<h2>Hangs</h2>
<table id="hangs"><thead><tr><th>at s</th><th>node</th><th>round</th><th>verdict</th></tr></thead>
<tbody></tbody></table>
<h2>Checkpoints</h2>
<table id="checkpoints"><thead><tr><th>step</th><th>at s</th><th>round</th></tr></thead><tbody></tbody></table>
<script id="data" type="application/json">__DATA__</script>
<script>
const R = JSON.parse(document.getElementById("data").textContent);
__TIMELINE_JS__
const t0 = R.started_at, tEnd = Math.max(R.ended_at, t0 + 1), A = R.accounting;
const last = R.steps.length ? R.steps[R.steps.length - 1] : null;
document.getElementById("title").textContent = R.title || "";
const lost = A.causes.filter(c => c.cause !== "productive").reduce((s, c) => s + c.device_hours, 0);
const cost = A.device_hour_price ? " (" + (lost * A.device_hour_price).toFixed(2) + " at " + A.device_hour_price +
  " per device-hour)" : "";
document.getElementById("summary").textContent = (last ? "step " + last.step + ", loss " +
  (last.loss ?? NaN).toFixed(4) : "no step") + " · " + R.rounds.length + " round(s) · " +
  (R.heals || []).length + " heal(s) · " + A.devices +
  " device(s) for " + A.wall_s.toFixed(0) + " s · goodput " + (100 * A.goodput).toFixed(1) + "% · lost " +
  lost.toFixed(4) + " device-hours" + cost + " (accounted from the " + (A.source || "metrics") + ")";
if (R.final) document.getElementById("final").textContent = "job " + R.final.status + ": " + R.final.reason;

// one timeline
const lanes = ["rounds", "faults", "heals", "hangs", "checkpoints", "stragglers", "steps"];
const LANE = 24;
const {svg, x, y, mark} = timeline(document.getElementById("timeline"), lanes, t0, tEnd, LANE);
const REASONS = {start: "#90caf9", scale_up: "#a5d6a7", straggler: "#ffcc80", hang: "#f48fb1"};
R.rounds.forEach((r, i) => {
  const end = i + 1 < R.rounds.length ? R.rounds[i + 1].time : tEnd;
  const rect = el("rect", {x: x(r.time), y: y("rounds") + 3, width: Math.max(1, x(end) - x(r.time) - 1),
    height: LANE - 9, fill: REASONS[r.reason] || "#ef9a9a", class: "round"}, svg);
  el("title", {}, rect).textContent = "round " + r.round + " (" + r.reason + "): " + r.members.join(", ");
});
R.faults.forEach(f => mark("faults", f.time, "#d32f2f", f.kind + " " + f.node, 4));
const sources = h => Object.entries(h.sources).map(([s, n]) => s + " x" + n).join(", ");
(R.heals || []).forEach(h => mark("heals", h.time, "#1565c0", "round " + h.round + ": state from " + sources(h) +
  " at step " + h.step, Math.max(3, x(h.done_at) - x(h.time))));  // from the first rank's start to the last's end
R.hangs.forEach(h => mark("hangs", h.time, "#ad1457", "hang on " + h.node + ": " + h.verdict, 4));
R.checkpoints.forEach(c => mark("checkpoints", c.time, "#2e7d32", "committed step " + c.step, 2));
R.stragglers.forEach(s => mark("stragglers", s.time, "#ef6c00", "straggler " + s.node + " (" + s.policy + ")", 4));
if (R.steps.length) {
  const maxStep = Math.max(...R.steps.map(m => m.step), 1);
  const pts = R.steps.map(m => x(m.time).toFixed(1) + "," +
    (y("steps") + LANE - 4 - (LANE - 8) * m.step / maxStep).toFixed(1)).join(" ");
  el("polyline", {points: pts, fill: "none", stroke: "#333", "stroke-width": 1}, svg);
}

// curves against the step
function chart(name, key, color) {
  const CW = 360, CH = 160, L = 50, B = 20;
  const pts = R.steps.filter(m => typeof m[key] === "number" && isFinite(m[key]));
  const box = el("svg", {width: CW, height: CH, "data-chart": name}, document.getElementById("charts"));
  el("text", {x: L, y: 12, class: "axis"}, box).textContent = name;
  if (!pts.length) return;
  const lo = Math.min(...pts.map(m => m[key])), hi = Math.max(...pts.map(m => m[key]), lo + 1e-12);
  const s0 = pts[0].step, s1 = Math.max(pts[pts.length - 1].step, s0 + 1);
  const px = s => L + (CW - L - 8) * (s - s0) / (s1 - s0), py = v => CH - B - (CH - B - 18) * (v - lo) / (hi - lo);
  el("polyline", {points: pts.map(m => px(m.step).toFixed(1) + "," + py(m[key]).toFixed(1)).join(" "),
    fill: "none", stroke: color, "stroke-width": 1.2}, box);
  el("text", {x: 2, y: py(hi) + 4, class: "axis"}, box).textContent = hi.toPrecision(3);
  el("text", {x: 2, y: py(lo), class: "axis"}, box).textContent = lo.toPrecision(3);
  el("text", {x: L, y: CH - 4, class: "axis"}, box).textContent = "step " + s0;
  el("text", {x: CW - 60, y: CH - 4, class: "axis"}, box).textContent = "step " + s1;
}
chart("loss", "loss", "#1565c0");
chart("grad norm", "grad_norm", "#6a1b9a");
chart("tokens/s", "tokens_per_s", "#2e7d32");

// heatmap: ranks x steps, busy time per step
const rows = Math.max(0, ...R.steps.map(m => m.rank_busy_s.length));
const HW = 1100, HL = 60, CELL_H = 12, cols = Math.min(R.steps.length, 400);
const heat = el("svg", {width: HW, height: rows * CELL_H + 20, "data-chart": "heatmap"},
  document.getElementById("heatmap"));
if (rows && cols) {
  const per = R.steps.length / cols, cw = (HW - HL - 10) / cols;
  const all = R.steps.flatMap(m => m.rank_busy_s), hi = Math.max(...all, 1e-9);
  for (let r = 0; r < rows; r++) {
    el("text", {x: 2, y: r * CELL_H + 10, class: "axis"}, heat).textContent = "rank " + r;
    for (let c = 0; c < cols; c++) {
      const m = R.steps[Math.floor(c * per)], v = m.rank_busy_s[r];
      if (v === undefined) continue;
      const light = 95 - 60 * v / hi;
      const cell = el("rect", {x: HL + c * cw, y: r * CELL_H, width: Math.max(1, cw), height: CELL_H - 1,
        fill: "hsl(20, 90%, " + light.toFixed(0) + "%)", class: "cell"}, heat);
      el("title", {}, cell).textContent = "rank " + r + ", step " + m.step + ": busy " + v.toFixed(4) + " s";
    }
  }
}

function table(id, rowsData, cells) {
  const tb = document.querySelector("#" + id + " tbody");
  rowsData.forEach(d => {
    const tr = document.createElement("tr");
    cells(d).forEach(v => { const td = document.createElement("td"); td.textContent = v ?? "-"; tr.appendChild(td); });
    tb.appendChild(tr);
  });
}
const at = t => (t - t0).toFixed(1);
table("lost", A.causes, c => [c.cause, c.device_hours.toFixed(5), (100 * c.share).toFixed(1) + "%",
  c.cost === null ? "-" : c.cost.toFixed(4)]);
table("decisions", R.decisions || [], d => [at(d.time), d.text]);
table("rounds", R.rounds, r => [r.round, at(r.time), r.reason, r.members.join(", "), r.world_size]);
const secs = v => typeof v === "number" ? v.toFixed(2) : null;
table("heals", R.heals || [], h => [h.round, at(h.time), sources(h), h.step, h.steps_redone, h.slowest_rank,
  secs(h.seconds), ["join_s", "build_s", "state_s"].map(k => secs(h.phases_s[k]) ?? "-").join(" / "), h.refused]);
table("stragglers", R.stragglers, s => [at(s.time), s.node, s.rank, s.busy_s.toFixed(4), s.others_s.toFixed(4),
  s.policy]);
table("hangs", R.hangs, h => [at(h.time), h.node, h.round, h.verdict]);
table("checkpoints", R.checkpoints, c => [c.step, at(c.time), c.round]);
document.body.setAttribute("data-rendered", lanes.length);
</script></body></html>
"""


#: what :func:`embed_json` escapes: ``json.dumps`` leaves ``<``, ``>`` and ``&`` as they are (U+2028
#: and U+2029 it escapes already, with every other non-ASCII character: kept here all the same)
_UNSAFE_IN_SCRIPT = {
    ord("<"): "\\u003c",
    ord(">"): "\\u003e",
    ord("&"): "\\u0026",
    0x2028: "\\u2028",
    0x2029: "\\u2029",
}


def embed_json(value: Any) -> str:
    """``value`` as JSON that can sit inside ``<script type="application/json">`` whatever its
    strings hold (see the module doc); ``JSON.parse`` of the block gives ``value`` back."""
    return json.dumps(_finite(value), default=str, allow_nan=False).translate(_UNSAFE_IN_SCRIPT)


def _finite(value: Any) -> Any:
    """``value`` with every NaN or infinity replaced by None (and tuples as lists)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def render(report: dict[str, Any]) -> str:
    """The page for ``report`` (:func:`ftrain.observability.run_report.build`)."""
    parts = {
        "__TITLE__": html.escape(str(report.get("title", ""))),
        "__TIMELINE_JS__": TIMELINE_JS,
        "__DATA__": embed_json(report),
    }
    # one pass: a title or a log string that reads "__DATA__" stays text
    return _SLOT.sub(lambda m: parts[m.group(0)], _PAGE)


_SLOT = re.compile("__TITLE__|__TIMELINE_JS__|__DATA__")
