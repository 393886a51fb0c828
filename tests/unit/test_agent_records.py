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
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ftrain.agent_link.heartbeat import Heartbeat, process_gone
from ftrain.agents.agent_options import AgentOptions
from ftrain.agents.etcd import KeyValue
from ftrain.agents.heartbeat import HeartbeatServer
from ftrain.agents.job_keys import JobKeys, validate_id
from ftrain.agents.metrics import AgentMetrics
from ftrain.agents.records import (
    FAILED,
    HANG,
    NODE_LOST,
    START,
    SUCCEEDED,
    WORKER_EXIT,
    FinalStatus,
    JobState,
    Member,
    NodeRecord,
    NodeStatus,
    Report,
    RoundRecord,
    parse_master,
)
from ftrain.agents.status import format_status
from ftrain.agents.workers import PidTracker
from ftrain.contract.accounting import CAUSES
from ftrain.testbed.wait import wait_for

KEYS = JobKeys("job-7")


def kv(key: str, value: str, *, create_revision: int = 1, mod_revision: int | None = None, lease: int = 0) -> KeyValue:
    return KeyValue(key, value.encode(), create_revision, mod_revision or create_revision, 1, lease)


# -- JobKeys -----------------------------------------------------------------------------------
def test_job_keys_layout() -> None:
    p = "/ftrain/jobs/job-7/"
    assert KEYS.prefix == p
    assert KEYS.node("n1") == p + "nodes/n1"
    assert KEYS.leader == p + "leader"
    assert KEYS.round == p + "round"
    assert KEYS.round_record(12) == p + "rounds/12"
    assert KEYS.master(12) == p + "rounds/12/master"
    assert KEYS.started(12, "n1") == p + "tally/12/started/n1"
    assert KEYS.report(12, "n1") == p + "tally/12/reports/n1"
    assert KEYS.status("n1") == p + "status/n1"
    assert KEYS.final == p + "final"


@pytest.mark.parametrize("job", ["", "a/b", "/", "a b", "-x", ".hidden", "a" * 65, "job\n", "ü"])
def test_job_id_must_be_one_path_segment(job: str) -> None:
    with pytest.raises(ValueError, match=r"--job: bad id .*A-Z a-z 0-9"):
        JobKeys(job)


@pytest.mark.parametrize("node", ["a/b", "", "node 1", "../x", "n" * 65])
def test_agent_options_refuse_a_bad_node_id_naming_the_option(node: str) -> None:
    opts = AgentOptions.of(
        etcd=["http://127.0.0.1:1"],
        job="j",
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=1,
        worker_args=["c.toml"],
        node_id=node,
    )
    with pytest.raises(ValueError, match="--node-id: bad id"):
        opts.validate()


@pytest.mark.parametrize("good", ["a", "node-1", "host.example.com", "N_7", "x" * 64])
def test_valid_ids(good: str) -> None:
    assert validate_id(good, "--node-id") == good


# -- JobState.parse ----------------------------------------------------------------------------
def test_parse_round_trips_every_record() -> None:
    a = NodeRecord("a", "uid-a", "host-a", 11, 4, 1000.5)
    b = NodeRecord("b", "uid-b", "host-b", 22, 4, 1001.5)
    record = RoundRecord(
        round=3,
        members=[b.member(), a.member()],
        nproc_per_node=4,
        reason=WORKER_EXIT,
        created_at=1010.0,
        failure_times=[1005.0, 1009.5],
        restarts_by_cause={WORKER_EXIT: 1, NODE_LOST: 1},
    )
    failed = Report(FAILED, HANG, "no heartbeat from local rank(s) [1]", "uid-b", 1009.5)
    status = NodeStatus(
        round=3,
        state="running",
        step=40,
        step_time_s=0.25,
        heartbeat_age_s=None,
        committed_step=30,
        restarts=2,
        host="host-a",
        pid=11,
        updated_at=1020.0,
    )
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
    kvs = [
        kv(KEYS.node(n), NodeRecord(n, f"uid-{n}", "h", 1, 1, 0.0).to_json(), create_revision=rev)
        for n, rev in (("a", 30), ("b", 10), ("c", 20))
    ]
    state = JobState.parse(KEYS, kvs, revision=30)
    assert state.live_members() == [Member("b", "uid-b"), Member("c", "uid-c"), Member("a", "uid-a")]


