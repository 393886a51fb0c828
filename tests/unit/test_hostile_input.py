"""Every decoder of untrusted input survives hostile values (issue 38, item 1).

A record under the job's etcd prefix, a heartbeat datagram, an assignment file, a flight record
and an event-log line are written by other processes. Whatever one holds — a 400-digit number
where a float goes, NaN or Infinity, a list nested 100,000 deep, a 200 KB string, invalid UTF-8,
a lone surrogate, a value of the wrong type — it is a reported bad record (``JobState.problems``,
``HeartbeatServer.dropped``, a ValueError, ``RoundEvidence.problems``) and never an exception
that ends an agent or a receiver thread; the valid records beside it are still read.

The first tests are the reproductions of the issue (each failed before: ``OverflowError`` out of
``JobState.parse``, a heartbeat thread ended by one datagram, ``OverflowError`` out of a flight
record); the property tests throw generated hostile JSON at every record kind of
:mod:`ftrain.agents.records`, every datagram kind of :mod:`ftrain.contract.heartbeat`, the
control file of :mod:`ftrain.contract.control`, flight records and event logs.
"""

from __future__ import annotations

import base64
import copy
import json
import os
import tempfile
import time
from dataclasses import asdict
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ftrain.agents import flight as agent_flight
from ftrain.agents import hang_view
from ftrain.agents.etcd import KeyValue
from ftrain.agents.flight_verdict import from_events
from ftrain.agents.heartbeat import HeartbeatServer, parse_beat
from ftrain.agents.job_keys import JobKeys
from ftrain.agents.record_checks import checker, from_dict
from ftrain.agents.records import (
    FAILED,
    HANG,
    WORKER_EXIT,
    DumpRequest,
    FinalStatus,
    JobState,
    Member,
    NodeRecord,
    NodeStatus,
    Problem,
    RankStall,
    Report,
    RoundRecord,
    decode,
)
from ftrain.checkpoint.errors import ManifestError
from ftrain.checkpoint.manifest import Manifest
from ftrain.contract.bounded_json import JsonInputError, is_finite_number, loads, printable, short
from ftrain.contract.control import Assignment, ControlFile
from ftrain.contract.events import Hang, parse, parse_line, read_jsonl
from ftrain.contract.flight import Collective, FlightRecord, record_path
from ftrain.observability.run_report import build
from ftrain.testbed.wait import wait_for

KEYS = JobKeys("job-7")
HUGE = "9" * 400  #: the issue's number: past every float, and 400 digits of int
NOW = 1_700_000_000.0


def kv(key: str, value: bytes | str, *, mod_revision: int = 1, lease: int = 0) -> KeyValue:
    data = value.encode() if isinstance(value, str) else value
    return KeyValue(key, data, mod_revision, mod_revision, 1, lease)


def with_raw(obj: dict[str, Any], field: str, raw: str) -> str:
    """``obj`` as JSON with ``field``'s value replaced by the JSON text ``raw``."""
    return json.dumps({**obj, field: "@@"}).replace('"@@"', raw)


# -- the reproductions ---------------------------------------------------------------------------
NODE_A = NodeRecord("a", "uid-a", "host-a", 11, 2, 1000.5)


def test_a_400_digit_number_in_a_float_field_is_a_skipped_record_never_an_exception():
    hostile = with_raw(asdict(NodeRecord("zz", "uid-z", "h", 12, 1, 0.0)), "registered_at", HUGE)
    state = JobState.parse(KEYS, [kv(KEYS.node("a"), NODE_A.to_json()), kv(KEYS.node("zz"), hostile)], 2)
    assert list(state.nodes) == ["a"]  # the valid record beside it is read
    assert [p.key for p in state.problems] == [KEYS.node("zz")]
    assert "registered_at" in str(state.problems[0]) and "40 digits" in str(state.problems[0])


