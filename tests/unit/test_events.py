"""The event catalogue: every event has one record, every writer emits records (never a bare
name), and what is written reads back as the same record."""

from __future__ import annotations

import ast
import dataclasses
import types
import typing

import pytest

from ftrain.contract import events as ev
from ftrain.testbed.procs import REPO

SAMPLES = {int: 3, float: 1.5, str: "x", bool: True}


def _sample(record_type: type[ev.Record]) -> ev.Record:
    hints = typing.get_type_hints(record_type)
    values = {}
    for f in dataclasses.fields(record_type):
        hint = hints[f.name]
        if isinstance(hint, types.UnionType):  # X | None: the X
            hint = next(a for a in typing.get_args(hint) if a is not type(None))
        origin = typing.get_origin(hint)
        values[f.name] = ["a"] if origin is list else {"k": "v"} if origin is dict else SAMPLES[hint]
    return record_type(**values)


def test_every_event_has_exactly_one_record():
    assert set(ev.RECORDS) == set(ev.Event)
    assert all(cls.EVENT is event for event, cls in ev.RECORDS.items())


@pytest.mark.parametrize("event", list(ev.Event), ids=str)
def test_a_written_record_reads_back_the_same(tmp_path, event):
    log = ev.EventLog(str(tmp_path / "events.jsonl"), rank=2, round_=5)
    record = _sample(ev.RECORDS[event])
    log.emit(record)
    log.close()
    (line,) = ev.read_events(tmp_path / "events.jsonl")
    assert line["event"] == event and line["rank"] == 2 and line["pid"] > 0
    assert ev.parse(line) == record


def test_unknown_or_incomplete_lines_parse_to_none():
    assert ev.parse({"event": "no_such_event"}) is None
    assert ev.parse({"event": "ckpt_committed", "step": 3}) is None  # duration_s missing


def test_event_names_compare_and_hash_as_the_strings_on_disk():
    assert ev.Event.HANG == "hang" and "hang" in {ev.Event.HANG} and {ev.Event.HANG: 1}["hang"] == 1


def _emits_of_bare_names() -> list[str]:
    bad = []
    for package in ("contract", "checkpoint", "ftrain", "agents", "chaos"):
        for path in sorted((REPO / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("emit", "on_event")
                    and node.args
                    and isinstance(node.args[0], ast.Constant)
                ):
                    bad.append(f"{path.relative_to(REPO)}:{node.lineno}")
    return bad


def test_writers_emit_records_not_names():
    assert _emits_of_bare_names() == []