@pytest.mark.parametrize(
    ("key", "value"),
    [
        (KEYS.node("a"), "{not json"),
        (KEYS.node("a"), json.dumps({"node_id": "a"})),  # fields missing
        (KEYS.node("a"), json.dumps({**json.loads(NodeRecord("a", "u", "h", 1, 1, 0.0).to_json()), "pid": "11"})),
        (KEYS.node("a"), NodeRecord("b", "u", "h", 1, 1, 0.0).to_json()),  # another node's record under a's key
        (KEYS.node("a"), b"\xff\xfe".decode("latin-1")),
        (KEYS.round_record(3), json.dumps({"round": 3})),
        (KEYS.round_record(3) + "x", RoundRecord(3, [Member("a", "u")], 1, "start", 0.0).to_json()),
        (KEYS.round_record(3), RoundRecord(4, [Member("a", "u")], 1, "start", 0.0).to_json()),  # wrong round inside
        (KEYS.report(3, "b"), json.dumps({"outcome": 7})),
        (KEYS.status("a"), "[]"),
        (KEYS.status("a"), json.dumps({"step": True})),  # a bool is not a step
        (KEYS.status("a"), json.dumps({"step": 1.5})),
        (KEYS.status("a"), "[" * 100_000),  # deeper than the JSON parser goes
        (KEYS.final, "null"),
        (KEYS.final, json.dumps({"status": "maybe", "reason": "", "round": 1, "time": 0})),
        (KEYS.master(3), "no-port"),
        (KEYS.master(3), "host:99999"),
        (KEYS.master(3), "bad host:1234"),
        (KEYS.leader, "a"),  # no lease: agents always put the leader key on theirs
    ],
)
def test_an_unreadable_record_is_skipped_and_named_never_fatal(key: str, value: str) -> None:
    good = NodeRecord("z", "uid-z", "h", 1, 1, 0.0)
    state = JobState.parse(KEYS, [kv(key, value, mod_revision=5), kv(KEYS.node("z"), good.to_json())], revision=9)
    assert [(p.key, p.mod_revision) for p in state.problems] == [(key, 5)]
    assert str(state.problems[0]).startswith(f"unreadable job record {key} (revision 5): ")
    assert list(state.nodes) == ["z"]  # the readable records are all there; a garbage node is not live
    assert state.status == {} and state.final is None and state.leader is None and state.masters == {}


def test_records_from_a_newer_version_with_extra_fields_are_read() -> None:
    report = json.dumps({**json.loads(Report(FAILED, HANG, "x", "uid-a", 1.0).to_json()), "colour": "red"})
    status = json.dumps({**json.loads(NodeStatus(step=4).to_json()), "gpu_temp_c": 71})
    state = JobState.parse(KEYS, [kv(KEYS.report(3, "a"), report), kv(KEYS.status("a"), status)], revision=2)
    assert state.problems == []
    assert state.reports[3]["a"] == Report(FAILED, HANG, "x", "uid-a", 1.0)
    assert state.status["a"].step == 4


def test_records_of_an_older_version_without_the_new_fields_are_read() -> None:
    old_report = json.dumps({"outcome": "failed", "reason": "worker_exit", "detail": "", "agent_uid": "u", "time": 1})
    old_round = json.dumps(
        {
            "round": 2,
            "members": [{"node_id": "a", "agent_uid": "u"}],
            "nproc_per_node": 1,
            "reason": "start",
            "created_at": 0,
            "failure_times": [],
            "restarts_by_cause": {},
        }
    )
    state = JobState.parse(KEYS, [kv(KEYS.report(2, "a"), old_report), kv(KEYS.round_record(2), old_round)], 3)
    assert state.problems == []
    assert (state.reports[2]["a"].step, state.reports[2]["a"].error) == (-1, "")
    assert state.rounds[2].failure_signatures == [] and state.rounds[2].created_at == 0.0


def test_an_unreadable_round_key_is_never_acted_on() -> None:
    record = RoundRecord(4, [Member("a", "u")], 1, START, 0.0)
    kvs = [
        kv(KEYS.round, "four", mod_revision=30),
        kv(KEYS.round_record(4), record.to_json()),
        kv(KEYS.started(6, "a"), "u"),
    ]  # round 6 got as far as a started key: 6 is the highest number in use
    state = JobState.parse(KEYS, kvs, revision=31)
    assert state.round_unreadable and not state.round_known and state.current is None
    assert (state.round, state.round_mod_revision) == (6, 30)  # a repair round is formed above every number used
    assert state.newest_record() == record