@pytest.mark.parametrize("value", [10**400, -(10**400), 2**1024, float("nan"), float("inf"), True, "1.0"])
def test_the_float_checker_refuses_what_no_finite_float_holds_with_a_type_error(value):
    with pytest.raises(TypeError, match="NodeRecord.registered_at"):
        from_dict(NodeRecord, {**asdict(NODE_A), "registered_at": value})


@pytest.mark.parametrize("value", [2**63, -(2**63) - 1, 10**400])
def test_the_int_checker_refuses_what_no_writer_writes(value):
    with pytest.raises(TypeError, match=r"NodeRecord.pid: -?\d+.*is not an int64"):
        from_dict(NodeRecord, {**asdict(NODE_A), "pid": value})


def test_a_lone_surrogate_is_read_as_printable_text():
    status = from_dict(NodeStatus, json.loads('{"host": "h\\udc80\\ud800", "ckpt_error": "\\udfff"}'))
    assert status.host == "h\\udc80\\ud800" and status.ckpt_error == "\\udfff"
    status.host.encode("utf-8")  # a lone surrogate would raise here, and in every print


def hang_event(flight: dict[str, Any]) -> dict[str, Any]:
    """A ``hang`` event line of node b in round 1 with these flight records."""
    fields = Hang(node="b", worker_round=1, why="no progress", local_ranks=[0, 1], stacks={}, flight=flight).fields()
    return {"time": NOW, "event": "hang", "rank": -1, "round": 1, "pid": 1, **fields}


def _short_dir() -> tempfile.TemporaryDirectory:
    return tempfile.TemporaryDirectory(prefix="ftrain-hostile-")  # a socket path fits in 108 bytes


def _beat(step: int, **extra: Any) -> dict[str, Any]:
    return {"kind": "beat", "round": 1, "rank": 0, "local_rank": 0, "pid": os.getpid(), "step": step, **extra}


def test_one_hostile_datagram_never_ends_the_heartbeat_receiver():
    with _short_dir() as d:
        server = HeartbeatServer(os.path.join(d, "hb.sock"))
        try:
            server.reset(1)
            import socket  # noqa: PLC0415 - only this test sends by hand

            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
                sock.sendto(with_raw(_beat(1), "time", HUGE).encode(), server.path)
                sock.sendto(b"[" * 4000, server.path)
                sock.sendto(json.dumps(_beat(7)).encode(), server.path)
            assert wait_for(lambda: 0 in server.beats(), 5.0, "the valid beat after the hostile ones")
            assert server.beats()[0].step == 7
            assert server.dropped == 2
        finally:
            server.close()


def test_a_flight_record_with_a_400_digit_time_is_refused_with_a_reason():
    record = FlightRecord(0, 1234, NOW, [Collective(3, "0", "gloo:all_reduce", [[4]], ["Float"])], nonce="ab")
    hostile = with_raw(record.to_dict(), "taken_at", HUGE)
    with pytest.raises(ValueError, match="taken_at"):
        FlightRecord.decode(hostile)
    with pytest.raises(ValueError, match="taken_at"):
        FlightRecord.decode({**record.to_dict(), "taken_at": 10**400})  # an already parsed object too
    with _short_dir() as d:  # what the agent reads from a worker's directory
        with open(record_path(d, 1234), "w") as fh:
            fh.write(hostile)
        why = agent_flight._read(record_path(d, 1234), "ab")
        assert isinstance(why, str) and why.startswith("refused flight record")
    (evidence,) = from_events([hang_event({"0": json.loads(hostile), "1": record.to_dict()})])
    assert list(evidence.records) == [1] and "rank 0" in evidence.problems[0]
    evidence.verdict()


