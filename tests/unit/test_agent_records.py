"""What an agent records and reports: the job's etcd records (JobKeys, JobState.parse), the
worker heartbeat channel, the Prometheus metrics and the ``ftrain status`` table.

No etcd here: records are parsed from ``KeyValue`` objects built by hand (``job_status`` against
a real etcd is in tests/integration/test_agent_status.py). Heartbeats use a real Unix socket in a
short temporary directory; waits poll a condition until a deadline.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from agents.etcd import KeyValue
from agents.heartbeat import HeartbeatServer
from agents.metrics import AgentMetrics
from agents.records import (FAILED, HANG, NODE_LOST, SUCCEEDED, WORKER_EXIT, FinalStatus, JobKeys, JobState, Member,
                            NodeRecord, NodeStatus, Report, RoundRecord)
from agents.status import format_status
from ftrain.heartbeat import Heartbeat, process_gone

KEYS = JobKeys("job-7")


def kv(key: str, value: str, *, create_revision: int = 1, mod_revision: int | None = None, lease: int = 0) -> KeyValue:
    return KeyValue(key, value.encode(), create_revision, mod_revision or create_revision, 1, lease)


def wait_for(condition: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


# -- JobKeys -----------------------------------------------------------------------------------
def test_job_keys_layout() -> None:
    p = "/ftrain/jobs/job-7/"
    assert KEYS.prefix == p
    assert KEYS.node("n1") == p + "nodes/n1"
    assert KEYS.leader == p + "leader"
    assert KEYS.round == p + "round"
    assert KEYS.round_record(12) == p + "rounds/12"
    assert KEYS.master(12) == p + "rounds/12/master"
    assert KEYS.started(12, "n1") == p + "rounds/12/started/n1"
    assert KEYS.report(12, "n1") == p + "rounds/12/reports/n1"
    assert KEYS.status("n1") == p + "status/n1"
    assert KEYS.final == p + "final"


@pytest.mark.parametrize("job", ["", "a/b", "/"])
def test_job_id_must_be_one_path_segment(job: str) -> None:
    with pytest.raises(ValueError, match="bad job id"):
        JobKeys(job)


# -- JobState.parse ----------------------------------------------------------------------------
def test_parse_round_trips_every_record() -> None:
    a = NodeRecord("a", "uid-a", "host-a", 11, 4, 1000.5)
    b = NodeRecord("b", "uid-b", "host-b", 22, 4, 1001.5)
    record = RoundRecord(round=3, members=[b.member(), a.member()], nproc_per_node=4, reason=WORKER_EXIT,
                         created_at=1010.0, failure_times=[1005.0, 1009.5],
                         restarts_by_cause={WORKER_EXIT: 1, NODE_LOST: 1})
    failed = Report(FAILED, HANG, "no heartbeat from local rank(s) [1]", "uid-b", 1009.5)
    status = NodeStatus(round=3, state="running", step=40, step_time_s=0.25, heartbeat_age_s=None,
                        committed_step=30, restarts=2, host="host-a", pid=11, updated_at=1020.0)
    final = FinalStatus(SUCCEEDED, "every node finished training", 3, 1030.0)
    kvs = [
        kv(KEYS.node("a"), a.to_json(), create_revision=7, lease=0xA),
        kv(KEYS.node("b"), b.to_json(), create_revision=5, lease=0xB),
        kv(KEYS.leader, "b", create_revision=6, lease=0xB),
        kv(KEYS.round, "3", create_revision=8, mod_revision=20),
        kv(KEYS.round_record(3), record.to_json(), create_revision=20),
        kv(KEYS.master(3), "host-b:29500", create_revision=21),
        kv(KEYS.started(3, "a"), "uid-a", create_revision=22),
        kv(KEYS.started(3, "b"), "uid-b", create_revision=23),
        kv(KEYS.report(2, "b"), failed.to_json(), create_revision=19),
        kv(KEYS.status("a"), status.to_json(), create_revision=9, mod_revision=24, lease=0xA),
        kv(KEYS.final, final.to_json(), create_revision=25),
    ]
    state = JobState.parse(KEYS, kvs, revision=25)

    assert state.revision == 25
    assert state.nodes == {"a": replace(a, create_revision=7), "b": replace(b, create_revision=5)}  # join order
    assert (state.leader, state.leader_lease) == ("b", 0xB)
    assert (state.round, state.round_mod_revision) == (3, 20)
    assert state.rounds == {3: record}
    assert state.current == record
    assert state.masters == {3: "host-b:29500"}
    assert state.started == {3: {"a", "b"}}
    assert state.reports == {2: {"b": failed}}
    assert state.status == {"a": status}
    assert state.final == final


def test_empty_job_has_no_round() -> None:
    state = JobState.parse(KEYS, [], revision=4)
    assert (state.round, state.round_mod_revision, state.current, state.leader, state.final) == (0, 0, None, None, None)
    assert state.live_members() == []


def test_node_record_json_leaves_out_the_create_revision() -> None:
    assert "create_revision" not in json.loads(NodeRecord("a", "u", "h", 1, 1, 0.0, create_revision=9).to_json())


def test_live_members_in_join_order_not_name_order() -> None:
    kvs = [kv(KEYS.node(n), NodeRecord(n, f"uid-{n}", "h", 1, 1, 0.0).to_json(), create_revision=rev)
           for n, rev in (("a", 30), ("b", 10), ("c", 20))]
    state = JobState.parse(KEYS, kvs, revision=30)
    assert state.live_members() == [Member("b", "uid-b"), Member("c", "uid-c"), Member("a", "uid-a")]


@pytest.mark.parametrize(("key", "value"), [
    (KEYS.node("a"), "{not json"),
    (KEYS.node("a"), json.dumps({"node_id": "a"})),  # fields missing
    (KEYS.round, "three"),
    (KEYS.round_record(3), json.dumps({"round": 3})),
    (KEYS.round_record(3) + "x", RoundRecord(3, [], 1, "start", 0.0).to_json()),  # round number not a number
    (KEYS.report(3, "a"), json.dumps({"outcome": "failed", "colour": "red"})),  # unknown field
    (KEYS.status("a"), "[]"),
    (KEYS.final, "null"),
])
def test_unreadable_record_names_its_key(key: str, value: str) -> None:
    with pytest.raises(ValueError, match=re.escape(f"unreadable job record {key}:")):
        JobState.parse(KEYS, [kv(key, value)], revision=1)


def _round_with_reports(*reports: tuple[str, Report]) -> JobState:
    record = RoundRecord(2, [Member("a", "uid-a2"), Member("b", "uid-b")], 1, NODE_LOST, 0.0)
    kvs = [kv(KEYS.round, "2"), kv(KEYS.round_record(2), record.to_json())]
    kvs += [kv(KEYS.report(2, node), r.to_json()) for node, r in reports]
    return JobState.parse(KEYS, kvs, revision=9)


def test_member_reports_ignore_an_earlier_agent_process_of_the_same_node() -> None:
    current = Report(FAILED, WORKER_EXIT, agent_uid="uid-b", time=5.0)
    state = _round_with_reports(("a", Report(FAILED, WORKER_EXIT, agent_uid="uid-a1", time=4.0)), ("b", current))
    assert set(state.reports[2]) == {"a", "b"}  # both are in etcd
    assert state.member_reports(2) == {"b": current}  # only b's is from the member


def test_member_reports_ignore_non_members_and_unknown_rounds() -> None:
    state = _round_with_reports(("c", Report(SUCCEEDED, agent_uid="uid-c")), ("a", Report(SUCCEEDED)))
    assert state.member_reports(2) == {}
    assert state.member_reports(1) == {}


def test_round_record_node_rank_and_world_size() -> None:
    a, b = Member("a", "1"), Member("b", "2")
    record = RoundRecord(4, [b, a], 8, NODE_LOST, 0.0)
    assert record.world_size == 16
    assert (record.node_rank(b), record.node_rank(a)) == (0, 1)
    assert record.node_rank(Member("a", "other process")) is None


# -- heartbeats ---------------------------------------------------------------------------------
def short_socket_dir() -> tempfile.TemporaryDirectory:
    # A Unix socket path must fit in 108 bytes; pytest's tmp_path may not.
    return tempfile.TemporaryDirectory(prefix="ftrain-hb-")


@pytest.fixture(scope="module")
def shared_server() -> Iterator[HeartbeatServer]:
    """One server for the module (closing one takes up to its 0.5 s receive timeout)."""
    with short_socket_dir() as d:
        server = HeartbeatServer(os.path.join(d, "hb.sock"))
        try:
            yield server
        finally:
            server.close()


_rounds = itertools.count(100)


@dataclass
class Channel:
    """The agent's server, reset to a round of this test's own (so a late datagram of another
    test belongs to another round), and the workers' senders."""
    server: HeartbeatServer
    round: int
    senders: list[Heartbeat] = field(default_factory=list)

    def worker(self, local_rank: int, *, round_: int | None = None) -> Heartbeat:
        hb = Heartbeat(self.server.path, round_=self.round if round_ is None else round_, rank=10 + local_rank,
                       local_rank=local_rank)
        self.senders.append(hb)
        return hb

    def send_raw(self, data: bytes) -> None:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.sendto(data, self.server.path)

    def received(self, local_rank: int, timeout_s: float = 5.0) -> bool:
        return wait_for(lambda: local_rank in self.server.beats(), timeout_s)


