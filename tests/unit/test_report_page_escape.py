"""The run report's page against hostile log fields (ftrain.observability.report_page and
run_report): the
page is parsed by a real HTML5 parser (html5lib, the WHATWG tokenizer with its script-data
states, which Python's html.parser does not implement), and the embedded JSON must come back
exactly, the page's own script whole, whatever an event or metric line holds: a comment opener
and a script tag (``<!--<script>``), a closing tag, ``&``, U+2028, a NaN loss, wrong types."""

from __future__ import annotations

import json
from typing import Any

import pytest

from ftrain.chaos.report import render_html
from ftrain.observability import report_page
from ftrain.observability.run_report import build

html5lib = pytest.importorskip(
    "html5lib", reason="html5lib (pure Python) is needed to parse the page as a browser does: pip install html5lib"
)

T0 = 1_000.0
HOSTILE = [
    "<!--<script>",
    "</script><script>document.title='owned'</script>",
    "--> <!-- </script",
    "&amp; &lt; \u2028 \u2029 \\u003c",
    "__DATA__ __TIMELINE_JS__",
]


def _strict_json(text: str) -> Any:
    """JSON as ``JSON.parse`` reads it (no NaN, no Infinity)."""

    def refuse(constant: str) -> Any:
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def _logs() -> tuple[list[dict], list[dict]]:
    metrics = [
        {"step": 1, "time": T0 + 1, "loss": 2.0, "world_size": 2, "rank_busy_s": [0.1, 0.1]},
        {"step": 2, "time": T0 + 2, "loss": float("nan"), "grad_norm": float("inf"), "world_size": 10**400},
        {"step": 3, "time": T0 + 3, "loss": "low", "round": "one", "tokens_per_s": 10**400},
    ]
    events: list[dict] = [
        {"time": T0, "event": "round_formed", "new_round": 1, "reason": HOSTILE[0], "members": HOSTILE},
        {"time": T0 + 0.5, "event": "round_formed", "new_round": "2", "reason": "x", "members": "a,b"},
        {"time": T0 + 1.5, "event": "chaos_fault", "kind": HOSTILE[1], "node": HOSTILE[2]},
        {"time": T0 + 1.9, "event": "hang", "node": HOSTILE[3], "worker_round": 1, "verdict": HOSTILE[0] + " rank 1"},
        {"time": T0 + 2.1, "event": "straggler_detected", "node": HOSTILE[4], "busy_rank": [1], "policy": HOSTILE[1]},
    ]
    return metrics, events


def _parse(page: str):
    return html5lib.parse(page, treebuilder="etree", namespaceHTMLElements=False)


def test_hostile_log_fields_come_back_exactly_and_leave_the_pages_script_whole():
    metrics, events = _logs()
    report = build(metrics, events, title=HOSTILE[1] + HOSTILE[4])
    page = report_page.render(report)
    doc = _parse(page)
    scripts = doc.findall(".//script")
    assert [s.get("id") for s in scripts] == ["data", None], [(s.get("id"), (s.text or "")[:80]) for s in scripts]
    data, code = scripts
    assert _strict_json(data.text) == report  # every string exactly as the logs had it
    assert code.text.lstrip().startswith('const R = JSON.parse(document.getElementById("data").textContent);')
    assert code.text.rstrip().endswith('document.body.setAttribute("data-rendered", lanes.length);')
    assert doc.find(".//title").text == "ftrain run: " + HOSTILE[1] + HOSTILE[4]  # text, not markup
    assert [t.tag for t in doc.find(".//h1")] == ["span"]  # nothing the title or the data said became an element


def test_a_nan_or_a_wrong_type_in_a_log_line_is_no_value_not_a_broken_page():
    metrics, events = _logs()
    report = build(metrics, events)
    steps = report["steps"]
    assert [s["loss"] for s in steps] == [2.0, None, None] and steps[1]["grad_norm"] is None
    assert steps[2]["round"] is None and steps[2]["tokens_per_s"] is None
    assert report["accounting"]["devices"] == 2  # a world of 10**400 devices is not believed
    rounds = report["rounds"]
    assert rounds[0]["members"] == HOSTILE and rounds[1]["members"] == [] and rounds[1]["round"] is None
    assert report["stragglers"][0]["rank"] is None
    _strict_json(json.dumps(report))  # report.json is JSON too
    odd = {"x": float("nan"), "y": [float("-inf"), (1, 2)]}
    assert _strict_json(report_page.embed_json(odd)) == {"x": None, "y": [None, [1, 2]]}


def test_embedded_json_has_no_character_the_html_parser_acts_on():
    text = report_page.embed_json({"s": "".join(HOSTILE)})
    assert not set(text) & set("<>&\u2028\u2029")
    assert _strict_json(text) == {"s": "".join(HOSTILE)}


def test_the_chaos_report_page_takes_hostile_fields_the_same_way():
    """chaos/report.py embedded its report with only ``</`` escaped (the same defect)."""
    report = {"scenario": HOSTILE[1] + HOSTILE[4], "faults": [{"kind": HOSTILE[0], "node": HOSTILE[2]}], "x": HOSTILE}
    doc = _parse(render_html(report))
    scripts = doc.findall(".//script")
    assert [s.get("id") for s in scripts] == ["data", None]
    assert _strict_json(scripts[0].text) == report
    assert doc.find(".//title").text == "ftrain chaos: " + HOSTILE[1] + HOSTILE[4]