# -- the shared pieces -------------------------------------------------------------------------
@pytest.mark.parametrize(
    "raw, match",
    [
        (b"[" * 100_000 + b"]" * 100_000, "nests deeper than 64"),
        (b'{"a":' + HUGE.encode() + b"}", "more than 40 digits"),
        (b'{"a": 1e999}', "not finite"),
        (b'{"a": NaN}', "NaN"),
        (b'{"a": 1, "a": 2}', "repeats the key 'a'"),
        (b'{"a": "\xff"}', "not valid JSON"),
        (b'"' + b"x" * 2000 + b'"', "more than the 1000"),
        (b'"\\"' * 5000 + b"\\", "more than the|not valid"),
    ],
)
def test_the_bounded_reader_raises_one_error_type_naming_the_bound(raw, match):
    with pytest.raises(JsonInputError, match=match):
        loads(raw, max_bytes=1000 if len(raw) < 100_000 else 1 << 20)


def test_an_unterminated_string_full_of_quotes_is_scanned_in_linear_time():
    data = b'["' + b'\\"' * 1_000_000 + b"\\"  # each quote inside would restart a naive scan
    began = time.monotonic()
    with pytest.raises(JsonInputError):
        loads(data, max_bytes=1 << 22)
    assert time.monotonic() - began < 5.0  # quadratic: hours


def test_short_and_printable_never_raise_and_stay_small():
    nested: Any = []
    for _ in range(5000):
        nested = [nested]
    assert len(short(nested)) <= 120 and len(short("x" * 10**7)) <= 120 and len(short(10**4000)) <= 120
    assert printable("é\udc80") == "é\\udc80" and printable("plain") == "plain"
    assert not is_finite_number(10**400) and not is_finite_number(True) and is_finite_number(-(2**1000))


# -- generated hostile JSON ----------------------------------------------------------------------
class Raw(str):
    """JSON text put into a document as it is (numbers and nesting no Python value encodes)."""


RAW_VALUES = [
    "NaN",
    "Infinity",
    "-Infinity",
    "1e999",
    "-1e400",
    "1E400",
    "-0.0",
    "1e308",
    HUGE,
    "-" + HUGE,
    "1" * 5000,
    "0." + "0" * 400 + "1",
    "[" * 100_000 + "]" * 100_000,
    '{"a":' * 3000 + "1" + "}" * 3000,
    "[" * 65 + "]" * 65,
    '"' + "x" * 200_000 + '"',
    '"\\ud800"',
    '"\\udc80x\\udfff"',
    '"\\u0000\\u001b[2J"',
]

leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=-(10**60), max_value=10**60),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(["\ud800", "a\udc80", "²", "١٢", "host:²", "-1", "0", "3"]),
    st.sampled_from([Raw(r) for r in RAW_VALUES]),
)
hostile_values = st.recursive(
    leaves,
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=6), kids, max_size=4),
    max_leaves=10,
)
#: what replaces a valid record's field: a third each of raw JSON, ints past every float (the
#: issue's number) and any hostile value
replacements = st.one_of(
    st.sampled_from([Raw(r) for r in RAW_VALUES]),
    st.integers(min_value=2**1023, max_value=10**400) | st.integers(min_value=-(10**400), max_value=-(2**1023)),
    hostile_values,
)