def test_an_unreadable_record_of_the_current_round_is_never_acted_on() -> None:
    older = RoundRecord(2, [Member("a", "u")], 1, START, 0.0)
    kvs = [kv(KEYS.round, "3"), kv(KEYS.round_record(3), "{garbage"), kv(KEYS.round_record(2), older.to_json())]
    state = JobState.parse(KEYS, kvs, revision=5)
    assert state.current is None and not state.round_known and state.round == 3
    assert state.newest_record() == older


def test_an_unreadable_report_of_a_member_counts_as_a_failure_never_a_success() -> None:
    record = RoundRecord(2, [Member("a", "uid-a"), Member("b", "uid-b")], 1, START, 0.0)
    kvs = [
        kv(KEYS.round, "2"),
        kv(KEYS.round_record(2), record.to_json()),
        kv(KEYS.report(2, "a"), Report(SUCCEEDED, agent_uid="uid-a").to_json()),
        kv(KEYS.report(2, "b"), '{"outcome": "succeeded", "agent_uid": 5}'),
        kv(KEYS.report(2, "c"), "junk"),
    ]  # not a member: ignored
    reports = JobState.parse(KEYS, kvs, revision=5).member_reports(2)
    assert set(reports) == {"a", "b"}
    assert reports["b"].outcome == FAILED and "unreadable report" in reports["b"].detail


def test_a_malformed_master_is_recorded_per_round() -> None:
    state = JobState.parse(KEYS, [kv(KEYS.master(3), "host:0"), kv(KEYS.master(4), "h:29500")], revision=2)
    assert state.masters == {4: "h:29500"}
    assert "malformed master address 'host:0'" in state.bad_masters[3]
    assert parse_master("[::1]:29500") == ("[::1]", 29500)


def test_an_unreadable_final_is_replaceable_and_a_leaderless_key_is_noted() -> None:
    state = JobState.parse(KEYS, [kv(KEYS.final, "{", mod_revision=12), kv(KEYS.leader, "a", mod_revision=8)], 13)
    assert state.final is None and state.final_mod_revision == 12
    assert state.leader is None and state.leader_mod_revision == 8


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
        hb = Heartbeat(
            self.server.path,
            round_=self.round if round_ is None else round_,
            rank=10 + local_rank,
            local_rank=local_rank,
        )
        self.senders.append(hb)
        return hb

    def send_raw(self, data: bytes) -> None:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.sendto(data, self.server.path)

    def received(self, local_rank: int, timeout_s: float = 5.0) -> bool:
        return bool(
            wait_for(lambda: local_rank in self.server.beats(), timeout_s, f"a beat of local rank {local_rank}")
        )


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
        1,
        11,
        os.getpid(),
        17,
        0.5,
        10,
        "saving",
    )
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
    assert wait_for(lambda: len(channel.server.beats()) == 2, 5.0, "two beats")
    beats = channel.server.beats()
    assert (beats[0].finished, beats[1].finished, beats[0].committed_step) == (True, False, 20)
    hb0.beat(21)  # a beat after the exit message does not undo it
    assert wait_for(lambda: channel.server.beats()[0].step == 21, 5.0, "step 21")
    assert channel.server.beats()[0].finished is True


@pytest.mark.parametrize(
    "garbage",
    [
        b"not json",
        b"\xc3\x28",
        b"\xff\xfe",
        b"[1, 2]",
        b"7",
        b'{"round": 100}',
        b'{"round": "five", "local_rank": 0}',
        b'{"local_rank": 0}',
    ],
)
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
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


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
    return {
        "node": node,
        "live": True,
        "member": True,
        "node_rank": 0,
        "leader": False,
        "host": f"host-{node}",
        "agent_pid": 10,
        "state": "running",
        "worker_round": 3,
        "step": 40,
        "heartbeat_age_s": 0.3,
        "status_age_s": 0.5,
        "restarts_seen": 2,
    } | fields


def _status(**fields: object) -> dict[str, object]:
    return {
        "job": "job-7",
        "revision": 50,
        "leader": "a",
        "round": 3,
        "round_reason": HANG,
        "world_size": 8,
        "members": ["a", "b"],
        "restarts_by_cause": {HANG: 1, NODE_LOST: 1},
        "restarts": 2,
        "last_committed_step": 30,
        "final": None,
        "nodes": [
            _node("a", leader=True, recovery="live", workers_kept=2, workers_new=1),
            _node("b", node_rank=1, heartbeat_age_s=None, recovery="restart"),
            _node(
                "c",
                live=False,
                member=False,
                node_rank=None,
                host="host-c",
                state="",
                worker_round=None,
                step=None,
                heartbeat_age_s=None,
                status_age_s=None,
            ),
        ],
    } | fields


