"""The agent -> live worker control file (contract/control.py): every field checked, a file
replaced whole, a worker acting only on what is newer."""

from __future__ import annotations

import json

import pytest

from ftrain.contract.control import Assignment, ControlFile
from ftrain.recovery.peer_state import HeldState
from ftrain.recovery.round_control import (
    AssignmentTimeout,
    RoundEnded,
    newer_round_assigned,
    wait_for_assignment,
    wait_for_store,
)
from ftrain.session_live import SessionRounds
from ftrain.testbed.etcd import free_ports

GOOD = dict(
    round=3,
    rank=5,
    world_size=8,
    local_rank=1,
    local_world_size=4,
    node_rank=1,
    nnodes=2,
    master_addr="10.0.0.1",
    master_port=29500,
)


def test_an_assignment_round_trips_and_sets_torchruns_environment():
    a = Assignment(**GOOD)
    assert Assignment.decode(a.encode()) == a
    env = a.env()
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["MASTER_PORT"], env["FTRAIN_ROUND"]) == (
        "5",
        "8",
        "1",
        "29500",
        "3",
    )


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"rank": 8}, "rank"),
        ({"rank": True}, "rank"),
        ({"world_size": "8"}, "world_size"),
        ({"local_rank": 4}, "local_rank"),
        ({"node_rank": 2}, "node_rank"),
        ({"master_port": 0}, "master_port"),
        ({"master_addr": "host; rm -rf /"}, "master_addr"),
        ({"round": -1}, "round"),
        ({"stop": "yes"}, "stop"),
        ({"interrupt": 1}, "interrupt"),
        ({"committed_step": -2}, "committed_step"),
        ({"committed_step": 1.5}, "committed_step"),
        ({"extra": 1}, "unknown field"),
    ],
)
def test_a_bad_field_refuses_the_whole_assignment_and_is_named(change, named):
    with pytest.raises(ValueError, match=named):
        Assignment.decode(json.dumps({**GOOD, **change}).encode())


def test_a_missing_field_or_garbage_is_refused():
    with pytest.raises(ValueError, match="missing"):
        Assignment.decode(json.dumps({k: v for k, v in GOOD.items() if k != "rank"}).encode())
    with pytest.raises(ValueError):
        Assignment.decode(b"\x00not json")
    with pytest.raises(ValueError, match="not a JSON object"):
        Assignment.decode(b"[1, 2]")


def test_a_worker_takes_only_a_newer_round_even_one_its_train_loop_saw_first(tmp_path):
    control = ControlFile(str(tmp_path / "w.json"))
    with pytest.raises(AssignmentTimeout):
        wait_for_assignment(control, newer_than=-1, timeout_s=0.05)  # nothing yet
    control.write(Assignment(**GOOD))
    assert wait_for_assignment(control, newer_than=2, timeout_s=1).round == 3
    with pytest.raises(AssignmentTimeout):
        wait_for_assignment(control, newer_than=3, timeout_s=0.05)  # the same round again: not newer
    ended = newer_round_assigned(control, current=3)
    assert not ended()
    control.write(Assignment(**{**GOOD, "round": 4}))
    assert ended() and ended()  # the train loop saw it (and keeps saying so) ...
    assert wait_for_assignment(control, newer_than=3, timeout_s=1).round == 4  # ... and the wait still gets it


def test_a_rank_waiting_for_a_store_nobody_hosts_leaves_when_a_newer_round_is_assigned(tmp_path):
    """Rank 0 of round 3 never hosted its store (it failed, or left the round); its agent moved
    on to round 4. A rank waiting for that store leaves the round (keeping what it holds) as soon
    as it is assigned the newer one, not after the store timeout (the process group's, 600 s
    in a session) nor killed by its round watchdog 10 s later (losing it)."""
    control = ControlFile(str(tmp_path / "w.json"))
    control.write(Assignment(**GOOD))
    [port] = free_ports(1)  # nothing listens there
    wait_for_store("127.0.0.1", port, 0.05, newer_round_assigned(ControlFile(control.path), 3))  # times out
    checks = 0

    def newer() -> bool:
        nonlocal checks
        checks += 1
        if checks == 3:
            control.write(Assignment(**{**GOOD, "round": 4}))
        return ended()

    ended = newer_round_assigned(ControlFile(control.path), 3)
    with pytest.raises(RoundEnded, match=f"127.0.0.1:{port}"):
        wait_for_store("127.0.0.1", port, 60, newer)
    assert checks == 3  # at the first look after the new assignment


def test_a_session_rank_whose_round_ended_before_it_joined_keeps_what_it_held(tmp_path):
    """The round ended while this rank waited for its store (the wait above): the session never
    joined it, so leaving is only saying so; what the rank held before it is kept for the next
    round (before: the session's own leave asserted a joined round, and the process died)."""
    held = HeldState(step=20, committed_step=20, model={}, optim={}, cursor={})
    session_left = []
    rounds = SessionRounds(
        ControlFile(str(tmp_path / "w.json")),
        None,
        serve_round=lambda rnd: None,
        close=lambda **kw: None,
        leave_round=lambda why, ports: session_left.append(why),
        keep_ports=set(),
    )
    rounds.held = held
    assert rounds.enter(Assignment(**GOOD)) == 20
    rounds.leave(RoundEnded("a newer round was assigned while waiting for the round's store"))
    assert rounds.held is held and rounds.round is None and session_left == []
    assert rounds.enter(Assignment(**{**GOOD, "round": 4})) == 20  # the next round starts from it


def test_a_spare_marks_itself_ready(tmp_path):
    control = ControlFile(str(tmp_path / "w.json"))
    assert not control.is_ready()
    control.mark_ready()
    assert control.is_ready()


def test_the_agent_never_writes_through_a_link_planted_in_the_control_directory(tmp_path):
    """The old writer opened ``<file>.<pid>.tmp`` with O_TRUNC, following a link planted under
    that predictable name (and the ready marker under its fixed one) into a victim file."""
    import os

    from ftrain.agents.live_workers import LiveWorkers
    from ftrain.contract.local_files import UnsafeLocalDirError

    victim = tmp_path / "victim"
    victim.write_text("precious")
    control = ControlFile(str(tmp_path / "w.json"))
    os.symlink(victim, f"{control.path}.{os.getpid()}.tmp")
    os.symlink(victim, control.ready_path)
    control.write(Assignment(**GOOD))
    control.mark_ready()
    assert victim.read_text() == "precious"
    assert control.read() == Assignment(**GOOD)
    run_dir = tmp_path / "run"
    (run_dir / "control").mkdir(parents=True)
    os.chmod(run_dir / "control", 0o777)  # others could plant files and links there
    with pytest.raises(UnsafeLocalDirError, match="agent.run_dir"):
        LiveWorkers({}, str(run_dir / "round-0001.log"), worker_args=(), standby=0, spares=0)