def text_of(value: Any) -> str:
    """``value`` as JSON text; :class:`Raw` pieces as they are, NaN and Infinity as Python writes them."""
    if isinstance(value, Raw):
        return str(value)
    if isinstance(value, dict):
        return "{" + ",".join(json.dumps(k) + ":" + text_of(v) for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(text_of(v) for v in value) + "]"
    return json.dumps(value)


@st.composite
def hostile_doc(draw: st.DrawFn, valid: Any) -> Any:
    """``valid`` with one field or item, at any depth, replaced by a hostile value, removed, or
    given a hostile sibling."""
    doc = copy.deepcopy(valid)
    if not isinstance(doc, (dict, list)) or not doc:
        return draw(replacements)
    container: Any = doc

    def pick(c: Any) -> Any:
        return draw(st.sampled_from(sorted(c))) if isinstance(c, dict) else draw(st.integers(0, len(c) - 1))

    key = pick(container)
    for _ in range(6):  # down a random path, through non-empty containers
        child = container[key]
        if not isinstance(child, (dict, list)) or not child or not draw(st.booleans()):
            break
        container, key = child, pick(child)
    action = draw(st.sampled_from(["replace", "replace", "delete", "add"]))
    if action == "replace":
        container[key] = draw(replacements)
    elif action == "delete":
        del container[key]
    elif isinstance(container, dict):
        container[draw(st.text(max_size=6))] = draw(replacements)
    else:
        container.append(draw(replacements))
    return doc


@st.composite
def hostile_bytes(draw: st.DrawFn, valid: Any) -> bytes:
    """Bytes of a hostile record shaped like ``valid``: garbage, a hostile document, or
    :func:`hostile_doc` of ``valid``, sometimes with its bytes torn or made undecodable."""
    how = draw(st.integers(0, 5))
    if how == 0:
        return draw(st.binary(max_size=40))
    if how == 1:
        return text_of(draw(hostile_values)).encode()
    data = text_of(draw(hostile_doc(valid))).encode()
    if how == 5 and data:  # torn or undecodable
        at = draw(st.integers(0, len(data) - 1))
        data = data[:at] + draw(st.sampled_from([b"", b"\xff", b"\xc3\x28", b"\xed\xa0\x80"])) + data[at + 1 :]
    return data


HYPOTHESIS = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
)


# -- every record kind under the job's prefix ---------------------------------------------------------
ROUND = RoundRecord(
    round=3,
    members=[Member("a", "uid-a"), Member("b", "uid-b")],
    nproc_per_node=2,
    reason=WORKER_EXIT,
    created_at=NOW,
    failure_times=[NOW - 5],
    restarts_by_cause={WORKER_EXIT: 1},
    failure_signatures=["worker_exit|3|boom"],
    excluded={"c": NOW + 60},
)
STATUS = NodeStatus(
    round=3,
    state="running",
    step=40,
    step_time_s=0.25,
    heartbeat_age_s=0.5,
    host="host-b",
    pid=22,
    updated_at=NOW,
    device_hours={"productive": 1.5},
    busy_s=0.2,
    stragglers=["a"],
    stalled=[RankStall(2, "waiting", NOW - 30, 7, "0", "gloo:all_reduce [4] Float")],
    hang_dumped_round=3,
)
#: (key of a hostile record, the valid document its kind holds)
RECORD_KINDS: list[tuple[str, Any]] = [
    (KEYS.node("zz"), asdict(NodeRecord("zz", "uid-z", "host-z", 33, 2, NOW))),
    (KEYS.node("b"), asdict(NodeRecord("b", "uid-b", "host-b", 22, 2, NOW))),
    (KEYS.status("b"), json.loads(STATUS.to_json())),
    (KEYS.status("zz"), json.loads(STATUS.to_json())),
    (KEYS.round_record(3), json.loads(ROUND.to_json())),
    (KEYS.round_record(9), json.loads(ROUND.to_json()) | {"round": 9}),
    (KEYS.report(3, "b"), asdict(Report(FAILED, HANG, "no heartbeat", "uid-b", NOW, 40, "boom", 2))),
    (KEYS.stragglers(3), ["a", "b"]),
    (KEYS.dump, asdict(DumpRequest("ab12", NOW))),
    (KEYS.final, asdict(FinalStatus("failed", "too many restarts", 3, NOW, 30))),
    (KEYS.leader, "b"),
    (KEYS.round, 3),
    (KEYS.master(3), "host-b:29500"),
    (KEYS.hang(3), "b"),
    (KEYS.started(3, "b"), "uid-b"),
    (KEYS.commits + "40", "{}"),
    (KEYS.prefix + "rounds/²/master", "host-b:29500"),
    (KEYS.prefix + "tally/١٢/reports/b", asdict(Report(FAILED, HANG))),
    (KEYS.prefix + "commits/²", "{}"),
]
#: a valid job beside the hostile record: each of these must still be read
VALID_JOB = {
    KEYS.node("a"): NODE_A.to_json(),
    KEYS.leader: "a",
    KEYS.round: "3",
    KEYS.round_record(3): ROUND.to_json(),
    KEYS.master(3): "host-a:29500",
    KEYS.status("a"): STATUS.to_json(),
}