@pytest.fixture
def channel(shared_server: HeartbeatServer) -> Iterator[Channel]:
    ch = Channel(shared_server, next(_rounds))
    shared_server.reset(ch.round)
    try:
        yield ch
    finally:
        for hb in ch.senders:
            hb.close()


def test_beat_reaches_the_server(channel: Channel) -> None:
    channel.worker(1).beat(17, phase="saving", step_time_s=0.5, committed_step=10)
    assert channel.received(1)
    beat = channel.server.beats()[1]
    assert (beat.local_rank, beat.rank, beat.pid, beat.step, beat.step_time_s, beat.committed_step, beat.phase) == (
        1, 11, os.getpid(), 17, 0.5, 10, "saving")
    assert beat.finished is None
    assert beat.received_at <= time.monotonic()


def test_newest_beat_of_each_local_rank_is_kept(channel: Channel) -> None:
    hb0 = channel.worker(0)
    for step in range(3):
        hb0.beat(step)
    channel.worker(1).beat(7)
    assert channel.received(1)  # queued after every beat of local rank 0
    assert {r: b.step for r, b in channel.server.beats().items()} == {0: 2, 1: 7}


def test_beats_of_another_round_are_ignored(channel: Channel) -> None:
    channel.worker(0, round_=channel.round - 1).beat(100)  # a zombie of the previous round
    channel.worker(1).beat(1)
    assert channel.received(1)  # the zombie's beat was queued before it
    assert list(channel.server.beats()) == [1]
    channel.server.reset(next(_rounds))  # a new round forgets the old one's beats
    assert channel.server.beats() == {}