def test_format_status_renders_a_row_per_node() -> None:
    lines = format_status(_status()).splitlines()
    assert lines[0] == "job job-7: running round 3 (hang), world size 8"
    assert lines[1] == "leader a; members a, b; last committed step 30; restarts 2 (hang 1, node_lost 1)"
    assert lines[2] == ""
    table = [line.split() for line in lines[3:]]
    assert table[0] == [
        "node",
        "live",
        "rank",
        "leader",
        "host",
        "state",
        "round",
        "step",
        "recovery",
        "hb",
        "age",
        "s",
        "status",
        "age",
        "s",
    ]
    assert table[1:] == [
        ["a", "yes", "0", "yes", "host-a", "running", "3", "40", "live:", "2", "kept,", "1", "new", "0.3", "0.5"],
        ["b", "yes", "1", "no", "host-b", "running", "3", "40", "restart", "-", "0.5"],
        ["c", "no", "-", "no", "host-c", "-", "-", "-", "-"],  # an empty state is a blank cell
    ]
    header, row_a = lines[3], lines[4]
    assert [header.index(c) for c in ("host", "state", "step")] == [row_a.index(c) for c in ("host-a", "running", "40")]


def test_format_status_of_a_finished_job_and_of_one_with_no_round() -> None:
    final = {"status": "failed", "reason": "restart budget exhausted", "round": 9, "time": 1.0}
    assert format_status(_status(final=final)).splitlines()[0] == (
        "job job-7: FAILED (restart budget exhausted) at round 9"
    )
    empty = format_status(
        _status(round=0, leader=None, members=[], restarts_by_cause={}, restarts=0, last_committed_step=None, nodes=[])
    ).splitlines()
    assert empty[0] == "job job-7: no round yet"
    assert empty[1] == "leader -; members -; last committed step -; restarts 0 (none)"
    assert len(empty) == 4  # the header row only


def test_format_status_calls_out_failing_checkpoints_and_unreadable_records() -> None:
    s = _status(
        nodes=[
            _node("a", ckpt_failures=3, ckpt_failures_total=5, ckpt_error="StaleRoundError: etcd said no"),
            _node("b"),
        ],
        problems=["unreadable job record /ftrain/jobs/job-7/status/x (revision 4): JSONDecodeError: x"],
    )
    text = format_status(s)
    assert (
        "CHECKPOINTS FAILING on a: 3 commit(s) in a row failed (5 in all); last error: StaleRoundError: etcd said no"
    ) in text
    assert "on b" not in text
    assert "warning: unreadable job record /ftrain/jobs/job-7/status/x (revision 4)" in text


# -- checkpoint failures in heartbeats and metrics -------------------------------------------------
def test_beats_carry_checkpoint_failures_and_the_exit_error(channel: Channel) -> None:
    worker = channel.worker(0)
    error = "FenceAuthError: " + "x" * 5000
    worker.beat(5, committed_step=0, ckpt_failures=2, ckpt_failures_total=4, ckpt_error=error, corruptions=1)
    assert wait_for(lambda: 0 in channel.server.beats() and channel.server.beats()[0].step == 5, 5.0, "step 5")
    beat = channel.server.beats()[0]
    assert (beat.ckpt_failures, beat.ckpt_failures_total) == (2, 4) and beat.ckpt_error.startswith("FenceAuthError")
    assert beat.corruptions == 1
    worker.exit(6, finished=False, error="CheckpointFailuresError: 3 in a row", fatal=True)
    assert wait_for(lambda: channel.server.beats()[0].finished is False, 5.0, "the exit message")
    beat = channel.server.beats()[0]
    assert (beat.step, beat.error, beat.fatal) == (6, "CheckpointFailuresError: 3 in a row", True)