def _job_with(key: str, data: bytes) -> list[KeyValue]:
    kvs = {k: kv(k, v, lease=7 if k == KEYS.leader else 0) for k, v in VALID_JOB.items()}
    kvs[key] = kv(key, data, mod_revision=50, lease=7 if key == KEYS.leader else 0)
    return [kvs[k] for k in sorted(kvs)]


@HYPOTHESIS
@given(st.data())
def test_every_record_kind_survives_hostile_values_and_is_reported(data):
    key, valid = data.draw(st.sampled_from(RECORD_KINDS), label="kind")
    raw = data.draw(hostile_bytes(valid), label="record")
    kvs = _job_with(key, raw)
    decoded = decode(KEYS, next(x for x in kvs if x.key == key))  # never raises
    state = JobState.parse(KEYS, kvs, revision=60)  # never raises
    if decoded.error:  # a bad record is reported, once, under its key and revision
        assert Problem(key, 50, decoded.error) in state.problems
        str(state.problems[0]).encode("utf-8")
    untouched = {k for k in VALID_JOB if k != key}
    if KEYS.node("a") in untouched:  # the valid records beside it are still read
        assert state.nodes["a"].host == "host-a"
    if KEYS.status("a") in untouched:
        assert state.status["a"].step == 40
    # what a hostile record that passed holds is still usable by the agent's readers
    for g in [*state.rounds, state.round]:
        hang_view.where(state, g)
        hang_view.stalls_of(state, g, "a")
        hang_view.others_moving(state, g, "a", now_wall=NOW)
        hang_view.others_dumped(state, g, "a")
        hang_view.hang_reported_by(state, g, "a")
    repr(state).encode("utf-8")


def test_a_round_record_that_asks_for_more_workers_than_a_node_can_run_is_refused():
    for bad in ({"nproc_per_node": 10**9}, {"nproc_per_node": 0}, {"round": 2**63 - 1}):
        raw = json.dumps(json.loads(ROUND.to_json()) | bad)
        state = JobState.parse(KEYS, _job_with(KEYS.round_record(3), raw.encode()), revision=60)
        assert state.current is None and [p.key for p in state.problems] == [KEYS.round_record(3)]
        assert hang_view.where(state, 3) == {}  # never a table of a billion ranks


def test_a_round_segment_that_only_looks_like_a_number_is_a_bad_record():
    state = JobState.parse(KEYS, _job_with(KEYS.prefix + "rounds/²/master", b"host-a:29500"), revision=60)
    assert state.masters == {3: "host-a:29500"} and "not a round number" in state.problems[0].error
    with pytest.raises(ValueError):
        from ftrain.agents.records import parse_master  # noqa: PLC0415

        parse_master("host:²")


def test_checkers_of_nested_hints_refuse_hostile_values_with_type_errors():
    for value in ([10**400], {"x": 10**400}, [[[]]], {"x": "y"}):
        with pytest.raises(TypeError):
            checker(list[float])(value, "f") if isinstance(value, list) else checker(dict[str, int])(value, "f")


# -- every datagram kind of the heartbeat channel ----------------------------------------------------
DATAGRAMS = [
    _beat(5, phase="training", step_time_s=0.1, phases_s={"forward": 0.05, "comm_wait": 0.01}, committed_step=4),
    {**_beat(6), "kind": "exit", "finished": False, "error": "boom", "fatal": True},
    {
        **_beat(-1),
        "kind": "alive",
        "recording": True,
        "in_flight_seq": 3,
        "in_flight_group": "0",
        "in_flight": "gloo:all_reduce",
        "in_flight_s": 1.5,
    },
]


