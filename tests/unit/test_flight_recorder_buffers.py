"""The flight recorder reads both of torch's buffers: NCCL's and the other backends'.

A CUDA build of torch keeps NCCL's collectives in a buffer of its own (``_dump_nccl_trace_json``);
``_dump_fr_trace_json`` holds gloo's only. A worker on GPUs trains over NCCL and keeps gloo groups
beside it (memory tier, checkpoints), so a reader of one buffer alone misses either the training
collectives or the others. This CPU build has no NCCL buffer: the test puts in a stand-in with the
fields torch's dump has, and checks the merge (the GPU check runs it against the real one).
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import pytest
from torch._C import _distributed_c10d as c10d

from ftrain.agent_link import flight_recorder


def _entry(pg_id: int, seq: int, op: str, created_ns: int, state: str) -> dict[str, Any]:
    return {
        "pg_id": pg_id,
        "process_group": ["0", "default_pg"],
        "collective_seq_id": seq,
        "profiling_name": op,
        "input_sizes": [[4]],
        "input_dtypes": ["Float"],
        "state": state,
        "retired": False,
        "time_created_ns": created_ns,
        "is_p2p": False,
    }


def _dump(entries: list[dict[str, Any]], status: dict[str, dict[str, int]]):
    def dump(include_collectives: bool, only_active: bool) -> str:
        return json.dumps({"entries": entries if include_collectives else [], "pg_status": status})

    return dump


@pytest.fixture
def both_buffers(monkeypatch):
    """An NCCL buffer whose all_reduce 7 is in flight, and a gloo buffer with nothing in flight."""
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "100")
    for state in ("_in_flight", "_group_names"):
        monkeypatch.setattr(flight_recorder, state, {})
    monkeypatch.setattr(flight_recorder, "_old_backends", set())
    monkeypatch.setattr(flight_recorder, "_world_since_ns", 0)
    now = time.time_ns()
    nccl = [
        _entry(0, 6, "nccl:all_reduce", now + 1_000, "completed"),
        _entry(0, 7, "nccl:all_reduce", now + 3_000, "started"),
    ]
    gloo = [_entry(0, 3, "gloo:broadcast", now + 2_000, "completed")]
    monkeypatch.setattr(c10d, "_dump_nccl_trace_json", _dump(nccl, {"0": _status(6, 7)}), raising=False)
    monkeypatch.setattr(c10d, "_dump_fr_trace_json", _dump(gloo, {"0": _status(3, 3)}))
    monkeypatch.setattr(flight_recorder.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(flight_recorder, "_groups", lambda: {})
    monkeypatch.setattr(flight_recorder, "EXACT_AFTER_S", 0.0)
    return now


def _status(completed: int, enqueued: int) -> dict[str, int]:
    return {"last_completed_collective": completed, "last_enqueued_collective": enqueued}


def test_a_snapshot_holds_both_buffers_oldest_first(both_buffers):
    record = flight_recorder.snapshot(0)
    assert record.available
    assert [(c.op, c.seq) for c in record.entries] == [
        ("nccl:all_reduce", 6),
        ("gloo:broadcast", 3),
        ("nccl:all_reduce", 7),
    ]


def test_the_groups_of_the_two_buffers_are_kept_apart_and_an_nccl_collective_is_seen_in_flight(both_buffers):
    assert flight_recorder._read_pg_status() == {"nccl:0": (6, 7), "fr:0": (3, 3)}  # both have a group 0
    oldest = flight_recorder.oldest_in_flight()
    assert oldest is not None and (oldest.op, oldest.seq) == ("nccl:all_reduce", 7)
    assert oldest.enqueued_s == pytest.approx((both_buffers + 3_000) / 1e9)


def test_a_buffer_that_cannot_be_read_is_said_once_and_the_other_is_still_read(both_buffers, monkeypatch, caplog):
    def broken(include_collectives: bool, only_active: bool) -> str:
        raise RuntimeError("no NCCL here")

    monkeypatch.setattr(c10d, "_dump_nccl_trace_json", broken, raising=False)
    monkeypatch.setattr(flight_recorder, "_unreadable", set())
    with caplog.at_level(logging.DEBUG, logger=flight_recorder.__name__):
        for _ in range(3):
            assert flight_recorder._read_pg_status() == {"fr:0": (3, 3)}
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "_dump_nccl_trace_json" in warned[0].getMessage()
    assert [c.op for c in flight_recorder.snapshot(0).entries] == ["gloo:broadcast"]