@pytest.mark.parametrize(
    "bad",
    [
        {"pid": -1},
        {"pid": 0},
        {"pid": 1},
        {"pid": 2**40},
        {"pid": "123"},
        {"pid": True},
        {"step": "7"},
        {"step": 7.5},
        {"step": -5},
        {"step": None},
        {"local_rank": -1},
        {"local_rank": 10**9},
        {"step_time_s": float("nan")},
        {"step_time_s": -1.0},
        {"phase": "x" * 50},
        {"kind": "explode"},
        {"fatal": "yes"},
        {"error": 5},
        {"ckpt_failures": -2},
        {"corruptions": -1},
        {"corruptions": 1.5},
    ],
)
def test_a_beat_with_one_bad_field_is_dropped_whole(channel: Channel, bad: dict) -> None:
    good = {"kind": "beat", "round": channel.round, "local_rank": 0, "rank": 0, "pid": os.getpid(), "step": 3}
    channel.send_raw(json.dumps({**good, **bad}).encode())
    channel.worker(1).beat(3)
    assert channel.received(1)
    assert list(channel.server.beats()) == [1]


def test_checkpoint_failure_metrics_count_each_failure_once() -> None:
    metrics = AgentMetrics("job-7", "n1")
    port = metrics.serve(0)
    try:
        metrics.ckpt_failed(1, total=2, consecutive=2)
        metrics.ckpt_failed(1, total=2, consecutive=2)  # the same beats, seen again: not counted again
        metrics.ckpt_failed(2, total=1, consecutive=3)  # a new round's workers count from zero
        samples = scrape(port)
    finally:
        metrics.close()
    node = frozenset({("job", "job-7"), ("node", "n1")})
    assert samples[("ftrain_checkpoint_failures_total", node)] == 3
    assert samples[("ftrain_checkpoint_consecutive_failures", node)] == 3
    assert metrics.ckpt_failures_total() == 3


# -- PIDs are signalled only while they are this torchrun's workers ---------------------------------
def test_pid_tracker_ignores_a_pid_that_is_not_a_descendant() -> None:
    root = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, sys, time; "
            "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
            "print(c.pid, flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    child = None
    try:
        child = int(root.stdout.readline())
        tracker = PidTracker(root.pid)
        tracker.note([stranger.pid, os.getpid(), -1, 0, 1, 2**40])  # announced in heartbeats, none ours
        assert tracker.live() == []
        tracker.note([child])
        assert tracker.live() == [child]
        tracker._known[child] -= 1  # as if the PID had been recycled: another process, another start time
        assert tracker.replaced(child) and tracker.live() == []
    finally:
        if child is not None:
            os.kill(child, signal.SIGKILL)
        for proc in (root, stranger):
            proc.kill()
            proc.wait()


def test_device_time_by_cause_adds_up_to_the_nodes_devices_wall_time_and_is_priced() -> None:
    now = [100.0]
    metrics = AgentMetrics("job-7", "n1", clock=lambda: now[0], devices=2, device_hour_price=3.0)
    metrics.launched()
    now[0] = 110.0  # 10 s to the first step: start-up
    for step in range(1, 11):
        metrics.stepped(step, 0.4, interval_s=0.5)  # first-time steps, 0.5 s each
    metrics.phases_taken([{"ckpt_staging": 0.2, "comm_wait": 0.3}, {"ckpt_staging": 0.2}], straggling=False)
    metrics.phases_taken([{"comm_wait": 0.5}, {"comm_wait": 0.25}], straggling=True)  # waiting for a straggler
    for step in (7, 8, 9):  # back to step 6, done again
        metrics.stepped(step, 0.4, interval_s=0.5)
    now[0] = 120.0
    seconds = metrics.device_seconds()
    assert list(seconds) == list(CAUSES)
    assert seconds["recomputation"] == pytest.approx(2 * 0.5 * 2)  # 7 -> 8 -> 9: the first is not counted
    assert seconds["checkpoint_stalls"] == pytest.approx(0.4) and seconds["stragglers"] == pytest.approx(0.75)
    assert seconds["productive"] == pytest.approx(9 * 0.5 * 2 - 0.4 - 0.75)  # steps 2..10: the first warms up
    assert seconds["startup"] == pytest.approx(10.0 * 2) and seconds["idle"] == 0.0  # launch to the first step
    assert seconds["recovery"] == pytest.approx(20.0 * 2 - 20.0 - 2.0 - 0.4 - 0.75 - 7.85)
    assert sum(seconds.values()) == pytest.approx(20.0 * 2)
    metrics.tick()
    port = metrics.serve(0)
    try:
        samples = scrape(port)
    finally:
        metrics.close()
    key = frozenset({("job", "job-7"), ("node", "n1"), ("cause", "stragglers")})
    assert samples[("ftrain_device_hours", key)] == pytest.approx(0.75 / 3600)
    assert samples[("ftrain_device_cost", key)] == pytest.approx(0.75 / 3600 * 3.0)