@pytest.fixture(scope="module")
def hb_server():
    with _short_dir() as d:
        server = HeartbeatServer(os.path.join(d, "hb.sock"))
        try:
            yield server
        finally:
            server.close()


@HYPOTHESIS
@given(data=st.data())
def test_every_datagram_kind_survives_hostile_values_and_is_counted(hb_server, data):
    valid = data.draw(st.sampled_from(DATAGRAMS), label="kind")
    raw = data.draw(hostile_bytes(valid), label="datagram")
    try:
        round_, _, beat = parse_beat(raw, 1.0)
        malformed = False
        json.dumps(asdict(beat)).encode()  # what it says can be printed and forwarded
    except ValueError:  # the only error a datagram may cause
        malformed = True
    hb_server.reset(1)
    dropped = hb_server.dropped
    hb_server._handle(raw)  # what the receiver thread does with it
    assert hb_server.dropped == dropped + malformed
    step = data.draw(st.integers(0, 10**6), label="next step")
    hb_server._handle(json.dumps(_beat(step)).encode())  # a valid beat after it is received
    assert hb_server.beats()[0].step == step


# -- the control channel (agent -> worker) -------------------------------------------------------------
ASSIGNMENT = Assignment(3, 1, 4, 1, 2, 0, 2, "10.0.0.1", 29500, committed_step=20)


@HYPOTHESIS
@given(data=st.data())
def test_every_assignment_survives_hostile_values(data):
    raw = data.draw(hostile_bytes(json.loads(ASSIGNMENT.encode())), label="assignment")
    try:
        assignment = Assignment.decode(raw)
    except ValueError:  # the only error a control file may cause
        return
    assert all(isinstance(v, str) and v.isprintable() for v in assignment.env().values())


def test_a_control_file_that_is_hostile_or_not_a_file_is_a_value_error_and_a_good_one_is_read_after():
    with _short_dir() as d:
        control = ControlFile(os.path.join(d, "control.json"))
        for hostile in (with_raw(json.loads(ASSIGNMENT.encode()), "round", HUGE), "[" * 100_000, "{}" * 50_000):
            with open(control.path, "w") as fh:
                fh.write(hostile)
            with pytest.raises(ValueError):
                control.read()
        os.unlink(control.path)
        os.mkfifo(control.path)  # a reader would wait forever on a FIFO
        with pytest.raises(ValueError, match="not a regular file"):
            control.read()
        os.unlink(control.path)
        with pytest.raises(ValueError, match="master_addr"):
            Assignment.decode(json.dumps({**json.loads(ASSIGNMENT.encode()), "master_addr": "host\n"}).encode())
        control.write(ASSIGNMENT)
        assert control.read() == ASSIGNMENT


# -- flight records and the event log --------------------------------------------------------------------
FLIGHT = FlightRecord(
    0,
    1234,
    NOW,
    [Collective(3, "0", "gloo:all_reduce", [[4]], ["Float"], "started", False, NOW - 9, NOW - 9)],
    {"0": [0, 1]},
    nonce="ab",
)


@HYPOTHESIS
@given(data=st.data())
def test_every_flight_record_survives_hostile_values_and_is_a_problem_of_its_round(data):
    valid = FLIGHT.to_dict()
    if data.draw(st.booleans(), label="inside an entry"):  # one field of one collective
        entry = data.draw(hostile_doc(asdict(FLIGHT.entries[0])), label="entry")
        raw = text_of(valid | {"entries": [entry]}).encode()
    else:
        raw = data.draw(hostile_bytes(valid), label="record")
    try:
        FlightRecord.decode(raw)
    except ValueError:  # the only error a record may cause
        pass
    obj = parse_line(raw)  # as a hang event's records are read from the event log (NaN read as a float)
    if obj is None:
        return
    try:
        FlightRecord.decode(obj)
        refused = False
    except ValueError:
        refused = True
    (evidence,) = from_events([hang_event({"0": obj, "1": FLIGHT.to_dict()})])
    assert 1 in evidence.records  # the valid one beside it is taken
    assert bool(evidence.problems) == refused
    evidence.verdict()


