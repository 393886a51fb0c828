"""A flight record read from a worker directory (ftrain.contract.flight.FlightRecord.decode) is untrusted
text that ends up in logs and terminals: a name with a control character (an escape sequence that
rewrites the terminal, a newline that forges a log line) and a document nested past the parser's
depth are refused as ValueError, the one error the agent turns into a reason, never a crash."""

from __future__ import annotations

import json

import pytest

from ftrain.contract.flight import FlightRecord


def _record(**entry: object) -> dict:
    collective = {"seq": 1, "group": "0", "op": "gloo:all_reduce", "sizes": [[4]], "dtypes": ["Float"], **entry}
    return {"rank": 0, "pid": 5, "taken_at": 1.0, "entries": [collective], "groups": {"0": [0]}}


@pytest.mark.parametrize(
    ("entry", "named"),
    [
        ({"op": "gloo:all_reduce\x1b[2J\x1b[Hrank 3 is the culprit"}, "entries[0].op"),
        ({"group": "0\nERROR ftrain.agents.agent: forged"}, "entries[0].group"),
        ({"dtypes": ["Float\x9b31m"]}, "entries[0].dtypes"),
    ],
)
def test_a_name_with_a_control_character_is_refused_naming_the_field(entry, named):
    with pytest.raises(ValueError, match=named.replace("[", r"\[").replace("]", r"\]")):
        FlightRecord.decode(json.dumps(_record(**entry)))
    assert FlightRecord.decode(json.dumps(_record(op="gloo:all_reduce é"))).entries[0].op == "gloo:all_reduce é"


def test_a_document_nested_past_the_parsers_depth_is_a_value_error():
    with pytest.raises(ValueError, match="nests deeper than"):
        FlightRecord.decode(b"[" * 200_000 + b"]" * 200_000)
