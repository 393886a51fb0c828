"""examples/own_loop/train.py, a plain PyTorch loop (a Hugging Face Llama under FSDP2) with
ftrain.Session, run as a user runs it: ``torchrun --standalone`` with its defaults, from a
directory of its own. Run straight, and stopped then run again, it ends with the same weights
bit for bit; run again with more steps on another number of processes, it goes on from its
newest step. Under two ``ftrain agent --script`` nodes (restart recovery) a SIGKILLed worker
is restarted with its peer, they resume from the newest commit, and the run ends bitwise equal
to the straight one. Under two ``--recovery live`` agents, a SIGKILLed worker and then a lost node
cost the surviving process nothing but a new round: it keeps its PID and serves every round, the
new processes take the state from it (ddp: a live peer; under FSDP, from the shards the ranks and
their buddies keep in memory, without reading storage: a drain here, a worker kill and a node loss
in tests/integration/test_users_loop.py), and the run still ends bitwise equal to the straight one."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ftrain.contract import exits
from ftrain.observability.run_report import build, collect
from ftrain.testbed.jobs import max_abs_diff, run, worker_env
from ftrain.testbed.procs import REPO, kill_tree
from ftrain.testbed.wait import wait_for
from tests.script_agents import (
    assert_agents_exit,
    assert_ends_as,
    committed_steps,
    events,
    rounds_formed,
    script_workers,
    served_by,
    snapshots_complete,
    start_agent,
    stop_agents,
    torchrun_script,
)

pytestmark = pytest.mark.timeout(400)

EXAMPLE = REPO / "examples" / "own_loop" / "train.py"


def _torchrun(cwd: Path, nproc: int, *args: str) -> str:
    return torchrun_script(EXAMPLE, cwd, nproc, *args)


def _committed(cwd: Path) -> list[int]:
    return committed_steps(cwd / "runs/own_loop/ckpt")


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> tuple[Path, str]:
    """The example with its defaults (60 steps, a save every 20) on 2 processes: its directory and output."""
    where = tmp_path_factory.mktemp("straight")
    return where, _torchrun(where, 2, "--final-weights", "final.pt")


def test_the_example_resumes_where_it_stopped_bitwise_and_at_another_world_size(tmp_path, straight):
    straight, out = straight
    stopped = tmp_path / "stopped"
    stopped.mkdir()
    assert "training steps 1..60 on 2 process(es)" in out and "step 60 loss" in out, out
    assert _committed(straight) == [20, 40, 60]
    losses = [float(x) for x in re.findall(r"step \d+ loss ([0-9.]+)", out)]
    assert losses[-1] < losses[0] / 4, losses  # it learns the counting pattern

    _torchrun(stopped, 2, "--steps", "30")
    assert _committed(stopped) == [20, 30]
    out = _torchrun(stopped, 2, "--final-weights", "final.pt")
    assert "resumed after step 30; training steps 31..60" in out, out
    said = [line for line in out.splitlines() if line.startswith("ftrain: ")]  # the session's own lines, rank 0's
    assert said[0].startswith("ftrain: resumed after step 30, loaded from") and len(said) == 3, said  # + 40, 60
    a, b = (torch.load(d / "final.pt", weights_only=True) for d in (straight, stopped))
    assert max_abs_diff(a, b) == 0.0

    out = _torchrun(stopped, 1, "--steps", "70")  # one process now: DCP reshards the FSDP state
    assert "resumed after step 60; training steps 61..70 on 1 process(es)" in out and "step 70 loss" in out, out
    assert _committed(stopped)[-1] == 70


def _agent(tmp_path: Path, etcd, node: str, *options: str, script_args: tuple[str, ...] = ()) -> subprocess.Popen:
    return start_agent(tmp_path, etcd.endpoint, node, EXAMPLE, *options, script_args=script_args)


def test_under_two_agents_a_killed_worker_is_restarted_and_the_run_ends_as_the_straight_one(tmp_path, etcd, straight):
    agents = {n: _agent(tmp_path, etcd, n) for n in ("a", "b")}
    try:
        wait_for(lambda: 20 in _committed(tmp_path), 180, "step 20's commit")
        victims = script_workers(agents["b"], EXAMPLE)
        assert len(victims) == 1, victims
        os.kill(victims[0], signal.SIGKILL)
        assert_agents_exit(tmp_path, agents)
        assert rounds_formed(tmp_path) == ["start", "worker_exit"]
        assert [e["status"] for e in events(tmp_path) if e["event"] == "job_final"] == ["succeeded"]
        assert _committed(tmp_path)[-1] == 60
        manifest = json.loads(next((tmp_path / "runs/own_loop/ckpt").glob("step-000000060/manifest.json")).read_text())
        assert manifest["job"] == "own" and manifest["round"] == 2  # written through the agent's fence, round 2
        assert_ends_as(tmp_path, straight[0] / "final.pt")
    finally:
        stop_agents(agents)


def test_under_two_live_agents_the_survivor_keeps_its_process_through_a_worker_kill_and_a_node_loss(tmp_path, etcd):
    """DDP: the new processes take the state from the survivor (a live peer). The same under FSDP
    from the memory tier: tests/integration/test_users_loop.py, with a loop of another shape."""
    (tmp_path / "golden").mkdir()
    _torchrun(tmp_path / "golden", 2, "--parallel", "ddp", "--final-weights", "final.pt")
    golden = tmp_path / "golden" / "final.pt"
    live = ("--recovery", "live")
    script_args = ("--parallel", "ddp", "--save-every", "20", "--metrics", str(tmp_path / "lines" / "metrics.jsonl"))
    agents = {n: _agent(tmp_path, etcd, n, *live, script_args=script_args) for n in ("a", "b")}
    try:
        wait_for(lambda: 20 in _committed(tmp_path), 180, "step 20's commit")
        (_, [victim]), *_ = served_by(tmp_path, "b")[-1:]
        os.kill(victim, signal.SIGKILL)  # a worker: node b's agent hands its rank to a spare
        wait_for(lambda: len(rounds_formed(tmp_path)) >= 2, 60, "the round after the worker's death")
        wait_for(lambda: max(_committed(tmp_path)) >= 40, 180, "a commit after that round")
        kill_tree(agents.pop("b"))  # node b is lost (its agent and every process under it)
        # --nnodes 2:2: node a's process leaves the round and waits until a replacement host joins
        agents["c"] = _agent(tmp_path, etcd, "c", *live, script_args=script_args)
        assert_agents_exit(tmp_path, agents)
        reasons = rounds_formed(tmp_path)
        assert reasons[:2] == ["start", "worker_exit"] and len(reasons) >= 3, reasons
        served = served_by(tmp_path, "a")
        assert len(served) >= 3 and len({pid for _, (pid,) in served}) == 1, served  # one process, every round
        worker_logs = "".join(p.read_text() for p in tmp_path.glob("*/workers.log"))
        assert worker_logs.count("from live_peer") >= 2, worker_logs[-4000:]  # both recoveries
        assert "from storage" not in worker_logs, worker_logs[-4000:]  # no step was read back from storage
        assert "Traceback" not in worker_logs, worker_logs[-4000:]
        # the session tells the job's event log what ftrain train's rounds tell it
        logged = events(tmp_path)
        healed = [e for e in logged if e["event"] == "live_restored" and e["round"] > 1]
        assert {e["source"] for e in healed} <= {"live_peer", "memory"}, healed  # never storage
        new = [e for e in healed if e["held_step"] < 0]  # each new process got it from the one that kept it
        assert len(new) >= 2 and all(e["source"] == "live_peer" and e["from_rank"] != e["rank"] for e in new), healed
        assert [e for e in logged if e["event"] == "live_round_left" and e["step"] >= 20]
        assert not [e for e in logged if e["event"] == "ckpt_loaded"], "a step was read back from storage"
        # and ftrain report says it: each fault's round healed from memory, no step trained twice
        report = build(*collect(tmp_path)[:2])
        # rank 0's lines: each step once at least, but the one a killed rank 0 did not get to write
        assert len(set(range(1, 61)) - {s["step"] for s in report["steps"]}) <= 2, report["steps"]
        assert all(s["loss"] is not None and s["loss"] > 0 for s in report["steps"]), report["steps"]
        # the step boundary's agreement brought every rank's times: the heatmap has a row per rank
        timed = [s for s in report["steps"] if s["rank_busy_s"]]
        assert len(timed) >= 50 and all(len(s["rank_busy_s"]) == s["world_size"] for s in timed), report["steps"]
        assert all(sum(s["rank_busy_s"][r] for s in timed) > 0 for r in (0, 1)), timed  # each rank's row
        assert len(report["heals"]) >= 2 and report["heals"][0]["round"] == 2, report["heals"]
        assert all(set(h["sources"]) <= {"live_peer", "memory"} for h in report["heals"]), report["heals"]
        assert all(h["steps_redone"] == 0 and h["seconds"] > 0 for h in report["heals"]), report["heals"]
        said_committed = {e["step"] for e in logged if e["event"] == "ckpt_committed"}
        assert 60 in said_committed and said_committed <= set(_committed(tmp_path)), said_committed
        assert _committed(tmp_path)[-1] == 60
        ckpt = str(tmp_path / "runs/own_loop/ckpt")
        # every commit kept verifies (each file re-hashed): one run goes through every committed step
        verified = run([sys.executable, "-m", "ftrain", "ckpt", "verify", ckpt], timeout_s=120, env=worker_env())
        assert verified.returncode == 0, verified.stdout[-2000:]
        for step in _committed(tmp_path):
            assert re.search(rf"^step-{step:09d}: OK \(", verified.stdout, re.M), verified.stdout[-2000:]
        assert_ends_as(tmp_path, golden)
    finally:
        stop_agents(agents)


def test_under_two_live_agents_every_worker_lost_at_once_heals_from_the_memory_dir(tmp_path, etcd, straight):
    """``Session(memory_dir=...)``: every worker of the job SIGKILLed at once (the agents live),
    so that no process holds a snapshot: the spares that replace them restore from the
    snapshots their nodes kept on disk (not from storage), the job ends bitwise equal to the
    straight run, and the finished job leaves nothing in the directory."""
    shm = tmp_path / "shm"
    script_args = ("--parallel", "fsdp", "--save-every", "20", "--memory-dir", str(shm))
    agents = {n: _agent(tmp_path, etcd, n, "--recovery", "live", script_args=script_args) for n in ("a", "b")}
    try:
        wait_for(lambda: 20 in _committed(tmp_path), 180, "step 20's commit")
        wait_for(lambda: snapshots_complete(tmp_path, 20), 60, "a snapshot of step 20 or later on both ranks")
        victims = [pid for node in ("a", "b") for _, pids in served_by(tmp_path, node)[-1:] for pid in pids]
        assert len(victims) == 2, victims
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        assert_agents_exit(tmp_path, agents)
        worker_logs = "".join(p.read_text() for p in tmp_path.glob("*/workers.log"))
        assert worker_logs.count("from memory_tier") >= 2, worker_logs[-4000:]  # both new processes
        assert "from storage" not in worker_logs, worker_logs[-4000:]
        assert "Traceback" not in worker_logs, worker_logs[-4000:]
        assert_ends_as(tmp_path, straight[0] / "final.pt")
        assert not list(shm.rglob("step-*")), "the finished job left snapshots in memory_dir"
    finally:
        stop_agents(agents)


def test_under_fsdp_a_drained_nodes_replacement_heals_from_the_memory_tier(tmp_path, etcd, straight):
    """A drain under FSDP (nnodes 2:2): node b's process takes a memory-tier snapshot of the step
    it stops at (its shards' copies go to node a's process) besides saving it, so node c's new
    process takes b's shards from a's memory at that step, not from storage (which would hold a
    newer step than the tier and be read instead); the run ends bitwise equal to the straight one."""
    live = ("--recovery", "live")
    script_args = ("--parallel", "fsdp", "--save-every", "20")
    agents = {n: _agent(tmp_path, etcd, n, *live, script_args=script_args) for n in ("a", "b")}
    try:
        wait_for(lambda: 20 in _committed(tmp_path), 180, "step 20's commit")
        agents["b"].send_signal(signal.SIGTERM)
        assert agents["b"].wait(timeout=120) == exits.DRAINED, (tmp_path / "agent-b.log").read_text()[-3000:]
        agents["c"] = _agent(tmp_path, etcd, "c", *live, script_args=script_args)
        for node in ("a", "c"):
            assert agents[node].wait(timeout=240) == 0, (tmp_path / f"agent-{node}.log").read_text()[-3000:]
        drained = (tmp_path / "b" / "workers.log").read_text()
        [(stopped, committed)] = re.findall(
            r"stopped after step (\d+): asked to \(SIGTERM\); committed step: (\d+)", drained
        )
        assert stopped == committed, drained[-3000:]
        joined = (tmp_path / "c" / "workers.log").read_text()
        assert re.search(rf"state of step {stopped} from memory_tier", joined), joined[-3000:]
        worker_logs = "".join(p.read_text() for p in tmp_path.glob("*/workers.log"))
        assert "from storage" not in worker_logs and "Traceback" not in worker_logs, worker_logs[-4000:]
        assert len({pid for _, (pid,) in served_by(tmp_path, "a")}) == 1  # a's one process served every round
        assert_ends_as(tmp_path, straight[0] / "final.pt")
    finally:
        stop_agents(agents)


def test_a_drained_node_stops_at_a_committed_step_and_the_other_goes_on_in_the_same_process(tmp_path, etcd):
    """SIGTERM to node b's agent (a drain) under live recovery: b's process saves, commits and
    exits 0 at a step boundary; node a's process leaves that round with its state and finishes
    the job alone, in the same process (nnodes 1:2)."""
    script_args = ("--parallel", "ddp", "--save-every", "10", "--steps", "60")
    agents = {
        n: _agent(tmp_path, etcd, n, "--recovery", "live", "--nnodes", "1:2", script_args=script_args) for n in "ab"
    }
    try:
        wait_for(lambda: 10 in _committed(tmp_path), 180, "step 10's commit")
        agents["b"].send_signal(signal.SIGTERM)
        assert_agents_exit(tmp_path, agents, {"a": exits.OK, "b": exits.DRAINED})  # b drained (75), a finished (0)
        drained = (tmp_path / "b" / "workers.log").read_text()
        stopped = re.findall(r"stopped after step (\d+): asked to \(SIGTERM\); committed step: (\d+)", drained)
        assert len(stopped) == 1 and stopped[0][0] == stopped[0][1], drained[-3000:]  # its last step, committed
        assert "Traceback" not in drained, drained[-3000:]
        served = served_by(tmp_path, "a")
        assert len(served) >= 2 and len({pid for _, (pid,) in served}) == 1, served
        assert re.search(
            r"rank 0 of 1 \(pid \d+\): state of step \d+ from memory", (tmp_path / "a" / "workers.log").read_text()
        )
        assert _committed(tmp_path)[-1] == 60
    finally:
        stop_agents(agents)
