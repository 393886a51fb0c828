"""The chaos report: ``report.json``, a self-contained ``report.html`` (the data is embedded and
drawn by a small script into an SVG timeline: one lane per node and per rank, plus the faults
and the step count) and ``report.png``, a screenshot of the page by headless Chromium when one is
installed (:mod:`ftrain.observability.browser`)."""

from __future__ import annotations

import html
import json
import re
from pathlib import Path
from typing import Any

from ftrain.contract.local_files import replace_file
from ftrain.observability.browser import dump_dom, find_browser, screenshot
from ftrain.observability.report_page import TIMELINE_JS, embed_json

__all__ = ["dump_dom", "find_browser", "render_html", "screenshot", "write_report"]

_PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>ftrain chaos: __TITLE__</title>
<style>
body { font: 13px system-ui, sans-serif; margin: 16px; color: #222; }
h1 { font-size: 18px; margin: 0 0 8px; }
table { border-collapse: collapse; margin: 8px 0 16px; }
td, th { border: 1px solid #ccc; padding: 3px 8px; text-align: left; }
.ok { color: #17702a; font-weight: bold; } .fail { color: #b00020; font-weight: bold; }
.lane-label { font-size: 12px; fill: #333; }
.legend span { display: inline-block; margin-right: 14px; }
.sw { display: inline-block; width: 10px; height: 10px; margin-right: 4px; vertical-align: middle; }
</style></head>
<body>
<h1>ftrain chaos: <span id="title"></span></h1>
<div id="summary"></div>
<div class="legend" id="legend"></div>
<div id="timeline"></div>
<h2>Faults</h2>
<table id="faults"><thead><tr><th>#</th><th>kind</th><th>at step</th><th>node</th><th>detected by</th>
<th>detection s</th><th>new round</th><th>recovery s</th><th>resumed step</th><th>lost steps</th>
<th>lost s</th></tr></thead>
<tbody></tbody></table>
<h2>Invariants</h2>
<table id="checks"><tbody></tbody></table>
<script id="data" type="application/json">__DATA__</script>
<script>
const R = JSON.parse(document.getElementById("data").textContent);
__TIMELINE_JS__
const COLORS = {fault: "#d32f2f", detect: "#f57c00", round: "#1565c0", staged: "#9e9e9e", committed: "#2e7d32",
                failed: "#6a1b9a", resumed: "#00838f", worker: "#5d4037", hang: "#ad1457"};
document.getElementById("title").textContent = R.scenario + " (seed " + R.seed + ")";
document.getElementById("summary").innerHTML =
  "<span class='" + (R.ok ? "ok'>ALL INVARIANTS HOLD" : "fail'>INVARIANTS FAILED") + "</span> &middot; " +
  R.faults.length + " fault(s) &middot; goodput " + (100 * R.goodput.goodput).toFixed(1) + "% (" +
  R.goodput.productive_s.toFixed(0) + " s productive of " + R.goodput.wall_s.toFixed(0) + " s)" +
  (R.goodput.lost_by_cause ? "; time lost: " + Object.entries(R.goodput.lost_by_cause)
     .sort((a, b) => b[1] - a[1]).map(([k, v]) => k + " " + v.toFixed(1) + " s").join(", ") : "");
document.getElementById("legend").innerHTML = Object.entries(COLORS).map(([k, c]) =>
  "<span><i class='sw' style='background:" + c + "'></i>" + k + "</span>").join("");

const ev = R.events, t0 = R.started_at;
const tEnd = Math.max(...ev.map(e => e.time), ...R.metrics.map(m => m.time), t0 + 1);
const nodes = [...new Set(ev.filter(e => e.rank === -1 && e.node).map(e => e.node))].sort();
const ranks = [...new Set(ev.filter(e => e.rank >= 0).map(e => e.rank))].sort((a, b) => a - b);
const lanes = ["faults", "steps", ...nodes.map(n => "node " + n), ...ranks.map(r => "rank " + r)];
const LANE = 26;
const {svg, x, y, mark} = timeline(document.getElementById("timeline"), lanes, t0, tEnd, LANE);
// rounds as spans on every node lane they include
const rounds = ev.filter(e => e.event === "round_formed").sort((a, b) => a.time - b.time);
rounds.forEach((r, i) => {
  const end = i + 1 < rounds.length ? rounds[i + 1].time : tEnd;
  r.members.forEach(n => {
    if (lanes.includes("node " + n)) {
      const rect = el("rect", {x: x(r.time), y: y("node " + n) + 4, width: Math.max(1, x(end) - x(r.time)),
                               height: LANE - 12, fill: "#bbdefb", class: "round"}, svg);
      el("title", {}, rect).textContent = "round " + r.new_round + " (" + r.reason + ")";
    }
  });
  mark("node " + (r.node || nodes[0]), r.time, COLORS.round, "round " + r.new_round + " formed: " + r.reason);
});
ev.forEach(e => {
  const lane = e.rank >= 0 ? "rank " + e.rank : (e.node ? "node " + e.node : null);
  if (e.event === "chaos_fault") mark("faults", e.time, COLORS.fault, e.kind + " " + (e.node || ""), 4);
  else if (["workers_exited", "lease_lost", "etcd_unreachable", "ckpt_corrupt"].includes(e.event) && lane)
    mark(lane, e.time, COLORS.detect, e.event);
  else if (e.event === "hang" && lane) mark(lane, e.time, COLORS.hang, "hang: stacks dumped");
  else if (e.event === "ckpt_staged" && lane) mark(lane, e.time, COLORS.staged, "staged step " + e.step, 2);
  else if (e.event === "ckpt_committed" && lane) mark(lane, e.time, COLORS.committed, "committed step " + e.step);
  else if (e.event === "ckpt_failed" && lane) mark(lane, e.time, COLORS.failed, "save failed: " + e.error);
  else if (e.event === "resumed" && lane) mark(lane, e.time, COLORS.resumed, "resumed step " + e.step);
  else if (e.event === "worker_started" && lane) mark(lane, e.time, COLORS.worker, "worker " + e.pid, 2);
});
if (R.metrics.length) {
  const maxStep = Math.max(...R.metrics.map(m => m.step));
  const pts = R.metrics.map(m => x(m.time).toFixed(1) + "," +
                            (y("steps") + LANE - 5 - (LANE - 8) * m.step / maxStep).toFixed(1)).join(" ");
  el("polyline", {points: pts, fill: "none", stroke: "#333", "stroke-width": 1, class: "steps"}, svg);
}
const fb = document.querySelector("#faults tbody");
R.faults.forEach(f => {
  const tr = document.createElement("tr");
  [f.index, f.kind, f.step, f.node, f.detected_by, f.detection_s, f.new_round, f.recovery_s, f.resumed_step,
   f.lost_steps, f.lost_s].forEach(v => {
    const td = document.createElement("td"); td.textContent = v ?? "-"; tr.appendChild(td);
  });
  fb.appendChild(tr);
});
const cb = document.querySelector("#checks tbody");
R.checks.forEach(c => {
  const tr = document.createElement("tr");
  const verdict = c.skipped ? "ok'>skipped" : c.ok ? "ok'>ok" : "fail'>FAIL";
  tr.innerHTML = "<td class='" + verdict + "</td><td></td><td></td>";
  tr.children[1].textContent = c.name; tr.children[2].textContent = c.detail;
  cb.appendChild(tr);
});
document.body.setAttribute("data-rendered", lanes.length);
</script></body></html>
"""


def render_html(report: dict[str, Any]) -> str:
    """The page, its slots filled in one pass (a value that holds another slot's name stays
    text): the title HTML-escaped, the data as :func:`ftrain.observability.report_page.embed_json` embeds it
    (a log field such as ``<!--<script>`` must not end the data block or swallow the script)."""
    slots = {
        "__TITLE__": html.escape(str(report["scenario"])),
        "__TIMELINE_JS__": TIMELINE_JS,
        "__DATA__": embed_json(report),
    }
    return re.sub("|".join(slots), lambda m: slots[m.group(0)], _PAGE)


def write_report(out_dir: Path, report: dict[str, Any]) -> None:
    replace_file(out_dir / "report.json", json.dumps(report, indent=1, default=str).encode())  # never through a link
    html = out_dir / "report.html"
    replace_file(html, render_html(report).encode())
    screenshot(html, out_dir / "report.png")