@HYPOTHESIS
@given(data=st.data())
def test_event_log_readers_skip_hostile_lines_and_keep_reading(data):
    valid_events = [
        hang_event({"0": FLIGHT.to_dict()}),
        {"time": NOW, "event": "round_formed", "new_round": 2, "members": ["a"], "world_size": 2, "reason": "start"},
        {"time": NOW, "event": "node_host", "node": "b", "host": "10.0.0.2", "hostname": "b"},
        {"step": 3, "time": NOW, "loss": 1.5, "world_size": 2, "phases_s": {"forward": 0.1}, "rank_busy_s": [0.1]},
    ]
    lines = data.draw(st.lists(st.sampled_from(valid_events).flatmap(hostile_bytes), max_size=4), label="lines")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "events.jsonl")
        with open(path, "wb") as fh:
            fh.write(b"".join(line.replace(b"\n", b" ") + b"\n" for line in lines))
            fh.write(json.dumps(valid_events[1]).encode() + b"\n")
        read = read_jsonl(path)
    assert all(isinstance(e, dict) for e in read) and read[-1] == valid_events[1]  # a valid line after them is read
    for e in read:
        parse(e)
    for evidence in from_events(read):
        evidence.verdict()
    report = build([m for m in read if isinstance(m.get("step"), int)], read)
    json.dumps(report)


def test_a_manifest_is_refused_with_a_manifest_error_whatever_it_holds():
    @HYPOTHESIS
    @given(data=st.data())
    def check(data):
        raw = data.draw(hostile_bytes({"format": 2, "step": 1, "files": {".metadata": {"size_bytes": 1}}}))
        with pytest.raises(ManifestError):
            Manifest.from_json(raw)

    check()


# -- the checkpoint fence's commit records and the memory tier's wire ------------------------------------
def test_a_hostile_commit_record_is_ignored_never_raised():
    from ftrain.agent_link.fence import _parse_record  # noqa: PLC0415 - the worker side of the fence

    prefix = KEYS.commits

    def record(key: str, value: bytes, revision: Any = "3") -> dict[str, Any]:
        b64 = base64.b64encode
        return {"key": b64(key.encode()).decode(), "value": b64(value).decode(), "mod_revision": revision}

    good = json.dumps({"digest": "a" * 64}).encode()
    assert _parse_record(prefix, record(prefix + "5", good)) == (5, "a" * 64, 3)
    for bad in (
        record(prefix + "5", b"[" * 100_000),  # a RecursionError out of the worker's commit before
        record(prefix + "5", b'{"digest": ' + HUGE.encode() + b"}"),
        record(prefix + "5", b'{"digest": "\xff"}'),
        record(prefix + "²", good),
        record(prefix + "5", good, revision=[1]),
    ):
        assert _parse_record(prefix, bad) is None


def test_the_memory_tier_wire_allocates_nothing_past_its_bounds():
    import torch.distributed as dist  # noqa: PLC0415 - the one test here that needs torch

    from ftrain.recovery.tier_wire import WireError, all_gather_json, broadcast_bytes  # noqa: PLC0415

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        group = dist.group.WORLD
        assert broadcast_bytes(b"x" * 100, 0, group, max_bytes=10) == b""  # never allocated on a receiver
        assert broadcast_bytes(b"x" * 10, 0, group, max_bytes=10) == b"x" * 10
        with pytest.raises(WireError, match="at most 10"):
            all_gather_json({"a": "x" * 100}, group, max_bytes=10)
        with pytest.raises(WireError, match="40 digits"):
            all_gather_json({"step": 10**400}, group)
        assert all_gather_json({"step": 3, "files": ["a"]}, group) == [{"step": 3, "files": ["a"]}]
    finally:
        dist.destroy_process_group()
