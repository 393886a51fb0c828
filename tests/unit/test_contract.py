"""The worker <-> agent contract: the environment and the heartbeat datagrams round-trip, and what
cannot be used is refused naming the variable or field."""

from __future__ import annotations

import json

import pytest

from ftrain.contract.heartbeat import MAX_ERROR_CHARS, Message
from ftrain.contract.worker_env import AGENT_PID, ROUND, WorkerEnv, WorkerEnvError, worker_environment


def test_worker_env_round_trips_through_the_environment():
    env = WorkerEnv(
        job="j-1",
        round=7,
        node="n0",
        etcd=("http://a:1", "http://b:2"),
        fence_key="/ftrain/jobs/j-1/round",
        heartbeat="/run/hb.sock",
        agent_pid=1234,
        stack_dir="/run/stacks",
        etcd_client_file="/run/c.json",
    )
    exported = env.to_env()
    assert len(exported) == 9 and all(k.startswith("FTRAIN_") for k in exported)
    assert WorkerEnv.from_env(exported) == env


def test_without_an_agent_a_worker_sees_the_defaults():
    assert WorkerEnv.from_env({}) == WorkerEnv()
    assert WorkerEnv().to_env() == {ROUND: "0"}


@pytest.mark.parametrize(
    "name,raw",
    [
        (ROUND, "-1"),
        (ROUND, "1e3"),
        (ROUND, "7 apples"),
        (ROUND, str(2**63)),
        (AGENT_PID, "abc"),
        (AGENT_PID, str(2**40)),
    ],
)
def test_an_unusable_value_names_the_variable(name, raw):
    with pytest.raises(WorkerEnvError) as err:
        WorkerEnv.from_env({name: raw})
    assert err.value.key == name and "set by the ftrain agent" in str(err.value)


def test_secrets_are_not_inherited_by_workers():
    env = worker_environment(
        {"FTRAIN_ETCD_PASSWORD": "pw", "PATH": "/bin"}, {"FTRAIN_ETCD_CLIENT_FILE": "/x"}, WorkerEnv(round=3).to_env()
    )
    assert env == {"PATH": "/bin", ROUND: "3", "OMP_NUM_THREADS": "1"}


def test_messages_round_trip_and_cut_errors():
    msg = Message(
        kind="exit",
        round=2,
        rank=5,
        local_rank=1,
        pid=4242,
        time=1.5,
        phase="exiting",
        step=9,
        finished=False,
        error="x" * 5000,
        fatal=True,
    )
    back = Message.decode(msg.encode())
    assert back == Message(**{**json.loads(msg.encode()), "error": "x" * MAX_ERROR_CHARS})
    assert back.fatal and back.error == "x" * MAX_ERROR_CHARS


@pytest.mark.parametrize(
    "field,value",
    [
        ("pid", 1),
        ("pid", True),
        ("local_rank", 4096),
        ("round", -1),
        ("step", 1.5),
        ("time", float("nan")),
        ("kind", "hello"),
        ("phase", "dreaming"),
        ("fatal", "yes"),
        ("error", 3),
    ],
)
def test_a_bad_field_refuses_the_whole_message(field, value):
    good = json.loads(Message(kind="beat", round=1, rank=0, local_rank=0, pid=100).encode())
    with pytest.raises(ValueError, match=field):
        Message.decode(json.dumps({**good, field: value}).encode())
