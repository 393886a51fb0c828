"""A deterministic failure at start under ``--recovery live`` stops the job with its message
(issue 38 item 14), as it does in train() and under restart recovery.

Before: a ``with ftrain.Session(...)`` script under ``--script --recovery live`` raised at its
start, before it had a round to tell its agent in; the agent replaced the process, formed round
after round with no error to compare, and backed off until killed. Now the session tells the
agent (fatal: a restart cannot help), and a worker process that dies at start without a word
is described by its log's last error line, counted as a start-up failure (no spare is started
ahead of need after ``deterministic_failures`` of them in a row) and judged deterministic like
any other failure.

Real worker processes (a two-line script, no torch), a real heartbeat socket; the agent on the
in-memory store and a fake clock that moves one tick per look (waits have real deadlines).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import pytest

from ftrain.agents.agent import TICK_S, Agent
from ftrain.agents.agent_options import AgentOptions
from ftrain.agents.heartbeat import HeartbeatServer
from ftrain.agents.job_keys import JobKeys
from ftrain.agents.live_workers import LiveWorkers
from ftrain.agents.metrics import AgentMetrics
from ftrain.agents.records import FAILED, FATAL, RANK_LEFT, SUCCEEDED, WORKER_EXIT, JobState
from ftrain.agents.status import format_status, status_of
from ftrain.agents.supervision import last_error_line, left_round_grace_s
from ftrain.agents.workers import Launch, Workers
from ftrain.chaos.cluster import FAST_AGENT_SETTINGS
from ftrain.contract.control import Assignment, ControlFile
from ftrain.contract.events import EventLog, read_jsonl
from ftrain.contract.worker_env import WorkerEnv
from ftrain.testbed.wait import wait_for
from tests.memory_jobstore import FakeClock, MemoryJobStore
from tests.unit.test_agent_unit import Job, start_round_1

JOB = "job"
KEYS = JobKeys(JOB)
BOOM = "RuntimeError: boom at start (this script fails the same way every time)"


def _failing_script(tmp_path: Path) -> Path:
    script = tmp_path / "train.py"
    script.write_text(f'raise RuntimeError("{BOOM.removeprefix("RuntimeError: ")}")\n')
    return script


def test_last_error_line_is_a_tracebacks_last_line_never_a_log_line_or_torchruns_report(tmp_path: Path) -> None:
    log = tmp_path / "workers.log"
    log.write_text(
        "Traceback (most recent call last):\n"
        '  File "train.py", line 1, in <module>\n'
        "    raise ValueError('first')\n"
        "ValueError: first\n"
        "2026-01-01 00:00:00,000 ERROR ftrain.x: RuntimeError: a log line, not a traceback\n"
        "Traceback (most recent call last):\n"
        "ftrain.session_state.SessionError: put the loop in a function\n"
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
        "    | nested: OSError: indented, not the last line\n"
    )
    assert last_error_line(str(log)) == "ftrain.session_state.SessionError: put the loop in a function"
    assert last_error_line(str(tmp_path / "absent.log")) == ""


def test_processes_that_fail_before_they_are_ready_are_counted_and_no_spare_replaces_them(tmp_path: Path) -> None:
    pool = LiveWorkers(
        {**os.environ},
        str(tmp_path / "workers.log"),
        worker_args=(),
        standby=2,
        spares=1,
        script=str(_failing_script(tmp_path)),
        startup_failure_limit=3,
    )
    try:
        wait_for(lambda: (pool.refill(1), pool.failing_at_start())[1], 60, "three start-up failures in a row")
        assert pool.startup_failures >= 3 and pool.startup_exit_code == 1
        wait_for(lambda: not pool.spare_pids(), 30, "the last spares gone")
        pool.refill(1)
        assert pool.spare_pids() == [], "no spare is started ahead of need any more"
        assert last_error_line(pool.log_path) == BOOM
    finally:
        pool.kill()


class _Tick:
    """The agent, ticked once per look by :func:`wait_for`: the fake clock moves one tick each."""

    def __init__(self, agent: Agent, clock: FakeClock, store: MemoryJobStore):
        self.agent, self.clock, self.store = agent, clock, store

    def state(self) -> JobState:
        listing = self.store.list_prefix(KEYS.prefix)
        return JobState.parse(KEYS, listing.kvs, listing.revision)

    def __call__(self) -> JobState:
        if self.agent.exit_code is None:
            self.agent.tick()
        self.clock.advance(TICK_S)
        self.store.expire_leases()
        return self.state()


def _no_torchrun(launch: Launch, env: dict[str, str], log_path: str) -> Workers:
    raise AssertionError("live recovery starts no torchrun")


def _live_agent(tmp_path: Path, script: Path) -> tuple[Agent, _Tick]:
    """One agent (``--nnodes 1:1``, one worker, one spare) under live recovery, running ``script``."""
    clock = FakeClock(monotonic_s=time.monotonic())  # the live workers' start times are on the real one
    store = MemoryJobStore(clock)
    opts = AgentOptions.of(
        etcd=["http://etcd.invalid:2379"],
        job=JOB,
        node_id="a",
        worker_args=[],
        script=str(script),
        **{**FAST_AGENT_SETTINGS, "recovery": "live", "nnodes": "1:1", "nproc_per_node": 1, "spares": 1},
    )
    agent = Agent(
        opts,
        store=store,
        clock=clock,
        heartbeats=HeartbeatServer(str(tmp_path / "hb.sock")),
        metrics=AgentMetrics(JOB, "a", clock=clock.monotonic),
        events=EventLog(str(tmp_path / "events.jsonl"), rank=-1),
        launcher=_no_torchrun,
        run_dir=str(tmp_path),
        standby=lambda env, log_path: LiveWorkers(
            env, log_path, worker_args=(), standby=2, spares=1, script=str(script), startup_failure_limit=3
        ),
    )
    return agent, _Tick(agent, clock, store)


@pytest.mark.timeout(120)
def test_a_live_worker_that_fails_at_start_without_a_word_stops_the_job_as_deterministic_with_its_error(
    tmp_path: Path,
) -> None:
    agent, tick = _live_agent(tmp_path, _failing_script(tmp_path))
    clock, events = tick.clock, tmp_path / "events.jsonl"
    try:
        agent.start()
        seen_error: list[str] = []

        def done() -> JobState | None:
            state = tick()
            status = state.status.get("a")
            if status is not None and status.workers_error:
                seen_error.append(status.workers_error)
            return state if state.final is not None else None

        state = wait_for(done, 90, "the job's end", poll_s=0.01)
    finally:
        agent.close()
    final = state.final
    assert final is not None and final.status == FAILED
    assert final.reason.startswith("deterministic failure: the workers failed 3 times in a row at step -1"), final
    assert BOOM in final.reason
    reports = [r for g in sorted(state.reports) for r in state.reports[g].values()]
    assert reports and all(r.reason == WORKER_EXIT and r.error == BOOM for r in reports)
    assert seen_error and BOOM in seen_error[0] and "before they were ready" in seen_error[0]
    [failing] = [e for e in read_jsonl(events) if e["event"] == "workers_failing"]
    assert failing["error"] == BOOM and failing["exit_code"] == 1
    shown = format_status(status_of(state, JOB, now=clock.time()))
    assert shown.startswith("job job: FAILED (deterministic failure") and BOOM in shown
    # its device time counts from the first round its live workers served (before: never, under
    # live recovery: 0 device-hours whatever happened); no step was ever done: all of it start-up
    hours = state.status["a"].device_hours
    assert hours["startup"] > 0 and sum(hours.values()) == pytest.approx(hours["startup"], abs=1e-6)


@pytest.mark.timeout(120)
def test_under_live_recovery_the_agent_names_its_worker_processes_not_torchrun(tmp_path: Path, caplog) -> None:
    script = tmp_path / "train.py"
    script.write_text("")  # its processes exit 0 at once: the round's workers stopped early
    agent, tick = _live_agent(tmp_path, script)
    caplog.set_level(logging.INFO, logger="ftrain.agents.agent")
    try:
        agent.start()
        wait_for(lambda: tick() and "workers exited" in caplog.text, 60, "the round's workers exited")
    finally:
        agent.close()
    [line] = [r.getMessage() for r in caplog.records if "workers exited" in r.getMessage()][:1]
    assert line == "round 1: workers exited (worker processes' exit 0): yielded", line
    assert "torchrun" not in caplog.text


def test_a_session_started_under_live_recovery_tells_its_agent_why_before_it_raises(
    tmp_path: Path, monkeypatch
) -> None:
    """``with ftrain.Session(...)`` in a live worker: the session waits for the round the agent
    gives it, says there that it fails and that a restart cannot help (fatal), then raises."""
    from ftrain.session import Session, SessionError

    server = HeartbeatServer(str(tmp_path / "hb.sock"))
    try:
        server.reset(3)
        control = ControlFile(str(tmp_path / "control.json"))
        control.write(
            Assignment(
                round=3,
                rank=1,
                world_size=2,
                local_rank=0,
                local_world_size=1,
                node_rank=1,
                nnodes=2,
                master_addr="127.0.0.1",
                master_port=29500,
            )
        )
        for name, value in WorkerEnv(job=JOB, heartbeat=server.path, control=control.path).to_env().items():
            monkeypatch.setenv(name, value)
        with pytest.raises(SessionError, match=r"session\.run\(train\)"):
            Session(str(tmp_path / "ckpt")).start()
        beat = wait_for(lambda: server.beats().get(0), 10, "the exit message")
    finally:
        server.close()
    assert beat.finished is False and beat.fatal and beat.step == -1 and beat.rank == 1
    assert beat.error.startswith("SessionError: this process was started by `ftrain agent --recovery live`")
    assert FATAL  # the agent's report of it is fatal (supervision.exit_report): the leader ends the job at once


def test_under_restart_recovery_workers_that_die_before_saying_why_are_described_by_their_logs_error(
    tmp_path: Path,
) -> None:
    """torchrun exits 1 and no worker sent an exit message (it failed importing the training
    code): the report carries the log's last error line, so the same failure round after round
    is told as deterministic; a signal death (negative exit code) is not read from the log."""
    job = Job(tmp_path)
    try:
        start_round_1(job, "a", nnodes="1:1")
        workers = job.nodes["a"].workers
        Path(workers.log_path).write_text(
            "Traceback (most recent call last):\nModuleNotFoundError: No module named 'x'\n"
        )
        workers.rc = 1
        job.run_until(lambda: "a" in job.state().reports.get(1, {}), "a's report of round 1")
        report = job.state().reports[1]["a"]
        assert report.error == "ModuleNotFoundError: No module named 'x'"
        assert "its log says: ModuleNotFoundError" in report.detail
        job.run_until(lambda: job.running(2, "a"), "round 2")
        killed = job.nodes["a"].workers
        Path(killed.log_path).write_text("ValueError: not this one\n")
        killed.rc = -9
        job.run_until(lambda: "a" in job.state().reports.get(2, {}), "a's report of round 2")
        assert job.state().reports[2]["a"].error == ""
    finally:
        job.close()


@pytest.mark.timeout(120)
def test_a_live_worker_killed_by_a_signal_is_reported_at_the_first_look_without_a_grace(tmp_path: Path) -> None:
    """A SIGKILLed worker (the most common fault) sends no exit message: the agent reports its
    death at the first tick that sees it, instead of waiting CRASH_GRACE_S (0.3 s) for a
    message that cannot come, which every worker kill paid in time to the next step."""
    script = tmp_path / "train.py"
    script.write_text(
        "import os, signal, time\n"
        "path = os.environ['FTRAIN_CONTROL']\n"
        "while not os.path.exists(path):\n"
        "    time.sleep(0.01)\n"
        "os.kill(os.getpid(), signal.SIGKILL)  # killed once it serves a round\n"
    )
    agent, tick = _live_agent(tmp_path, script)
    try:
        agent.start()
        wait_for(lambda: tick() and agent.workers is not None and agent.workers.round == 1, 60, "round 1")
        workers = agent.workers
        assert isinstance(workers, LiveWorkers)
        [proc] = workers._assigned.values()
        proc.popen.wait(timeout=60)  # dead now, and not looked at by the agent yet
        looks = 0
        while not any(e["event"] == "workers_exited" for e in read_jsonl(tmp_path / "events.jsonl")):
            tick()
            looks += 1
            assert looks < 20, "the death was never reported"
    finally:
        agent.close()
    assert looks == 1, f"reported after {looks} ticks of {TICK_S} s"


_LEAVES_ROUND_1 = """
import os
import torch.distributed as dist
from ftrain.agent_link import heartbeat
from ftrain.contract.control import ControlFile
from ftrain.contract.worker_env import WorkerEnv
from ftrain.recovery.rounds import RoundOver, said_left, serve_rounds