def test_exit_message_sets_finished_and_it_sticks(channel: Channel) -> None:
    hb0, hb1 = channel.worker(0), channel.worker(1)
    hb0.exit(20, finished=True, committed_step=20)
    hb1.exit(12, finished=False)
    assert wait_for(lambda: len(channel.server.beats()) == 2)
    beats = channel.server.beats()
    assert (beats[0].finished, beats[1].finished, beats[0].committed_step) == (True, False, 20)
    hb0.beat(21)  # a beat after the exit message does not undo it
    assert wait_for(lambda: channel.server.beats()[0].step == 21)
    assert channel.server.beats()[0].finished is True


@pytest.mark.parametrize("garbage", [b"not json", b"\xc3\x28", b"\xff\xfe", b"[1, 2]", b"7", b'{"round": 100}',
                                     b'{"round": "five", "local_rank": 0}', b'{"local_rank": 0}'])
def test_malformed_datagram_is_ignored(channel: Channel, garbage: bytes) -> None:
    channel.send_raw(garbage)
    channel.worker(1).beat(3)
    assert channel.received(1)
    assert list(channel.server.beats()) == [1]


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_datagram_with_a_bad_field_value_does_not_stop_the_server() -> None:
    with short_socket_dir() as d:
        server = HeartbeatServer(os.path.join(d, "hb.sock"))  # its own: this one may lose its thread
        server.reset(1)
        channel = Channel(server, 1)
        try:
            channel.send_raw(json.dumps({"kind": "beat", "round": 1, "local_rank": 0, "step": None}).encode())
            channel.worker(1).beat(3)
            assert channel.received(1, timeout_s=1.0)
        finally:
            channel.senders[0].close()
            server.close()


