"""``ftrain status`` against a real etcd: job_status reads a job's keys as agents write them.

The keys are written directly (no agents run), on a lease where agents put them on theirs.
"""

from __future__ import annotations

import json
import time

import pytest

from ftrain.agents.etcd import EtcdClient
from ftrain.agents.job_keys import JobKeys
from ftrain.agents.records import (
    FAILED,
    NODE_LOST,
    WORKER_EXIT,
    FinalStatus,
    Member,
    NodeRecord,
    NodeStatus,
    RoundRecord,
)
from ftrain.agents.status import job_status, status_main
from ftrain.testbed.etcd import EtcdServer

pytestmark = pytest.mark.timeout(60)

JOB = "status-job"
KEYS = JobKeys(JOB)


def write_job(client: EtcdClient) -> int:
    """Round 3 of nodes a and b; b's agent is gone (its leased keys with it), c waits to join.
    Returns the lease of the live agents."""
    lease = client.grant(60).id
    a = NodeRecord("a", "uid-a", "host-a", 111, 2, time.time())
    c = NodeRecord("c", "uid-c", "host-c", 333, 2, time.time())
    client.put(KEYS.node("a"), a.to_json(), lease=lease)
    client.put(KEYS.leader, "a", lease=lease)
    record = RoundRecord(
        3,
        [a.member(), Member("b", "uid-b")],
        2,
        NODE_LOST,
        time.time(),
        restarts_by_cause={WORKER_EXIT: 1, NODE_LOST: 1},
    )
    client.put(KEYS.round, "3")
    client.put(KEYS.round_record(3), record.to_json())
    client.put(
        KEYS.status("a"),
        NodeStatus(
            round=3,
            state="running",
            step=42,
            heartbeat_age_s=0.2,
            committed_step=30,
            restarts=2,
            host="host-a",
            pid=111,
            updated_at=time.time(),
        ).to_json(),
        lease=lease,
    )
    client.put(KEYS.node("c"), c.to_json(), lease=lease)
    client.put(
        KEYS.status("c"),
        NodeStatus(state="waiting", host="host-c", pid=333, updated_at=time.time()).to_json(),
        lease=lease,
    )
    return lease


def test_job_status_of_a_round_with_a_lost_member(client: EtcdClient) -> None:
    write_job(client)
    s = job_status(client, JOB)
    assert s["revision"] == client.current_revision()
    assert {
        k: s[k]
        for k in (
            "job",
            "leader",
            "round",
            "round_reason",
            "world_size",
            "members",
            "restarts",
            "restarts_by_cause",
            "last_committed_step",
            "final",
        )
    } == {
        "job": JOB,
        "leader": "a",
        "round": 3,
        "round_reason": NODE_LOST,
        "world_size": 4,
        "members": ["a", "b"],
        "restarts": 2,
        "restarts_by_cause": {WORKER_EXIT: 1, NODE_LOST: 1},
        "last_committed_step": 30,
        "final": None,
    }
    nodes = {n["node"]: n for n in s["nodes"]}
    assert [n["node"] for n in s["nodes"]] == ["a", "b", "c"]
    pick = ("live", "member", "node_rank", "leader", "host", "agent_pid", "state", "worker_round", "step")
    assert {k: nodes["a"][k] for k in pick} == dict(
        zip(pick, (True, True, 0, True, "host-a", 111, "running", 3, 42), strict=True)
    )
    assert {k: nodes["b"][k] for k in pick} == dict(
        zip(pick, (False, True, 1, False, "", None, "", None, None), strict=True)
    )
    assert {k: nodes["c"][k] for k in pick} == dict(
        zip(pick, (True, False, None, False, "host-c", 333, "waiting", 0, -1), strict=True)
    )
    assert 0 <= nodes["a"]["status_age_s"] < 30
    assert nodes["b"]["status_age_s"] is None


def test_job_status_after_the_agents_are_gone(client: EtcdClient) -> None:
    client.revoke(write_job(client))
    client.put(KEYS.final, FinalStatus(FAILED, "restart budget exhausted", 3, time.time()).to_json())
    s = job_status(client, JOB)
    assert s["leader"] is None
    assert s["final"]["status"] == FAILED and s["final"]["round"] == 3
    assert s["last_committed_step"] is None  # the status keys went with the lease
    assert [(n["node"], n["live"]) for n in s["nodes"]] == [("a", False), ("b", False)]  # the members remain


def test_status_command_prints_the_table_or_json(
    etcd: EtcdServer, client: EtcdClient, capsys: pytest.CaptureFixture[str]
) -> None:
    write_job(client)
    assert status_main([etcd.endpoint], JOB, as_json=False) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0] == "job status-job: running round 3 (node_lost), world size 4"
    assert [line.split()[0] for line in table[3:]] == ["node", "a", "b", "c"]
    assert status_main([etcd.endpoint], JOB, as_json=True) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["members"] == ["a", "b"] and shown["restarts"] == 2


def test_status_of_a_job_nobody_joined_fails(etcd: EtcdServer, capsys: pytest.CaptureFixture[str]) -> None:
    assert status_main([etcd.endpoint], "nobody", as_json=False) == 1
    assert "nothing in etcd" in capsys.readouterr().out


def test_status_command_says_what_the_leader_decided_why_a_node_waits_and_where_the_device_time_went(
    etcd: EtcdServer, client: EtcdClient, capsys: pytest.CaptureFixture[str]
) -> None:
    """The leader's status says a round it needs and cannot form, and why c waits; each agent
    its device time by cause: ``ftrain status`` shows all three (issue 38 items 13, 17, 19)."""
    lease = write_job(client)
    pending = (
        "new round needed for node_lost (agent gone: b); not formed: cannot form a round: 1 of at least 2 nodes live"
    )
    hours = {"productive": 0.01, "recovery": 0.002, "startup": 0.001, "restarts": 0.001}  # an older agent's name too
    client.put(
        KEYS.status("a"),
        NodeStatus(
            round=3,
            state="running",
            host="host-a",
            pid=111,
            updated_at=time.time(),
            round_pending=pending,
            waiting={"c": "joins at the next checkpoint commit after step 30 (agent.scale_up=checkpoint)"},
            devices=2,
            device_hours=hours,
        ).to_json(),
        lease=lease,
    )
    assert status_main([etcd.endpoint], JOB, as_json=False) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith("job status-job: round 3 (node_lost), world size 4, is to be replaced")
    assert f"ROUND PENDING (leader a): {pending}" in lines
    assert "WAITING c: joins at the next checkpoint commit after step 30 (agent.scale_up=checkpoint)" in lines
    [device] = [line for line in lines if line.startswith("device time:")]
    assert device.startswith("device time: 0.0140 device-hours on 2 device(s), goodput 71.4%; lost 0.0040")
    assert "recovery 0.0030" in device and "restarts" not in device
    assert status_main([etcd.endpoint], JOB, as_json=True) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["round_pending"] == pending and shown["accounting"]["goodput"] == pytest.approx(0.7143, abs=1e-4)