class Owner:
    def __init__(self, hb):
        self.hb, self.assignment = hb, None
    def enter(self, assignment):
        self.assignment = assignment
        with open(os.path.join(os.path.dirname(__file__), "rounds.txt"), "a") as f:
            f.write(f"{assignment.round} {os.getpid()}\\n")
        return 7
    def step_time_s(self):
        return 0.0
    def serve(self, assignment):
        if assignment.round == 1:  # what rank 0 meets when the round's port was taken since it was picked
            raise dist.DistNetworkError("The server socket has failed to listen on any local network address. "
                                        "port: 29500, useIpv6: false, code: -98, name: EADDRINUSE")
        self.hb.exit(8, finished=True, committed_step=8)
        return RoundOver(done=True)
    def finish(self, over):
        return None
    def failed(self, error):
        pass
    def stopped(self, why):
        pass
    def leave(self, why):
        said_left(self.assignment, why, 7, self.hb)

hb = heartbeat.from_env(-1, 0)
serve_rounds(Owner(hb), ControlFile(WorkerEnv.from_env().control), hb, set(), 30.0, lambda: False)
"""


@pytest.mark.timeout(120)
def test_a_rank_that_left_its_round_on_its_own_gets_a_new_round_after_the_grace_not_the_start_timeout(
    tmp_path: Path,
) -> None:
    """A live worker leaves round 1 on an error of the round's communication that no member's
    failure, loss or drain explains (here: rank 0 cannot host the round's store, EADDRINUSE, as
    when its port is taken between the agent's pick and the bind), and waits for the next round.
    Before, nobody formed one: its peers waited for it and the job stood still for the start
    timeout (300 s by default; a CI run's 240 s wait ran out on it). Now its agent reports the
    round over after the grace (2 lease lifetimes + settle + 5 s) and the same process, holding
    its state, serves round 2."""
    rounds_file = tmp_path / "rounds.txt"
    script = tmp_path / "train.py"
    script.write_text(_LEAVES_ROUND_1)
    agent, tick = _live_agent(tmp_path, script)
    clock = tick.clock
    try:
        agent.start()
        # ticks at the pace of real time: the worker's "alive" datagrams are stamped on the real clock
        state = wait_for(lambda: (s := tick()).final is not None and s, 90, "the job's end", poll_s=TICK_S)
    finally:
        agent.close()
    assert state.final is not None and state.final.status == SUCCEEDED, state.final
    second = state.rounds[2]
    assert second.reason == RANK_LEFT, second
    [report] = state.reports[1].values()
    assert report.outcome == FAILED and report.reason == RANK_LEFT and "local rank(s) [0] left" in report.detail
    served = [line.split() for line in rounds_file.read_text().splitlines()]
    assert [r for r, _ in served] == ["1", "2"] and len({pid for _, pid in served}) == 1, served  # one process
    grace_s = left_round_grace_s(FAST_AGENT_SETTINGS["lease_ttl_s"], FAST_AGENT_SETTINGS["settle_s"])
    waited_s = second.created_at - state.rounds[1].created_at
    assert grace_s < waited_s < FAST_AGENT_SETTINGS["start_timeout_s"], (waited_s, clock.time())