def test_sending_without_an_agent_never_raises() -> None:
    with short_socket_dir() as d:
        hb = Heartbeat(os.path.join(d, "nobody.sock"), round_=1, rank=0, local_rank=0)
        try:
            hb.beat(1)
            hb.exit(1, finished=True)
        finally:
            hb.close()


def test_process_gone() -> None:
    assert process_gone(os.getpid()) is False
    child = subprocess.Popen([sys.executable, "-c", ""])
    try:
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped: a zombie
        assert process_gone(child.pid) is True
    finally:
        child.wait()
    assert process_gone(child.pid) is True  # reaped: no /proc entry


# -- metrics -----------------------------------------------------------------------------------
def scrape(port: int) -> dict[tuple[str, frozenset], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_served_on_a_free_port() -> None:
    metrics = AgentMetrics("job-7", "n1")
    port = metrics.serve(0)
    try:
        assert port > 0 and metrics.port == port
        metrics.round.set(4)
        metrics.count_restart(2, HANG)
        metrics.count_restart(2, HANG)  # every agent of round 2 sees it many times: counted once
        metrics.count_restart(4, WORKER_EXIT)
        samples = scrape(port)
    finally:
        metrics.close()
    node = {("job", "job-7"), ("node", "n1")}
    assert samples[("ftrain_round", frozenset(node))] == 4
    assert samples[("ftrain_restarts_total", frozenset(node | {("cause", HANG)}))] == 1
    assert samples[("ftrain_restarts_total", frozenset(node | {("cause", WORKER_EXIT)}))] == 1
    assert metrics.restarts() == 2


# -- ftrain status -----------------------------------------------------------------------------
def _node(node: str, **fields: object) -> dict[str, object]:
    return {"node": node, "live": True, "member": True, "node_rank": 0, "leader": False, "host": f"host-{node}",
            "agent_pid": 10, "state": "running", "worker_round": 3, "step": 40, "heartbeat_age_s": 0.3,
            "status_age_s": 0.5, "restarts_seen": 2} | fields


def _status(**fields: object) -> dict[str, object]:
    return {"job": "job-7", "revision": 50, "leader": "a", "round": 3, "round_reason": HANG, "world_size": 8,
            "members": ["a", "b"], "restarts_by_cause": {HANG: 1, NODE_LOST: 1}, "restarts": 2,
            "last_committed_step": 30, "final": None,
            "nodes": [_node("a", leader=True), _node("b", node_rank=1, heartbeat_age_s=None),
                      _node("c", live=False, member=False, node_rank=None, host="host-c", state="", worker_round=None,
                            step=None, heartbeat_age_s=None, status_age_s=None)]} | fields


def test_format_status_renders_a_row_per_node() -> None:
    lines = format_status(_status()).splitlines()
    assert lines[0] == "job job-7: running round 3 (hang), world size 8"
    assert lines[1] == "leader a; members a, b; last committed step 30; restarts 2 (hang 1, node_lost 1)"
    assert lines[2] == ""
    table = [line.split() for line in lines[3:]]
    assert table[0] == ["node", "live", "rank", "leader", "host", "state", "round", "step", "hb", "age", "s",
                        "status", "age", "s"]
    assert table[1:] == [
        ["a", "yes", "0", "yes", "host-a", "running", "3", "40", "0.3", "0.5"],
        ["b", "yes", "1", "no", "host-b", "running", "3", "40", "-", "0.5"],
        ["c", "no", "-", "no", "host-c", "-", "-", "-", "-"],  # an empty state is a blank cell
    ]
    header, row_a = lines[3], lines[4]
    assert [header.index(c) for c in ("host", "state", "step")] == [row_a.index(c) for c in ("host-a", "running", "40")]


def test_format_status_of_a_finished_job_and_of_one_with_no_round() -> None:
    final = {"status": "failed", "reason": "restart budget exhausted", "round": 9, "time": 1.0}
    assert format_status(_status(final=final)).splitlines()[0] == (
        "job job-7: FAILED (restart budget exhausted) at round 9")
    empty = format_status(_status(round=0, leader=None, members=[], restarts_by_cause={}, restarts=0,
                                  last_committed_step=None, nodes=[])).splitlines()
    assert empty[0] == "job job-7: no round yet"
    assert empty[1] == "leader -; members -; last committed step -; restarts 0 (none)"
    assert len(empty) == 4  # the header row only
